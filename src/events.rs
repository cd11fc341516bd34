//! The one event seam: what the runtime does, as typed [`Event`]s with their instants, for
//! metrics, budgets and progress displays.
//!
//! An [`Observer`] is installed once, on the [`Config`](crate::Config) the
//! [`Sandbox`](crate::Sandbox) is built from (`Config::builder(..).observer(..)`): the one
//! hook. It sees every turn's admission, its wait
//! for a container slot, each phase and its end (the failure kind, or ok; warm or cold),
//! the warm pool's preparations, adoptions, fallbacks and discards (each with its reason),
//! every broker call (model: status, latency, the upstream's token usage; tool and MCP:
//! name, outcome, latency) and every refusal of the broker (its status and the limit that
//! refused), and the engine's calls (operation, latency). An event names the turn by its
//! runtime-wide number and the channel by its short hash ([`ChannelId::short`]); it never
//! carries guest text but one field: the speaker's id in a turn's [`TurnFacts`] (the
//! audit trail's, [`crate::audit`]), guest-chosen, never a metric label.
//!
//! The other views are built on it: [`Sandbox::warm_counts`](crate::Sandbox::warm_counts)
//! counts its [`WarmEvent::Adopted`]/[`WarmEvent::FellBack`], the audit trail writes each
//! turn's line from them, and the actor layer keeps each channel's state (its `Status`)
//! from the `Phase` events of the turn it runs. A bot that shows a message's progress
//! (typing, a status line) filters the events by the channel's [`ChannelId::short`]: a
//! channel runs one turn at a time.
//!
//! The observer is called on the thread that does the work (a turn's task, a broker
//! connection's task): it must return quickly. A panic in it is caught and logged.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roundtable_sandbox_protocol::Usage;

use crate::budgets::Budget;
use crate::turn::kinds::{TurnFailure, TurnPhase};
use crate::ChannelId;

/// Receives every [`Event`] of a runtime (see the [module](self)).
pub type Observer = Arc<dyn Fn(&Event) + Send + Sync>;

/// One thing the runtime did.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// When.
    pub at: Instant,
    /// The turn's runtime-wide number ([`AdmittedTurn::number`](crate::turn::AdmittedTurn::number)),
    /// when the event is a turn's.
    pub turn: Option<u64>,
    /// The channel's short hash ([`ChannelId::short`]), when the event is a channel's
    /// (shared: no allocation per event).
    pub channel: Option<Arc<str>>,
    /// What happened.
    pub kind: EventKind,
}

/// What happened. New kinds may come: match with a `_` arm.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum EventKind {
    /// A turn was admitted (its deadline fixed).
    Admitted,
    /// A message waits behind the channel's running turn: `depth` turns ahead of it.
    Queued {
        /// Turns ahead of it (the running one included).
        depth: usize,
    },
    /// Every container slot (the actor layer's global cap) is taken: the turn waits.
    WaitingForSlot,
    /// The turn got a container slot after waiting this long.
    WaitedForSlot {
        /// How long.
        waited: Duration,
    },
    /// The turn reached a phase.
    Phase(TurnPhase),
    /// The turn ended (once per turn, and once per refused message): `None` when its
    /// reply is the guest's own success.
    Ended {
        /// Why it did not succeed.
        failure: Option<TurnFailure>,
        /// Whether a prepared container served it.
        warm: bool,
    },
    /// The warm pool.
    Warm(WarmEvent),
    /// The broker.
    Broker(BrokerEvent),
    /// A budget refused a turn before anything was made for it, or a model call of a
    /// running turn (the guest's, or its compactor's): see [`crate::budgets`].
    BudgetRefused {
        /// Which budget.
        budget: crate::budgets::Budget,
        /// Whether the turn was running (a model call refused) rather than refused at its start.
        mid_turn: bool,
    },
    /// What a turn (or a message refused before its turn) was, whole: who spoke, the bytes
    /// in and out, the host-counted usage, the budget that refused it, the workspace after
    /// it, and its [`TurnRecord`] (its durations, calls and refusals, as the turn runner
    /// knows them: no observer rebuilds them from the other events). Sent once, just before
    /// the turn's last event (its `Phase(Done)`; a refused message's `Ended`). Its
    /// `speaker` is guest-chosen text: never a metric label (see [`TurnFacts`]).
    Facts(Box<TurnFacts>),
    /// The budgets' shared store (`[budgets] store`): this process's view of the other
    /// processes' spend turned stale (the database not reached for longer than
    /// `max_staleness_secs`: new turns, and running turns' counted model calls and egress
    /// requests, refused unless `fail_open`) or fresh again.
    BudgetStore {
        /// Whether the view is stale now.
        stale: bool,
    },
    /// One call to the container engine.
    Engine {
        /// The operation (`create`, `start`, `remove`, `inspect`, …).
        op: &'static str,
        /// How long it took.
        latency: Duration,
        /// Whether it succeeded.
        ok: bool,
    },
}

