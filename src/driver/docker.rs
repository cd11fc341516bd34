//! The Docker Engine driver, on bollard.
//!
//! One turn: create (sealed [`HostConfig`]), attach before start (`stdin_once`), start, write
//! the turn and close stdin, then read stdout/stderr (capped) while waiting for the exit;
//! an inspect for an OOM kill when the turn asks ([`ContainerDriver::oom_killed`]). Every API
//! call has a deadline; cancellation kills the container.
//! The container is removed by [`ContainerDriver::remove`], or by a drop guard when the
//! run's future is dropped half-way (a panicking or aborted caller).

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
    AttachContainerOptions, CreateContainerOptionsBuilder, KillContainerOptionsBuilder,
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, WaitContainerOptions,
};
use bollard::{ClientVersion, Docker};
use futures_util::StreamExt;
use roundtable_sandbox_protocol::{RUN_MOUNT, WORKSPACE_MOUNT};
use tokio::io::AsyncWriteExt;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use super::{
    BoxFuture, ContainerDriver, ContainerProcesses, ContainerSpec, DriverError, HeldFiles,
    OutputCollector, RunOutcome, StartedContainer, SweepScope, Unmeasurable, KEEP_CONTAINERS_ENV,
    LABEL_RUNTIME,
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
    dir: &'static str,
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
        match self
            .call("inspect image", image, docker.inspect_image(image))
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.is_not_found() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Finds where the named container's processes are listed: its init's cgroup (from
    /// `/proc/<pid>/cgroup`, which must name the container's id), or the engine's `top`.
    async fn process_source(&self, name: &str) -> Result<Option<ProcessSource>, DriverError> {
        if let Some(found) = self.process_files.lock().unwrap().get(name) {
            return Ok(Some(found.clone()));
        }
        if self.starting.lock().unwrap().contains(name) {
            return Ok(None);
        }
        let docker = self.engine().await?;
        let inspected = match self
            .call("inspect", name, docker.inspect_container(name, None))
            .await
        {
            Ok(i) => i,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e),
        };
        let state = inspected.state.unwrap_or_default();
        let (Some(id), Some(pid)) = (inspected.id, state.pid.filter(|p| *p > 0)) else {
            return Ok(None);
        };
        let procs = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|text| cgroup_procs_file(&text, &id))
            .filter(|p| p.exists());
        let source = ProcessSource { id, procs };
        self.process_files
            .lock()
            .unwrap()
            .insert(name.to_owned(), source.clone());
        Ok(Some(source))
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

    /// Creates, attaches and starts the container; its guest then waits on stdin.
    async fn start_inner(
        &self,
        spec: &ContainerSpec,
        cancel: CancellationToken,
    ) -> Result<DockerStarted, DriverError> {
        if cancel.is_cancelled() {
            return Err(DriverError::Cancelled);
        }
        let docker = tokio::select! {
            d = self.engine() => d?,
            _ = cancel.cancelled() => return Err(DriverError::Cancelled),
        };
        self.retry_pending_removals().await;
        let name = spec.name.as_str();
        let create = CreateContainerOptionsBuilder::new().name(name).build();
        let id = match self
            .call(
                "create",
                name,
                docker.create_container(Some(create), create_body(spec)),
            )
            .await
        {
            Ok(created) => created.id,
            Err(DriverError::Call {
                status, message, ..
            }) if status == Some(404) || message.contains("No such image") => {
                return Err(DriverError::ImageMissing {
                    image: spec.image.clone(),
                })
            }
            // "Unknown runtime specified runsc" (20.10), "unknown or invalid runtime name" (23+).
            Err(DriverError::Call { message, .. })
                if spec.runtime.is_some() && message.to_lowercase().contains("runtime") =>
            {
                return Err(DriverError::RuntimeMissing {
                    runtime: spec.runtime.clone().unwrap_or_default(),
                })
            }
            Err(e) => return Err(e),
        };
        if spec.runtime.as_deref() == Some(crate::driver::GVISOR_RUNTIME) {
            self.sandboxed.lock().unwrap().insert(
                name.to_owned(),
                Sandboxed {
                    user: format!("{}:{}", spec.uid, spec.gid),
                    dir: WORKSPACE_MOUNT,
                },
            );
        }
        // Until its processes' file is known (below), a look at them finds none.
        struct Starting<'a>(&'a DockerDriver, &'a str);
        impl Drop for Starting<'_> {
            fn drop(&mut self) {
                self.0.starting.lock().unwrap().remove(self.1);
            }
        }
        self.starting.lock().unwrap().insert(name.to_owned());
        let starting = Starting(self, name);
        let io = self.attach_and_start(docker, name).await?;
        // Where its processes are listed, found by the id the engine gave at creation where
        // the engine's cgroup layout puts it (no inspect on a turn's way; otherwise the
        // first look asks the engine, see `process_source`).
        if let Some(procs) = cgroup_procs_by_id(&id) {
            self.process_files.lock().unwrap().insert(
                name.to_owned(),
                ProcessSource {
                    id,
                    procs: Some(procs),
                },
            );
        }
        drop(starting);
        // The exit is watched from now on: a prepared container that dies while it waits
        // for its turn is known before the turn is written to it.
        let (exit_tx, exit) = tokio::sync::oneshot::channel();
        let (exited_tx, exited) = tokio::sync::watch::channel(false);
        let wait = docker.wait_container(name, None::<WaitContainerOptions>);
        let (waited, container) = (self.clone(), name.to_owned());
        let watcher = tokio::spawn(async move {
            tokio::pin!(wait);
            let status = match wait.next().await {
                Some(Ok(r)) => Ok(r.status_code),
                Some(Err(BollardError::DockerContainerWaitError { code, .. })) => Ok(code),
                Some(Err(e)) => Err(classify("wait", &container, e)),
                None => Err(DriverError::Call {
                    engine: ENGINE,
                    op: "wait",
                    container: container.clone(),
                    status: None,
                    message: "wait stream ended".into(),
                }),
            };
            drop(waited);
            let _ = exited_tx.send(true);
            let _ = exit_tx.send(status);
        });
        let bollard::container::AttachContainerResults { output, input } = io;
        Ok(DockerStarted {
            driver: self.clone(),
            docker: docker.clone(),
            name: name.to_owned(),
            output,
            input,
            exit,
            exited,
            watcher: Some(watcher),
            collector: OutputCollector::new(spec),
            procs: None,
        })
    }
}

