//! The processes of a running container and the files they hold open with no name left:
//! host processes under runc (listed from the container's cgroup, or the engine's `top`),
//! counted inside the sandbox under gVisor (an exec of the guest program's measurer).

use super::*;

/// The most time one count inside a sandbox may take (exec create, start, output, inspect):
/// past it the count failed (the guest may have stopped or starved the measurer).
pub const HELD_FILES_TIMEOUT: Duration = Duration::from_secs(5);

impl DockerDriver {
    /// Finds where the named container's processes are listed: its init's cgroup (from
    /// `/proc/<pid>/cgroup`, which must name the container's id), or the engine's `top`.
    pub(super) async fn process_source(
        &self,
        name: &str,
    ) -> Result<Option<ProcessSource>, DriverError> {
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

    /// The host pids of the container's processes (see [`ContainerDriver::processes`]).
    pub(super) async fn processes_inner(
        &self,
        name: &str,
    ) -> Result<ContainerProcesses, DriverError> {
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
    }

    /// What the container's processes hold (see [`ContainerDriver::held_files`]).
    pub(super) async fn held_files_of(&self, name: &str) -> HeldFiles {
        let sandboxed = self.sandboxed.lock().unwrap().get(name).cloned();
        match sandboxed {
            Some(sandboxed) => self.held_files_inside(name, &sandboxed).await,
            // runc: the guest's processes are host processes; the host stats them.
            None => crate::driver::held_by_host_processes(self.processes(name).await),
        }
    }

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
            cmd: Some(vec![GUEST_PROGRAM, HELD_FILES_ARG, &sandboxed.dir]),
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
pub(super) fn cgroup_procs_by_id(id: &str) -> Option<std::path::PathBuf> {
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
