//! Usage accounting and budgets: what each turn used, counted by the host from the
//! upstream's own answers, and the limits an operator puts on a speaker, a channel and the
//! whole bot (`[budgets]`).
//!
//! Why a module of the core and not a crate: it sits on the same trust boundary as the
//! broker and the turn runner (it trusts the operator's configuration and the upstream's
//! `usage`, never the guest), and both of its checks are in the core's own paths, the
//! admission at the start of a turn's run ([`crate::Sandbox::run`]; before any workspace or container,
//! so `Sandbox::run_turn*` and the actor layer get it alike) and the broker's check before
//! each model call. The durable part is behind [`BudgetStore`]: the SQLite file
//! ([`SqliteStore`], `store`), or, when one bot runs as several processes, a PostgreSQL
//! database they share ([`PostgresStore`], `postgres`; the bound across processes and the
//! faults are in its doc and docs/design.md), each process reconciling through its
//! [`SharedView`].
//!
//! - [`HostUsage`]: one turn's usage as the host counted it (what `TurnOutcome::usage`
//!   carries). The reply's `usage` is the guest's own claim and is never read here;
//! - [`TurnAccount`]: one turn's running count, shared by the turn runner and its broker;
//! - [`BudgetBook`]: the counters in memory (today's tokens by speaker, channel and bot; the
//!   speakers' turns of the last minute), the checks, and a writer thread that commits the
//!   changes to the store off the callers' threads (charges and started turns gathered
//!   for [`COMMIT_INTERVAL`], then one transaction). Each token counter is a shared cell
//!   (`Slot`: total and unsaved, atomics); a turn's account resolves its speaker's,
//!   channel's and the bot's once per day, so a model call's check and charge take no lock
//!   of the book and hash no key (the day's end is checked against the clock each call);
//! - [`BudgetRefusal`]: which budget refused, and the message a guest reads.
//!
//! **The bound.** A turn is admitted only while every budget has room. A model call (the
//! guest's or the compactor's) is checked again just before it goes upstream, against the
//! tokens charged so far and every call in flight at its worst case (its prompt's estimate,
//! one token per 4 bytes, plus its clamped `model_request.max_tokens`); passing, its own
//! worst case is held at once, in the same step ([`TurnAccount::hold`], under the book's
//! lock). Its answer settles it: the upstream's `usage`, or the estimate of what was sent and
//! read. A call that never settles (the guest closed its connection, the turn ended or was
//! stopped, the deadline passed, the answer was past its cap) keeps its worst case: dropping
//! a call never costs less than letting it finish. The worst case is held, not the prompt
//! alone, because concurrent calls (one turn's `max_calls_in_flight`, or one speaker's turns
//! in several channels) would otherwise all pass a budget with little room left. So a budget
//! is passed by at most **one call**, the last whose check found room, whatever the number
//! of channels, turns or dropped calls: by its actual tokens (its prompt ≤
//! `max_request_bytes`, its completion ≤ `model_request.max_tokens`). Tested:
//! `budgets::concurrent_turns_of_one_speaker_pass_the_budget_by_at_most_one_call`,
//! `budgets::dropped_calls_are_charged_at_their_worst_case`.

mod postgres;
mod store;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use chrono::{DateTime, NaiveDate, TimeZone, Utc};

pub use crate::config::BudgetSettings;
pub use postgres::{PgStats, PostgresStore};
pub use store::{BudgetStore, CounterKey, SqliteStore, StoreError};
// The one rule for a stored count, for this workspace's tests (a store of the crate, the
// PostgreSQL one to come, uses it from `store`).
pub use store::{clamp_count, LoadReport, ReadCount, StoredCount, MAX_STORED, SATURATING_ADD};

/// One turn's use of the model and tools, as the host counted it: tokens from the
/// upstream's own `usage` of every completion the broker forwarded (compaction calls
/// included), or estimated where an answer had none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostUsage {
    /// Prompt (input) tokens.
    pub prompt_tokens: u64,
    /// Completion (output) tokens.
    pub completion_tokens: u64,
    /// Model calls sent upstream (compaction's included).
    pub model_calls: u32,
    /// Host and MCP tool calls run.
    pub tool_calls: u32,
    /// Some of the tokens are an estimate (an answer without `usage`: 1 token per 4 bytes
    /// of the request sent and of the answer).
    pub estimated: bool,
    /// Bytes sent through egress routes (paths, queries and bodies).
    pub egress_bytes_out: u64,
    /// Bytes read through egress routes (bodies).
    pub egress_bytes_in: u64,
}

impl HostUsage {
    /// Prompt plus completion tokens.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// The estimate for an answer without `usage`: one token per 4 bytes.
pub(crate) fn estimate_tokens(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(4)
}

/// One turn's running count, shared by the turn runner and the turn's broker, and the
/// turn's view of the budgets.
#[derive(Debug)]
pub struct TurnAccount {
    speaker: String,
    channel: String,
    book: Option<Arc<BudgetBook>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    model_calls: AtomicU32,
    tool_calls: AtomicU32,
    estimated: AtomicBool,
    egress_out: AtomicU64,
    egress_in: AtomicU64,
    refusal: Mutex<Option<BudgetRefusal>>,
    /// The turn's three counters in the book, resolved at its first call (read without a
    /// lock by every later call of that day: a turn's calls run on several threads at once).
    first: std::sync::OnceLock<TurnSlots>,
    /// Those of a later day, for a turn that runs past midnight.
    later: Mutex<Option<TurnSlots>>,
}

impl TurnAccount {
    /// The account of a turn of `speaker` (the key its budgets count under: the speaker's id,
    /// or the request's `limits_key`) in the channel of hash `channel`.
    pub fn new(speaker: &str, channel: &str, book: Option<Arc<BudgetBook>>) -> Self {
        Self {
            speaker: speaker.to_owned(),
            channel: channel.to_owned(),
            book,
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            model_calls: AtomicU32::new(0),
            tool_calls: AtomicU32::new(0),
            estimated: AtomicBool::new(false),
            egress_out: AtomicU64::new(0),
            egress_in: AtomicU64::new(0),
            refusal: Mutex::new(None),
            first: std::sync::OnceLock::new(),
            later: Mutex::new(None),
        }
    }

