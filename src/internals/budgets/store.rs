//! Where the budgets' counters live: the [`BudgetStore`] trait, and [`SqliteStore`], its
//! implementation on an embedded SQLite database (rusqlite with SQLite compiled in) in the
//! state file `[budgets] state_file` names.
//!
//! The file is opened once at startup, in WAL mode with `synchronous = FULL` (a committed
//! write survives a crash of the process and of the machine) and `locking_mode =
//! EXCLUSIVE` (held by this process until the store is closed: one runtime per state file),
//! checked (`quick_check`) and its schema made inside one `BEGIN IMMEDIATE` transaction,
//! so a file that is not a database, a damaged one and one another connection or process
//! holds are each a clear startup error naming the file ([`StoreError`]); the file is never
//! rewritten or reset.
//! After startup the store is owned by the book's writer thread: no turn and no actor
//! thread waits for a disk write.
//!
//! Keys are what the host admitted, never guest text: the speaker's limits key (the chat
//! platform's id, or what a bot passed as `TurnRequest::limits_key`), the channel's sha256
//! hex (as its workspace), and `bot`.
//!
//! **Counts that cannot overflow the store.** A count is at most [`MAX_STORED`]
//! (`i64::MAX`, SQLite's largest INTEGER). The writer adds with saturation in SQL
//! ([`SATURATING_ADD`]): `tokens + excluded.tokens` overflowed to a REAL (9.22e18) on a
//! huge `usage`, and every later start failed on it until the next day. Increments, not
//! totals, are written because a store shared by several processes of one bot (the
//! PostgreSQL store to come) can only add to what the others wrote; the SQL saturates at
//! the top. The loader reads whatever a damaged or foreign writer left through
//! [`clamp_count`], the one rule (the SQL's `CASE` is the same rule, tested to agree): a
//! value is never a reason to fail a start or to reset a counter; a clamped one is told in
//! one warning per load naming the file and the number of rows.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{ErrorCode, OptionalExtension};

/// What a counter counts: a speaker's, a channel's or the bot's tokens, or a speaker's or
/// a channel's egress bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CounterKey {
    /// One speaker's tokens (their platform id, or limits key), across channels.
    Speaker(String),
    /// One channel's tokens (its sha256 hex).
    Channel(String),
    /// The whole bot's tokens.
    Bot,
    /// One speaker's egress bytes (sent and read), across channels.
    SpeakerEgress(String),
    /// One channel's egress bytes.
    ChannelEgress(String),
}

impl CounterKey {
    /// The scope and key columns.
    pub fn columns(&self) -> (&'static str, &str) {
        match self {
            CounterKey::Speaker(id) => ("speaker", id),
            CounterKey::Channel(hash) => ("channel", hash),
            CounterKey::Bot => ("bot", ""),
            CounterKey::SpeakerEgress(id) => ("speaker_egress", id),
            CounterKey::ChannelEgress(hash) => ("channel_egress", hash),
        }
    }

    pub(super) fn from_columns(scope: &str, key: String) -> Option<Self> {
        match scope {
            "speaker" => Some(CounterKey::Speaker(key)),
            "channel" => Some(CounterKey::Channel(key)),
            "bot" => Some(CounterKey::Bot),
            "speaker_egress" => Some(CounterKey::SpeakerEgress(key)),
            "channel_egress" => Some(CounterKey::ChannelEgress(key)),
            _ => None,
        }
    }
}

/// The largest count a store holds: SQLite's largest INTEGER (PostgreSQL's BIGINT too).
pub const MAX_STORED: u64 = i64::MAX as u64;

/// A stored token count as the store found it, before [`clamp_count`]: the value kinds of
/// SQL (a store maps its own types onto these).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StoredCount<'a> {
    /// An integer (what this runtime writes; negative only from another writer).
    Integer(i64),
    /// A floating-point value (an overflowed `tokens + excluded.tokens`, 9.22e18, or another
    /// writer's).
    Real(f64),
    /// Text. In a column of INTEGER affinity SQLite stores numeric text as a number, so text
    /// found there is no number.
    Text(&'a str),
    /// No value.
    Null,
    /// Bytes.
    Blob,
}

/// A count read through [`clamp_count`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadCount {
    /// A clean count (an integer of 0 to [`MAX_STORED`]), as stored.
    Clean(u64),
    /// Anything else, clamped into 0 to [`MAX_STORED`]; the loader warns.
    Clamped(u64),
}

