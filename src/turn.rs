//! The turn runner: one turn's resources, from run dir to teardown.
//!
//! [`run_turn`] is the equivalent of `runSandboxTurn` in pi-roundtable-sandbox 0.7.18 (the
//! TypeScript package this ports): it makes the channel's workspace (0700) and a fresh run
//! dir (`mkdtemp run_root/turn-XXXXXX`), starts the broker listener on
//! `<run_dir>/broker.sock`, runs the container through the driver, hands the
//! reply to a callback **before** cleanup, then tears down on every path: listener stopped,
//! container removed, run dir removed. The host never reads a workspace file.
//!
//! The turn timeout counts from the turn's admission ([`TurnRequest::admitted`], default:
//! the call), as the TypeScript package arms its timer in `runTurn` before anything else:
//! it covers the workspace checks, the broker's start and the container (and, in the actor
//! layer, the wait for a container slot). Teardown runs after it, on every path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roundtable_sandbox_protocol::{Reply, Speaker, Turn};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::broker::{BrokerEvent, BrokerListener, TurnContext};
use crate::driver::{
    BrokerTransport, ContainerDriver, ContainerSpec, DriverError, RunOutcome, LABEL_CHANNEL,
    LABEL_RUNTIME, LABEL_TURN,
};
use crate::prepared::{Prepared, PreparedTurn};
use crate::Sandbox;

/// What the caller asks of one turn.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    /// The channel (any string; the workspace is named by its hash).
    pub channel: String,
    /// Who wrote the message.
    pub speaker: Speaker,
    /// The message.
    pub text: String,
    /// Start a fresh session (the reset generation at admission was above zero).
    pub reset: bool,
    /// Fired by the caller to stop the turn.
    pub stop: CancellationToken,
    /// When the turn was admitted: its timeout counts from here (`None`: from the call of
    /// [`run_turn`]). The actor layer sets it to the channel's admission, so the wait for a
    /// container slot counts too.
    pub admitted: Option<Instant>,
}

/// Where a turn is; reported to an optional observer (progress display, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnPhase {
    /// Creating the workspace and run dir, checking quota and floor.
    Preparing,
    /// The broker listens on the turn's socket.
    BrokerListening,
    /// The container runs.
    ContainerRunning,
    /// The broker forwards a model call (reported at each call).
    ModelCall,
    /// The broker runs a host or MCP tool (reported at each call).
    ToolCall,
    /// The reply is known.
    Replied,
    /// The container, listener and run dir are being removed.
    TearingDown,
    /// Everything is removed.
    Done,
}

/// Receives phase changes of a turn.
pub type PhaseObserver = Arc<dyn Fn(TurnPhase) + Send + Sync>;

