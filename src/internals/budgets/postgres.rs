//! [`PostgresStore`]: the budgets' counters in a PostgreSQL database shared by the processes
//! of one bot (`[budgets] store`), with this process's state file as its local journal.
//!
//! **How the processes agree.** Each process admits and charges from its own counters in
//! memory, as with SQLite. Its writer commits each interval's charges and started turns as
//! one **batch**: first into the local journal (the state file, one SQLite transaction with
//! its fsync), then to the database by this store's own thread, in one statement that adds
//! the deltas with saturation and returns the counters' new totals. The same thread reads
//! back, every interval, the counters of the day and the turns that changed since it last
//! looked (never every row): a row carries the namespace's **version** of the batch that
//! last wrote it, and batches take their version under the namespace row's lock, so they
//! commit in version order and "everything after version v" is exact. So every process
//! sees the others' spend within about two intervals (`docs/design.md` states the bound).
//!
//! **Faults.** A batch stays in the journal until the database acknowledged it; a batch
//! carries an id the database records with it, so a batch sent again (its answer lost with
//! the connection, or replayed from the journal at the next start after a crash) is
//! applied once. The database down at startup is a startup error. Lost while running, the
//! batches wait in the journal and are sent when it is back (reconnecting every interval);
//! the book refuses new turns, and a running turn's model calls and egress requests, once
//! its view is older than `max_staleness_secs` (unless `fail_open`). A slow database is cut
//! by the statement timeout (and a client-side one beside it, which bounds a failed
//! transaction's `ROLLBACK` too), then treated as lost. A database whose `server_encoding`
//! cannot hold every speaker id (anything but UTF8 and SQL_ASCII) is refused.
//!
//! **Agreement.** The namespace's row holds the limits and the time zone. A process whose
//! settings differ refuses to start, naming each difference, while any other process of
//! the namespace is connected (each holds a shared advisory lock for its session); when
//! none is, the first to start sets them (so a limit is changed by restarting every
//! process). The schema is versioned (`roundtable_budgets.meta`) and migrated by the first
//! process of a newer build; a database of a newer version than this build's is refused.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};

use super::store::{clamp_count, LoadReport, ReadCount, SqliteStore, StoredCount};
use super::{BudgetSettings, BudgetStore, CounterKey, SharedView, StoreError, COMMIT_INTERVAL};
use crate::config::StoreSource;

/// The schema version this build writes (`roundtable_budgets.meta`).
pub(crate) const PG_SCHEMA_VERSION: i32 = 2;

/// Each version's migration, from the one before (index 0: from nothing to version 1).
const MIGRATIONS: &[&str] = &[
    "
    CREATE TABLE roundtable_budgets.namespaces (
        ns TEXT PRIMARY KEY,
        version BIGINT NOT NULL DEFAULT 0,
        speaker_tokens_per_day BIGINT,
        channel_tokens_per_day BIGINT,
        bot_tokens_per_day BIGINT,
        speaker_turns_per_minute BIGINT,
        time_zone TEXT NOT NULL,
        settings_at TIMESTAMPTZ NOT NULL DEFAULT now());
    CREATE TABLE roundtable_budgets.tokens (
        ns TEXT NOT NULL, day TEXT NOT NULL, scope TEXT NOT NULL, key TEXT NOT NULL,
        tokens BIGINT NOT NULL, version BIGINT NOT NULL,
        PRIMARY KEY (ns, day, scope, key));
    CREATE INDEX tokens_changed ON roundtable_budgets.tokens (ns, day, version);
    CREATE TABLE roundtable_budgets.turns (
        ns TEXT NOT NULL, speaker TEXT NOT NULL, at_ms BIGINT NOT NULL,
        origin TEXT NOT NULL, version BIGINT NOT NULL);
    CREATE INDEX turns_changed ON roundtable_budgets.turns (ns, version);
    CREATE INDEX turns_at ON roundtable_budgets.turns (ns, at_ms);
    CREATE TABLE roundtable_budgets.batches (
        ns TEXT NOT NULL, batch TEXT NOT NULL,
        applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (ns, batch));
",
    // Version 2: the egress budgets (issue 45), agreed on as the token budgets are.
    "ALTER TABLE roundtable_budgets.namespaces
        ADD COLUMN speaker_egress_bytes_per_day BIGINT,
        ADD COLUMN channel_egress_bytes_per_day BIGINT;
",
];

/// The advisory lock keys' first half (the second is `hashtext(ns)`): setups of a
/// namespace one at a time, and the live processes (shared) against a settings change
/// (exclusive).
const LOCK_SETUP: i32 = 0x5254_4253; // "RTBS"
const LOCK_LIVE: i32 = 0x5254_424c; // "RTBL"
/// The migrations, one process at a time (the whole database).
const LOCK_MIGRATE: i64 = 0x5254_424d_0000_0001;

/// One batch's write: the namespace's version bumped (its row locked until the commit:
/// batches commit in version order), the batch recorded once under that bump, the deltas
/// added with saturation (a row found negative counts as 0, as [`clamp_count`] reads it)
/// and the turns recorded only when the batch is new; the counters' totals after it
/// returned. A batch already recorded adds nothing (only the version moves) and returns no
/// row. Without the namespace's row (deleted, or a database restored from before it was
/// made) nothing is recorded and the one row `('', '', 0)` says so: the batch is not
/// acknowledged. Every step hangs on the bump's own answer, never on the statement's
/// snapshot: a row deleted by a transaction that commits while the bump waits for its lock
/// is seen as gone by the bump alone (before, the batch's id was recorded from the
/// snapshot, which still held the row, nothing was added and no `''` row came back: the
/// batch was taken as applied and its re-send as already recorded, its charges lost).
const WRITE: &str = "
WITH v AS (
    UPDATE roundtable_budgets.namespaces SET version = version + 1
    WHERE ns = $1 RETURNING version),
fresh AS (
    INSERT INTO roundtable_budgets.batches (ns, batch)
    SELECT $1, $2 FROM v
    ON CONFLICT DO NOTHING RETURNING 1),
t AS (
    INSERT INTO roundtable_budgets.tokens AS c (ns, day, scope, key, tokens, version)
    SELECT $1, $3, d.scope, d.key, d.n, v.version
    FROM unnest($4::text[], $5::text[], $6::bigint[]) AS d(scope, key, n), v
    WHERE EXISTS (SELECT 1 FROM fresh)
    ON CONFLICT (ns, day, scope, key) DO UPDATE SET
        tokens = LEAST(GREATEST(c.tokens, 0), 9223372036854775807 - excluded.tokens)
                 + excluded.tokens,
        version = excluded.version
    RETURNING c.scope, c.key, c.tokens),
r AS (
    INSERT INTO roundtable_budgets.turns (ns, speaker, at_ms, origin, version)
    SELECT $1, u.speaker, u.at_ms, $9, v.version
    FROM unnest($7::text[], $8::bigint[]) AS u(speaker, at_ms), v
    WHERE EXISTS (SELECT 1 FROM fresh))
SELECT scope, key, tokens FROM t
UNION ALL
SELECT '', '', 0 WHERE NOT EXISTS (SELECT 1 FROM v)";

/// The read back: the day's counters and the other processes' turns changed since the
/// cursors, and the namespace's version (kind 2: one below a cursor is a database that went
/// back, a restore or a failover to a replica behind, and the cursors start again) (one
/// statement: one snapshot).
const READ: &str = "
SELECT 0 AS kind, scope, key, tokens, version FROM roundtable_budgets.tokens
    WHERE ns = $1 AND day = $2 AND version > $3
UNION ALL
SELECT 1, speaker, '', at_ms, version FROM roundtable_budgets.turns
    WHERE ns = $1 AND version > $4 AND origin <> $5 AND at_ms > $6
UNION ALL
SELECT 2, '', '', version, version FROM roundtable_budgets.namespaces WHERE ns = $1";

/// Counters and a number each (deltas or totals).
type Counts = Vec<(CounterKey, u64)>;