/// What a turn was, for the audit trail (see [`EventKind::Facts`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TurnFacts {
    /// The speaker's id, as the chat gave it: **guest-chosen text** (never a metric label;
    /// the audit trail writes it JSON-escaped, the CLI shows it through
    /// [`crate::display`]).
    pub speaker: String,
    /// The message's size in bytes (UTF-8).
    pub bytes_in: u64,
    /// The reply's size in bytes (its text, or its error).
    pub bytes_out: u64,
    /// What the turn used, counted by the host ([`crate::budgets::HostUsage`]).
    pub usage: crate::budgets::HostUsage,
    /// The budget that refused the turn, or one of its model calls.
    pub budget: Option<crate::budgets::BudgetRefusal>,
    /// The channel's workspace after the turn, in allocated bytes: measured only when the
    /// audit trail is on and the host measures the workspace (`None` otherwise).
    pub workspace_bytes: Option<u64>,
    /// The message and the reply, only when `audit.include_text` is set; sealed: only the
    /// audit trail reads it (an observer never sees guest text).
    pub text: Option<AuditText>,
    /// The turn as its runner saw it: durations, calls, refusals, its end.
    pub record: TurnRecord,
}

/// A whole turn as the turn runner saw it (in [`TurnFacts::record`]): what an observer would
/// otherwise rebuild from the turn's other events, with its durations measured where they
/// happened.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct TurnRecord {
    /// From its admission to its end (`None`: a message refused before it was admitted).
    pub total: Option<Duration>,
    /// The wait for a container slot (the actor layer's), if it waited.
    pub slot_wait: Option<Duration>,
    /// Each phase it went through and the time it spent in it, in order (a model or tool
    /// call is a phase of its own each time; `Done`, the last, has none).
    pub phases: Vec<(TurnPhase, Duration)>,
    /// Its model and tool calls ([`BrokerEvent::ModelCall`], [`BrokerEvent::ToolCall`]), in
    /// the order they were answered.
    pub calls: Vec<BrokerEvent>,
    /// The broker's refusals (status, limit), the first [`TurnRecord::MAX_REFUSALS`].
    pub refusals: Vec<(u16, Refusal)>,
    /// Refusals past [`TurnRecord::MAX_REFUSALS`], counted only.
    pub refusals_omitted: u64,
    /// How it ended: `Some(None)` ok, `Some(Some(kind))` failed, `None` its end not seen.
    pub ended: Option<Option<TurnFailure>>,
    /// Whether a prepared container served it.
    pub warm: bool,
    /// Whether a prepared container could not serve it (it started cold).
    pub fell_back: bool,
}

impl TurnRecord {
    /// Refusals kept in a record; the rest are counted.
    pub const MAX_REFUSALS: usize = 64;

    /// Whether its container ran (it reached [`TurnPhase::ContainerRunning`]).
    pub fn ran(&self) -> bool {
        self.phases
            .iter()
            .any(|(p, _)| *p == TurnPhase::ContainerRunning)
    }

    /// The record of a message that ended before the core ran it (`admitted`: when it was
    /// admitted, if it was).
    pub fn ended_early(failure: TurnFailure, admitted: Option<Instant>) -> Self {
        Self {
            total: admitted.map(|a| a.elapsed()),
            ended: Some(Some(failure)),
            ..Self::default()
        }
    }
}

impl TurnFacts {
    /// The facts of a message that ended before the core ran it (the actor layer's `Busy`,
    /// `ShuttingDown`, a slot timeout): its speaker, its size and its record.
    pub fn refused(speaker: &str, message: &str, record: TurnRecord) -> Self {
        Self {
            speaker: speaker.to_owned(),
            bytes_in: message.len() as u64,
            bytes_out: 0,
            usage: Default::default(),
            budget: None,
            workspace_bytes: None,
            text: None,
            record,
        }
    }
}

