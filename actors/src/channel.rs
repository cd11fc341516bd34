//! The [`ChannelActor`]: one channel's admission, queue, stop and reset flag.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use roundtable_sandbox::events::EventKind;
use roundtable_sandbox::{ChannelId, PreparedTurn};
use roundtable_sandbox::{TurnFailure, TurnOutcome, TurnRequest};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::control::TurnControl;
use crate::error::AbortReason;
use crate::internal::{
    ChannelIdle, ChannelLink, ChannelRestartedNotice, ChannelShutdown, Enqueue, QueryStatus,
    Retire, ShutdownChannel, SupervisorLink, TurnDone, TurnReplied,
};
use crate::reset::{ResetGeneration, Stamp};
use crate::shared::Shared;
use crate::turn::{panic_message, ProgressSink, Responder, TurnActor, TurnJob};
use crate::{
    ChannelState, ChannelStatus, GuestMessage, SandboxActorError, Stop, Withdraw, WithdrawReport,
};

/// One channel: serializes its turns in arrival order behind a bounded queue, decides each
/// turn's reset flag from the stamp its message got on arrival (a reset applies to the
/// messages that arrived after it), and stops the active turn on [`Stop`].
///
/// Spawned by the [`SandboxSupervisor`](crate::SandboxSupervisor) under
/// [`actix::Supervisor`]. Every handler runs under `catch_unwind`: a panic aborts the turn
/// in flight (its caller is answered [`SandboxActorError::ChannelRestarted`]) and stops the
/// actor, which actix then restarts at the same address with its queue; the reset
/// generation lives in a cell the supervisor keeps. An idle actor asks to be retired after
/// `idle_timeout`.
pub(crate) struct ChannelActor {
    channel: ChannelId,
    shared: Arc<Shared>,
    reset: ResetGeneration,
    supervisor: SupervisorLink,
    actor_id: u64,
    queue: VecDeque<Pending>,
    active: Option<ActiveTurn>,
    /// Guest messages received (the supervisor counts those it forwarded: retirement
    /// happens only when both agree, so no message can be in flight to a retired actor).
    received: u64,
    restarts: u32,
    turns_done: u64,
    shutting_down: bool,
    /// The bot withdrew from the channel ([`Withdraw`]): no container is prepared for it
    /// until its next message.
    withdrawn: bool,
    drained: Vec<oneshot::Sender<()>>,
    idle_timer: Option<SpawnHandle>,
    /// The container prepared for the channel's next turn (see [`roundtable_sandbox::PreparedTurn`]).
    warm: Option<WarmSlot>,
    /// A preparation in flight: its number and its cancellation.
    preparing: Option<(u64, CancellationToken)>,
    /// While the next message waits for the preparation in flight (at most
    /// [`PREPARATION_WAIT`]): the timer that admits it cold past that.
    holding: Option<SpawnHandle>,
    /// The preparation the waiting message gave up on: no message waits for it again.
    gave_up_on: Option<u64>,
    warm_seq: u64,
    span: tracing::Span,
}

/// How long a message admitted while its channel's next container is being prepared waits
/// for that container before it starts cold. Admitted at once, it would start cold beside
/// the preparation, and back-to-back messages would all be cold (the bench's 32 channels:
/// 112 of 183 turns); a preparation takes what a cold start takes, so the wait costs
/// nothing unless the engine stalls.
const PREPARATION_WAIT: Duration = Duration::from_secs(3);

/// A prepared container waiting for the channel's next turn.
struct WarmSlot {
    seq: u64,
    turn: PreparedTurn,
    /// The channel's resets when it was prepared: after another reset it is not adopted
    /// (the turn that resets may wipe the workspace it was started on).
    stamp: Stamp,
    ttl: SpawnHandle,
}

/// What a preparation task ends with.
type PreparationResult =
    Result<Result<Option<PreparedTurn>, roundtable_sandbox::TurnError>, tokio::task::JoinError>;

/// Removes a prepared container in the background (its permit is held until it is gone,
/// so the supervisor's shutdown waits for it).
fn discard(turn: PreparedTurn, why: &'static str) {
    actix_rt::spawn(turn.discard(why));
}

