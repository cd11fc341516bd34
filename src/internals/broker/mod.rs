//! The credential broker: the only door out of a turn's container.
//!
//! One [`Broker`] lives as long as the runtime (it owns the upstream HTTP client, the
//! compiled host-tool schemas and the MCP server pool); each turn gets a `BrokerListener`
//! on `<run_dir>/broker.sock`, bound to that turn's `TurnContext` (channel, speaker,
//! cancellation). Every request on the socket comes from a hostile guest; upstream model
//! responses and MCP servers are not trusted either.
//!
//! Parts:
//! - [`HostTool`]: the trait a bot author implements for a host tool (`tools`);
//! - [`BrokerPolicy`]: what the broker enforces (`policy`), built once from the
//!   configuration (whose sections, the key and the MCP servers among them, live in
//!   `config`), and [`validate_policy`] for a broker driven alone;
//! - [`Broker`] / [`BrokerListener`]: the runtime-long broker and one turn's listener.
//!
//! The runtime ([`crate::Sandbox`]) builds the broker from its resolved config and listens
//! for each turn; this workspace's tests, the bench and the fuzz targets drive a broker
//! alone (`Broker::new` with the `testing` feature, [`Broker::listen`]).
//!
//! The other files: `server` (HTTP/1.1 on the unix socket: peer check, routing, limits),
//! `model` (the upstream chat-completions proxy), `compact` (the compactor behind
//! `POST /v1/compact`), `tools` (host tools and their schemas), `mcp` (the MCP client
//! pool with pinned tools), `redact` (removing declared secrets from everything that flows
//! back).
//!
//! # Wire behaviour (see `roundtable_sandbox_protocol::paths`)
//! - `POST /v1/chat/completions`: forwarded to `{model_url}/chat/completions` (the
//!   configured `model_url` is the API base, e.g. `https://api.example.com/v1`). Only the
//!   fields of [`ALLOWED_MODEL_FIELDS`](crate::config::ALLOWED_MODEL_FIELDS) and `[model_request] extra_fields` are
//!   forwarded (any other: `400` naming it); the body's `model` is **replaced** by the
//!   configured model (a guest cannot pick another); `max_tokens` and
//!   `max_completion_tokens` are clamped to `[model_request] max_tokens` (set to it
//!   when neither is sent). Only
//!   `content-type` (always `application/json`) and `accept` are forwarded from the guest;
//!   `Authorization: Bearer <key>` is set exactly once. Redirects are not followed and no
//!   proxy is used, so the key goes nowhere but `model_url`. With `"stream": true` the
//!   upstream body is relayed chunk by chunk; otherwise it is read whole, capped at
//!   `max_response_bytes`. Upstream failures become `502` (`504` past the deadline) with
//!   a readable message; every declared secret is redacted from everything returned, and
//!   no piece of one is sent on any error path.
//! - `POST /v1/compact`: a typed, size-capped compaction request (the older messages, the
//!   previous summary, `tokens_before`); the host builds the summary request from the shared
//!   rules and sends it to the configured summarizer, else (or when it fails) to the main
//!   model, else builds the plain summary; `200` with a `CompactReply`. Each upstream call
//!   counts against the turn's model calls; each fallback is logged at warn with the
//!   channel's hash, the reason and `tokens_before`. See `compact`.
//! - `POST /v1/tools/{name}`, `POST /v1/mcp/{server}/{tool}`: the body is the arguments
//!   object, validated against the tool's schema first; `200` with a `ToolCallResult`.
//! - Refusals: `400` malformed JSON or arguments (or a model field not allowed), `404`
//!   unknown route or tool, `405` not POST, `413` body too large, `429` too many calls in
//!   the turn or in flight at once, `502` upstream or MCP server failure, `503` too many
//!   connections (written raw, then closed), `504` past the per-call deadline; always
//!   `{"error": "..."}`.

pub(crate) mod bounded;
mod compact;
pub(crate) mod egress;
mod http;
pub use http::{FREE_REFUSALS, REFUSAL_PAUSE};
mod mcp;
mod model;
pub use mcp::container::DATA_MOUNT as MCP_DATA_MOUNT;
pub use mcp::container::{McpEngine, LABEL_MCP};
pub use mcp::{META_CHANNEL, META_SPEAKER};
mod policy;
pub use policy::{validate_policy, BrokerPolicy};
mod redact;
mod server;
mod tools;
pub use tools::{HostTool, ToolCallContext};
mod usage;
mod warn;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use roundtable_sandbox_protocol::{McpServerSpec, Speaker, ToolSpec};
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// A boxed future, as the object-safe traits of this crate return (re-exported from
/// `futures-util`, so an implementation can name either).
pub use crate::driver::BoxFuture;

use crate::config::PolicyError;