    /// A model call was sent upstream.
    pub fn count_model_call(&self) {
        self.model_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// A host or MCP tool call is run.
    pub fn count_tool_call(&self) {
        self.tool_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// An egress request: bytes sent and read.
    pub fn count_egress(&self, bytes_out: u64, bytes_in: u64) {
        saturating_add(&self.egress_out, bytes_out);
        saturating_add(&self.egress_in, bytes_in);
    }

    /// A model answer's tokens (from its `usage`, or `estimated`); charged to the budgets.
    pub fn charge(&self, prompt: u64, completion: u64, estimated: bool) {
        // (An upstream's `usage` is any u64: the turn's counts stop at the top as the
        // budgets' do, never wrap round to a small count the audit trail would show.)
        saturating_add(&self.prompt_tokens, prompt);
        saturating_add(&self.completion_tokens, completion);
        if estimated {
            self.estimated.store(true, Ordering::Relaxed);
        }
        let tokens = prompt.saturating_add(completion);
        if let (Some(book), true) = (&self.book, tokens > 0) {
            self.with_slots(book, |slots| book.charge_slots(slots, tokens));
        }
    }

    /// A model call is about to go upstream: every token budget must have room (the tokens
    /// charged so far and the calls in flight at their worst), and then its own worst case
    /// (the prompt's estimate and its clamped completion) is held on every budget until its
    /// answer settles it ([`CallCharge::settle`]). The check and the hold are one step
    /// under the book's lock, so every call that passes has seen every earlier call's hold.
    /// Dropped unsettled (the guest hung up, the turn ended, the deadline passed), the
    /// worst case is charged. A refusal is remembered (the turn's failure kind).
    pub fn hold(
        self: &Arc<Self>,
        prompt: u64,
        completion: u64,
    ) -> Result<CallCharge, BudgetRefusal> {
        let worst = prompt.saturating_add(completion);
        let slots = match &self.book {
            None => None,
            Some(book) => Some(
                self.with_slots(book, |s| book.check_and_hold(s, worst))
                    .inspect_err(|r| {
                        *self.refusal.lock().unwrap_or_else(|e| e.into_inner()) = Some(r.clone());
                    })?,
            ),
        };
        Ok(CallCharge {
            account: self.clone(),
            slots,
            prompt,
            completion,
            settled: false,
            counted: AtomicBool::new(false),
        })
    }

    /// Runs `f` on the turn's counters of today (resolved again after a day rolled over).
    fn with_slots<T>(&self, book: &BudgetBook, f: impl FnOnce(&TurnSlots) -> T) -> T {
        let day = book.day_now();
        let first = self
            .first
            .get_or_init(|| book.resolve(&self.speaker, &self.channel));
        if first.generation == day {
            return f(first);
        }
        let mut later = self.later.lock().unwrap_or_else(|e| e.into_inner());
        let slots = match &mut *later {
            Some(s) if s.generation == day => s,
            other => other.insert(book.resolve(&self.speaker, &self.channel)),
        };
        f(slots)
    }

    /// What the turn used so far.
    pub fn usage(&self) -> HostUsage {
        HostUsage {
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens: self.completion_tokens.load(Ordering::Relaxed),
            model_calls: self.model_calls.load(Ordering::Relaxed),
            tool_calls: self.tool_calls.load(Ordering::Relaxed),
            estimated: self.estimated.load(Ordering::Relaxed),
            egress_bytes_out: self.egress_out.load(Ordering::Relaxed),
            egress_bytes_in: self.egress_in.load(Ordering::Relaxed),
        }
    }

    /// The budget that refused one of this turn's model calls, if any did.
    pub fn refusal(&self) -> Option<BudgetRefusal> {
        self.refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A model call's charge from when its request goes upstream ([`TurnAccount::hold`]) until
/// its answer is read: settled with the upstream's `usage` (or an estimate), or, dropped
/// unsettled, charged at its worst case (the prompt's estimate and the clamped completion).
#[derive(Debug)]
#[must_use = "dropped unsettled, the call is charged at its worst case"]
pub struct CallCharge {
    account: Arc<TurnAccount>,
    /// The counters holding the worst case (none without a book).
    slots: Option<[Arc<Slot>; 3]>,
    prompt: u64,
    completion: u64,
    settled: bool,
    /// Counted as one of the turn's model calls ([`Self::count_sent`]).
    counted: AtomicBool,
}

impl CallCharge {
    /// Its request went upstream: counted as one of the turn's model calls (once).
    pub fn count_sent(&self) {
        if !self.counted.swap(true, Ordering::Relaxed) {
            self.account.count_model_call();
        }
    }

    /// The answer's tokens replace the worst case (`estimated`: not the upstream's count).
    pub fn settle(mut self, prompt: u64, completion: u64, estimated: bool) {
        self.settled = true;
        self.release();
        self.account.charge(prompt, completion, estimated);
    }

    fn release(&self) {
        if let Some(slots) = &self.slots {
            let worst = self.prompt.saturating_add(self.completion);
            for slot in slots {
                slot.release(worst);
            }
        }
    }
}

impl Drop for CallCharge {
    fn drop(&mut self) {
        if !self.settled {
            self.release();
            self.account.charge(self.prompt, self.completion, true);
            // Charged as sent (a call the guest dropped while the upstream worked): counted
            // as sent too (the turn's usage told fewer calls than reached the upstream).
            self.count_sent();
        }
    }
}

impl TurnAccount {
    /// An egress request is about to be sent: every egress budget of the turn's speaker
    /// and channel must have room, and then the request's worst case (`worst` bytes: what it
    /// may send and read, its redirects' included) is held on them until its bytes settle
    /// it ([`EgressCharge::settle`]); dropped unsettled, the worst case is charged. So an
    /// egress budget is passed by at most one request, as a token budget by one call.
    pub fn hold_egress(self: &Arc<Self>, worst: u64) -> Result<EgressCharge, BudgetRefusal> {
        let slots = match &self.book {
            None => Vec::new(),
            Some(book) => book.check_and_hold_egress(&self.speaker, &self.channel, worst)?,
        };
        Ok(EgressCharge {
            account: self.clone(),
            slots,
            worst,
            settled: false,
        })
    }
}

/// An egress request's charge on the egress budgets, from its check until its bytes are
/// known ([`TurnAccount::hold_egress`]).
#[derive(Debug)]
#[must_use = "dropped unsettled, the request is charged at its worst case"]
pub struct EgressCharge {
    account: Arc<TurnAccount>,
    slots: Vec<Arc<Slot>>,
    worst: u64,
    settled: bool,
}

impl EgressCharge {
    /// The request's bytes, sent and read: counted for the turn and charged to the budgets
    /// in place of its worst case.
    pub fn settle(mut self, bytes_out: u64, bytes_in: u64) {
        self.settled = true;
        self.release();
        self.account.count_egress(bytes_out, bytes_in);
        if let Some(book) = &self.account.book {
            book.charge_egress(&self.slots, bytes_out.saturating_add(bytes_in));
        }
    }

    fn release(&self) {
        for slot in &self.slots {
            slot.release(self.worst);
        }
    }
}

impl Drop for EgressCharge {
    fn drop(&mut self) {
        if !self.settled {
            self.release();
            if let Some(book) = &self.account.book {
                book.charge_egress(&self.slots, self.worst);
            }
        }
    }
}

/// A budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Budget {
    /// `speaker_tokens_per_day`.
    SpeakerTokensPerDay,
    /// `channel_tokens_per_day`.
    ChannelTokensPerDay,
    /// `bot_tokens_per_day`.
    BotTokensPerDay,
    /// `speaker_turns_per_minute`.
    SpeakerTurnsPerMinute,
    /// `speaker_egress_bytes_per_day`.
    SpeakerEgressBytesPerDay,
    /// `channel_egress_bytes_per_day`.
    ChannelEgressBytesPerDay,
    /// `store`: the shared store's view is older than `max_staleness_secs` (the database
    /// not reached), so no budget can be checked against the other processes' spend.
    Store,
}

impl Budget {
    /// Its key in `[budgets]`.
    pub fn key(self) -> &'static str {
        match self {
            Budget::SpeakerTokensPerDay => "speaker_tokens_per_day",
            Budget::ChannelTokensPerDay => "channel_tokens_per_day",
            Budget::BotTokensPerDay => "bot_tokens_per_day",
            Budget::SpeakerTurnsPerMinute => "speaker_turns_per_minute",
            Budget::SpeakerEgressBytesPerDay => "speaker_egress_bytes_per_day",
            Budget::ChannelEgressBytesPerDay => "channel_egress_bytes_per_day",
            Budget::Store => "store",
        }
    }
}

/// A budget refused a turn or a model call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("budget {} exceeded: {message}", .budget.key())]
pub struct BudgetRefusal {
    /// Which budget.
    pub budget: Budget,
    /// Its limit.
    pub limit: u64,
    /// What the guest is told, e.g. "this speaker has used today's 50000 tokens; the budget
    /// resets at 00:00 UTC".
    pub message: String,
}

/// The current time (injected in tests).
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// The book's side of a store shared by several processes ([`BudgetStore::share`]): the
/// store reports through it what the database acknowledged of this process's charges, the
/// totals the other processes' charges made, their turns, and when it last reconciled
/// (the view's age, which the admission and every model call and egress request check
/// against `max_staleness_secs`). The age is measured on the monotonic clock: a wall
/// clock stepped back (by hand, or an NTP step during the outage) made it negative, and a
/// stale view passed for a fresh one; the wall clock (the injected one in tests) is kept
/// for the days and the turns' stamps.
#[derive(Clone)]
pub struct SharedView {
    inner: Arc<ViewInner>,
}

struct ViewInner {
    state: SharedState,
    clock: Option<Clock>,
    /// The monotonic clock's origin for [`Self::synced_ms`] and [`Self::warned_ms`].
    origin: std::time::Instant,
    /// When the store last reconciled (ms since `origin`).
    synced_ms: AtomicI64,
    max_staleness_ms: i64,
    fail_open: bool,
    /// Whether the store has read the book's day back since the book turned to it: a day
    /// rolled over starts at zero in memory, and an idle process's first turns of the day
    /// were checked against zero while the others had spent it.
    day_read: AtomicBool,
    /// Whether the view was stale at the writer's last look (its transitions are told).
    stale: AtomicBool,
    /// When the last warning of a stale view was logged (ms since `origin`).
    warned_ms: AtomicI64,
    events: std::sync::OnceLock<Arc<crate::events::EventHub>>,
    /// The PostgreSQL store's counts (statements, round trips), for the bench.
    stats: std::sync::OnceLock<Arc<PgStats>>,
}

impl std::fmt::Debug for SharedView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedView")
            .field("synced_ms", &self.inner.synced_ms)
            .finish_non_exhaustive()
    }
}

impl SharedView {
    /// Now on the monotonic clock (ms since the view was made).
    fn mono_ms(&self) -> i64 {
        i64::try_from(self.inner.origin.elapsed().as_millis()).unwrap_or(i64::MAX)
    }

    fn now_ms(&self) -> i64 {
        self.inner
            .clock
            .as_ref()
            .map_or_else(Utc::now, |c| c())
            .timestamp_millis()
    }

    /// The book's current day (`YYYY-MM-DD` in the configured zone): the day whose
    /// counters the store reads back.
    pub fn day(&self) -> String {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .day
            .to_string()
    }

    /// The store holds these charges of this process now (`day`'s; `totals`: each
    /// counter's total in the store after them, every process's charges, when known).
    pub fn acknowledged(
        &self,
        day: &str,
        deltas: &[(CounterKey, u64)],
        totals: &[(CounterKey, u64)],
    ) {
        let mut st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.day.to_string() != day {
            return;
        }
        for (key, total) in totals {
            st.tokens.slot_of(key).set_base(*total);
        }
        for (key, delta) in deltas {
            if let Some(slot) = st.tokens.find(key) {
                slot.acknowledge(*delta);
            }
        }
    }