/// How many batches one round sends (pipelined, one round trip).
const BATCHES_PER_ROUND: usize = 64;
/// How often old rows are forgotten (turns past a minute, batch ids past two days).
const HOUSEKEEPING: Duration = Duration::from_secs(60);

/// One interval's charges and turns, as journalled and sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Batch {
    id: String,
    /// Whose turns these are (the process that admitted them).
    origin: String,
    day: String,
    tokens: Vec<(String, String, u64)>,
    turns: Vec<(String, i64)>,
}

impl Batch {
    fn deltas(&self) -> Vec<(CounterKey, u64)> {
        self.tokens
            .iter()
            .filter_map(|(scope, key, n)| {
                CounterKey::from_columns(scope, key.clone()).map(|k| (k, *n))
            })
            .collect()
    }
}

/// What this store did, for the bench: statements sent, round trips, rounds (write and
/// read back), batches acknowledged, failed rounds.
#[derive(Debug, Default)]
pub struct PgStats {
    /// Statements sent to the database.
    pub statements: AtomicU64,
    /// Round trips (a pipelined group of statements is one).
    pub round_trips: AtomicU64,
    /// Reconcile rounds that succeeded.
    pub rounds: AtomicU64,
    /// Batches the database acknowledged.
    pub batches: AtomicU64,
    /// Rounds that failed (the database unreachable, slow or refusing).
    pub failures: AtomicU64,
}

/// How to reach the database (parsed once; the URL itself is not kept in any message).
#[derive(Clone)]
struct Target {
    config: tokio_postgres::Config,
    ssl: SslMode,
    root: Option<PathBuf>,
    /// "PostgreSQL (namespace "x", URL from environment variable Y)": the errors' subject.
    what: String,
    statement_timeout: Duration,
}

/// `sslmode` as libpq reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    /// As the URL names it.
    fn name(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Allow => "allow",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }
}

/// The budgets' settings the processes of a namespace must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Agreed {
    speaker_tokens_per_day: Option<i64>,
    channel_tokens_per_day: Option<i64>,
    bot_tokens_per_day: Option<i64>,
    speaker_turns_per_minute: Option<i64>,
    speaker_egress_bytes_per_day: Option<i64>,
    channel_egress_bytes_per_day: Option<i64>,
    time_zone: String,
}

impl Agreed {
    /// `ns` and these settings as the parameters `$1`..`$8` of the namespace's row (the
    /// order of its `INSERT` and its `UPDATE`).
    fn params<'a>(&'a self, ns: &'a String) -> [&'a (dyn tokio_postgres::types::ToSql + Sync); 8] {
        [
            ns,
            &self.speaker_tokens_per_day,
            &self.channel_tokens_per_day,
            &self.bot_tokens_per_day,
            &self.speaker_turns_per_minute,
            &self.time_zone,
            &self.speaker_egress_bytes_per_day,
            &self.channel_egress_bytes_per_day,
        ]
    }

    fn of(settings: &BudgetSettings, time_zone: &str) -> Self {
        let i = |n: Option<u64>| n.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        Self {
            speaker_tokens_per_day: i(settings.speaker_tokens_per_day),
            channel_tokens_per_day: i(settings.channel_tokens_per_day),
            bot_tokens_per_day: i(settings.bot_tokens_per_day),
            speaker_turns_per_minute: settings.speaker_turns_per_minute.map(i64::from),
            speaker_egress_bytes_per_day: i(settings.speaker_egress_bytes_per_day),
            channel_egress_bytes_per_day: i(settings.channel_egress_bytes_per_day),
            time_zone: time_zone.to_owned(),
        }
    }

    fn from_row(row: &tokio_postgres::Row) -> Self {
        Self {
            speaker_tokens_per_day: row.get(0),
            channel_tokens_per_day: row.get(1),
            bot_tokens_per_day: row.get(2),
            speaker_turns_per_minute: row.get(3),
            time_zone: row.get(4),
            speaker_egress_bytes_per_day: row.get(5),
            channel_egress_bytes_per_day: row.get(6),
        }
    }

    /// Each setting that differs, as "key: this process X, the database Y".
    fn differences(&self, stored: &Agreed) -> Vec<String> {
        let show = |n: Option<i64>| n.map_or_else(|| "unset".to_owned(), |n| n.to_string());
        let mut out = Vec::new();
        for (key, mine, theirs) in [
            (
                "speaker_tokens_per_day",
                self.speaker_tokens_per_day,
                stored.speaker_tokens_per_day,
            ),
            (
                "channel_tokens_per_day",
                self.channel_tokens_per_day,
                stored.channel_tokens_per_day,
            ),
            (
                "bot_tokens_per_day",
                self.bot_tokens_per_day,
                stored.bot_tokens_per_day,
            ),
            (
                "speaker_turns_per_minute",
                self.speaker_turns_per_minute,
                stored.speaker_turns_per_minute,
            ),
            (
                "speaker_egress_bytes_per_day",
                self.speaker_egress_bytes_per_day,
                stored.speaker_egress_bytes_per_day,
            ),
            (
                "channel_egress_bytes_per_day",
                self.channel_egress_bytes_per_day,
                stored.channel_egress_bytes_per_day,
            ),
        ] {
            if mine != theirs {
                out.push(format!(
                    "{key}: this process {}, the database {}",
                    show(mine),
                    show(theirs)
                ));
            }
        }
        if self.time_zone != stored.time_zone {
            out.push(format!(
                "time_zone: this process {}, the database {}",
                self.time_zone, stored.time_zone
            ));
        }
        out
    }
}

/// A [`BudgetStore`] in a PostgreSQL database shared by several processes (see the
/// module's doc). Its connection is owned by its own thread (`budget-postgres`), which the
/// calls of the trait ask; after [`BudgetStore::share`] that thread also reconciles on its
/// own every [`COMMIT_INTERVAL`].
pub struct PostgresStore {
    journal: SqliteStore,
    origin: String,
    seq: u64,
    what: String,
    tx: mpsc::Sender<Req>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Batch ids the database acknowledged, to delete from the journal at the next commit.
    acked: Arc<Mutex<Vec<String>>>,
    stats: Arc<PgStats>,
    reports: Vec<LoadReport>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("what", &self.what)
            .finish_non_exhaustive()
    }
}

/// What the store's calls ask its thread.
enum Req {
    LoadTokens(
        String,
        mpsc::SyncSender<Result<Vec<(CounterKey, i64)>, String>>,
    ),
    LoadTurns(i64, mpsc::SyncSender<Result<Vec<(String, i64)>, String>>),
    Share(SharedView),
    Batch(Batch),
    Forget(String),
    Flush(mpsc::SyncSender<Result<(), String>>),
}

impl PostgresStore {
    /// Opens the store of `settings` (`[budgets] store`, `namespace`, `state_file` as the
    /// journal): reads its URL from its source, connects (TLS as its `sslmode` says),
    /// creates or migrates the schema, checks that the namespace's settings are these
    /// (`time_zone` included), sends what the journal holds from an earlier run (and, at
    /// the first start on a state file that held SQLite counters, today's of them). Any
    /// failure is a startup error naming the store, never the URL.
    pub fn open(settings: &BudgetSettings, time_zone: &str) -> Result<Self, StoreError> {
        Self::open_as(settings, time_zone, false)
    }

    /// `doctor`'s open: the same checks, but a namespace's settings are never set or
    /// replaced (a difference is an error whether or not another process is connected).
    pub fn check(settings: &BudgetSettings, time_zone: &str) -> Result<Self, StoreError> {
        Self::open_as(settings, time_zone, true)
    }

