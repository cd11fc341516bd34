//! Container-confined stdio MCP sessions: each session of a `confine = "container"` server
//! is its own container through the engine, hardened as a guest's (the same
//! [`create_body`]: no network, read-only root, `cap-drop ALL`, no-new-privileges, the
//! engine's default seccomp profile, memory = swap, cpus and pids caps, `/tmp` tmpfs,
//! `ulimit fsize` at the data quota, an init, first in line for the OOM killer), run as the
//! service uid:gid with no supplementary group (so not in `docker`), under the configured
//! runtime (gVisor too), labelled with the runtime instance and [`LABEL_MCP`]. Its only
//! mount is its own data dir, `<data root>/<server>/<channel hash>` (made `0700` by the
//! host), at [`DATA_MOUNT`]. Its stdio is the attach stream: stdout to rmcp, stderr lines
//! to the debug log (capped).
//!
//! The data dir is held to a quota measured as a workspace's ([`crate::quota`], by
//! descriptor, never following a link), before each call and, by a [`Watcher`] as long as
//! the session's container lives (between calls too), every
//! [`crate::quota::WATCH_INTERVAL`] with the files its processes hold open after deleting
//! them ([`crate::driver::ContainerDriver::held_files`], as a turn's); its filesystem is held
//! to the free-space floor. Past either, the watcher removes the container and the session's
//! call in flight, or else its next call, is refused with the watcher's error.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use bollard::container::LogOutput;
use bollard::models::{Mount, MountBindOptions, MountBindOptionsPropagationEnum, MountType};
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::config::McpServer;
use crate::driver::create_body;
use crate::driver::{ContainerSpec, DockerDriver, DockerOptions, LABEL_CHANNEL, LABEL_RUNTIME};
use crate::quota::{Floor, Guarded, Quota, QuotaError};

/// Label on every MCP session's container; its value is the server's name.
pub const LABEL_MCP: &str = "roundtable-sandbox.mcp";
/// Where a session's data dir is mounted in its container (read-write, its only mount).
pub const DATA_MOUNT: &str = "/data";
/// The dir name of a shared server's one data dir (a channel's is its 64-hex hash).
const SHARED_DIR: &str = "shared";
/// Stderr bytes of one session that reach the debug log; the rest is dropped.
pub(crate) const STDERR_CAP: usize = 64 * 1024;

/// The engine and identity container-confined MCP sessions run with.
#[derive(Debug, Clone)]
pub struct McpEngine {
    /// The engine's socket (`unix:///var/run/docker.sock`).
    pub docker_host: String,
    /// The runtime instance (the value of [`LABEL_RUNTIME`] on each session's container).
    pub instance: String,
    /// The service uid the sessions run as (never 0).
    pub uid: u32,
    /// The service gid; no supplementary group is given.
    pub gid: u32,
    /// The private root of the sessions' data dirs (absolute; created `0700`).
    pub data_root: PathBuf,
    /// The engine's container runtime (`runsc`: gVisor), as the guests'.
    pub runtime: Option<String>,
    /// The free space the data root's filesystem must keep.
    pub floor: Floor,
}

impl McpEngine {
    /// The engine's driver for MCP sessions.
    pub(crate) fn driver(&self) -> DockerDriver {
        DockerDriver::new(DockerOptions {
            host: self.docker_host.clone(),
            ..DockerOptions::default()
        })
    }

    /// The host path of a session's data dir (`segment` empty: the shared one).
    pub(crate) fn data_dir(&self, server: &str, segment: &str) -> PathBuf {
        let leaf = if segment.is_empty() {
            SHARED_DIR
        } else {
            segment
        };
        self.data_root.join(server).join(leaf)
    }

    /// Makes `data_root/<server>` (each `0700`); refuses a root that is a link or not a dir.
    pub(crate) fn prepare(&self, server: &str) -> Result<(), String> {
        make_private(&self.data_root)?;
        make_private(&self.data_root.join(server))
    }