/// Errors of the broker layer: a rule of its policy, or a failure of its start or a turn's
/// listener.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// A rule of the policy (model url, tools, MCP servers, compaction, limits).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("MCP server {server} could not be started: {error}")]
    /// An MCP server could not be started or listed its tools.
    McpStart {
        /// The server.
        server: String,
        /// What failed.
        error: String,
    },
    #[error("MCP server {server} has no tool {tool} (named in its allow-list)")]
    /// An MCP server's allow-list names a tool it does not have.
    McpUnknownTool {
        /// The server.
        server: String,
        /// The tool.
        tool: String,
    },
    /// The HTTP client for the model could not be built.
    #[error("build the upstream HTTP client: {0}")]
    HttpClient(String),
    /// A turn's broker socket could not be bound.
    #[error("bind broker socket {path}")]
    Bind {
        /// The socket's path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The [`ApiKeyProvider`](crate::ApiKeyProvider) failed to give the key.
    #[error("api key provider failed: {0}")]
    ApiKey(String),
    /// An egress route could not be prepared (its credential, its CA file, the resolver).
    #[error("{0}")]
    Egress(String),
}

/// One turn's view: who speaks in which channel, and the turn's cancellation.
#[derive(Clone)]
pub struct TurnContext {
    /// The turn's channel.
    pub channel: crate::ChannelId,
    /// Who wrote the turn's message.
    pub speaker: Speaker,
    /// Fired when the turn ends.
    pub cancel: CancellationToken,
    /// The turn's events: each call and each refusal (never their content); `None` for
    /// a broker driven alone.
    pub events: Option<crate::events::TurnEvents>,
    /// The turn's usage count and budgets (`None`: nothing counted, nothing refused).
    pub account: Option<Arc<crate::budgets::TurnAccount>>,
}

impl fmt::Debug for TurnContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TurnContext")
            .field("channel", &self.channel)
            .field("speaker", &self.speaker)
            .field("cancel", &self.cancel)
            .field("events", &self.events)
            .field("account", &self.account)
            .finish()
    }
}

/// The runtime-long broker: upstream client, host tools and MCP pool.
pub struct Broker {
    policy: BrokerPolicy,
    upstream: model::Upstream,
    compactor: compact::Compactor,
    tools: tools::HostTools,
    mcp: mcp::McpPool,
    egress: egress::Egress,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Broker")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// Every declared secret now, to redact from what the guest is sent (built once; again
    /// only when a key provider hands out a new key).
    pub(crate) fn secrets(&self) -> redact::Secrets {
        self.upstream.secrets(&self.policy)
    }

    /// Validates the policy and prepares the shared parts: the upstream client, the
    /// compiled host-tool schemas, and every MCP server (started, listed, its allow-listed
    /// tools checked and pinned). For a broker driven alone (this workspace's tests, the
    /// bench): a runtime's broker starts from the policy its configuration validated.
    #[cfg(feature = "testing")]
    pub async fn new(policy: BrokerPolicy) -> Result<Self, BrokerError> {
        validate_policy(&policy)?;
        Self::start(policy).await
    }

    /// Prepares the shared parts of a broker whose policy was validated already (by
    /// [`crate::Config::resolve`], which built it): validated once.
    pub(crate) async fn start(policy: BrokerPolicy) -> Result<Self, BrokerError> {
        let egress = egress::Egress::new(
            &policy.egress,
            policy.egress_nameserver,
            policy.engine_networks.clone(),
        )?;
        let upstream = model::Upstream::new(&policy, egress.secrets().collect())?;
        let compactor = compact::Compactor::new(&policy)?;
        let tools = tools::HostTools::new(&policy.tools)?;
        let mcp = mcp::McpPool::start(
            &policy.mcp,
            policy.limits.call_timeout,
            policy.mcp_engine.as_ref(),
        )
        .await?;
        Ok(Self {
            policy,
            upstream,
            compactor,
            tools,
            mcp,
            egress,
        })
    }

    /// The egress routes, as a turn is told of them.
    pub fn egress_specs(&self) -> Vec<roundtable_sandbox_protocol::egress::RouteSpec> {
        self.egress.specs()
    }

    /// The tool specs handed to each turn: host tools, then the allow-listed MCP tools with
    /// the descriptions and schemas pinned when first read.
    pub fn turn_tools(&self) -> (Vec<ToolSpec>, Vec<McpServerSpec>) {
        let tools = self
            .policy
            .tools
            .iter()
            .map(|t| ToolSpec {
                name: t.name().to_owned(),
                description: t.description().to_owned(),
                parameters: t.parameters(),
            })
            .collect();
        (tools, self.mcp.specs())
    }