    fn open_as(
        settings: &BudgetSettings,
        time_zone: &str,
        check_only: bool,
    ) -> Result<Self, StoreError> {
        let ns = settings.effective_namespace().to_owned();
        let source = settings
            .store
            .as_ref()
            .ok_or_else(|| StoreError::Database {
                what: "PostgreSQL".into(),
                reason: "no store is configured".into(),
            })?;
        let what = format!(
            "PostgreSQL (namespace {ns:?}, URL from {})",
            source.describe()
        );
        let err = |reason: String| StoreError::Database {
            what: what.clone(),
            reason,
        };
        let StoreSource::Ref(key) = source else {
            return Err(err("store must name env or file".into()));
        };
        let url = key
            .read("budgets.store")
            .map_err(|e| err(format!("read the URL: {e}")))?;
        let mut target = parse_url(url.expose_secret()).map_err(&err)?;
        target.what = what.clone();
        target.statement_timeout = settings.effective_statement_timeout();
        let path = settings
            .state_file
            .as_deref()
            .ok_or_else(|| err("state_file (the local journal) is required".into()))?;
        let journal = SqliteStore::open(path)?;
        prepare_journal(&journal)?;
        let origin = uuid::Uuid::new_v4().simple().to_string();
        let tz: chrono_tz::Tz = time_zone.parse().unwrap_or(chrono_tz::UTC);
        let agreed = Agreed::of(settings, tz.name());
        let stats = Arc::new(PgStats::default());
        // The first connection, the schema, the settings: here, so a failure is the start's.
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let shipper = Shipper {
            ns: ns.clone(),
            origin: origin.clone(),
            target,
            agreed,
            check_only,
            conn: None,
            queue: VecDeque::new(),
            view: None,
            tokens_cursor: (String::new(), 0),
            turns_cursor: 0,
            stats: stats.clone(),
            acked_out: Arc::new(Mutex::new(Vec::new())),
            last_housekeeping: None,
            last_error_log: None,
        };
        let acked = shipper.acked_out.clone();
        let thread = std::thread::Builder::new()
            .name("budget-postgres".into())
            .spawn(move || shipper.run(rx, ready_tx))
            .map_err(|e| err(format!("start its thread: {e}")))?;
        let mut store = Self {
            journal,
            origin,
            seq: 0,
            what: what.clone(),
            tx,
            thread: Some(thread),
            acked,
            stats,
            reports: Vec::new(),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(reason)) => return Err(err(reason)),
            Err(_) => return Err(err("its thread ended".into())),
        }
        if check_only {
            // `doctor` writes nothing: a crash's batches and a SQLite state file's counters
            // wait for the bot's start (sent by a check, into a namespace not made yet,
            // they were lost).
            return Ok(store);
        }
        // A crash's batches (and, once, a SQLite state file's counters of today) first.
        store.import_sqlite_counters(tz)?;
        for batch in read_journal(&store.journal)? {
            store.send(Req::Batch(batch));
        }
        store.flush_to_database()?;
        Ok(store)
    }

    /// What the store did (statements, round trips, rounds), for the bench.
    pub fn stats(&self) -> Arc<PgStats> {
        self.stats.clone()
    }

    /// The loads so far that were not clean, each as its warning said.
    pub fn load_reports(&self) -> &[LoadReport] {
        &self.reports
    }

    fn send(&self, req: Req) {
        let _ = self.tx.send(req);
    }

    fn ask<T>(
        &self,
        make: impl FnOnce(mpsc::SyncSender<Result<T, String>>) -> Req,
    ) -> Result<T, StoreError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(make(tx));
        rx.recv()
            .unwrap_or_else(|_| Err("its thread ended".into()))
            .map_err(|reason| StoreError::Database {
                what: self.what.clone(),
                reason,
            })
    }

    /// Waits until the database has every batch sent so far (or fails: the database not
    /// reached within the statement timeout and a reconnect).
    fn flush_to_database(&mut self) -> Result<(), StoreError> {
        self.ask(Req::Flush)?;
        self.forget_acked()
    }

    /// Deletes the acknowledged batches from the journal.
    fn forget_acked(&mut self) -> Result<(), StoreError> {
        let acked = std::mem::take(&mut *self.acked.lock().unwrap_or_else(|e| e.into_inner()));
        if acked.is_empty() {
            return Ok(());
        }
        journal_tx(&mut self.journal, None, &acked)
    }

    /// At the first start on a state file that held the SQLite store's counters: today's
    /// counters and the last minute's turns go to the database once, as a batch of the
    /// journal (they leave the file's tables in the same transaction).
    fn import_sqlite_counters(&mut self, tz: chrono_tz::Tz) -> Result<(), StoreError> {
        let now = chrono::Utc::now();
        let day = now.with_timezone(&tz).date_naive().to_string();
        let since = now.timestamp_millis() - super::MINUTE_MS;
        let tokens = self.journal.load_tokens(&day)?;
        let turns = self.journal.load_turns(since)?;
        if tokens.is_empty() && turns.is_empty() {
            return Ok(());
        }
        let batch = Batch {
            id: format!("import:{}", self.origin),
            origin: format!("import:{}", self.origin),
            day: day.clone(),
            tokens: tokens
                .iter()
                .map(|(k, n)| {
                    let (scope, key) = k.columns();
                    (scope.to_owned(), key.to_owned(), *n)
                })
                .collect(),
            turns,
        };
        let body = serde_json::to_string(&batch).unwrap_or_default();
        let path = self.journal.path().to_owned();
        let run = |conn: &mut rusqlite::Connection| -> rusqlite::Result<()> {
            let tx = conn.transaction()?;
            tx.execute(
                "INSERT INTO journal (batch, body) VALUES (?1, ?2)",
                rusqlite::params![batch.id, body],
            )?;
            tx.execute("DELETE FROM tokens WHERE day = ?1", [&day])?;
            tx.execute("DELETE FROM turns", [])?;
            tx.commit()
        };
        run(&mut self.journal.conn).map_err(|e| super::store::classify(&path, &e))?;
        tracing::info!(
            counters = batch.tokens.len(),
            turns = batch.turns.len(),
            "budgets: today's counters of the SQLite state file are moved to the shared store"
        );
        Ok(())
    }

    fn next_batch(
        &mut self,
        day: &str,
        deltas: &[(CounterKey, u64)],
        turns: &[(String, i64)],
    ) -> Batch {
        self.seq += 1;
        // One row per counter (the write's upsert cannot touch a row twice).
        let mut merged: BTreeMap<(&'static str, String), u64> = BTreeMap::new();
        for (k, n) in deltas {
            let (scope, key) = k.columns();
            let e = merged.entry((scope, key.to_owned())).or_default();
            *e = e.saturating_add(*n);
        }
        Batch {
            id: format!("{}:{}", self.origin, self.seq),
            origin: self.origin.clone(),
            day: day.to_owned(),
            tokens: merged
                .into_iter()
                .map(|((s, k), n)| (s.to_owned(), k, n))
                .collect(),
            turns: turns.to_vec(),
        }
    }
}

impl BudgetStore for PostgresStore {
    fn load_tokens(&mut self, day: &str) -> Result<Vec<(CounterKey, u64)>, StoreError> {
        let rows = self.ask(|tx| Req::LoadTokens(day.to_owned(), tx))?;
        let mut report = LoadReport {
            what: "counter",
            rows: rows.len(),
            ..Default::default()
        };
        let counters = rows
            .into_iter()
            .map(|(k, n)| {
                let c = clamp_count(StoredCount::Integer(n));
                report.clamped += usize::from(matches!(c, ReadCount::Clamped(_)));
                (k, c.count())
            })
            .collect();
        if !report.is_clean() {
            tracing::warn!("{}", report.warning(Path::new(&self.what)));
            self.reports.push(report);
        }
        Ok(counters)
    }

    fn load_turns(&mut self, since_ms: i64) -> Result<Vec<(String, i64)>, StoreError> {
        let mut turns = self.ask(|tx| Req::LoadTurns(since_ms, tx))?;
        turns.sort_by_key(|&(_, at)| at);
        Ok(turns)
    }

    fn add_tokens(&mut self, day: &str, deltas: &[(CounterKey, u64)]) -> Result<(), StoreError> {
        self.commit(day, deltas, &[], 0)
    }

    fn forget_days_before(&mut self, day: &str) -> Result<(), StoreError> {
        self.send(Req::Forget(day.to_owned()));
        Ok(())
    }

