//! A prepared container as a value: [`PreparedTurn`], what the channel holds until its next
//! turn adopts it. It is a turn's [`TurnResources`] built and started ahead of the turn
//! (see [`crate::warm`]), and the permit that bounds them; its removal is the resources'
//! one teardown.

use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;

use super::resources::TurnResources;

/// A started container waiting for its channel's next turn (see [`crate::warm`]).
/// Adopt it with [`crate::Sandbox::run`]; otherwise [`PreparedTurn::discard`] it
/// (dropping it removes it in the background).
#[derive(Debug)]
pub struct PreparedTurn {
    inner: Option<Prepared>,
}

#[derive(Debug)]
struct Prepared {
    resources: TurnResources,
    prepared_at: Instant,
    /// Held until the container is removed or adopted (`warm.max`).
    permit: OwnedSemaphorePermit,
}

impl PreparedTurn {
    pub(crate) fn new(resources: TurnResources, permit: OwnedSemaphorePermit) -> Self {
        Self {
            inner: Some(Prepared {
                resources,
                prepared_at: Instant::now(),
                permit,
            }),
        }
    }

    /// The prepared container's name.
    pub fn container(&self) -> &str {
        self.inner
            .as_ref()
            .map_or("", |p| p.resources.spec().name.as_str())
    }

    /// The channel it was prepared for.
    pub fn channel(&self) -> &str {
        self.inner
            .as_ref()
            .map_or("", |p| p.resources.channel().key())
    }

    /// How long it has been waiting.
    pub fn age(&self) -> Duration {
        self.inner
            .as_ref()
            .map_or(Duration::ZERO, |p| p.prepared_at.elapsed())
    }

    /// Takes the resources out for their turn (the turn's teardown removes them from then
    /// on); the permit goes now.
    pub(crate) fn adopt(mut self) -> Option<TurnResources> {
        self.inner.take().map(|p| p.resources)
    }

    /// Removes the container and its run dir; logs why at debug (and sends it as a
    /// [`WarmEvent::Discarded`](crate::events::WarmEvent::Discarded)).
    pub async fn discard(mut self, why: &str) {
        if let Some(p) = self.inner.take() {
            tracing::debug!(container = %p.resources.spec().name, why, "prepared container discarded");
            p.resources.discarded(why);
            p.remove().await;
        }
    }
}

impl Prepared {
    /// The resources' teardown; the permit goes last.
    async fn remove(self) {
        let Prepared {
            resources, permit, ..
        } = self;
        resources.teardown_logged("remove prepared container").await;
        drop(permit);
    }
}

impl Drop for PreparedTurn {
    fn drop(&mut self) {
        if let Some(p) = self.inner.take() {
            p.resources.discarded("dropped");
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    handle.spawn(p.remove());
                }
                // The resources' own drop says what is left to the startup sweep.
                Err(_) => drop(p),
            }
        }
    }
}
