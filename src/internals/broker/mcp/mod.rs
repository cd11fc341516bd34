//! The MCP bridge: `POST /v1/mcp/{server}/{tool}` through a pool of the broker's own MCP
//! client's sessions (`client`: every message read through the bounded reader).
//!
//! - [`validate_config`]: pure checks of one server's configuration (its scope and where
//!   `{channel}` may appear);
//! - [`McpPool::start`]: every server started once (stdio child or streamable HTTP), its
//!   tools listed, the allow-list checked against them, and each allow-listed tool's
//!   description and input schema **pinned**: one pin per server, for every session of it.
//!   A `shared` server keeps that session; a `channel` server's first session (a probe,
//!   with `{channel}` = [`PROBE_SEGMENT`]) is stopped once its tools are pinned;
//! - [`McpPool::call`]: only allow-listed tools; arguments validated against the pinned
//!   schema; the call goes to the caller's session (one per channel, started on the
//!   channel's first call, or the shared one) and carries the channel hash and the speaker
//!   in `_meta`; a session that starts (or restarts after dying) presenting an allow-listed
//!   tool that differs from the pin is refused from then on (tool rug-pull); the call is
//!   dropped, which sends `notifications/cancelled`, when the turn ends or the deadline
//!   passes;
//! - a shared session runs one call at a time, handed out fairly across channels (each
//!   channel's calls in order, round-robin between channels), its `call_timeout` starting
//!   once it holds the session; a call that does not finish stops the (stdio) session, and
//!   the calls waiting behind it, never sent, run on the restarted session ([`fair`]);
//! - channel sessions are bounded by the server's `max_sessions`: the least recently used
//!   idle one is stopped to make room, and a call that finds every session busy is refused;
//! - [`McpPool::release`]: a retired channel's sessions stopped;
//! - [`McpPool::shutdown`]: every session closed, then terminated and reaped.
//!
//! A stdio child gets only its configured env plus a few harmless variables, never the
//! runtime's whole env.

mod client;
pub(crate) mod container;
mod fair;
mod wire;

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::StatusCode;
use roundtable_sandbox_protocol::{McpServerSpec, ToolSpec};
use tokio::io::{AsyncBufReadExt, AsyncReadExt};
use tokio_util::sync::CancellationToken;

use self::client::{Client, ClientError};
use self::container::{Container, McpEngine};
use self::wire::AnswerError;
use super::bounded::Caps;
use super::http::{error_response, failure, refuse, Response};
use super::tools::{check_args_off_thread, compile_schema, tool_result};
use super::{BrokerError, TurnContext};
use crate::config::{McpScope, McpServer, McpTransport, CHANNEL_PLACEHOLDER, PROBE_SEGMENT};
use crate::driver::ContainerDriver;
use crate::events::Refusal;

/// Variables a stdio child inherits from the runtime; everything else it gets is configured.
const INHERITED_ENV: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"];
/// How long starting (or restarting) a server may take.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to exit at shutdown before it is killed.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
/// The `_meta` key of the channel's sha256 hex on every tool call.
pub const META_CHANNEL: &str = "roundtable-sandbox/channel";
/// The `_meta` key of the speaker (`{"id", "name"}`) on every tool call.
pub const META_SPEAKER: &str = "roundtable-sandbox/speaker";
/// The most pages of `tools/list` read from one server.
const MAX_TOOL_PAGES: usize = 16;

/// An allow-listed tool as first read.
struct Pinned {
    description: String,
    schema: serde_json::Value,
    validator: Arc<jsonschema::Validator>,
}

enum State {
    /// Not started yet, or its process died: (re)started on the next call.
    Stopped,
    Running(Box<Live>),
    /// It presented an allow-listed tool that differs from the pin.
    Refused(String),
    /// Stopped for good: its channel retired or it made room for another.
    Closed,
    /// The broker shut down.
    Shutdown,
}

/// A started session: its client and, when confined, its container, or its host child.
struct Live {
    client: Arc<Client>,
    container: Option<Container>,
    child: Option<HostChild>,
}

/// A host child (`confine = "host"`), reaped by a task of its own as soon as it exits.
/// Once its session ends (closed by the pool, or by the client at a cap) its stdin is
/// closed; a child that does not exit within half of [`SHUTDOWN_TIMEOUT`] gets SIGTERM,
/// then SIGKILL after as long again. Dropped, it is killed.
struct HostChild {
    exited: tokio::sync::watch::Receiver<bool>,
    _reaper: tokio_util::task::AbortOnDropHandle<()>,
}

impl HostChild {
    fn new(mut child: tokio::process::Child, closed: CancellationToken) -> Self {
        let (tx, exited) = tokio::sync::watch::channel(false);
        let grace = SHUTDOWN_TIMEOUT / 2;
        let reaper = tokio::spawn(async move {
            tokio::select! {
                _ = child.wait() => {}
                _ = closed.cancelled() => {
                    if tokio::time::timeout(grace, child.wait()).await.is_err() {
                        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                            let _ = nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(pid),
                                nix::sys::signal::Signal::SIGTERM,
                            );
                        }
                        if tokio::time::timeout(grace, child.wait()).await.is_err() {
                            tracing::warn!("MCP server did not close in time; killed");
                            let _ = child.kill().await;
                        }
                    }
                }
            }
            let _ = tx.send(true);
        });
        Self {
            exited,
            _reaper: tokio_util::task::AbortOnDropHandle::new(reaper),
        }
    }
}

