//! Prepared ("warm") containers: a channel's next turn's container, created and started
//! before its message arrives, its guest waiting on stdin.
//!
//! [`Sandbox::prepare_turn`] makes the channel's workspace and a fresh run dir, and starts
//! the container with the turn's sealed spec (labelled [`LABEL_PREPARED`]) through
//! [`ContainerDriver::start`](crate::driver::ContainerDriver::start). Nothing is bound to
//! it: the run dir holds no socket, so a connection from the container before its turn is
//! refused (`ENOENT`), and it has seen no key and no turn. The turn that adopts it
//! ([`crate::turn::run_turn_prepared`]) checks it still waits, checks the quota as a cold
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

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub use crate::config::WarmSettings;
pub use crate::prepared::PreparedTurn;
use crate::prepared::{remove_run_dir, Prepared};
use crate::turn::TurnError;
use crate::Sandbox;

/// Label set (to `1`) on every prepared container: it was started before its turn.
pub const LABEL_PREPARED: &str = "roundtable-sandbox.prepared";

/// The runtime's prepared containers: one permit each, up to `warm.max`.
#[derive(Debug)]
pub(crate) struct WarmPool {
    permits: Arc<Semaphore>,
    max: usize,
    /// Turns served by a prepared container, and turns whose prepared container could not
    /// serve (they started cold).
    pub(crate) adopted: std::sync::atomic::AtomicU64,
    pub(crate) fell_back: std::sync::atomic::AtomicU64,
}

impl WarmPool {
    pub(crate) fn new(settings: &WarmSettings) -> Self {
        let max = if settings.on() { settings.max } else { 0 };
        Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
            adopted: Default::default(),
            fell_back: Default::default(),
        }
    }
}

impl Sandbox {
    /// Whether this runtime prepares containers (`[warm]` on and a driver that can).
    pub fn warm_enabled(&self) -> bool {
        self.inner.warm.max > 0 && self.driver().prepares()
    }

    /// Turns served by a prepared container, and turns whose prepared container could not
    /// serve them (they started cold), since start.
    pub fn warm_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let w = &self.inner.warm;
        (w.adopted.load(Relaxed), w.fell_back.load(Relaxed))
    }

    pub(crate) fn count_warm(&self, adopted: bool) {
        let w = &self.inner.warm;
        let counter = if adopted { &w.adopted } else { &w.fell_back };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        channel: &str,
        cancel: CancellationToken,
    ) -> Result<Option<PreparedTurn>, TurnError> {
        if !self.warm_enabled() {
            return Ok(None);
        }
        let Ok(permit) = self.inner.warm.permits.clone().try_acquire_owned() else {
            return Ok(None);
        };
        let config = self.config();
        let segment = crate::turn::channel_segment(channel);
        let turn_id = uuid::Uuid::new_v4().simple().to_string();
        let workspace_dir = config.workspace_root.join(&segment);
        // The directory it is made for, by identity: the adopting turn compares it with the
        // one it holds (a workspace moved aside or deleted meanwhile is another).
        let workspace = crate::turn::make_workspace(self, &segment)?;
        crate::turn::check_mount_path(&workspace_dir, &workspace)?;
        let workspace = workspace.id();
        let name = crate::turn::container_name(&segment, &turn_id);
        let dir = crate::turn::make_run_dir(self)?;
        self.live_turns().containers.insert(name.clone());
        let mut spec =
            crate::turn::container_spec(self, &name, &segment, &turn_id, &dir, &workspace_dir);
        spec.labels = spec
            .labels
            .into_iter()
            .chain([(LABEL_PREPARED.to_owned(), "1".to_owned())])
            .collect::<BTreeMap<_, _>>();
        // Not abandoned half-way: an engine call dropped in flight may still create the
        // container after a removal meant for it. Cancelled, it is removed once started.
        let started = match self.driver().start(&spec, CancellationToken::new()).await {
            Ok(_) if cancel.is_cancelled() => Err(crate::driver::DriverError::Cancelled),
            other => other,
        };
        match started {
            Ok(started) => Ok(Some(PreparedTurn {
                inner: Some(Prepared {
                    sandbox: self.clone(),
                    channel: channel.to_owned(),
                    turn_id,
                    spec,
                    workspace,
                    started,
                    prepared_at: Instant::now(),
                    _permit: permit,
                }),
            })),
            Err(e) => {
                if let Err(e) = self.driver().remove(&name).await {
                    tracing::warn!(container = %name, error = %e, "remove failed preparation");
                }
                remove_run_dir(self, &dir);
                self.live_turns().containers.remove(&name);
                Err(e.into())
            }
        }
    }
}