impl ReadCount {
    /// The count the budgets use.
    pub fn count(self) -> u64 {
        match self {
            ReadCount::Clean(n) | ReadCount::Clamped(n) => n,
        }
    }
}

/// The one rule for a stored count, whatever wrote it: an integer of 0 to [`MAX_STORED`] is
/// taken as it is; a negative integer is 0; a REAL is its whole part (truncated toward zero,
/// as SQL's `CAST(x AS INTEGER)`) held within 0 to [`MAX_STORED`] (the overflowed 9.22e18
/// is [`MAX_STORED`]); anything that is no number (TEXT, NULL, a BLOB, a NaN) counts as
/// spent, [`MAX_STORED`]: a count nobody can read refuses its budget for the rest of the
/// day (fail closed) rather than granting a fresh one. The SQLite writer's
/// [`SATURATING_ADD`] applies the same rule to the row it adds to.
pub fn clamp_count(stored: StoredCount<'_>) -> ReadCount {
    match stored {
        StoredCount::Integer(n) => match u64::try_from(n) {
            Ok(n) => ReadCount::Clean(n),
            Err(_) => ReadCount::Clamped(0),
        },
        StoredCount::Real(r) if r.is_nan() => ReadCount::Clamped(MAX_STORED),
        // `as` truncates toward zero and saturates at i64's ends, as SQLite's CAST does.
        StoredCount::Real(r) => ReadCount::Clamped((r as i64).max(0) as u64),
        StoredCount::Text(_) | StoredCount::Null | StoredCount::Blob => {
            ReadCount::Clamped(MAX_STORED)
        }
    }
}

/// The SQLite writer's upsert: a new row takes the delta; an existing row becomes its
/// count read by [`clamp_count`]'s rule, plus the delta, saturating at [`MAX_STORED`]
/// (`MIN(old, MAX - delta) + delta`: no intermediate passes `i64::MAX`, so the row stays an
/// INTEGER). The delta is at most [`MAX_STORED`] (`to_i64`). A damaged row is rewritten
/// clean by its next charge.
pub const SATURATING_ADD: &str =
    "INSERT INTO tokens (day, scope, key, tokens) VALUES (?1, ?2, ?3, ?4)
     ON CONFLICT (day, scope, key) DO UPDATE SET tokens =
         MIN(CASE typeof(tokens)
                 WHEN 'integer' THEN MAX(tokens, 0)
                 WHEN 'real' THEN MAX(CAST(tokens AS INTEGER), 0)
                 ELSE 9223372036854775807 END,
             9223372036854775807 - excluded.tokens) + excluded.tokens";

/// What one load found that was not clean: rows clamped, rows skipped (a key or a time
/// that is not readable), and the rows read. Told in one warning per load
/// ([`LoadReport::warning`]) and shown by `doctor`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// `"counter"` or `"turn"`.
    pub what: &'static str,
    /// Rows read.
    pub rows: usize,
    /// Rows whose value was clamped ([`clamp_count`]).
    pub clamped: usize,
    /// Rows left out: a counter's scope or key that is not text, a turn's speaker that is
    /// not text or its time that is no number.
    pub skipped: usize,
}

impl LoadReport {
    /// Whether every row was clean.
    pub fn is_clean(&self) -> bool {
        self.clamped == 0 && self.skipped == 0
    }

    /// The warning for a load that was not clean, naming the file.
    pub fn warning(&self, path: &Path) -> String {
        let mut parts = Vec::new();
        if self.clamped > 0 {
            parts.push(format!(
                "{} clamped (REAL, TEXT, NULL, BLOB or negative: read as 0 if negative, a REAL as \
                 its whole part up to {MAX_STORED}, anything else as spent, {MAX_STORED})",
                self.clamped
            ));
        }
        if self.skipped > 0 {
            parts.push(format!(
                "{} skipped (a key, speaker or time that is not readable)",
                self.skipped
            ));
        }
        format!(
            "budget state file {}: {} of {} {} row(s) loaded were not clean: {}; the runtime goes on \
             with them so (a counter's next charge rewrites it clean; an unreadable turn is pruned)",
            path.display(),
            self.clamped + self.skipped,
            self.rows,
            self.what,
            parts.join("; ")
        )
    }
}