    /// Counters of `day` that changed in the store (by any process): their totals.
    pub fn totals(&self, day: &str, totals: &[(CounterKey, u64)]) {
        self.acknowledged(day, &[], totals);
    }

    /// Turns the other processes started (speaker, Unix ms by the admitting process's
    /// clock); one stamped after this process's now counts as started now.
    pub fn turns(&self, turns: &[(String, i64)]) {
        if turns.is_empty() {
            return;
        }
        let now_ms = self.now_ms();
        let mut st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        for (speaker, at) in turns {
            let at = (*at).min(now_ms);
            if at <= now_ms - MINUTE_MS {
                continue;
            }
            let window = st.turns.entry(speaker.clone()).or_default();
            // Kept in order: a turn of another process may be older than this one's last.
            let i = window.partition_point(|&t| t <= at);
            window.insert(i, at);
        }
    }

    /// The PostgreSQL store's counts, once it shares the view.
    pub(crate) fn set_stats(&self, stats: Arc<PgStats>) {
        let _ = self.inner.stats.set(stats);
    }

    /// The store reconciled just now: the view is fresh.
    pub fn synced(&self) {
        self.inner
            .synced_ms
            .store(self.mono_ms(), Ordering::Relaxed);
    }

    /// The store reconciled just now and read `day`'s counters back: when that is still the
    /// book's day, its turns may be admitted.
    pub fn synced_day(&self, day: &str) {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.day.to_string() == day {
            self.inner.day_read.store(true, Ordering::Relaxed);
        }
        drop(st);
        self.synced();
    }

    /// How old the view is (ms, monotonic: never negative).
    fn age_ms(&self) -> i64 {
        self.mono_ms()
            .saturating_sub(self.inner.synced_ms.load(Ordering::Relaxed))
            .max(0)
    }

    /// Refuses a turn while the view is older than `max_staleness_secs` (unless fail open),
    /// or while a new day has not been read.
    fn check(&self) -> Result<(), BudgetRefusal> {
        self.check_fresh("new turns")?;
        if self.inner.fail_open || self.inner.day_read.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(BudgetRefusal {
            budget: Budget::Store,
            limit: (self.inner.max_staleness_ms / 1000) as u64,
            message: "a new day began and the budgets' shared database has not been read \
                      for it yet: new turns are refused until it is (the next commit \
                      interval)"
                .into(),
        })
    }

    /// Refuses `what` (new turns; a running turn's model calls, its egress requests) while
    /// the view is older than `max_staleness_secs`, unless fail open.
    fn check_fresh(&self, what: &str) -> Result<(), BudgetRefusal> {
        let age = self.age_ms();
        if age <= self.inner.max_staleness_ms || self.inner.fail_open {
            return Ok(());
        }
        Err(BudgetRefusal {
            budget: Budget::Store,
            limit: (self.inner.max_staleness_ms / 1000) as u64,
            message: format!(
                "the budgets' shared database has not been reached for {} s (max_staleness_secs = \
                 {}): {what} are refused until it is back",
                age / 1000,
                self.inner.max_staleness_ms / 1000
            ),
        })
    }

    /// The writer's look at each tick: a view that turned stale (or fresh again) is told
    /// once, as a warning and an event (the metrics' gauge); a stale one is warned again
    /// every minute.
    fn watch(&self) {
        let age = self.age_ms();
        let stale = age > self.inner.max_staleness_ms;
        let was = self.inner.stale.swap(stale, Ordering::Relaxed);
        let now = self.mono_ms();
        if stale {
            let last = self.inner.warned_ms.load(Ordering::Relaxed);
            if !was || now - last >= MINUTE_MS {
                self.inner.warned_ms.store(now, Ordering::Relaxed);
                tracing::warn!(
                    age_secs = age / 1000,
                    max_staleness_secs = self.inner.max_staleness_ms / 1000,
                    fail_open = self.inner.fail_open,
                    "budgets: the shared database has not been reached; {}",
                    if self.inner.fail_open {
                        "turns are admitted on this process's own counts (fail_open)"
                    } else {
                        "new turns, model calls and egress requests are refused until it is back"
                    }
                );
            }
        } else if was {
            tracing::info!("budgets: the shared database is reached again; turns are admitted");
        }
        if stale != was {
            if let Some(events) = self.inner.events.get() {
                events.emit(None, None, crate::events::EventKind::BudgetStore { stale });
            }
        }
    }
}

/// What the writer thread commits.
enum Write {
    Tokens {
        day: String,
        deltas: Vec<(CounterKey, u64)>,
    },
    NewDay(String),
    Flush(mpsc::SyncSender<()>),
}

/// One of today's token counters (a speaker's, a channel's or the bot's): its total and
/// what the writer has not taken yet. A turn's account holds its three (resolved once per
/// day), so a model call's check and charge are a few atomic operations, no lookup and no
/// lock of the book (the book's lock is taken when a counter turns dirty, once per commit
/// interval per counter).
///
/// The total is `base + pending`: `base` what the store said (loaded at the start; with a
/// shared store, the database's total as last read back, every process's charges), and
/// `pending` this process's charges not yet in `base` (with a store of its own, every
/// charge since the start; with a shared store, until the database acknowledged them).
#[derive(Debug)]
struct Slot {
    key: CounterKey,
    base: AtomicU64,
    pending: AtomicU64,
    unsaved: AtomicU64,
    /// The worst cases of the model calls in flight ([`CallCharge`]): counted by every
    /// check, never stored.
    held: AtomicU64,
}

/// Adds `n` to `a`, saturating; what `a` held before.
fn saturating_add(a: &AtomicU64, n: u64) -> u64 {
    a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
        Some(h.saturating_add(n))
    })
    .unwrap_or_else(|h| h)
}

/// Subtracts `n` from `a`, stopping at 0.
fn saturating_sub(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
        Some(h.saturating_sub(n))
    });
}

impl Slot {
    fn new(key: CounterKey, base: u64) -> Arc<Self> {
        Arc::new(Self {
            key,
            base: AtomicU64::new(base),
            pending: AtomicU64::new(0),
            unsaved: AtomicU64::new(0),
            held: AtomicU64::new(0),
        })
    }

    fn total(&self) -> u64 {
        self.base
            .load(Ordering::Relaxed)
            .saturating_add(self.pending.load(Ordering::Relaxed))
    }

    /// What the checks count: the charged total and the calls in flight at their worst.
    fn used(&self) -> u64 {
        self.total()
            .saturating_add(self.held.load(Ordering::Relaxed))
    }

    fn hold(&self, n: u64) {
        saturating_add(&self.held, n);
    }

    fn release(&self, n: u64) {
        saturating_sub(&self.held, n);
    }

    /// Adds `n`, saturating (an upstream's `usage` is any `u64`); whether the slot had
    /// nothing unsaved (the caller lists it for the writer).
    fn add(&self, n: u64) -> bool {
        saturating_add(&self.pending, n);
        saturating_add(&self.unsaved, n) == 0
    }

    /// A shared store's total for this counter (every process's charges it holds).
    /// Set before the acknowledged charges leave `pending`: in between, a check counts
    /// them twice (refuses early), never not at all.
    fn set_base(&self, total: u64) {
        self.base.store(total, Ordering::Relaxed);
    }

    /// `delta` of this process's charges is in the shared store's total now.
    fn acknowledge(&self, delta: u64) {
        saturating_sub(&self.pending, delta);
    }
}

/// The three counters a turn's calls are checked against and charged to, of one day
/// (`generation`: the book's day count when they were resolved).
#[derive(Debug)]
struct TurnSlots {
    generation: u64,
    speaker: Arc<Slot>,
    channel: Arc<Slot>,
    bot: Arc<Slot>,
}

/// Today's token counters by speaker, channel and for the whole bot, and the egress bytes'
/// by speaker and channel (`egress`).
struct Counters {
    speakers: HashMap<String, Arc<Slot>>,
    channels: HashMap<String, Arc<Slot>>,
    bot: Arc<Slot>,
    egress: HashMap<CounterKey, Arc<Slot>>,
}

impl Counters {
    fn new() -> Self {
        Self {
            speakers: HashMap::new(),
            channels: HashMap::new(),
            bot: Slot::new(CounterKey::Bot, 0),
            egress: HashMap::new(),
        }
    }

    fn from_keys(keys: impl IntoIterator<Item = (CounterKey, u64)>) -> Self {
        let mut c = Self::new();
        for (key, n) in keys {
            c.slot_of(&key).set_base(n);
        }
        c
    }

    /// The counter of `key` (made if new).
    fn slot_of(&mut self, key: &CounterKey) -> Arc<Slot> {
        match key {
            CounterKey::Speaker(s) => self.speaker_slot(s),
            CounterKey::Channel(h) => self.channel_slot(h),
            CounterKey::Bot => self.bot.clone(),
            egress => self
                .egress
                .entry(egress.clone())
                .or_insert_with(|| Slot::new(egress.clone(), 0))
                .clone(),
        }
    }

