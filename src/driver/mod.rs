//! Container drivers: how one turn's sealed container is created, run and removed.
//!
//! Parts:
//! - [`ContainerSpec`]: everything that shapes the container (name, identity, mounts,
//!   limits, labels); built by the turn runner, never from guest input;
//! - [`ContainerDriver`]: the pluggable trait (Docker by default; a recording fake in tests);
//! - [`RunOutcome`]: what a run did (exit status, capped stdout, stderr tail),
//!   collected with an [`OutputCollector`] and judged once, by the turn;
//! - [`DriverError`]: each way a driver call can fail, backend-neutral;
//! - [`SessionSpec`] and the trait's session methods: long-lived attached containers (MCP
//!   sessions), paused and resumed, listed by label, wrapped with a file of an image;
//! - `docker`: the Docker Engine driver on bollard ([`DockerDriver`]; its engine-level
//!   parts, for this workspace's tests and bench, are `internals::docker`).

pub(crate) mod docker;
mod session;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

#[cfg(feature = "testing")]
use roundtable_sandbox_protocol::Reply;
use roundtable_sandbox_protocol::REPLY_FRAME_END;
use tokio_util::sync::CancellationToken;

pub use docker::{DockerDriver, DockerOptions};
pub use futures_util::future::BoxFuture;
pub use roundtable_sandbox_protocol::{parse_reply, ReplyError, GUEST_ERROR_PREFIX};
pub use session::{
    is_static_elf, LabelledContainer, SessionIo, SessionMount, SessionOutput, SessionSpec,
};

/// The gVisor runtime's name as `scripts/setup.sh --gvisor` registers it with the engine.
pub const GVISOR_RUNTIME: &str = "runsc";

/// Label set on every container of this project; its value is the runtime instance.
pub const LABEL_RUNTIME: &str = "roundtable-sandbox";
/// Label with the first 16 hex digits of the channel's hash.
pub const LABEL_CHANNEL: &str = "roundtable-sandbox.channel";
/// Label on every MCP session's container (its value is the server's name): such a
/// container is its MCP pool's, which sweeps it at startup ([`ContainerDriver::sweep`]
/// leaves it).
pub const LABEL_MCP: &str = "roundtable-sandbox.mcp";
/// Label with the turn id.
pub const LABEL_TURN: &str = "roundtable-sandbox.turn";
/// Label on a container made only to read a file of an image
/// ([`ContainerDriver::image_file`]); its value is when it was made (Unix seconds). Such a
/// container is never started and is removed as soon as the file is read; one a crash left
/// behind is removed by the next [`ContainerDriver::sweep`] of any instance once it is
/// [`READ_ORPHANED_AFTER`] old (a read takes seconds).
pub const LABEL_READ: &str = "roundtable-sandbox.read";
/// How old a never-started [`LABEL_READ`] container must be before a sweep removes it.
pub const READ_ORPHANED_AFTER: std::time::Duration = std::time::Duration::from_secs(600);
/// Set to `1` to keep containers after their turn (debugging only).
pub const KEEP_CONTAINERS_ENV: &str = "ROUNDTABLE_SANDBOX_KEEP_CONTAINERS";

/// The shape of one turn's container.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerSpec {
    /// The container's name.
    pub name: String,
    /// The guest image.
    pub image: String,
    /// Host dir holding only `broker.sock`; mounted read-only at `/run/roundtable`.
    pub run_dir: PathBuf,
    /// Host dir of this channel's workspace; mounted read-write at `/workspace`.
    pub workspace_dir: PathBuf,
    /// The worker's uid (never 0).
    pub uid: u32,
    /// The worker's gid (never 0).
    pub gid: u32,
    /// Memory in MiB (swap is the same: none).
    pub memory_mb: u64,
    /// CPUs.
    pub cpus: f64,
    /// Processes and threads.
    pub pids: i64,
    /// The `/tmp` tmpfs in MiB.
    pub tmpfs_mb: u64,
    /// Largest file the guest may write, in MiB (`RLIMIT_FSIZE`; the workspace quota).
    pub file_size_mb: u64,
    /// Cap on stdout bytes; past it the container is killed and the turn fails.
    pub output_cap: usize,
    /// Cap on stderr bytes kept for the debug log.
    pub stderr_cap: usize,
    /// The labels that name the container's runtime, channel and turn.
    pub labels: BTreeMap<String, String>,
    /// Replaces the image's entrypoint (tests and benchmarks).
    pub command: Option<Vec<String>>,
    /// The engine's runtime for this container (`runsc`: gVisor); `None`: the engine's default.
    pub runtime: Option<String>,
}