    fn record_turns(
        &mut self,
        turns: &[(String, i64)],
        forget_before_ms: i64,
    ) -> Result<(), StoreError> {
        let day = chrono::Utc::now().date_naive().to_string();
        self.commit(&day, &[], turns, forget_before_ms)
    }

    fn commit(
        &mut self,
        day: &str,
        deltas: &[(CounterKey, u64)],
        turns: &[(String, i64)],
        _forget_before_ms: i64,
    ) -> Result<(), StoreError> {
        let acked = std::mem::take(&mut *self.acked.lock().unwrap_or_else(|e| e.into_inner()));
        if deltas.is_empty() && turns.is_empty() {
            return match acked.is_empty() {
                true => Ok(()),
                false => journal_tx(&mut self.journal, None, &acked),
            };
        }
        let batch = self.next_batch(day, deltas, turns);
        // In the journal before it is sent: a crash from here on loses none of it.
        let journalled = journal_tx(&mut self.journal, Some(&batch), &acked);
        if journalled.is_err() {
            // Not lost for this run: sent all the same (the next start cannot replay it).
            self.acked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(acked);
        }
        self.send(Req::Batch(batch));
        journalled
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        self.flush_to_database()
    }

    fn share(&mut self, view: SharedView) -> bool {
        view.set_stats(self.stats.clone());
        self.send(Req::Share(view));
        true
    }
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        // A last round for what was sent (bounded by the timeouts); what it cannot send
        // stays in the journal for the next start.
        let _ = self.flush_to_database();
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The journal's table in the state file (made when missing; the SQLite store's schema
/// version is unchanged: a build without it ignores the table).
fn prepare_journal(journal: &SqliteStore) -> Result<(), StoreError> {
    journal
        .conn
        .execute_batch(
            "CREATE TABLE IF NOT EXISTS journal (batch TEXT PRIMARY KEY, body TEXT NOT NULL)",
        )
        .map_err(|e| journal.err(&e))
}

/// One journal transaction: `batch` added, `acked` deleted.
fn journal_tx(
    journal: &mut SqliteStore,
    batch: Option<&Batch>,
    acked: &[String],
) -> Result<(), StoreError> {
    let path = journal.path().to_owned();
    let run = |conn: &mut rusqlite::Connection| -> rusqlite::Result<()> {
        let tx = conn.transaction()?;
        if let Some(b) = batch {
            let body = serde_json::to_string(b).unwrap_or_default();
            tx.execute(
                "INSERT OR REPLACE INTO journal (batch, body) VALUES (?1, ?2)",
                rusqlite::params![b.id, body],
            )?;
        }
        {
            let mut del = tx.prepare_cached("DELETE FROM journal WHERE batch = ?1")?;
            for id in acked {
                del.execute([id])?;
            }
        }
        tx.commit()
    };
    run(&mut journal.conn).map_err(|e| super::store::classify(&path, &e))
}

/// The batches the journal holds (an earlier run's, not acknowledged), oldest first.
fn read_journal(journal: &SqliteStore) -> Result<Vec<Batch>, StoreError> {
    let mut stmt = journal
        .conn
        .prepare("SELECT body FROM journal ORDER BY rowid")
        .map_err(|e| journal.err(&e))?;
    let bodies = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
        .map_err(|e| journal.err(&e))?;
    let mut batches = Vec::new();
    for body in bodies {
        match serde_json::from_str::<Batch>(&body) {
            Ok(b) => batches.push(b),
            Err(e) => {
                tracing::warn!(error = %e, "budgets: a journal entry that cannot be read is skipped")
            }
        }
    }
    if !batches.is_empty() {
        tracing::info!(
            batches = batches.len(),
            "budgets: the journal's batches of an earlier run are sent to the shared store"
        );
    }
    Ok(batches)
}

/// The URL's `sslmode` and `sslrootcert` (read here, as libpq reads them), the rest to
/// tokio-postgres. A message never holds the URL.
fn parse_url(url: &str) -> Result<Target, String> {
    let url = url.trim();
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err("its URL must start with postgres:// or postgresql://".into());
    }
    // The query begins at the first `?` after the user and password, which end at the
    // first `@` before any `/`, as libpq reads them (a `?` in a password is its own: split
    // at the URL's first `?`, the password's tail was read as the query, shown in an error).
    let after = url.find("://").map_or(0, |i| i + 3);
    let user_end = url[after..]
        .find(['@', '/'])
        .filter(|&i| url.as_bytes()[after + i] == b'@')
        .map_or(after, |i| after + i + 1);
    let (base, query) = match url[user_end..].find('?') {
        Some(i) => (&url[..user_end + i], &url[user_end + i + 1..]),
        None => (url, ""),
    };
    let mut ssl = SslMode::Prefer;
    let mut ssl_given = false;
    let mut root = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(v);
        match k {
            "sslmode" => {
                ssl_given = true;
                ssl = match value.as_str() {
                    "disable" => SslMode::Disable,
                    "allow" => SslMode::Allow,
                    "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    _ => {
                        return Err(format!(
                            "its URL's sslmode must be disable, allow, prefer, require, verify-ca \
                             or verify-full, got {value:?}"
                        ))
                    }
                }
            }
            "sslrootcert" => root = Some(PathBuf::from(value)),
            k if k.starts_with("ssl") || k == "requiressl" => {
                return Err(format!(
                    "its URL's {k} is not supported (sslmode and sslrootcert are)"
                ))
            }
            _ => rest.push(pair),
        }
    }
    // `sslrootcert=system` (the public CAs) implies `verify-full` and refuses any weaker
    // mode, as libpq 16 does: any holder of a public CA's certificate passes a chain check
    // that does not check the host name.
    if root.as_deref() == Some(Path::new("system")) {
        if ssl_given && ssl != SslMode::VerifyFull {
            return Err(format!(
                "its URL's sslmode {} may not be used with sslrootcert=system (use verify-full)",
                ssl.name()
            ));
        }
        ssl = SslMode::VerifyFull;
    }
    let rebuilt = match rest.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", rest.join("&")),
    };
    let config: tokio_postgres::Config = rebuilt
        .parse()
        .map_err(|e: tokio_postgres::Error| format!("its URL cannot be read: {e}"))?;
    Ok(Target {
        config,
        ssl,
        root,
        what: String::new(),
        statement_timeout: Duration::from_secs(2),
    })
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

mod tls {
    //! The rustls connector for each `sslmode` (ring provider), as libpq verifies.
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{CertificateError, DigitallySignedStruct, Error, SignatureScheme};

    use super::SslMode;

    /// Encryption without authentication (`prefer`, `require` without a root file, `allow`):
    /// the handshake's signatures are checked, the certificate is not.
    #[derive(Debug)]
    struct Unverified(Arc<rustls::crypto::CryptoProvider>);

    impl ServerCertVerifier for Unverified {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            rustls::crypto::verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    /// `verify-ca`: the chain to the root, not the host name.
    #[derive(Debug)]
    struct ChainOnly(Arc<dyn ServerCertVerifier>);