/// Errors of a turn, before it is turned into an `{ok:false}` reply.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The turn's timeout passed.
    #[error("turn timed out after {0:?}")]
    Timeout(Duration),
    /// The turn's timeout passed while it waited for a container slot (the actor layer's
    /// global cap); it never started.
    #[error("turn timed out after {timeout:?} waiting for a container slot (all {slots} in use)")]
    SlotTimeout {
        /// The turn's timeout.
        timeout: Duration,
        /// The container slots.
        slots: usize,
    },
    /// The caller stopped the turn.
    #[error("turn stopped")]
    Stopped,
    /// The channel's workspace could not be created.
    #[error("create workspace {path}")]
    CreateWorkspace {
        /// The workspace.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The channel's existing workspace is not a private directory of the service user.
    #[error("workspace {path} must be a directory of the service user (uid {uid}) with no group or other permission bits: found uid {owner}, mode {mode:o}")]
    WorkspaceNotPrivate {
        /// The workspace.
        path: PathBuf,
        /// The service user.
        uid: u32,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
    },
    /// The workspace's path no longer names the directory the turn made and holds: the
    /// workspace root (or the directory) was moved or replaced since.
    #[error("workspace {path} no longer names the directory made for the turn (the workspace root was moved or replaced)")]
    WorkspaceReplaced {
        /// The workspace.
        path: PathBuf,
    },
    /// The turn's run dir could not be created.
    #[error("create run dir under {path}")]
    CreateRunDir {
        /// The run root.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The turn's socket path is too long.
    #[error("broker socket path too long: {0}")]
    SocketPathTooLong(PathBuf),
    /// The broker could not listen.
    #[error("start broker")]
    Broker(#[from] crate::broker::BrokerError),
    /// The driver failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The workspace is over its quota or a filesystem below its floor.
    #[error(transparent)]
    Quota(#[from] crate::quota::QuotaError),
    /// The engine reports that the memory limit killed the guest.
    #[error("guest killed: out of memory (limit {limit_mb} MiB)")]
    OutOfMemory {
        /// The memory limit.
        limit_mb: u64,
    },
    /// The guest died of `SIGXFSZ` (its init exits `128+SIGXFSZ`): `RLIMIT_FSIZE` was hit.
    #[error("guest killed: a file grew past the workspace quota ({limit_mb} MiB)")]
    FileTooLarge {
        /// The workspace quota.
        limit_mb: u64,
    },
    /// The container exited non-zero (137 under the init process: `SIGKILL`).
    #[error("guest exited with code {code}")]
    Exit {
        /// The exit code.
        code: i64,
    },
    /// The guest's output is not a reply.
    #[error(transparent)]
    Reply(#[from] ReplyError),
}

/// Why the guest's stdout is not a reply (see [`parse_reply`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplyError {
    #[error("guest output exceeds {cap} bytes")]
    /// The output passed its cap.
    OutputTooLarge {
        /// The cap.
        cap: usize,
    },
    #[error("guest output is not a valid reply: {reason}")]
    /// The output is not one JSON reply.
    MalformedOutput {
        /// Why.
        reason: String,
    },
}

/// Why a turn did not give the guest's own successful answer: what a bot matches on to
/// answer each case its own way (the reply's `error` text stays for display).
///
/// The core reports the kinds a turn can end with; the actor layer adds its own refusals
/// (`Busy`, `ShuttingDown`, …). New kinds may come: match with a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TurnFailure {
    /// The turn's timeout passed (counted from admission).
    Timeout,
    /// The timeout passed while the turn waited for a container slot; it never started.
    SlotTimeout,
    /// The turn was stopped (a `Stop`, or the caller's token).
    Stopped,
    /// The memory limit killed the guest.
    OutOfMemory,
    /// The workspace is (or grew) over its quota, or a file passed it (`RLIMIT_FSIZE`).
    OverQuota,
    /// A guarded filesystem is below its free-space floor (or cannot be measured).
    DiskFloor,
    /// The guest itself reported a failure (the reply's error carries
    /// [`GUEST_ERROR_PREFIX`]).
    GuestError,
    /// The guest's stdout was not a valid reply, or exceeded the output cap.
    MalformedOutput,
    /// The guest exited non-zero without a reply.
    GuestExit,
    /// The container engine cannot be reached.
    EngineUnavailable,
    /// The sandbox image is missing.
    ImageMissing,
    /// The engine refused or failed a call, or the host could not prepare the turn (its
    /// workspace, run dir or broker).
    Internal,
    /// The actor layer: the channel's queue is full.
    Busy,
    /// The actor layer: the supervisor is shutting down.
    ShuttingDown,
    /// The actor layer: the channel's worker failed and was restarted mid-turn.
    ChannelRestarted,
}

impl TurnError {
    /// The kind of failure, for an embedder that answers each differently.
    pub fn failure(&self) -> TurnFailure {
        use crate::quota::QuotaError;
        match self {
            TurnError::Timeout(_) => TurnFailure::Timeout,
            TurnError::SlotTimeout { .. } => TurnFailure::SlotTimeout,
            TurnError::Stopped | TurnError::Driver(DriverError::Cancelled) => TurnFailure::Stopped,
            TurnError::OutOfMemory { .. } => TurnFailure::OutOfMemory,
            TurnError::FileTooLarge { .. }
            | TurnError::Quota(QuotaError::Exceeded { .. } | QuotaError::Measure(_)) => {
                TurnFailure::OverQuota
            }
            TurnError::Quota(_) => TurnFailure::DiskFloor,
            TurnError::Exit { .. } => TurnFailure::GuestExit,
            TurnError::Reply(_) => TurnFailure::MalformedOutput,
            TurnError::Driver(DriverError::DaemonUnreachable { .. }) => {
                TurnFailure::EngineUnavailable
            }
            TurnError::Driver(DriverError::ImageMissing { .. }) => TurnFailure::ImageMissing,
            TurnError::Driver(_)
            | TurnError::CreateWorkspace { .. }
            | TurnError::WorkspaceNotPrivate { .. }
            | TurnError::WorkspaceReplaced { .. }
            | TurnError::CreateRunDir { .. }
            | TurnError::SocketPathTooLong(_)
            | TurnError::Broker(_) => TurnFailure::Internal,
        }
    }
}

/// One turn's end: the wire [`Reply`] (as the guest or the host wrote it) and, when it is
/// not a success, the typed reason. Dereferences to the reply.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnOutcome {
    /// The reply, as the guest or the host wrote it.
    pub reply: Reply,
    /// `None` exactly when `reply.ok`.
    pub failure: Option<TurnFailure>,
}

impl TurnOutcome {
    /// The outcome of a turn that failed with `error` (its reply carries the message).
    pub fn failed(error: &TurnError) -> Self {
        Self {
            reply: Reply::error(crate::one_line(error)),
            failure: Some(error.failure()),
        }
    }

    /// The outcome of a reply the guest wrote (a guest-reported failure is `GuestError`).
    pub fn from_guest(reply: Reply) -> Self {
        let failure = (!reply.ok).then_some(TurnFailure::GuestError);
        Self { reply, failure }
    }

    /// The wire reply.
    pub fn into_reply(self) -> Reply {
        self.reply
    }
}

impl std::ops::Deref for TurnOutcome {
    type Target = Reply;
    fn deref(&self) -> &Reply {
        &self.reply
    }
}

impl From<TurnOutcome> for Reply {
    fn from(o: TurnOutcome) -> Reply {
        o.reply
    }
}

testing_pub! {
    /// Judges what a container did, the same for every backend: an OOM kill, then the output
    /// cap, then `128+SIGXFSZ` (the file-size limit), then any non-zero exit, and only then the
    /// strict parse of stdout.
    fn judge(outcome: &RunOutcome, spec: &ContainerSpec) -> Result<Reply, TurnError> {
        if outcome.oom_killed {
            return Err(TurnError::OutOfMemory {
                limit_mb: spec.memory_mb,
            });
        }
        if outcome.stdout_overflow {
            return Err(ReplyError::OutputTooLarge {
                cap: spec.output_cap,
            }
            .into());
        }
        if outcome.exit_code == 128 + libc::SIGXFSZ as i64 {
            return Err(TurnError::FileTooLarge {
                limit_mb: spec.file_size_mb,
            });
        }
        if outcome.exit_code != 0 {
            return Err(TurnError::Exit {
                code: outcome.exit_code,
            });
        }
        Ok(parse_reply(&outcome.stdout, spec.output_cap)?)
    }
}

/// Judges a run; when it did not answer (a non-zero exit, the output cap, output that is
/// not a reply), first asks the driver whether the memory limit killed a process of the
/// container, which then takes precedence as in [`judge`]. A guest that exits 0 with a reply
/// has answered, whatever befell its children (a tool's OOM kill is the tool's failure,
/// which the guest saw): its turn costs no engine call. A failure to ask is logged and
/// leaves the judgement as it is.
async fn judge_run(
    mut run: RunOutcome,
    spec: &ContainerSpec,
    driver: &dyn ContainerDriver,
) -> Result<Reply, TurnError> {
    let judged = judge(&run, spec);
    if judged.is_ok() || run.oom_killed {
        return judged;
    }
    match driver.oom_killed(&spec.name).await {
        Ok(true) => {
            run.oom_killed = true;
            judge(&run, spec)
        }
        Ok(false) => judged,
        Err(e) => {
            tracing::warn!(container = %spec.name, error = %e, "ask whether an OOM kill ended the turn");
            judged
        }
    }
}

/// Strictly parses the guest's stdout: exactly one [`Reply`] JSON document (whitespace
/// around it allowed), no unknown field, a consistent shape, at most `cap` bytes. A failed
/// reply's error is prefixed with [`GUEST_ERROR_PREFIX`].
pub fn parse_reply(stdout: &[u8], cap: usize) -> Result<Reply, ReplyError> {
    if stdout.len() > cap {
        return Err(ReplyError::OutputTooLarge { cap });
    }
    if stdout.iter().all(u8::is_ascii_whitespace) {
        return Err(ReplyError::MalformedOutput {
            reason: "no output".into(),
        });
    }
    let mut reply: Reply =
        serde_json::from_slice(stdout).map_err(|e| ReplyError::MalformedOutput {
            reason: e.to_string(),
        })?;
    reply
        .check_shape()
        .map_err(|reason| ReplyError::MalformedOutput {
            reason: reason.into(),
        })?;
    // A failure the guest reports is marked as the guest's: it can never pass for one of
    // the host's own errors (a timeout, a stop, an out-of-memory kill).
    if let Some(error) = reply.error.take() {
        reply.error = Some(format!("{GUEST_ERROR_PREFIX}{error}"));
    }
    Ok(reply)
}

/// What every failure reported by the guest itself starts with (see [`parse_reply`]).
pub const GUEST_ERROR_PREFIX: &str = "the guest reported an error: ";

pub use crate::channel::channel_segment;

/// Runs one turn. `on_reply` sees the reply before any cleanup; the same reply is returned
/// after cleanup. Never panics on a failing part; every failure is an `{ok:false}` reply.
/// [`run_turn_outcome`] gives the typed failure beside it.
pub async fn run_turn(
    sandbox: &Sandbox,
    request: TurnRequest,
    on_reply: impl FnOnce(&Reply),
    observer: Option<PhaseObserver>,
) -> Reply {
    run_turn_outcome(sandbox, request, |o| on_reply(&o.reply), observer)
        .await
        .reply
}

/// [`run_turn`], with the reply's typed failure ([`TurnOutcome`]) given to `on_reply`
/// (before any cleanup) and returned (after it).
pub async fn run_turn_outcome(
    sandbox: &Sandbox,
    request: TurnRequest,
    on_reply: impl FnOnce(&TurnOutcome),
    observer: Option<PhaseObserver>,
) -> TurnOutcome {
    run_turn_prepared(sandbox, request, None, on_reply, observer).await
}

/// [`run_turn_outcome`] in the container `prepared` for this channel's turn, if given (see
/// [`crate::warm`]): the same checks, broker and teardown as a cold turn, without the
/// container's create and start. A prepared container that cannot serve (exited, removed,
/// the engine does not answer) is removed and the turn starts cold, the reason logged.
pub async fn run_turn_prepared(
    sandbox: &Sandbox,
    request: TurnRequest,
    prepared: Option<PreparedTurn>,
    on_reply: impl FnOnce(&TurnOutcome),
    observer: Option<PhaseObserver>,
) -> TurnOutcome {
    let mut prepared = prepared.and_then(PreparedTurn::take);
    if let Some(p) = prepared.take_if(|p| p.channel != request.channel) {
        tracing::warn!(container = %p.spec.name, "a container prepared for another channel is not adopted");
        crate::prepared::remove(p).await;
    }
    let turn_id = prepared
        .as_ref()
        .map_or_else(new_turn_id, |p| p.turn_id.clone());
    let segment = channel_segment(&request.channel);
    let span = tracing::info_span!(
        "turn",
        channel = &segment[..16],
        turn = &turn_id[..8],
        reset = request.reset,
        warm = prepared.is_some()
    );
    run_turn_inner(
        sandbox, request, prepared, on_reply, observer, turn_id, segment,
    )
    .instrument(span)
    .await
}

fn new_turn_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// A turn's container name: `roundtable-sandbox-<segment[..16]>-<turn[..8]>`.
pub(crate) fn container_name(segment: &str, turn_id: &str) -> String {
    format!("roundtable-sandbox-{}-{}", &segment[..16], &turn_id[..8])
}

/// Makes a fresh run dir (`mkdtemp run_root/turn-XXXXXX`, 0700), created and registered
/// under the live-turns lock, which the sweep holds while it removes stale run dirs: a
/// sweep never sees it unregistered.
pub(crate) fn make_run_dir(sandbox: &Sandbox) -> Result<PathBuf, TurnError> {
    let config = sandbox.config();
    let mut live = sandbox.live_turns();
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
    Ok(dir)
}

/// The turn's run dir, registered as live (the sweep skips it) until removed.
struct RunDir<'a> {
    sandbox: &'a Sandbox,
    path: Option<PathBuf>,
}

