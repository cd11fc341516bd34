//! The audit trail (`[audit]`): one JSON line per turn, appended to a file the operator
//! names, built on the event seam ([`crate::events`]) and the turn's [`TurnFacts`].
//!
//! A line says: the turn's number, its time (admission, UTC), the channel's short hash,
//! the speaker's id, how it launched (`warm`, `cold`, or `none`: it never reached a
//! container), its duration by phase, each model call (status, latency, the upstream's
//! tokens), each host and MCP tool call (name, outcome, latency), each refusal of the
//! broker, the outcome (`ok` or the failure kind) with a host-written sentence that
//! explains it, the budget that refused it, the host-counted usage, the bytes in and out
//! and the workspace's use after the turn. A message the actor layer refused (`busy`,
//! `shutting_down`) is a line too, without a turn number.
//!
//! **Never a key** (no event carries one) and **no guest text** but the speaker's id,
//! unless `include_text = true` adds the message and the reply. The file is ASCII: every
//! string is JSON-escaped, and every character outside printable ASCII (controls, DEL,
//! C1, bidi overrides, line separators, any non-ASCII letter) is a `\uXXXX` escape, so a
//! `tail` of the file cannot be steered by a guest's speaker id.
//!
//! **Appending.** A turn's line is made from its one [`EventKind::Facts`], which carries the
//! turn's whole [`TurnRecord`](crate::events::TurnRecord) as the turn runner kept it (no
//! event is gathered here, no state is kept per turn): it is handed to one writer thread
//! per runtime through a bounded queue (`try_send`: a turn never waits for it). The writer makes the
//! line and appends it with one `write` under `flock(LOCK_EX)` on a descriptor opened
//! `O_APPEND`: one writer in the process, and the lock for any other process appending to
//! the same file, so lines are never interleaved. A write that fails part way (a full
//! disk) is cut back to the file's length before it (`ftruncate`), so a line is whole or
//! absent. A failed write never fails or delays a turn: it is counted
//! ([`AuditStats::failed`]), and warned at most once a minute with the count since; a turn
//! that finds the queue full is counted as [`AuditStats::dropped`] (warned alike).
//!
//! `roundtable-sandbox audit FILE` summarises a trail (`summary`).

#[cfg(any(feature = "cli", feature = "testing"))]
pub mod summary;

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::events::{BrokerEvent, Event, EventKind, Refusal, TurnFacts};
use crate::turn::kinds::{TurnFailure, TurnPhase};

pub use crate::config::AuditSettings;

/// Errors of opening the audit trail (at startup).
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// The file cannot be opened for appending.
    #[error("audit file {path} cannot be opened for appending")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The writer thread could not be started.
    #[error("start the audit writer thread")]
    Thread(#[source] std::io::Error),
}

/// What the audit trail has done since startup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuditStats {
    /// Lines appended.
    pub written: u64,
    /// Lines whose write failed (a full disk, an I/O error): not in the file.
    pub failed: u64,
    /// Turns not written because the writer's queue was full.
    pub dropped: u64,
}

/// Turns queued for the writer at most; past it a turn's line is dropped (counted).
const QUEUE: usize = 4096;
/// At most one warning per this long.
const WARN_EVERY: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
    /// The warnings of dropped lines.
    drop_warnings: Mutex<Throttle>,
}

/// One warning per [`WARN_EVERY`]; what happened in between is counted into the next.
#[derive(Default)]
struct Throttle {
    last: Option<Instant>,
    unwarned: u64,
}

impl Throttle {
    /// Counts one; `Some(the count since the last warning)` when a warning is due now.
    fn count(&mut self) -> Option<u64> {
        self.unwarned += 1;
        if self.last.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.unwarned))
    }
}

/// A turn's events sent to `observer` and to the audit trail `audit` (as a runtime with
/// both on sends them), for a broker driven without a runtime (the bench). Here, not in
/// [`crate::events`], which does not depend on the audit trail.
#[cfg(feature = "testing")]
pub fn turn_events(
    observer: Option<crate::events::Observer>,
    audit: Option<Arc<AuditTrail>>,
    turn: u64,
    channel: &str,
) -> crate::events::TurnEvents {
    let audit = audit.map(|a| a as Arc<dyn crate::events::EventSink>);
    crate::events::TurnEvents::new(
        Arc::new(crate::events::EventHub::new(observer, audit)),
        turn,
        crate::ChannelId::new(channel),
    )
}