/// Resolves with the error once a container session's data watcher stops it.
type Stopped = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>;

impl Live {
    fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    fn watcher(&self) -> Option<&container::Watcher> {
        self.container.as_ref().and_then(|c| c.watcher.as_ref())
    }

    fn stopped(&self) -> Option<Stopped> {
        self.watcher().map(|w| Box::pin(w.stopped()) as Stopped)
    }
}

/// One MCP session: a child process or container (stdio) or an MCP session (http).
pub(crate) struct Session {
    /// What `{channel}` becomes for it.
    segment: String,
    state: tokio::sync::Mutex<State>,
}

/// The live sessions of one server, by key (the channel's hash; `""` when shared).
#[derive(Default)]
struct Sessions {
    live: HashMap<String, (Arc<Session>, u64)>,
    /// Bumped on each use: the least recently used session has the smallest stamp.
    clock: u64,
    shut: bool,
}

struct Server {
    config: McpServer,
    scope: McpScope,
    cap: usize,
    pins: BTreeMap<String, Pinned>,
    sessions: std::sync::Mutex<Sessions>,
    /// A shared server's calls, one at a time in a fair order across channels
    /// ([`fair`]); unused by a channel-scoped server.
    fair: fair::FairQueue,
}

impl Server {
    fn table(&self) -> std::sync::MutexGuard<'_, Sessions> {
        // The table is only ever held for map operations; a poisoned lock holds valid data.
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The MCP servers of a broker.
pub(crate) struct McpPool {
    servers: BTreeMap<String, Arc<Server>>,
    /// Server names in configuration order (the order handed to the turn).
    order: Vec<String>,
    http: reqwest::Client,
    /// The engine of container-confined sessions, and its driver.
    engine: Option<(McpEngine, Arc<dyn ContainerDriver>)>,
    /// The host path of the wrapper every container session's command runs under
    /// ([`McpEngine::install_wrapper`]).
    wrapper: std::path::PathBuf,
}

impl McpPool {
    /// Starts every server, lists its tools and pins the allow-listed ones.
    pub(crate) async fn start(
        configs: &[McpServer],
        call_timeout: Duration,
        engine: Option<&McpEngine>,
    ) -> Result<Self, BrokerError> {
        let http = super::model::http_client(call_timeout.min(Duration::from_secs(10)))?;
        let engine = match (configs.iter().find(|c| c.in_container()), engine) {
            (None, None) => None,
            (None, Some(engine)) => {
                // No server runs in a container now, but a crashed run's may have: swept
                // all the same (best effort: nothing of this run depends on it).
                let driver = engine.driver();
                if let Err(e) = engine.sweep(driver.as_ref()).await {
                    tracing::warn!(error = %e, "sweep leftover MCP containers");
                }
                None
            }
            (Some(c), None) => {
                return Err(BrokerError::McpStart {
                    server: c.name.clone(),
                    error: "it runs in a container but the broker has no container engine".into(),
                })
            }
            (Some(c), Some(engine)) => Some(container_engine(&c.name, engine).await?),
        };
        let (engine, wrapper) = match engine {
            Some((engine, driver, wrapper)) => (Some((engine, driver)), wrapper),
            None => (None, Default::default()),
        };
        let mut pool = Self {
            servers: BTreeMap::new(),
            order: configs.iter().map(|c| c.name.clone()).collect(),
            http,
            engine,
            wrapper,
        };
        for config in configs {
            match pool.start_one(config).await {
                Ok(server) => {
                    pool.servers.insert(config.name.clone(), Arc::new(server));
                }
                Err(e) => {
                    pool.shutdown().await;
                    return Err(e);
                }
            }
        }
        Ok(pool)
    }