impl std::fmt::Debug for ChannelActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelActor")
            .field("actor_id", &self.actor_id)
            .field("queued", &self.queue.len())
            .field("active", &self.active.as_ref().map(|a| a.id))
            .field("restarts", &self.restarts)
            .finish_non_exhaustive()
    }
}

struct Pending {
    message: GuestMessage,
    /// The resets requested before the message arrived at the supervisor.
    stamp: Stamp,
    responder: Responder,
    /// Counts it among the messages waiting across all channels until it leaves the queue.
    ticket: crate::shared::QueueTicket,
}

struct ActiveTurn {
    id: u64,
    control: TurnControl,
    admitted: Instant,
}

impl Drop for ActiveTurn {
    fn drop(&mut self) {
        // Normally the turn is over when this is dropped. If the channel's state is dropped
        // with a turn still running (the actor died), the turn is stopped with a clear error.
        if !self.control.replied() {
            self.control.abort(AbortReason::ChannelRestarted);
        }
    }
}

impl ChannelActor {
    pub(crate) fn new(
        channel: ChannelId,
        shared: Arc<Shared>,
        reset: ResetGeneration,
        supervisor: SupervisorLink,
        actor_id: u64,
    ) -> Self {
        let span = tracing::info_span!("channel", channel = channel.short(), actor = actor_id);
        Self {
            channel,
            shared,
            reset,
            supervisor,
            actor_id,
            queue: VecDeque::new(),
            active: None,
            received: 0,
            restarts: 0,
            turns_done: 0,
            shutting_down: false,
            withdrawn: false,
            drained: Vec::new(),
            idle_timer: None,
            warm: None,
            preparing: None,
            holding: None,
            gave_up_on: None,
            warm_seq: 0,
            span,
        }
    }

    /// Where a message's events go (`turn` 0: only queued).
    fn sink(&self, turn: u64) -> ProgressSink {
        ProgressSink {
            sandbox: self.shared.sandbox.clone(),
            channel: self.channel.clone(),
            turn,
        }
    }

    /// Prepares the container of the channel's next turn in the background, unless one is
    /// prepared or being prepared, the channel is shutting down, or warm turns are off.
    fn prepare_next(&mut self, ctx: &mut Context<Self>) {
        if self.shutting_down
            || self.withdrawn
            || self.warm.is_some()
            || self.preparing.is_some()
            || !self.shared.sandbox.warm_enabled()
        {
            return;
        }
        self.warm_seq += 1;
        let seq = self.warm_seq;
        let cancel = CancellationToken::new();
        self.preparing = Some((seq, cancel.clone()));
        let stamp = self.reset.stamp();
        let (sandbox, key) = (self.shared.sandbox.clone(), self.channel.clone());
        let task = actix_rt::spawn(
            async move { sandbox.prepare_turn(&key, cancel).await }.instrument(self.span.clone()),
        );
        ctx.spawn(
            actix::fut::wrap_future::<_, Self>(task).map(move |result, act, ctx| {
                act.guarded(ctx, "prepared", |act, ctx| {
                    act.prepared(seq, stamp, result, ctx)
                });
            }),
        );
    }

    /// A preparation ended: keep its container for the next turn, or remove it; then admit
    /// the message that waited for it, if one did.
    fn prepared(
        &mut self,
        seq: u64,
        stamp: Stamp,
        result: PreparationResult,
        ctx: &mut Context<Self>,
    ) {
        if self.preparing.as_ref().is_some_and(|(s, _)| *s == seq) {
            self.preparing = None;
        }
        self.keep_prepared(seq, stamp, result, ctx);
        if let Some(timer) = self.holding.take() {
            ctx.cancel_future(timer);
        }
        if !self.shutting_down {
            self.admit_next(ctx);
        }
    }

