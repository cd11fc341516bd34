//! [`TurnResources`]: the one owner of what a turn holds on the host and the engine — the
//! channel's identity, its workspace, the run dir and its registration, the container
//! (cold-started or prepared) and the broker listener — with the one teardown that runs on
//! every path ([`TurnResources::teardown`], and its drop when a turn is dropped before it).
//!
//! Warm preparation ([`crate::warm`]) and a cold turn build it with the same constructor
//! ([`TurnResources::new`]); the run ([`super`]) only adopts it, binds the broker, runs,
//! judges, replies and tears it down. The live-turn registry ([`LiveTurns`], which the
//! sweep reads) is changed here alone.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::outcome::TurnError;
use crate::broker::{BrokerListener, TurnContext};
use crate::driver::{
    BrokerTransport, ContainerSpec, DriverError, RunOutcome, StartedContainer, WorkspaceHome,
    LABEL_CHANNEL, LABEL_RUNTIME, LABEL_TURN,
};
use crate::quota::Workspace;
use crate::{ChannelId, Sandbox};

/// The broker's socket in a turn's run dir (the guest sees it at
/// [`roundtable_sandbox_protocol::BROKER_SOCKET`]).
pub const SOCKET_FILE: &str = "broker.sock";

/// Label set (to `1`) on every prepared container: it was started before its turn.
pub const LABEL_PREPARED: &str = "roundtable-sandbox.prepared";

/// The run dirs and containers of this runtime's turns in flight: the sweep skips them.
/// Changed by [`TurnResources`] alone.
#[derive(Debug, Default)]
pub(crate) struct LiveTurns {
    run_dirs: HashSet<PathBuf>,
    containers: HashSet<String>,
}

impl LiveTurns {
    /// Whether a turn in flight owns this run dir.
    pub(crate) fn has_run_dir(&self, dir: &Path) -> bool {
        self.run_dirs.contains(dir)
    }

    /// Whether a turn in flight owns this container.
    pub(crate) fn has_container(&self, name: &str) -> bool {
        self.containers.contains(name)
    }
}

/// Which container a turn's resources are made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Created and started by the turn's run.
    Cold,
    /// Started before its turn, its guest waiting on stdin ([`LABEL_PREPARED`]).
    Prepared,
}

/// What one turn holds (see the [module](self)). Every field is released by
/// [`TurnResources::teardown`], or by the drop when the turn never got to it.
#[derive(Debug)]
pub(crate) struct TurnResources {
    sandbox: Sandbox,
    channel: ChannelId,
    turn_id: String,
    spec: ContainerSpec,
    /// The workspace directory, held open (made relative to the workspace root's descriptor
    /// held since startup), when the host keeps it ([`WorkspaceHome::HostDir`]).
    workspace: Option<Arc<Workspace>>,
    /// Registered as live while `Some`; removed by the teardown.
    run_dir: Option<PathBuf>,
    /// The container's name is registered as live while true.
    registered: bool,
    /// A container of `spec.name` exists (or may) that the teardown must remove.
    started: bool,
    /// The prepared container's handle, until its run.
    handle: Option<Box<dyn StartedContainer>>,
    listener: Option<BrokerListener>,
}

impl TurnResources {
    /// The one constructor (warm preparation and cold turns): a fresh turn id, the
    /// channel's workspace where the backend keeps it ([`WorkspaceHome::HostDir`]: made
    /// here, 0700, never through a link), the container's name registered as live, then a
    /// fresh run dir (`mkdtemp run_root/turn-XXXXXX`, 0700, registered under the live-turns
    /// lock, which the sweep holds while it removes stale run dirs), and the turn's sealed
    /// container spec.
    pub(crate) fn new(
        sandbox: &Sandbox,
        channel: &ChannelId,
        start: Start,
    ) -> Result<Self, TurnError> {
        let config = sandbox.config();
        let turn_id = uuid::Uuid::new_v4().simple().to_string();
        let workspace_dir = config.workspace_root.join(channel.segment());
        let workspace = match sandbox.driver().workspace_home() {
            WorkspaceHome::HostDir => Some(Arc::new(make_workspace(sandbox, channel.segment())?)),
            _ => None,
        };
        let name = format!("roundtable-sandbox-{}-{}", channel.short(), &turn_id[..8]);
        let mut owner = Self {
            sandbox: sandbox.clone(),
            channel: channel.clone(),
            turn_id,
            spec: container_spec(sandbox, name, channel, &workspace_dir),
            workspace,
            run_dir: None,
            registered: false,
            started: false,
            handle: None,
            listener: None,
        };
        owner
            .sandbox
            .live_turns()
            .containers
            .insert(owner.spec.name.clone());
        owner.registered = true;
        let dir = {
            let mut live = owner.sandbox.live_turns();
            let dir = tempfile::Builder::new()
                .prefix("turn-")
                .rand_bytes(6)
                .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .tempdir_in(&config.run_root)
                .map_err(|source| TurnError::CreateRunDir {
                    path: config.run_root.clone(),
                    source,
                })?
                .keep();
            live.run_dirs.insert(dir.clone());
            dir
        };
        owner.run_dir = Some(dir.clone());
        owner.spec.run_dir = dir;
        owner
            .spec
            .labels
            .insert(LABEL_TURN.to_owned(), owner.turn_id.clone());
        if start == Start::Prepared {
            owner
                .spec
                .labels
                .insert(LABEL_PREPARED.to_owned(), "1".to_owned());
        }
        Ok(owner)
    }