    /// Listens on `socket` for one turn (the Docker path: a unix socket in the turn's
    /// run dir, each peer's uid checked). Each connection is its own task; the listener's
    /// cancellation (a child of the turn's) ends every call in flight.
    pub async fn listen(
        self: &Arc<Self>,
        socket: &Path,
        ctx: TurnContext,
    ) -> Result<BrokerListener, BrokerError> {
        let listener = UnixListener::bind(socket).map_err(|source| BrokerError::Bind {
            path: socket.to_owned(),
            source,
        })?;
        Ok(self.spawn(server::Acceptor::Unix(listener), socket.to_owned(), ctx))
    }

    /// Serves one turn over the byte streams a backend carries from its guest (see
    /// [`crate::driver::BrokerTransport::Streams`]): the same HTTP, limits and policy as on
    /// the unix socket, without a socket and without a peer check (the backend vouches
    /// that each stream is this turn's guest). Serving ends when the listener stops.
    pub fn serve_streams(
        self: &Arc<Self>,
        streams: tokio::sync::mpsc::Receiver<Box<dyn crate::driver::GuestStream>>,
        ctx: TurnContext,
    ) -> BrokerListener {
        self.spawn(server::Acceptor::Streams(streams), PathBuf::new(), ctx)
    }

    fn spawn(
        self: &Arc<Self>,
        acceptor: server::Acceptor,
        path: PathBuf,
        ctx: TurnContext,
    ) -> BrokerListener {
        let stop = ctx.cancel.child_token();
        self.pause_at_end(&ctx, &stop);
        let task = tokio::spawn(server::serve(self.clone(), acceptor, ctx, stop.clone()));
        BrokerListener {
            path,
            stop,
            task: Some(task),
        }
    }

    /// Once the turn's serving ends (`stop`: the listener stopped or dropped, or the turn
    /// cancelled), pauses the channel's MCP sessions: no work of theirs outlives the turn
    /// (see `mcp::McpPool::pause_channel`).
    fn pause_at_end(self: &Arc<Self>, ctx: &TurnContext, stop: &CancellationToken) {
        let (broker, stop) = (self.clone(), stop.clone());
        let segment = ctx.channel.segment().to_owned();
        tokio::spawn(async move {
            stop.cancelled().await;
            broker.mcp.pause_channel(&segment).await;
        });
    }

    /// Stops the channel's MCP sessions (channel-scoped servers only). They are taken out
    /// of the pool at once, so a later call of the channel starts a new session; the
    /// returned future closes them (stdin closed, then SIGTERM, then SIGKILL; reaped).
    /// The actor layer calls it when it retires an idle channel. Without it a channel's
    /// sessions live until `max_sessions` makes room for others, or until shutdown.
    pub fn release_channel(&self, channel: impl Into<crate::ChannelId>) -> BoxFuture<'static, ()> {
        let sessions = self.mcp.release(channel.into().segment());
        if !sessions.is_empty() {
            tracing::debug!(
                sessions = sessions.len(),
                "releasing a channel's MCP sessions"
            );
        }
        Box::pin(mcp::close_sessions(sessions))
    }

    /// MCP sessions alive now, across servers (a shared server's session counts once; for
    /// this workspace's tests).
    #[cfg(feature = "testing")]
    pub fn mcp_sessions(&self) -> usize {
        self.mcp.live_sessions()
    }

    /// Calls waiting for `server`'s shared MCP session, not counting the one it runs (for
    /// this workspace's tests).
    #[cfg(feature = "testing")]
    pub fn mcp_waiting(&self, server: &str) -> usize {
        self.mcp.waiting(server)
    }

    /// Whether a call holds `server`'s shared MCP session (for this workspace's tests).
    #[cfg(feature = "testing")]
    pub fn mcp_running(&self, server: &str) -> bool {
        self.mcp.running(server)
    }

    /// Whether `server`'s shared MCP session is in use: a call holds it or waits for it, or
    /// a turn that called it still runs (for this workspace's tests).
    #[cfg(feature = "testing")]
    pub fn mcp_in_use(&self, server: &str) -> bool {
        self.mcp.shared_busy(server)
    }

    /// Ends the runtime-long parts: every MCP child is closed, then killed if it lingers,
    /// and reaped. Later MCP calls are refused.
    pub async fn shutdown(&self) {
        self.mcp.shutdown().await;
    }
}

/// One turn's listener. Stopping (or dropping) it ends every call in flight.
#[derive(Debug)]
pub struct BrokerListener {
    /// The socket file (empty: streams carried by the backend).
    path: PathBuf,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl BrokerListener {
    /// The socket path (empty when the backend carries the streams).
    #[cfg(feature = "testing")]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, ends every connection and removes the socket file (if any).
    pub async fn stop(mut self) -> Result<(), std::io::Error> {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
        if self.path.as_os_str().is_empty() {
            return Ok(());
        }
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

impl Drop for BrokerListener {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            // Aborting the accept task drops its JoinSet, which aborts every connection.
            task.abort();
        }
    }
}
