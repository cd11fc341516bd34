//! A turn's control, as its channel and the runtime's observer hold it: the handle to stop
//! it and see its stage ([`TurnControl`]), and the routes from the core's `Phase` events to
//! each running turn's handle ([`PhaseRoutes`]). The [`crate::turn::TurnActor`] makes and
//! registers them; the supervisor's shared state holds the routes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use roundtable_sandbox::events::{Event, EventKind, Observer};
use roundtable_sandbox::{TurnFailure, TurnPhase};
use tokio_util::sync::CancellationToken;

use crate::error::AbortReason;
use crate::ChannelState;

/// The handle a channel keeps on its active turn: stop it, say why, see its phase.
#[derive(Debug, Clone, Default)]
pub(crate) struct TurnControl(Arc<ControlInner>);

#[derive(Debug, Default)]
struct ControlInner {
    stop: CancellationToken,
    abort: OnceLock<AbortReason>,
    /// The abort's kind, for the core's `Ended` event (the kind its caller gets).
    stopped_for: Arc<OnceLock<TurnFailure>>,
    /// Where the turn is: the core's phase itself, kept as it is reported.
    phase: Mutex<Stage>,
    replied: AtomicBool,
}

/// A turn's stage as its channel reports it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) enum Stage {
    /// Admitted, not yet waiting or running.
    #[default]
    Admitted,
    /// Waiting for a container slot.
    WaitingForSlot,
    /// In the core, at this phase.
    Running(TurnPhase),
}

impl TurnControl {
    /// Stops the turn; returns whether it was still active (admitted, not yet answered,
    /// not already stopped).
    pub(crate) fn stop(&self) -> bool {
        let was_active = !self.0.stop.is_cancelled() && !self.replied();
        self.0.stop.cancel();
        was_active
    }

    /// Stops the turn for a reason of the layer; its caller gets that reason's error.
    pub(crate) fn abort(&self, reason: AbortReason) {
        let _ = self.0.abort.set(reason);
        let _ = self.0.stopped_for.set(reason.into_error().failure());
        self.0.stop.cancel();
    }

    /// The token that stops the turn.
    pub(crate) fn stop_token(&self) -> CancellationToken {
        self.0.stop.clone()
    }

    /// The abort's kind, for the core's `Ended` event (set once the turn is aborted).
    pub(crate) fn stopped_for(&self) -> Arc<OnceLock<TurnFailure>> {
        self.0.stopped_for.clone()
    }

    /// The layer's reason the turn was aborted, if it was.
    pub(crate) fn abort_reason(&self) -> Option<&AbortReason> {
        self.0.abort.get()
    }

    /// The turn has answered its caller.
    pub(crate) fn mark_replied(&self) {
        self.0.replied.store(true, Ordering::SeqCst);
    }

    pub(crate) fn replied(&self) -> bool {
        self.0.replied.load(Ordering::SeqCst)
    }

    pub(crate) fn set_stage(&self, stage: Stage) {
        *self
            .0
            .phase
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = stage;
    }

    /// The channel's state as this turn makes it.
    pub(crate) fn state(&self) -> ChannelState {
        if self.0.stop.is_cancelled() && !self.replied() {
            return ChannelState::Stopping;
        }
        let stage = *self
            .0
            .phase
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match stage {
            Stage::Admitted => ChannelState::Running(TurnPhase::Preparing),
            Stage::WaitingForSlot => ChannelState::WaitingForSlot,
            Stage::Running(phase) => ChannelState::Running(phase),
        }
    }
}

/// Each running turn's channel state, kept from the `Phase` events of the runtime's one
/// observer: the supervisor installs [`PhaseRoutes::observer`] on the core's config (the
/// bot's observer, if any, still gets every event first), a turn's actor registers its
/// control under the turn's number while the core runs it.
#[derive(Clone, Default)]
pub(crate) struct PhaseRoutes(Arc<Mutex<HashMap<u64, TurnControl>>>);

impl PhaseRoutes {
    /// The observer that feeds the routes, after `bot`'s.
    pub(crate) fn observer(&self, bot: Option<Observer>) -> Observer {
        let routes = self.clone();
        Arc::new(move |event: &Event| {
            if let Some(bot) = &bot {
                bot(event);
            }
            if let (EventKind::Phase(phase), Some(turn)) = (&event.kind, event.turn) {
                if let Some(control) = routes.table().get(&turn) {
                    control.set_stage(Stage::Running(*phase));
                }
            }
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<u64, TurnControl>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Routes turn `turn`'s phases to `control` until the guard is dropped.
    pub(crate) fn route(&self, turn: u64, control: TurnControl) -> RouteGuard {
        self.table().insert(turn, control);
        RouteGuard(self.clone(), turn)
    }
}

pub(crate) struct RouteGuard(PhaseRoutes, u64);

impl Drop for RouteGuard {
    fn drop(&mut self) {
        self.0.table().remove(&self.1);
    }
}
