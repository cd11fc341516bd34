//! A Prometheus endpoint for roundtable-sandbox: an adapter on the runtime's event seam
//! ([`roundtable_sandbox::events`]) that the core does not depend on.
//!
//! Its parts:
//! - [`Metrics`]: one registry (`prometheus-client`, its own types) fed from the one seam:
//!   install [`Metrics::observer`] as the core's `Config::observer`; [`Metrics::encode`]
//!   writes the OpenMetrics text. It keeps nothing per turn: a turn's durations come whole
//!   in its `Facts` (its [`TurnRecord`](roundtable_sandbox::events::TurnRecord)), the
//!   gauges move on the events that start and end what they count;
//! - [`MetricsServer`]: `GET /metrics` over HTTP/1 (hyper 1) on a TCP listener, served on a
//!   thread of its own (a scrape never waits on the actor thread, nor it on a scrape);
//! - [`labels`]: the fixed label values every event is mapped to (outcomes, phases, warm
//!   reasons, refusals, budgets, engine operations). No label ever holds a channel key, a
//!   channel hash, a speaker, a tool's name or any text a guest or the host wrote: each
//!   label's values are a closed set;
//! - [`check_address`] and [`bindable`]: the endpoint's address rule (loopback unless
//!   asked otherwise) and the check `doctor` runs;
//! - `MetricsArgs` (feature `cli`): `--metrics ADDR` and `--metrics-allow-remote` for
//!   the bots.
//!
//! The metrics (names as Prometheus writes them):
//!
//! | name | type | labels |
//! | --- | --- | --- |
//! | `roundtable_turns_total` | counter | `outcome` |
//! | `roundtable_turn_duration_seconds` | histogram | `launch_type` (`warm`, `cold`), `outcome` |
//! | `roundtable_turn_phase_duration_seconds` | histogram | `phase` |
//! | `roundtable_queue_depth` | gauge | — |
//! | `roundtable_containers_running`, `roundtable_containers_prepared` | gauge | — |
//! | `roundtable_warm_adoptions_total` | counter | — |
//! | `roundtable_warm_fallbacks_total`, `roundtable_warm_discards_total` | counter | `reason` |
//! | `roundtable_broker_refusals_total` | counter | `status`, `limit` |
//! | `roundtable_tool_calls_total` | counter | `kind` (`host`, `mcp`), `outcome` (`ok`, `error`) |
//! | `roundtable_budget_refusals_total` | counter | `budget`, `stage` (`admission`, `model_call`) |
//! | `roundtable_budget_store_stale` | gauge | — (1 while the shared budget store's view is older than `max_staleness_secs`) |
//! | `roundtable_engine_call_duration_seconds` | histogram | `operation`, `outcome` |
//! | `roundtable_egress_requests_total` | counter | `route` (the operator's route names), `decision` (`allowed`, `denied`, `audit_denied`) |
//! | `roundtable_egress_bytes_total` | counter | `route`, `direction` (`out`, `in`) |
//! | `gen_ai_client_operation_duration_seconds` | histogram | `gen_ai_operation_name` (`chat`), `roundtable_operation` (`chat`, `compaction_summarizer`, `compaction_model`), `error_type` |
//! | `gen_ai_client_token_usage` | histogram | `gen_ai_operation_name`, `roundtable_operation`, `gen_ai_token_type` (`input`, `output`) |
//!
//! The two `gen_ai_*` families follow the OpenTelemetry GenAI semantic conventions
//! (`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`) as Prometheus writes
//! them. Their tokens are the upstream's own `usage` of each answer (a whole body's, or a
//! stream's usage chunk), the guest's calls and the compactor's; an answer without one
//! adds no tokens here (the budgets count it by their estimate).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use roundtable_sandbox::events::{BrokerEvent, Event, EventKind, Observer, TurnFacts, WarmEvent};
use roundtable_sandbox::TurnPhase;

mod server;

pub use server::{bindable, check_address, MetricsError, MetricsServer};

#[cfg(feature = "cli")]
mod args;
#[cfg(feature = "cli")]
pub use args::MetricsArgs;

pub mod labels;

type Labels1 = [(&'static str, &'static str); 1];
type Labels2 = [(&'static str, &'static str); 2];
type Labels3 = [(&'static str, &'static str); 3];

/// An egress route (an operator's name: a closed set, never a guest's) and a second label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EgressLabels {
    route: String,
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EgressBytesLabels {
    route: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    status: u16,
    limit: &'static str,
}