    async fn start_one(&self, config: &McpServer) -> Result<Server, BrokerError> {
        // (A server's own words in it, as a log line carries them.)
        let start_err = |error: String| BrokerError::McpStart {
            server: config.name.clone(),
            error: for_log(&error),
        };
        let scope = config.scope();
        let probe = match scope {
            McpScope::Shared => "",
            McpScope::Channel => PROBE_SEGMENT,
        };
        let service = self
            .connect(config, &substitute(&config.transport, PROBE_SEGMENT), probe)
            .await
            .map_err(start_err)?;
        let listed = match list(&service.client, &config.tools).await {
            Ok(l) => l,
            Err(e) => {
                close(service).await;
                return Err(start_err(e));
            }
        };
        let mut pins = BTreeMap::new();
        for name in &config.tools {
            let Some((description, schema)) = listed.get(name) else {
                close(service).await;
                return Err(BrokerError::McpUnknownTool {
                    server: config.name.clone(),
                    tool: name.clone(),
                });
            };
            let validator = match compile_schema(&format!("{}/{name}", config.name), schema) {
                Ok(v) => v,
                Err(e) => {
                    close(service).await;
                    return Err(e.into());
                }
            };
            pins.insert(
                name.clone(),
                Pinned {
                    description: description.clone(),
                    schema: schema.clone(),
                    validator,
                },
            );
        }
        let mut sessions = Sessions::default();
        match scope {
            McpScope::Shared => {
                let session = Session {
                    segment: String::new(),
                    state: tokio::sync::Mutex::new(State::Running(Box::new(service))),
                };
                sessions.live.insert(String::new(), (Arc::new(session), 0));
            }
            // The probe session is not any channel's: stopped once the tools are pinned.
            McpScope::Channel => close(service).await,
        }
        tracing::info!(server = %config.name, tools = pins.len(), %scope, "MCP server ready");
        Ok(Server {
            config: config.clone(),
            scope,
            cap: config.session_cap(),
            pins,
            sessions: std::sync::Mutex::new(sessions),
            fair: fair::FairQueue::default(),
        })
    }

    /// The allow-listed tools, as pinned, for the turn.
    pub(crate) fn specs(&self) -> Vec<McpServerSpec> {
        self.order
            .iter()
            .filter_map(|name| self.servers.get(name))
            .map(|s| McpServerSpec {
                server: s.config.name.clone(),
                tools: s
                    .config
                    .tools
                    .iter()
                    .filter_map(|name| {
                        s.pins.get(name).map(|p| ToolSpec {
                            name: name.clone(),
                            description: p.description.clone(),
                            parameters: p.schema.clone(),
                        })
                    })
                    .collect(),
            })
            .collect()
    }

    /// Whether `server/tool` is allow-listed (whatever the server itself offers).
    pub(crate) fn allowed(&self, server: &str, tool: &str) -> bool {
        self.servers
            .get(server)
            .is_some_and(|s| s.pins.contains_key(tool))
    }

    /// The sessions alive now (a shared server's counts once), across servers.
    #[cfg(feature = "testing")]
    pub(crate) fn live_sessions(&self) -> usize {
        self.servers.values().map(|s| s.table().live.len()).sum()
    }

    /// The calls waiting for `server`'s shared session (not the one running).
    #[cfg(feature = "testing")]
    pub(crate) fn waiting(&self, server: &str) -> usize {
        self.servers.get(server).map_or(0, |s| s.fair.waiting())
    }

    /// Whether a call holds `server`'s shared session.
    #[cfg(feature = "testing")]
    pub(crate) fn running(&self, server: &str) -> bool {
        self.servers.get(server).is_some_and(|s| s.fair.held())
    }

    /// Whether `server`'s shared session is in use (a call holds or waits for it, or a
    /// turn that called it still runs): the pause code's check ([`fair::FairQueue::busy`]).
    #[allow(dead_code)] // the hook of the pause code (issue 43, item 4)
    pub(crate) fn shared_busy(&self, server: &str) -> bool {
        self.servers
            .get(server)
            .is_some_and(|s| s.scope == McpScope::Shared && s.fair.busy() > 0)
    }