/// How a driver call failed. Backend-neutral: the engine is named by [`DriverError`]'s
/// `engine` fields (`"docker"` for [`DockerDriver`]); a server's answer keeps its HTTP-like
/// status code in a field of its own. What a container *did* (its exit code, an OOM kill,
/// its output) is not an error here: it is a [`RunOutcome`], judged by the turn.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// The run's cancellation token fired; the container was killed.
    #[error("turn cancelled")]
    Cancelled,
    /// The engine does not have the spec's image.
    #[error("sandbox image not found: {image} (build it with scripts/build-image.sh)")]
    ImageMissing {
        /// The image.
        image: String,
    },
    /// The engine does not know the spec's runtime (`runsc` not registered).
    #[error("container runtime {runtime} is not known to the engine (register it: scripts/setup.sh --gvisor, as root, for runsc)")]
    RuntimeMissing {
        /// The runtime.
        runtime: String,
    },
    /// The engine cannot be reached (transport failure, no answer, too old).
    #[error("{engine} daemon unreachable: {reason}")]
    DaemonUnreachable {
        /// The engine (`docker`).
        engine: &'static str,
        /// What failed.
        reason: String,
    },
    /// One engine call passed its deadline.
    #[error("{engine} {op} of {container} timed out after {after:?}")]
    CallTimeout {
        /// The engine.
        engine: &'static str,
        /// The call (`create`, `start`, `wait`, …).
        op: &'static str,
        /// The container.
        container: String,
        /// The deadline.
        after: Duration,
    },
    /// The engine answered a call with a failure.
    #[error("{engine} {op} of {container} failed: {}", status_and(*status, message))]
    Call {
        /// The engine.
        engine: &'static str,
        /// The call.
        op: &'static str,
        /// The container.
        container: String,
        /// The HTTP-like status of the engine's answer (`None`: not an answer with a status).
        status: Option<u16>,
        /// The engine's message.
        message: String,
    },
    /// A started container stopped before its turn was written to it.
    #[error("container {container} exited before its turn (code {code})")]
    Exited {
        /// The container.
        container: String,
        /// Its exit status (`-1`: none reported).
        code: i64,
    },
    /// The driver cannot do this (a backend without prepared containers).
    #[error("the container driver cannot {op}")]
    Unsupported {
        /// What was asked (`start`, `list processes`, `tell an oom kill`).
        op: &'static str,
    },
}

impl DriverError {
    /// The HTTP-like status of the engine's answer, if it was one.
    pub fn status(&self) -> Option<u16> {
        match self {
            DriverError::Call { status, .. } => *status,
            _ => None,
        }
    }

    /// Whether the engine answered "not found" (404).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }
}

fn status_and(status: Option<u16>, message: &str) -> String {
    match status {
        Some(code) => format!("{code} {message}"),
        None => message.to_owned(),
    }
}