impl DockerDriver {
    /// Creates, attaches and starts a long-lived container whose stdin stays open (an MCP
    /// session, see `broker::mcp_container`): its stdout and stderr, and its stdin. Under
    /// gVisor the files its processes hold open are counted inside, on `measured` (the
    /// session's data mount), by the image's `/roundtable-guest --held-files`.
    pub(crate) async fn start_attached(
        &self,
        name: &str,
        body: ContainerCreateBody,
        measured: &'static str,
    ) -> Result<bollard::container::AttachContainerResults, DriverError> {
        let docker = self.engine().await?;
        let image = body.image.clone().unwrap_or_default();
        let runtime = body.host_config.as_ref().and_then(|h| h.runtime.clone());
        let user = body.user.clone().unwrap_or_default();
        let create = CreateContainerOptionsBuilder::new().name(name).build();
        match self
            .call("create", name, docker.create_container(Some(create), body))
            .await
        {
            Ok(_) => {}
            Err(DriverError::Call {
                status, message, ..
            }) if status == Some(404) || message.contains("No such image") => {
                return Err(DriverError::ImageMissing { image })
            }
            Err(DriverError::Call { message, .. })
                if runtime.is_some() && message.to_lowercase().contains("runtime") =>
            {
                return Err(DriverError::RuntimeMissing {
                    runtime: runtime.unwrap_or_default(),
                })
            }
            Err(e) => return Err(e),
        }
        if runtime.as_deref() == Some(crate::driver::GVISOR_RUNTIME) {
            let sandboxed = Sandboxed {
                user,
                dir: measured,
            };
            self.sandboxed
                .lock()
                .unwrap()
                .insert(name.to_owned(), sandboxed);
        }
        self.attach_and_start(docker, name).await
    }

    /// Attaches to a created container's stdin, stdout and stderr, then starts it.
    async fn attach_and_start(
        &self,
        docker: &Docker,
        name: &str,
    ) -> Result<bollard::container::AttachContainerResults, DriverError> {
        let attach = AttachContainerOptions {
            stdin: true,
            stdout: true,
            stderr: true,
            stream: true,
            logs: false,
            detach_keys: None,
        };
        let io = self
            .call("attach", name, docker.attach_container(name, Some(attach)))
            .await?;
        self.call("start", name, docker.start_container(name, None))
            .await?;
        Ok(io)
    }

    /// Removes a container (killed first), as a turn's teardown does; a failure is retried
    /// before the next run or sweep.
    pub(crate) async fn remove_container(&self, name: &str) -> Result<(), DriverError> {
        self.remove_inner(name).await
    }

    /// Every container (running or not) carrying all of `labels` (`key=value`): name and
    /// the host source of each bind mount by its target.
    pub(crate) async fn list_labelled(
        &self,
        labels: Vec<String>,
    ) -> Result<Vec<(String, HashMap<String, String>)>, DriverError> {
        let docker = self.engine().await?;
        let filters: HashMap<&str, Vec<String>> = HashMap::from([("label", labels)]);
        let list = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let found = self
            .call("list", "", docker.list_containers(Some(list)))
            .await?;
        Ok(found
            .into_iter()
            .filter_map(|c| {
                let name = c
                    .names
                    .and_then(|n| n.into_iter().next())
                    .map(|n| n.trim_start_matches('/').to_owned())
                    .or(c.id)?;
                let mounts = c
                    .mounts
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|m| Some((m.destination?, m.source?)))
                    .collect();
                Some((name, mounts))
            })
            .collect())
    }
}

