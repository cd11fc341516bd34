//! The turn: one guest message, from admission to teardown.
//!
//! [`Sandbox::run`] is the equivalent of `runSandboxTurn` in pi-roundtable-sandbox 0.7.18 (the
//! TypeScript package this ports). A turn's parts:
//!
//! - `resources`: `TurnResources`, the one owner of what a turn
//!   holds (the channel's identity, workspace, run dir and its registration, container,
//!   broker listener) and its one teardown; built by the same constructor for a cold turn
//!   and for a prepared container ([`crate::warm`]);
//! - `prepared`: [`PreparedTurn`], those resources started ahead of their turn;
//! - `judge`: what a run did, mapped to a reply once for every backend;
//! - `outcome`: the turn's errors and [`TurnOutcome`];
//! - `kinds`: [`TurnPhase`] and [`TurnFailure`], a leaf the event seam names them from.
//!
//! The run (this module) adopts the resources (a prepared container's, or a cold turn's),
//! checks the workspace's quota and the free-space floor, binds the broker, runs the
//! container until its reply's frame (or its end), judges what it did, hands the reply to a
//! callback **before** cleanup (the container may still run: the teardown kills it), then
//! tears the resources down on every path: listener stopped, container removed, run dir
//! removed. The host never reads a workspace file.
//!
//! The turn timeout counts from the turn's admission ([`Sandbox::admit`]: the deadline is
//! computed there, once), as the TypeScript package arms its timer in `runTurn` before
//! anything else: it covers the workspace checks, the broker's start and the container
//! (and, in the actor layer, the wait for a container slot). Teardown runs after it, on
//! every path.

mod judge;
pub(crate) mod kinds;
mod outcome;
mod prepared;
pub(crate) mod resources;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use roundtable_sandbox_protocol::{Reply, Speaker, Turn};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::broker::TurnContext;
pub use crate::channel::channel_segment;
use crate::driver::DriverError;
use crate::events::{EventKind, TurnEvents, WarmEvent};
use crate::Sandbox;
pub use judge::judge;
pub use kinds::{TurnFailure, TurnPhase};
pub use outcome::{TurnError, TurnOutcome};
pub use prepared::PreparedTurn;
use resources::{Start, TurnResources};
pub use resources::{LABEL_PREPARED, SOCKET_FILE};
pub use roundtable_sandbox_protocol::{parse_reply, ReplyError, GUEST_ERROR_PREFIX};

/// What the caller asks of one turn.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    /// The channel (any string; the workspace is named by its hash, computed once).
    pub channel: crate::ChannelId,
    /// Who wrote the message.
    pub speaker: Speaker,
    /// The message.
    pub text: String,
    /// Start a fresh session (the reset generation at admission was above zero).
    pub reset: bool,
    /// Fired by the caller to stop the turn.
    pub stop: CancellationToken,
    /// When the turn was admitted: its timeout counts from here (`None`: from the call of
    /// [`Sandbox::run`]). The actor layer sets it to the channel's admission, so the wait for a
    /// container slot counts too.
    pub admitted: Option<Instant>,
    /// What the per-speaker budgets (`speaker_tokens_per_day`, `speaker_turns_per_minute`)
    /// count this turn under instead of `speaker.id`, when set: something the sender cannot
    /// change at will where the speaker id is (an IRC nick; the IRC bot passes a keyed hash
    /// of the sender's host). Read by the budgets alone: never written into the turn, the
    /// audit trail, an event or a log line, so the model, the guest and the other guests see
    /// only `speaker`. `None`: the budgets count `speaker.id`, as before.
    pub limits_key: Option<String>,
}

impl TurnRequest {
    /// The key the per-speaker budgets count this turn under: [`Self::limits_key`], else the
    /// speaker's id; one too long or holding a NUL as its hash ([`crate::budgets::stored_key`]).
    pub(crate) fn limits_id(&self) -> std::borrow::Cow<'_, str> {
        crate::budgets::stored_key(self.limits_key.as_deref().unwrap_or(&self.speaker.id))
    }
}