    /// The counter of `key`, if there is one.
    fn find(&self, key: &CounterKey) -> Option<&Arc<Slot>> {
        match key {
            CounterKey::Speaker(s) => self.speakers.get(s),
            CounterKey::Channel(h) => self.channels.get(h),
            CounterKey::Bot => Some(&self.bot),
            egress => self.egress.get(egress),
        }
    }

    fn slot(
        map: &mut HashMap<String, Arc<Slot>>,
        key: &str,
        make: fn(String) -> CounterKey,
    ) -> Arc<Slot> {
        match map.get(key) {
            Some(s) => s.clone(),
            None => {
                let s = Slot::new(make(key.to_owned()), 0);
                map.insert(key.to_owned(), s.clone());
                s
            }
        }
    }

    fn speaker_slot(&mut self, speaker: &str) -> Arc<Slot> {
        Self::slot(&mut self.speakers, speaker, CounterKey::Speaker)
    }

    fn channel_slot(&mut self, channel: &str) -> Arc<Slot> {
        Self::slot(&mut self.channels, channel, CounterKey::Channel)
    }

    /// What the checks count of a speaker's counter (see [`Slot::used`]).
    fn speaker(&self, speaker: &str) -> u64 {
        self.speakers.get(speaker).map_or(0, |s| s.used())
    }

    /// What the checks count of a channel's counter.
    fn channel(&self, channel: &str) -> u64 {
        self.channels.get(channel).map_or(0, |s| s.used())
    }

    /// A counter's charged total.
    fn get(&self, key: &CounterKey) -> u64 {
        self.find(key).map_or(0, |s| s.total())
    }
}

/// Counters charged and turns started since the writer last took them (the counters' of
/// one day).
#[derive(Default)]
struct Unsaved {
    day: String,
    dirty: Vec<Arc<Slot>>,
    /// Turns started (speaker, Unix ms), for the speakers' turns per minute.
    turns: Vec<(String, i64)>,
}

impl Unsaved {
    /// The dirty counters' unsaved tokens, as the store's keys; each counter's unsaved is
    /// taken (a charge after this lists its counter again).
    fn drain(&mut self) -> Vec<(CounterKey, u64)> {
        self.dirty
            .drain(..)
            .filter_map(|s| {
                let n = s.unsaved.swap(0, Ordering::Relaxed);
                (n > 0).then(|| (s.key.clone(), n))
            })
            .collect()
    }
}

struct BookState {
    day: NaiveDate,
    /// The UTC instants `day` starts and ends at in the configured zone: a call inside them
    /// is of `day`, without a time-zone conversion.
    day_span: (DateTime<Utc>, DateTime<Utc>),
    tokens: Counters,
    /// Each speaker's turn starts (Unix ms) within the last minute.
    turns: HashMap<String, VecDeque<i64>>,
    /// Charged, not yet taken by the writer.
    unsaved: Unsaved,
}

type SharedState = Arc<Mutex<BookState>>;

/// What the writer takes for a commit: the unsaved deltas (and their day) and the turns
/// started.
struct Taken {
    day: String,
    deltas: Vec<(CounterKey, u64)>,
    turns: Vec<(String, i64)>,
}

/// Takes what waits for the writer (`None`: nothing).
fn take_unsaved(state: &SharedState) -> Option<Taken> {
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    let deltas = st.unsaved.drain();
    let turns = std::mem::take(&mut st.unsaved.turns);
    let day = std::mem::take(&mut st.unsaved.day);
    (!deltas.is_empty() || !turns.is_empty()).then_some(Taken { day, deltas, turns })
}

/// The budgets' counters, checks and writer (see the module doc).
pub struct BudgetBook {
    settings: BudgetSettings,
    tz: chrono_tz::Tz,
    /// `None`: the system's clock (read as Unix ms without chrono on a call's path).
    clock: Option<Clock>,
    state: SharedState,
    /// Days begun since the book opened (bumped at each rollover, under the state's lock):
    /// a turn's resolved counters are of the current day while theirs matches.
    generation: AtomicU64,
    /// The current day's span as Unix ms (floor of its start, floor of its end), for a
    /// check without the lock that a call is inside it.
    span_ms: [AtomicI64; 2],
    writer: Mutex<Option<mpsc::Sender<Write>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Held while a model call's check and hold run ([`TurnAccount::hold`]).
    holding: Mutex<()>,
    state_file: Option<PathBuf>,
    /// With a store shared by several processes: its view (the admission's staleness).
    shared: Option<SharedView>,
}

impl std::fmt::Debug for BudgetBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BudgetBook")
            .field("settings", &self.settings)
            .field("tz", &self.tz)
            .finish_non_exhaustive()
    }
}

const MINUTE_MS: i64 = 60_000;

/// The longest speaker key the stores keep as it is (bytes).
pub const MAX_STORED_KEY: usize = 256;

/// The key a speaker's budgets count under, as the stores keep it: the id itself, or, for
/// one longer than [`MAX_STORED_KEY`] or holding a NUL (which PostgreSQL's text refuses,
/// and a primary key's index cannot hold past about 2.7 KB: either wedged the shared
/// store's queue for every speaker), `sha256:` and the id's SHA-256 in hex. Applied once,
/// where a turn's key is made ([`crate::turn::TurnRequest`]'s), and again by the shared
/// store before it writes (a no-op on a key made here).
pub fn stored_key(id: &str) -> std::borrow::Cow<'_, str> {
    use sha2::Digest as _;
    if id.len() <= MAX_STORED_KEY && !id.contains('\0') {
        return std::borrow::Cow::Borrowed(id);
    }
    std::borrow::Cow::Owned(format!("sha256:{}", hex::encode(sha2::Sha256::digest(id))))
}

impl BudgetBook {
    /// Opens the state file of `settings` (see [`SqliteStore::open`]) and reads today's
    /// counters; `None` when no state file is named.
    pub fn open(
        settings: &BudgetSettings,
        time_zone: &str,
    ) -> Result<Option<Arc<Self>>, StoreError> {
        let Some(path) = &settings.state_file else {
            return Ok(None);
        };
        let store: Box<dyn BudgetStore> = match &settings.store {
            Some(_) => Box::new(PostgresStore::open(settings, time_zone)?),
            None => Box::new(SqliteStore::open(path)?),
        };
        Self::build(settings, time_zone, store, None).map(Some)
    }

    /// A book on any store, with the clock `clock`.
    pub fn with_store(
        settings: &BudgetSettings,
        time_zone: &str,
        store: Box<dyn BudgetStore>,
        clock: Clock,
    ) -> Result<Arc<Self>, StoreError> {
        Self::build(settings, time_zone, store, Some(clock))
    }

    fn build(
        settings: &BudgetSettings,
        time_zone: &str,
        mut store: Box<dyn BudgetStore>,
        clock: Option<Clock>,
    ) -> Result<Arc<Self>, StoreError> {
        let now = clock.as_ref().map_or_else(Utc::now, |c| c());
        let tz: chrono_tz::Tz = time_zone.parse().unwrap_or(chrono_tz::UTC);
        let loaded = load_start(store.as_mut(), tz, now)?;
        let day = loaded.day;
        let tokens = Counters::from_keys(loaded.tokens);
        let mut turns: HashMap<String, VecDeque<i64>> = HashMap::new();
        for (speaker, at) in loaded.turns {
            turns.entry(speaker).or_default().push_back(at);
        }
        let (tx, rx) = mpsc::channel::<Write>();
        let span = day_span(tz, now);
        let state: SharedState = Arc::new(Mutex::new(BookState {
            day,
            day_span: span,
            tokens,
            turns,
            unsaved: Unsaved::default(),
        }));
        let view = SharedView {
            inner: Arc::new(ViewInner {
                state: state.clone(),
                clock: clock.clone(),
                origin: std::time::Instant::now(),
                synced_ms: AtomicI64::new(0),
                max_staleness_ms: i64::try_from(settings.effective_max_staleness().as_millis())
                    .unwrap_or(i64::MAX),
                fail_open: settings.fail_open,
                day_read: AtomicBool::new(true),
                stale: AtomicBool::new(false),
                warned_ms: AtomicI64::new(0),
                events: std::sync::OnceLock::new(),
                stats: std::sync::OnceLock::new(),
            }),
        };
        let shared = store.share(view.clone()).then_some(view);
        let watch = shared.clone();
        let writer_state = state.clone();
        let thread = std::thread::Builder::new()
            .name("budget-writer".into())
            .spawn(move || writer(store, rx, writer_state, watch))
            .map_err(|e| StoreError::Open {
                path: settings.state_file.clone().unwrap_or_default(),
                reason: format!("start the writer thread: {e}"),
            })?;
        Ok(Arc::new(Self {
            settings: settings.clone(),
            tz,
            clock,
            state,
            generation: AtomicU64::new(0),
            span_ms: [
                AtomicI64::new(span.0.timestamp_millis()),
                AtomicI64::new(span.1.timestamp_millis()),
            ],
            writer: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            holding: Mutex::new(()),
            state_file: settings.state_file.clone(),
            shared,
        }))
    }