    fn keep_prepared(
        &mut self,
        seq: u64,
        stamp: Stamp,
        result: PreparationResult,
        ctx: &mut Context<Self>,
    ) {
        let turn = match result {
            Ok(Ok(Some(turn))) => turn,
            Ok(Ok(None)) => {
                tracing::debug!("no container prepared (warm.max reached)");
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "preparing the next turn's container failed; it starts cold");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the preparation task failed; the next turn starts cold");
                return;
            }
        };
        if self.shutting_down || self.warm.is_some() {
            return discard(turn, "not needed");
        }
        tracing::debug!(
            container = turn.container(),
            "next turn's container prepared"
        );
        let ttl = ctx.run_later(self.shared.warm_ttl, move |act, _| {
            if let Some(slot) = act.warm.take_if(|slot| slot.seq == seq) {
                tracing::debug!(
                    container = slot.turn.container(),
                    "prepared container expired (warm TTL)"
                );
                discard(slot.turn, "expired");
            }
        });
        self.warm = Some(WarmSlot {
            seq,
            turn,
            stamp,
            ttl,
        });
    }

    /// Takes the prepared container for a turn being admitted, if it may serve it.
    fn take_prepared(&mut self, ctx: &mut Context<Self>) -> Option<PreparedTurn> {
        let slot = self.warm.take()?;
        ctx.cancel_future(slot.ttl);
        if slot.stamp != self.reset.stamp() {
            tracing::debug!(
                container = slot.turn.container(),
                "a reset came after the container was prepared; the turn starts cold"
            );
            discard(slot.turn, "reset since prepared");
            return None;
        }
        Some(slot.turn)
    }

    /// Removes the prepared container and abandons a preparation in flight.
    /// Empties the queue: each message ends as `failure` (its event) and its caller is
    /// answered `error()`; how many callers were still waiting for it.
    fn refuse_queued(
        &mut self,
        failure: TurnFailure,
        error: impl Fn() -> SandboxActorError,
    ) -> usize {
        let mut answered = 0;
        for pending in std::mem::take(&mut self.queue) {
            self.sink(0).ended(failure);
            if pending.responder.send(Err(error())).is_ok() {
                answered += 1;
            }
        }
        answered
    }

    fn drop_prepared(&mut self, ctx: &mut Context<Self>, why: &'static str) {
        if let Some((_, cancel)) = self.preparing.take() {
            cancel.cancel();
        }
        if let Some(timer) = self.holding.take() {
            ctx.cancel_future(timer);
        }
        if let Some(slot) = self.warm.take() {
            ctx.cancel_future(slot.ttl);
            discard(slot.turn, why);
        }
    }

    /// Whether the next message waits for the preparation in flight (arming the timer that
    /// admits it cold past [`PREPARATION_WAIT`]).
    fn waits_for_preparation(&mut self, ctx: &mut Context<Self>) -> bool {
        let Some(seq) = self.preparing.as_ref().map(|(seq, _)| *seq) else {
            return false;
        };
        if self.warm.is_some() || self.queue.is_empty() || self.gave_up_on == Some(seq) {
            return false;
        }
        if self.holding.is_none() {
            tracing::debug!("the next turn waits for its container's preparation");
            self.holding = Some(ctx.run_later(PREPARATION_WAIT, move |act, ctx| {
                act.holding = None;
                act.gave_up_on = Some(seq);
                tracing::debug!("the preparation is slow; the next turn starts cold");
                act.guarded(ctx, "preparation wait", |act, ctx| act.admit_next(ctx));
            }));
        }
        true
    }

    fn is_idle(&self) -> bool {
        self.active.is_none() && self.queue.is_empty()
    }

    /// Runs a handler's logic; a panic in it restarts the actor instead of killing it
    /// silently (actix restarts a supervised actor only when it stops).
    fn guarded<R>(
        &mut self,
        ctx: &mut Context<Self>,
        what: &'static str,
        f: impl FnOnce(&mut Self, &mut Context<Self>) -> R,
    ) -> Option<R> {
        let span = self.span.clone();
        let _entered = span.enter();
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(self, ctx))) {
            Ok(r) => Some(r),
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                tracing::error!(handler = what, %message, "channel actor panicked; restarting it");
                if let Some(active) = &self.active {
                    active.control.abort(AbortReason::ChannelRestarted);
                }
                ctx.stop();
                None
            }
        }
    }

    fn accept(
        &mut self,
        Enqueue { message, stamp }: Enqueue,
        ctx: &mut Context<Self>,
    ) -> Result<oneshot::Receiver<Result<TurnOutcome, SandboxActorError>>, SandboxActorError> {
        let sink = self.sink(0);
        self.withdrawn = false;
        if self.shutting_down {
            sink.refused(
                &message.speaker.id,
                &message.text,
                TurnFailure::ShuttingDown,
            );
            return Err(SandboxActorError::ShuttingDown);
        }
        let waits_here = self.active.is_some() || self.holding.is_some();
        let waiting = self.shared.waiting();
        if waiting >= self.shared.max_waiting {
            tracing::info!(
                waiting,
                "busy: message refused (max_waiting across channels)"
            );
            sink.refused(&message.speaker.id, &message.text, TurnFailure::Busy);
            return Err(SandboxActorError::Overloaded { waiting });
        }
        if waits_here && self.queue.len() >= self.shared.queue_limit {
            tracing::info!(waiting = self.queue.len(), "busy: message refused");
            sink.refused(&message.speaker.id, &message.text, TurnFailure::Busy);
            return Err(SandboxActorError::Busy {
                waiting: self.queue.len(),
            });
        }
        let ahead = self.queue.len() + usize::from(self.active.is_some());
        if ahead > 0 {
            sink.emit(EventKind::Queued { depth: ahead });
        }
        let (responder, answer) = oneshot::channel();
        self.queue.push_back(Pending {
            message,
            stamp,
            responder,
            ticket: self.shared.queue_ticket(),
        });
        self.admit_next(ctx);
        Ok(answer)
    }

    /// Admits the next queued message if no turn is active; arms the idle timer otherwise.
    fn admit_next(&mut self, ctx: &mut Context<Self>) {
        if self.active.is_some() || self.waits_for_preparation(ctx) {
            return;
        }
        while let Some(pending) = self.queue.pop_front() {
            if pending.responder.is_closed() {
                tracing::debug!("caller gave up while queued; skipped");
                continue;
            }
            self.admit(pending, ctx);
            return;
        }
        self.arm_idle_timer(ctx);
    }

    fn admit(&mut self, pending: Pending, ctx: &mut Context<Self>) {
        if let Some(timer) = self.idle_timer.take() {
            ctx.cancel_future(timer);
        }
        // Decided at admission, before anything yields, from the message's stamp: a reset
        // that arrived after the message (while it was queued, or from now on while it
        // runs) stays pending for a later message.
        let Pending {
            message,
            stamp,
            responder,
            ticket,
        } = pending;
        // Out of the queue: no longer counted as waiting there (a slot's wait counts it).
        drop(ticket);
        let reset = self.reset.resets(stamp);
        let admitted = Instant::now();
        let control = TurnControl::default();
        // The core admits it: its number, and its deadline (admission + turn timeout).
        let turn = self.shared.sandbox.admit(TurnRequest {
            channel: self.channel.clone(),
            speaker: message.speaker,
            text: message.text,
            reset,
            stop: control.stop_token(),
            admitted: Some(admitted),
            limits_key: message.limits_key,
        });
        let id = turn.number();
        let progress = self.sink(id);
        let prepared = self.take_prepared(ctx);
        let job = TurnJob {
            prepared,
            shared: self.shared.clone(),
            turn,
            stamp,
            resets: self.reset.clone(),
            responder,
            progress,
        };
        let span = tracing::info_span!(parent: &self.span, "turn_actor", turn = id, reset);
        tracing::debug!(turn = id, reset, "turn admitted");
        let channel = ChannelLink {
            replied: ctx.address().recipient(),
            done: ctx.address().recipient(),
        };
        TurnActor::new(id, job, control.clone(), channel, span).start();
        self.active = Some(ActiveTurn {
            id,
            control,
            admitted,
        });
        // At the channel's first turn, its next turn's container is prepared meanwhile.
        if self.turns_done == 0 {
            self.prepare_next(ctx);
        }
    }

    fn arm_idle_timer(&mut self, ctx: &mut Context<Self>) {
        if self.idle_timer.is_some() || !self.is_idle() || self.shutting_down {
            return;
        }
        let timeout = self.shared.idle_timeout;
        self.idle_timer = Some(ctx.run_later(timeout, |act, _ctx| {
            act.idle_timer = None;
            if act.is_idle() && !act.shutting_down {
                act.supervisor.idle.do_send(ChannelIdle {
                    channel: act.channel.clone(),
                    actor_id: act.actor_id,
                    received: act.received,
                });
            }
        }));
    }

    fn status(&self) -> ChannelStatus {
        ChannelStatus {
            channel: self.channel.key().to_owned(),
            state: self
                .active
                .as_ref()
                .map_or(ChannelState::Idle, |a| a.control.state()),
            queued: self.queue.len(),
            pending_reset: self.reset.pending(),
            live: true,
            restarts: self.restarts,
            turns_done: self.turns_done,
            active_for: self.active.as_ref().map(|a| a.admitted.elapsed()),
            prepared: self.warm.is_some(),
        }
    }
}