/// A turn's message and reply, for the audit trail alone (`audit.include_text`): no
/// accessor outside the crate, and its `Debug` shows neither.
#[derive(Clone, PartialEq, Eq)]
pub struct AuditText {
    pub(crate) message: String,
    pub(crate) reply: String,
}

impl std::fmt::Debug for AuditText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuditText(..)")
    }
}

/// What the warm pool did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WarmEvent {
    /// A container was prepared for the channel's next turn.
    Prepared,
    /// A turn adopted its prepared container.
    Adopted,
    /// The prepared container could not serve; the turn started cold.
    FellBack {
        /// Why (the host's error text: never guest text).
        reason: String,
    },
    /// A prepared container was removed unused.
    Discarded {
        /// Why (`expired`, `reset since prepared`, `shutting down`, …).
        reason: String,
    },
}

/// What the broker did for a turn.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum BrokerEvent {
    /// A model call was answered (or failed upstream): the guest's chat completion, or
    /// one of the compactor's summary calls.
    ModelCall {
        /// Which call: the guest's, or the compactor's (to its summarizer or the model).
        operation: ModelOperation,
        /// The status the guest got (a compactor's call: the upstream's status, or `502`
        /// unreachable, `504` timed out, `503` the turn was stopped).
        status: u16,
        /// From the forwarded request to the upstream's answer (its head, when streamed).
        latency: Duration,
        /// The upstream's token usage, when it said (a whole answer's `usage`, or a
        /// stream's usage chunk: the event of a stream comes when the stream ends, however
        /// it ends).
        usage: Option<Usage>,
    },
    /// A host or MCP tool was called.
    ToolCall {
        /// The tool (`server/tool` for MCP).
        name: String,
        /// Whether it is an MCP tool.
        mcp: bool,
        /// Whether it answered with a result (2xx).
        ok: bool,
        /// How long it took.
        latency: Duration,
    },
    /// A web request through an egress route: sent, refused by a rule, or sent in a route's
    /// `audit` mode past a rule that would have refused it.
    Egress(Box<EgressCall>),
    /// The broker refused a request (every 4xx/5xx it answers itself).
    Refused {
        /// The status.
        status: u16,
        /// The limit or rule that refused.
        limit: Refusal,
    },
}

/// One egress request (see [`BrokerEvent::Egress`]): never a credential, a body or a query
/// value.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EgressCall {
    /// The route (an operator's name).
    pub route: String,
    /// The method.
    pub method: String,
    /// The host asked for (guest-chosen within the route's rules: never a metric label).
    pub host: String,
    /// The path, with every query value left out.
    pub path: String,
    /// The upstream's status; 0 when nothing was sent (refused, or the connection failed).
    pub status: u16,
    /// Bytes sent (the path, the query and the body).
    pub bytes_out: u64,
    /// Bytes read (the body).
    pub bytes_in: u64,
    /// From the request to the answer's last byte.
    pub latency: Duration,
    /// What was decided.
    pub decision: EgressDecision,
    /// The rule that refused it (or would have, in `audit` mode).
    pub rule: Option<String>,
    /// The address connected to.
    pub address: Option<std::net::IpAddr>,
}

/// What was decided of an egress request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EgressDecision {
    /// Sent.
    Allowed,
    /// Refused by a rule (`403`).
    Denied,
    /// Sent in `audit` mode although a rule would have refused it.
    AuditDenied,
}

impl EgressDecision {
    /// A short name, fit for a metric label.
    pub fn key(self) -> &'static str {
        match self {
            EgressDecision::Allowed => "allowed",
            EgressDecision::Denied => "denied",
            EgressDecision::AuditDenied => "audit_denied",
        }
    }
}

/// Which model call a [`BrokerEvent::ModelCall`] is. New kinds may come: match with a `_`
/// arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ModelOperation {
    /// The guest's `/v1/chat/completions`, forwarded.
    Chat,
    /// A compaction's summary call to the separate summarizer (`[compaction.summarizer]`).
    CompactionSummarizer,
    /// A compaction's summary call to the main model.
    CompactionModel,
}