/// What one container run did, as any backend reports it: the turn (not the driver) maps
/// it to a reply ([`crate::turn`]). A run ends one of two ways:
/// - **at the reply's frame** ([`RunOutcome::reply_ready`]): stdout's first line is a whole
///   valid reply ([`roundtable_sandbox_protocol::Reply::frame`]); the backend hands it over
///   at once, without waiting for the exit, and the turn answers with it whatever the
///   container does next (its exit status, a kill, more output); the container is left
///   running for the turn's teardown to kill and remove;
/// - **at its end** (otherwise): the exit status, judged as before (OOM, the output cap,
///   `128+SIGXFSZ`, a non-zero exit, then [`parse_reply`] of all of stdout).
///
/// The default is the second (fail closed): only a backend that sets `reply_ready` skips
/// the exit's judgement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOutcome {
    /// The container's exit status (`-1`: the engine reported none, or the run ended at
    /// the reply's frame and the exit was not awaited).
    pub exit_code: i64,
    /// The backend reported with the exit that the memory limit killed a process of the
    /// container (the Docker driver does not: the turn asks
    /// [`ContainerDriver::oom_killed`] when the run did not answer).
    pub oom_killed: bool,
    /// The guest's stdout, up to [`ContainerSpec::output_cap`] (empty past it); when a
    /// frame is complete, that frame only (what follows it is not kept).
    pub stdout: Vec<u8>,
    /// Stdout passed its cap (the container was killed then).
    pub stdout_overflow: bool,
    /// The first [`ContainerSpec::stderr_cap`] bytes of stderr (for the debug log only).
    pub stderr_tail: Vec<u8>,
    /// The run ended at the reply's frame (see above): `stdout` is the frame, the exit was
    /// not awaited, and the container may still run until the turn's teardown removes it.
    pub reply_ready: bool,
}

impl RunOutcome {
    /// A run that printed `reply`'s frame as its stdout and was handed over at it (for
    /// fakes and tests).
    #[cfg(feature = "testing")]
    pub fn replied(reply: &Reply) -> Self {
        Self {
            stdout: reply.frame(),
            exit_code: -1,
            reply_ready: true,
            ..Self::default()
        }
    }

    /// A run that exited with `code` and printed nothing.
    pub fn exited(code: i64) -> Self {
        Self {
            exit_code: code,
            ..Self::default()
        }
    }
}

/// Collects a run's output under the spec's caps; a backend feeds it the streams it reads.
/// It watches stdout's first line: when it is complete and a whole valid reply, the reply
/// is ready ([`OutputCollector::reply_ready`]; the backend may then end the run with
/// [`OutputCollector::finish_at_frame`]) and nothing after it is kept.
#[derive(Debug)]
pub struct OutputCollector {
    pub(crate) outcome: RunOutcome,
    pub(crate) stdout_cap: usize,
    pub(crate) stderr_cap: usize,
    /// Stdout's first line has non-whitespace content so far.
    content: bool,
    /// Stdout's first line is complete (whether or not it was a reply).
    first_line_done: bool,
    /// Stdout's first line is a whole valid reply: the run's answer.
    framed: bool,
}

impl OutputCollector {
    /// A collector with the spec's caps.
    pub fn new(spec: &ContainerSpec) -> Self {
        Self::with_caps(spec.output_cap, spec.stderr_cap)
    }

    pub(crate) fn with_caps(stdout_cap: usize, stderr_cap: usize) -> Self {
        Self {
            outcome: RunOutcome::default(),
            stdout_cap,
            stderr_cap,
            content: false,
            first_line_done: false,
            framed: false,
        }
    }

    /// Takes stdout bytes; returns true when stdout has just passed its cap (kill then).
    /// Once the reply's frame is complete, the rest is dropped (and never passes the cap).
    pub fn stdout(&mut self, bytes: &[u8]) -> bool {
        if self.outcome.stdout_overflow || self.framed {
            return false;
        }
        let end = self.first_line_end(bytes);
        let (head, rest) = match end {
            Some(end) => bytes.split_at(end + 1),
            None => (bytes, &[][..]),
        };
        if self.take(head) {
            return true;
        }
        if end.is_some() {
            // `head` ended stdout's first line.
            self.first_line_done = true;
            if parse_reply(&self.outcome.stdout, self.stdout_cap).is_ok() {
                self.framed = true;
                return false;
            }
        }
        self.take(rest)
    }

    /// Where stdout's first line ends in `bytes` (its newline, after some content), if it
    /// ends there.
    fn first_line_end(&mut self, bytes: &[u8]) -> Option<usize> {
        if self.first_line_done {
            return None;
        }
        for (i, b) in bytes.iter().enumerate() {
            if *b == REPLY_FRAME_END && self.content {
                return Some(i);
            }
            if !b.is_ascii_whitespace() {
                self.content = true;
            }
        }
        None
    }