impl Actor for ChannelActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        tracing::debug!(parent: &self.span, restarts = self.restarts, "channel actor started");
        // After a restart, pick up where the panic left off: the next queued message if no
        // turn is active any more, or the shutdown waiters if the channel has drained.
        if self.shutting_down {
            if self.active.is_none() {
                for waiter in self.drained.drain(..) {
                    let _ = waiter.send(());
                }
            }
        } else {
            let _entered = self.span.clone().entered();
            self.admit_next(ctx);
        }
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        tracing::debug!(parent: &self.span, "channel actor stopped");
    }
}

impl actix::Supervised for ChannelActor {
    fn restarting(&mut self, ctx: &mut Self::Context) {
        // The actor's timers and futures are gone: the prepared container (its TTL timer)
        // and a preparation in flight (its result) with them.
        self.drop_prepared(ctx, "channel actor restarted");
        // The queue, the counters and the reset cell are kept; the aborted turn (if any)
        // stays active until its TurnActor reports it torn down, so turns never overlap.
        self.restarts += 1;
        self.idle_timer = None;
        tracing::warn!(parent: &self.span, restarts = self.restarts, "channel actor restarted");
        self.supervisor.restarted.do_send(ChannelRestartedNotice {
            channel: self.channel.clone(),
        });
    }
}