/// A started container of the [`DockerDriver`]: attached, its exit watched, its guest
/// waiting on stdin.
pub struct DockerStarted {
    driver: DockerDriver,
    docker: Docker,
    name: String,
    output:
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<LogOutput, BollardError>> + Send>>,
    input: std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    exit: tokio::sync::oneshot::Receiver<Result<i64, DriverError>>,
    exited: tokio::sync::watch::Receiver<bool>,
    /// Aborted when this is dropped, unless the run ended at the reply's frame (then the
    /// removal's: see [`DockerDriver::answered`]).
    watcher: Option<tokio::task::JoinHandle<()>>,
    collector: OutputCollector,
    /// The host file listing the container's processes (its cgroup's `cgroup.procs`),
    /// found when it was prepared: the liveness check reads it instead of asking the engine.
    procs: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for DockerStarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerStarted")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Drop for DockerStarted {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
    }
}

impl DockerStarted {
    /// Writes the turn and closes stdin while reading the output (a guest that floods
    /// stdout without reading stdin cannot deadlock the exchange), until the reply's frame
    /// is complete (returned at once, the container still running) or the exit.
    async fn run_inner(
        mut self,
        stdin: Vec<u8>,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, DriverError> {
        let (driver, docker) = (self.driver.clone(), self.docker.clone());
        let name = self.name.clone();
        let name = name.as_str();
        let mut input = std::mem::replace(&mut self.input, Box::pin(tokio::io::sink()));
        let write = async {
            input.write_all(&stdin).await?;
            input.flush().await?;
            input.shutdown().await
        };
        tokio::pin!(write);
        let mut written = false;

        // Keep reading while a kill is under way: a daemon whose attach copier is blocked
        // on a full pipe does not answer the kill.
        let mut out = std::mem::replace(&mut self.collector, OutputCollector::with_caps(0, 0));
        let mut output_done = false;
        let mut exit: Option<Result<i64, DriverError>> = None;
        let mut killing = false;
        let mut cancelled = false;
        let mut give_up: Option<tokio::time::Instant> = None;
        let far = tokio::time::Instant::now() + Duration::from_secs(86400 * 365);
        while !(output_done && exit.is_some()) {
            tokio::select! {
                _ = cancel.cancelled(), if !cancelled => {
                    cancelled = true;
                    give_up = Some(tokio::time::Instant::now() + driver.options.call_timeout);
                    if !killing {
                        killing = true;
                        driver.spawn_kill(&docker, name);
                    }
                }
                r = &mut write, if !written => {
                    written = true;
                    if let Err(e) = r {
                        // A guest that exits without reading closes the pipe: judge it by its exit.
                        tracing::debug!(container = name, error = %e, "write turn to stdin");
                    }
                }
                item = self.output.next(), if !output_done => match item {
                    Some(Ok(o)) => {
                        if push(&mut out, o) && !killing {
                            killing = true;
                            driver.spawn_kill(&docker, name);
                        }
                        // The reply is known: handed over now. The exit, the rest of the
                        // output and the container are the turn's teardown's (it removes
                        // the container, killing whatever still runs).
                        if out.reply_ready() && !cancelled {
                            if let Some(w) = self.watcher.take() {
                                driver.answered.lock().unwrap().insert(
                                    name.to_owned(),
                                    Answered {
                                        exited: self.exited.clone(),
                                        watcher: w.abort_handle(),
                                    },
                                );
                            }
                            return Ok(out.finish_at_frame());
                        }
                    }
                    Some(Err(e)) => {
                        tracing::debug!(container = name, error = %e, "attach stream");
                        output_done = true;
                    }
                    None => output_done = true,
                },
                status = &mut self.exit, if exit.is_none() => {
                    exit = Some(status.unwrap_or_else(|_| Err(DriverError::Call {
                        engine: ENGINE,
                        op: "wait",
                        container: name.to_owned(),
                        status: None,
                        message: "exit watcher ended".into(),
                    })));
                    // The attach stream ends at exit; give it a moment to drain.
                    let drain = tokio::time::Instant::now() + Duration::from_secs(2);
                    give_up = Some(give_up.map_or(drain, |g| g.min(drain)));
                }
                _ = tokio::time::sleep_until(give_up.unwrap_or(far)), if give_up.is_some() => break,
            }
        }
        if cancelled {
            return Err(DriverError::Cancelled);
        }
        // The OOM flag is the turn's to ask for, only when the run did not answer.
        Ok(out.finish(exit.unwrap_or(Ok(-1))?))
    }

    async fn check_inner(&mut self) -> Result<(), DriverError> {
        let exited = |code| DriverError::Exited {
            container: self.name.clone(),
            code,
        };
        match self.exit.try_recv() {
            Ok(status) => return Err(exited(status.unwrap_or(-1))),
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => return Err(exited(-1)),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
        }
        // Processes in its cgroup: it has not exited (the kernel empties the cgroup before the
        // engine learns of an exit, and a removal deletes it). No engine call on the path of
        // a turn; anything else (no file found at preparation, empty, unreadable) asks the
        // engine.
        if let Some(procs) = &self.procs {
            if std::fs::read_to_string(procs).is_ok_and(|t| t.lines().any(|l| !l.trim().is_empty()))
            {
                return Ok(());
            }
        }
        let state = self
            .driver
            .call(
                "inspect",
                &self.name,
                self.docker.inspect_container(&self.name, None),
            )
            .await?
            .state
            .unwrap_or_default();
        if state.running != Some(true) {
            return Err(exited(state.exit_code.unwrap_or(-1)));
        }
        Ok(())
    }
}

impl StartedContainer for DockerStarted {
    fn name(&self) -> &str {
        &self.name
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), DriverError>> {
        Box::pin(self.check_inner())
    }

