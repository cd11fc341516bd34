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

impl Sandbox {
    /// Whether this runtime prepares containers (`[warm]` on and a driver that can).
    pub fn warm_enabled(&self) -> bool {
        self.inner.warm.max > 0 && self.driver().prepares()
    }

    /// Turns served by a prepared container, and turns whose prepared container could not
    /// serve them (they started cold), since start: a count of the
    /// [`crate::events::WarmEvent`]s `Adopted` and `FellBack`.
    pub fn warm_counts(&self) -> (u64, u64) {
        self.events().warm_counts()
    }

    /// Prepared containers alive now (waiting, or being prepared or removed).
    pub fn prepared_containers(&self) -> usize {
        self.inner.warm.max - self.inner.warm.permits.available_permits()
    }

    /// Waits until no prepared container is left (each one removed or adopted), or `limit`.
    pub async fn prepared_drained(&self, limit: Duration) -> bool {
        let max = self.inner.warm.max as u32;
        if max == 0 {
            return true;
        }
        let permits = self.inner.warm.permits.clone();
        let drained = tokio::time::timeout(limit, permits.acquire_many(max)).await;
        matches!(drained, Ok(Ok(_)))
    }

    /// Prepares the channel's next turn's container (see the [module](self)): `Ok(None)`
    /// when warm turns are off or `warm.max` containers are already prepared. `cancel`
    /// abandons the preparation: what was made is removed (after the engine's calls end)
    /// and the result is `Err` with [`crate::driver::DriverError::Cancelled`].
    pub async fn prepare_turn(
        &self,
        channel: impl Into<crate::ChannelId>,
        cancel: CancellationToken,
    ) -> Result<Option<PreparedTurn>, TurnError> {
        if !self.warm_enabled() {
            return Ok(None);
        }
        let Ok(permit) = self.inner.warm.permits.clone().try_acquire_owned() else {
            return Ok(None);
        };
        let channel: crate::ChannelId = channel.into();
        let mut resources = TurnResources::new(self, &channel, Start::Prepared)?;
        // Not abandoned half-way: an engine call dropped in flight may still create the
        // container after a removal meant for it. Cancelled, it is removed once started.
        let started = match resources.start().await {
            Ok(()) if cancel.is_cancelled() => Err(crate::driver::DriverError::Cancelled.into()),
            other => other,
        };
        match started {
            Ok(()) => {
                self.emit(None, Some(&channel), EventKind::Warm(WarmEvent::Prepared));
                Ok(Some(PreparedTurn::new(resources, permit)))
            }
            Err(e) => {
                resources.teardown_logged("remove failed preparation").await;
                Err(e)
            }
        }
    }
}
