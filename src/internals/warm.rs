//! Prepared ("warm") containers: a channel's next turn's container, created and started
//! before its message arrives, its guest waiting on stdin.
//!
//! [`Sandbox::prepare_turn`] makes the channel's workspace and a fresh run dir, and starts
//! the container with the turn's sealed spec (labelled [`LABEL_PREPARED`]) through
//! [`ContainerDriver::start`](crate::driver::ContainerDriver::start), from the same
//! [`TurnResources`](crate::turn) a cold turn builds. Nothing is bound to
//! it: the run dir holds no socket, so a connection from the container before its turn is
//! refused (`ENOENT`), and it has seen no key and no turn. The turn that adopts it
//! ([`crate::Sandbox::run`]) checks it still waits, checks the quota as a cold
//! turn does, binds the broker to its own context and writes the turn; a prepared container
//! that cannot serve (it exited, was removed, the engine does not answer) is removed and
//! the turn starts cold, the reason logged. One container still serves exactly one turn.
//!
//! A prepared container serves only the workspace directory it was made for: its
//! `(st_dev, st_ino)` is recorded here, and the adopting turn compares it with the directory
//! it made and holds. A workspace moved aside (an operator's fix of an over-quota channel)
//! or deleted since is another directory, while the container's bind still holds the old
//! one: the container is discarded and the turn runs cold.
//!
//! Bounded: at most [`WarmSettings::max`] prepared containers per runtime (a permit each,
//! held until the container is removed or adopted). A prepared container that is never
//! adopted is removed by [`PreparedTurn::discard`], or by its drop in the background; the
//! startup sweep finds it by the runtime's label like any turn's container.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub use crate::config::WarmSettings;
use crate::events::{EventKind, WarmEvent};
use crate::turn::resources::{Start, TurnResources};
pub use crate::turn::PreparedTurn;
use crate::turn::TurnError;
pub use crate::turn::LABEL_PREPARED;
use crate::Sandbox;

/// The runtime's prepared containers: one permit each, up to `warm.max`.
#[derive(Debug)]
pub(crate) struct WarmPool {
    permits: Arc<Semaphore>,
    max: usize,
}

impl WarmPool {
    pub(crate) fn new(settings: &WarmSettings) -> Self {
        let max = if settings.on() { settings.max } else { 0 };
        Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }
}

/// Prepares the channel's next turn's container (see [`Sandbox::prepare_turn`]).
pub(crate) async fn prepare(
    sandbox: &Sandbox,
    channel: crate::ChannelId,
    cancel: CancellationToken,
) -> Result<Option<PreparedTurn>, TurnError> {
    if !sandbox.warm_enabled() {
        return Ok(None);
    }
    let Ok(permit) = sandbox.inner.warm.permits.clone().try_acquire_owned() else {
        return Ok(None);
    };
    let mut resources = TurnResources::new(sandbox, &channel, Start::Prepared)?;
    // Not abandoned half-way: an engine call dropped in flight may still create the
    // container after a removal meant for it. Cancelled, it is removed once started.
    let started = match resources.start().await {
        Ok(()) if cancel.is_cancelled() => Err(crate::driver::DriverError::Cancelled.into()),
        other => other,
    };
    match started {
        Ok(()) => {
            sandbox.emit(None, Some(&channel), EventKind::Warm(WarmEvent::Prepared));
            Ok(Some(PreparedTurn::new(resources, permit)))
        }
        Err(e) => {
            resources.teardown_logged("remove failed preparation").await;
            Err(e)
        }
    }
}

/// Waits until no prepared container is left (each one removed or adopted), or `limit`.
pub(crate) async fn drained(pool: &WarmPool, limit: Duration) -> bool {
    let max = pool.max as u32;
    if max == 0 {
        return true;
    }
    let permits = pool.permits.clone();
    let drained = tokio::time::timeout(limit, permits.acquire_many(max)).await;
    matches!(drained, Ok(Ok(_)))
}

impl WarmPool {
    /// How many containers may be prepared at once (`warm.max`).
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Prepared containers alive now (waiting, or being prepared or removed).
    pub(crate) fn alive(&self) -> usize {
        self.max - self.permits.available_permits()
    }
}