    fn run(
        self: Box<Self>,
        stdin: Vec<u8>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<RunOutcome, DriverError>> {
        Box::pin(self.run_inner(stdin, cancel))
    }
}

/// Feeds one attach frame to the collector; returns true when stdout has just passed its cap.
fn push(out: &mut OutputCollector, frame: LogOutput) -> bool {
    match frame {
        LogOutput::StdOut { message } | LogOutput::Console { message } => out.stdout(&message),
        LogOutput::StdErr { message } => {
            out.stderr(&message);
            false
        }
        LogOutput::StdIn { .. } => false,
    }
}

impl Default for DockerDriver {
    fn default() -> Self {
        Self::new(DockerOptions::default())
    }
}

/// Removes the container when a run's future is dropped before it finished.
struct RemoveGuard<'a> {
    driver: &'a DockerDriver,
    name: &'a str,
    armed: bool,
}

impl Drop for RemoveGuard<'_> {
    fn drop(&mut self) {
        if !self.armed || keep_containers() {
            return;
        }
        let driver = self.driver.clone();
        let name = self.name.to_owned();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = driver.remove_inner(&name).await {
                    tracing::warn!(container = %name, error = %e, "remove after abandoned run");
                }
            });
        }
    }
}

fn keep_containers() -> bool {
    std::env::var(KEEP_CONTAINERS_ENV).is_ok_and(|v| v == "1")
}

impl DockerDriver {
    /// Names of containers whose removal failed and is still to be retried.
    pub(crate) fn removals_to_retry(&self) -> Vec<String> {
        self.pending_removal
            .lock()
            .unwrap()
            .iter()
            .cloned()
            .collect()
    }

    /// Retries every removal that failed before (kept for later if it fails again).
    async fn retry_pending_removals(&self) {
        for name in self.removals_to_retry() {
            match self.remove_inner(&name).await {
                Ok(()) => tracing::info!(container = %name, "removed after an earlier failure"),
                Err(e) => tracing::debug!(container = %name, error = %e, "removal retry"),
            }
        }
    }

    async fn remove_inner(&self, name: &str) -> Result<(), DriverError> {
        let answered = self.answered.lock().unwrap().remove(name);
        if let Some(mut a) = answered {
            let _ = tokio::time::timeout(EXIT_GRACE, a.exited.wait_for(|e| *e)).await;
            a.watcher.abort();
        }
        self.process_files.lock().unwrap().remove(name);
        self.sandboxed.lock().unwrap().remove(name);
        let result = self.remove_once(name).await;
        let mut pending = self.pending_removal.lock().unwrap();
        match &result {
            Ok(()) => {
                pending.remove(name);
            }
            Err(_) => {
                pending.insert(name.to_owned());
            }
        }
        result
    }

