//! The Docker Engine driver, on bollard.
//!
//! One turn: create (sealed [`HostConfig`](bollard::models::HostConfig)), attach before
//! start (`stdin_once`), start, write the turn and close stdin, then read stdout/stderr
//! (capped) while waiting for the exit; an inspect for an OOM kill when the turn asks
//! ([`ContainerDriver::oom_killed`]). Every API call has a deadline; cancellation kills the
//! container. The container is removed by [`ContainerDriver::remove`], or by a drop guard
//! when the run's future is dropped half-way (a panicking or aborted caller).
//!
//! By concern:
//! - this module: the handle ([`DockerDriver`]), its options, the engine's client, the
//!   deadline every call runs under, how an engine error is classified, and the
//!   [`ContainerDriver`] implementation (each method a short delegation);
//! - `create`: what a container is created with (the sealed body, gVisor's sizing);
//! - `run`: a turn's container started, prepared and run ([`DockerStarted`]);
//! - `lifecycle`: removal (retried), pause and resume, the OOM question, the sweep, the
//!   listing by label;
//! - `held`: the container's processes and the files they hold open (counted inside under
//!   gVisor);
//! - `session`: long-lived attached containers (MCP sessions) and files read out of an
//!   image;
//! - `networks`: the engine's own networks.

mod create;
mod held;
mod lifecycle;
mod networks;
mod run;
mod session;

pub use create::{
    create_body, GUEST_OOM_SCORE_ADJ, GVISOR_HOST_TASKS_BASE, GVISOR_HOST_TASKS_PER_GUEST_TASK,
};
pub use held::HELD_FILES_TIMEOUT;
pub use run::DockerStarted;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::errors::Error as BollardError;
use bollard::models::{
    ContainerCreateBody, HostConfig, HostConfigLogConfig, Mount, MountBindOptions,
    MountBindOptionsPropagationEnum, MountType, ResourcesUlimits,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, KillContainerOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder, WaitContainerOptions,
};
use bollard::{ClientVersion, Docker};
use futures_util::StreamExt;
use roundtable_sandbox_protocol::{RUN_MOUNT, WORKSPACE_MOUNT};
use tokio::io::AsyncWriteExt;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::driver::{
    BoxFuture, ContainerDriver, ContainerProcesses, ContainerSpec, DriverError, HeldFiles,
    OutputCollector, RunOutcome, StartedContainer, SweepScope, Unmeasurable, KEEP_CONTAINERS_ENV,
    LABEL_READ, LABEL_RUNTIME, READ_ORPHANED_AFTER,
};

/// How long [`DockerDriver::oom_killed`] asks about a container that ended by SIGKILL or
/// that the engine still lists as running, and the pause between.
const OOM_ASK_WITHIN: Duration = Duration::from_secs(3);
const OOM_ASK_PAUSE: Duration = Duration::from_millis(150);

/// How the driver reaches the engine.
#[derive(Debug, Clone)]
pub struct DockerOptions {
    /// `unix:///path/to/docker.sock`, or a bare path.
    pub host: String,
    /// Deadline of each API call (create, attach, start, inspect, kill, remove, list).
    pub call_timeout: Duration,
}

impl Default for DockerOptions {
    fn default() -> Self {
        let host = std::env::var("DOCKER_HOST")
            .ok()
            .filter(|h| h.starts_with("unix://"))
            .unwrap_or_else(|| "unix:///var/run/docker.sock".to_owned());
        Self {
            host,
            call_timeout: Duration::from_secs(20),
        }
    }
}

/// The oldest engine API this driver speaks (Docker 20.10); newer engines are negotiated.
const MIN_API: ClientVersion = ClientVersion {
    major_version: 1,
    minor_version: 41,
};

/// Runs turns in Docker containers.
#[derive(Debug, Clone)]
pub struct DockerDriver {
    options: DockerOptions,
    docker: Arc<OnceCell<Docker>>,
    /// Containers whose removal failed (the daemon was unreachable or timed out): retried
    /// before every run and every sweep, so a daemon outage leaks nothing for long.
    pending_removal: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    /// Per running container: its id and the host file listing its processes (its
    /// cgroup's `cgroup.procs`), found once by [`ContainerDriver::processes`].
    process_files: Arc<std::sync::Mutex<HashMap<String, ProcessSource>>>,
    /// Containers being attached and started: no process of theirs runs yet, so a look at
    /// their processes (the quota's watcher, ticking while a slow engine starts a cold
    /// turn's container) finds none without asking the engine.
    starting: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// Containers whose run ended at the reply's frame, still running then: their exit
    /// watcher goes on, and the removal waits up to [`EXIT_GRACE`] for the exit the
    /// guest makes on its own (the engine's forced removal of a running container costs
    /// more than the removal of an exited one).
    answered: Arc<std::sync::Mutex<HashMap<String, Answered>>>,
    /// The engine's data root (`DockerRootDir`), asked once.
    data_root: Arc<OnceCell<Option<std::path::PathBuf>>>,
    /// Containers created under gVisor: their processes are not host processes, so what
    /// they hold open is counted inside (see [`ContainerDriver::held_files`]).
    sandboxed: Arc<std::sync::Mutex<HashMap<String, Sandboxed>>>,
    /// Where each engine call is reported (operation, latency), if the runtime observes.
    events: Option<Arc<crate::events::EventHub>>,
}