    /// Keeps `bytes` under the cap; true when they pass it (stdout is dropped then).
    fn take(&mut self, bytes: &[u8]) -> bool {
        let o = &mut self.outcome;
        if o.stdout.len() + bytes.len() > self.stdout_cap {
            o.stdout_overflow = true;
            o.stdout = Vec::new();
            return true;
        }
        o.stdout.extend_from_slice(bytes);
        false
    }

    /// Takes stderr bytes; past its cap they are dropped.
    pub fn stderr(&mut self, bytes: &[u8]) {
        let room = self
            .stderr_cap
            .saturating_sub(self.outcome.stderr_tail.len());
        self.outcome
            .stderr_tail
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// Whether stdout's first line is a complete, valid reply: the run's answer, which a
    /// backend may hand over now ([`OutputCollector::finish_at_frame`]).
    pub fn reply_ready(&self) -> bool {
        self.framed
    }

    /// The outcome, with the exit status the engine reported (judged with it).
    pub fn finish(self, exit_code: i64) -> RunOutcome {
        RunOutcome {
            exit_code,
            ..self.outcome
        }
    }

    /// The outcome of a run handed over at its reply's frame (see [`RunOutcome`]): no exit
    /// status, [`RunOutcome::reply_ready`] set. Only when [`OutputCollector::reply_ready`].
    pub fn finish_at_frame(self) -> RunOutcome {
        debug_assert!(self.framed, "finished at a frame that is not complete");
        RunOutcome {
            exit_code: -1,
            reply_ready: self.framed,
            ..self.outcome
        }
    }
}

/// The processes of one running container, as the host sees them (see
/// [`ContainerDriver::processes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerProcesses {
    /// Host pids (thread-group ids) of every process in the container.
    pub pids: Vec<u32>,
    /// A string that `/proc/<pid>/cgroup` of each of them holds (the container's id): a pid
    /// whose cgroup file does not hold it was reused by another process and is skipped.
    pub cgroup_marker: Option<String>,
}

/// How the files a running container's processes hold open with no name left (deleted while
/// open, `O_TMPFILE`) are counted for the workspace quota (see [`ContainerDriver::held_files`]
/// and [`crate::quota`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeldFiles {
    /// The container's processes are host processes: the host `stat`s their descriptors.
    HostProcesses(ContainerProcesses),
    /// Counted inside the sandbox, where the host cannot see the guest's descriptors.
    Counted {
        /// How many such files (each inode once).
        files: u64,
        /// Their allocated bytes.
        bytes: u64,
    },
    /// They could not be counted; the quota counts the workspace as over it (fail closed).
    Unmeasurable(Unmeasurable),
}

/// Why the files a container's processes hold could not be counted. The texts are the
/// driver's own, never the guest's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unmeasurable {
    /// A live process's descriptors cannot be read.
    #[error("a process of the turn hides its open files from the host")]
    HiddenDescriptors,
    /// A deleted workspace file is held only through a memory mapping.
    #[error("a deleted workspace file is held only through a memory mapping")]
    MappedDeleted,
    /// The measurer inside the sandbox did not give a report (refused, killed, timed out,
    /// or printed something else).
    #[error("the open files of the turn could not be counted inside the sandbox: {0}")]
    Measurer(String),
    /// The turn's host processes could not be listed (the backend cannot, or the engine
    /// failed to answer).
    #[error("the processes of the turn could not be listed: {0}")]
    Processes(String),
}

/// A container created and started by [`ContainerDriver::start`], its guest waiting on stdin
/// for its turn (a prepared container). Removal stays with [`ContainerDriver::remove`].
pub trait StartedContainer: Send + std::fmt::Debug {
    /// The container's name.
    fn name(&self) -> &str;

    /// Checks that the container still waits for its turn: an error says why it cannot
    /// take one (it exited or was removed, or the engine does not answer).
    fn check(&mut self) -> BoxFuture<'_, Result<(), DriverError>>;

