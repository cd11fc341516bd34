//! The [`TurnActor`]: one turn, from admission to the end of its teardown.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use actix::prelude::*;
use roundtable_sandbox::events::{EventKind, TurnRecord};
use roundtable_sandbox::AdmittedTurn;
use roundtable_sandbox::TurnError;
use roundtable_sandbox::{ChannelId, PreparedTurn, Reply, TurnFailure, TurnOutcome, TurnPhase};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::control::{Stage, TurnControl};
use crate::internal::{ChannelLink, TurnDone, TurnReplied};
use crate::reset::{ResetGeneration, Stamp};
use crate::shared::Shared;
use crate::SandboxActorError;

/// Where a caller's answer goes.
pub(crate) type Responder = oneshot::Sender<Result<TurnOutcome, SandboxActorError>>;

/// A message's events of this layer (queued, waiting for a slot, the ends it answers
/// itself), sent to the runtime's observer as its channel's.
#[derive(Clone)]
pub(crate) struct ProgressSink {
    pub(crate) sandbox: roundtable_sandbox::Sandbox,
    pub(crate) channel: ChannelId,
    /// The turn's number; 0 while the message is only queued.
    pub(crate) turn: u64,
}

impl ProgressSink {
    /// Sends one event of this layer's to the runtime's observer.
    pub(crate) fn emit(&self, kind: EventKind) {
        let turn = (self.turn > 0).then_some(self.turn);
        self.sandbox.emit(turn, Some(&self.channel), kind);
    }

    /// The end of a message the layer answered itself (a refusal, a turn that never
    /// reached the core): one `Ended` event, of the kind the caller gets.
    pub(crate) fn ended(&self, failure: TurnFailure) {
        self.emit(EventKind::Ended {
            failure: Some(failure),
            warm: false,
        });
    }

    /// A message refused by this layer: its facts (the audit trail's: speaker, size),
    /// then its `Ended`.
    pub(crate) fn refused(&self, speaker: &str, text: &str, failure: TurnFailure) {
        self.facts(speaker, text, TurnRecord::ended_early(failure, None));
        self.ended(failure);
    }

    /// The facts of a message that never reached the core's turn (before its `Done`).
    pub(crate) fn facts(&self, speaker: &str, text: &str, record: TurnRecord) {
        self.emit(EventKind::Facts(Box::new(
            roundtable_sandbox::events::TurnFacts::refused(speaker, text, record),
        )));
    }
}

/// Everything a turn needs, handed over by its channel at admission.
pub(crate) struct TurnJob {
    pub(crate) shared: Arc<Shared>,
    /// The turn as the core admitted it (its reset flag and deadline fixed then).
    pub(crate) turn: AdmittedTurn,
    /// The message's stamp among the channel's resets.
    pub(crate) stamp: Stamp,
    pub(crate) resets: ResetGeneration,
    pub(crate) responder: Responder,
    pub(crate) progress: ProgressSink,
    /// The container prepared for this turn, if the channel had one (see
    /// [`roundtable_sandbox::PreparedTurn`]).
    pub(crate) prepared: Option<PreparedTurn>,
}

/// One turn. Owns the turn's future (run dir, broker listener, container: all through
/// [`roundtable_sandbox::run_turn`]), which runs in its own task so that a panic in it is
/// caught (as a `JoinError`) instead of taking an actor down.
///
/// In order: waits for a container slot (or a stop, or the turn's deadline, which counts
/// from admission); runs the turn; from the core's reply callback — before any teardown —
/// consumes the resets that arrived before the turn's message if the reply is ok, answers
/// the caller and reports that it replied to its channel actor;
/// after teardown reports that it is done and stops.
/// If the actor is dropped early it cancels the turn (the core's guards tear it down) and
/// still reports `TurnDone`, so its channel never waits forever.
pub(crate) struct TurnActor {
    id: u64,
    job: Option<TurnJob>,
    control: TurnControl,
    channel: ChannelLink,
    done_reported: bool,
    span: tracing::Span,
}

impl std::fmt::Debug for TurnActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnActor")
            .field("id", &self.id)
            .field("state", &self.control.state())
            .finish_non_exhaustive()
    }
}

impl TurnActor {
    pub(crate) fn new(
        id: u64,
        job: TurnJob,
        control: TurnControl,
        channel: ChannelLink,
        span: tracing::Span,
    ) -> Self {
        Self {
            id,
            job: Some(job),
            control,
            channel,
            done_reported: false,
            span,
        }
    }
}

impl Actor for TurnActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let Some(job) = self.job.take() else {
            return;
        };
        let responder = Arc::new(Mutex::new(Some(job.responder)));
        let progress = job.progress.clone();
        let delivery = Delivery {
            turn: self.id,
            responder: responder.clone(),
            control: self.control.clone(),
            resets: job.resets,
            stamp: job.stamp,
            channel: self.channel.clone(),
        };
        let mut turn = job.turn;
        turn.stop_reason(self.control.stopped_for());
        let work = run_job(
            job.shared,
            turn,
            job.prepared,
            job.progress,
            self.control.clone(),
            delivery,
        )
        .instrument(self.span.clone());
        let task = actix_rt::spawn(work);
        ctx.spawn(
            actix::fut::wrap_future::<_, Self>(task).map(move |outcome, act, ctx| {
                if let Err(e) = outcome {
                    let error = if e.is_panic() {
                        let message = panic_message(e.into_panic().as_ref());
                        tracing::error!(parent: &act.span, %message, "the turn's task panicked");
                        SandboxActorError::TurnPanicked { message }
                    } else {
                        SandboxActorError::TurnLost
                    };
                    act.control.mark_replied();
                    if let Some(tx) = take(&responder) {
                        // The core never answered: the layer's answer is the turn's end.
                        progress.ended(error.failure());
                        let _ = tx.send(Err(error));
                    }
                }
                act.report_done();
                ctx.stop();
            }),
        );
    }
}

