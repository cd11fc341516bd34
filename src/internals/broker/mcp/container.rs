//! Container-confined stdio MCP sessions: each session of a `confine = "container"` server
//! is its own container, started through the runtime's [`ContainerDriver`]
//! ([`ContainerDriver::start_session`]: a second backend runs them as Docker does, or
//! refuses them), hardened as a guest's (no network, read-only root, `cap-drop ALL`,
//! no-new-privileges, the engine's default seccomp profile, memory = swap, cpus and pids
//! caps, `/tmp` tmpfs, `ulimit fsize` at the data quota, an init, first in line for the OOM
//! killer), run as the service uid:gid with no supplementary group (so not in `docker`),
//! under the configured runtime (gVisor too), labelled with the runtime instance and
//! [`LABEL_MCP`]. Its stdio is the attach stream: stdout to the client, stderr lines to the
//! debug log (capped).
//!
//! **The guest's seccomp layer, for any image.** Its mounts are its own data dir,
//! `<data root>/<server>/<channel hash>` (made `0700` by the host), at [`DATA_MOUNT`], and,
//! read-only at [`WRAPPER`], the static guest program read once out of the guest image
//! ([`McpEngine::install_wrapper`], checked static). That program is the session's
//! entrypoint: `/roundtable-guest --exec COMMAND ARGS…` installs the guest's own seccomp
//! layer (`guest/src/seccomp.rs`: `ptrace`, `process_vm_*`, `kcmp`, `pidfd_getfd`,
//! `sendmsg`/`sendmmsg` — the only ways to pass a descriptor —, io_uring, and the
//! space-reserving `fallocate` modes refused), then execs the configured command, so every
//! process of the session runs under it and the operator's image needs nothing of ours.
//! Under gVisor the same program counts the files the session holds open
//! (`--held-files /data`).
//!
//! **DNS with `network = true`.** glibc's resolver sends its A and AAAA queries together
//! with `sendmmsg`, which the layer refuses (`EPERM`); measured with the MCP image's glibc
//! (Debian bookworm, 2.36), resolution then fails. Such a session gets
//! `RES_OPTIONS=single-request` in its environment (added to the operator's own
//! `RES_OPTIONS`): glibc then sends one query at a time with `send(2)`, which carries no
//! descriptor, and resolves (`tests/broker/mcp_layer.rs`, under runc and gVisor).
//! Descriptor passing stays refused: `sendmsg` and `sendmmsg` stay refused whatever the
//! session does with its environment (a program that drops the option only loses its own
//! name resolution).
//!
//! **Work that outlives its turn.** A channel's session is paused ([`Container::pause`],
//! the engine's freezer) when the turn that used it ends and resumed at its next call;
//! where the backend cannot pause, the session is stopped (its container removed) and its
//! next call starts it again on its data.
//!
//! The data dir is held to a quota measured as a workspace's ([`crate::quota`], by
//! descriptor, never following a link), before each call and, by a [`Watcher`] as long as
//! the session's container runs (between calls too; not while it is paused: nothing of it
//! runs then), every [`crate::quota::WATCH_INTERVAL`] with the files its processes hold open
//! after deleting them ([`ContainerDriver::held_files`], as a turn's); its filesystem is
//! held to the free-space floor as a workspace's is. Past either, the watcher removes the
//! container and the session's call in flight, or else its next call, is refused with the
//! watcher's error. A deleted file queued in a unix socket (`SCM_RIGHTS`), which no
//! descriptor scan sees, cannot be made: the layer refuses `sendmsg`.

use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::config::McpServer;
use crate::driver::{
    ContainerDriver, DockerDriver, DockerOptions, DriverError, SessionMount, SessionOutput,
    SessionSpec, LABEL_CHANNEL, LABEL_RUNTIME,
};
use crate::quota::{Floor, Guarded, Quota, QuotaError};

