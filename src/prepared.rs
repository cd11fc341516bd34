//! A prepared container as a value: [`PreparedTurn`], what the channel holds until its next
//! turn adopts it, and its removal. How one is made and bounded: [`crate::warm`]; how a turn
//! adopts it: [`crate::turn::run_turn_prepared`]. Below both, so neither imports the other's
//! internals in a circle.

use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;

use crate::driver::{ContainerSpec, StartedContainer};
use crate::Sandbox;

/// A started container waiting for its channel's next turn (see the [module](self)).
/// Adopt it with [`crate::turn::run_turn_prepared`]; otherwise [`PreparedTurn::discard`] it
/// (dropping it removes it in the background).
#[derive(Debug)]
pub struct PreparedTurn {
    pub(crate) inner: Option<Prepared>,
}

#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) sandbox: Sandbox,
    pub(crate) channel: String,
    pub(crate) turn_id: String,
    pub(crate) spec: ContainerSpec,
    /// The workspace directory it was made for (device, inode), recorded at preparation.
    pub(crate) workspace: (u64, u64),
    pub(crate) started: Box<dyn StartedContainer>,
    pub(crate) prepared_at: Instant,
    pub(crate) _permit: OwnedSemaphorePermit,
}

impl PreparedTurn {
    /// The prepared container's name.
    pub fn container(&self) -> &str {
        self.inner.as_ref().map_or("", |p| p.spec.name.as_str())
    }

    /// The channel it was prepared for.
    pub fn channel(&self) -> &str {
        self.inner.as_ref().map_or("", |p| p.channel.as_str())
    }

    /// How long it has been waiting.
    pub fn age(&self) -> Duration {
        self.inner
            .as_ref()
            .map_or(Duration::ZERO, |p| p.prepared_at.elapsed())
    }

    /// Takes the container out for its turn (the turn's teardown removes it from then on).
    pub(crate) fn take(mut self) -> Option<Prepared> {
        self.inner.take()
    }

    /// Removes the container and its run dir; logs why at debug.
    pub async fn discard(mut self, why: &str) {
        if let Some(p) = self.inner.take() {
            tracing::debug!(container = %p.spec.name, why, "prepared container discarded");
            remove(p).await;
        }
    }
}

impl Drop for PreparedTurn {
    fn drop(&mut self) {
        if let Some(p) = self.inner.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    handle.spawn(remove(p));
                }
                Err(_) => tracing::warn!(
                    container = %p.spec.name,
                    "prepared container dropped without a runtime; the startup sweep removes it"
                ),
            }
        }
    }
}

/// Removes a prepared container, its run dir and its registration (the permit goes last).
pub(crate) async fn remove(p: Prepared) {
    let Prepared {
        sandbox,
        spec,
        started,
        _permit,
        ..
    } = p;
    drop(started);
    if let Err(e) = sandbox.driver().remove(&spec.name).await {
        tracing::warn!(container = %spec.name, error = %e, "remove prepared container");
    }
    remove_run_dir(&sandbox, &spec.run_dir);
    sandbox.live_turns().containers.remove(&spec.name);
}

pub(crate) fn remove_run_dir(sandbox: &Sandbox, dir: &std::path::Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %dir.display(), error = %e, "remove prepared run dir");
        }
    }
    sandbox.live_turns().run_dirs.remove(dir);
}