/// A turn admitted: its request and its deadline, computed once here, at admission
/// ([`Sandbox::admit`]). The deadline covers the wait for a container slot (the actor
/// layer's), the workspace checks, the broker's start and the container.
#[derive(Debug)]
pub struct AdmittedTurn {
    request: TurnRequest,
    admitted: Instant,
    deadline: Instant,
    number: u64,
    stopped_for: Option<Arc<OnceLock<TurnFailure>>>,
    slot_wait: Option<Duration>,
}

impl AdmittedTurn {
    /// The turn's runtime-wide number (from 1): names it in every [`Event`](crate::events::Event).
    pub fn number(&self) -> u64 {
        self.number
    }

    /// The caller's own reason for a stop, if it sets one before it stops the turn (the
    /// actor layer's shutdown, a restarted channel): the turn's
    /// [`EventKind::Ended`] reports that kind instead of
    /// `Stopped`, as the caller answers it.
    pub fn stop_reason(&mut self, reason: Arc<OnceLock<TurnFailure>>) {
        self.stopped_for = Some(reason);
    }

    /// When the turn must have ended: its admission plus `turn_timeout`.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// When it was admitted.
    pub fn admitted(&self) -> Instant {
        self.admitted
    }

    /// The caller waited this long for a container slot before running it (the actor
    /// layer's): it goes into the turn's record ([`crate::events::TurnRecord::slot_wait`]).
    pub fn waited_for_slot(&mut self, waited: Duration) {
        self.slot_wait = Some(waited);
    }

    /// What was asked.
    pub fn request(&self) -> &TurnRequest {
        &self.request
    }
}

/// Admits a turn (see [`Sandbox::admit`]): its deadline is [`TurnRequest::admitted`]
/// (default: now) plus the turn timeout, computed here and nowhere else.
pub(crate) fn admit(sandbox: &Sandbox, request: TurnRequest) -> AdmittedTurn {
    let admitted = request.admitted.unwrap_or_else(Instant::now);
    let number = sandbox.events().next_turn();
    sandbox.emit(Some(number), Some(&request.channel), EventKind::Admitted);
    AdmittedTurn {
        deadline: admitted + sandbox.config().turn_timeout,
        admitted,
        request,
        number,
        stopped_for: None,
        slot_wait: None,
    }
}

/// Runs an admitted turn (see [`Sandbox::run`]).
pub(crate) async fn run(
    sandbox: &Sandbox,
    turn: AdmittedTurn,
    prepared: Option<PreparedTurn>,
    on_reply: impl FnOnce(&TurnOutcome),
) -> TurnOutcome {
    let mut resources = prepared.and_then(PreparedTurn::adopt);
    if let Some(r) = resources.take_if(|r| *r.channel() != turn.request.channel) {
        tracing::warn!(container = %r.spec().name, "a container prepared for another channel is not adopted");
        r.discarded("prepared for another channel");
        r.teardown_logged("remove prepared container").await;
    }
    let events = TurnEvents::new(
        sandbox.events().clone(),
        turn.number,
        turn.request.channel.clone(),
    );
    let span = tracing::info_span!(
        "turn",
        channel = turn.request.channel.short(),
        turn = resources.as_ref().map(|r| &r.turn_id()[..8]),
        reset = turn.request.reset,
        warm = resources.is_some()
    );
    let run = Run {
        sandbox,
        request: &turn.request,
        deadline: turn.deadline,
        admitted: turn.admitted,
        slot_wait: turn.slot_wait,
        events,
        stopped_for: turn.stopped_for.clone(),
        cancel: turn.request.stop.child_token(),
        // The host's count of what this turn uses, and its view of the budgets.
        account: Arc::new(crate::budgets::TurnAccount::new(
            &turn.request.limits_id(),
            turn.request.channel.segment(),
            sandbox.budgets().cloned(),
        )),
        workspace: Default::default(),
    };
    // On the heap: the run's state is large in a debug build, and the callers' futures
    // (the actor layer's turn task) are built and moved on the stack.
    Box::pin(run.run(resources, on_reply).instrument(span)).await
}