/// The audit trail of a runtime: the writer thread and its queue.
pub struct AuditTrail {
    path: PathBuf,
    include_text: bool,
    queue: mpsc::SyncSender<Message>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for AuditTrail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditTrail")
            .field("path", &self.path)
            .field("include_text", &self.include_text)
            .finish_non_exhaustive()
    }
}

enum Message {
    Turn(Box<Finished>),
    Flush(mpsc::Sender<()>),
}

/// A turn handed to the writer.
struct Finished {
    turn: Option<u64>,
    channel: Option<Arc<str>>,
    facts: Box<TurnFacts>,
    wall: chrono::DateTime<chrono::Utc>,
}

impl AuditTrail {
    /// Opens (creates `0600`) `path` for appending and starts the writer thread; an
    /// unopenable path is an error here, at startup.
    pub fn open(path: &Path, include_text: bool) -> Result<Arc<Self>, AuditError> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::CLOEXEC.bits() as i32)
            .open(path)
            .map_err(|source| AuditError::Open {
                path: path.to_owned(),
                source,
            })?;
        let (queue, rx) = mpsc::sync_channel(QUEUE);
        let counters = Arc::new(Counters::default());
        let writer = Writer {
            file,
            include_text,
            counters: counters.clone(),
            failures: Throttle::default(),
        };
        std::thread::Builder::new()
            .name("audit-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(AuditError::Thread)?;
        Ok(Arc::new(Self {
            path: path.to_owned(),
            include_text,
            queue,
            counters,
        }))
    }

    /// Whether lines carry the message and the reply.
    pub fn include_text(&self) -> bool {
        self.include_text
    }

    /// What it has done since startup.
    pub fn stats(&self) -> AuditStats {
        AuditStats {
            written: self.counters.written.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
            dropped: self.counters.dropped.load(Ordering::Relaxed),
        }
    }

    /// Waits (up to `within`) until every turn handed to the writer so far is written or
    /// counted failed. Blocks: call it off the async threads.
    pub fn flush(&self, within: Duration) -> bool {
        let (tx, rx) = mpsc::channel();
        if self.queue.send(Message::Flush(tx)).is_err() {
            return false;
        }
        rx.recv_timeout(within).is_ok()
    }

    /// One event of the runtime (called by the event hub, on the emitting thread: no lock,
    /// no I/O). A turn's or a refused message's `Facts` is its line; nothing else is kept.
    pub(crate) fn observe(&self, event: &Event) {
        if let EventKind::Facts(facts) = &event.kind {
            self.hand(Box::new(Finished {
                turn: event.turn,
                channel: event.channel.clone(),
                facts: facts.clone(),
                wall: chrono::Utc::now(),
            }));
        }
    }

    /// Hands a turn to the writer without waiting: a full queue drops it (counted).
    fn hand(&self, finished: Box<Finished>) {
        if self.queue.try_send(Message::Turn(finished)).is_ok() {
            return;
        }
        let c = &self.counters;
        c.dropped.fetch_add(1, Ordering::Relaxed);
        let due = (c.drop_warnings.lock())
            .unwrap_or_else(|e| e.into_inner())
            .count();
        if let Some(dropped) = due {
            tracing::warn!(
                dropped,
                "audit lines dropped: the audit writer is behind (its queue is full); the turns go on"
            );
        }
    }
}

/// The writer thread: makes each line and appends it.
struct Writer {
    file: File,
    include_text: bool,
    counters: Arc<Counters>,
    failures: Throttle,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Message>) {
        for message in rx {
            match message {
                Message::Flush(done) => {
                    let _ = done.send(());
                }
                Message::Turn(finished) => {
                    let line = line(*finished, self.include_text);
                    let mut bytes = to_ascii_json(&line);
                    bytes.push(b'\n');
                    match append(&self.file, &bytes) {
                        Ok(()) => {
                            self.counters.written.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => self.failed(&e),
                    }
                }
            }
        }
    }

    /// A line not written: counted, warned at most once per [`WARN_EVERY`].
    fn failed(&mut self, error: &std::io::Error) {
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        if let Some(failed) = self.failures.count() {
            tracing::warn!(
                error = %error,
                failed,
                "audit lines not written (the turns go on)"
            );
        }
    }
}