/// Errors of a budget store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The state file is not a database, or a damaged one; it is left as it is.
    #[error("budget state file {path} is not a usable SQLite database (left as it is; move it aside to start with empty counters): {reason}")]
    Corrupt {
        /// The state file.
        path: PathBuf,
        /// What SQLite said.
        reason: String,
    },
    /// Another connection holds the state file locked.
    #[error("budget state file {path} is locked by another process (one writer at a time; is another bot running on it?): {reason}")]
    Locked {
        /// The state file.
        path: PathBuf,
        /// What SQLite said.
        reason: String,
    },
    /// The state file could not be opened or written.
    #[error("budget state file {path}: {reason}")]
    Open {
        /// The state file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A shared store (`[budgets] store`) could not be opened or used: unreachable, its
    /// schema newer than this build's, its namespace's settings not this process's.
    #[error("budget store {what}: {reason}")]
    Database {
        /// Which store: its kind, namespace and where its URL comes from (never the URL).
        what: String,
        /// What failed.
        reason: String,
    },
}

/// The durable side of the budgets: today's token counters and the recent turns of each
/// speaker. Read at startup (and at a day's rollover), written by one thread. A store
/// shared by several processes of one bot (a database server) implements the same five
/// calls.
pub trait BudgetStore: Send + 'static {
    /// Every token counter of `day` (`YYYY-MM-DD` in the configured time zone).
    fn load_tokens(&mut self, day: &str) -> Result<Vec<(CounterKey, u64)>, StoreError>;
    /// Every turn started at or after `since_ms` (Unix milliseconds): speaker id and time.
    fn load_turns(&mut self, since_ms: i64) -> Result<Vec<(String, i64)>, StoreError>;
    /// Adds `deltas` to `day`'s counters, all in one commit.
    fn add_tokens(&mut self, day: &str, deltas: &[(CounterKey, u64)]) -> Result<(), StoreError>;
    /// Forgets old days' token counters (the 30 days before `day` are kept, for the
    /// operator's reading; only the current day's are loaded).
    fn forget_days_before(&mut self, day: &str) -> Result<(), StoreError>;
    /// Records `turns` (speaker, at_ms), all in one commit, and forgets turns before
    /// `forget_before_ms`.
    fn record_turns(
        &mut self,
        turns: &[(String, i64)],
        forget_before_ms: i64,
    ) -> Result<(), StoreError>;
    /// Commits one interval's charges of `day` and its started turns (either may be
    /// empty). The default adds the tokens, then records the turns (both tried).
    fn commit(
        &mut self,
        day: &str,
        deltas: &[(CounterKey, u64)],
        turns: &[(String, i64)],
        forget_before_ms: i64,
    ) -> Result<(), StoreError> {
        let tokens = match deltas.is_empty() {
            true => Ok(()),
            false => self.add_tokens(day, deltas),
        };
        let turns = match turns.is_empty() {
            true => Ok(()),
            false => self.record_turns(turns, forget_before_ms),
        };
        tokens.and(turns)
    }
    /// Called once, before the book's writer starts: a store that several processes share
    /// keeps `view` and reports through it what the database acknowledged and what the
    /// others wrote (reconciling on its own interval), and returns true; the book then
    /// refuses turns (and running turns' counted calls) while the view is older than
    /// `max_staleness_secs`. The default (a
    /// store of this process alone) returns false.
    fn share(&mut self, view: super::SharedView) -> bool {
        let _ = view;
        false
    }
    /// Called after a commit by the book's flush: a store that sends its commits on
    /// elsewhere waits until they are there (the default: nothing to wait for).
    fn flush(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The schema version this build writes (`PRAGMA user_version`).
const SCHEMA_VERSION: i64 = 1;
/// How long an open or a write waits for another connection's lock.
const BUSY_TIMEOUT: Duration = Duration::from_millis(1500);

/// A [`BudgetStore`] in a SQLite file (WAL mode).
#[derive(Debug)]
pub struct SqliteStore {
    path: PathBuf,
    pub(super) conn: rusqlite::Connection,
    /// What each load found that was not clean (warned as it was found; `doctor` shows it).
    reports: Vec<LoadReport>,
}

impl SqliteStore {
    /// Opens (or creates) the state file: WAL mode, checked, schema made. A file that is
    /// not a database or is damaged is [`StoreError::Corrupt`], one another connection holds
    /// is [`StoreError::Locked`]; neither is changed.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let path = path.to_owned();
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            if !meta.file_type().is_file() {
                return Err(StoreError::Open {
                    path,
                    reason: "not a regular file".into(),
                });
            }
        }
        let conn = rusqlite::Connection::open(&path).map_err(|e| classify(&path, &e))?;
        let mut store = Self {
            path,
            conn,
            reports: Vec::new(),
        };
        store.prepare().map_err(|e| classify(&store.path, &e))?;
        Ok(store)
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn prepare(&mut self) -> rusqlite::Result<()> {
        self.conn.busy_timeout(BUSY_TIMEOUT)?;
        // One process at a time: the lock taken by the first read and the schema's write
        // below is held until the store is closed, so a second runtime on the same file
        // (whose in-memory counters would drift from this one's) fails at its start.
        let _: String = self
            .conn
            .query_row("PRAGMA locking_mode = EXCLUSIVE", [], |r| r.get(0))?;
        // Read first: a file that is not a database fails here, before anything is written.
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
                Some(format!(
                    "schema version {version} is newer than this build's ({SCHEMA_VERSION})"
                )),
            ));
        }
        let check: String = self
            .conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))?;
        if check != "ok" {
            return Err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
                Some(format!("quick_check: {check}")),
            ));
        }
        let mode: String = self
            .conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
                Some(format!("could not switch to WAL mode (still {mode})")),
            ));
        }
        self.conn.pragma_update(None, "synchronous", "FULL")?;
        // The write lock, taken at once: a file another connection holds is refused here.
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS tokens (
                 day TEXT NOT NULL, scope TEXT NOT NULL, key TEXT NOT NULL,
                 tokens INTEGER NOT NULL,
                 PRIMARY KEY (day, scope, key)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS turns (
                 speaker TEXT NOT NULL, at_ms INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS turns_at ON turns (at_ms);",
        )?;
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        tx.commit()
    }

    pub(super) fn err(&self, e: &rusqlite::Error) -> StoreError {
        classify(&self.path, e)
    }

    /// The loads so far that were not clean, each as its warning said.
    #[cfg(any(feature = "cli", feature = "testing"))]
    pub fn load_reports(&self) -> &[LoadReport] {
        &self.reports
    }

    /// A load that was not clean: one warning naming the file and the rows, kept for
    /// `doctor`.
    fn report(&mut self, report: LoadReport) {
        if !report.is_clean() {
            tracing::warn!("{}", report.warning(&self.path));
            self.reports.push(report);
        }
    }
}

