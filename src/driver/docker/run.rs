//! A turn's container on the engine: created, attached and started ([`DockerDriver::start_inner`]),
//! then run ([`DockerStarted`]: the turn written, the output collected under its caps, until
//! the reply's frame or the exit), cold (at once) or prepared (started before its turn).

use super::*;

impl DockerDriver {
    /// The cold path: prepare and run at once; removed by a guard if dropped half-way.
    pub(super) async fn run_cold(
        &self,
        spec: &ContainerSpec,
        stdin: &[u8],
        cancel: CancellationToken,
    ) -> Result<RunOutcome, DriverError> {
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
    }

    /// A container prepared before its turn (its guest waits on stdin).
    pub(super) async fn start_prepared(
        &self,
        spec: &ContainerSpec,
        cancel: CancellationToken,
    ) -> Result<Box<dyn StartedContainer>, DriverError> {
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
        // The earlier failures' removals (within their budget), or the turn's stop.
        tokio::select! {
            _ = self.retry_pending_removals() => {}
            _ = cancel.cancelled() => return Err(DriverError::Cancelled),
        }
        let name = spec.name.as_str();
        let id = self
            .create(docker, name, create_body(spec), spec.runtime.as_deref())
            .await?;
        if spec.runtime.as_deref() == Some(crate::driver::GVISOR_RUNTIME) {
            self.sandboxed.lock().unwrap().insert(
                name.to_owned(),
                Sandboxed {
                    user: format!("{}:{}", spec.uid, spec.gid),
                    dir: WORKSPACE_MOUNT.to_owned(),
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
        if let Some(procs) = held::cgroup_procs_by_id(&id) {
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
        let (exit, exited, watcher) = self.watch_exit(docker, name);
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
    /// Watches the container's exit from now on: its status once it exits, and a flag set
    /// then (for the removal's grace), by a task whose handle is returned.
    #[allow(clippy::type_complexity)]
    fn watch_exit(
        &self,
        docker: &Docker,
        name: &str,
    ) -> (
        tokio::sync::oneshot::Receiver<Result<i64, DriverError>>,
        tokio::sync::watch::Receiver<bool>,
        tokio::task::JoinHandle<()>,
    ) {
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
        (exit, exited, watcher)
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