    /// Calls an allow-listed tool in the caller's session: the tool and its arguments
    /// checked, the call's place in a shared session's queue, the call in its session
    /// within `call_timeout` (or until the turn stops), its answer.
    pub(crate) async fn call(
        &self,
        server: &str,
        tool: &str,
        args: serde_json::Map<String, serde_json::Value>,
        ctx: &TurnContext,
        stop: &CancellationToken,
        broker: &super::Broker,
    ) -> Response {
        let (srv, args) = match self.checked(server, tool, args).await {
            Ok(found) => found,
            Err(refused) => return *refused,
        };
        let segment = ctx.channel.segment().to_owned();
        let meta = call_meta(ctx, &segment);
        let Some(permit) = queued(srv, &segment, stop).await else {
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "turn cancelled");
        };
        let key = match srv.scope {
            McpScope::Shared => String::new(),
            McpScope::Channel => segment,
        };
        let timeout = broker.policy.limits.call_timeout;
        // The session the call runs in, once known: a call that does not finish (its
        // deadline, the turn's stop, the connection dropped) ends it, so no work outlives it.
        let slot: std::sync::Mutex<Option<Arc<Session>>> = Default::default();
        let mut guard = EndOnDrop {
            slot: &slot,
            stdio: matches!(srv.config.transport, McpTransport::Stdio { .. }),
            armed: true,
            permit,
        };
        let work = self.in_session(srv, &key, &slot, tool, args, meta);
        let outcome = tokio::select! {
            r = tokio::time::timeout(timeout, work) => r,
            _ = stop.cancelled() => {
                guard.end_now().await;
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "turn cancelled");
            }
        };
        let Ok(result) = outcome else {
            if srv.scope == McpScope::Shared {
                tracing::warn!(
                    server,
                    waiting = srv.fair.waiting(),
                    "a call to a shared MCP session timed out; the calls waiting run on a restarted session"
                );
            }
            guard.end_now().await;
            return failure(
                StatusCode::GATEWAY_TIMEOUT,
                &format!("tool call timed out after {timeout:?}; the MCP session was stopped"),
            );
        };
        guard.armed = false;
        answer(result, broker)
    }

    /// The server and the allow-listed tool, its arguments checked against its schema.
    async fn checked(
        &self,
        server: &str,
        tool: &str,
        args: serde_json::Map<String, serde_json::Value>,
    ) -> Result<(&Server, serde_json::Map<String, serde_json::Value>), Box<Response>> {
        let Some((srv, pin)) = self
            .servers
            .get(server)
            .and_then(|s| s.pins.get(tool).map(|p| (s, p)))
        else {
            return Err(Box::new(error_response(
                StatusCode::NOT_FOUND,
                &format!("unknown MCP tool: {server}/{tool}"),
            )));
        };
        let value =
            match check_args_off_thread(&pin.validator, serde_json::Value::Object(args)).await {
                Ok(value) => value,
                Err(msg) => {
                    return Err(Box::new(refuse(
                        StatusCode::BAD_REQUEST,
                        Refusal::ToolArguments,
                        &msg,
                    )))
                }
            };
        let serde_json::Value::Object(args) = value else {
            unreachable!("built from an object")
        };
        Ok((srv, args))
    }

    /// The call in its session (made or resumed as needed): the data quota checked first,
    /// the session's stop (its watcher's error) raced with the call.
    async fn in_session(
        &self,
        srv: &Server,
        key: &str,
        slot: &std::sync::Mutex<Option<Arc<Session>>>,
        tool: &str,
        args: serde_json::Map<String, serde_json::Value>,
        meta: serde_json::Map<String, serde_json::Value>,
    ) -> Result<wire::CallResult, CallError> {
        let server = name_of(srv);
        // Held for the whole call: a session in use is never stopped to make room.
        let session = self.session(srv, key).await?;
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
        let quota = srv.config.limits.data_quota();
        let confined = self.engine.as_ref().filter(|_| srv.config.in_container());
        if let Some((engine, _)) = confined {
            let dir = engine.data_dir(server, &session.segment);
            // The data dir's walk (up to `data_files` entries, which the server makes) on a
            // blocking thread: on a runtime thread it held every channel's turn back.
            let (engine, name) = (engine.clone(), server.to_owned());
            let checked =
                super::bounded::off_thread(move || engine.check(&name, &dir, &quota)).await;
            if let Err(msg) = checked {
                end_session(&session).await;
                return Err(CallError::Quota(msg));
            }
        }
        let (client, stopped) = self.ready(srv, &session).await?;
        // Dropping this future (deadline, turn stop) sends notifications/cancelled. The
        // session's data watcher (a container's) ends the call once it stops the session.
        let called = async {
            let call = client.call_tool(tool, args, meta);
            match stopped {
                Some(stopped) => tokio::select! {
                    r = call => Ok(r),
                    msg = stopped => Err(msg),
                },
                None => Ok(call.await),
            }
        };
        let called = called.await;
        // The watcher removes the container once it has kept its error: a call that saw
        // the session close first is refused with that error all the same.
        let called = match (called, self.tripped(&session).await) {
            (Ok(Err(_)), Some(msg)) => Err(msg),
            (called, _) => called,
        };
        match called {
            Err(msg) => {
                end_session(&session).await;
                Err(CallError::Quota(msg))
            }
            Ok(Ok(result)) => Ok(result),
            Ok(Err(ClientError::Answer(AnswerError::Rpc(e)))) => Err(CallError::Tool(e.message)),
            Ok(Err(ClientError::Answer(e))) => {
                tracing::warn!(server, error = %for_log(&e), "MCP call failed");
                Err(CallError::Failed(format!("MCP server {server}: {e}")))
            }
            Ok(Err(ClientError::Http(msg))) => {
                tracing::warn!(server, error = %for_log(&msg), "MCP call failed");
                Err(CallError::Failed(msg))
            }
            Ok(Err(e)) => Err(CallError::Failed(self.ended(&session, server, e).await)),
        }
    }

    /// The session for `key` (a channel's hash, or `""` when shared), made if there is
    /// none. Making one past the server's cap first stops the least recently used session
    /// that no call holds; with none such the call is refused.
    async fn session(&self, srv: &Server, key: &str) -> Result<Arc<Session>, CallError> {
        let name = &srv.config.name;
        let (session, evicted) = {
            let mut table = srv.table();
            if table.shut {
                return Err(CallError::Failed(format!("MCP server {name} is shut down")));
            }
            table.clock += 1;
            let now = table.clock;
            if let Some((session, used)) = table.live.get_mut(key) {
                *used = now;
                return Ok(session.clone());
            }
            let mut evicted = None;
            if table.live.len() >= srv.cap {
                // Only the table holds an idle session; a call in flight holds a clone.
                let lru = table
                    .live
                    .iter()
                    .filter(|(_, (s, _))| Arc::strong_count(s) == 1)
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(k, _)| k.clone());
                let Some(lru) = lru else {
                    tracing::warn!(server = %name, cap = srv.cap, "every MCP session is busy");
                    return Err(CallError::Busy(format!(
                        "MCP server {name}: all {} channel sessions are in use; try again later",
                        srv.cap
                    )));
                };
                evicted = table.live.remove(&lru).map(|(s, _)| s);
            }
            let session = Arc::new(Session {
                segment: key.to_owned(),
                state: tokio::sync::Mutex::new(State::Stopped),
            });
            table.live.insert(key.to_owned(), (session.clone(), now));
            (session, evicted)
        };
        if let Some(old) = evicted {
            tracing::info!(server = %name, cap = srv.cap, "stopping the least recently used MCP session");
            stop_session(&old, State::Closed).await;
        }
        Ok(session)
    }

    /// The error the session's data watcher stopped it with, if it did.
    async fn tripped(&self, session: &Session) -> Option<String> {
        match &*session.state.lock().await {
            State::Running(s) => s.watcher().and_then(|w| w.tripped()),
            _ => None,
        }
    }

    /// The session's peer and, for a container, what resolves once its data watcher stops
    /// it; (re)starting it (and checking its tools against the pins) first. A session its
    /// watcher stopped since its last call is closed and the call refused with the
    /// watcher's error (the next call starts it again, if its data is under the quota).
    async fn ready(
        &self,
        srv: &Server,
        session: &Session,
    ) -> Result<(Arc<Client>, Option<Stopped>), CallError> {
        let name = &srv.config.name;
        let mut state = session.state.lock().await;
        resume_paused(&mut state).await;
        let tripped = match &*state {
            State::Running(s) => s.watcher().and_then(|w| w.tripped()),
            _ => None,
        };
        if let Some(msg) = tripped {
            if let State::Running(live) = std::mem::replace(&mut *state, State::Stopped) {
                close(live).await;
            }
            return Err(CallError::Quota(msg));
        }
        match &*state {
            State::Running(s) if !s.is_closed() => {
                return Ok((s.client.clone(), s.stopped()));
            }
            State::Refused(why) => return Err(CallError::Failed(why.clone())),
            State::Shutdown => {
                return Err(CallError::Failed(format!("MCP server {name} is shut down")))
            }
            State::Closed => {
                return Err(CallError::Failed(format!(
                    "MCP server {name}: this channel's session was stopped; try again"
                )))
            }
            State::Running(_) | State::Stopped => {}
        }
        let old = std::mem::replace(&mut *state, State::Stopped);
        if let State::Running(live) = old {
            close(live).await;
        }
        tracing::info!(server = %name, scope = %srv.scope, "starting MCP session");
        let unavailable = || CallError::Failed(format!("MCP server {name} is unavailable"));
        let transport = substitute(&srv.config.transport, &session.segment);
        let service = self
            .connect(&srv.config, &transport, &session.segment)
            .await
            .map_err(|e| {
                tracing::warn!(server = %name, error = %for_log(&e), "MCP session start failed");
                unavailable()
            })?;
        let listed = match list(&service.client, &srv.config.tools).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(server = %name, error = %for_log(&e), "MCP server listing failed");
                close(service).await;
                return Err(unavailable());
            }
        };
        // One pin per server: every session must present the tools as first approved.
        for (tool, pin) in &srv.pins {
            let same = listed
                .get(tool)
                .is_some_and(|(d, s)| *d == pin.description && *s == pin.schema);
            if !same {
                let why = format!(
                    "MCP server {name} changed tool {tool} since it was approved; it is refused"
                );
                tracing::warn!(server = %name, tool = %tool, "MCP tool changed after pinning; session refused");
                close(service).await;
                *state = State::Refused(why.clone());
                return Err(CallError::Failed(why));
            }
        }
        let client = service.client.clone();
        let stopped = service.stopped();
        *state = State::Running(Box::new(service));
        Ok((client, stopped))
    }

    /// Takes the channel's sessions (by the channel's hash) out of every channel-scoped
    /// server at once; they are closed when the returned sessions are handed to
    /// [`close_sessions`]. A later call of the channel starts a new session.
    pub(crate) fn release(&self, segment: &str) -> Vec<Arc<Session>> {
        self.servers
            .values()
            .filter(|s| s.scope == McpScope::Channel)
            .filter_map(|s| s.table().live.remove(segment).map(|(session, _)| session))
            .collect()
    }

    /// Pauses the channel's container sessions (channel-scoped servers only; a shared
    /// session is never paused) once a turn of the channel has ended: nothing of theirs
    /// runs until their next call resumes them ([`resume_paused`]). A session a call holds
    /// (a next turn's, already) is left running.
    pub(crate) async fn pause_channel(&self, segment: &str) {
        let channel_scoped = self
            .servers
            .values()
            .filter(|s| s.scope == McpScope::Channel && s.config.in_container());
        for srv in channel_scoped {
            let session = srv.table().live.get(segment).map(|(s, _)| s.clone());
            if let Some(session) = session {
                pause_session(&session).await;
            }
        }
    }

    /// Closes every session; a child that does not exit is terminated, then killed, and
    /// always reaped. Later calls are refused.
    pub(crate) async fn shutdown(&self) {
        for srv in self.servers.values() {
            let sessions: Vec<_> = {
                let mut table = srv.table();
                table.shut = true;
                table.live.drain().map(|(_, (s, _))| s).collect()
            };
            for session in sessions {
                stop_session(&session, State::Shutdown).await;
            }
        }
    }
}