    /// The channel.
    pub(crate) fn channel(&self) -> &ChannelId {
        &self.channel
    }

    /// The turn's id (a uuid's 32 hex digits).
    pub(crate) fn turn_id(&self) -> &str {
        &self.turn_id
    }

    /// The container's sealed spec.
    pub(crate) fn spec(&self) -> &ContainerSpec {
        &self.spec
    }

    /// Sends the warm pool's discard of these resources.
    pub(crate) fn discarded(&self, why: &str) {
        self.sandbox.emit(
            None,
            Some(&self.channel),
            crate::events::EventKind::Warm(crate::events::WarmEvent::Discarded {
                reason: why.to_owned(),
            }),
        );
    }

    /// Whether the container was started before the turn (and not yet run).
    pub(crate) fn is_prepared(&self) -> bool {
        self.handle.is_some()
    }

    /// Starts the container before its turn (warm preparation), its guest waiting on
    /// stdin. Not abandoned half-way: an engine call dropped in flight may still create the
    /// container after a removal meant for it.
    pub(crate) async fn start(&mut self) -> Result<(), TurnError> {
        self.check_mount_path()?;
        self.started = true;
        let driver = self.sandbox.driver().clone();
        self.handle = Some(driver.start(&self.spec, CancellationToken::new()).await?);
        Ok(())
    }

    /// The engine mounts the workspace by path: just before the container is created, the
    /// path must still name the directory these resources made and hold.
    pub(crate) fn check_mount_path(&self) -> Result<(), TurnError> {
        match &self.workspace {
            Some(workspace) => check_mount_path(&self.spec.workspace_dir, workspace),
            None => Ok(()),
        }
    }

    /// Checks that the prepared container can serve this turn (`Ok(Err(why))` when it
    /// cannot; a cold turn has nothing to check): it serves only the workspace directory it
    /// was made for — the workspace is made again now and compared by identity (a workspace
    /// moved aside or deleted since is another directory, while the container's bind still
    /// holds the old one) — and it must still wait for its turn
    /// ([`StartedContainer::check`]). The workspace made now is the one the turn holds.
    pub(crate) async fn check_waiting(&mut self) -> Result<Result<(), String>, TurnError> {
        let Some(handle) = &mut self.handle else {
            return Ok(Ok(()));
        };
        if let Some(prepared_for) = &self.workspace {
            let now = make_workspace(&self.sandbox, self.channel.segment())?;
            if now.id() != prepared_for.id() {
                return Ok(Err(WORKSPACE_NOT_THE_PREPARED.to_owned()));
            }
            self.workspace = Some(Arc::new(now));
        }
        Ok(handle.check().await.map_err(|e| e.to_string()))
    }

    /// The workspace as the host's quota watcher measures it: its directory, held open since
    /// it was made (every measure starts from this descriptor and never follows a guest
    /// path), and the
    /// filesystems the free-space floor guards (`&mut`: the turn's future holds it across
    /// the engine's answer, and the prepared container's handle is not `Sync`). `None` when the backend keeps the
    /// workspace elsewhere ([`WorkspaceHome::Backend`]): the host measures nothing.
    pub(crate) async fn host_workspace(
        &mut self,
        floor_on: bool,
    ) -> Result<Option<(Arc<crate::quota::Workspace>, Vec<crate::quota::Guarded>)>, TurnError> {
        let Some(workspace) = self.workspace.clone() else {
            return Ok(None);
        };
        let mut guarded = vec![crate::quota::Guarded {
            what: "the workspaces",
            path: self.sandbox.config().workspace_root.clone(),
        }];
        if floor_on {
            if let Some(path) = self.sandbox.driver().data_root().await? {
                guarded.push(crate::quota::Guarded {
                    what: "the engine's data root",
                    path,
                });
            }
        }
        Ok(Some((workspace, guarded)))
    }