/// One turn's run: what it was asked, its deadline, its events and its own cancellation (stop, timeout and teardown all end broker calls
/// with it).
struct Run<'a> {
    sandbox: &'a Sandbox,
    /// When the turn was admitted, and how long it waited for a slot (its record's).
    admitted: Instant,
    slot_wait: Option<Duration>,
    request: &'a TurnRequest,
    deadline: Instant,
    events: TurnEvents,
    stopped_for: Option<Arc<OnceLock<TurnFailure>>>,
    cancel: CancellationToken,
    account: Arc<crate::budgets::TurnAccount>,
    /// The workspace the host measures (for the audit trail's use after the turn).
    workspace: std::sync::Mutex<Option<Arc<crate::quota::Workspace>>>,
}

impl Run<'_> {
    fn phase(&self, phase: TurnPhase) {
        self.events.emit(EventKind::Phase(phase));
    }

    /// Runs the turn in `resources` (prepared) or in a cold turn's, replies, tears down.
    async fn run(
        self,
        mut resources: Option<TurnResources>,
        on_reply: impl FnOnce(&TurnOutcome),
    ) -> TurnOutcome {
        let started = Instant::now();
        self.phase(TurnPhase::Preparing);
        let mut warm = false;
        let result = self.answer(&mut resources, &mut warm).await;
        let (reply, budget) = self.outcome(result);
        let failure = match (
            reply.failure,
            self.stopped_for.as_ref().and_then(|r| r.get()),
        ) {
            (Some(TurnFailure::Stopped), Some(reason)) => Some(*reason),
            (failure, _) => failure,
        };
        // The answer is made: a guest still running after its reply's frame gets no broker
        // call from here on (every call in flight ends), before the caller is answered.
        self.cancel.cancel();
        self.events.emit(EventKind::Ended { failure, warm });
        self.phase(TurnPhase::Replied);
        on_reply(&reply);

        // Teardown: every step runs; the turn's reply stands, cleanup errors are logged.
        self.phase(TurnPhase::TearingDown);
        self.tear_down(resources, &reply, budget, started).await;
        self.phase(TurnPhase::Done);
        reply
    }

    /// The turn's outcome from its answer: the guest's reply or the failure, with the
    /// host's count of what it used, and the budget that refused it (if one did).
    fn outcome(
        &self,
        result: Result<Reply, TurnError>,
    ) -> (TurnOutcome, Option<crate::budgets::BudgetRefusal>) {
        let mut budget = None;
        let mut reply = match result {
            Ok(reply) => TurnOutcome::from_guest(reply),
            Err(e) => {
                let failure = e.failure();
                tracing::info!(error = %e, kind = ?failure, "turn failed");
                if let TurnError::Budget(refusal) = &e {
                    budget = Some(refusal.clone());
                }
                TurnOutcome::failed(&e)
            }
        };
        reply.usage = self.account.usage();
        // A failure after a budget refused a model call is the budget's.
        if reply.failure.is_some() && self.account.refusal().is_some() {
            reply.failure = Some(TurnFailure::BudgetExceeded);
        }
        (reply, budget)
    }

    /// After the reply: the resources torn down, the workspace's use measured for the
    /// audit trail, the turn logged and its facts sent.
    async fn tear_down(
        &self,
        mut resources: Option<TurnResources>,
        reply: &TurnOutcome,
        budget: Option<crate::budgets::BudgetRefusal>,
        started: Instant,
    ) {
        // The workspace's use after the turn, for the audit trail, once the container is
        // gone (a guest may go on writing after its reply until it is killed), off the
        // async threads.
        let audit = self.sandbox.audit().cloned();
        let workspace = audit.as_ref().and_then(|_| {
            self.workspace
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
        });
        let quota = self.sandbox.config().limits.workspace_quota();
        let measure = async move {
            let ws = workspace?;
            tokio::task::spawn_blocking(move || crate::quota::measure(&ws, &quota, None).ok())
                .await
                .ok()
                .flatten()
                .map(|u| u.bytes)
        };
        let teardown = async {
            if let Some(r) = resources.take() {
                r.teardown_logged("turn cleanup").await;
            }
        };
        teardown.await;
        let workspace_bytes = measure.await;
        tracing::info!(
            ok = reply.ok,
            total_ms = started.elapsed().as_millis() as u64,
            prompt_tokens = reply.usage.prompt_tokens,
            completion_tokens = reply.usage.completion_tokens,
            model_calls = reply.usage.model_calls,
            tool_calls = reply.usage.tool_calls,
            "turn done"
        );
        let reply_text = reply
            .text
            .as_deref()
            .or(reply.error.as_deref())
            .unwrap_or("");
        self.events
            .emit(EventKind::Facts(Box::new(crate::events::TurnFacts {
                speaker: self.request.speaker.id.clone(),
                bytes_in: self.request.text.len() as u64,
                bytes_out: reply_text.len() as u64,
                usage: reply.usage,
                budget: budget.or_else(|| self.account.refusal()),
                workspace_bytes,
                text: audit
                    .filter(|a| a.include_text())
                    .map(|_| crate::events::AuditText {
                        message: self.request.text.clone(),
                        reply: reply_text.to_owned(),
                    }),
                record: self.events.record(self.admitted, self.slot_wait),
            })));
    }

    /// Everything up to the reply: the checks, the broker, the container, the judgement.
    /// The resources stay in `slot` (the caller tears them down on every path; a dropped
    /// turn's drop does).
    async fn answer(
        &self,
        slot: &mut Option<TurnResources>,
        warm_run: &mut bool,
    ) -> Result<Reply, TurnError> {
        let (sandbox, request) = (self.sandbox, self.request);
        let config = sandbox.config();
        let timeout = config.turn_timeout;
        // One deadline for the whole turn, from admission: preparation and container.
        // Already past it: end before any preparation (a timer set in the past fires only
        // when the time driver next turns, which the preparation could outrun).
        let deadline_at = tokio::time::Instant::from_std(self.deadline);
        if tokio::time::Instant::now() >= deadline_at {
            return Err(TurnError::Timeout(timeout));
        }
        self.admit_budgets()?;
        let deadline = tokio::time::sleep_until(deadline_at);
        tokio::pin!(deadline);
        let measured = tokio::select! {
            biased;
            _ = request.stop.cancelled() => return Err(TurnError::Stopped),
            _ = &mut deadline => return Err(TurnError::Timeout(timeout)),
            prepared = self.prepare(slot) => prepared?,
        };
        let warm = slot.as_ref().is_some_and(TurnResources::is_prepared);
        if let Some((ws, _)) = &measured {
            *self.workspace.lock().unwrap_or_else(|e| e.into_inner()) = Some(ws.clone());
        }
        let resources = slot.as_mut().expect("prepared above");
        self.phase(TurnPhase::BrokerListening);
        let stdin = self.guest_input();

        self.phase(TurnPhase::ContainerRunning);
        if warm {
            *warm_run = true;
            self.events.emit(EventKind::Warm(WarmEvent::Adopted));
        }
        let spec = resources.spec().clone();
        let watched = measured.as_ref().map(|(ws, _)| ws.clone());
        let over_quota = self.over_quota(measured, spec.name.clone());
        tokio::pin!(over_quota);
        // The engine mounts the workspace by path: it must still name the directory this
        // turn made and holds (a prepared container's was checked before its start, and at
        // adoption against what this turn holds).
        if !warm {
            resources.check_mount_path()?;
        }
        let run = resources.run(stdin, self.cancel.clone());
        tokio::pin!(run);
        let mut why: Option<TurnError> = None;
        let outcome = tokio::select! {
            r = &mut run => r,
            e = &mut over_quota => {
                why = Some(TurnError::Quota(e));
                self.cancel.cancel();
                run.await
            }
            _ = &mut deadline => {
                why = Some(TurnError::Timeout(timeout));
                self.cancel.cancel();
                run.await
            }
            _ = request.stop.cancelled() => {
                why = Some(TurnError::Stopped);
                run.await
            }
        };
        self.verdict(outcome, why, &spec, watched).await
    }

    /// The budgets, before any workspace, broker or container: a refusal is the turn's
    /// `BudgetRefused` event and its error.
    fn admit_budgets(&self) -> Result<(), TurnError> {
        if let Some(book) = self.sandbox.budgets() {
            let request = self.request;
            book.admit(&request.limits_id(), request.channel.segment())
                .inspect_err(|r| {
                    self.events.emit(EventKind::BudgetRefused {
                        budget: r.budget,
                        mid_turn: false,
                    })
                })?;
        }
        Ok(())
    }

    /// The guest's input: the turn as the guest reads it on its stdin.
    fn guest_input(&self) -> Vec<u8> {
        let (sandbox, request) = (self.sandbox, self.request);
        let config = sandbox.config();
        let (tools, mcp) = sandbox.broker().turn_tools();
        let turn = Turn {
            text: request.text.clone(),
            speaker: request.speaker.clone(),
            model: config.model.clone(),
            prompt: config.prompt.clone(),
            time_zone: config.time_zone.clone(),
            reset: request.reset,
            tools,
            mcp,
            egress: sandbox.broker().egress_specs(),
            max_steps: config.max_steps,
            session_budget: config.session_budget,
        };
        serde_json::to_vec(&turn).expect("a turn always serialises")
    }

    /// The host's watch of the workspace's quota while the guest runs: its error when the
    /// workspace passes it; never, when the backend keeps the workspace and enforces it.
    async fn over_quota(&self, measured: Measured, container: String) -> crate::quota::QuotaError {
        let config = self.sandbox.config();
        match measured {
            Some((workspace, guarded)) => {
                crate::quota::watch(crate::quota::Watch {
                    workspace,
                    quota: config.limits.workspace_quota(),
                    floor: config.limits.disk_floor(),
                    guarded,
                    driver: self.sandbox.driver().clone(),
                    container,
                })
                .await
            }
            // The backend keeps the workspace and enforces its quota.
            None => std::future::pending().await,
        }
    }

    /// The turn's result from the guest's run: the reason it was ended (quota, deadline,
    /// stop) first, else the run judged; a guest that did not answer may have ended
    /// before the watcher's next measure saw it pass the quota: measured once more (off
    /// the reply's path: a reply is judged ok before this), the quota's error comes first.
    async fn verdict(
        &self,
        outcome: Result<crate::driver::RunOutcome, DriverError>,
        why: Option<TurnError>,
        spec: &crate::driver::ContainerSpec,
        watched: Option<Arc<crate::quota::Workspace>>,
    ) -> Result<Reply, TurnError> {
        if let Ok(run) = &outcome {
            if !run.stderr_tail.is_empty() {
                tracing::debug!(
                    container = %spec.name,
                    stderr = %String::from_utf8_lossy(&run.stderr_tail),
                    "guest stderr"
                );
            }
        }
        match (outcome, why) {
            (Ok(run), None) => {
                let judged = judge::judge_run(run, spec, self.sandbox.driver().as_ref()).await;
                match (judged, watched) {
                    (Err(e), Some(ws)) if !matches!(e, TurnError::Quota(_)) => {
                        let quota = self.sandbox.config().limits.workspace_quota();
                        let over = tokio::task::spawn_blocking(move || {
                            crate::quota::measure(&ws, &quota, None)
                                .ok()
                                .filter(|u| quota.exceeded_by(u))
                                .map(|u| crate::quota::QuotaError::exceeded(&quota, &u))
                        })
                        .await
                        .ok()
                        .flatten();
                        Err(over.map(TurnError::Quota).unwrap_or(e))
                    }
                    (judged, _) => judged,
                }
            }
            (_, Some(reason)) => Err(reason),
            (Err(DriverError::Cancelled), None) => Err(TurnError::Stopped),
            (Err(e), None) => Err(e.into()),
        }
    }

    /// Makes the turn's resources ready to run: a cold turn's built, the workspace's
    /// quota and the floors checked, a prepared container checked (one that cannot serve
    /// is removed and the turn starts cold), the broker bound. Returns the workspace the
    /// host's watcher measures, if the host measures it.
    async fn prepare(&self, slot: &mut Option<TurnResources>) -> Result<Measured, TurnError> {
        let (sandbox, request) = (self.sandbox, self.request);
        let limits = &sandbox.config().limits;
        let (quota, floor) = (limits.workspace_quota(), limits.disk_floor());
        let stop = &request.stop;
        if slot.is_none() {
            *slot = Some(cold(sandbox, &request.channel)?);
        }
        let resources = slot.as_mut().expect("set above");
        // A prepared container must be able to serve this turn (its workspace, its liveness);
        // otherwise it is removed and this turn starts cold.
        let checked = tokio::select! {
            r = resources.check_waiting() => r?,
            _ = stop.cancelled() => return Err(TurnError::Stopped),
        };
        if let Err(reason) = checked {
            tracing::warn!(
                container = %resources.spec().name,
                reason = %reason,
                "the prepared container cannot serve this turn; starting cold"
            );
            self.events
                .emit(EventKind::Warm(WarmEvent::FellBack { reason }));
            // The turn lets go of it first: removal is the fallback's, awaited.
            if let Some(r) = slot.take() {
                r.teardown_logged("remove prepared container").await;
            }
            *slot = Some(cold(sandbox, &request.channel)?);
        }
        let resources = slot.as_mut().expect("set above");
        let measured = tokio::select! {
            r = resources.host_workspace(floor.is_on()) => r?,
            _ = stop.cancelled() => return Err(TurnError::Stopped),
        };
        // A filesystem below its floor, or a workspace over its quota, refuses the turn.
        if let Some((ws, g)) = &measured {
            let (ws, g) = (ws.clone(), g.clone());
            tokio::task::spawn_blocking(move || {
                crate::quota::check_floor(&g, &floor)?;
                crate::quota::check(&ws, &quota, None)
            })
            .await
            .map_err(|e| crate::quota::QuotaError::Measure(e.to_string()))??;
        }
        let resources = slot.as_mut().expect("set above");
        let ctx = self.turn_context();
        tokio::select! {
            r = resources.bind_broker(ctx) => r?,
            _ = stop.cancelled() => return Err(TurnError::Stopped),
        };
        Ok(measured)
    }

    /// The broker's view of this turn: its channel, speaker and cancellation, and its
    /// events (each call, each refusal).
    fn turn_context(&self) -> TurnContext {
        TurnContext {
            channel: self.request.channel.clone(),
            speaker: self.request.speaker.clone(),
            cancel: self.cancel.clone(),
            events: Some(self.events.clone()),
            account: Some(self.account.clone()),
        }
    }
}

/// A cold turn's resources; its id joins the turn's span.
fn cold(sandbox: &Sandbox, channel: &crate::ChannelId) -> Result<TurnResources, TurnError> {
    let resources = TurnResources::new(sandbox, channel, Start::Cold)?;
    tracing::Span::current().record("turn", &resources.turn_id()[..8]);
    Ok(resources)
}

/// The workspace the host's watcher measures and the filesystems its floor guards, when
/// the host measures them.
type Measured = Option<(Arc<crate::quota::Workspace>, Vec<crate::quota::Guarded>)>;