impl TurnActor {
    fn report_done(&mut self) {
        if !self.done_reported {
            self.done_reported = true;
            self.channel.done.do_send(TurnDone { turn: self.id });
        }
    }
}

impl Drop for TurnActor {
    fn drop(&mut self) {
        // Dropped before its task finished (the arbiter is going away): cancel the turn,
        // whose teardown goes on in its task, and free the channel.
        self.control.stop_token().cancel();
        self.report_done();
    }
}

fn take(responder: &Mutex<Option<Responder>>) -> Option<Responder> {
    responder
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

/// The reply's way out, run from the core's `on_reply` (before teardown).
struct Delivery {
    turn: u64,
    responder: Arc<Mutex<Option<Responder>>>,
    control: TurnControl,
    resets: ResetGeneration,
    stamp: Stamp,
    channel: ChannelLink,
}

impl Delivery {
    /// Delivers the outcome of a turn that never reached the core, and reports its end;
    /// the failure it reported.
    fn end(&self, outcome: &TurnOutcome, progress: &ProgressSink) -> Option<TurnFailure> {
        let failure = match self.control.abort_reason() {
            Some(reason) if !outcome.reply.ok => Some(reason.into_error().failure()),
            _ => outcome.failure,
        };
        if let Some(failure) = failure {
            progress.ended(failure);
        }
        self.deliver(outcome);
        failure
    }

    fn deliver(&self, outcome: &TurnOutcome) {
        let reply = &outcome.reply;
        self.control.mark_replied();
        if reply.ok && self.resets.consume(self.stamp) {
            tracing::debug!("pending reset consumed");
        }
        let answer = match self.control.abort_reason() {
            Some(reason) if !reply.ok => Err(reason.into_error()),
            _ => Ok(outcome.clone()),
        };
        if let Some(tx) = take(&self.responder) {
            let _ = tx.send(answer);
        }
        self.channel.replied.do_send(TurnReplied {
            turn: self.turn,
            ok: reply.ok,
        });
    }
}

async fn run_job(
    shared: Arc<Shared>,
    turn: AdmittedTurn,
    prepared: Option<PreparedTurn>,
    progress: ProgressSink,
    control: TurnControl,
    delivery: Delivery,
) {
    let (speaker, text) = (&turn.request().speaker.id, &turn.request().text);
    let admitted = turn.admitted();
    // A turn the core never ran: its end, its facts (with its record), its `Done`.
    let ended_early = |outcome: &TurnOutcome, slot_wait: Option<std::time::Duration>| {
        let failure = delivery
            .end(outcome, &progress)
            .unwrap_or(TurnFailure::Internal);
        let mut record = TurnRecord::ended_early(failure, Some(admitted));
        record.slot_wait = slot_wait;
        progress.facts(speaker, text, record);
        progress.emit(EventKind::Phase(TurnPhase::Done));
    };
    let stopped = || ended_early(&TurnOutcome::failed(&TurnError::Stopped), None);
    let token = turn.request().stop.clone();
    if token.is_cancelled() {
        return stopped();
    }
    // A container slot under the global cap. The semaphore is FIFO and each channel has at
    // most one turn waiting, so waiting channels are served in turn. The wait counts
    // against the turn's timeout, which runs from admission (as the TypeScript package arms
    // its timer in `runTurn`, before anything else): the deadline is the admitted turn's.
    let timeout = shared.sandbox.config().turn_timeout;
    let deadline = tokio::time::Instant::from_std(turn.deadline());
    let limiter = shared.limiter.clone();
    let mut slot_wait = None;
    let _permit = match limiter.clone().try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) => {
            control.set_stage(Stage::WaitingForSlot);
            progress.emit(EventKind::WaitingForSlot);
            let waiting = Instant::now();
            let _waiting = shared.waiting_guard();
            tokio::select! {
                biased;
                _ = token.cancelled() => return stopped(),
                _ = tokio::time::sleep_until(deadline) => {
                    let error = TurnError::SlotTimeout {
                        timeout,
                        slots: shared.max_containers,
                    };
                    tracing::info!(error = %error, kind = ?error.failure(), "turn failed");
                    return ended_early(&TurnOutcome::failed(&error), Some(waiting.elapsed()));
                }
                permit = limiter.acquire_owned() => match permit {
                    Ok(permit) => {
                        let waited = waiting.elapsed();
                        progress.emit(EventKind::WaitedForSlot { waited });
                        slot_wait = Some(waited);
                        permit
                    }
                    Err(_) => {
                        let outcome = TurnOutcome {
                            reply: Reply::error("the container limiter is closed"),
                            failure: Some(TurnFailure::Internal),
                            usage: Default::default(),
                        };
                        return ended_early(&outcome, Some(waiting.elapsed()));
                    }
                },
            }
        }
    };
    let mut turn = turn;
    if let Some(waited) = slot_wait {
        turn.waited_for_slot(waited);
    }
    // The core's phases, as its turn's events show them: the channel's state.
    let _route = shared.phases.route(turn.number(), control.clone());
    shared
        .sandbox
        .run(turn, prepared, |reply| delivery.deliver(reply))
        .await;
    // The permit is released here, after teardown: a slot is a container.
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_owned()
    }
}