    /// Writes `stdin` (the turn JSON) and collects the output under the spec's caps, until
    /// the reply's frame is complete or the container exits; as [`ContainerDriver::run`]
    /// after its start.
    fn run(
        self: Box<Self>,
        stdin: Vec<u8>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<RunOutcome, DriverError>>;
}

/// What a default method of [`ContainerDriver`] answers for what the backend cannot do.
fn unsupported<'a, T: Send + 'a>(op: &'static str) -> BoxFuture<'a, Result<T, DriverError>> {
    Box::pin(std::future::ready(Err(DriverError::Unsupported { op })))
}

/// Runs turns in containers. Implementations must be cancellation-safe: when `cancel`
/// fires, the container is killed and `run` returns [`DriverError::Cancelled`] promptly.
pub trait ContainerDriver: Send + Sync + std::fmt::Debug {
    /// Creates and starts the container, writes `stdin` (the turn JSON) to it, collects
    /// its output under the spec's caps (an [`OutputCollector`]) and returns what it did:
    /// at the reply's frame ([`RunOutcome::reply_ready`], the container left running), or
    /// at the exit (a backend that waits for the exit is judged by it: the fail-closed
    /// default). The container is left for [`ContainerDriver::remove`].
    fn run<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        stdin: &'a [u8],
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, DriverError>>;

    /// Whether [`ContainerDriver::start`] can prepare a container before its turn (warm
    /// turns); default false.
    fn prepares(&self) -> bool {
        false
    }

    /// Creates and starts the container without writing its turn (its guest waits on
    /// stdin), for a turn that comes later; what [`ContainerDriver::run`] does before it
    /// writes the turn. The container is left for [`ContainerDriver::remove`]. The default
    /// refuses ([`DriverError::Unsupported`]).
    fn start<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Box<dyn StartedContainer>, DriverError>> {
        let _ = (spec, cancel);
        unsupported("start")
    }

    /// Removes the named container (killing it); absent is not an error.
    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>>;

    /// Whether the memory limit killed a process of the named container, which has exited
    /// (or whose end the caller saw before the engine did: an MCP session's stdio closed by
    /// the kill) and is not yet removed. The turn asks only when its run did not answer (a non-zero
    /// exit, the output cap, or output that is not a reply): a guest that exits 0 with a
    /// reply has answered, whatever befell its children. A backend that learns it with the
    /// exit sets [`RunOutcome::oom_killed`] instead and answers here explicitly. The default
    /// cannot tell ([`DriverError::Unsupported`]): the turn logs it and its judgement stands.
    fn oom_killed<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, DriverError>> {
        let _ = name;
        unsupported("tell an oom kill")
    }

    /// Removes the leftover containers of this runtime: labelled with `scope.instance`,
    /// their run dir under `scope.run_root`, and not of a live turn (`scope.live`, asked
    /// after listing). Returns the names removed.
    fn sweep<'a>(
        &'a self,
        scope: SweepScope<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, DriverError>>;

    /// The host pids of the named container's processes (empty when it is not running).
    /// The workspace quota stats their open descriptors to count files deleted while held
    /// open (see [`crate::quota`]). The default cannot list them
    /// ([`DriverError::Unsupported`]), which the quota counts as unmeasurable, never as
    /// "no process": a backend without host processes says so by answering
    /// [`ContainerDriver::held_files`] itself.
    fn processes<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ContainerProcesses, DriverError>> {
        let _ = name;
        unsupported("list processes")
    }

    /// How the files the named container's processes hold open with no name left are
    /// counted: the workspace quota's watcher asks once per measure (see [`crate::quota`]).
    /// A backend whose guest processes are host processes lists them
    /// ([`HeldFiles::HostProcesses`], what the default does with
    /// [`ContainerDriver::processes`]); one that hides them from the host counts inside the
    /// sandbox ([`HeldFiles::Counted`]) and reports every failure to do so as
    /// [`HeldFiles::Unmeasurable`], never as a count. The default lists them with
    /// [`ContainerDriver::processes`]; a failure to list them (the default `processes`
    /// included) is [`Unmeasurable::Processes`], never "nothing held".
    fn held_files<'a>(&'a self, name: &'a str) -> BoxFuture<'a, HeldFiles> {
        Box::pin(async move { held_by_host_processes(self.processes(name).await) })
    }

    /// How the guest of the container `spec` describes reaches its broker; asked by the
    /// turn before it binds the broker (so, with a prepared container, at adoption). The
    /// default, and the Docker driver's, is [`BrokerTransport::UnixSocket`].
    fn broker_transport<'a>(
        &'a self,
        spec: &'a ContainerSpec,
    ) -> BoxFuture<'a, Result<BrokerTransport, DriverError>> {
        let _ = spec;
        Box::pin(async { Ok(BrokerTransport::UnixSocket) })
    }