/// Pauses a session's container unless a call holds the session (only the table and the
/// caller do then: a call takes its own hold before it waits for the state, so a call that
/// comes after this check finds the container paused and resumes it). One the backend
/// cannot pause is stopped: its next call starts it again on its data.
async fn pause_session(session: &Arc<Session>) {
    let mut state = session.state.lock().await;
    if Arc::strong_count(session) > 2 {
        return;
    }
    let State::Running(live) = &mut *state else {
        return;
    };
    if live.is_closed() {
        return;
    }
    let Some(container) = live.container.as_mut() else {
        return;
    };
    if let Err(e) = container.pause().await {
        tracing::info!(error = %e, "MCP session not paused at its turn's end; stopped (its next call starts it again)");
        if let State::Running(live) = std::mem::replace(&mut *state, State::Stopped) {
            close(live).await;
        }
    }
}

/// Thaws a session paused at its last turn's end, before its call; one that cannot be
/// thawed is stopped, and the call starts it again on its data.
async fn resume_paused(state: &mut State) {
    let State::Running(live) = state else { return };
    let Some(container) = live.container.as_mut().filter(|c| c.is_paused()) else {
        return;
    };
    if let Err(e) = container.resume().await {
        tracing::warn!(error = %e, "paused MCP session not resumed; started again");
        if let State::Running(live) = std::mem::replace(state, State::Stopped) {
            close(live).await;
        }
    }
}