pub use crate::driver::LABEL_MCP;
/// Where a session's data dir is mounted in its container (read-write).
pub const DATA_MOUNT: &str = "/data";
/// Where the guest program is mounted in a session's container (read-only): the wrapper
/// that installs the seccomp layer, and the held-files measurer under gVisor.
pub(crate) const WRAPPER: &str = roundtable_sandbox_protocol::held::GUEST_PROGRAM;
/// The dir under the data root that holds the wrapper (no server is named so: a server's
/// name has no dot).
const WRAPPER_DIR: &str = ".wrapper";
/// The largest guest program read out of the guest image.
const WRAPPER_MAX: u64 = 64 << 20;
/// What a `network = true` session's glibc resolver is told: one query at a time, with
/// `send(2)` (its parallel queries go by `sendmmsg`, which the layer refuses).
const RESOLVER_OPTIONS: &str = "single-request";
/// The dir name of a shared server's one data dir (a channel's is its 64-hex hash).
const SHARED_DIR: &str = "shared";
/// Stderr bytes of one session that reach the debug log; the rest is dropped.
pub(crate) const STDERR_CAP: usize = 64 * 1024;

/// The engine and identity container-confined MCP sessions run with.
#[derive(Debug, Clone)]
pub struct McpEngine {
    /// The engine's socket (`unix:///var/run/docker.sock`), for the Docker driver used when
    /// no `driver` is given.
    pub docker_host: String,
    /// The backend that runs the sessions (`None`: the Docker driver on `docker_host`);
    /// the runtime's own driver when its configuration gives one.
    pub driver: Option<Arc<dyn ContainerDriver>>,
    /// The guest image: its static `/roundtable-guest` wraps every session's command.
    pub guest_image: String,
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
    /// The backend for MCP sessions.
    pub(crate) fn driver(&self) -> Arc<dyn ContainerDriver> {
        match &self.driver {
            Some(d) => d.clone(),
            None => Arc::new(DockerDriver::new(DockerOptions {
                host: self.docker_host.clone(),
                ..DockerOptions::default()
            })),
        }
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

    /// Reads the static guest program out of the guest image and writes it under the data
    /// root (`0555`, replaced atomically); returns its path, which every session mounts
    /// read-only at [`WRAPPER`]. Refused when the image has no such file or it is not a
    /// static executable (it must run in any image).
    pub(crate) async fn install_wrapper(
        &self,
        driver: &dyn ContainerDriver,
    ) -> Result<PathBuf, String> {
        let bytes = driver
            .image_file(&self.guest_image, WRAPPER, WRAPPER_MAX)
            .await
            .map_err(|e| match e {
                DriverError::ImageMissing { image } => format!(
                    "the guest image {image} is not there (build it: scripts/build-image.sh); its /roundtable-guest wraps every MCP session"
                ),
                e => format!(
                    "read /roundtable-guest out of the guest image {}: {}",
                    self.guest_image,
                    crate::one_line(&e)
                ),
            })?;
        if !crate::driver::is_static_elf(&bytes) {
            return Err(format!(
                "/roundtable-guest of the guest image {} is not a static executable; it cannot wrap an MCP session",
                self.guest_image
            ));
        }
        make_private(&self.data_root)?;
        let dir = self.data_root.join(WRAPPER_DIR);
        make_private(&dir)?;
        let path = dir.join("roundtable-guest");
        let part = dir.join(format!(
            ".part-{:08x}",
            uuid::Uuid::new_v4().as_u128() as u32
        ));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o555)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&part)
            .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes).and_then(|()| f.sync_all()))
            .and_then(|()| std::fs::rename(&part, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&part);
            return Err(format!("write {}: {e}", path.display()));
        }
        Ok(path)
    }

    /// Removes this instance's MCP containers whose data dir lies under this data root
    /// (left by a runtime that crashed); returns their names.
    pub(crate) async fn sweep(&self, driver: &dyn ContainerDriver) -> Result<Vec<String>, String> {
        let labels = [
            format!("{LABEL_RUNTIME}={}", self.instance),
            LABEL_MCP.to_owned(),
        ];
        let found = driver
            .list_labelled(&labels)
            .await
            .map_err(|e| e.to_string())?;
        let mut removed = Vec::new();
        for c in found {
            let ours = c
                .mounts
                .get(DATA_MOUNT)
                .is_some_and(|src| Path::new(src).starts_with(&self.data_root));
            if !ours {
                continue;
            }
            match driver.remove(&c.name).await {
                Ok(()) => removed.push(c.name),
                Err(e) => tracing::warn!(container = %c.name, error = %e, "MCP sweep"),
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
        crate::quota::check_floor(&[self.guarded()], &self.floor)
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

    /// The filesystem the floor guards for MCP sessions.
    fn guarded(&self) -> Guarded {
        Guarded {
            what: "the MCP servers' data",
            path: self.data_root.clone(),
        }
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

/// What a session's watcher measures: enough to start it again after a pause.
#[derive(Clone)]
struct Watched {
    engine: McpEngine,
    server: String,
    data_dir: PathBuf,
    quota: Quota,
}

/// Watches a session's data dir while its container runs ([`crate::quota::watch`]: the
/// tree by descriptor, the files the container's processes hold open with no name left,
/// the floor). Past its quota (or unmeasurable, or the floor passed) it keeps the error,
/// wakes the session's call in flight and removes the container. Stopped when dropped.
pub(crate) struct Watcher {
    task: tokio::task::JoinHandle<()>,
    tripped: tokio::sync::watch::Receiver<Option<String>>,
}

impl Watcher {
    fn start(
        w: &Watched,
        driver: &Arc<dyn ContainerDriver>,
        container: &str,
    ) -> Result<Self, String> {
        let server = &w.server;
        let workspace = crate::quota::Workspace::open(&w.data_dir).map_err(|e| {
            format!(
                "MCP server {server}: this channel's data cannot be measured (open its dir: {e})"
            )
        })?;
        let watch = crate::quota::Watch {
            workspace: Arc::new(workspace),
            quota: w.quota,
            floor: w.engine.floor,
            guarded: vec![w.engine.guarded()],
            driver: driver.clone(),
            container: container.to_owned(),
        };
        let (tx, tripped) = tokio::sync::watch::channel(None);
        let (driver, server, name) = (driver.clone(), server.clone(), container.to_owned());
        let task = tokio::spawn(async move {
            let e = crate::quota::watch(watch).await;
            tracing::warn!(server = %server, "MCP session over its data quota or the floor; stopped");
            tx.send_replace(Some(watcher_error(&server, e)));
            if let Err(e) = driver.remove(&name).await {
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
    driver: Arc<dyn ContainerDriver>,
    /// The container's name.
    pub(crate) name: String,
    /// The session's memory cap (for the out-of-memory error).
    pub(crate) memory_mb: u64,
    /// The watcher of its data dir (stopped with it, and while it is paused).
    pub(crate) watcher: Option<Watcher>,
    /// What the watcher measures.
    watched: Watched,
    /// Frozen by [`Container::pause`].
    paused: bool,
    removed: bool,
    /// Cancelled when it is dropped: the task of [`Container::remove_when`] ends with it
    /// (a session whose start was cut off, by its call's deadline, was dropped unclosed,
    /// and the task waited for ever, one per start).
    dropped: tokio_util::sync::CancellationToken,
}

impl Container {
    /// Kills and removes the container.
    pub(crate) async fn remove(mut self) {
        self.removed = true;
        self.watcher = None;
        if let Err(e) = self.driver.remove(&self.name).await {
            tracing::warn!(container = %self.name, error = %e, "remove MCP container");
        }
    }

    /// Removes the container (from a task of its own) once `closed` fires: a session
    /// that ends (its server stopped, or its client stopped it at a cap) leaves no
    /// container working until its next call.
    pub(crate) fn remove_when(&self, closed: tokio_util::sync::CancellationToken) {
        let (driver, name) = (self.driver.clone(), self.name.clone());
        let dropped = self.dropped.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = closed.cancelled() => {}
                // Removed by its drop.
                () = dropped.cancelled() => return,
            }
            if let Err(e) = driver.remove(&name).await {
                tracing::debug!(container = %name, error = %e, "remove MCP container");
            }
        });
    }

    /// Whether the kernel's OOM killer ended it.
    pub(crate) async fn oom_killed(&self) -> bool {
        self.driver.oom_killed(&self.name).await.unwrap_or(false)
    }

    /// Whether it is paused.
    pub(crate) fn is_paused(&self) -> bool {
        self.paused
    }

    /// Freezes every process of the container (its watcher stopped: nothing of it runs,
    /// nothing it holds changes). An error (the backend cannot pause, the engine failed)
    /// leaves it to the caller to stop the session.
    pub(crate) async fn pause(&mut self) -> Result<(), String> {
        if self.paused {
            return Ok(());
        }
        self.watcher = None;
        self.driver
            .pause(&self.name)
            .await
            .map_err(|e| crate::one_line(&e))?;
        self.paused = true;
        Ok(())
    }

    /// Thaws a paused container and starts its watcher again. An error leaves it to the
    /// caller to stop the session (its next call starts it again on its data).
    pub(crate) async fn resume(&mut self) -> Result<(), String> {
        if !self.paused {
            return Ok(());
        }
        self.driver
            .resume(&self.name)
            .await
            .map_err(|e| crate::one_line(&e))?;
        self.paused = false;
        self.watcher = Some(Watcher::start(&self.watched, &self.driver, &self.name)?);
        Ok(())
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.dropped.cancel();
        if self.removed {
            return;
        }
        let (driver, name) = (self.driver.clone(), std::mem::take(&mut self.name));
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = driver.remove(&name).await;
            });
        }
    }
}

/// The session's stdio as the MCP client reads and writes it.
pub(crate) type Stdio = (
    tokio::io::DuplexStream,
    Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
);

/// Starts one session's container: `command` + `args` in `config.image` under the wrapper
/// (`wrapper`, the host path of the static guest program), `env` its whole environment
/// (with `HOME=/data`), its data dir made first.
pub(crate) async fn start(
    (engine, driver, wrapper): (&McpEngine, &Arc<dyn ContainerDriver>, &Path),
    config: &McpServer,
    segment: &str,
    (command, args, env): (&str, &[String], &BTreeMap<String, String>),
) -> Result<(Container, Stdio), String> {
    let server = &config.name;
    let data_dir = engine.data_dir(server, segment);
    engine.prepare(server)?;
    make_private(&data_dir)?;
    let spec = session_spec(
        engine,
        config,
        segment,
        &data_dir,
        wrapper,
        (command, args, env),
    );
    // Removed on any failure from here on (the guard's drop).
    let mut container = Container {
        driver: driver.clone(),
        name: spec.name.clone(),
        memory_mb: config.limits.memory_mb,
        watcher: None,
        watched: Watched {
            engine: engine.clone(),
            server: server.clone(),
            data_dir,
            quota: config.limits.data_quota(),
        },
        paused: false,
        removed: false,
        dropped: tokio_util::sync::CancellationToken::new(),
    };
    // The engine's calls run to their end in a task of their own: a call dropped while the
    // engine makes the container (the guest closed its connection, its turn ended) would
    // leave one the guard's removal came too early for (the engine answered it 404, then
    // made the container). What a caller no longer waits for is removed here.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (starter, starting) = (driver.clone(), spec.clone());
    tokio::spawn(async move {
        let started = starter.start_session(&starting).await;
        if let Err(started) = tx.send(started) {
            drop(started);
            let _ = starter.remove(&starting.name).await;
        }
    });
    let started = rx
        .await
        .map_err(|_| "the session's start was lost".to_owned())?;
    let io = started.map_err(|e| match e {
        DriverError::ImageMissing { image } => {
            format!("MCP image {image} not found (build it: scripts/build-mcp-image.sh)")
        }
        e => crate::one_line(&e),
    })?;
    // Watched from its start: what it writes while starting, between calls or in a thread
    // of its own after a call returned is measured all the same.
    container.watcher = Some(Watcher::start(&container.watched, driver, &spec.name)?);
    let (to_client, from_container) = tokio::io::duplex(64 * 1024);
    tokio::spawn(relay(server.clone(), io.output, from_container));
    Ok((container, (to_client, io.input)))
}

/// The container of one session: its name, labels, limits, the wrapper and its data dir
/// mounted, its argv (the wrapper, then the command), its environment.
fn session_spec(
    engine: &McpEngine,
    config: &McpServer,
    segment: &str,
    data_dir: &Path,
    wrapper: &Path,
    (command, args, env): (&str, &[String], &BTreeMap<String, String>),
) -> SessionSpec {
    let server = &config.name;
    let tag = if segment.is_empty() {
        SHARED_DIR
    } else {
        &segment[..segment.len().min(12)]
    };
    let name = format!(
        "rtb-mcp-{server}-{tag}-{:08x}",
        uuid::Uuid::new_v4().as_u128() as u32
    );
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
    let mut argv = vec![WRAPPER.to_owned(), "--exec".to_owned(), command.to_owned()];
    argv.extend(args.iter().cloned());
    let limits = &config.limits;
    SessionSpec {
        name,
        image: config.image.clone().unwrap_or_default(),
        uid: engine.uid,
        gid: engine.gid,
        memory_mb: limits.memory_mb,
        cpus: limits.cpus,
        pids: limits.pids,
        tmpfs_mb: limits.tmpfs_mb,
        file_size_mb: limits.data_mb,
        labels,
        argv,
        env: session_env(env, config.network),
        working_dir: DATA_MOUNT.into(),
        mounts: vec![
            SessionMount {
                source: data_dir.to_owned(),
                target: DATA_MOUNT.into(),
                read_only: false,
            },
            SessionMount {
                source: wrapper.to_owned(),
                target: WRAPPER.into(),
                read_only: true,
            },
        ],
        network: config.network,
        runtime: engine.runtime.clone(),
        measured: DATA_MOUNT.into(),
    }
}

/// A session's environment: `HOME=/data`, the configured variables and, with a network,
/// [`RESOLVER_OPTIONS`] added to `RES_OPTIONS` (see the module's doc on DNS).
fn session_env(env: &BTreeMap<String, String>, network: bool) -> Vec<String> {
    let mut vars = vec![format!("HOME={DATA_MOUNT}")];
    vars.extend(
        env.iter()
            .filter(|(k, _)| !(network && *k == "RES_OPTIONS"))
            .map(|(k, v)| format!("{k}={v}")),
    );
    if network {
        let options = match env.get("RES_OPTIONS") {
            Some(own) => format!("{own} {RESOLVER_OPTIONS}"),
            None => RESOLVER_OPTIONS.to_owned(),
        };
        vars.push(format!("RES_OPTIONS={options}"));
    }
    vars
}

/// Copies a session's stdout to its client and its stderr lines (capped, control
/// characters replaced) to the debug log; at the end of its output, EOF for the client.
async fn relay(
    server: String,
    mut output: Pin<Box<dyn futures_util::Stream<Item = SessionOutput> + Send>>,
    mut to_client: tokio::io::DuplexStream,
) {
    let mut logged = 0usize;
    while let Some(frame) = output.next().await {
        match frame {
            SessionOutput::Stdout(message) => {
                if to_client.write_all(&message).await.is_err() {
                    break;
                }
            }
            SessionOutput::Stderr(message) => {
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
        }
    }
    // EOF for the client: the session is closed.
    let _ = to_client.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_networked_session_resolves_one_query_at_a_time() {
        let env = BTreeMap::from([("A".to_owned(), "1".to_owned())]);
        assert_eq!(session_env(&env, false), ["HOME=/data", "A=1"]);
        assert_eq!(
            session_env(&env, true),
            ["HOME=/data", "A=1", "RES_OPTIONS=single-request"]
        );
        let own = BTreeMap::from([("RES_OPTIONS".to_owned(), "ndots:2".to_owned())]);
        assert_eq!(
            session_env(&own, true),
            ["HOME=/data", "RES_OPTIONS=ndots:2 single-request"]
        );
        assert_eq!(
            session_env(&own, false),
            ["HOME=/data", "RES_OPTIONS=ndots:2"]
        );
    }
}