impl ModelOperation {
    /// A short name, fit for a metric label.
    pub fn key(self) -> &'static str {
        match self {
            ModelOperation::Chat => "chat",
            ModelOperation::CompactionSummarizer => "compaction_summarizer",
            ModelOperation::CompactionModel => "compaction_model",
        }
    }
}

/// The limit or rule behind a broker refusal. New kinds may come: match with a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// `max_calls_in_flight` (429).
    CallsInFlight,
    /// `max_connections` (503).
    Connections,
    /// `max_request_bytes` (413).
    RequestBytes,
    /// `max_model_calls` (429).
    ModelCalls,
    /// `max_tool_calls` (429).
    ToolCalls,
    /// Tool arguments past the JSON value cap (400).
    ArgumentComplexity,
    /// A model request field outside the allow-list (400).
    ModelField,
    /// A tool's arguments do not match its schema (400).
    ToolArguments,
    /// An unknown path, tool or MCP server (404).
    UnknownRoute,
    /// A method the path does not take (405).
    Method,
    /// A request the broker cannot read (malformed JSON, not an object, unreadable body,
    /// or a head hyper cannot parse and answers `400` itself). A head not sent within the
    /// header timeout gets no answer (hyper closes the connection), and so no event.
    Malformed,
    /// The request's body did not arrive within `call_timeout` (408).
    BodyTimeout,
    /// The peer is not the worker uid (403).
    PeerUid,
    /// All of the MCP server's channel sessions are busy (503).
    McpSessions,
    /// A confined MCP session's container passed its storage quota (507).
    McpQuota,
    /// The turn was cancelled (503).
    Cancelled,
    /// The key could not be had (502).
    Key,
    /// A compaction request past its caps or rules (400/413).
    Compaction,
    /// A token budget has no room for the model call (429): which one.
    Budget(Budget),
    /// A request head past the broker's cap (431), or a URI past hyper's (414): answered by
    /// hyper itself, seen when the connection ends.
    HeadBytes,
    /// An egress route's per-turn caps (requests, bytes in or out: 429).
    EgressCaps,
    /// Any other failure of the broker's own (500).
    Internal,
}

/// A view of the runtime's events inside the crate (the audit trail): sees each event after
/// the observer, on the same thread; must return quickly.
pub(crate) trait EventSink: Send + Sync {
    /// Takes one event.
    fn observe(&self, event: &Event);
}

/// Where a runtime's events go: the observer, the audit trail, and the counters built on
/// the events.
#[derive(Default)]
pub(crate) struct EventHub {
    observer: Option<Observer>,
    /// The audit trail (`[audit]`), a view of the same events.
    audit: Option<Arc<dyn EventSink>>,
    next_turn: AtomicU64,
    adopted: AtomicU64,
    fell_back: AtomicU64,
}

impl std::fmt::Debug for EventHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventHub")
            .field("observer", &self.observer.as_ref().map(|_| "observer"))
            .finish_non_exhaustive()
    }
}

impl EventHub {
    pub(crate) fn new(observer: Option<Observer>, audit: Option<Arc<dyn EventSink>>) -> Self {
        Self {
            observer,
            audit,
            ..Self::default()
        }
    }