    /// Where the turn's workspace lives, and so who measures it (asked at every turn and
    /// preparation). The default, and the Docker driver's: [`WorkspaceHome::HostDir`], the
    /// channel's directory under the workspace root, made and measured by the host.
    fn workspace_home(&self) -> WorkspaceHome {
        WorkspaceHome::HostDir
    }

    /// Creates and starts a long-lived container whose stdin stays open (an MCP session,
    /// `spec` hardened as a turn's), attached: its output and its stdin. The container is
    /// left for [`ContainerDriver::remove`]. The default refuses
    /// ([`DriverError::Unsupported`]).
    fn start_session<'a>(
        &'a self,
        spec: &'a SessionSpec,
    ) -> BoxFuture<'a, Result<SessionIo, DriverError>> {
        let _ = spec;
        unsupported("start a session")
    }

    /// Freezes every process of the named container (nothing of it runs until
    /// [`ContainerDriver::resume`]). The default refuses ([`DriverError::Unsupported`]):
    /// the caller then stops the container instead.
    fn pause<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        let _ = name;
        unsupported("pause")
    }

    /// Thaws a container [`ContainerDriver::pause`] froze. The default refuses
    /// ([`DriverError::Unsupported`]).
    fn resume<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        let _ = name;
        unsupported("resume")
    }

    /// Every container (running or not) carrying all of `labels` (`key` or `key=value`),
    /// with its bind mounts. The default refuses ([`DriverError::Unsupported`]).
    fn list_labelled<'a>(
        &'a self,
        labels: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<LabelledContainer>, DriverError>> {
        let _ = labels;
        unsupported("list containers by label")
    }

    /// The regular file at `path` in `image` (at most `max` bytes; a link, a directory or a
    /// larger file is an error). The default refuses ([`DriverError::Unsupported`]).
    fn image_file<'a>(
        &'a self,
        image: &'a str,
        path: &'a str,
        max: u64,
    ) -> BoxFuture<'a, Result<Vec<u8>, DriverError>> {
        let _ = (image, path, max);
        unsupported("read a file of an image")
    }

    /// The host directory where the engine stores images and container layers, whose
    /// filesystem the free-space floor guards (`None`: no such directory on this host, as
    /// for a fake or a remote backend). No default: a backend says which, so a floor is
    /// never skipped because a backend forgot it.
    fn data_root(&self) -> BoxFuture<'_, Result<Option<PathBuf>, DriverError>>;
}

/// Where a turn's workspace lives, and so who makes and measures it
/// ([`ContainerDriver::workspace_home`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkspaceHome {
    /// `workspace_root/<segment>` on this host, bind-mounted into the container: the host
    /// makes it (0700, never through a link) and its quota watcher measures it by
    /// descriptor, with the free-space floor of its filesystem.
    HostDir,
    /// Elsewhere (a volume of a backend whose containers are not on this host, see
    /// docs/scale-out.md): the host makes and measures nothing; the backend keeps the
    /// quota (`ContainerSpec::file_size_mb`) and ends a run that passes it.
    Backend,
}

/// [`HeldFiles`] from a listing of the turn's host processes: a failed listing is
/// unmeasurable, never an empty one.
pub(crate) fn held_by_host_processes(listed: Result<ContainerProcesses, DriverError>) -> HeldFiles {
    match listed {
        Ok(p) => HeldFiles::HostProcesses(p),
        Err(e) => HeldFiles::Unmeasurable(Unmeasurable::Processes(crate::one_line(&e))),
    }
}

/// A byte stream between a guest and its broker, carried by the backend (a relay, a
/// tunnel, an in-memory pipe): the broker serves HTTP/1.1 on it as on its unix socket.
pub trait GuestStream:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static
{
}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static> GuestStream for T {}