    impl ServerCertVerifier for ChainOnly {
        fn verify_server_cert(
            &self,
            end: &CertificateDer<'_>,
            inter: &[CertificateDer<'_>],
            name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, Error> {
            match self.0.verify_server_cert(end, inter, name, ocsp, now) {
                Err(Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            self.0.verify_tls12_signature(m, c, d)
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            self.0.verify_tls13_signature(m, c, d)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.supported_verify_schemes()
        }
    }

    /// libpq's root file: `sslrootcert`, else `~/.postgresql/root.crt` when it exists;
    /// `system`: the bundled web roots.
    fn root_file(root: Option<&Path>) -> Option<PathBuf> {
        match root {
            Some(p) => Some(p.to_owned()),
            None => std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
                .filter(|p| p.is_file()),
        }
    }

    fn roots(file: &Path) -> Result<rustls::RootCertStore, String> {
        let mut store = rustls::RootCertStore::empty();
        if file == Path::new("system") {
            store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            return Ok(store);
        }
        use rustls::pki_types::pem::PemObject;
        let certs = CertificateDer::pem_file_iter(file)
            .map_err(|e| format!("read sslrootcert {}: {e}", file.display()))?;
        for cert in certs {
            let cert = cert.map_err(|e| format!("read sslrootcert {}: {e}", file.display()))?;
            store
                .add(cert)
                .map_err(|e| format!("sslrootcert {}: {e}", file.display()))?;
        }
        if store.is_empty() {
            return Err(format!(
                "sslrootcert {} holds no certificate",
                file.display()
            ));
        }
        Ok(store)
    }

    /// The connector and tokio-postgres's mode for `mode` (for `allow`, the second try's).
    pub(super) fn connector(
        mode: SslMode,
        root: Option<&Path>,
    ) -> Result<
        (
            tokio_postgres_rustls::MakeRustlsConnect,
            tokio_postgres::config::SslMode,
        ),
        String,
    > {
        use tokio_postgres::config::SslMode as Pg;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let file = root_file(root);
        let verifier: Arc<dyn ServerCertVerifier> = match (mode, &file) {
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => return Err(
                "sslmode verify-ca and verify-full need a root certificate: sslrootcert in the \
                     URL (a file, or system), or ~/.postgresql/root.crt"
                    .into(),
            ),
            (SslMode::VerifyCa | SslMode::VerifyFull | SslMode::Require, Some(file)) => {
                let full = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots(file)?),
                    provider.clone(),
                )
                .build()
                .map_err(|e| e.to_string())?;
                match mode {
                    SslMode::VerifyFull => full,
                    // `require` with a root file verifies as verify-ca (libpq).
                    _ => Arc::new(ChainOnly(full)),
                }
            }
            _ => Arc::new(Unverified(provider)),
        };
        let config = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        let pg = match mode {
            SslMode::Disable => Pg::Disable,
            SslMode::Prefer => Pg::Prefer,
            _ => Pg::Require,
        };
        Ok((tokio_postgres_rustls::MakeRustlsConnect::new(config), pg))
    }
}

/// A live connection and its prepared statements.
struct Conn {
    client: tokio_postgres::Client,
    write: tokio_postgres::Statement,
    read: tokio_postgres::Statement,
}

/// The store's thread: owns the connection (on its own current-thread runtime), sends
/// batches, reads back, reconnects.
struct Shipper {
    ns: String,
    origin: String,
    target: Target,
    agreed: Agreed,
    check_only: bool,
    conn: Option<Conn>,
    /// Batches not acknowledged yet, oldest first.
    queue: VecDeque<Batch>,
    view: Option<SharedView>,
    /// The day whose counters are read back, and the version read up to.
    tokens_cursor: (String, i64),
    turns_cursor: i64,
    stats: Arc<PgStats>,
    acked_out: Arc<Mutex<Vec<String>>>,
    last_housekeeping: Option<Instant>,
    last_error_log: Option<Instant>,
}

impl Shipper {
    fn run(mut self, rx: mpsc::Receiver<Req>, ready: mpsc::SyncSender<Result<(), String>>) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready.send(Err(format!("start its runtime: {e}")));
                return;
            }
        };
        let first = rt.block_on(self.connect(true));
        let ok = first.is_ok();
        let _ = ready.send(first);
        if !ok {
            return;
        }
        let mut next = Instant::now() + COMMIT_INTERVAL;
        loop {
            let wait = next.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Req::LoadTokens(day, reply)) => {
                    let _ = reply.send(rt.block_on(self.load_tokens(&day)));
                }
                Ok(Req::LoadTurns(since, reply)) => {
                    let _ = reply.send(rt.block_on(self.load_turns(since)));
                }
                Ok(Req::Share(view)) => {
                    view.synced();
                    self.view = Some(view);
                }
                Ok(Req::Batch(b)) => {
                    self.queue.push_back(b);
                    // Sent at once: the others see it an interval sooner.
                    let _ = rt.block_on(self.round());
                    next = Instant::now() + COMMIT_INTERVAL;
                }
                Ok(Req::Forget(day)) => {
                    let _ = rt.block_on(self.forget_days(&day));
                }
                Ok(Req::Flush(reply)) => {
                    let mut r = rt.block_on(self.round());
                    while r.is_ok() && !self.queue.is_empty() {
                        r = rt.block_on(self.round());
                    }
                    let _ = reply.send(r);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if self.view.is_some() {
                        let _ = rt.block_on(self.round());
                    }
                    next = Instant::now() + COMMIT_INTERVAL;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
    }

    /// The client-side deadline of one exchange (beside the server's statement timeout: a
    /// connection that went silent answers nothing).
    fn deadline(&self) -> Duration {
        self.target.statement_timeout + Duration::from_secs(1)
    }

    /// An error's words without what the URL holds: its user, its database's name and its
    /// host, where the server's or a library's words quote them (`password authentication
    /// failed for user "…"`, `database "…" does not exist`, rustls's `certificate not valid
    /// for name "…"`), and a host that reads as an address or a domain name wherever it
    /// stands: the errors (so the logs and `doctor`) name the URL's source, never what it
    /// holds.
    fn scrub(&self, message: String) -> String {
        let c = &self.target.config;
        let mut out = message;
        let db = c.get_dbname().filter(|d| !d.is_empty());
        if let Some(db) = db {
            out = out.replace(
                &format!("database \"{db}\""),
                "database \"(the URL's database)\"",
            );
        }
        if let Some(user) = c.get_user().filter(|u| !u.is_empty()) {
            out = out.replace(&format!("\"{user}\""), "\"(the URL's user)\"");
        }
        if let Some(db) = db {
            out = out.replace(&format!("\"{db}\""), "\"(the URL's database)\"");
        }
        let hosts = c
            .get_hosts()
            .iter()
            .map(|h| match h {
                tokio_postgres::config::Host::Tcp(h) => h.clone(),
                tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
            })
            .chain(c.get_hostaddrs().iter().map(|a| a.to_string()));
        for host in hosts.filter(|h| !h.is_empty()) {
            out = out.replace(&format!("\"{host}\""), "\"(the URL's host)\"");
            if host.len() >= 4 && host.contains(['.', ':', '/']) {
                out = out.replace(&host, "(the URL's host)");
            }
        }
        out
    }

    /// Ends a transaction that failed, within the same deadline as any statement (a
    /// connection gone silent answers no `ROLLBACK` either: the store's thread stalled on
    /// it, every later round with it; the server ends such a session itself, by its
    /// `idle_in_transaction_session_timeout`).
    async fn rollback(&self, client: &tokio_postgres::Client) {
        let _ = self.timed(client.batch_execute("ROLLBACK")).await;
    }

    fn db_err(e: &tokio_postgres::Error) -> String {
        match e.as_db_error() {
            Some(db) => format!("{}: {}", db.severity(), db.message()),
            None => {
                let mut s = e.to_string();
                let mut src = std::error::Error::source(e);
                while let Some(inner) = src {
                    s.push_str(": ");
                    s.push_str(&inner.to_string());
                    src = inner.source();
                }
                s
            }
        }
    }

    async fn timed<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, String> {
        match tokio::time::timeout(self.deadline(), f).await {
            Ok(r) => r.map_err(|e| self.scrub(Self::db_err(&e))),
            Err(_) => Err(format!(
                "no answer within {} ms",
                self.deadline().as_millis()
            )),
        }
    }