/// A column's value as [`StoredCount`].
fn stored(v: rusqlite::types::ValueRef<'_>) -> StoredCount<'_> {
    use rusqlite::types::ValueRef;
    match v {
        ValueRef::Integer(n) => StoredCount::Integer(n),
        ValueRef::Real(r) => StoredCount::Real(r),
        ValueRef::Text(t) => StoredCount::Text(std::str::from_utf8(t).unwrap_or("")),
        ValueRef::Null => StoredCount::Null,
        ValueRef::Blob(_) => StoredCount::Blob,
    }
}

/// A column's value as text, if it is text.
fn text(v: rusqlite::types::ValueRef<'_>) -> Option<String> {
    match v {
        rusqlite::types::ValueRef::Text(t) => std::str::from_utf8(t).ok().map(str::to_owned),
        _ => None,
    }
}

/// A SQLite error as a store error naming the file.
pub(super) fn classify(path: &Path, e: &rusqlite::Error) -> StoreError {
    let path = path.to_owned();
    let reason = e.to_string();
    match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => {
            StoreError::Corrupt { path, reason }
        }
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => {
            StoreError::Locked { path, reason }
        }
        _ => StoreError::Open { path, reason },
    }
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl BudgetStore for SqliteStore {
    fn load_tokens(&mut self, day: &str) -> Result<Vec<(CounterKey, u64)>, StoreError> {
        let mut report = LoadReport {
            what: "counter",
            ..Default::default()
        };
        // Each column read as whatever it holds (a typed `get` failed the start on a REAL).
        let mut stmt = self
            .conn
            .prepare_cached("SELECT scope, key, tokens FROM tokens WHERE day = ?1")
            .map_err(|e| classify(&self.path, &e))?;
        let rows = stmt
            .query_map([day], |r| {
                let key = text(r.get_ref(0)?).zip(text(r.get_ref(1)?));
                Ok((key, clamp_count(stored(r.get_ref(2)?))))
            })
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>());
        drop(stmt);
        let rows = rows.map_err(|e| self.err(&e))?;
        report.rows = rows.len();
        let mut counters = Vec::with_capacity(rows.len());
        for (key, count) in rows {
            let Some((scope, key)) = key else {
                report.skipped += 1;
                continue;
            };
            report.clamped += usize::from(matches!(count, ReadCount::Clamped(_)));
            // An unknown scope is another version's counter: not this runtime's to read.
            if let Some(k) = CounterKey::from_columns(&scope, key) {
                counters.push((k, count.count()));
            }
        }
        self.report(report);
        Ok(counters)
    }

    fn load_turns(&mut self, since_ms: i64) -> Result<Vec<(String, i64)>, StoreError> {
        let mut report = LoadReport {
            what: "turn",
            ..Default::default()
        };
        // A time that is no number sorts above every number in SQLite: selected, then left
        // out here (and pruned by the next commit of turns).
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT speaker, at_ms FROM turns
                 WHERE at_ms >= ?1 OR typeof(at_ms) NOT IN ('integer', 'real')",
            )
            .map_err(|e| classify(&self.path, &e))?;
        let rows = stmt
            .query_map([since_ms], |r| {
                use rusqlite::types::ValueRef;
                let at = match r.get_ref(1)? {
                    ValueRef::Integer(n) => Some((n, false)),
                    // Truncated and saturated as SQL's CAST: a clamped time.
                    ValueRef::Real(x) if !x.is_nan() => Some((x as i64, true)),
                    _ => None,
                };
                Ok((text(r.get_ref(0)?), at))
            })
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>());
        drop(stmt);
        let rows = rows.map_err(|e| self.err(&e))?;
        report.rows = rows.len();
        let mut turns = Vec::with_capacity(rows.len());
        for row in rows {
            let (Some(speaker), Some((at, clamped))) = row else {
                report.skipped += 1;
                continue;
            };
            report.clamped += usize::from(clamped);
            if at >= since_ms {
                turns.push((speaker, at));
            }
        }
        turns.sort_by_key(|&(_, at)| at);
        self.report(report);
        Ok(turns)
    }

    fn add_tokens(&mut self, day: &str, deltas: &[(CounterKey, u64)]) -> Result<(), StoreError> {
        let path = self.path.clone();
        let mut run = || -> rusqlite::Result<()> {
            let tx = self.conn.transaction()?;
            {
                let mut stmt = tx.prepare_cached(SATURATING_ADD)?;
                for (key, n) in deltas {
                    let (scope, k) = key.columns();
                    stmt.execute(rusqlite::params![day, scope, k, to_i64(*n)])?;
                }
            }
            tx.commit()
        };
        run().map_err(|e| classify(&path, &e))
    }

    fn record_turns(
        &mut self,
        turns: &[(String, i64)],
        forget_before_ms: i64,
    ) -> Result<(), StoreError> {
        let path = self.path.clone();
        let mut run = || -> rusqlite::Result<()> {
            let tx = self.conn.transaction()?;
            {
                let mut stmt =
                    tx.prepare_cached("INSERT INTO turns (speaker, at_ms) VALUES (?1, ?2)")?;
                for (speaker, at_ms) in turns {
                    stmt.execute(rusqlite::params![speaker, at_ms])?;
                }
            }
            // Old turns, and any whose speaker or time is unreadable (skipped at startup).
            tx.execute(
                "DELETE FROM turns WHERE at_ms < ?1 OR typeof(at_ms) NOT IN ('integer', 'real')
                 OR typeof(speaker) != 'text'",
                [forget_before_ms],
            )?;
            tx.commit()
        };
        run().map_err(|e| classify(&path, &e))
    }

    fn forget_days_before(&mut self, day: &str) -> Result<(), StoreError> {
        // Kept a while for the operator (yesterday's totals); only today's are read.
        let oldest: Option<String> = self
            .conn
            .query_row(
                "SELECT day FROM tokens WHERE day < ?1 GROUP BY day ORDER BY day DESC LIMIT 1 OFFSET 30",
                [day],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| self.err(&e))?;
        if let Some(oldest) = oldest {
            self.conn
                .execute("DELETE FROM tokens WHERE day <= ?1", [oldest])
                .map_err(|e| self.err(&e))?;
        }
        Ok(())
    }
}
