//! What the engine creates a container with: the sealed body of a turn's container
//! ([`create_body`]), and its sizing under gVisor.

use super::*;

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
        // An image's HEALTHCHECK is an exec the engine starts now and then, outside the
        // guest's seccomp layer: none.
        healthcheck: Some(bollard::models::HealthConfig {
            test: Some(vec!["NONE".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
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

impl DockerDriver {
    /// Creates the container `name` from `body`; returns its id. A missing image and an
    /// unknown runtime get errors of their own.
    pub(super) async fn create(
        &self,
        docker: &Docker,
        name: &str,
        body: ContainerCreateBody,
        runtime: Option<&str>,
    ) -> Result<String, DriverError> {
        let image = body.image.clone().unwrap_or_default();
        let create = CreateContainerOptionsBuilder::new().name(name).build();
        match self
            .call("create", name, docker.create_container(Some(create), body))
            .await
        {
            Ok(created) => Ok(created.id),
            Err(DriverError::Call {
                status, message, ..
            }) if status == Some(404) || message.contains("No such image") => {
                Err(DriverError::ImageMissing { image })
            }
            // "Unknown runtime specified runsc" (20.10), "unknown or invalid runtime name" (23+).
            Err(DriverError::Call { message, .. })
                if runtime.is_some() && message.to_lowercase().contains("runtime") =>
            {
                Err(DriverError::RuntimeMissing {
                    runtime: runtime.unwrap_or_default().to_owned(),
                })
            }
            Err(e @ DriverError::CallTimeout { .. }) => {
                // The engine may still make it after the call was given up: its teardown's
                // removal finds nothing (404, counted as removed) and it would stay until
                // the next start's sweep. Removed again later, when it may have appeared.
                late_removal(docker.clone(), name.to_owned());
                Err(e)
            }
            Err(e) => Err(e),
        }
    }
}

/// When a late removal of a container whose create timed out is tried: the engine that
/// was slow may make it any time after.
const LATE_REMOVALS: [Duration; 3] = [
    Duration::from_secs(10),
    Duration::from_secs(60),
    Duration::from_secs(300),
];

/// Removes `name` at each of [`LATE_REMOVALS`] (a task of its own; nothing waits for it).
fn late_removal(docker: Docker, name: String) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    handle.spawn(async move {
        let opts = lifecycle::remove_options();
        let mut waited = Duration::ZERO;
        for at in LATE_REMOVALS {
            tokio::time::sleep(at - waited).await;
            waited = at;
            let removal = docker.remove_container(&name, Some(opts.clone()));
            if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(10), removal).await {
                tracing::info!(container = %name, "removed a container made after its create timed out");
            }
        }
    });
}

/// A session's container ([`crate::driver::SessionSpec`]): the body of a turn's
/// ([`create_body`]: its caps, no capabilities, read-only root, an init, no core dumps, the
/// OOM killer's first pick, gVisor's sizing), with the session's argv, environment, working
/// directory and only its own mounts, no supplementary group, its stdin kept open, and the
/// engine's default network only when asked.
pub(super) fn session_body(
    spec: &crate::driver::SessionSpec,
    image_volumes: &[String],
) -> ContainerCreateBody {
    let (entrypoint, cmd) = match spec.argv.split_first() {
        Some((program, args)) => (vec![program.clone()], args.to_vec()),
        None => (Vec::new(), Vec::new()),
    };
    let turn = ContainerSpec {
        name: spec.name.clone(),
        image: spec.image.clone(),
        run_dir: Default::default(),
        workspace_dir: Default::default(),
        uid: spec.uid,
        gid: spec.gid,
        memory_mb: spec.memory_mb,
        cpus: spec.cpus,
        pids: spec.pids,
        tmpfs_mb: spec.tmpfs_mb,
        file_size_mb: spec.file_size_mb,
        output_cap: 0,
        stderr_cap: 0,
        labels: spec.labels.clone(),
        command: Some(entrypoint),
        runtime: spec.runtime.clone(),
    };
    let mut body = create_body(&turn);
    body.cmd = Some(cmd);
    body.stdin_once = Some(false);
    body.working_dir = Some(spec.working_dir.clone());
    body.env = Some(spec.env.clone());
    if let Some(host) = body.host_config.as_mut() {
        host.mounts = Some(
            spec.mounts
                .iter()
                .map(|m| bind(&m.source, &m.target, m.read_only))
                .collect(),
        );
        host.group_add = None;
        // An image's `VOLUME` is an anonymous volume the engine makes writable under a
        // read-only root: storage outside the data quota and the floor. A tmpfs of the
        // session's size over each (its pages count against the memory cap) instead.
        let tmpfs = host.tmpfs.get_or_insert_with(HashMap::new);
        for path in image_volumes {
            tmpfs
                .entry(path.clone())
                .or_insert_with(|| format!("rw,nosuid,nodev,size={}m,mode=1777", spec.tmpfs_mb));
        }
        if spec.network {
            host.network_mode = Some("bridge".into());
        }
    }
    if spec.network {
        body.network_disabled = Some(false);
    }
    body
}

/// A private bind mount of `source` at `target`.
fn bind(source: &std::path::Path, target: &str, read_only: bool) -> Mount {
    Mount {
        target: Some(target.to_owned()),
        source: Some(source.to_string_lossy().into_owned()),
        typ: Some(MountType::BIND),
        read_only: Some(read_only),
        bind_options: Some(MountBindOptions {
            propagation: Some(MountBindOptionsPropagationEnum::RPRIVATE),
            ..Default::default()
        }),
        ..Default::default()
    }
}