/// Closes released sessions.
pub(crate) async fn close_sessions(sessions: Vec<Arc<Session>>) {
    for session in sessions {
        stop_session(&session, State::Closed).await;
    }
}

/// Puts the session in its final `state`, closing its process or connection.
async fn stop_session(session: &Session, state: State) {
    let old = std::mem::replace(&mut *session.state.lock().await, state);
    if let State::Running(live) = old {
        close(live).await;
    }
}

/// Ends a stdio session whose call did not finish (restarted on the next call): its
/// process or container is stopped, so none of its work outlives the call.
async fn end_session(session: &Session) {
    let mut state = session.state.lock().await;
    if matches!(*state, State::Running(_)) {
        if let State::Running(live) = std::mem::replace(&mut *state, State::Stopped) {
            drop(state);
            tracing::info!("stopping an MCP session whose call did not finish");
            close(live).await;
        }
    }
}

/// The `_meta` a call carries: the channel's segment and the speaker.
fn call_meta(ctx: &TurnContext, segment: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut meta = serde_json::Map::new();
    meta.insert(META_CHANNEL.into(), segment.into());
    meta.insert(
        META_SPEAKER.into(),
        serde_json::json!({"id": ctx.speaker.id, "name": ctx.speaker.name}),
    );
    meta
}

/// A shared session's call waits for its turn (fair across channels, [`fair`]) before its
/// timeout starts; `None`: the turn stopped while it waited (it left the queue). A
/// channel's session has no queue: `Some(None)`.
async fn queued(
    srv: &Server,
    segment: &str,
    stop: &CancellationToken,
) -> Option<Option<fair::Permit>> {
    match srv.scope {
        McpScope::Shared => {
            srv.fair.used_by(stop);
            tokio::select! {
                permit = srv.fair.acquire(segment) => Some(Some(permit)),
                _ = stop.cancelled() => None,
            }
        }
        McpScope::Channel => Some(None),
    }
}

/// The response to a call that finished within its deadline.
fn answer(result: Result<wire::CallResult, CallError>, broker: &super::Broker) -> Response {
    match result {
        // (It may quote the server: redacted and cut as a tool's error is.)
        Err(CallError::Failed(msg)) => failure(
            StatusCode::BAD_GATEWAY,
            &broker
                .secrets()
                .redact_cut(&msg, super::tools::MAX_ERROR_CHARS),
        ),
        Err(CallError::Quota(msg)) => {
            refuse(StatusCode::INSUFFICIENT_STORAGE, Refusal::McpQuota, &msg)
        }
        Err(CallError::Busy(msg)) => {
            refuse(StatusCode::SERVICE_UNAVAILABLE, Refusal::McpSessions, &msg)
        }
        Err(CallError::Tool(msg)) => tool_result(Err(format!("MCP error: {msg}")), broker),
        Ok(result) if result.is_error => tool_result(Err(result.text), broker),
        Ok(result) => tool_result(Ok(result.text), broker),
    }
}

/// Ends the call's session when the call does not finish ([`end_session`]): at once on
/// its deadline or the turn's stop, and from a spawned task when the call is dropped
/// (the connection aborted). Only stdio sessions: an http session is the remote's.
///
/// It holds a shared session's permit ([`fair::Permit`]) and hands it on only once the
/// session is ended (or taken out to be closed), so the next call never gets the session
/// of a call that did not finish: it restarts it.
struct EndOnDrop<'a> {
    slot: &'a std::sync::Mutex<Option<Arc<Session>>>,
    stdio: bool,
    armed: bool,
    permit: Option<fair::Permit>,
}