impl Handler<Enqueue> for ChannelActor {
    type Result = ResponseFuture<Result<TurnOutcome, SandboxActorError>>;

    fn handle(&mut self, message: Enqueue, ctx: &mut Self::Context) -> Self::Result {
        self.received += 1;
        match self.guarded(ctx, "guest message", |act, ctx| act.accept(message, ctx)) {
            Some(Ok(answer)) => {
                Box::pin(async move { answer.await.unwrap_or(Err(SandboxActorError::TurnLost)) })
            }
            Some(Err(e)) => Box::pin(std::future::ready(Err(e))),
            None => {
                // The handler panicked before the message was queued: refused.
                self.sink(0).ended(TurnFailure::ChannelRestarted);
                Box::pin(std::future::ready(Err(SandboxActorError::ChannelRestarted)))
            }
        }
    }
}

impl Handler<Stop> for ChannelActor {
    type Result = bool;

    fn handle(&mut self, _: Stop, ctx: &mut Self::Context) -> bool {
        self.guarded(ctx, "stop", |act, _| {
            let stopped = act.active.as_ref().is_some_and(|a| a.control.stop());
            tracing::info!(stopped, "stop requested");
            stopped
        })
        .unwrap_or(false)
    }
}

impl Handler<Withdraw> for ChannelActor {
    type Result = MessageResult<Withdraw>;