    async fn remove_once(&self, name: &str) -> Result<(), DriverError> {
        if keep_containers() {
            tracing::warn!(container = name, "{KEEP_CONTAINERS_ENV}=1: container kept");
            return Ok(());
        }
        // Without a connection this driver never created anything: nothing to remove.
        let Some(docker) = self.docker.get() else {
            return Ok(());
        };
        let opts = RemoveContainerOptionsBuilder::new()
            .force(true)
            .v(true)
            .build();
        // A turn answered at its reply's frame removes a container that may be exiting on
        // its own at that very moment: the engine's forced removal then fails in its kill
        // step ("Could not kill running container …, cannot remove - Container … is not
        // running", 409). It has exited by then: removed again, it goes.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self
                .call(
                    "remove",
                    name,
                    docker.remove_container(name, Some(opts.clone())),
                )
                .await
            {
                Ok(()) => return Ok(()),
                Err(DriverError::Call {
                    status, message, ..
                }) if status == Some(404) || message.contains("is already in progress") => {
                    return Ok(())
                }
                Err(DriverError::Call {
                    status: Some(409),
                    message,
                    ..
                }) if attempts < 5 && message.contains("is not running") => {
                    tracing::debug!(
                        container = name,
                        "removal raced the container's exit; again"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl ContainerDriver for DockerDriver {
    fn run<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        stdin: &'a [u8],
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, DriverError>> {
        Box::pin(async move {
            let mut guard = RemoveGuard {
                driver: self,
                name: &spec.name,
                armed: true,
            };
            // The cold path: prepare and run at once.
            let result = match self.start_inner(spec, cancel.clone()).await {
                Ok(started) => started.run_inner(stdin.to_vec(), cancel).await,
                Err(e) => Err(e),
            };
            // Finished: removal is now the caller's teardown.
            guard.armed = false;
            result
        })
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(self.remove_inner(name))
    }

    /// Inspects: the engine sets the flag when the container's cgroup saw an OOM kill.
    fn oom_killed<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, DriverError>> {
        Box::pin(async move {
            let docker = self.engine().await?;
            // The engine may record an OOM kill a while after the exit (seen under gVisor:
            // exit 137, `OOMKilled` still false at the first inspect; under load, still false
            // 600 ms later), and may not have seen the exit yet when the caller has (an MCP
            // session's stdio closed by the kill: still `running`). A container that ended by
            // SIGKILL, or still runs, is asked again, 150 ms apart, for up to 3 s; any other
            // end (a guest that went on after a child's kill and ended by itself) once more
            // after 150 ms. The engine may also lose the flag for good while it did see the
            // kill (its `oom` event handled before the exit, which then clears the flag: seen
            // 1 in 40 containers started 10 at once, and once in CI for a child's kill in a
            // guest that exited 0): an ended container's event log has the last word. Only a
            // turn that did not answer asks (its failure path).
            let asked = std::time::Instant::now();
            loop {
                let state = self
                    .call("inspect", name, docker.inspect_container(name, None))
                    .await?
                    .state
                    .unwrap_or_default();
                if state.oom_killed == Some(true) {
                    return Ok(true);
                }
                let running = state.running == Some(true);
                let killed = state.exit_code == Some(128 + libc::SIGKILL as i64);
                let within = if running || killed {
                    OOM_ASK_WITHIN
                } else {
                    OOM_ASK_PAUSE
                };
                if asked.elapsed() >= within {
                    return Ok(!running && self.oom_event_logged(docker, name).await);
                }
                tokio::time::sleep(OOM_ASK_PAUSE).await;
            }
        })
    }

    fn prepares(&self) -> bool {
        true
    }

    fn start<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Box<dyn StartedContainer>, DriverError>> {
        Box::pin(async move {
            let mut guard = RemoveGuard {
                driver: self,
                name: &spec.name,
                armed: true,
            };
            let result = self.start_inner(spec, cancel).await;
            // Started or failed: removal is now the caller's.
            guard.armed = false;
            let mut started = result?;
            // Found now, off the turn's path, for its liveness check (and the quota's watcher).
            started.procs = match self.process_source(&spec.name).await {
                Ok(source) => source.and_then(|s| s.procs),
                Err(e) => {
                    tracing::debug!(container = %spec.name, error = %e, "find the container's cgroup");
                    None
                }
            };
            Ok(Box::new(started) as Box<dyn StartedContainer>)
        })
    }

    fn processes<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ContainerProcesses, DriverError>> {
        Box::pin(async move {
            let Some(source) = self.process_source(name).await? else {
                return Ok(ContainerProcesses::default());
            };
            let pids = match &source.procs {
                Some(file) => match std::fs::read_to_string(file) {
                    Ok(text) => text.lines().filter_map(|l| l.trim().parse().ok()).collect(),
                    // The cgroup is gone: the container has stopped.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                    Err(e) => {
                        return Err(DriverError::Call {
                            engine: ENGINE,
                            op: "list processes",
                            container: name.to_owned(),
                            status: None,
                            message: format!("read {}: {e}", file.display()),
                        })
                    }
                },
                None => {
                    let docker = self.engine().await?;
                    let top = match self
                        .call("top", name, docker.top_processes(name, None))
                        .await
                    {
                        Ok(t) => t,
                        // Not running (yet, or any more).
                        Err(e) if matches!(e.status(), Some(404 | 409)) => {
                            return Ok(ContainerProcesses::default())
                        }
                        Err(e) => return Err(e),
                    };
                    let column = top
                        .titles
                        .unwrap_or_default()
                        .iter()
                        .position(|t| t == "PID");
                    match column {
                        Some(c) => top
                            .processes
                            .unwrap_or_default()
                            .iter()
                            .filter_map(|row| row.get(c).and_then(|p| p.parse().ok()))
                            .collect(),
                        None => Vec::new(),
                    }
                }
            };
            Ok(ContainerProcesses {
                pids,
                cgroup_marker: Some(source.id),
            })
        })
    }

    fn held_files<'a>(&'a self, name: &'a str) -> BoxFuture<'a, HeldFiles> {
        Box::pin(async move {
            let sandboxed = self.sandboxed.lock().unwrap().get(name).cloned();
            match sandboxed {
                Some(sandboxed) => self.held_files_inside(name, &sandboxed).await,
                // runc: the guest's processes are host processes; the host stats them.
                None => super::held_by_host_processes(self.processes(name).await),
            }
        })
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
        Box::pin(async move {
            let instance = scope.instance;
            let docker = self.engine().await?;
            self.retry_pending_removals().await;
            let filters: HashMap<&str, Vec<String>> =
                HashMap::from([("label", vec![format!("{LABEL_RUNTIME}={instance}")])]);
            let list = ListContainersOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build();
            let found = self
                .call("list", instance, docker.list_containers(Some(list)))
                .await?;
            let mut removed = Vec::new();
            let mut first_error = None;
            for c in found {
                let Some(id) = c.id else { continue };
                let name = c
                    .names
                    .and_then(|n| n.into_iter().next())
                    .map(|n| n.trim_start_matches('/').to_owned())
                    .unwrap_or_else(|| id.clone());
                // An MCP session's container is the broker's: its pool sweeps it at startup.
                if c.labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key(crate::broker::LABEL_MCP))
                {
                    continue;
                }
                // Asked after the listing: a turn registers before it creates its container.
                if (scope.live)(&name) {
                    tracing::debug!(container = %name, "sweep: a live turn's, kept");
                    continue;
                }
                let run_dir = c.mounts.unwrap_or_default().into_iter().find_map(|m| {
                    (m.destination.as_deref() == Some(RUN_MOUNT))
                        .then_some(m.source)
                        .flatten()
                });
                if !run_dir.is_some_and(|d| std::path::Path::new(&d).starts_with(scope.run_root)) {
                    tracing::warn!(
                        container = %name,
                        "sweep: labelled with this instance but its run dir is not under this run root (another runtime's), kept"
                    );
                    continue;
                }
                match self.remove_inner(&id).await {
                    Ok(()) => removed.push(name),
                    Err(e) => {
                        tracing::warn!(container = %name, error = %e, "sweep");
                        first_error.get_or_insert(e);
                    }
                }
            }
            match first_error {
                Some(e) if removed.is_empty() => Err(e),
                _ => Ok(removed),
            }
        })
    }
}

/// What the kernel's OOM killer adds to a guest's badness: the most (1000), so under host
/// memory pressure a guest is picked before the service or anything else on the host.
/// Raising one's own score needs no privilege, so the engine accepts it from any caller.
pub const GUEST_OOM_SCORE_ADJ: i64 = 1000;

/// The sealed container: no network, read-only root, no capabilities, no new privileges,
/// an init process, caps on memory (no swap), cpu, pids, /tmp and file size, no core
/// dumps, first in line for the host's OOM killer; only the two mounts.
pub fn create_body(spec: &ContainerSpec) -> ContainerCreateBody {
    let memory = (spec.memory_mb as i64) * 1024 * 1024;
    let file_size = (spec.file_size_mb as i64).saturating_mul(1024 * 1024);
    let bind = |source: &std::path::Path, target: &str, read_only: bool| Mount {
        target: Some(target.to_owned()),
        source: Some(source.to_string_lossy().into_owned()),
        typ: Some(MountType::BIND),
        read_only: Some(read_only),
        bind_options: Some(MountBindOptions {
            propagation: Some(MountBindOptionsPropagationEnum::RPRIVATE),
            ..Default::default()
        }),
        ..Default::default()
    };
    let host_config = HostConfig {
        network_mode: Some("none".into()),
        readonly_rootfs: Some(true),
        cap_drop: Some(vec!["ALL".into()]),
        security_opt: Some(vec!["no-new-privileges:true".into()]),
        memory: Some(memory),
        memory_swap: Some(memory),
        nano_cpus: Some((spec.cpus * 1e9) as i64),
        pids_limit: Some(spec.pids),
        oom_score_adj: Some(GUEST_OOM_SCORE_ADJ),
        init: Some(true),
        ipc_mode: Some("private".into()),
        tmpfs: Some(HashMap::from([(
            "/tmp".to_owned(),
            format!("rw,nosuid,nodev,size={}m,mode=1777", spec.tmpfs_mb),
        )])),
        mounts: Some(vec![
            bind(&spec.run_dir, RUN_MOUNT, true),
            bind(&spec.workspace_dir, WORKSPACE_MOUNT, false),
        ]),
        ulimits: Some(vec![
            ResourcesUlimits {
                name: Some("nofile".into()),
                soft: Some(1024),
                hard: Some(1024),
            },
            // No core dump: a crashing guest hands nothing to the host's core handler
            // (`core_pattern` may pipe to a host program) and writes nothing to the workspace.
            ResourcesUlimits {
                name: Some("core".into()),
                soft: Some(0),
                hard: Some(0),
            },
            // No file may grow past the workspace quota (bytes; see crate::quota).
            ResourcesUlimits {
                name: Some("fsize".into()),
                soft: Some(file_size),
                hard: Some(file_size),
            },
        ]),
        // Output goes through attach only; nothing is stored by the daemon.
        log_config: Some(HostConfigLogConfig {
            typ: Some("none".into()),
            config: None,
        }),
        auto_remove: Some(false),
        // `None`: the engine's default (runc); `runsc`: gVisor (docs/security.md#gvisor).
        runtime: spec.runtime.clone(),
        ..Default::default()
    };
    let mut host_config = host_config;
    if spec.runtime.as_deref() == Some(crate::driver::GVISOR_RUNTIME) {
        adapt_to_gvisor(&mut host_config, spec.pids);
    }
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        user: Some(format!("{}:{}", spec.uid, spec.gid)),
        entrypoint: spec.command.clone(),
        cmd: None,
        env: Some(vec!["PATH=/bin".into(), format!("HOME={WORKSPACE_MOUNT}")]),
        working_dir: Some(WORKSPACE_MOUNT.into()),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        open_stdin: Some(true),
        stdin_once: Some(true),
        tty: Some(false),
        network_disabled: Some(true),
        labels: Some(spec.labels.clone().into_iter().collect()),
        host_config: Some(host_config),
        ..Default::default()
    }
}

/// The most time one count inside a sandbox may take (exec create, start, output, inspect):
/// past it the count failed (the guest may have stopped or starved the measurer).
pub const HELD_FILES_TIMEOUT: Duration = Duration::from_secs(5);

impl DockerDriver {
    /// Counts inside the sandbox what the container's processes hold open with no name
    /// left: an exec of the guest program's measurer (`--held-files`) as the container's
    /// own user, no tty, no stdin, stdout capped and parsed strictly, under
    /// [`HELD_FILES_TIMEOUT`]. Any failure is [`HeldFiles::Unmeasurable`].
    async fn held_files_inside(&self, name: &str, sandboxed: &Sandboxed) -> HeldFiles {
        let started = std::time::Instant::now();
        let measure = self.exec_measurer(name, sandboxed);
        let held = match tokio::time::timeout(HELD_FILES_TIMEOUT, measure).await {
            Ok(Ok(held)) => held,
            Ok(Err(why)) => HeldFiles::Unmeasurable(Unmeasurable::Measurer(why)),
            Err(_) => HeldFiles::Unmeasurable(Unmeasurable::Measurer(format!(
                "no report within {HELD_FILES_TIMEOUT:?}"
            ))),
        };
        tracing::debug!(container = name, took = ?started.elapsed(), ?held, "held files counted inside");
        held
    }

    /// Whether the engine's event log holds an `oom` event of container `name` in the last
    /// ten minutes (the log is bounded and in memory: an older one is gone). Any failure is
    /// "no".
    async fn oom_event_logged(&self, docker: &Docker, name: &str) -> bool {
        use bollard::query_parameters::EventsOptionsBuilder;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // Up to now, to the nanosecond: the engine answers from its log at once (an `until`
        // in the future held the stream open until then, up to a second).
        let until = format!("{}.{:09}", now.as_secs(), now.subsec_nanos());
        let filters: HashMap<&str, Vec<&str>> = HashMap::from([
            ("type", vec!["container"]),
            ("event", vec!["oom"]),
            ("container", vec![name]),
        ]);
        let options = EventsOptionsBuilder::new()
            .since(&now.as_secs().saturating_sub(600).to_string())
            .until(&until)
            .filters(&filters)
            .build();
        let events = docker.events(Some(options)).take(16).collect::<Vec<_>>();
        match tokio::time::timeout(self.options.call_timeout, events).await {
            Ok(events) => events
                .iter()
                .any(|e| e.as_ref().is_ok_and(|e| e.action.as_deref() == Some("oom"))),
            Err(_) => false,
        }
    }

    async fn exec_measurer(&self, name: &str, sandboxed: &Sandboxed) -> Result<HeldFiles, String> {
        use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
        use roundtable_sandbox_protocol::held::{
            HeldReport, GUEST_PROGRAM, HELD_FILES_ARG, MAX_OUTPUT,
        };
        let docker = self
            .engine()
            .await
            .map_err(|_| "the engine cannot be reached".to_owned())?;
        let options = CreateExecOptions {
            attach_stdin: Some(false),
            attach_stdout: Some(true),
            attach_stderr: Some(false),
            tty: Some(false),
            privileged: Some(false),
            user: Some(sandboxed.user.as_str()),
            working_dir: Some("/"),
            env: Some(vec!["PATH=/bin"]),
            cmd: Some(vec![GUEST_PROGRAM, HELD_FILES_ARG, sandboxed.dir]),
            detach_keys: None,
        };
        let exec = match docker.create_exec(name, options).await {
            Ok(e) => e,
            Err(e) => {
                return match classify("exec", name, e).status() {
                    // Not running (yet, or any more): no process holds anything.
                    Some(404 | 409) => Ok(HeldFiles::Counted { files: 0, bytes: 0 }),
                    status => Err(format!("the engine refused the exec ({status:?})")),
                };
            }
        };
        let start = StartExecOptions {
            detach: false,
            tty: false,
            output_capacity: None,
        };
        let mut output = match docker.start_exec(&exec.id, Some(start)).await {
            Ok(StartExecResults::Attached { output, .. }) => output,
            Ok(StartExecResults::Detached) => return Err("the exec was detached".into()),
            Err(e) => {
                let status = classify("exec start", name, e).status();
                return Err(format!("the engine could not start the exec ({status:?})"));
            }
        };
        let mut out = Vec::new();
        while let Some(frame) = output.next().await {
            match frame {
                Ok(LogOutput::StdOut { message }) => {
                    if out.len() + message.len() > MAX_OUTPUT {
                        return Err("the measurer printed more than a report".into());
                    }
                    out.extend_from_slice(&message);
                }
                Ok(_) => {}
                Err(_) => return Err("the measurer's output stream failed".into()),
            }
        }
        // The stream ends with the measurer's stdout; its exit may be recorded a moment later.
        loop {
            let inspected = docker
                .inspect_exec(&exec.id)
                .await
                .map_err(|_| "the engine could not inspect the exec".to_owned())?;
            match (inspected.running, inspected.exit_code) {
                (Some(true), _) => tokio::time::sleep(Duration::from_millis(5)).await,
                (Some(false), Some(0)) => break,
                (_, code) => return Err(format!("the measurer ended with {code:?}")),
            }
        }
        match HeldReport::parse(&out) {
            Some(HeldReport::Counted { files, bytes }) => Ok(HeldFiles::Counted { files, bytes }),
            Some(HeldReport::HiddenDescriptors) => {
                Ok(HeldFiles::Unmeasurable(Unmeasurable::HiddenDescriptors))
            }
            Some(HeldReport::MappedDeleted) => {
                Ok(HeldFiles::Unmeasurable(Unmeasurable::MappedDeleted))
            }
            None => Err("the measurer's report is not one".into()),
        }
    }
}

/// The `cgroup.procs` file of container `id`'s cgroup where the engine's two cgroup
/// drivers put it (v1: the `pids` hierarchy; v2: the unified one; `cgroupfs`:
/// `docker/<id>`; `systemd`: `system.slice/docker-<id>.scope`), if it lists a process (the
/// container has started: its init is in it). A container started with another cgroup
/// parent is found by its init's `/proc/<pid>/cgroup` instead ([`cgroup_procs_file`]).
/// The names are the engine's: a guest cannot make a cgroup on the host's hierarchy.
fn cgroup_procs_by_id(id: &str) -> Option<std::path::PathBuf> {
    if id.len() != 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    [
        format!("/sys/fs/cgroup/pids/docker/{id}"),
        format!("/sys/fs/cgroup/pids/system.slice/docker-{id}.scope"),
        format!("/sys/fs/cgroup/docker/{id}"),
        format!("/sys/fs/cgroup/system.slice/docker-{id}.scope"),
    ]
    .into_iter()
    .map(|dir| std::path::PathBuf::from(dir).join("cgroup.procs"))
    .find(|procs| {
        std::fs::read_to_string(procs).is_ok_and(|t| t.lines().any(|l| !l.trim().is_empty()))
    })
}

/// The `cgroup.procs` file of the cgroup that `/proc/<pid>/cgroup` (its `text`) names, if
/// that cgroup belongs to container `id`: the v1 `pids` (or `memory`) hierarchy, else the
/// unified (v2) one.
fn cgroup_procs_file(text: &str, id: &str) -> Option<std::path::PathBuf> {
    let mut unified = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if !path.contains(id) {
            continue;
        }
        for c in ["pids", "memory"] {
            if controllers.split(',').any(|x| x == c) {
                return Some(format!("/sys/fs/cgroup/{c}{path}/cgroup.procs").into());
            }
        }
        if controllers.is_empty() {
            unified = Some(format!("/sys/fs/cgroup{path}/cgroup.procs").into());
        }
    }
    unified
}

/// Host tasks of an idle gVisor sandbox (Sentry, gofer, their Go threads; measured 56
/// with three guest processes) and what each guest task adds (a ptrace stub process and
/// its threads; measured 7 to 8, 220 host tasks with 24 guest tasks), with room for the
/// transient ones: past the host limit the Sentry itself cannot make a thread and dies.
/// See docs/security.md#gvisor.
pub const GVISOR_HOST_TASKS_BASE: i64 = 96;
/// What each guest task adds to the host pids limit under gVisor (see above).
pub const GVISOR_HOST_TASKS_PER_GUEST_TASK: i64 = 12;

/// Under gVisor the container's pids cgroup counts the sandbox's own host tasks, not the
/// guest's: with the guest's limit the sandbox cannot even start, and a few guest
/// processes later it dies. So the limit moves inside, where it means the same thing: the
/// Sentry enforces `RLIMIT_NPROC` = `pids` on the guest's tasks (sandbox-local: under runc
/// it would count the service user's processes on the whole host, so it is set only here);
/// the host cgroup keeps a bound on the sandbox itself, sized for that many guest tasks.
fn adapt_to_gvisor(host_config: &mut HostConfig, pids: i64) {
    host_config.pids_limit = Some(GVISOR_HOST_TASKS_BASE + GVISOR_HOST_TASKS_PER_GUEST_TASK * pids);
    host_config
        .ulimits
        .get_or_insert_with(Vec::new)
        .push(ResourcesUlimits {
            name: Some("nproc".into()),
            soft: Some(pids),
            hard: Some(pids),
        });
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

#[cfg(test)]
mod tests {
    use super::cgroup_procs_file;

    #[test]
    fn the_process_list_is_the_containers_own_cgroup() {
        let id = "84943c269f3ef7af2bf81502155f4afdca0539d50a6cad224950af1175cae4f9";
        let v1 = format!(
            "9:name=systemd:/docker/{id}\n8:pids:/docker/{id}\n4:memory:/docker/{id}\n0::/docker/{id}\n"
        );
        assert_eq!(
            cgroup_procs_file(&v1, id),
            Some(format!("/sys/fs/cgroup/pids/docker/{id}/cgroup.procs").into())
        );
        let v2 = format!("0::/system.slice/docker-{id}.scope\n");
        assert_eq!(
            cgroup_procs_file(&v2, id),
            Some(format!("/sys/fs/cgroup/system.slice/docker-{id}.scope/cgroup.procs").into())
        );
        // Another container's (or the host's) cgroup is never taken.
        assert_eq!(cgroup_procs_file("8:pids:/docker/other\n0::/\n", id), None);
    }
}