/// Seconds: 5 ms to ~10 min.
const SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

type HistFamily<S> = Family<S, Histogram, fn() -> Histogram>;

fn seconds() -> Histogram {
    Histogram::new(SECONDS.iter().copied())
}

fn tokens() -> Histogram {
    // 1 to 4^13 (~67 M) tokens, as the GenAI conventions advise.
    Histogram::new(exponential_buckets(1.0, 4.0, 14))
}

/// The registry and its metrics, fed from the event seam (see the [crate] docs).
pub struct Metrics {
    registry: Registry,
    turns: Family<Labels1, Counter>,
    turn_duration: HistFamily<Labels2>,
    phase_duration: HistFamily<Labels1>,
    queue_depth: Gauge,
    running: Gauge,
    prepared: Gauge,
    adoptions: Counter,
    fallbacks: Family<Labels1, Counter>,
    discards: Family<Labels1, Counter>,
    refusals: Family<RefusalLabels, Counter>,
    tool_calls: Family<Labels2, Counter>,
    budget_refusals: Family<Labels2, Counter>,
    budget_store_stale: Gauge,
    engine: HistFamily<Labels2>,
    model_duration: HistFamily<Labels3>,
    model_tokens: HistFamily<Labels3>,
    egress: Family<EgressLabels, Counter>,
    egress_bytes: Family<EgressBytesLabels, Counter>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// What the gauges and durations need to remember between events: keyed by turn number
/// and channel hash, never exported.
#[derive(Default)]
struct State {
    /// Messages queued per channel (by its short hash), not yet admitted.
    queued: HashMap<String, u64>,
    /// Prepared containers per channel (by its short hash).
    prepared: HashMap<String, u64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric at zero: the turns' metrics, then the broker's (the
    /// order they are exported in).
    pub fn new() -> Self {
        let mut metrics = Self {
            registry: Registry::default(),
            turns: Family::default(),
            turn_duration: Family::new_with_constructor(seconds),
            phase_duration: Family::new_with_constructor(seconds),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            prepared: Gauge::default(),
            adoptions: Counter::default(),
            fallbacks: Family::default(),
            discards: Family::default(),
            refusals: Family::default(),
            tool_calls: Family::default(),
            budget_refusals: Family::default(),
            budget_store_stale: Gauge::default(),
            engine: Family::new_with_constructor(seconds),
            model_duration: Family::new_with_constructor(seconds),
            model_tokens: Family::new_with_constructor(tokens),
            egress: Family::default(),
            egress_bytes: Family::default(),
            state: Mutex::default(),
        };
        metrics.register_turns();
        metrics.register_broker();
        metrics
    }

    /// Registers the turns' metrics: outcomes, durations and phases, the queue, the
    /// containers running and prepared, and the warm path's adoptions, fallbacks and
    /// discards.
    fn register_turns(&mut self) {
        self.registry.register(
            "roundtable_turns",
            "Turns ended, by outcome (ok or the failure kind; refused messages included)",
            self.turns.clone(),
        );
        self.registry.register_with_unit(
            "roundtable_turn_duration",
            "Turn duration from admission to its end, by launch type and outcome",
            Unit::Seconds,
            self.turn_duration.clone(),
        );
        self.registry.register_with_unit(
            "roundtable_turn_phase_duration",
            "Time a turn spent in each phase (waiting_for_slot included)",
            Unit::Seconds,
            self.phase_duration.clone(),
        );
        self.registry.register(
            "roundtable_queue_depth",
            "Messages waiting behind their channel's running turn",
            self.queue_depth.clone(),
        );
        self.registry.register(
            "roundtable_containers_running",
            "Turn containers running (from the start of the container phase to the turn's teardown)",
            self.running.clone(),
        );
        self.registry.register(
            "roundtable_containers_prepared",
            "Prepared (warm) containers waiting for their channel's next turn",
            self.prepared.clone(),
        );
        self.registry.register(
            "roundtable_warm_adoptions",
            "Turns served by a prepared container",
            self.adoptions.clone(),
        );
        self.registry.register(
            "roundtable_warm_fallbacks",
            "Prepared containers that could not serve (the turn started cold), by reason",
            self.fallbacks.clone(),
        );
        self.registry.register(
            "roundtable_warm_discards",
            "Prepared containers removed unused, by reason",
            self.discards.clone(),
        );
    }

    /// Registers the broker's metrics: its refusals, the tool calls, the budgets, the
    /// engine calls, the model calls (GenAI conventions) and the egress.
    fn register_broker(&mut self) {
        self.registry.register(
            "roundtable_broker_refusals",
            "Requests the broker refused itself, by status and the limit that refused",
            self.refusals.clone(),
        );
        self.registry.register(
            "roundtable_tool_calls",
            "Host and MCP tool calls made, by kind and outcome",
            self.tool_calls.clone(),
        );
        self.registry.register(
            "roundtable_budget_refusals",
            "Turns (at admission) and model calls (mid-turn) refused by a budget",
            self.budget_refusals.clone(),
        );
        self.registry.register(
            "roundtable_budget_store_stale",
            "1 while this process's view of the shared budget store is older than max_staleness_secs",
            self.budget_store_stale.clone(),
        );
        self.registry.register_with_unit(
            "roundtable_engine_call_duration",
            "Calls to the container engine, by operation and outcome",
            Unit::Seconds,
            self.engine.clone(),
        );
        self.registry.register_with_unit(
            "gen_ai_client_operation_duration",
            "GenAI operation duration: each model call the broker forwarded, to the upstream's answer",
            Unit::Seconds,
            self.model_duration.clone(),
        );
        self.registry.register(
            "gen_ai_client_token_usage",
            "Tokens of each model call as the upstream reported them, by token type",
            self.model_tokens.clone(),
        );
        self.registry.register(
            "roundtable_egress_requests",
            "Egress requests, by route and decision (allowed, denied, audit_denied)",
            self.egress.clone(),
        );
        self.registry.register_with_unit(
            "roundtable_egress",
            "Egress bytes, by route and direction (out: paths, queries, bodies; in: bodies)",
            Unit::Bytes,
            self.egress_bytes.clone(),
        );
    }

    /// The observer to install on the runtime: records every event here.
    pub fn observer(self: &Arc<Self>) -> Observer {
        let me = self.clone();
        Arc::new(move |e: &Event| me.record(e))
    }

    /// The metrics in the OpenMetrics text format (what `/metrics` serves).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records one event.
    pub fn record(&self, event: &Event) {
        match &event.kind {
            EventKind::Admitted => {
                let mut st = self.state();
                if let Some(channel) = &event.channel {
                    if take_one(&mut st.queued, channel) {
                        self.queue_depth.dec();
                    }
                }
            }
            EventKind::Queued { .. } => {
                if let Some(channel) = &event.channel {
                    *self.state().queued.entry(channel.to_string()).or_default() += 1;
                    self.queue_depth.inc();
                }
            }
            EventKind::WaitedForSlot { waited } => {
                self.phase_duration
                    .get_or_create(&[("phase", "waiting_for_slot")])
                    .observe(waited.as_secs_f64());
            }
            // Counted from its start; its turn's `Facts` says whether it ran, and ends it.
            EventKind::Phase(TurnPhase::ContainerRunning) => {
                self.running.inc();
            }
            EventKind::Ended { failure, .. } => {
                let outcome = labels::outcome(*failure);
                self.turns.get_or_create(&[("outcome", outcome)]).inc();
                if matches!(
                    failure,
                    Some(
                        roundtable_sandbox::TurnFailure::ShuttingDown
                            | roundtable_sandbox::TurnFailure::Stopped
                    )
                ) && event.turn.is_none()
                {
                    // A queued message refused at shutdown, or dropped by a withdrawal,
                    // leaves the queue.
                    if let Some(channel) = &event.channel {
                        if take_one(&mut self.state().queued, channel) {
                            self.queue_depth.dec();
                        }
                    }
                }
            }
            EventKind::Facts(facts) => self.facts(facts),
            EventKind::Warm(w) => self.warm(event, w),
            EventKind::Broker(b) => self.broker(b),
            EventKind::BudgetRefused { budget, mid_turn } => {
                let stage = if *mid_turn { "model_call" } else { "admission" };
                self.budget_refusals
                    .get_or_create(&[("budget", labels::budget(*budget)), ("stage", stage)])
                    .inc();
            }
            EventKind::BudgetStore { stale } => {
                self.budget_store_stale.set(i64::from(*stale));
            }
            EventKind::Engine { op, latency, ok } => {
                self.engine
                    .get_or_create(&[
                        ("operation", labels::engine_op(op)),
                        ("outcome", if *ok { "ok" } else { "error" }),
                    ])
                    .observe(latency.as_secs_f64());
            }
            _ => {}
        }
    }

    /// A turn's end, whole: its duration and each phase's, as its runner measured them.
    fn facts(&self, facts: &TurnFacts) {
        let r = &facts.record;
        for (phase, took) in &r.phases {
            self.phase_duration
                .get_or_create(&[("phase", labels::phase(*phase))])
                .observe(took.as_secs_f64());
        }
        if r.ran() {
            self.running.dec();
        }
        if let (Some(total), Some(failure)) = (r.total, r.ended) {
            let launch = if r.warm { "warm" } else { "cold" };
            self.turn_duration
                .get_or_create(&[
                    ("launch_type", launch),
                    ("outcome", labels::outcome(failure)),
                ])
                .observe(total.as_secs_f64());
        }
    }

    fn warm(&self, event: &Event, w: &WarmEvent) {
        let channel = event.channel.as_deref().unwrap_or("");
        let mut st = self.state();
        match w {
            WarmEvent::Prepared => {
                *st.prepared.entry(channel.to_owned()).or_default() += 1;
                self.prepared.inc();
                return;
            }
            WarmEvent::Adopted => {
                self.adoptions.inc();
            }
            WarmEvent::FellBack { reason } => {
                self.fallbacks
                    .get_or_create(&[("reason", labels::fallback_reason(reason))])
                    .inc();
            }
            WarmEvent::Discarded { reason } => {
                self.discards
                    .get_or_create(&[("reason", labels::discard_reason(reason))])
                    .inc();
            }
            _ => return,
        };
        if take_one(&mut st.prepared, channel) {
            self.prepared.dec();
        }
    }

    fn broker(&self, b: &BrokerEvent) {
        match b {
            BrokerEvent::ModelCall {
                operation,
                status,
                latency,
                usage,
                ..
            } => {
                let op = operation.key();
                self.model_duration
                    .get_or_create(&[
                        ("gen_ai_operation_name", "chat"),
                        ("roundtable_operation", op),
                        ("error_type", labels::error_type(*status)),
                    ])
                    .observe(latency.as_secs_f64());
                if let Some(u) = usage {
                    let kinds = [("input", u.prompt_tokens), ("output", u.completion_tokens)];
                    for (kind, n) in kinds {
                        let Some(n) = n else { continue };
                        self.model_tokens
                            .get_or_create(&[
                                ("gen_ai_operation_name", "chat"),
                                ("roundtable_operation", op),
                                ("gen_ai_token_type", kind),
                            ])
                            .observe(n as f64);
                    }
                }
            }
            BrokerEvent::ToolCall { mcp, ok, .. } => {
                self.tool_calls
                    .get_or_create(&[
                        ("kind", if *mcp { "mcp" } else { "host" }),
                        ("outcome", if *ok { "ok" } else { "error" }),
                    ])
                    .inc();
            }
            BrokerEvent::Egress(e) => {
                let route = e.route.clone();
                self.egress
                    .get_or_create(&EgressLabels {
                        route: route.clone(),
                        decision: e.decision.key(),
                    })
                    .inc();
                for (direction, n) in [("out", e.bytes_out), ("in", e.bytes_in)] {
                    self.egress_bytes
                        .get_or_create(&EgressBytesLabels {
                            route: route.clone(),
                            direction,
                        })
                        .inc_by(n);
                }
            }
            BrokerEvent::Refused { status, limit } => {
                self.refusals
                    .get_or_create(&RefusalLabels {
                        status: labels::refusal_status(*status),
                        limit: labels::refusal(*limit),
                    })
                    .inc();
            }
            _ => {}
        }
    }

    /// The value of one sample of [`Metrics::encode`]'s text (`name{labels}` exactly as
    /// written there), for tests and the bench.
    pub fn sample(&self, series: &str) -> Option<f64> {
        let text = self.encode();
        let mut want = String::new();
        let _ = write!(want, "{series} ");
        text.lines()
            .find_map(|l| l.strip_prefix(want.as_str()))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    }
}

/// Takes one from `map[key]` (dropping the key at zero); whether there was one.
fn take_one(map: &mut HashMap<String, u64>, key: &str) -> bool {
    match map.get_mut(key) {
        Some(n) if *n > 1 => {
            *n -= 1;
            true
        }
        Some(_) => {
            map.remove(key);
            true
        }
        None => false,
    }
}