    fn handle(&mut self, _: Withdraw, ctx: &mut Self::Context) -> Self::Result {
        let report = self.guarded(ctx, "withdraw", |act, ctx| {
            act.withdrawn = true;
            act.drop_prepared(ctx, "withdrawn");
            let mut report = WithdrawReport {
                dropped: act.refuse_queued(TurnFailure::Stopped, || SandboxActorError::Withdrawn),
                ..Default::default()
            };
            report.stopped = act.active.as_ref().is_some_and(|a| a.control.stop());
            tracing::info!(
                stopped = report.stopped,
                dropped = report.dropped,
                "withdrawn from the channel"
            );
            report
        });
        MessageResult(report.unwrap_or_default())
    }
}

impl Handler<TurnReplied> for ChannelActor {
    type Result = ();

    fn handle(&mut self, msg: TurnReplied, ctx: &mut Self::Context) {
        self.guarded(ctx, "turn replied", |act, ctx| {
            if act.active.as_ref().is_some_and(|a| a.id == msg.turn) {
                tracing::debug!(turn = msg.turn, ok = msg.ok, "turn replied; tearing down");
                // The next turn's container is prepared while this one is torn down (it
                // waits for its turn, which is admitted only once the teardown is done).
                act.prepare_next(ctx);
            }
        });
    }
}

impl Handler<TurnDone> for ChannelActor {
    type Result = ();

    fn handle(&mut self, msg: TurnDone, ctx: &mut Self::Context) {
        self.guarded(ctx, "turn done", |act, ctx| {
            if act.active.as_ref().is_none_or(|a| a.id != msg.turn) {
                return;
            }
            act.active = None;
            act.turns_done += 1;
            if act.shutting_down {
                for waiter in act.drained.drain(..) {
                    let _ = waiter.send(());
                }
            } else {
                act.prepare_next(ctx);
                act.admit_next(ctx);
            }
        });
    }
}

impl Handler<QueryStatus> for ChannelActor {
    type Result = MessageResult<QueryStatus>;

    fn handle(&mut self, _: QueryStatus, ctx: &mut Self::Context) -> Self::Result {
        let status = self.guarded(ctx, "status", |act, _| act.status());
        MessageResult(status.unwrap_or_else(|| self.status()))
    }
}

impl Handler<ShutdownChannel> for ChannelActor {
    type Result = ResponseFuture<ChannelShutdown>;

    fn handle(&mut self, _: ShutdownChannel, ctx: &mut Self::Context) -> Self::Result {
        let outcome = self.guarded(ctx, "shutdown", |act, ctx| {
            act.shutting_down = true;
            if let Some(timer) = act.idle_timer.take() {
                ctx.cancel_future(timer);
            }
            act.drop_prepared(ctx, "shutting down");
            let mut report = ChannelShutdown {
                refused: act.refuse_queued(TurnFailure::ShuttingDown, || {
                    SandboxActorError::ShuttingDown
                }),
                ..Default::default()
            };
            let wait = act.active.as_ref().map(|active| {
                report.stopped = !active.control.replied();
                active.control.abort(AbortReason::ShuttingDown);
                let (tx, rx) = oneshot::channel();
                act.drained.push(tx);
                rx
            });
            tracing::info!(
                stopped = report.stopped,
                refused = report.refused,
                "channel shutting down"
            );
            (report, wait)
        });
        match outcome {
            Some((report, Some(wait))) => Box::pin(async move {
                let _ = wait.await;
                report
            }),
            Some((report, None)) => Box::pin(std::future::ready(report)),
            None => Box::pin(std::future::ready(ChannelShutdown::default())),
        }
    }
}

impl Handler<Retire> for ChannelActor {
    type Result = ();

    fn handle(&mut self, _: Retire, ctx: &mut Self::Context) {
        self.guarded(ctx, "retire", |act, ctx| {
            if act.is_idle() {
                tracing::debug!("idle channel actor retired");
                act.drop_prepared(ctx, "channel retired");
                ctx.stop();
            }
        });
    }
}

#[cfg(feature = "testing")]
impl Handler<crate::messages::InjectPanic> for ChannelActor {
    type Result = bool;

    fn handle(&mut self, _: crate::messages::InjectPanic, ctx: &mut Self::Context) -> bool {
        self.guarded(ctx, "inject panic", |_, _| -> bool {
            panic!("panic injected into the channel actor (test hook)")
        });
        true
    }
}