    /// Binds the broker to the turn, over the transport the backend asks for: a unix
    /// socket in the turn's run dir (checked peer), or the byte streams the backend
    /// carries. The listener is the turn's until its teardown.
    pub(crate) async fn bind_broker(&mut self, ctx: TurnContext) -> Result<(), TurnError> {
        let broker = self.sandbox.broker().clone();
        let listener = match self.sandbox.driver().broker_transport(&self.spec).await? {
            BrokerTransport::UnixSocket => {
                let socket = self.spec.run_dir.join(SOCKET_FILE);
                if socket.as_os_str().len() > crate::config::MAX_SOCKET_PATH {
                    return Err(TurnError::SocketPathTooLong(socket));
                }
                broker.listen(&socket, ctx).await?
            }
            BrokerTransport::Streams(streams) => broker.serve_streams(streams, ctx),
        };
        self.listener = Some(listener);
        Ok(())
    }

    /// Runs the turn in the container: the prepared one is handed `stdin`, a cold one is
    /// created, started and handed it. From here the teardown removes the container.
    pub(crate) async fn run(
        &mut self,
        stdin: Vec<u8>,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, DriverError> {
        self.started = true;
        match self.handle.take() {
            Some(handle) => handle.run(stdin, cancel).await,
            None => {
                let driver = self.sandbox.driver().clone();
                driver.run(&self.spec, &stdin, cancel).await
            }
        }
    }

    /// The one teardown, every step attempted: the prepared container's handle dropped,
    /// the listener stopped (every call in flight ended) and the container removed
    /// (overlapped: the stop, a task to abort and join, hides behind the engine's removal),
    /// the run dir removed, the registration ended. Returns what failed; the caller logs it.
    pub(crate) async fn teardown(mut self) -> Vec<String> {
        drop(self.handle.take());
        let listener = self.listener.take();
        let stop_listener = async {
            match listener {
                Some(l) => l.stop().await.map_err(|e| format!("stop broker: {e}")),
                None => Ok(()),
            }
        };
        let (driver, name, started) = (
            self.sandbox.driver().clone(),
            self.spec.name.clone(),
            self.started,
        );
        let remove_container = async {
            if !started {
                return Ok(());
            }
            driver
                .remove(&name)
                .await
                .map_err(|e| format!("remove container {name}: {e}"))
        };
        let (stopped, removed) = tokio::join!(stop_listener, remove_container);
        // Removed, or why not is returned: the drop stands down (until here, a turn dropped
        // mid-removal is removed once more by it; removing an absent container is no error).
        self.started = false;
        let mut errors: Vec<String> = Vec::new();
        errors.extend(stopped.err());
        errors.extend(removed.err());
        if let Err(e) = self.remove_run_dir() {
            errors.push(format!("remove run dir: {e}"));
        }
        self.unregister();
        errors
    }

    /// Tears down and logs what failed (at warn, with `what`).
    pub(crate) async fn teardown_logged(self, what: &'static str) {
        for e in self.teardown().await {
            tracing::warn!(error = %e, "{what}");
        }
    }

    fn remove_run_dir(&mut self) -> std::io::Result<()> {
        let Some(dir) = self.run_dir.take() else {
            return Ok(());
        };
        let result = match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        self.sandbox.live_turns().run_dirs.remove(&dir);
        result
    }

    fn unregister(&mut self) {
        if std::mem::take(&mut self.registered) {
            self.sandbox.live_turns().containers.remove(&self.spec.name);
        }
    }
}

impl Drop for TurnResources {
    /// A turn dropped before its teardown (an aborted or panicking caller, a panicking
    /// reply callback, a prepared container never adopted): the same teardown, spawned.
    /// Without a runtime the run dir is removed here and the container left to the
    /// startup sweep.
    fn drop(&mut self) {
        if !self.started && self.handle.is_none() && self.listener.is_none() {
            // Nothing of the engine's: the run dir and the registration go here and now.
            let _ = self.remove_run_dir();
            self.unregister();
            return;
        }
        let rest = TurnResources {
            sandbox: self.sandbox.clone(),
            channel: self.channel.clone(),
            turn_id: std::mem::take(&mut self.turn_id),
            spec: self.spec.clone(),
            workspace: self.workspace.take(),
            run_dir: self.run_dir.take(),
            registered: std::mem::take(&mut self.registered),
            started: std::mem::take(&mut self.started),
            handle: self.handle.take(),
            listener: self.listener.take(),
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(rest.teardown_logged("remove the resources of a dropped turn"));
            }
            Err(_) => {
                let mut rest = rest;
                tracing::warn!(
                    container = %rest.spec.name,
                    "turn dropped without a runtime; the startup sweep removes its container"
                );
                rest.started = false;
                drop(rest.handle.take());
                drop(rest.listener.take());
                // `rest` drops here: its run dir and registration go by the branch above.
            }
        }
    }
}