impl EndOnDrop<'_> {
    fn take(&mut self) -> Option<Arc<Session>> {
        if !std::mem::take(&mut self.armed) || !self.stdio {
            return None;
        }
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    async fn end_now(&mut self) {
        if let Some(session) = self.take() {
            end_session(&session).await;
        }
        self.permit = None;
    }
}

impl Drop for EndOnDrop<'_> {
    fn drop(&mut self) {
        let Some(session) = self.take() else { return };
        let permit = self.permit.take();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // The session is taken out now when its state is free (so it is idle at once, for
        // `max_sessions`); closed by a task either way.
        let taken = match session.state.try_lock() {
            Ok(mut state) => match std::mem::replace(&mut *state, State::Stopped) {
                State::Running(live) => Some(Some(live)),
                other => {
                    *state = other;
                    Some(None)
                }
            },
            Err(_) => None,
        };
        match taken {
            Some(Some(live)) => {
                handle.spawn(close(live));
            }
            Some(None) => {}
            None => {
                handle.spawn(async move {
                    end_session(&session).await;
                    drop(permit);
                });
            }
        }
    }
}

fn name_of(srv: &Server) -> &str {
    &srv.config.name
}

/// The transport with `{channel}` replaced by `segment`.
fn substitute(transport: &McpTransport, segment: &str) -> McpTransport {
    let sub = |v: &String| v.replace(CHANNEL_PLACEHOLDER, segment);
    match transport {
        McpTransport::Stdio { command, args, env } => McpTransport::Stdio {
            command: command.clone(),
            args: args.iter().map(sub).collect(),
            env: env.iter().map(|(k, v)| (k.clone(), sub(v))).collect(),
        },
        McpTransport::Http { url, headers } => McpTransport::Http {
            url: sub(url),
            headers: headers.iter().map(|(k, v)| (k.clone(), sub(v))).collect(),
        },
    }
}

enum CallError {
    /// The server failed (a `502`).
    Failed(String),
    /// Every session of the server is in use (a `503`).
    Busy(String),
    /// The session's data is over its quota, or its filesystem below the floor (a `507`).
    Quota(String),
    /// The server answered the call with an error (a readable `{"ok":false}`).
    Tool(String),
}

impl McpPool {
    /// Starts one session (`segment`: what `{channel}` became; empty when shared) and runs
    /// the MCP handshake: a container of its own (`confine = "container"`), a host child
    /// (`confine = "host"`) or an http session.
    async fn connect(
        &self,
        config: &McpServer,
        transport: &McpTransport,
        segment: &str,
    ) -> Result<Live, String> {
        let server = config.name.as_str();
        let caps = message_caps(config);
        let start = async {
            let live = match transport {
                McpTransport::Stdio { command, args, env } if config.in_container() => {
                    let Some((engine, driver)) = &self.engine else {
                        return Err("no container engine for MCP containers".to_owned());
                    };
                    let (container, (output, input)) = container::start(
                        (engine, driver, &self.wrapper),
                        config,
                        segment,
                        (command, args, env),
                    )
                    .await?;
                    let client = Client::stdio(server, caps, output, input);
                    // A session that ends (the server stopped, or broke a cap) is removed
                    // at once, not at its next call.
                    container.remove_when(client.closed());
                    Live {
                        client: Arc::new(client),
                        container: Some(container),
                        child: None,
                    }
                }
                McpTransport::Stdio { command, args, env } => {
                    let (client, child) = spawn_child(server, caps, command, args, env)?;
                    let child = HostChild::new(child, client.closed());
                    Live {
                        client: Arc::new(client),
                        container: None,
                        child: Some(child),
                    }
                }
                McpTransport::Http { url, headers } => {
                    let url = reqwest::Url::parse(url).map_err(|e| e.to_string())?;
                    let mut custom = HeaderMap::new();
                    for (k, v) in headers {
                        let name = HeaderName::try_from(k.as_str()).map_err(|e| e.to_string())?;
                        let mut value =
                            HeaderValue::try_from(v.as_str()).map_err(|e| e.to_string())?;
                        value.set_sensitive(true);
                        custom.insert(name, value);
                    }
                    let client = Client::http(server, caps, self.http.clone(), url, custom);
                    Live {
                        client: Arc::new(client),
                        container: None,
                        child: None,
                    }
                }
            };
            Ok(live)
        };
        let started = std::time::Instant::now();
        let live = tokio::time::timeout(START_TIMEOUT, start)
            .await
            .map_err(|_| format!("no MCP session within {START_TIMEOUT:?}"))??;
        match tokio::time::timeout(START_TIMEOUT, live.client.initialize()).await {
            Ok(Ok(())) => {
                tracing::debug!(server, took = ?started.elapsed(), "MCP session started");
                Ok(live)
            }
            Ok(Err(e)) => {
                close(live).await;
                Err(e.to_string())
            }
            Err(_) => {
                close(live).await;
                Err(format!("no MCP handshake within {START_TIMEOUT:?}"))
            }
        }
    }

