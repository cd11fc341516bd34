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
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roundtable_sandbox_protocol::{Reply, Speaker, Turn};
use sha2::Digest;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::broker::{BrokerEvent, TurnContext};
use crate::driver::{ContainerSpec, DriverError, LABEL_CHANNEL, LABEL_RUNTIME, LABEL_TURN};
use crate::Sandbox;

/// What the caller asks of one turn.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    pub channel: String,
    pub speaker: Speaker,
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
    Preparing,
    BrokerListening,
    ContainerRunning,
    /// The broker forwards a model call (reported at each call).
    ModelCall,
    /// The broker runs a host or MCP tool (reported at each call).
    ToolCall,
    Replied,
    TearingDown,
    Done,
}

/// Receives phase changes of a turn.
pub type PhaseObserver = Arc<dyn Fn(TurnPhase) + Send + Sync>;

/// Errors of a turn, before it is turned into an `{ok:false}` reply.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    #[error("turn timed out after {0:?}")]
    Timeout(Duration),
    /// The turn's timeout passed while it waited for a container slot (the actor layer's
    /// global cap); it never started.
    #[error("turn timed out after {timeout:?} waiting for a container slot (all {slots} in use)")]
    SlotTimeout { timeout: Duration, slots: usize },
    #[error("turn stopped")]
    Stopped,
    #[error("create workspace {path}: {source}")]
    CreateWorkspace {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("create run dir under {path}: {source}")]
    CreateRunDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("broker socket path too long: {0}")]
    SocketPathTooLong(PathBuf),
    #[error("start broker: {0}")]
    Broker(#[from] crate::broker::BrokerError),
    #[error("{0}")]
    Driver(#[from] DriverError),
    #[error("{0}")]
    Quota(#[from] crate::quota::QuotaError),
}

/// `hex(sha256(channel))`: the channel's workspace segment.
pub fn channel_segment(channel: &str) -> String {
    hex::encode(sha2::Sha256::digest(channel.as_bytes()))
}

/// Runs one turn. `on_reply` sees the reply before any cleanup; the same reply is returned
/// after cleanup. Never panics on a failing part; every failure is an `{ok:false}` reply.
pub async fn run_turn(
    sandbox: &Sandbox,
    request: TurnRequest,
    on_reply: impl FnOnce(&Reply),
    observer: Option<PhaseObserver>,
) -> Reply {
    let turn_id = uuid::Uuid::new_v4().simple().to_string();
    let segment = channel_segment(&request.channel);
    let span = tracing::info_span!(
        "turn",
        channel = &segment[..16],
        turn = &turn_id[..8],
        reset = request.reset
    );
    run_turn_inner(sandbox, request, on_reply, observer, turn_id, segment)
        .instrument(span)
        .await
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

/// The turn's container name, registered as live (the sweep skips it) for the turn's life.
struct LiveContainer<'a> {
    sandbox: &'a Sandbox,
    name: &'a str,
}

impl Drop for LiveContainer<'_> {
    fn drop(&mut self) {
        self.sandbox.live_turns().containers.remove(self.name);
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
    on_reply: impl FnOnce(&Reply),
    observer: Option<PhaseObserver>,
    turn_id: String,
    segment: String,
) -> Reply {
    let phase = |p: TurnPhase| {
        if let Some(o) = &observer {
            o(p);
        }
    };
    let config = sandbox.config();
    let started = Instant::now();
    phase(TurnPhase::Preparing);

    let workspace_dir = config.workspace_root.join(&segment);
    let container_name = format!("roundtable-sandbox-{}-{}", &segment[..16], &turn_id[..8]);
    let mut run_dir = RunDir {
        sandbox,
        path: None,
    };
    sandbox
        .live_turns()
        .containers
        .insert(container_name.clone());
    let _live_container = LiveContainer {
        sandbox,
        name: &container_name,
    };
    let mut listener = None;
    let mut container_started = false;
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
        let quota = config.config.limits.workspace_quota();
        let floor = config.config.limits.disk_floor();
        let prepare = async {
            make_workspace(&workspace_dir)?;
            // Held open for the whole turn: every measure starts from this descriptor and never
            // follows a guest path (see crate::quota).
            // A workspace the guest locked (`chmod 000 /workspace`) cannot be measured.
            let workspace =
                Arc::new(crate::quota::Workspace::open(&workspace_dir).map_err(|e| {
                    crate::quota::QuotaError::Measure(format!("open the workspace: {e}"))
                })?);
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
            // Created and registered under the live-turns lock, which the sweep holds while
            // it removes stale run dirs: a sweep never sees this dir unregistered.
            let dir = {
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
                dir
            };
            run_dir.path = Some(dir.clone());
            let socket = dir.join("broker.sock");
            if socket.as_os_str().len() > crate::config::MAX_SOCKET_PATH {
                return Err(TurnError::SocketPathTooLong(socket));
            }
            let events: Option<crate::broker::BrokerEvents> = observer.clone().map(|o| {
                Arc::new(move |e: BrokerEvent| {
                    o(match e {
                        BrokerEvent::ModelCall => TurnPhase::ModelCall,
                        BrokerEvent::ToolCall => TurnPhase::ToolCall,
                    })
                }) as crate::broker::BrokerEvents
            });
            let ctx = TurnContext {
                channel: request.channel.clone(),
                speaker: request.speaker.clone(),
                cancel: cancel.clone(),
                events,
            };
            let l = tokio::select! {
                l = sandbox.broker().listen(&socket, ctx) => l?,
                _ = request.stop.cancelled() => return Err(TurnError::Stopped),
            };
            listener = Some(l);
            Ok::<_, TurnError>((workspace, guarded, dir))
        };
        let (workspace, guarded, dir) = tokio::select! {
            biased;
            _ = request.stop.cancelled() => return Err(TurnError::Stopped),
            _ = &mut deadline => return Err(TurnError::Timeout(timeout)),
            prepared = prepare => prepared?,
        };
        phase(TurnPhase::BrokerListening);
        tracing::debug!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "broker listening"
        );

        let (tools, mcp) = sandbox.broker().turn_tools();
        let turn = Turn {
            text: request.text.clone(),
            speaker: request.speaker.clone(),
            model: config.config.model.clone(),
            prompt: config.prompt.clone(),
            time_zone: config.time_zone.clone(),
            reset: request.reset,
            tools,
            mcp,
            max_steps: config.config.max_steps,
            session_budget: config.config.session_budget,
        };
        let stdin = serde_json::to_vec(&turn).expect("a turn always serialises");
        let spec = container_spec(
            sandbox,
            &container_name,
            &segment,
            &turn_id,
            &dir,
            &workspace_dir,
        );

        phase(TurnPhase::ContainerRunning);
        container_started = true;
        let run = sandbox.driver().run(&spec, &stdin, cancel.clone());
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
        match (outcome, why) {
            (Ok(reply), None) => Ok(reply),
            (_, Some(reason)) => Err(reason),
            (Err(DriverError::Cancelled), None) => Err(TurnError::Stopped),
            (Err(e), None) => Err(e.into()),
        }
    }
    .await;

    let reply = match result {
        Ok(reply) => reply,
        Err(e) => {
            tracing::info!(error = %e, "turn failed");
            Reply::error(e.to_string())
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
        if !container_started {
            return Ok(());
        }
        sandbox
            .driver()
            .remove(&container_name)
            .await
            .map_err(|e| format!("remove container {container_name}: {e}"))
    };
    let (stopped, removed) = tokio::join!(stop_listener, remove_container);
    cleanup_errors.extend(stopped.err());
    cleanup_errors.extend(removed.err());
    if let Err(e) = run_dir.remove() {
        cleanup_errors.push(format!("remove run dir: {e}"));
    }
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

fn make_workspace(dir: &Path) -> Result<(), TurnError> {
    let err = |source| TurnError::CreateWorkspace {
        path: dir.to_owned(),
        source,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            // Never follow a link planted in place of the workspace.
            let meta = std::fs::symlink_metadata(dir).map_err(err)?;
            if meta.is_dir() {
                Ok(())
            } else {
                Err(err(std::io::Error::other("not a directory")))
            }
        }
        Err(e) => Err(err(e)),
    }
}

fn container_spec(
    sandbox: &Sandbox,
    name: &str,
    segment: &str,
    turn_id: &str,
    run_dir: &Path,
    workspace_dir: &Path,
) -> ContainerSpec {
    let config = sandbox.config();
    let limits = &config.config.limits;
    ContainerSpec {
        name: name.to_owned(),
        image: config.config.image.clone(),
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
        command: config.config.command.clone(),
        runtime: config.config.runtime.clone(),
    }
}