/// Why a prepared container is not adopted when the turn's workspace is not its own.
const WORKSPACE_NOT_THE_PREPARED: &str =
    "its workspace directory was moved or deleted since it was prepared (the turn's is another)";

/// Makes the channel's workspace (`mkdirat` 0700) and opens it (`O_NOFOLLOW | O_DIRECTORY`),
/// both relative to the workspace root's descriptor held since startup (never through the
/// root's path). An existing directory must be the service user's with no group or other
/// bit ([`crate::config::is_private_dir`]): one some other user made, or that others can
/// read, is refused. A workspace the guest locked (`chmod 000 /workspace`) cannot be
/// opened, so cannot be measured: a quota error, as every unmeasurable workspace.
fn make_workspace(sandbox: &Sandbox, segment: &str) -> Result<Workspace, TurnError> {
    use rustix::fs::{AtFlags, FileType, Mode};
    let config = sandbox.config();
    let root = sandbox.workspace_root_lock().dir();
    let path = config.workspace_root.join(segment);
    let err = |e: rustix::io::Errno| TurnError::CreateWorkspace {
        path: path.clone(),
        source: e.into(),
    };
    match rustix::fs::mkdirat(root, segment, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(err(e)),
    }
    // Never follow a link planted in place of the workspace.
    let st = rustix::fs::statat(root, segment, AtFlags::SYMLINK_NOFOLLOW).map_err(err)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return Err(TurnError::CreateWorkspace {
            path,
            source: std::io::Error::other("not a directory"),
        });
    }
    let mode = st.st_mode as u32 & 0o7777;
    if !crate::config::is_private_dir(st.st_uid, mode, config.uid) {
        return Err(TurnError::WorkspaceNotPrivate {
            path,
            uid: config.uid,
            owner: st.st_uid,
            mode,
        });
    }
    let workspace = Workspace::open_at(root, segment)
        .map_err(|e| crate::quota::QuotaError::Measure(format!("open the workspace: {e}")))?;
    #[allow(clippy::unnecessary_cast)]
    if workspace.id() != (st.st_dev as u64, st.st_ino as u64) {
        // Replaced between the check and the open (only a writer of the root can).
        return Err(TurnError::WorkspaceReplaced { path });
    }
    Ok(workspace)
}

/// Checks that `path`, the workspace's path as the engine will resolve it for the bind
/// mount, still names `workspace` (same device and inode). What remains between this check
/// and the engine's own lookup needs write access to a directory on the path, which the
/// startup check refuses to anyone but root and the service user
/// ([`crate::config::check_root_ancestors`]).
fn check_mount_path(path: &Path, workspace: &Workspace) -> Result<(), TurnError> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if (meta.dev(), meta.ino()) == workspace.id() => Ok(()),
        _ => Err(TurnError::WorkspaceReplaced {
            path: path.to_owned(),
        }),
    }
}

/// The turn's sealed container spec (its run dir and turn label are set by the
/// constructor).
fn container_spec(
    sandbox: &Sandbox,
    name: String,
    channel: &ChannelId,
    workspace_dir: &Path,
) -> ContainerSpec {
    let config = sandbox.config();
    let limits = &config.limits;
    ContainerSpec {
        name,
        image: config.image.clone(),
        run_dir: PathBuf::new(),
        workspace_dir: workspace_dir.to_owned(),
        uid: config.uid,
        gid: config.gid,
        memory_mb: limits.memory_mb,
        cpus: limits.cpus,
        pids: limits.pids,
        tmpfs_mb: limits.tmpfs_mb,
        file_size_mb: limits.workspace_mb,
        output_cap: (limits.output_kb as usize) * 1024,
        stderr_cap: 64 * 1024,
        labels: BTreeMap::from([
            (LABEL_RUNTIME.to_owned(), config.instance.clone()),
            (LABEL_CHANNEL.to_owned(), channel.short().to_owned()),
        ]),
        command: config.command.clone(),
        runtime: config.runtime.clone(),
    }
}