impl RunDir<'_> {
    fn remove(&mut self) -> Result<(), std::io::Error> {
        match self.path.take() {
            Some(p) => {
                let result = match std::fs::remove_dir_all(&p) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                    _ => Ok(()),
                };
                self.sandbox.live_turns().run_dirs.remove(&p);
                result
            }
            None => Ok(()),
        }
    }
}

/// The turn's container name, registered as live (the sweep skips it) for the turn's life;
/// `started` while a container of that name exists that the turn must remove. When the
/// turn's future is dropped before its teardown (a panicking or aborted caller, a panicking
/// reply callback), the drop unregisters it and spawns its removal: for a prepared
/// container, and for a cold one after its run returned, there is no other guard.
struct LiveContainer<'a> {
    sandbox: &'a Sandbox,
    name: String,
    started: bool,
}

impl LiveContainer<'_> {
    fn register(&mut self, name: String) {
        self.sandbox.live_turns().containers.insert(name.clone());
        self.unregister();
        self.name = name;
    }

    fn unregister(&mut self) {
        let name = std::mem::take(&mut self.name);
        if !name.is_empty() {
            self.sandbox.live_turns().containers.remove(&name);
        }
    }
}

impl Drop for LiveContainer<'_> {
    fn drop(&mut self) {
        if std::mem::take(&mut self.started) {
            let (driver, name) = (self.sandbox.driver().clone(), self.name.clone());
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    handle.spawn(async move {
                        if let Err(e) = driver.remove(&name).await {
                            tracing::warn!(container = %name, error = %e, "remove the container of a dropped turn");
                        }
                    });
                }
                Err(_) => tracing::warn!(
                    container = %self.name,
                    "turn dropped without a runtime; the startup sweep removes its container"
                ),
            }
        }
        self.unregister();
    }
}