    /// Removes this instance's MCP containers whose data dir lies under this data root
    /// (left by a runtime that crashed); returns their names.
    pub(crate) async fn sweep(&self, driver: &DockerDriver) -> Result<Vec<String>, String> {
        let found = driver
            .list_labelled(vec![
                format!("{LABEL_RUNTIME}={}", self.instance),
                LABEL_MCP.to_owned(),
            ])
            .await
            .map_err(|e| e.to_string())?;
        let mut removed = Vec::new();
        for (name, mounts) in found {
            let ours = mounts
                .get(DATA_MOUNT)
                .is_some_and(|src| Path::new(src).starts_with(&self.data_root));
            if !ours {
                continue;
            }
            match driver.remove_container(&name).await {
                Ok(()) => removed.push(name),
                Err(e) => tracing::warn!(container = %name, error = %e, "MCP sweep"),
            }
        }
        if !removed.is_empty() {
            tracing::info!(
                containers = removed.len(),
                "removed MCP containers left by an earlier run"
            );
        }
        Ok(removed)
    }

    /// Refuses a call when the session's data dir is over its quota (or cannot be
    /// measured), or its filesystem is below the free-space floor.
    pub(crate) fn check(&self, server: &str, data_dir: &Path, quota: &Quota) -> Result<(), String> {
        crate::quota::check_floor(
            &[Guarded {
                what: "the MCP servers' data",
                path: self.data_root.clone(),
            }],
            &self.floor,
        )
        .map_err(|e| format!("MCP server {server}: {e}"))?;
        if !data_dir.exists() {
            return Ok(());
        }
        let usage = crate::quota::measure_dir(data_dir, quota).map_err(|e| {
            format!(
                "MCP server {server}: this channel's data cannot be measured ({}); the call is refused",
                crate::one_line(&e)
            )
        })?;
        if quota.exceeded_by(&usage) {
            return Err(format!(
                "MCP server {server}: this channel's data is over its quota ({} MiB in {} entries; the limit is {} MiB in {} entries); its session is stopped and calls are refused until an operator frees space",
                usage.bytes.div_ceil(1 << 20),
                usage.entries,
                quota.max_bytes >> 20,
                quota.max_entries
            ));
        }
        Ok(())
    }
}

/// The error of a session its watcher stopped, from the quota's own.
fn watcher_error(server: &str, e: QuotaError) -> String {
    match e {
        QuotaError::Exceeded { used, held, limit } => format!(
            "MCP server {server}: this channel's data is over its quota ({used} used{held}; the limit is {limit}); its session was stopped"
        ),
        QuotaError::Measure(why) => format!(
            "MCP server {server}: this channel's data cannot be measured ({why}); its session was stopped"
        ),
        e => format!("MCP server {server}: {e}"),
    }
}

/// Watches a session's data dir for as long as its container lives ([`crate::quota::watch`]:
/// the tree by descriptor, the files the container's processes hold open with no name left,
/// the floor). Past its quota (or unmeasurable, or the floor passed) it keeps the error,
/// wakes the session's call in flight and removes the container. Stopped when dropped.
pub(crate) struct Watcher {
    task: tokio::task::JoinHandle<()>,
    tripped: tokio::sync::watch::Receiver<Option<String>>,
}

impl Watcher {
    fn start(
        engine: &McpEngine,
        driver: &DockerDriver,
        server: &str,
        data_dir: &Path,
        container: &str,
        quota: Quota,
    ) -> Result<Self, String> {
        let workspace = crate::quota::Workspace::open(data_dir).map_err(|e| {
            format!(
                "MCP server {server}: this channel's data cannot be measured (open its dir: {e})"
            )
        })?;
        let watch = crate::quota::Watch {
            workspace: std::sync::Arc::new(workspace),
            quota,
            floor: engine.floor,
            guarded: vec![Guarded {
                what: "the MCP servers' data",
                path: engine.data_root.clone(),
            }],
            driver: std::sync::Arc::new(driver.clone()),
            container: container.to_owned(),
        };
        let (tx, tripped) = tokio::sync::watch::channel(None);
        let (driver, server, name) = (driver.clone(), server.to_owned(), container.to_owned());
        let task = tokio::spawn(async move {
            let e = crate::quota::watch(watch).await;
            tracing::warn!(server = %server, "MCP session over its data quota or the floor; stopped");
            tx.send_replace(Some(watcher_error(&server, e)));
            if let Err(e) = driver.remove_container(&name).await {
                tracing::warn!(container = %name, error = %e, "remove MCP container");
            }
        });
        Ok(Self { task, tripped })
    }