    /// Connects (TLS as `sslmode` says; `allow`: plain first, then TLS), sets the
    /// statement timeout, checks the schema (`first`: creates or migrates it), agrees on
    /// the settings and takes the namespace's shared live lock for the session.
    async fn connect(&mut self, first: bool) -> Result<(), String> {
        self.conn = None;
        let mut config = self.target.config.clone();
        config
            .connect_timeout(self.deadline())
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(10))
            .application_name("roundtable-sandbox budgets");
        let tries = match self.target.ssl {
            SslMode::Allow => vec![SslMode::Disable, SslMode::Require],
            m => vec![m],
        };
        let mut last = String::new();
        let mut client = None;
        for mode in tries {
            let (tls, pg) = tls::connector(mode, self.target.root.as_deref())?;
            config.ssl_mode(pg);
            let connecting = config.connect(tls);
            match tokio::time::timeout(self.deadline() + Duration::from_secs(1), connecting).await {
                Ok(Ok((c, connection))) => {
                    tokio::spawn(async move {
                        let _ = connection.await;
                    });
                    client = Some(c);
                    break;
                }
                Ok(Err(e)) => last = format!("connect: {}", self.scrub(Self::db_err(&e))),
                Err(_) => last = "connect: no answer in time".into(),
            }
        }
        let client = client.ok_or(last)?;
        self.stats.round_trips.fetch_add(1, Ordering::Relaxed);
        // A session left idle inside a transaction (its client gone silent) is ended by the
        // server, with the locks it holds, after one client deadline.
        let setup = self
            .timed(client.simple_query(&format!(
                "SET statement_timeout = {}; SET lock_timeout = {}; \
                 SET idle_in_transaction_session_timeout = {}; SHOW server_encoding",
                self.target.statement_timeout.as_millis(),
                self.target.statement_timeout.as_millis(),
                self.deadline().as_millis()
            )))
            .await?;
        let encoding = setup
            .iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .unwrap_or_default();
        check_encoding(&encoding)?;
        self.schema(&client, first && !self.check_only).await?;
        self.agree(&client).await?;
        let write = self.timed(client.prepare(WRITE)).await?;
        let read = self.timed(client.prepare(READ)).await?;
        self.conn = Some(Conn {
            client,
            write,
            read,
        });
        Ok(())
    }

