//! A container's life after its start: removal (retried before the next run or sweep when
//! the engine failed it), the OOM question, the sweep of what a crashed runtime left, and
//! the listing of containers by label.

use super::*;
use crate::driver::LabelledContainer;

/// A removal's options: forced (killed first) and with its anonymous volumes.
pub(super) fn remove_options() -> bollard::query_parameters::RemoveContainerOptions {
    RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build()
}

/// How long a start retries earlier failed removals before its own create.
const RETRY_BUDGET: Duration = Duration::from_secs(1);

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

    /// Retries every removal that failed before (kept for later if it fails again), for
    /// [`RETRY_BUDGET`] at most: with the engine hung, each took up to the call timeout, and
    /// the k-th start of an outage waited k of them before its own create. What is left is
    /// retried next time, and by the sweep.
    pub(super) async fn retry_pending_removals(&self) {
        let retries = async {
            for name in self.removals_to_retry() {
                match self.remove_inner(&name).await {
                    Ok(()) => {
                        tracing::info!(container = %name, "removed after an earlier failure")
                    }
                    Err(e) => tracing::debug!(container = %name, error = %e, "removal retry"),
                }
            }
        };
        let _ = tokio::time::timeout(RETRY_BUDGET, retries).await;
    }

    pub(super) async fn remove_inner(&self, name: &str) -> Result<(), DriverError> {
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
        let opts = remove_options();
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

    pub(super) async fn oom_killed_inner(&self, name: &str) -> Result<bool, DriverError> {
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
    }

    /// Removes this instance's leftover turn containers (see [`ContainerDriver::sweep`]).
    pub(super) async fn sweep_inner(
        &self,
        scope: SweepScope<'_>,
    ) -> Result<Vec<String>, DriverError> {
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
            let name = first_name(c.names).unwrap_or_else(|| id.clone());
            // An MCP session's container is the broker's: its pool sweeps it at startup.
            if c.labels
                .as_ref()
                .is_some_and(|l| l.contains_key(crate::driver::LABEL_MCP))
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
        removed.extend(self.sweep_reads(docker, READ_ORPHANED_AFTER).await);
        match first_error {
            Some(e) if removed.is_empty() => Err(e),
            _ => Ok(removed),
        }
    }

    /// Removes the never-started containers an image's file was read from
    /// ([`LABEL_READ`]) that are at least `after` old, whatever their instance: a crash
    /// between their creation and their removal left them. A failure is logged (the next
    /// sweep tries again); returns the names removed.
    pub(super) async fn sweep_reads(&self, docker: &Docker, after: Duration) -> Vec<String> {
        let filters: HashMap<&str, Vec<String>> = HashMap::from([
            ("label", vec![LABEL_READ.to_owned()]),
            ("status", vec!["created".to_owned()]),
        ]);
        let list = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let found = match self
            .call("list", LABEL_READ, docker.list_containers(Some(list)))
            .await
        {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "sweep: list the image-read containers");
                return Vec::new();
            }
        };
        let now = since_epoch().as_secs();
        let mut removed = Vec::new();
        for c in found {
            let Some(id) = c.id else { continue };
            let made = c
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_READ))
                .and_then(|v| v.parse::<u64>().ok());
            // A value that is not a time is no read of ours in progress: removed too.
            if made.is_some_and(|made| now.saturating_sub(made) < after.as_secs()) {
                continue;
            }
            let name = first_name(c.names).unwrap_or_else(|| id.clone());
            match self.remove_inner(&id).await {
                Ok(()) => removed.push(name),
                Err(e) => {
                    tracing::warn!(container = %name, error = %e, "sweep: an image-read container")
                }
            }
        }
        removed
    }

    /// Whether the engine's event log holds an `oom` event of container `name` in the last
    /// ten minutes (the log is bounded and in memory: an older one is gone). Any failure is
    /// "no".
    async fn oom_event_logged(&self, docker: &Docker, name: &str) -> bool {
        use bollard::query_parameters::EventsOptionsBuilder;
        let now = since_epoch();
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

    /// Pauses the named container (see [`ContainerDriver::pause`]).
    pub(super) async fn pause_inner(&self, name: &str) -> Result<(), DriverError> {
        let docker = self.engine().await?;
        self.call("pause", name, docker.pause_container(name)).await
    }

    /// Unpauses the named container (see [`ContainerDriver::resume`]).
    pub(super) async fn resume_inner(&self, name: &str) -> Result<(), DriverError> {
        let docker = self.engine().await?;
        self.call("unpause", name, docker.unpause_container(name))
            .await
    }

    /// Every container carrying all of `labels` (see [`ContainerDriver::list_labelled`]).
    pub(super) async fn list_labelled_inner(
        &self,
        labels: &[String],
    ) -> Result<Vec<LabelledContainer>, DriverError> {
        let docker = self.engine().await?;
        let filters: HashMap<&str, Vec<String>> = HashMap::from([("label", labels.to_vec())]);
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
                let name = first_name(c.names).or(c.id)?;
                let mounts = c
                    .mounts
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|m| Some((m.destination?, m.source?)))
                    .collect();
                Some(LabelledContainer { name, mounts })
            })
            .collect())
    }
}

/// A container's first name as the engine lists it (without its leading `/`).
fn first_name(names: Option<Vec<String>>) -> Option<String> {
    names
        .and_then(|n| n.into_iter().next())
        .map(|n| n.trim_start_matches('/').to_owned())
}

/// The time since the Unix epoch (zero before it).
pub(super) fn since_epoch() -> Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}