/// Appends `line` whole or not at all: under `flock(LOCK_EX)` (any other process that
/// appends to the file the same way waits), one `write` (completed if short), and a
/// failure part way cut back to the file's length before it.
fn append(file: &File, line: &[u8]) -> std::io::Result<()> {
    use rustix::fs::{flock, FlockOperation};
    // A file system without flock still has the one writer of this process.
    let locked = flock(file, FlockOperation::LockExclusive).is_ok();
    let before = file
        .metadata()
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    let result = (&*file).write_all(line);
    if result.is_err() {
        if let Some(len) = before {
            let _ = file.set_len(len);
        }
    }
    if locked {
        let _ = flock(file, FlockOperation::Unlock);
    }
    result
}

/// The sentence an operator reads for a failure kind (host-written: never the reply's
/// text, which may be the guest's).
pub fn explain(failure: TurnFailure) -> &'static str {
    match failure {
        TurnFailure::Timeout => "the turn passed its timeout (counted from admission)",
        TurnFailure::SlotTimeout => {
            "the turn's timeout passed while it waited for a container slot; it never started"
        }
        TurnFailure::Stopped => "the turn was stopped (a stop, or the caller's token)",
        TurnFailure::OutOfMemory => "the container's memory limit killed the guest",
        TurnFailure::OverQuota => {
            "the workspace passed its quota (bytes or entries), or a file passed the file-size limit"
        }
        TurnFailure::DiskFloor => {
            "a guarded filesystem is below its free-space floor, or could not be measured"
        }
        TurnFailure::GuestError => "the guest reported a failure of its own",
        TurnFailure::MalformedOutput => "the guest's output was not a valid reply, or too large",
        TurnFailure::GuestExit => "the guest exited non-zero without a reply",
        TurnFailure::EngineUnavailable => "the container engine could not be reached",
        TurnFailure::ImageMissing => "the guest image is missing",
        TurnFailure::Internal => {
            "the host could not prepare or run the turn (engine, workspace, run dir or broker)"
        }
        TurnFailure::Busy => "the channel's queue was full: the message was refused",
        TurnFailure::ShuttingDown => "the bot was shutting down: the message was refused",
        TurnFailure::ChannelRestarted => "the channel's worker failed and was restarted mid-turn",
        TurnFailure::BudgetExceeded => {
            "a budget refused the turn before it started, or one of its model calls"
        }
    }
}

/// One audit line (see the [module](self)); its fields in this order.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Line {
    pub(crate) v: u32,
    pub(crate) at: String,
    #[serde(default)]
    pub(crate) turn: Option<u64>,
    #[serde(default)]
    pub(crate) channel: Option<String>,
    #[serde(default)]
    pub(crate) speaker: Option<String>,
    pub(crate) launch: String,
    pub(crate) outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) explain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) budget: Option<BudgetLine>,
    pub(crate) duration_ms: Durations,
    #[serde(default)]
    pub(crate) model_calls: Vec<ModelCallLine>,
    #[serde(default)]
    pub(crate) tool_calls: Vec<ToolCallLine>,
    #[serde(default)]
    pub(crate) refusals: Vec<RefusalLine>,
    /// Each egress request (route, method, host, path without query values, status,
    /// bytes each way, duration, decision and rule, address): never a credential or a body.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) egress: Vec<EgressLine>,
    /// Refusals past the first [`TurnRecord::MAX_REFUSALS`](crate::events::TurnRecord::MAX_REFUSALS)
    /// (a guest's flood), counted only.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) refusals_omitted: u64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) warm_fallback: bool,
    pub(crate) usage: UsageLine,
    #[serde(default)]
    pub(crate) bytes_in: Option<u64>,
    #[serde(default)]
    pub(crate) bytes_out: Option<u64>,
    #[serde(default)]
    pub(crate) workspace_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) reply: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct BudgetLine {
    pub(crate) name: String,
    pub(crate) limit: u64,
    pub(crate) message: String,
}