/// How a turn's guest reaches its broker (see [`ContainerDriver::broker_transport`]).
#[non_exhaustive]
pub enum BrokerTransport {
    /// The turn binds a unix listener at `<run_dir>/broker.sock`; the backend mounts the
    /// run dir into the container (read-only, at [`roundtable_sandbox_protocol::RUN_MOUNT`]).
    /// Each peer's uid is checked (SO_PEERCRED) unless the configuration turns it off.
    UnixSocket,
    /// The backend carries each of the guest's connections to the host itself and hands it
    /// over on this channel; the broker serves every stream it receives until the turn
    /// ends. There is no socket file and no peer check: the backend vouches that each
    /// stream comes from this turn's container.
    Streams(tokio::sync::mpsc::Receiver<Box<dyn GuestStream>>),
}

impl std::fmt::Debug for BrokerTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BrokerTransport::UnixSocket => f.write_str("UnixSocket"),
            BrokerTransport::Streams(_) => f.write_str("Streams"),
        }
    }
}

/// What a sweep may remove (see [`ContainerDriver::sweep`]).
#[derive(Clone, Copy)]
pub struct SweepScope<'a> {
    /// The runtime instance (the value of [`LABEL_RUNTIME`]).
    pub instance: &'a str,
    /// The run root: a container whose run dir lies elsewhere belongs to another runtime
    /// that shares the instance name, and is left alone.
    pub run_root: &'a std::path::Path,
    /// Whether the named container is a live turn's (never removed).
    pub live: &'a (dyn Fn(&str) -> bool + Send + Sync),
}

impl std::fmt::Debug for SweepScope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SweepScope")
            .field("instance", &self.instance)
            .field("run_root", &self.run_root)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend that implements only what the trait requires.
    #[derive(Debug)]
    struct Minimal;

    impl ContainerDriver for Minimal {
        fn run<'a>(
            &'a self,
            _: &'a ContainerSpec,
            _: &'a [u8],
            _: CancellationToken,
        ) -> BoxFuture<'a, Result<RunOutcome, DriverError>> {
            Box::pin(async { Err(DriverError::Unsupported { op: "run" }) })
        }
        fn remove<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
            Box::pin(async { Ok(()) })
        }
        fn sweep<'a>(
            &'a self,
            _: SweepScope<'a>,
        ) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
            Box::pin(async { Ok(Vec::new()) })
        }
        fn data_root(&self) -> BoxFuture<'_, Result<Option<PathBuf>, DriverError>> {
            Box::pin(async { Ok(None) })
        }
    }

    /// What a backend does not implement is unmeasurable or unknown, never "nothing held"
    /// or "not killed".
    #[tokio::test]
    async fn the_defaults_fail_closed() {
        match Minimal.held_files("c").await {
            HeldFiles::Unmeasurable(why) => assert_eq!(
                why.to_string(),
                "the processes of the turn could not be listed: the container driver cannot list processes"
            ),
            other => panic!("a backend without processes counted as {other:?}"),
        }
        assert!(Minimal.processes("c").await.is_err());
        assert!(Minimal.oom_killed("c").await.is_err());
        // What MCP sessions need: refused, so no session runs on a backend without it.
        let is_unsupported = |e: DriverError| matches!(e, DriverError::Unsupported { .. });
        let spec = SessionSpec {
            name: "s".into(),
            image: "i".into(),
            uid: 1,
            gid: 1,
            memory_mb: 1,
            cpus: 1.0,
            pids: 1,
            tmpfs_mb: 1,
            file_size_mb: 1,
            labels: BTreeMap::new(),
            argv: vec!["x".into()],
            env: Vec::new(),
            working_dir: "/".into(),
            mounts: Vec::new(),
            network: false,
            runtime: None,
            measured: "/data".into(),
        };
        assert!(is_unsupported(
            Minimal.start_session(&spec).await.unwrap_err()
        ));
        assert!(is_unsupported(Minimal.pause("c").await.unwrap_err()));
        assert!(is_unsupported(Minimal.resume("c").await.unwrap_err()));
        assert!(is_unsupported(
            Minimal.list_labelled(&[]).await.unwrap_err()
        ));
        assert!(is_unsupported(
            Minimal.image_file("i", "/f", 1).await.unwrap_err()
        ));
    }
}