    /// The next turn's runtime-wide number (from 1).
    pub(crate) fn next_turn(&self) -> u64 {
        self.next_turn.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Turns served by a prepared container, and turns whose prepared container could not
    /// serve (from the events).
    pub(crate) fn warm_counts(&self) -> (u64, u64) {
        (
            self.adopted.load(Ordering::Relaxed),
            self.fell_back.load(Ordering::Relaxed),
        )
    }

    /// Sends one event.
    pub(crate) fn emit(&self, turn: Option<u64>, channel: Option<&ChannelId>, kind: EventKind) {
        match &kind {
            EventKind::Warm(WarmEvent::Adopted) => {
                self.adopted.fetch_add(1, Ordering::Relaxed);
            }
            EventKind::Warm(WarmEvent::FellBack { .. }) => {
                self.fell_back.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        if self.observer.is_none() && self.audit.is_none() {
            return;
        }
        let event = Event {
            at: Instant::now(),
            turn,
            channel: channel.map(ChannelId::short_shared),
            kind,
        };
        if let Some(observer) = &self.observer {
            if std::panic::catch_unwind(AssertUnwindSafe(|| observer(&event))).is_err() {
                tracing::warn!("the event observer panicked; the runtime goes on");
            }
        }
        if let Some(audit) = &self.audit {
            audit.observe(&event);
        }
    }
}

/// One turn's events: its number and channel stamped on each, and its [`TurnRecord`] kept
/// as they are sent. Cheap to clone; the broker holds one per turn.
#[derive(Clone)]
pub struct TurnEvents {
    hub: Arc<EventHub>,
    turn: u64,
    channel: ChannelId,
    record: Arc<std::sync::Mutex<Recording>>,
}

/// A turn's record as its events are sent: phases with the instants they began.
#[derive(Default)]
struct Recording {
    phases: Vec<(TurnPhase, Instant)>,
    record: TurnRecord,
}

impl std::fmt::Debug for TurnEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnEvents")
            .field("turn", &self.turn)
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl TurnEvents {
    pub(crate) fn new(hub: Arc<EventHub>, turn: u64, channel: ChannelId) -> Self {
        Self {
            hub,
            turn,
            channel,
            record: Default::default(),
        }
    }

    /// The turn's record up to now (`admitted`: its admission; `slot_wait`: the actor
    /// layer's wait): the last phase runs to now.
    pub(crate) fn record(&self, admitted: Instant, slot_wait: Option<Duration>) -> TurnRecord {
        let now = Instant::now();
        let r = self.record.lock().unwrap_or_else(|e| e.into_inner());
        let mut record = r.record.clone();
        record.total = Some(now.saturating_duration_since(admitted));
        record.slot_wait = slot_wait;
        let ends = r.phases.iter().skip(1).map(|(_, at)| *at).chain([now]);
        record.phases = r
            .phases
            .iter()
            .zip(ends)
            .map(|((phase, from), to)| (*phase, to.saturating_duration_since(*from)))
            .collect();
        record
    }

    /// Keeps what `kind` adds to the turn's record.
    fn keep(&self, kind: &EventKind) {
        let keeps = matches!(
            kind,
            EventKind::Phase(_)
                | EventKind::Ended { .. }
                | EventKind::Warm(WarmEvent::Adopted | WarmEvent::FellBack { .. })
                | EventKind::Broker(_)
        );
        if !keeps {
            return;
        }
        let mut r = self.record.lock().unwrap_or_else(|e| e.into_inner());
        let r = &mut *r;
        match kind {
            EventKind::Phase(phase) => r.phases.push((*phase, Instant::now())),
            EventKind::Ended { failure, warm } => {
                r.record.ended = Some(*failure);
                r.record.warm = *warm;
            }
            EventKind::Warm(WarmEvent::FellBack { .. }) => r.record.fell_back = true,
            EventKind::Broker(BrokerEvent::Refused { status, limit }) => {
                if r.record.refusals.len() < TurnRecord::MAX_REFUSALS {
                    r.record.refusals.push((*status, *limit));
                } else {
                    r.record.refusals_omitted += 1;
                }
            }
            EventKind::Broker(call) => r.record.calls.push(call.clone()),
            _ => {}
        }
    }

    /// A turn's events for a broker driven alone (the bench, with the `testing` feature):
    /// each goes to `observer`, as turn `turn` of `channel`.
    #[cfg(feature = "testing")]
    pub fn observed(observer: Observer, turn: u64, channel: &str) -> Self {
        Self::new(
            Arc::new(EventHub::new(Some(observer), None)),
            turn,
            ChannelId::new(channel),
        )
    }

    /// Sends `kind` as this turn's (what the runtime sends around a broker: its
    /// `Admitted`, its `Phase(Done)`), for a broker driven without a runtime (the bench).
    #[cfg(feature = "testing")]
    pub fn emit_as_runtime(&self, kind: EventKind) {
        self.emit(kind);
    }

    pub(crate) fn emit(&self, kind: EventKind) {
        self.keep(&kind);
        self.hub.emit(Some(self.turn), Some(&self.channel), kind);
    }

    /// A broker event of the turn.
    pub(crate) fn broker(&self, event: BrokerEvent) {
        self.emit(EventKind::Broker(event));
    }
}

/// A turn's events, or none (a broker driven alone).
pub(crate) fn emit(events: &Option<TurnEvents>, kind: EventKind) {
    if let Some(e) = events {
        e.emit(kind);
    }
}