    /// The settings.
    pub fn settings(&self) -> &BudgetSettings {
        &self.settings
    }

    /// Reports the shared store's view turning stale or fresh on `events` (the metrics'
    /// gauge): set once, by the runtime that owns the book.
    pub(crate) fn observe(&self, events: Arc<crate::events::EventHub>) {
        if let Some(view) = &self.shared {
            let _ = view.inner.events.set(events);
        }
    }

    /// With the PostgreSQL store: what it sent (statements, round trips, rounds).
    pub fn store_stats(&self) -> Option<Arc<PgStats>> {
        self.shared
            .as_ref()
            .and_then(|v| v.inner.stats.get().cloned())
    }

    /// With a shared store: how old this process's view of the other processes' spend is.
    pub fn shared_view_age(&self) -> Option<std::time::Duration> {
        self.shared
            .as_ref()
            .map(|v| std::time::Duration::from_millis(v.age_ms().max(0) as u64))
    }

    /// The state file, if the store is one.
    pub fn state_file(&self) -> Option<&std::path::Path> {
        self.state_file.as_deref()
    }

    fn send(&self, w: Write) {
        if let Some(tx) = &*self.writer.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = tx.send(w);
        }
    }

    /// The state, rolled over to the day of `now` in the configured zone.
    fn state(&self, now: DateTime<Utc>) -> std::sync::MutexGuard<'_, BookState> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now >= st.day_span.0 && now < st.day_span.1 {
            return st;
        }
        st.day_span = day_span(self.tz, now);
        self.span_ms[0].store(st.day_span.0.timestamp_millis(), Ordering::Relaxed);
        self.span_ms[1].store(st.day_span.1.timestamp_millis(), Ordering::Relaxed);
        let day = now.with_timezone(&self.tz).date_naive();
        if day != st.day {
            // The last day's unsaved charges go first, under their own day.
            let deltas = st.unsaved.drain();
            let old = std::mem::take(&mut st.unsaved.day);
            if !deltas.is_empty() {
                self.send(Write::Tokens { day: old, deltas });
            }
            st.day = day;
            st.tokens = Counters::new();
            if let Some(view) = &self.shared {
                view.inner.day_read.store(false, Ordering::Relaxed);
            }
            self.generation.fetch_add(1, Ordering::Release);
            self.send(Write::NewDay(day.to_string()));
        }
        st
    }

    fn now(&self) -> DateTime<Utc> {
        self.clock.as_ref().map_or_else(Utc::now, |c| c())
    }

    /// The current day's number ([`Self::generation`]), rolled over first when the clock
    /// has left the day; without the lock while it has not.
    fn day_now(&self) -> u64 {
        let ms = match &self.clock {
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            Some(clock) => clock().timestamp_millis(),
        };
        // Inside for sure: `now` is at or past the start's ms floor + 1 and before the
        // end's ms floor (both spans' instants are compared exactly under the lock).
        let inside = ms > self.span_ms[0].load(Ordering::Relaxed)
            && ms < self.span_ms[1].load(Ordering::Relaxed);
        if !inside {
            drop(self.state(self.now()));
        }
        self.generation.load(Ordering::Acquire)
    }

    /// The counters of `speaker`, `channel` and the bot today.
    fn resolve(&self, speaker: &str, channel: &str) -> TurnSlots {
        let mut st = self.state(self.now());
        TurnSlots {
            generation: self.generation.load(Ordering::Acquire),
            speaker: st.tokens.speaker_slot(speaker),
            channel: st.tokens.channel_slot(channel),
            bot: st.tokens.bot.clone(),
        }
    }

    /// With a shared store whose view is stale (unless fail open): a running turn's model
    /// call (or egress request) is refused, as a new turn is. Without it, every turn
    /// admitted before the database went away went on charging on this process's own
    /// counts, in every channel, for as long as the outage lasted. Only when one of the
    /// budgets it would be checked against is set.
    fn check_shared_fresh(&self, what: &str, budgeted: bool) -> Result<(), BudgetRefusal> {
        match &self.shared {
            Some(view) if budgeted => view.check_fresh(what),
            _ => Ok(()),
        }
    }

    /// Checks `slots` and holds `worst` on them, in one step (see [`TurnAccount::hold`]).
    fn check_and_hold(
        &self,
        slots: &TurnSlots,
        worst: u64,
    ) -> Result<[Arc<Slot>; 3], BudgetRefusal> {
        let s = &self.settings;
        let budgeted = s.speaker_tokens_per_day.is_some()
            || s.channel_tokens_per_day.is_some()
            || s.bot_tokens_per_day.is_some();
        self.check_shared_fresh("model calls", budgeted)?;
        let _one_at_a_time = self.holding.lock().unwrap_or_else(|e| e.into_inner());
        self.check_slots(slots)?;
        for slot in [&slots.speaker, &slots.channel, &slots.bot] {
            slot.hold(worst);
        }
        Ok([
            slots.speaker.clone(),
            slots.channel.clone(),
            slots.bot.clone(),
        ])
    }

    fn check_slots(&self, slots: &TurnSlots) -> Result<(), BudgetRefusal> {
        self.token_check_of(slots.speaker.used(), slots.channel.used(), slots.bot.used())
    }

    /// Adds `tokens` to `slots`' counters; a counter that turns dirty is listed for the
    /// writer.
    fn charge_slots(&self, slots: &TurnSlots, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let turned =
            [&slots.speaker, &slots.channel, &slots.bot].map(|s| s.add(tokens).then_some(s));
        if turned.iter().all(Option::is_none) {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut *st;
        if st.unsaved.dirty.is_empty() {
            st.unsaved.day = st.day.to_string();
        }
        st.unsaved
            .dirty
            .extend(turned.into_iter().flatten().cloned());
    }

    /// The egress budgets set, with today's counters of `speaker` and `channel` (made if
    /// new; an egress budget not set counts nothing).
    fn egress_slots(&self, speaker: &str, channel: &str) -> Vec<(Budget, u64, Arc<Slot>)> {
        let s = &self.settings;
        let mut st = self.state(self.now());
        let mut out = Vec::new();
        if let Some(limit) = s.speaker_egress_bytes_per_day {
            let key = CounterKey::SpeakerEgress(speaker.to_owned());
            out.push((
                Budget::SpeakerEgressBytesPerDay,
                limit,
                st.tokens.slot_of(&key),
            ));
        }
        if let Some(limit) = s.channel_egress_bytes_per_day {
            let key = CounterKey::ChannelEgress(channel.to_owned());
            out.push((
                Budget::ChannelEgressBytesPerDay,
                limit,
                st.tokens.slot_of(&key),
            ));
        }
        out
    }

    /// Every egress budget of `speaker` and `channel` has room (the bytes charged today and
    /// the requests in flight at their worst), and then `worst` is held on each, in one
    /// step under the book's lock (as a model call's tokens: [`TurnAccount::hold`]).
    fn check_and_hold_egress(
        &self,
        speaker: &str,
        channel: &str,
        worst: u64,
    ) -> Result<Vec<Arc<Slot>>, BudgetRefusal> {
        let slots = self.egress_slots(speaker, channel);
        self.check_shared_fresh("egress requests", !slots.is_empty())?;
        let _one_at_a_time = self.holding.lock().unwrap_or_else(|e| e.into_inner());
        for (budget, limit, slot) in &slots {
            if slot.used() >= *limit {
                let who = match budget {
                    Budget::SpeakerEgressBytesPerDay => "this speaker",
                    _ => "this channel",
                };
                return Err(BudgetRefusal {
                    budget: *budget,
                    limit: *limit,
                    message: format!(
                        "{who} has used today's {limit} egress bytes; {}",
                        self.resets()
                    ),
                });
            }
        }
        Ok(slots
            .into_iter()
            .map(|(_, _, slot)| {
                slot.hold(worst);
                slot
            })
            .collect())
    }

    /// Adds `bytes` to the egress counters `slots`; a counter that turns dirty is listed
    /// for the writer.
    fn charge_egress(&self, slots: &[Arc<Slot>], bytes: u64) {
        if bytes == 0 {
            return;
        }
        let turned: Vec<Arc<Slot>> = slots.iter().filter(|s| s.add(bytes)).cloned().collect();
        if turned.is_empty() {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.unsaved.dirty.is_empty() {
            st.unsaved.day = st.day.to_string();
        }
        st.unsaved.dirty.extend(turned);
    }

    fn resets(&self) -> String {
        format!("the budget resets at 00:00 {}", self.tz.name())
    }

    fn token_check(
        &self,
        st: &BookState,
        speaker: &str,
        channel: &str,
    ) -> Result<(), BudgetRefusal> {
        self.token_check_of(
            st.tokens.speaker(speaker),
            st.tokens.channel(channel),
            st.tokens.bot.used(),
        )
    }

    /// Every token budget has room, with these counts used today.
    fn token_check_of(&self, speaker: u64, channel: u64, bot: u64) -> Result<(), BudgetRefusal> {
        let s = &self.settings;
        let checks = [
            (
                Budget::SpeakerTokensPerDay,
                s.speaker_tokens_per_day,
                speaker,
                "this speaker",
            ),
            (
                Budget::ChannelTokensPerDay,
                s.channel_tokens_per_day,
                channel,
                "this channel",
            ),
            (
                Budget::BotTokensPerDay,
                s.bot_tokens_per_day,
                bot,
                "the bot",
            ),
        ];
        for (budget, limit, used, who) in checks {
            if let Some(limit) = limit {
                if used >= limit {
                    return Err(BudgetRefusal {
                        budget,
                        limit,
                        message: format!(
                            "{who} has used today's {limit} tokens; {}",
                            self.resets()
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Whether a model call of this speaker in this channel may be sent.
    pub fn check_tokens(&self, speaker: &str, channel: &str) -> Result<(), BudgetRefusal> {
        let st = self.state(self.now());
        self.token_check(&st, speaker, channel)
    }

    /// Admits a turn: every token budget has room and the speaker has not started
    /// `speaker_turns_per_minute` turns in the last minute; an admitted turn is counted.
    pub fn admit(&self, speaker: &str, channel: &str) -> Result<(), BudgetRefusal> {
        let now = self.now();
        let now_ms = now.timestamp_millis();
        // The day rolled over first: a shared view's check knows whether it was read.
        let mut st = self.state(now);
        if let Some(view) = &self.shared {
            view.check()?;
        }
        self.token_check(&st, speaker, channel)?;
        let window = st.turns.entry(speaker.to_owned()).or_default();
        while window.front().is_some_and(|&t| t <= now_ms - MINUTE_MS) {
            window.pop_front();
        }
        if let Some(limit) = self.settings.speaker_turns_per_minute {
            if window.len() >= limit as usize {
                let oldest = window.front().copied().unwrap_or(now_ms);
                let wait = ((oldest.saturating_add(MINUTE_MS) - now_ms).max(0) as u64)
                    .div_ceil(1000)
                    .max(1);
                return Err(BudgetRefusal {
                    budget: Budget::SpeakerTurnsPerMinute,
                    limit: u64::from(limit),
                    message: format!(
                        "this speaker has started {limit} turns in the last minute; try again in {wait} s"
                    ),
                });
            }
        }
        window.push_back(now_ms);
        if st.turns.len() > 4096 {
            st.turns
                .retain(|_, w| w.back().is_some_and(|&t| t > now_ms - MINUTE_MS));
        }
        if self.settings.speaker_turns_per_minute.is_some() {
            st.unsaved.turns.push((speaker.to_owned(), now_ms));
        }
        Ok(())
    }

    /// Adds `tokens` to today's counters of the speaker, the channel and the bot; the
    /// write is committed by the writer thread.
    pub fn charge(&self, speaker: &str, channel: &str, tokens: u64) {
        if tokens > 0 {
            self.charge_slots(&self.resolve(speaker, channel), tokens);
        }
    }

    /// Today's tokens of a counter (in memory: what is charged, committed or about to be).
    pub fn tokens(&self, key: &CounterKey) -> u64 {
        let st = self.state(self.now());
        st.tokens.get(key)
    }

    /// Waits (blocking) until every write sent so far is committed.
    pub fn flush(&self) {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Write::Flush(tx));
        let _ = rx.recv();
    }

    /// When the next day starts in the configured zone, for `explain`.
    pub fn next_reset(&self) -> DateTime<Utc> {
        next_midnight(self.tz, self.now())
    }
}

/// What a start reads from its store.
struct Loaded {
    day: NaiveDate,
    tokens: Vec<(CounterKey, u64)>,
    turns: Vec<(String, i64)>,
}

/// The one load of a start, also `doctor`'s ([`check_state_file`]): the token counters of
/// `now`'s day in `tz` and the turns of the minute before `now`. A turn recorded after
/// `now` (another writer's, or a clock set back) counts as started now: it stays in this
/// minute's window and its wait cannot overflow.
fn load_start(
    store: &mut dyn BudgetStore,
    tz: chrono_tz::Tz,
    now: DateTime<Utc>,
) -> Result<Loaded, StoreError> {
    let day = now.with_timezone(&tz).date_naive();
    let now_ms = now.timestamp_millis();
    let tokens = store.load_tokens(&day.to_string())?;
    let mut turns = store.load_turns(now_ms - MINUTE_MS)?;
    for (_, at) in &mut turns {
        *at = (*at).min(now_ms);
    }
    Ok(Loaded { day, tokens, turns })
}

/// What `doctor` found in a state file loaded as a start loads it.
#[cfg(any(feature = "cli", feature = "testing"))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFileCheck {
    /// Today's token counters read.
    pub counters: usize,
    /// Turns of the last minute read.
    pub turns: usize,
    /// The loads that were not clean, each with the warning a start logs
    /// ([`LoadReport::warning`]).
    pub warnings: Vec<String>,
}

/// `doctor`'s check of the state file at `path`: opened ([`SqliteStore::open`]) and today's
/// counters and the last minute's turns loaded exactly as a start does ([`BudgetBook::open`]
/// with the configured `time_zone`), so a file a start cannot use is an error here too, and
/// the values a start would clamp are named. Nothing is written but what opening writes
/// (the schema, when it is missing).
#[cfg(any(feature = "cli", feature = "testing"))]
pub fn check_state_file(
    path: &std::path::Path,
    time_zone: &str,
) -> Result<StateFileCheck, StoreError> {
    // The zone in any letter case, as the configuration resolves it (`europe/paris`,
    // `US/Eastern`); ICU's legacy ids that no tz database names fall back to UTC here.
    let tz: chrono_tz::Tz = time_zone.parse().unwrap_or_else(|_| {
        chrono_tz::TZ_VARIANTS
            .into_iter()
            .find(|tz| tz.name().eq_ignore_ascii_case(time_zone))
            .unwrap_or(chrono_tz::UTC)
    });
    let mut store = SqliteStore::open(path)?;
    let loaded = load_start(&mut store, tz, Utc::now())?;
    Ok(StateFileCheck {
        counters: loaded.tokens.len(),
        turns: loaded.turns.len(),
        warnings: store
            .load_reports()
            .iter()
            .map(|r| r.warning(path))
            .collect(),
    })
}

/// `doctor`'s check of a shared store (`[budgets] store`): connects as a start does (TLS,
/// the schema's version, the namespace's settings against these: never set or replaced
/// here), and loads today's counters and the last minute's turns as a start does; it
/// writes nothing (the journal's batches and a SQLite state file's counters wait for the
/// bot's start). What it found, for the check's line.
#[cfg(any(feature = "cli", feature = "testing"))]
pub fn check_shared_store(
    settings: &BudgetSettings,
    time_zone: &str,
) -> Result<StateFileCheck, StoreError> {
    // The zone as the configuration resolves it for the bot, which stores that name
    // (`US/Eastern` is `America/New_York`): compared as given, a correct deployment failed.
    let canonical =
        crate::config::canonical_time_zone(time_zone).and_then(|c| c.parse::<chrono_tz::Tz>().ok());
    let tz: chrono_tz::Tz = canonical.unwrap_or_else(|| {
        time_zone.parse().unwrap_or_else(|_| {
            chrono_tz::TZ_VARIANTS
                .into_iter()
                .find(|tz| tz.name().eq_ignore_ascii_case(time_zone))
                .unwrap_or(chrono_tz::UTC)
        })
    });
    let mut store = PostgresStore::check(settings, tz.name())?;
    let loaded = load_start(&mut store, tz, Utc::now())?;
    Ok(StateFileCheck {
        counters: loaded.tokens.len(),
        turns: loaded.turns.len(),
        warnings: store
            .load_reports()
            .iter()
            .map(|r| r.warning(std::path::Path::new("(the shared store)")))
            .collect(),
    })
}

/// The first instant of `now`'s day in `tz` and of the next (a day of a time-zone change
/// included: its start is its first local instant that exists).
fn day_span(tz: chrono_tz::Tz, now: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
    let day = now.with_timezone(&tz).date_naive();
    let start = day
        .and_hms_opt(0, 0, 0)
        .and_then(|m| tz.from_local_datetime(&m).earliest())
        .map_or(now, |t| t.with_timezone(&Utc))
        .min(now);
    (
        start,
        next_midnight(tz, now).max(now + chrono::Duration::milliseconds(1)),
    )
}

/// The first instant of the day after `now`'s in `tz`.
pub(crate) fn next_midnight(tz: chrono_tz::Tz, now: DateTime<Utc>) -> DateTime<Utc> {
    let day = now.with_timezone(&tz).date_naive();
    let next = day.succ_opt().unwrap_or(day);
    let midnight = next.and_hms_opt(0, 0, 0).expect("midnight exists");
    tz.from_local_datetime(&midnight)
        .earliest()
        .map_or(now, |t| t.with_timezone(&Utc))
}

impl Drop for BudgetBook {
    fn drop(&mut self) {
        // Closing the channel ends the writer after the writes sent so far.
        self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// How often the writer commits what was charged and started since its last commit: at
/// most this much of the last charges and turns is lost with a crash of the process (what
/// was committed stays), and under load one commit (one fsync) serves every call and turn
/// of the interval. 100 ms: a commit with its fsync costs the writer thread ~260 µs of CPU
/// on the bench's VM, which at 20 ms was 1.0 µs of every broker call's ~145 µs at 13,000
/// calls a second (0.7 %); at 100 ms it is a fifth of that. An interval with nothing to
/// commit writes nothing (the tick only takes the book's lock).
pub const COMMIT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Commits the writes in order. Charges and started turns are gathered in memory
/// ([`BookState::unsaved`]; no charge or admission signals this thread) and taken every
/// [`COMMIT_INTERVAL`], in one transaction each; a flush takes them at once.
fn writer(
    mut store: Box<dyn BudgetStore>,
    rx: mpsc::Receiver<Write>,
    state: SharedState,
    watch: Option<SharedView>,
) {
    use mpsc::RecvTimeoutError;
    let report = |r: Result<(), StoreError>| {
        if let Err(e) = r {
            // Kept in memory for this run; the next start reads what was committed.
            tracing::error!(error = %e, "budget state write failed");
        }
    };
    let commit = |store: &mut Box<dyn BudgetStore>| {
        let Some(t) = take_unsaved(&state) else {
            return;
        };
        let forget = t.turns.last().map_or(0, |&(_, last)| last - MINUTE_MS);
        report(store.commit(&t.day, &t.deltas, &t.turns, forget));
    };
    let mut next = std::time::Instant::now() + COMMIT_INTERVAL;
    loop {
        match rx.recv_timeout(next.saturating_duration_since(std::time::Instant::now())) {
            Ok(Write::Tokens { day, deltas }) => report(store.add_tokens(&day, &deltas)),
            Ok(Write::NewDay(day)) => report(store.forget_days_before(&day)),
            Ok(Write::Flush(done)) => {
                commit(&mut store);
                report(store.flush());
                let _ = done.send(());
            }
            Err(RecvTimeoutError::Timeout) => {
                commit(&mut store);
                if let Some(view) = &watch {
                    view.watch();
                }
                // A fixed rate: a commit's own time does not stretch the interval.
                next += COMMIT_INTERVAL;
                let now = std::time::Instant::now();
                if next <= now {
                    next = now + COMMIT_INTERVAL;
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    commit(&mut store);
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[derive(Default)]
    struct Memory(Arc<Mutex<Vec<String>>>);
    impl BudgetStore for Memory {
        fn load_tokens(&mut self, _: &str) -> Result<Vec<(CounterKey, u64)>, StoreError> {
            Ok(vec![])
        }
        fn load_turns(&mut self, _: i64) -> Result<Vec<(String, i64)>, StoreError> {
            Ok(vec![])
        }
        fn add_tokens(&mut self, day: &str, d: &[(CounterKey, u64)]) -> Result<(), StoreError> {
            self.0.lock().unwrap().push(format!("{day} {}", d[0].1));
            Ok(())
        }
        fn forget_days_before(&mut self, _: &str) -> Result<(), StoreError> {
            Ok(())
        }
        fn record_turns(&mut self, turns: &[(String, i64)], _: i64) -> Result<(), StoreError> {
            self.0
                .lock()
                .unwrap()
                .push(format!("turns {}", turns.len()));
            Ok(())
        }
    }

    fn book_at(
        settings: BudgetSettings,
        tz: &str,
        now: Arc<Mutex<DateTime<Utc>>>,
    ) -> (Arc<BudgetBook>, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let clock: Clock = Arc::new(move || *now.lock().unwrap());
        let book =
            BudgetBook::with_store(&settings, tz, Box::new(Memory(log.clone())), clock).unwrap();
        (book, log)
    }

    #[test]
    fn a_day_whose_midnight_does_not_exist_still_starts_and_ends() {
        // Havana springs forward at 00:00: 8 March 2026 starts at 01:00 CDT (05:00 UTC);
        // 04:59:59 UTC is 23:59:59 on the 7th. The day's span (kept so a call needs no
        // time-zone conversion) must end there all the same.
        let now = Arc::new(Mutex::new(
            Utc.with_ymd_and_hms(2026, 3, 8, 4, 59, 0).unwrap(),
        ));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_tokens_per_day: Some(100),
            ..Default::default()
        };
        let (book, _) = book_at(settings, "America/Havana", now.clone());
        book.charge("alice", "c", 100);
        *now.lock().unwrap() = Utc.with_ymd_and_hms(2026, 3, 8, 4, 59, 59).unwrap();
        assert!(book.admit("alice", "c").is_err(), "still the 7th");
        *now.lock().unwrap() = Utc.with_ymd_and_hms(2026, 3, 8, 5, 0, 0).unwrap();
        book.admit("alice", "c").unwrap();
        assert_eq!(book.tokens(&CounterKey::Speaker("alice".into())), 0);
        // And the 8th (23 hours long) ends at midnight of the 9th, 04:00 UTC.
        book.charge("alice", "c", 100);
        *now.lock().unwrap() = Utc.with_ymd_and_hms(2026, 3, 9, 3, 59, 59).unwrap();
        assert!(book.admit("alice", "c").is_err(), "still the 8th");
        *now.lock().unwrap() = Utc.with_ymd_and_hms(2026, 3, 9, 4, 0, 0).unwrap();
        book.admit("alice", "c").unwrap();
    }

    #[test]
    fn the_day_rolls_over_at_midnight_in_the_configured_zone() {
        // 22:59:59 UTC on 31 March is 00:59:59 on 1 April in Paris (summer time, +2).
        let now = Arc::new(Mutex::new(
            Utc.with_ymd_and_hms(2026, 3, 31, 21, 59, 0).unwrap(),
        ));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_tokens_per_day: Some(100),
            ..Default::default()
        };
        let (book, log) = book_at(settings, "Europe/Paris", now.clone());
        book.charge("alice", "c", 100);
        let refused = book.admit("alice", "c").unwrap_err();
        assert_eq!(refused.budget, Budget::SpeakerTokensPerDay);
        assert_eq!(
            refused.to_string(),
            "budget speaker_tokens_per_day exceeded: this speaker has used today's 100 tokens; the budget resets at 00:00 Europe/Paris"
        );
        assert_eq!(
            book.next_reset(),
            Utc.with_ymd_and_hms(2026, 3, 31, 22, 0, 0).unwrap()
        );
        // 23:59:59 Paris: still the same day.
        *now.lock().unwrap() = Utc.with_ymd_and_hms(2026, 3, 31, 21, 59, 59).unwrap();
        assert!(book.admit("alice", "c").is_err());
        // Midnight in Paris (22:00 UTC), long before midnight UTC: a new day.
        *now.lock().unwrap() = Utc.with_ymd_and_hms(2026, 3, 31, 22, 0, 0).unwrap();
        book.admit("alice", "c").unwrap();
        book.charge("alice", "c", 7);
        book.flush();
        assert_eq!(
            *log.lock().unwrap(),
            vec!["2026-03-31 100".to_owned(), "2026-04-01 7".to_owned()]
        );
        assert_eq!(book.tokens(&CounterKey::Speaker("alice".into())), 7);
    }

    #[test]
    fn a_turns_account_follows_the_day_and_its_charges_are_committed() {
        // A turn that runs across midnight UTC: its calls before are of the old day, its
        // calls after are checked against and charged to the new one.
        let now = Arc::new(Mutex::new(
            Utc.with_ymd_and_hms(2026, 12, 4, 23, 59, 58).unwrap(),
        ));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_tokens_per_day: Some(100),
            ..Default::default()
        };
        let (book, log) = book_at(settings, "UTC", now.clone());
        let account = Arc::new(TurnAccount::new("alice", "c", Some(book.clone())));
        let other = Arc::new(TurnAccount::new("alice", "d", Some(book.clone())));
        account.hold(1, 1).unwrap().settle(60, 0, false);
        other.hold(1, 1).unwrap().settle(30, 10, false);
        // Both turns' charges are one speaker's: the budget is full for either.
        assert_eq!(
            account.hold(1, 1).unwrap_err().budget,
            Budget::SpeakerTokensPerDay
        );
        assert!(other.hold(1, 1).is_err());
        assert_eq!(book.tokens(&CounterKey::Channel("d".into())), 40);
        *now.lock().unwrap() = Utc.with_ymd_and_hms(2026, 12, 5, 0, 0, 1).unwrap();
        account.hold(1, 1).unwrap().settle(7, 0, false);
        book.flush();
        let day = |d: &str| -> u64 {
            let log = log.lock().unwrap();
            log.iter()
                .filter_map(|l| l.strip_prefix(d))
                .map(|n| n.trim().parse::<u64>().unwrap())
                .sum()
        };
        // The log holds each commit's first delta; the three counters move together here
        // but for the channel, so each commit's first is the speaker's.
        assert_eq!((day("2026-12-04 "), day("2026-12-05 ")), (100, 7));
        assert_eq!(book.tokens(&CounterKey::Speaker("alice".into())), 7);
        assert_eq!(account.usage().tokens(), 67);
    }

    #[test]
    fn a_hostile_usage_saturates_the_counters() {
        // An upstream's `usage` is any u64: the counters stop at u64::MAX, never wrap
        // round to a small count that would pass the budget again.
        let now = Arc::new(Mutex::new(
            Utc.with_ymd_and_hms(2026, 12, 4, 12, 0, 0).unwrap(),
        ));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            bot_tokens_per_day: Some(1_000),
            ..Default::default()
        };
        let (book, _log) = book_at(settings, "UTC", now);
        let account = Arc::new(TurnAccount::new("mallory", "c", Some(book.clone())));
        account.charge(u64::MAX, 0, false);
        account.charge(5, 0, false);
        assert_eq!(book.tokens(&CounterKey::Bot), u64::MAX);
        assert_eq!(account.usage().prompt_tokens, u64::MAX);
        assert_eq!(
            account.hold(1, 1).unwrap_err().budget,
            Budget::BotTokensPerDay
        );
    }

    #[test]
    fn turns_per_minute_is_a_sliding_minute() {
        let t0 = Utc.with_ymd_and_hms(2026, 1, 1, 12, 0, 0).unwrap();
        let now = Arc::new(Mutex::new(t0));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_turns_per_minute: Some(2),
            ..Default::default()
        };
        let (book, _) = book_at(settings, "UTC", now.clone());
        book.admit("bob", "c1").unwrap();
        *now.lock().unwrap() = t0 + chrono::Duration::seconds(30);
        book.admit("bob", "c2").unwrap();
        // Another speaker is not limited by bob's turns.
        book.admit("carol", "c1").unwrap();
        let refused = book.admit("bob", "c1").unwrap_err();
        assert_eq!(
            refused.message,
            "this speaker has started 2 turns in the last minute; try again in 30 s"
        );
        *now.lock().unwrap() = t0 + chrono::Duration::seconds(60);
        book.admit("bob", "c1").unwrap();
    }

    /// Turns admitted at once are committed at once, after the interval (not one commit,
    /// one fsync, per turn as it is admitted, beside the turn), and a flush commits them.
    #[test]
    fn turns_admitted_together_are_one_commit() {
        let now = Arc::new(Mutex::new(
            Utc.with_ymd_and_hms(2026, 1, 1, 12, 0, 0).unwrap(),
        ));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_turns_per_minute: Some(100),
            ..Default::default()
        };
        let (book, log) = book_at(settings, "UTC", now);
        for speaker in ["a", "b", "c", "d", "e"] {
            book.admit(speaker, "c1").unwrap();
        }
        book.flush();
        // One commit, or two should this thread be preempted past an interval mid-loop.
        let commits = log.lock().unwrap().clone();
        let turns: Vec<usize> = commits
            .iter()
            .map(|c| c.strip_prefix("turns ").unwrap().parse().unwrap())
            .collect();
        assert!(
            turns.iter().sum::<usize>() == 5 && turns.len() <= 2,
            "{commits:?}"
        );
        book.admit("a", "c1").unwrap();
        book.flush();
        assert_eq!(log.lock().unwrap()[turns.len()..], ["turns 1"]);
    }

    /// A busy book's charges and turns are committed at each interval's tick, not held
    /// until a flush; an idle book's writer writes nothing.
    #[test]
    fn a_busy_book_commits_every_interval_and_an_idle_one_writes_nothing() {
        let now = Arc::new(Mutex::new(
            Utc.with_ymd_and_hms(2026, 1, 1, 12, 0, 0).unwrap(),
        ));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_tokens_per_day: Some(1_000_000),
            speaker_turns_per_minute: Some(1_000),
            ..Default::default()
        };
        let (book, log) = book_at(settings, "UTC", now);
        // Each turns commit's count, in order.
        let turn_commits = |log: &Mutex<Vec<String>>| -> Vec<usize> {
            let log = log.lock().unwrap();
            log.iter()
                .filter_map(|c| c.strip_prefix("turns "))
                .map(|n| n.parse().unwrap())
                .collect()
        };
        // Idle from the start: ticks pass, nothing is written.
        std::thread::sleep(COMMIT_INTERVAL * 5);
        assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
        // A turn and a charge every 10 ms until three ticks have committed (about 300 ms;
        // on a loaded machine, longer): no flush, the ticks alone.
        let started = std::time::Instant::now();
        let mut rounds = 0;
        while turn_commits(&log).len() < 3 {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(60),
                "no tick committed"
            );
            book.admit("a", "c1").unwrap();
            book.charge("a", "c1", 1);
            rounds += 1;
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        book.flush();
        let turns = turn_commits(&log);
        assert_eq!(turns.iter().sum::<usize>(), rounds, "{turns:?}");
        assert_eq!(book.tokens(&CounterKey::Speaker("a".into())), rounds as u64);
        // Idle again: the ticks that follow write nothing.
        let written = log.lock().unwrap().len();
        std::thread::sleep(COMMIT_INTERVAL * 5);
        assert_eq!(
            log.lock().unwrap().len(),
            written,
            "{:?}",
            log.lock().unwrap()
        );
    }

    #[test]
    fn each_token_budget_names_itself() {
        let now = Arc::new(Mutex::new(
            Utc.with_ymd_and_hms(2026, 1, 1, 12, 0, 0).unwrap(),
        ));
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_tokens_per_day: Some(1000),
            channel_tokens_per_day: Some(50),
            bot_tokens_per_day: Some(70),
            ..Default::default()
        };
        let (book, _) = book_at(settings, "UTC", now);
        book.charge("a", "chan1", 50);
        let r = book.check_tokens("b", "chan1").unwrap_err();
        assert_eq!(r.budget, Budget::ChannelTokensPerDay);
        assert_eq!(
            r.message,
            "this channel has used today's 50 tokens; the budget resets at 00:00 UTC"
        );
        book.check_tokens("b", "chan2").unwrap();
        book.charge("b", "chan2", 20);
        let r = book.check_tokens("c", "chan3").unwrap_err();
        assert_eq!(r.budget, Budget::BotTokensPerDay);
        assert_eq!(
            r.message,
            "the bot has used today's 70 tokens; the budget resets at 00:00 UTC"
        );
    }

    /// A store shared by other processes that never reconciles (the database away): the
    /// view only ages.
    struct Unreachable;
    impl BudgetStore for Unreachable {
        fn load_tokens(&mut self, _: &str) -> Result<Vec<(CounterKey, u64)>, StoreError> {
            Ok(vec![])
        }
        fn load_turns(&mut self, _: i64) -> Result<Vec<(String, i64)>, StoreError> {
            Ok(vec![])
        }
        fn add_tokens(&mut self, _: &str, _: &[(CounterKey, u64)]) -> Result<(), StoreError> {
            Ok(())
        }
        fn forget_days_before(&mut self, _: &str) -> Result<(), StoreError> {
            Ok(())
        }
        fn record_turns(&mut self, _: &[(String, i64)], _: i64) -> Result<(), StoreError> {
            Ok(())
        }
        fn share(&mut self, _: SharedView) -> bool {
            true
        }
    }

    /// The view's age is the monotonic clock's: a wall clock stepped back an hour during
    /// the outage (by hand, or an NTP step) leaves a stale view stale (measured on the wall
    /// clock, the age turned negative and the speaker was admitted).
    #[test]
    fn a_clock_stepped_back_leaves_a_stale_view_stale() {
        let base = Utc.with_ymd_and_hms(2026, 1, 1, 12, 0, 0).unwrap();
        let started = std::time::Instant::now();
        // A wall clock that runs (from noon, the day's middle), and that can be stepped.
        let step_ms = Arc::new(AtomicI64::new(0));
        let step = step_ms.clone();
        let clock: Clock = Arc::new(move || {
            base + chrono::Duration::from_std(started.elapsed()).unwrap()
                + chrono::Duration::milliseconds(step.load(Ordering::Relaxed))
        });
        let settings = BudgetSettings {
            state_file: Some("/x".into()),
            speaker_tokens_per_day: Some(1000),
            max_staleness_secs: Some(1),
            ..Default::default()
        };
        let book = BudgetBook::with_store(&settings, "UTC", Box::new(Unreachable), clock).unwrap();
        book.admit("ann", "c").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1300));
        let stale = |r: Result<(), BudgetRefusal>| {
            let r = r.unwrap_err();
            assert_eq!(r.budget, Budget::Store, "{r}");
            assert!(
                r.message
                    .starts_with("the budgets' shared database has not been reached for ")
                    && r.message.ends_with(
                        " s (max_staleness_secs = 1): new turns are refused until it is back"
                    ),
                "{}",
                r.message
            );
        };
        stale(book.admit("ann", "c"));
        step_ms.store(-3_600_000, Ordering::Relaxed);
        stale(book.admit("ann", "c"));
        assert!(book.shared_view_age().unwrap() >= std::time::Duration::from_secs(1));
    }
}