    /// The error it stopped the session with, if it did.
    pub(crate) fn tripped(&self) -> Option<String> {
        self.tripped.borrow().clone()
    }

    /// Resolves with the error once it stops the session (never, while it does not).
    pub(crate) fn stopped(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        let mut rx = self.tripped.clone();
        async move {
            let got = rx.wait_for(Option::is_some).await.map(|v| v.clone());
            match got {
                Ok(v) => v.unwrap_or_default(),
                Err(_) => std::future::pending().await,
            }
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Creates `dir` `0700` if missing; refuses a link or a non-dir.
fn make_private(dir: &Path) -> Result<(), String> {
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!(
            "MCP data dir {} is not a directory (a link?)",
            dir.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .or_else(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .map_err(|e| format!("create MCP data dir {}: {e}", dir.display())),
        Err(e) => Err(format!("MCP data dir {}: {e}", dir.display())),
    }
}

/// A session's container; removed (killed first) by [`Container::remove`], or on drop.
pub(crate) struct Container {
    driver: DockerDriver,
    /// The container's name.
    pub(crate) name: String,
    /// The session's memory cap (for the out-of-memory error).
    pub(crate) memory_mb: u64,
    /// The watcher of its data dir (stopped with it).
    pub(crate) watcher: Option<Watcher>,
    removed: bool,
}

impl Container {
    /// Kills and removes the container.
    pub(crate) async fn remove(mut self) {
        self.removed = true;
        self.watcher = None;
        if let Err(e) = self.driver.remove_container(&self.name).await {
            tracing::warn!(container = %self.name, error = %e, "remove MCP container");
        }
    }

    /// Removes the container (from a task of its own) once `closed` fires: a session
    /// that ends (its server stopped, or its client stopped it at a cap) leaves no
    /// container working until its next call.
    pub(crate) fn remove_when(&self, closed: tokio_util::sync::CancellationToken) {
        let (driver, name) = (self.driver.clone(), self.name.clone());
        tokio::spawn(async move {
            closed.cancelled().await;
            if let Err(e) = driver.remove_container(&name).await {
                tracing::debug!(container = %name, error = %e, "remove MCP container");
            }
        });
    }

    /// Whether the kernel's OOM killer ended it.
    pub(crate) async fn oom_killed(&self) -> bool {
        use crate::driver::ContainerDriver;
        self.driver.oom_killed(&self.name).await.unwrap_or(false)
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let (driver, name) = (self.driver.clone(), std::mem::take(&mut self.name));
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = driver.remove_container(&name).await;
            });
        }
    }
}

/// The session's stdio as the MCP client reads and writes it.
pub(crate) type Stdio = (
    tokio::io::DuplexStream,
    Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
);

/// Starts one session's container: `command` + `args` in `config.image`, `env` its whole
/// environment (with `HOME=/data`), its data dir made first.
pub(crate) async fn start(
    engine: &McpEngine,
    driver: &DockerDriver,
    config: &McpServer,
    segment: &str,
    (command, args, env): (&str, &[String], &BTreeMap<String, String>),
) -> Result<(Container, Stdio), String> {
    let server = &config.name;
    let image = config.image.clone().unwrap_or_default();
    let data_dir = engine.data_dir(server, segment);
    engine.prepare(server)?;
    make_private(&data_dir)?;
    let tag = if segment.is_empty() {
        SHARED_DIR
    } else {
        &segment[..segment.len().min(12)]
    };
    let name = format!(
        "rtb-mcp-{server}-{tag}-{:08x}",
        uuid::Uuid::new_v4().as_u128() as u32
    );
    let limits = &config.limits;
    let mut labels = BTreeMap::from([
        (LABEL_RUNTIME.to_owned(), engine.instance.clone()),
        (LABEL_MCP.to_owned(), server.clone()),
    ]);
    if !segment.is_empty() {
        labels.insert(
            LABEL_CHANNEL.to_owned(),
            segment[..segment.len().min(16)].to_owned(),
        );
    }
    let spec = ContainerSpec {
        name: name.clone(),
        image,
        run_dir: PathBuf::new(),
        workspace_dir: PathBuf::new(),
        uid: engine.uid,
        gid: engine.gid,
        memory_mb: limits.memory_mb,
        cpus: limits.cpus,
        pids: limits.pids,
        tmpfs_mb: limits.tmpfs_mb,
        file_size_mb: limits.data_mb,
        output_cap: 0,
        stderr_cap: 0,
        labels,
        command: Some(vec![command.to_owned()]),
        runtime: engine.runtime.clone(),
    };
    // The guest's hardening, with this session's own mount, stdio and environment.
    let mut body = create_body(&spec);
    body.cmd = Some(args.to_vec());
    body.stdin_once = Some(false);
    body.working_dir = Some(DATA_MOUNT.into());
    let mut vars = vec![format!("HOME={DATA_MOUNT}")];
    vars.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
    body.env = Some(vars);
    if let Some(host) = body.host_config.as_mut() {
        host.mounts = Some(vec![Mount {
            target: Some(DATA_MOUNT.to_owned()),
            source: Some(data_dir.to_string_lossy().into_owned()),
            typ: Some(MountType::BIND),
            read_only: Some(false),
            bind_options: Some(MountBindOptions {
                propagation: Some(MountBindOptionsPropagationEnum::RPRIVATE),
                ..Default::default()
            }),
            ..Default::default()
        }]);
        host.group_add = None;
        if config.network {
            host.network_mode = Some("bridge".into());
        }
    }
    if config.network {
        body.network_disabled = Some(false);
    }
    // Removed on any failure from here on (the guard's drop).
    let mut container = Container {
        driver: driver.clone(),
        name: name.clone(),
        memory_mb: limits.memory_mb,
        watcher: None,
        removed: false,
    };
    let io = driver
        .start_attached(&name, body, DATA_MOUNT)
        .await
        .map_err(|e| match e {
            crate::driver::DriverError::ImageMissing { image } => {
                format!("MCP image {image} not found (build it: scripts/build-mcp-image.sh)")
            }
            e => crate::one_line(&e),
        })?;
    // Watched from its start: what it writes while starting, between calls or in a thread
    // of its own after a call returned is measured all the same.
    container.watcher = Some(Watcher::start(
        engine,
        driver,
        server,
        &data_dir,
        &name,
        limits.data_quota(),
    )?);
    let bollard::container::AttachContainerResults { mut output, input } = io;
    let (to_rmcp, mut from_container) = tokio::io::duplex(64 * 1024);
    let server = server.clone();
    tokio::spawn(async move {
        let mut logged = 0usize;
        while let Some(frame) = output.next().await {
            match frame {
                Ok(LogOutput::StdOut { message }) => {
                    if from_container.write_all(&message).await.is_err() {
                        break;
                    }
                }
                Ok(LogOutput::StdErr { message }) => {
                    if logged < STDERR_CAP {
                        logged += message.len();
                        for line in String::from_utf8_lossy(&message).lines() {
                            let line: String = line
                                .chars()
                                .take(500)
                                .map(|c| if c.is_control() { '?' } else { c })
                                .collect();
                            tracing::debug!(server = %server, "MCP stderr: {line}");
                        }
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        // EOF for the client: the session is closed.
        let _ = from_container.shutdown().await;
    });
    Ok((container, (to_rmcp, input)))
}
