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
//! Keys are what the host admitted, never guest text: the speaker's id (the chat
//! platform's), the channel's sha256 hex (as its workspace), and `bot`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{ErrorCode, OptionalExtension};

/// What a token counter counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CounterKey {
    /// One speaker (their platform id), across channels.
    Speaker(String),
    /// One channel (its sha256 hex).
    Channel(String),
    /// The whole bot.
    Bot,
}

impl CounterKey {
    /// The scope and key columns.
    pub fn columns(&self) -> (&'static str, &str) {
        match self {
            CounterKey::Speaker(id) => ("speaker", id),
            CounterKey::Channel(hash) => ("channel", hash),
            CounterKey::Bot => ("bot", ""),
        }
    }

    fn from_columns(scope: &str, key: String) -> Option<Self> {
        match scope {
            "speaker" => Some(CounterKey::Speaker(key)),
            "channel" => Some(CounterKey::Channel(key)),
            "bot" => Some(CounterKey::Bot),
            _ => None,
        }
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
}

/// The schema version this build writes (`PRAGMA user_version`).
const SCHEMA_VERSION: i64 = 1;
/// How long an open or a write waits for another connection's lock.
const BUSY_TIMEOUT: Duration = Duration::from_millis(1500);

/// A [`BudgetStore`] in a SQLite file (WAL mode).
#[derive(Debug)]
pub struct SqliteStore {
    path: PathBuf,
    conn: rusqlite::Connection,
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
        let mut store = Self { path, conn };
        store.prepare().map_err(|e| classify(&store.path, &e))?;
        Ok(store)
    }

    /// The state file.
    #[cfg(any(feature = "cli", feature = "testing"))]
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

    fn err(&self, e: &rusqlite::Error) -> StoreError {
        classify(&self.path, e)
    }
}

/// A SQLite error as a store error naming the file.
fn classify(path: &Path, e: &rusqlite::Error) -> StoreError {
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
        let mut stmt = self
            .conn
            .prepare_cached("SELECT scope, key, tokens FROM tokens WHERE day = ?1")
            .map_err(|e| self.err(&e))?;
        let rows = stmt
            .query_map([day], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>());
        drop(stmt);
        let rows = rows.map_err(|e| self.err(&e))?;
        Ok(rows
            .into_iter()
            .filter_map(|(scope, key, n)| {
                CounterKey::from_columns(&scope, key).map(|k| (k, n.max(0) as u64))
            })
            .collect())
    }

    fn load_turns(&mut self, since_ms: i64) -> Result<Vec<(String, i64)>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT speaker, at_ms FROM turns WHERE at_ms >= ?1 ORDER BY at_ms")
            .map_err(|e| self.err(&e))?;
        let rows = stmt
            .query_map([since_ms], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>());
        drop(stmt);
        rows.map_err(|e| self.err(&e))
    }

    fn add_tokens(&mut self, day: &str, deltas: &[(CounterKey, u64)]) -> Result<(), StoreError> {
        let path = self.path.clone();
        let mut run = || -> rusqlite::Result<()> {
            let tx = self.conn.transaction()?;
            {
                let mut stmt = tx.prepare_cached(
                    "INSERT INTO tokens (day, scope, key, tokens) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (day, scope, key) DO UPDATE SET tokens = tokens + excluded.tokens",
                )?;
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
            tx.execute("DELETE FROM turns WHERE at_ms < ?1", [forget_before_ms])?;
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