    /// A session that ended during a call (`e`): closed, to be restarted on the next call,
    /// and the guest's error, which tells an out-of-memory kill of its container.
    async fn ended(&self, session: &Session, server: &str, e: ClientError) -> String {
        tracing::warn!(server, error = %for_log(&e), "MCP call failed");
        let mut state = session.state.lock().await;
        let mut oom = None;
        if let State::Running(s) = &*state {
            if let Some(c) = &s.container {
                if c.oom_killed().await {
                    oom = Some(c.memory_mb);
                }
            }
            if let State::Running(live) = std::mem::replace(&mut *state, State::Stopped) {
                close(live).await;
            }
        }
        match (oom, e) {
            (Some(mb), _) => format!(
                "MCP server {server} ran out of memory during the call (its limit is {mb} MiB) and was stopped; the next call restarts it"
            ),
            (None, ClientError::Stopped(_)) => format!("MCP server {server} stopped during the call"),
            (None, e) => e.to_string(),
        }
    }
}

/// The caps on each message `server` sends (its `max_message_kb`, and the values cap).
fn message_caps(server: &McpServer) -> Caps {
    Caps::bytes(server.max_message_kb.saturating_mul(1024))
}

/// Starts a host child (`confine = "host"`): its configured env plus a few harmless
/// variables of the runtime's, stdin and stdout its session, stderr lines to the debug log.
fn spawn_child(
    server: &str,
    caps: Caps,
    command: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
) -> Result<(Client, tokio::process::Child), String> {
    let mut cmd = tokio::process::Command::new(command);
    cmd.args(args)
        .env_clear()
        .kill_on_drop(true)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in INHERITED_ENV {
        if let Some(v) = std::env::var_os(var) {
            cmd.env(var, v);
        }
    }
    cmd.envs(env);
    let mut child = cmd.spawn().map_err(|e| format!("spawn {command}: {e}"))?;
    let (Some(stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(format!("spawn {command}: no stdio"));
    };
    let name = server.to_owned();
    tokio::spawn(async move {
        let mut lines =
            tokio::io::BufReader::new(stderr.take(container::STDERR_CAP as u64)).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let line: String = line.chars().take(500).collect();
            tracing::debug!(server = %name, "MCP stderr: {line}");
        }
    });
    Ok((Client::stdio(server, caps, stdout, Box::pin(stdin)), child))
}

/// The server's tools of `wanted` (its allow-list): name → (description, input schema).
async fn list(
    client: &Client,
    wanted: &[String],
) -> Result<BTreeMap<String, (String, serde_json::Value)>, String> {
    tokio::time::timeout(START_TIMEOUT, client.list_tools(MAX_TOOL_PAGES, wanted))
        .await
        .map_err(|_| format!("no tool list within {START_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())
}

/// Closes a session (for a child: stdin closed, then SIGTERM, then SIGKILL, each after a
/// wait, and reaped: [`HostChild`]; for a container: killed and removed, its data dir
/// kept).
async fn close(live: impl Into<Box<Live>>) {
    let Live {
        client,
        container,
        child,
    } = *live.into();
    if let Some(container) = container {
        // Killed at once: a session being closed has nothing left to finish.
        container.remove().await;
        client.close().await;
        return;
    }
    client.close().await;
    if let Some(mut child) = child {
        let _ = tokio::time::timeout(SHUTDOWN_TIMEOUT, child.exited.wait_for(|e| *e)).await;
    }
}

/// The engine of container-confined sessions, ready: what a crashed runtime left swept,
/// the wrapper read out of the guest image (`server`: the first such server, named in an
/// error).
async fn container_engine(
    server: &str,
    engine: &McpEngine,
) -> Result<(McpEngine, Arc<dyn ContainerDriver>, std::path::PathBuf), BrokerError> {
    let failed = |error: String| BrokerError::McpStart {
        server: server.to_owned(),
        error,
    };
    let driver = engine.driver();
    // What a crashed runtime left: its sessions' containers.
    engine
        .sweep(driver.as_ref())
        .await
        .map_err(|error| failed(format!("sweep leftover MCP containers: {error}")))?;
    let wrapper = engine
        .install_wrapper(driver.as_ref())
        .await
        .map_err(failed)?;
    Ok((engine.clone(), driver, wrapper))
}

/// A server's words (its errors) as a host log line carries them: one line (control
/// characters as `?`: a `\n` would start a forged record), at most [`LOGGED_CHARS`]
/// characters (a server's error may be as long as its message cap, and is logged at each
/// start it fails).
fn for_log(text: &dyn std::fmt::Display) -> String {
    let text = text.to_string();
    let mut out: String = text
        .chars()
        .take(LOGGED_CHARS)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if text.chars().nth(LOGGED_CHARS).is_some() {
        out.push('…');
    }
    out
}

/// How much of a server's error a log line carries.
const LOGGED_CHARS: usize = 500;