/// Milliseconds by phase, `total` first (admission to the end).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Durations {
    pub(crate) total: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) slot_wait: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) preparing: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) broker_listening: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) container_running: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) replied: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tearing_down: Option<f64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ModelCallLine {
    /// `chat` (the guest's), `compaction_summarizer`, `compaction_model`.
    #[serde(default)]
    pub(crate) operation: std::borrow::Cow<'static, str>,
    pub(crate) status: u16,
    pub(crate) latency_ms: f64,
    #[serde(default)]
    pub(crate) prompt_tokens: Option<u64>,
    #[serde(default)]
    pub(crate) completion_tokens: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ToolCallLine {
    pub(crate) name: String,
    pub(crate) mcp: bool,
    pub(crate) ok: bool,
    pub(crate) latency_ms: f64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct EgressLine {
    pub(crate) route: String,
    pub(crate) method: String,
    pub(crate) host: String,
    pub(crate) path: String,
    pub(crate) status: u16,
    pub(crate) bytes_out: u64,
    pub(crate) bytes_in: u64,
    pub(crate) latency_ms: f64,
    pub(crate) decision: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rule: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) address: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RefusalLine {
    pub(crate) status: u16,
    pub(crate) limit: String,
    /// The budget, when `limit` is `budget`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) budget: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct UsageLine {
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) model_calls: u32,
    pub(crate) tool_calls: u32,
    pub(crate) estimated: bool,
}

/// Milliseconds, to the microsecond.
fn ms(d: Duration) -> f64 {
    (d.as_micros() as f64) / 1000.0
}

/// A kind's name as the trail writes it: its variant in snake case (`OverQuota` ->
/// `over_quota`).
pub(crate) fn snake(value: &impl std::fmt::Debug) -> String {
    let name = format!("{value:?}");
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The line of a finished turn.
fn line(f: Finished, include_text: bool) -> Line {
    let facts = f.facts;
    let r = &facts.record;
    let total = r.total.unwrap_or_default();
    let wall = f.wall - chrono::Duration::from_std(total).unwrap_or_default();
    let durations = durations(r, total);
    let launch = match (r.warm, r.ran()) {
        (true, _) => "warm",
        (false, true) => "cold",
        (false, false) => "none",
    };
    let (outcome, explained) = match r.ended {
        None => ("unknown".to_owned(), Some("the turn's end was not seen")),
        Some(None) => ("ok".to_owned(), None),
        Some(Some(failure)) => (snake(&failure), Some(explain(failure))),
    };
    let (model_calls, tool_calls, egress) = calls(r);
    let refusals = refusals(r);
    let usage = facts.usage;
    let text = facts.text.as_ref().filter(|_| include_text);
    Line {
        v: 1,
        at: wall.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        turn: f.turn,
        channel: f.channel.as_deref().map(str::to_owned),
        speaker: Some(facts.speaker.clone()),
        launch: launch.to_owned(),
        outcome,
        explain: explained.map(str::to_owned),
        budget: facts.budget.as_ref().map(|b| BudgetLine {
            name: b.budget.key().to_owned(),
            limit: b.limit,
            message: b.message.clone(),
        }),
        duration_ms: durations,
        model_calls,
        tool_calls,
        refusals,
        egress,
        refusals_omitted: r.refusals_omitted,
        warm_fallback: r.fell_back,
        usage: UsageLine {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            model_calls: usage.model_calls,
            tool_calls: usage.tool_calls,
            estimated: usage.estimated,
        },
        bytes_in: Some(facts.bytes_in),
        bytes_out: Some(facts.bytes_out),
        workspace_bytes: facts.workspace_bytes,
        text: text.map(|t| t.message.clone()),
        reply: text.map(|t| t.reply.clone()),
    }
}

/// The turn's durations: in all, waiting for its slot, and in each phase.
fn durations(r: &crate::events::TurnRecord, total: Duration) -> Durations {
    let mut durations = Durations {
        total: ms(total),
        slot_wait: r.slot_wait.map(ms),
        ..Default::default()
    };
    for (phase, took) in &r.phases {
        let d = Some(ms(*took));
        match phase {
            TurnPhase::Preparing => durations.preparing = d,
            TurnPhase::BrokerListening => durations.broker_listening = d,
            TurnPhase::ContainerRunning => durations.container_running = d,
            TurnPhase::Replied => durations.replied = d,
            TurnPhase::TearingDown => durations.tearing_down = d,
            _ => {}
        }
    }
    durations
}

/// The turn's broker calls, each a line: its model calls, its tool calls and its egress
/// requests.
fn calls(
    r: &crate::events::TurnRecord,
) -> (Vec<ModelCallLine>, Vec<ToolCallLine>, Vec<EgressLine>) {
    let (mut model_calls, mut tool_calls, mut egress) = (Vec::new(), Vec::new(), Vec::new());
    for call in &r.calls {
        match call {
            BrokerEvent::ModelCall {
                operation,
                status,
                latency,
                usage,
            } => model_calls.push(ModelCallLine {
                operation: std::borrow::Cow::Borrowed(operation.key()),
                status: *status,
                latency_ms: ms(*latency),
                prompt_tokens: usage.as_ref().and_then(|u| u.prompt_tokens),
                completion_tokens: usage.as_ref().and_then(|u| u.completion_tokens),
            }),
            BrokerEvent::ToolCall {
                name,
                mcp,
                ok,
                latency,
            } => tool_calls.push(ToolCallLine {
                name: name.clone(),
                mcp: *mcp,
                ok: *ok,
                latency_ms: ms(*latency),
            }),
            BrokerEvent::Egress(e) => egress.push(EgressLine {
                route: e.route.clone(),
                method: e.method.clone(),
                host: e.host.clone(),
                path: e.path.clone(),
                status: e.status,
                bytes_out: e.bytes_out,
                bytes_in: e.bytes_in,
                latency_ms: ms(e.latency),
                decision: e.decision.key().to_owned(),
                rule: e.rule.clone(),
                address: e.address.map(|a| a.to_string()),
            }),
            _ => {}
        }
    }
    (model_calls, tool_calls, egress)
}

/// The broker's refusals in the turn, each with the limit (the budget) that refused.
fn refusals(r: &crate::events::TurnRecord) -> Vec<RefusalLine> {
    r.refusals
        .iter()
        .map(|(status, limit)| {
            let (limit, budget) = match limit {
                Refusal::Budget(b) => ("budget".to_owned(), Some(b.key().to_owned())),
                other => (snake(other), None),
            };
            RefusalLine {
                status: *status,
                limit,
                budget,
            }
        })
        .collect()
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `value` as one line of JSON in ASCII: every string's characters outside printable
/// ASCII written as `\uXXXX` (UTF-16 units), so nothing in it is raw to a terminal.
pub(crate) fn to_ascii_json(value: &impl Serialize) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, AsciiFormatter);
    value
        .serialize(&mut ser)
        .expect("an audit line always serialises");
    out
}

struct AsciiFormatter;

impl serde_json::ser::Formatter for AsciiFormatter {
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let mut units = [0u16; 2];
        for c in fragment.chars() {
            if (' '..='~').contains(&c) {
                writer.write_all(&[c as u8])?;
            } else {
                for unit in c.encode_utf16(&mut units) {
                    write!(writer, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

impl crate::events::EventSink for AuditTrail {
    fn observe(&self, event: &Event) {
        AuditTrail::observe(self, event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_ascii_and_read_back_the_same() {
        let speaker = "ann\u{1b}]52;c;aGk=\u{7}\n{\"forged\":1}\u{202e}\u{2028}\u{7f}\u{9b}é😀";
        let value = serde_json::json!({"speaker": speaker});
        let bytes = to_ascii_json(&value);
        assert!(bytes.iter().all(|b| (b' '..=b'~').contains(b)), "{bytes:?}");
        assert_eq!(
            String::from_utf8(bytes.clone()).unwrap(),
            r#"{"speaker":"ann\u001b]52;c;aGk=\u0007\n{\"forged\":1}\u202e\u2028\u007f\u009b\u00e9\ud83d\ude00"}"#
        );
        let back: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back["speaker"], speaker);
    }

    /// A guest can make the broker refuse it as fast as it can send (unknown routes,
    /// spent caps): a turn's record keeps its first refusals and counts the rest, so
    /// neither the record nor its line grows with the flood; and the line is made from the
    /// turn's `Facts` alone (the trail keeps nothing per turn: the other events write
    /// nothing).
    #[test]
    fn a_flood_of_refusals_is_kept_bounded_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let trail = AuditTrail::open(&path, false).unwrap();
        let hub = Arc::new(crate::events::EventHub::new(
            None,
            Some(trail.clone() as Arc<dyn crate::events::EventSink>),
        ));
        let events = crate::events::TurnEvents::new(hub, 1, crate::ChannelId::new("#flood"));
        let admitted = Instant::now();
        events.emit(EventKind::Phase(TurnPhase::Preparing));
        for _ in 0..10_000 {
            events.emit(EventKind::Broker(BrokerEvent::Refused {
                status: 404,
                limit: Refusal::UnknownRoute,
            }));
        }
        events.emit(EventKind::Ended {
            failure: None,
            warm: false,
        });
        assert!(trail.flush(Duration::from_secs(10)));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "",
            "no line before its facts"
        );
        let record = events.record(admitted, None);
        assert_eq!(
            record.refusals.len(),
            crate::events::TurnRecord::MAX_REFUSALS
        );
        events.emit(EventKind::Facts(Box::new(TurnFacts::refused(
            "ann", "hi", record,
        ))));
        assert!(trail.flush(Duration::from_secs(10)));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.len() < 16 * 1024, "a line of {} bytes", text.len());
        let line: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        let kept = crate::events::TurnRecord::MAX_REFUSALS;
        assert_eq!(line["refusals"].as_array().unwrap().len(), kept);
        assert_eq!(line["refusals_omitted"], 10_000 - kept as u64);
        assert_eq!(line["outcome"], "ok");
        assert!(line["duration_ms"]["preparing"].as_f64().is_some());
    }

    #[test]
    fn kinds_are_named_in_snake_case() {
        assert_eq!(snake(&TurnFailure::OverQuota), "over_quota");
        assert_eq!(snake(&TurnFailure::Timeout), "timeout");
        assert_eq!(
            snake(&crate::events::Refusal::CallsInFlight),
            "calls_in_flight"
        );
    }

    #[test]
    fn the_section_is_read_from_toml_and_refuses_unknown_keys() {
        let head = "image = \"x\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\nmodel_url = \"https://a\"\n";
        let c = crate::Config::from_toml_str(&format!(
            "{head}[audit]\npath = \"/var/log/rt/audit.jsonl\"\ninclude_text = true\n"
        ))
        .unwrap();
        assert_eq!(
            c.audit,
            AuditSettings {
                path: Some("/var/log/rt/audit.jsonl".into()),
                include_text: true
            }
        );
        let c = crate::Config::from_toml_str(head).unwrap();
        assert_eq!(c.audit, AuditSettings::default());
        let e = crate::Config::from_toml_str(&format!("{head}[audit]\nfile = \"/x\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("config file <string>: audit.file: unknown field `file`"),
            "{e}"
        );
        assert_eq!(
            crate::ConfigError::Audit("include_text is set but no path is".into()).to_string(),
            "audit.include_text is set but no path is"
        );
    }

    #[test]
    fn settings_rules() {
        let roots = [Path::new("/run/rt"), Path::new("/srv/ws")];
        let s = |path: Option<&str>, include_text| AuditSettings {
            path: path.map(PathBuf::from),
            include_text,
        };
        assert_eq!(s(None, false).validate(roots), Ok(()));
        assert_eq!(
            s(None, true).validate(roots),
            Err("include_text is set but no path is".into())
        );
        assert_eq!(
            s(Some("audit.jsonl"), false).validate(roots),
            Err("path must be an absolute path, got audit.jsonl".into())
        );
        assert_eq!(
            s(Some("/srv/ws/a.jsonl"), false).validate(roots),
            Err("path must be outside run_root and workspace_root, got /srv/ws/a.jsonl".into())
        );
        assert_eq!(
            s(Some("/var/log/rt/audit.jsonl"), true).validate(roots),
            Ok(())
        );
    }
}