/// How the measurer inside a gVisor container is run: as the container's `uid:gid`, on the
/// directory whose held files count (the workspace, or an MCP session's data).
#[derive(Debug, Clone)]
struct Sandboxed {
    user: String,
    dir: String,
}

/// A container answered at its reply's frame: whether it has exited, and its watcher.
#[derive(Debug)]
struct Answered {
    exited: tokio::sync::watch::Receiver<bool>,
    watcher: tokio::task::AbortHandle,
}

/// How long the removal of a container that answered waits for the guest's own exit
/// before it forces it (a guest that hangs after its reply is killed then).
const EXIT_GRACE: Duration = Duration::from_millis(250);

/// Where a container's process list is read.
#[derive(Debug, Clone)]
struct ProcessSource {
    id: String,
    /// `cgroup.procs` of the container's cgroup; `None`: ask the engine (`top`).
    procs: Option<std::path::PathBuf>,
}

impl DockerDriver {
    /// A driver for the given engine; nothing is contacted until the first call.
    pub fn new(options: DockerOptions) -> Self {
        Self {
            options,
            docker: Arc::new(OnceCell::new()),
            pending_removal: Default::default(),
            process_files: Default::default(),
            starting: Default::default(),
            answered: Default::default(),
            data_root: Arc::new(OnceCell::new()),
            sandboxed: Default::default(),
            events: None,
        }
    }

    /// The driver reporting each engine call to the runtime's events.
    pub(crate) fn with_events(mut self, events: Arc<crate::events::EventHub>) -> Self {
        self.events = Some(events);
        self
    }

    /// The engine's client, connected and version-negotiated on first use (an engine
    /// type: public to this workspace's tests and bench only, never the embedding API).
    pub(crate) async fn engine(&self) -> Result<&Docker, DriverError> {
        self.docker
            .get_or_try_init(|| async {
                let path = self.options.host.trim_start_matches("unix://");
                // bollard's own timeout would cut the wait and attach streams: ours apply per call.
                let docker = Docker::connect_with_unix(path, 3600, &MIN_API)
                    .map_err(|e| unreachable_error(&e))?;
                let negotiated =
                    tokio::time::timeout(self.options.call_timeout, docker.negotiate_version())
                        .await
                        .map_err(|_| DriverError::DaemonUnreachable {
                            engine: ENGINE,
                            reason: format!(
                                "no answer from {} within {:?}",
                                self.options.host, self.options.call_timeout
                            ),
                        })?
                        .map_err(|e| unreachable_error(&e))?;
                // Never go below the API that has every field this driver sets.
                let v = negotiated.client_version();
                if (v.major_version, v.minor_version) < (1, 41) {
                    return Err(DriverError::DaemonUnreachable {
                        engine: ENGINE,
                        reason: format!(
                            "engine API {}.{} is older than 1.41",
                            v.major_version, v.minor_version
                        ),
                    });
                }
                Ok(negotiated)
            })
            .await
    }

    /// The engine's version string (for `doctor`).
    pub async fn version(&self) -> Result<String, DriverError> {
        let docker = self.engine().await?;
        let v = self.call("version", "engine", docker.version()).await?;
        Ok(format!(
            "{} (API {})",
            v.version.unwrap_or_default(),
            v.api_version.unwrap_or_default()
        ))
    }

    /// The runtimes the engine lists (its info's `Runtimes`) and its default one (for `doctor`).
    pub async fn runtimes(&self) -> Result<(Vec<String>, String), DriverError> {
        let docker = self.engine().await?;
        let info = self.call("info", "engine", docker.info()).await?;
        let mut names: Vec<String> = info.runtimes.unwrap_or_default().into_keys().collect();
        names.sort();
        Ok((names, info.default_runtime.unwrap_or_else(|| "runc".into())))
    }

    /// Whether the image is present locally.
    pub async fn image_present(&self, image: &str) -> Result<bool, DriverError> {
        let docker = self.engine().await?;
        Ok(self.inspected(docker, image).await?.is_some())
    }