impl Drop for RunDir<'_> {
    fn drop(&mut self) {
        // The future was dropped before teardown (an aborted or panicking caller).
        let _ = self.remove();
    }
}

async fn run_turn_inner(
    sandbox: &Sandbox,
    request: TurnRequest,
    mut prepared: Option<Prepared>,
    on_reply: impl FnOnce(&TurnOutcome),
    observer: Option<PhaseObserver>,
    mut turn_id: String,
    segment: String,
) -> TurnOutcome {
    let phase = |p: TurnPhase| {
        if let Some(o) = &observer {
            o(p);
        }
    };
    let config = sandbox.config();
    let started = Instant::now();
    phase(TurnPhase::Preparing);

    let workspace_dir = config.workspace_root.join(&segment);
    let mut container_name = container_name(&segment, &turn_id);
    let mut run_dir = RunDir {
        sandbox,
        path: None,
    };
    let mut live_container = LiveContainer {
        sandbox,
        name: String::new(),
        started: false,
    };
    let mut listener = None;
    if let Some(p) = &prepared {
        // From here on the prepared container and its run dir are this turn's: its
        // teardown removes them on every path.
        live_container.register(p.spec.name.clone());
        run_dir.path = Some(p.spec.run_dir.clone());
        live_container.started = true;
    } else {
        live_container.register(container_name.clone());
    }
    // The turn's own cancellation: stop, timeout and teardown all end broker calls with it.
    let cancel = request.stop.child_token();

    let timeout = config.turn_timeout;
    let deadline_at = tokio::time::Instant::from_std(request.admitted.unwrap_or(started)) + timeout;

    let result: Result<Reply, TurnError> = async {
        // One deadline for the whole turn, from admission: preparation and container.
        // Already past it: end before any preparation (a timer set in the past fires only
        // when the time driver next turns, which the preparation could outrun).
        if tokio::time::Instant::now() >= deadline_at {
            return Err(TurnError::Timeout(timeout));
        }
        let deadline = tokio::time::sleep_until(deadline_at);
        tokio::pin!(deadline);
        let quota = config.limits.workspace_quota();
        let floor = config.limits.disk_floor();
        let prepare = async {
            // Made and opened relative to the workspace root held since startup, and held
            // open for the whole turn: every measure starts from this descriptor and never
            // follows a guest path (see crate::quota).
            let workspace = Arc::new(make_workspace(sandbox, &segment)?);
            // The filesystems the free-space floor guards: the workspaces', the engine's.
            let mut guarded = vec![crate::quota::Guarded {
                what: "the workspaces",
                path: config.workspace_root.clone(),
            }];
            if floor.is_on() {
                let data_root = tokio::select! {
                    r = sandbox.driver().data_root() => r?,
                    _ = request.stop.cancelled() => return Err(TurnError::Stopped),
                };
                if let Some(path) = data_root {
                    guarded.push(crate::quota::Guarded {
                        what: "the engine's data root",
                        path,
                    });
                }
            }
            // A filesystem below its floor, or a workspace over its quota, refuses the turn.
            let (ws, g) = (workspace.clone(), guarded.clone());
            tokio::task::spawn_blocking(move || {
                crate::quota::check_floor(&g, &floor)?;
                crate::quota::check(&ws, &quota, None)
            })
            .await
            .map_err(|e| crate::quota::QuotaError::Measure(e.to_string()))??;
            // A prepared container must still wait for its turn; otherwise it is removed and
            // this turn starts cold.
            // It serves only the directory it was made for: a workspace moved aside or
            // deleted since (the container still has the old directory mounted) is not the
            // one this turn holds and measures.
            if let Some(p) = &mut prepared {
                let checked = if p.workspace != workspace.id() {
                    Err(WORKSPACE_NOT_THE_PREPARED.to_owned())
                } else {
                    tokio::select! {
                        r = p.started.check() => r.map_err(|e| e.to_string()),
                        _ = request.stop.cancelled() => return Err(TurnError::Stopped),
                    }
                };
                if let Err(e) = checked {
                    tracing::warn!(
                        container = %p.spec.name,
                        reason = %e,
                        "the prepared container cannot serve this turn; starting cold"
                    );
                    sandbox.count_warm(false);
                    let p = prepared.take().expect("checked above");
                    // The turn lets go of it first: removal is the fallback's, awaited.
                    run_dir.path = None;
                    live_container.started = false;
                    crate::prepared::remove(p).await;
                    turn_id = new_turn_id();
                    container_name = self::container_name(&segment, &turn_id);
                    live_container.register(container_name.clone());
                }
            }
            let spec = match &prepared {
                Some(p) => {
                    container_name = p.spec.name.clone();
                    p.spec.clone()
                }
                None => {
                    let dir = make_run_dir(sandbox)?;
                    run_dir.path = Some(dir.clone());
                    container_spec(
                        sandbox,
                        &container_name,
                        &segment,
                        &turn_id,
                        &dir,
                        &workspace_dir,
                    )
                }
            };
            let ctx = turn_context(&request, &cancel, &observer);
            let l = tokio::select! {
                l = bind_broker(sandbox, &spec, ctx) => l?,
                _ = request.stop.cancelled() => return Err(TurnError::Stopped),
            };
            listener = Some(l);
            Ok::<_, TurnError>((workspace, guarded, spec))
        };
        let (workspace, guarded, spec) = tokio::select! {
            biased;
            _ = request.stop.cancelled() => return Err(TurnError::Stopped),
            _ = &mut deadline => return Err(TurnError::Timeout(timeout)),
            prepared = prepare => prepared?,
        };
        phase(TurnPhase::BrokerListening);
        tracing::debug!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            warm = prepared.is_some(),
            "broker listening"
        );

        let (tools, mcp) = sandbox.broker().turn_tools();
        let turn = Turn {
            text: request.text.clone(),
            speaker: request.speaker.clone(),
            model: config.model.clone(),
            prompt: config.prompt.clone(),
            time_zone: config.time_zone.clone(),
            reset: request.reset,
            tools,
            mcp,
            max_steps: config.max_steps,
            session_budget: config.session_budget,
        };
        let stdin = serde_json::to_vec(&turn).expect("a turn always serialises");

        // The engine mounts the workspace by path: just before the container is created,
        // the path must still name the directory this turn made and holds (a prepared
        // container was checked before its start, and above against what this turn holds).
        if prepared.is_none() {
            check_mount_path(&workspace_dir, &workspace)?;
        }
        phase(TurnPhase::ContainerRunning);
        live_container.started = true;
        let run = match prepared.take() {
            Some(p) => {
                sandbox.count_warm(true);
                p.started.run(stdin, cancel.clone())
            }
            None => sandbox.driver().run(&spec, &stdin, cancel.clone()),
        };
        tokio::pin!(run);
        let over_quota = crate::quota::watch(crate::quota::Watch {
            workspace: workspace.clone(),
            quota,
            floor,
            guarded,
            driver: sandbox.driver().clone(),
            container: container_name.clone(),
        });
        tokio::pin!(over_quota);
        let mut why: Option<TurnError> = None;
        let outcome = tokio::select! {
            r = &mut run => r,
            e = &mut over_quota => {
                why = Some(TurnError::Quota(e));
                cancel.cancel();
                run.await
            }
            _ = &mut deadline => {
                why = Some(TurnError::Timeout(timeout));
                cancel.cancel();
                run.await
            }
            _ = request.stop.cancelled() => {
                why = Some(TurnError::Stopped);
                run.await
            }
        };
        if let Ok(run) = &outcome {
            if !run.stderr_tail.is_empty() {
                tracing::debug!(
                    container = %container_name,
                    stderr = %String::from_utf8_lossy(&run.stderr_tail),
                    "guest stderr"
                );
            }
        }
        match (outcome, why) {
            (Ok(run), None) => judge_run(run, &spec, sandbox.driver().as_ref()).await,
            (_, Some(reason)) => Err(reason),
            (Err(DriverError::Cancelled), None) => Err(TurnError::Stopped),
            (Err(e), None) => Err(e.into()),
        }
    }
    .await;
    // A prepared container not yet handed its turn (an early refusal) is this turn's to
    // remove: its handle goes now, its removal is the teardown's below.
    drop(prepared);

    let reply = match result {
        Ok(reply) => TurnOutcome::from_guest(reply),
        Err(e) => {
            tracing::info!(error = %e, "turn failed");
            TurnOutcome::failed(&e)
        }
    };
    phase(TurnPhase::Replied);
    on_reply(&reply);

    // Teardown: every step runs; the turn's reply stands, cleanup errors are logged.
    phase(TurnPhase::TearingDown);
    cancel.cancel();
    let mut cleanup_errors: Vec<String> = Vec::new();
    // The listener's stop and the container's removal are independent: overlapped, the
    // stop (a task to abort and join) hides behind the daemon's removal.
    let stop_listener = async {
        match listener.take() {
            Some(l) => l.stop().await.map_err(|e| format!("stop broker: {e}")),
            None => Ok(()),
        }
    };
    let remove_container = async {
        if !live_container.started {
            return Ok(());
        }
        sandbox
            .driver()
            .remove(&container_name)
            .await
            .map_err(|e| format!("remove container {container_name}: {e}"))
    };
    let (stopped, removed) = tokio::join!(stop_listener, remove_container);
    // Removed, or why not is logged below: the drop guard stands down (until here, a turn
    // dropped mid-removal is removed once more by it; a removal of an absent container is
    // not an error).
    live_container.started = false;
    cleanup_errors.extend(stopped.err());
    cleanup_errors.extend(removed.err());
    if let Err(e) = run_dir.remove() {
        cleanup_errors.push(format!("remove run dir: {e}"));
    }
    drop(live_container);
    for e in &cleanup_errors {
        tracing::warn!(error = %e, "turn cleanup");
    }
    tracing::info!(
        ok = reply.ok,
        total_ms = started.elapsed().as_millis() as u64,
        "turn done"
    );
    phase(TurnPhase::Done);
    reply
}