    /// Creates or migrates the schema (`migrate`), or only checks its version.
    async fn schema(&self, client: &tokio_postgres::Client, migrate: bool) -> Result<(), String> {
        let exists: Option<String> = self
            .timed(client.query_one("SELECT to_regclass('roundtable_budgets.meta')::text", &[]))
            .await?
            .get(0);
        let version = match exists {
            None => 0,
            Some(_) => self
                .timed(client.query_opt(
                    "SELECT schema_version FROM roundtable_budgets.meta WHERE id = 1",
                    &[],
                ))
                .await?
                .map_or(0, |r| r.get::<_, i32>(0)),
        };
        if version > PG_SCHEMA_VERSION {
            return Err(format!(
                "the database's schema is version {version}, newer than this build's \
                 ({PG_SCHEMA_VERSION}): a newer build migrated it; run that build (this one \
                 does not start on it)"
            ));
        }
        if version == PG_SCHEMA_VERSION {
            return Ok(());
        }
        if !migrate {
            return Err(format!(
                "the database's schema is version {version}, older than this build's \
                 ({PG_SCHEMA_VERSION}): a start of the bot migrates it"
            ));
        }
        // One migrator at a time; the version read again under the lock.
        let mut sql = format!("BEGIN; SELECT pg_advisory_xact_lock({LOCK_MIGRATE});");
        let schema_exists: bool = self
            .timed(client.query_one(
                "SELECT to_regnamespace('roundtable_budgets') IS NOT NULL",
                &[],
            ))
            .await?
            .get(0);
        if !schema_exists {
            sql.push_str("CREATE SCHEMA IF NOT EXISTS roundtable_budgets;");
        }
        sql.push_str(
            "CREATE TABLE IF NOT EXISTS roundtable_budgets.meta (
                 id INT PRIMARY KEY CHECK (id = 1), schema_version INT NOT NULL);
             INSERT INTO roundtable_budgets.meta VALUES (1, 0) ON CONFLICT DO NOTHING;",
        );
        self.timed(client.batch_execute(&sql)).await?;
        let result = async {
            let now: i32 = self
                .timed(client.query_one(
                    "SELECT schema_version FROM roundtable_budgets.meta WHERE id = 1",
                    &[],
                ))
                .await?
                .get(0);
            if now > PG_SCHEMA_VERSION {
                return Err(format!(
                    "the database's schema is version {now}, newer than this build's \
                     ({PG_SCHEMA_VERSION})"
                ));
            }
            for (i, step) in MIGRATIONS.iter().enumerate().skip(now as usize) {
                self.timed(client.batch_execute(step))
                    .await
                    .map_err(|e| format!("migrate the schema to version {}: {e}", i + 1))?;
            }
            self.timed(client.execute(
                "UPDATE roundtable_budgets.meta SET schema_version = $1 WHERE id = 1",
                &[&PG_SCHEMA_VERSION],
            ))
            .await?;
            self.timed(client.batch_execute("COMMIT")).await
        }
        .await;
        if result.is_err() {
            self.rollback(client).await;
        } else {
            tracing::info!(
                from = version,
                to = PG_SCHEMA_VERSION,
                "budgets: the shared store's schema was migrated"
            );
        }
        result
    }

    /// The namespace's settings: set when new (or when no other process is connected),
    /// else they must be this process's; the session's shared live lock taken.
    async fn agree(&self, client: &tokio_postgres::Client) -> Result<(), String> {
        let a = &self.agreed;
        let ns = &self.ns;
        let select = "SELECT speaker_tokens_per_day, channel_tokens_per_day, bot_tokens_per_day,
                             speaker_turns_per_minute, time_zone,
                             speaker_egress_bytes_per_day, channel_egress_bytes_per_day
                      FROM roundtable_budgets.namespaces WHERE ns = $1";
        if self.check_only {
            return self.check_agreed(client, select).await;
        }
        self.timed(client.batch_execute("BEGIN")).await?;
        let result = async {
            self.timed(client.execute(
                "SELECT pg_advisory_xact_lock($1, hashtext($2))",
                &[&LOCK_SETUP, ns],
            ))
            .await?;
            self.timed(client.execute(
                "INSERT INTO roundtable_budgets.namespaces (ns, speaker_tokens_per_day,
                     channel_tokens_per_day, bot_tokens_per_day, speaker_turns_per_minute,
                     time_zone, speaker_egress_bytes_per_day, channel_egress_bytes_per_day)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
                &a.params(ns),
            ))
            .await?;
            let row = self.timed(client.query_one(select, &[ns])).await?;
            let d = a.differences(&Agreed::from_row(&row));
            if !d.is_empty() {
                self.replace(client, &d).await?;
            }
            self.timed(client.execute(
                "SELECT pg_advisory_lock_shared($1, hashtext($2))",
                &[&LOCK_LIVE, ns],
            ))
            .await?;
            self.timed(client.batch_execute("COMMIT")).await
        }
        .await;
        if result.is_err() {
            self.rollback(client).await;
        }
        result
    }

    /// Without changing anything (`doctor`): a namespace's settings, when it has them,
    /// must be this process's.
    async fn check_agreed(
        &self,
        client: &tokio_postgres::Client,
        select: &str,
    ) -> Result<(), String> {
        let ns = &self.ns;
        let row = self.timed(client.query_opt(select, &[ns])).await?;
        match row {
            None => Ok(()),
            Some(row) => {
                let d = self.agreed.differences(&Agreed::from_row(&row));
                match d.is_empty() {
                    true => Ok(()),
                    false => Err(differ(ns, &d, false)),
                }
            }
        }
    }

    /// The namespace's settings differ (`d`) from this process's: replaced only when no
    /// other process of the namespace is connected.
    async fn replace(&self, client: &tokio_postgres::Client, d: &[String]) -> Result<(), String> {
        let a = &self.agreed;
        let ns = &self.ns;
        let alone: bool = self
            .timed(client.query_one(
                "SELECT pg_try_advisory_lock($1, hashtext($2))",
                &[&LOCK_LIVE, ns],
            ))
            .await?
            .get(0);
        if !alone {
            return Err(differ(ns, d, true));
        }
        self.timed(client.execute(
            "UPDATE roundtable_budgets.namespaces SET speaker_tokens_per_day = $2,
                 channel_tokens_per_day = $3, bot_tokens_per_day = $4,
                 speaker_turns_per_minute = $5, time_zone = $6,
                 speaker_egress_bytes_per_day = $7, channel_egress_bytes_per_day = $8,
                 settings_at = now()
             WHERE ns = $1",
            &a.params(ns),
        ))
        .await?;
        self.timed(client.execute(
            "SELECT pg_advisory_unlock($1, hashtext($2))",
            &[&LOCK_LIVE, ns],
        ))
        .await?;
        tracing::warn!(
            namespace = %ns,
            changes = %d.join("; "),
            "budgets: no other process of the namespace is connected: its settings are now this process's"
        );
        Ok(())
    }

    async fn load_tokens(&mut self, day: &str) -> Result<Vec<(CounterKey, i64)>, String> {
        let conn = self.conn.as_ref().ok_or("not connected")?;
        let c = &conn.client;
        // One snapshot: the rows and the version they are read up to.
        self.timed(c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"))
            .await?;
        let result = async {
            // No row yet (a check before the namespace's first start): nothing counted.
            let version: i64 = self
                .timed(c.query_opt(
                    "SELECT version FROM roundtable_budgets.namespaces WHERE ns = $1",
                    &[&self.ns],
                ))
                .await?
                .map_or(0, |r| r.get(0));
            let rows = self
                .timed(c.query(
                    "SELECT scope, key, tokens FROM roundtable_budgets.tokens
                     WHERE ns = $1 AND day = $2",
                    &[&self.ns, &day],
                ))
                .await?;
            self.timed(c.batch_execute("COMMIT")).await?;
            Ok((version, rows))
        }
        .await;
        let (version, rows) = match result {
            Ok(r) => r,
            Err(e) => {
                self.rollback(c).await;
                return Err(e);
            }
        };
        self.tokens_cursor = (day.to_owned(), version);
        Ok(rows
            .iter()
            .filter_map(|r| {
                CounterKey::from_columns(r.get::<_, &str>(0), r.get::<_, String>(1))
                    .map(|k| (k, r.get::<_, i64>(2)))
            })
            .collect())
    }

    async fn load_turns(&mut self, since: i64) -> Result<Vec<(String, i64)>, String> {
        let conn = self.conn.as_ref().ok_or("not connected")?;
        let c = &conn.client;
        let rows = self
            .timed(c.query(
                "SELECT speaker, at_ms, (SELECT version FROM roundtable_budgets.namespaces
                     WHERE ns = $1) FROM roundtable_budgets.turns WHERE ns = $1 AND at_ms >= $2
                 UNION ALL SELECT NULL, NULL, version FROM roundtable_budgets.namespaces
                     WHERE ns = $1",
                &[&self.ns, &since],
            ))
            .await?;
        let mut turns = Vec::new();
        for r in &rows {
            self.turns_cursor = r.get::<_, i64>(2);
            if let (Some(s), Some(at)) = (r.get::<_, Option<String>>(0), r.get::<_, Option<i64>>(1))
            {
                turns.push((s, at));
            }
        }
        Ok(turns)
    }

    async fn forget_days(&mut self, day: &str) -> Result<(), String> {
        let Some(conn) = &self.conn else {
            return Ok(());
        };
        // The 30 days before `day` are kept, as the SQLite store keeps them.
        let cut = chrono::NaiveDate::parse_from_str(day, "%Y-%m-%d")
            .map(|d| (d - chrono::Duration::days(31)).to_string())
            .map_err(|e| e.to_string())?;
        self.stats.statements.fetch_add(1, Ordering::Relaxed);
        self.stats.round_trips.fetch_add(1, Ordering::Relaxed);
        self.timed(conn.client.execute(
            "DELETE FROM roundtable_budgets.tokens WHERE ns = $1 AND day < $2",
            &[&self.ns, &cut],
        ))
        .await
        .map(drop)
    }

    /// One reconcile: the queued batches sent (at most [`BATCHES_PER_ROUND`]) and the
    /// changes since the cursors read back, pipelined in one round trip; applied to the
    /// view. A failure drops the connection (the next round reconnects).
    async fn round(&mut self) -> Result<(), String> {
        let r = self.try_round().await;
        match &r {
            Ok(()) => {
                self.stats.rounds.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                self.conn = None;
                let quiet = self
                    .last_error_log
                    .is_some_and(|t| t.elapsed() < Duration::from_secs(10));
                if !quiet {
                    self.last_error_log = Some(Instant::now());
                    tracing::warn!(
                        store = %self.target.what,
                        error = %e,
                        waiting = self.queue.len(),
                        "budgets: the shared store could not be reached; the batches wait in the journal"
                    );
                }
            }
        }
        r
    }

    async fn try_round(&mut self) -> Result<(), String> {
        if self.conn.is_none() {
            self.connect(false).await?;
        }
        let day = match &self.view {
            Some(v) => v.day(),
            None => self.tokens_cursor.0.clone(),
        };
        if day != self.tokens_cursor.0 {
            // A new day: its counters read whole.
            self.tokens_cursor = (day.clone(), 0);
        }
        let now_ms = chrono::Utc::now().timestamp_millis();
        let since = now_ms - super::MINUTE_MS;
        let housekeeping = self
            .last_housekeeping
            .is_none_or(|t| t.elapsed() >= HOUSEKEEPING);
        let sending: Vec<Batch> = self.queue.iter().take(BATCHES_PER_ROUND).cloned().collect();
        let (written, read) = self
            .exchange(&sending, &day, now_ms, since, housekeeping)
            .await?;
        if housekeeping {
            self.last_housekeeping = Some(Instant::now());
        }
        let gone = written
            .iter()
            .flatten()
            .any(|r| r.get::<_, &str>(0).is_empty())
            || !read.iter().any(|r| r.get::<_, i32>(0) == 2);
        if gone {
            // Made again by the reconnect's agreement; the batches wait in the journal.
            return Err(format!(
                "the namespace {:?} has no row in the database (deleted, or the database \
                 restored from before it was made): nothing was written",
                self.ns
            ));
        }
        self.apply(&sending, &written, &read, &day);
        Ok(())
    }

    /// The round's statements, pipelined in one round trip: each batch's write, the read
    /// back, and (once a minute) the housekeeping.
    async fn exchange(
        &self,
        sending: &[Batch],
        day: &str,
        now_ms: i64,
        since: i64,
        housekeeping: bool,
    ) -> Result<(Vec<Vec<tokio_postgres::Row>>, Vec<tokio_postgres::Row>), String> {
        let conn = self.conn.as_ref().ok_or("not connected")?;
        // Each batch's parameters, owned for the pipelined futures.
        struct Params {
            tk_scope: Vec<String>,
            tk_key: Vec<String>,
            tk_n: Vec<i64>,
            tu_speaker: Vec<String>,
            tu_at: Vec<i64>,
        }
        let params: Vec<Params> = sending
            .iter()
            .map(|b| Params {
                tk_scope: b.tokens.iter().map(|t| t.0.clone()).collect(),
                // A key the database cannot hold (too long, a NUL) as its hash: one such
                // key wedged the queue (a batch refused at every round, then every start).
                tk_key: b
                    .tokens
                    .iter()
                    .map(|t| super::stored_key(&t.1).into_owned())
                    .collect(),
                tk_n: b
                    .tokens
                    .iter()
                    .map(|t| i64::try_from(t.2).unwrap_or(i64::MAX))
                    .collect(),
                tu_speaker: b
                    .turns
                    .iter()
                    .map(|t| super::stored_key(&t.0).into_owned())
                    .collect(),
                tu_at: b.turns.iter().map(|t| t.1).collect(),
            })
            .collect();
        type Arg<'a> = &'a (dyn tokio_postgres::types::ToSql + Sync);
        let args: Vec<[Arg<'_>; 9]> = sending
            .iter()
            .zip(&params)
            .map(|(b, p)| -> [Arg<'_>; 9] {
                [
                    &self.ns,
                    &b.id,
                    &b.day,
                    &p.tk_scope,
                    &p.tk_key,
                    &p.tk_n,
                    &p.tu_speaker,
                    &p.tu_at,
                    &b.origin,
                ]
            })
            .collect();
        let writes = args.iter().map(|a| conn.client.query(&conn.write, a));
        let writes = futures_util::future::try_join_all(writes);
        let read_args: [Arg<'_>; 6] = [
            &self.ns,
            &day,
            &self.tokens_cursor.1,
            &self.turns_cursor,
            &self.origin,
            &since,
        ];
        let read = conn.client.query(&conn.read, &read_args);
        let old_turns = now_ms - 2 * super::MINUTE_MS;
        let housework = async {
            if !housekeeping {
                return Ok(0);
            }
            conn.client
                .execute(
                    "WITH a AS (DELETE FROM roundtable_budgets.turns WHERE ns = $1 AND at_ms < $2),
                          b AS (DELETE FROM roundtable_budgets.batches WHERE ns = $1
                                AND applied_at < now() - interval '2 days')
                     SELECT 1",
                    &[&self.ns, &old_turns],
                )
                .await
        };
        let statements = sending.len() as u64 + 1 + u64::from(housekeeping);
        self.stats
            .statements
            .fetch_add(statements, Ordering::Relaxed);
        self.stats.round_trips.fetch_add(1, Ordering::Relaxed);
        let (written, read, _) = self
            .timed(async { futures_util::try_join!(writes, read, housework) })
            .await?;
        Ok((written, read))
    }

    /// Applies a round's answers: the batches acknowledged (their totals, then their
    /// deltas leave `pending`), the counters and turns that changed, the view fresh.
    fn apply(
        &mut self,
        sending: &[Batch],
        written: &[Vec<tokio_postgres::Row>],
        read: &[tokio_postgres::Row],
        day: &str,
    ) {
        // Applied: what the database acknowledged, then what changed.
        let mut acked_ids = Vec::with_capacity(sending.len());
        let mut by_day: BTreeMap<String, (Counts, Counts)> = BTreeMap::new();
        for (batch, rows) in sending.iter().zip(written) {
            let entry = by_day.entry(batch.day.clone()).or_default();
            entry.0.extend(batch.deltas());
            for r in rows {
                if let Some(k) =
                    CounterKey::from_columns(r.get::<_, &str>(0), r.get::<_, String>(1))
                {
                    let n = clamp_count(StoredCount::Integer(r.get(2))).count();
                    entry.1.push((k, n));
                }
            }
            acked_ids.push(batch.id.clone());
        }
        let mut changed = Vec::new();
        let mut turns = Vec::new();
        // The namespace's version below a cursor: the database went back (a restore, a
        // failover to a replica behind). Every later write would hide under the cursors,
        // the view fresh and blind: they start again, and the next round reads all.
        let now = read
            .iter()
            .find(|r| r.get::<_, i32>(0) == 2)
            .map_or(0, |r| r.get::<_, i64>(4));
        let went_back = now < self.tokens_cursor.1 || now < self.turns_cursor;
        for r in read {
            let version: i64 = r.get(4);
            let kind = r.get::<_, i32>(0);
            if kind == 2 {
                continue;
            }
            if kind == 0 {
                self.tokens_cursor.1 = self.tokens_cursor.1.max(version);
                if let Some(k) =
                    CounterKey::from_columns(r.get::<_, &str>(1), r.get::<_, String>(2))
                {
                    changed.push((k, clamp_count(StoredCount::Integer(r.get(3))).count()));
                }
            } else {
                self.turns_cursor = self.turns_cursor.max(version);
                turns.push((r.get::<_, String>(1), r.get::<_, i64>(3)));
            }
        }
        if went_back {
            tracing::warn!(
                namespace = %self.ns,
                version = now,
                read_up_to = self.tokens_cursor.1.max(self.turns_cursor),
                "budgets: the shared store's namespace is at an older version than this process read up to (the database restored, or a replica behind): its counters are read again whole"
            );
            self.tokens_cursor.1 = 0;
            self.turns_cursor = 0;
        }
        for _ in 0..sending.len() {
            self.queue.pop_front();
        }
        self.stats
            .batches
            .fetch_add(sending.len() as u64, Ordering::Relaxed);
        if let Some(view) = &self.view {
            // Totals first (read back after the writes: the newest), then the deltas leave
            // `pending`.
            let mine: Vec<(CounterKey, u64)> =
                by_day.get(day).map(|e| e.1.clone()).unwrap_or_default();
            let mut totals = mine;
            totals.extend(changed);
            view.totals(day, &totals);
            for (d, (deltas, _)) in &by_day {
                view.acknowledged(d, deltas, &[]);
            }
            view.turns(&turns);
            view.synced_day(day);
        }
        self.acked_out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(acked_ids);
    }
}

