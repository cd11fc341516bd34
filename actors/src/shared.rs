//! What every actor of one supervisor shares: the runtime, the container cap and the
//! layer's settings and counters.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use roundtable_sandbox::Sandbox;
use tokio::sync::Semaphore;

use crate::control::PhaseRoutes;
use crate::SupervisorOptions;

/// What every actor of one supervisor shares.
pub(crate) struct Shared {
    pub(crate) sandbox: Sandbox,
    /// The global cap on running containers (FIFO: fair across channels).
    pub(crate) limiter: Arc<Semaphore>,
    pub(crate) max_containers: usize,
    pub(crate) queue_limit: usize,
    pub(crate) max_waiting: usize,
    pub(crate) idle_timeout: Duration,
    /// How long a prepared container waits for its channel's next turn (`warm.ttl_secs`,
    /// default the idle timeout).
    pub(crate) warm_ttl: Duration,
    /// Where each running turn's `Phase` events go (its channel's state).
    pub(crate) phases: PhaseRoutes,
    waiting_for_slot: AtomicUsize,
    /// Messages queued in every channel (each counted by its [`QueueTicket`]).
    queued: AtomicUsize,
}

impl Shared {
    /// The shared state of a supervisor over `sandbox` with `config`'s settings.
    pub(crate) fn new(sandbox: Sandbox, config: &SupervisorOptions, phases: PhaseRoutes) -> Self {
        let warm_ttl = sandbox.config().warm.ttl().unwrap_or(config.idle_timeout);
        Self {
            sandbox,
            limiter: Arc::new(Semaphore::new(config.max_containers)),
            max_containers: config.max_containers,
            queue_limit: config.queue_limit,
            max_waiting: config.max_waiting,
            idle_timeout: config.idle_timeout,
            warm_ttl,
            phases,
            waiting_for_slot: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
        }
    }

    /// Messages waiting now across all channels: queued, or waiting for a slot.
    pub(crate) fn waiting(&self) -> usize {
        self.queued.load(Ordering::SeqCst) + self.waiting_for_slot()
    }

    /// Counts a queued message while the ticket lives (whatever drops it: its admission,
    /// a shutdown's refusal, its actor's end).
    pub(crate) fn queue_ticket(self: &Arc<Self>) -> QueueTicket {
        self.queued.fetch_add(1, Ordering::SeqCst);
        QueueTicket(self.clone())
    }

    /// Turns waiting for a container slot now.
    pub(crate) fn waiting_for_slot(&self) -> usize {
        self.waiting_for_slot.load(Ordering::SeqCst)
    }

    /// Counts a turn waiting for a slot while the guard lives.
    pub(crate) fn waiting_guard(self: &Arc<Self>) -> WaitingGuard {
        self.waiting_for_slot.fetch_add(1, Ordering::SeqCst);
        WaitingGuard(self.clone())
    }
}

/// One queued message, counted in [`Shared::waiting`] until dropped.
pub(crate) struct QueueTicket(Arc<Shared>);

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) struct WaitingGuard(Arc<Shared>);

impl Drop for WaitingGuard {
    fn drop(&mut self) {
        self.0.waiting_for_slot.fetch_sub(1, Ordering::SeqCst);
    }
}