/// The broker's view of this turn: its channel, speaker and cancellation, and the phase
/// observer told of each call.
fn turn_context(
    request: &TurnRequest,
    cancel: &CancellationToken,
    observer: &Option<PhaseObserver>,
) -> TurnContext {
    let events: Option<crate::broker::BrokerEvents> = observer.clone().map(|o| {
        Arc::new(move |e: BrokerEvent| {
            o(match e {
                BrokerEvent::ModelCall => TurnPhase::ModelCall,
                BrokerEvent::ToolCall => TurnPhase::ToolCall,
            })
        }) as crate::broker::BrokerEvents
    });
    TurnContext {
        channel: request.channel.clone(),
        speaker: request.speaker.clone(),
        cancel: cancel.clone(),
        events,
    }
}

/// The broker's socket in a turn's run dir (the guest sees it at
/// [`roundtable_sandbox_protocol::BROKER_SOCKET`]).
pub const SOCKET_FILE: &str = "broker.sock";

/// Binds the broker to the turn, over the transport the backend asks for: a unix socket in
/// the turn's run dir (checked peer), or the byte streams the backend carries.
async fn bind_broker(
    sandbox: &Sandbox,
    spec: &ContainerSpec,
    ctx: TurnContext,
) -> Result<BrokerListener, TurnError> {
    match sandbox.driver().broker_transport(spec).await? {
        BrokerTransport::UnixSocket => {
            let socket = spec.run_dir.join(SOCKET_FILE);
            if socket.as_os_str().len() > crate::config::MAX_SOCKET_PATH {
                return Err(TurnError::SocketPathTooLong(socket));
            }
            Ok(sandbox.broker().listen(&socket, ctx).await?)
        }
        BrokerTransport::Streams(streams) => Ok(sandbox.broker().serve_streams(streams, ctx)),
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
pub(crate) fn make_workspace(
    sandbox: &Sandbox,
    segment: &str,
) -> Result<crate::quota::Workspace, TurnError> {
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
    let workspace = crate::quota::Workspace::open_at(root, segment)
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
pub(crate) fn check_mount_path(
    path: &Path,
    workspace: &crate::quota::Workspace,
) -> Result<(), TurnError> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if (meta.dev(), meta.ino()) == workspace.id() => Ok(()),
        _ => Err(TurnError::WorkspaceReplaced {
            path: path.to_owned(),
        }),
    }
}

pub(crate) fn container_spec(
    sandbox: &Sandbox,
    name: &str,
    segment: &str,
    turn_id: &str,
    run_dir: &Path,
    workspace_dir: &Path,
) -> ContainerSpec {
    let config = sandbox.config();
    let limits = &config.limits;
    ContainerSpec {
        name: name.to_owned(),
        image: config.image.clone(),
        run_dir: run_dir.to_owned(),
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
            (LABEL_CHANNEL.to_owned(), segment[..16].to_owned()),
            (LABEL_TURN.to_owned(), turn_id.to_owned()),
        ]),
        command: config.command.clone(),
        runtime: config.runtime.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_reply_is_strict() {
        assert_eq!(
            parse_reply(b" {\"ok\":true,\"text\":\"hi\"}\n", 100)
                .unwrap()
                .text
                .as_deref(),
            Some("hi")
        );
        let err = |b: &[u8]| parse_reply(b, 64).unwrap_err().to_string();
        assert_eq!(err(b""), "guest output is not a valid reply: no output");
        assert!(err(b"garbage").starts_with("guest output is not a valid reply: expected value"));
        assert!(err(b"{\"ok\":true,\"text\":\"a\"} trailing").contains("trailing characters"));
        assert!(err(b"{\"ok\":true,\"text\":\"a\",\"admin\":true}").contains("unknown field"));
        assert_eq!(
            err(b"{\"ok\":true}"),
            "guest output is not a valid reply: an ok reply must carry text and no error"
        );
        assert_eq!(err(&[b' '; 65]), "guest output exceeds 64 bytes");
        assert_eq!(
            parse_reply(b"{\"ok\":false,\"error\":\"turn stopped\"}", 100)
                .unwrap()
                .error
                .as_deref(),
            Some("the guest reported an error: turn stopped")
        );
    }

    fn spec() -> ContainerSpec {
        ContainerSpec {
            name: "c".into(),
            image: "i".into(),
            run_dir: "/r".into(),
            workspace_dir: "/w".into(),
            uid: 1,
            gid: 1,
            memory_mb: 256,
            cpus: 1.0,
            pids: 64,
            tmpfs_mb: 16,
            file_size_mb: 100,
            output_cap: 64,
            stderr_cap: 8,
            labels: BTreeMap::new(),
            command: None,
            runtime: None,
        }
    }

    /// The one mapping every backend's outcome goes through, in its order of precedence.
    #[test]
    fn a_run_outcome_is_judged_once_in_order() {
        let spec = spec();
        let run = |exit_code, oom_killed, stdout: &[u8], stdout_overflow| RunOutcome {
            exit_code,
            oom_killed,
            stdout: stdout.to_vec(),
            stdout_overflow,
            stderr_tail: Vec::new(),
        };
        let judged = |o: RunOutcome| judge(&o, &spec).map_err(|e| (e.failure(), e.to_string()));
        let ok = br#"{"ok":true,"text":"hi"}"#;
        assert_eq!(
            judged(run(0, false, ok, false)).unwrap().text.as_deref(),
            Some("hi")
        );
        assert_eq!(
            judged(run(137, true, ok, true)).unwrap_err(),
            (
                TurnFailure::OutOfMemory,
                "guest killed: out of memory (limit 256 MiB)".into()
            )
        );
        assert_eq!(
            judged(run(137, false, b"", true)).unwrap_err(),
            (
                TurnFailure::MalformedOutput,
                "guest output exceeds 64 bytes".into()
            )
        );
        assert_eq!(
            judged(run(128 + libc::SIGXFSZ as i64, false, ok, false)).unwrap_err(),
            (
                TurnFailure::OverQuota,
                "guest killed: a file grew past the workspace quota (100 MiB)".into()
            )
        );
        assert_eq!(
            judged(run(137, false, ok, false)).unwrap_err(),
            (TurnFailure::GuestExit, "guest exited with code 137".into())
        );
        assert_eq!(
            judged(run(0, false, b"nope", false)).unwrap_err().0,
            TurnFailure::MalformedOutput
        );
        let mut collector = crate::driver::OutputCollector::new(&spec);
        assert!(!collector.stdout(&[b'a'; 60]));
        assert!(collector.stdout(&[b'a'; 5]), "past the cap: kill");
        assert!(!collector.stdout(b"more"), "reported once");
        collector.stderr(b"0123456789");
        let o = collector.finish(3);
        assert!(o.stdout_overflow && o.stdout.is_empty());
        assert_eq!(o.stderr_tail, b"01234567");
        assert_eq!(o.exit_code, 3);
    }

    #[test]
    fn a_guest_failure_is_typed_as_the_guests() {
        let guest = parse_reply(br#"{"ok":false,"error":"turn timed out after 1s"}"#, 100).unwrap();
        let o = TurnOutcome::from_guest(guest);
        assert_eq!(o.failure, Some(TurnFailure::GuestError));
        assert_eq!(
            o.error.as_deref(),
            Some("the guest reported an error: turn timed out after 1s")
        );
        let o = TurnOutcome::failed(&TurnError::Timeout(Duration::from_secs(1)));
        assert_eq!(o.failure, Some(TurnFailure::Timeout));
        assert_eq!(o.error.as_deref(), Some("turn timed out after 1s"));
        let ok = TurnOutcome::from_guest(Reply::text("hi", Default::default()));
        assert_eq!(ok.failure, None);
    }
}