/// The database's `server_encoding` must hold any text a speaker id may be: UTF8, or
/// SQL_ASCII (bytes kept as sent). Another one (LATIN1, …) refuses the characters it lacks,
/// so one speaker's id failed every batch, at every round and every start.
fn check_encoding(encoding: &str) -> Result<(), String> {
    match encoding {
        "UTF8" | "SQL_ASCII" => Ok(()),
        other => Err(format!(
            "the database's server_encoding is {other:?}; the store needs UTF8 (or SQL_ASCII): \
             a speaker id with a character {other} cannot hold would fail every batch (create \
             the database with ENCODING 'UTF8')"
        )),
    }
}

fn differ(ns: &str, d: &[String], live: bool) -> String {
    format!(
        "the settings of namespace {ns:?} differ from this process's ({}){}; every process of a \
         namespace must have the same limits and time_zone",
        d.join("; "),
        if live {
            ", and another process of it is connected"
        } else {
            ""
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The query begins after the password, as libpq reads it: a `?` in a password is the
    /// password's (split at the URL's first `?`, its tail was read as the query, and shown
    /// in the error).
    #[test]
    fn a_question_mark_in_the_password_is_the_passwords() {
        let t = parse_url("postgres://u:a?b@h/db?sslmode=require").unwrap();
        assert_eq!(t.ssl, SslMode::Require);
        assert_eq!(t.config.get_password(), Some(&b"a?b"[..]));
        assert_eq!(t.config.get_dbname(), Some("db"));
        let e = match parse_url("postgres://u:pw?sslx@h/db?sslfoo=1") {
            Err(e) => e,
            Ok(_) => panic!("sslfoo accepted"),
        };
        assert_eq!(
            e,
            "its URL's sslfoo is not supported (sslmode and sslrootcert are)"
        );
        // Without a user, or with a `/` first, the first `?` begins the query.
        let t = parse_url("postgres://h?sslmode=verify-full&sslrootcert=/x.pem").unwrap();
        assert_eq!(t.ssl, SslMode::VerifyFull);
        let t = parse_url("postgres://h/db?sslmode=disable&application_name=a@b").unwrap();
        assert_eq!(t.ssl, SslMode::Disable);
    }

    /// `sslrootcert=system` implies `verify-full` and refuses a weaker mode, as libpq 16.
    #[test]
    fn sslrootcert_system_means_verify_full() {
        let t = parse_url("postgres://u@h/db?sslrootcert=system").unwrap();
        assert_eq!(t.ssl, SslMode::VerifyFull);
        let t = parse_url("postgres://u@h/db?sslrootcert=system&sslmode=verify-full").unwrap();
        assert_eq!(t.ssl, SslMode::VerifyFull);
        for weak in ["disable", "allow", "prefer", "require", "verify-ca"] {
            let e = match parse_url(&format!(
                "postgres://u@h/db?sslmode={weak}&sslrootcert=system"
            )) {
                Err(e) => e,
                Ok(_) => panic!("{weak} with system accepted"),
            };
            assert_eq!(
                e,
                format!("its URL's sslmode {weak} may not be used with sslrootcert=system (use verify-full)")
            );
        }
    }
}