    /// The image's inspection; `None` when it is not present.
    async fn inspected(
        &self,
        docker: &Docker,
        image: &str,
    ) -> Result<Option<bollard::models::ImageInspect>, DriverError> {
        match self
            .call("inspect image", image, docker.inspect_image(image))
            .await
        {
            Ok(inspected) => Ok(Some(inspected)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The paths an image declares as `VOLUME`s (none for an image not present: its create
    /// says so).
    pub(super) async fn image_volumes(
        &self,
        docker: &Docker,
        image: &str,
    ) -> Result<Vec<String>, DriverError> {
        Ok(self
            .inspected(docker, image)
            .await?
            .and_then(|i| i.config)
            .and_then(|c| c.volumes)
            .unwrap_or_default())
    }

    pub(crate) async fn call<T>(
        &self,
        op: &'static str,
        container: &str,
        fut: impl std::future::Future<Output = Result<T, BollardError>>,
    ) -> Result<T, DriverError> {
        let started = std::time::Instant::now();
        let result = match tokio::time::timeout(self.options.call_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(op, container, e)),
            Err(_) => Err(DriverError::CallTimeout {
                engine: ENGINE,
                op,
                container: container.to_owned(),
                after: self.options.call_timeout,
            }),
        };
        if let Some(events) = &self.events {
            events.emit(
                None,
                None,
                crate::events::EventKind::Engine {
                    op,
                    latency: started.elapsed(),
                    ok: result.is_ok(),
                },
            );
        }
        result
    }

    fn spawn_kill(&self, docker: &Docker, name: &str) {
        let (driver, docker, name) = (self.clone(), docker.clone(), name.to_owned());
        tokio::spawn(async move { driver.kill(&docker, &name).await });
    }

    async fn kill(&self, docker: &Docker, name: &str) {
        let opts = KillContainerOptionsBuilder::new().signal("SIGKILL").build();
        if let Err(e) = self
            .call("kill", name, docker.kill_container(name, Some(opts)))
            .await
        {
            tracing::debug!(container = name, error = %e, "kill after cancel");
        }
    }
}

impl Default for DockerDriver {
    fn default() -> Self {
        Self::new(DockerOptions::default())
    }
}

fn keep_containers() -> bool {
    std::env::var(KEEP_CONTAINERS_ENV).is_ok_and(|v| v == "1")
}

impl ContainerDriver for DockerDriver {
    fn run<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        stdin: &'a [u8],
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, DriverError>> {
        Box::pin(self.run_cold(spec, stdin, cancel))
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(self.remove_inner(name))
    }

    /// Inspects: the engine sets the flag when the container's cgroup saw an OOM kill.
    fn oom_killed<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, DriverError>> {
        Box::pin(self.oom_killed_inner(name))
    }

    fn prepares(&self) -> bool {
        true
    }

    fn start<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Box<dyn StartedContainer>, DriverError>> {
        Box::pin(self.start_prepared(spec, cancel))
    }

    fn processes<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ContainerProcesses, DriverError>> {
        Box::pin(self.processes_inner(name))
    }

    fn held_files<'a>(&'a self, name: &'a str) -> BoxFuture<'a, HeldFiles> {
        Box::pin(self.held_files_of(name))
    }

    fn data_root(&self) -> BoxFuture<'_, Result<Option<std::path::PathBuf>, DriverError>> {
        Box::pin(async move {
            self.data_root
                .get_or_try_init(|| async {
                    let docker = self.engine().await?;
                    let info = self.call("info", "engine", docker.info()).await?;
                    Ok(info
                        .docker_root_dir
                        .filter(|d| !d.is_empty())
                        .map(std::path::PathBuf::from))
                })
                .await
                .cloned()
        })
    }

    fn sweep<'a>(
        &'a self,
        scope: SweepScope<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
        Box::pin(self.sweep_inner(scope))
    }

    fn start_session<'a>(
        &'a self,
        spec: &'a crate::driver::SessionSpec,
    ) -> BoxFuture<'a, Result<crate::driver::SessionIo, DriverError>> {
        Box::pin(self.start_session_inner(spec))
    }

    fn pause<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(self.pause_inner(name))
    }

    fn resume<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(self.resume_inner(name))
    }

    fn list_labelled<'a>(
        &'a self,
        labels: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<crate::driver::LabelledContainer>, DriverError>> {
        Box::pin(self.list_labelled_inner(labels))
    }

    fn image_file<'a>(
        &'a self,
        image: &'a str,
        path: &'a str,
        max: u64,
    ) -> BoxFuture<'a, Result<Vec<u8>, DriverError>> {
        Box::pin(self.image_file_inner(image, path, max))
    }
}

/// The engine's name in [`DriverError`]s.
const ENGINE: &str = "docker";

fn unreachable_error(e: &BollardError) -> DriverError {
    DriverError::DaemonUnreachable {
        engine: ENGINE,
        reason: e.to_string(),
    }
}

/// Maps a bollard error: transport failures mean the daemon is unreachable; a server
/// answer keeps its status code first (`404 …`).
fn classify(op: &'static str, container: &str, e: BollardError) -> DriverError {
    match e {
        BollardError::DockerResponseServerError {
            status_code,
            message,
        } => DriverError::Call {
            engine: ENGINE,
            op,
            container: container.to_owned(),
            status: Some(status_code),
            message,
        },
        BollardError::IOError { .. }
        | BollardError::HyperResponseError { .. }
        | BollardError::HyperLegacyError { .. }
        | BollardError::SocketNotFoundError(_)
        | BollardError::RequestTimeoutError => DriverError::DaemonUnreachable {
            engine: ENGINE,
            reason: e.to_string(),
        },
        other => DriverError::Call {
            engine: ENGINE,
            op,
            container: container.to_owned(),
            status: None,
            message: other.to_string(),
        },
    }
}
