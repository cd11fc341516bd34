//! The credential broker: the only door out of a turn's container.
//!
//! One [`Broker`] lives as long as the runtime (it owns the upstream HTTP client, the
//! compiled host-tool schemas and the MCP server pool); each turn gets a `BrokerListener`
//! on `<run_dir>/broker.sock`, bound to that turn's `TurnContext` (channel, speaker,
//! cancellation). Every request on the socket comes from a hostile guest; upstream model
//! responses and MCP servers are not trusted either.
//!
//! Parts (this file is the public API and the pure policy checks):
//! - [`ApiKey`]: the model key, a secret that never prints, static or from an async provider;
//! - [`HostTool`]: the trait a bot author implements for a host tool;
//! - [`McpServer`]: an MCP server and the allow-list of its tools;
//! - [`BrokerLimits`]: per-turn caps on sizes, call counts and call time;
//! - [`CompactionModel`]: an optional separate summarizer for compaction;
//! - `BrokerPolicy`: all of the above plus the model endpoint, checked by
//!   `validate_policy` without side effects;
//! - [`Broker`] / `BrokerListener`: the runtime-long broker and one turn's listener.
//!
//! The runtime ([`crate::Sandbox`]) builds the broker from its config and listens for each
//! turn; the policy, the turn's context, the listener and the broker's constructor and
//! `listen` are public only with the `testing` feature (for this workspace's tests, the
//! bench and the fuzz targets, which drive a broker alone).
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
//!   fields of [`ALLOWED_MODEL_FIELDS`] and [`ModelRequestPolicy::extra_fields`] are
//!   forwarded (any other: `400` naming it); the body's `model` is **replaced** by the
//!   configured model (a guest cannot pick another); `max_tokens` and
//!   `max_completion_tokens` are clamped to [`ModelRequestPolicy::max_tokens`] (set to it
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
mod http;
mod mcp;
mod model;
pub use mcp::container::DATA_MOUNT as MCP_DATA_MOUNT;
pub use mcp::container::{McpEngine, LABEL_MCP};
pub use mcp::{CHANNEL_PLACEHOLDER, META_CHANNEL, META_SPEAKER, PROBE_SEGMENT};
mod redact;
mod server;
mod tools;
mod usage;
mod warn;

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use roundtable_sandbox_protocol::{builtin_tools, McpServerSpec, Speaker, ToolSpec};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// A boxed future, as the object-safe traits of this crate return (re-exported from
/// `futures-util`, so an implementation can name either).
pub use futures_util::future::BoxFuture;

/// Errors of the broker layer.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// `model_url` is `http://` without `allow_http`.
    #[error("model_url must use https (set allow_http only for offline tests): {0}")]
    InsecureModelUrl(String),
    /// `model_url` is `http://` to a host that is not loopback.
    #[error("model_url uses http to a host that is not loopback (allow_http covers only 127.0.0.0/8, ::1 and localhost): {0}")]
    HttpNotLoopback(String),
    /// `[model_request]` breaks a rule.
    #[error("invalid model_request: {0}")]
    InvalidModelRequest(String),
    /// `model_url` is not a URL.
    #[error("invalid model_url: {0}")]
    InvalidModelUrl(String),
    /// A host tool's name is not a valid tool name.
    #[error("invalid tool name {0:?}: use 1 to 64 of a-z, 0-9, _ and -")]
    InvalidToolName(String),
    /// Two tools have the same name.
    #[error("duplicate tool name: {0}")]
    DuplicateToolName(String),
    #[error(
        "host tool {:?} has the name of a built-in guest tool (built-ins: {})",
        .0,
        builtin_tools::ALL.join(", ")
    )]
    /// A host tool has the name of a built-in guest tool.
    BuiltinToolName(String),
    #[error("invalid JSON schema for tool {tool}: {error}")]
    /// A tool's parameters are not a valid JSON schema.
    InvalidToolSchema {
        /// The tool.
        tool: String,
        /// What the schema compiler said.
        error: String,
    },
    /// `[broker]` breaks a rule.
    #[error("invalid broker limits: {0}")]
    InvalidLimits(String),
    #[error("MCP server {server}: {reason}")]
    /// An `[[mcp]]` entry breaks a rule.
    InvalidMcpServer {
        /// The server.
        server: String,
        /// The rule.
        reason: String,
    },
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
    /// The [`ApiKeyProvider`] failed to give the key.
    #[error("api key provider failed: {0}")]
    ApiKey(String),
    /// `compaction.url` is not a URL.
    #[error("invalid compaction.url: {0}")]
    InvalidCompactionUrl(String),
    #[error(
        "compaction.url must use https (allow_http permits http to a loopback address only): {0}"
    )]
    /// `compaction.url` is `http://` without `allow_http`, or not to loopback.
    InsecureCompactionUrl(String),
    /// `compaction.model` is empty.
    #[error("compaction.model is required")]
    CompactionModelMissing,
    /// `compaction.timeout` is outside 1 s to 600 s.
    #[error("compaction.timeout must be 1 s to 600 s, got {0:?}")]
    CompactionTimeout(Duration),
}

/// An async source of the model key (a vault, a refreshing token).
pub trait ApiKeyProvider: Send + Sync {
    /// Yields the current key.
    fn key(&self) -> BoxFuture<'_, Result<SecretString, String>>;
}

/// The model API key: a static secret or a provider. Its `Debug` never shows it.
#[derive(Clone)]
pub enum ApiKey {
    /// A fixed key.
    Static(Arc<SecretString>),
    /// A key fetched for each model call.
    Provider(Arc<ProvidedKey>),
    /// No key (a local model that needs none).
    None,
}

/// How many of a provider's most recent keys are remembered (to redact them).
const PROVIDED_KEYS_KEPT: usize = 8;

/// A key provider and the keys it has handed out lately: each is redacted from everything
/// the guest is sent (a rotated key may still be echoed by a slow tool).
pub struct ProvidedKey {
    provider: Box<dyn ApiKeyProvider>,
    seen: std::sync::Mutex<Vec<SecretString>>,
}

impl ProvidedKey {
    async fn fetch(&self) -> Result<SecretString, BrokerError> {
        let key = self.provider.key().await.map_err(BrokerError::ApiKey)?;
        if !key.expose_secret().is_empty() {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if !seen
                .iter()
                .any(|k| k.expose_secret() == key.expose_secret())
            {
                if seen.len() == PROVIDED_KEYS_KEPT {
                    seen.remove(0);
                }
                seen.push(SecretString::from(key.expose_secret().to_owned()));
            }
        }
        Ok(key)
    }

    fn seen(&self) -> Vec<String> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.iter().map(|k| k.expose_secret().to_owned()).collect()
    }
}

impl ApiKey {
    /// A fixed key.
    pub fn from_static(key: impl Into<String>) -> Self {
        ApiKey::Static(Arc::new(SecretString::from(key.into())))
    }

    /// A key from an async provider, asked once per model call.
    pub fn from_provider(provider: impl ApiKeyProvider + 'static) -> Self {
        ApiKey::Provider(Arc::new(ProvidedKey {
            provider: Box::new(provider),
            seen: std::sync::Mutex::new(Vec::new()),
        }))
    }

    /// Resolves the key for one call.
    pub async fn resolve(&self) -> Result<Option<SecretString>, BrokerError> {
        match self {
            ApiKey::Static(k) => Ok(Some(SecretString::from(k.expose_secret().to_owned()))),
            ApiKey::Provider(p) => p.fetch().await.map(Some),
            ApiKey::None => Ok(None),
        }
    }

    /// The keys known without an await (a static key, a provider's recent keys); each is
    /// redacted from what the guest is sent.
    fn known(&self) -> Vec<String> {
        match self {
            ApiKey::Static(k) if !k.expose_secret().is_empty() => {
                vec![k.expose_secret().to_owned()]
            }
            ApiKey::Provider(p) => p.seen(),
            _ => Vec::new(),
        }
    }

    /// Whether a provider has not handed out a key yet.
    fn unfetched(&self) -> bool {
        matches!(self, ApiKey::Provider(p) if p.seen().is_empty())
    }
}

impl fmt::Debug for ProvidedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProvidedKey(..)")
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiKey::Static(_) => f.write_str("ApiKey::Static([redacted])"),
            ApiKey::Provider(_) => f.write_str("ApiKey::Provider(..)"),
            ApiKey::None => f.write_str("ApiKey::None"),
        }
    }
}

/// What a host tool's handler is told about the call.
#[derive(Debug, Clone)]
pub struct ToolCallContext {
    /// The channel the turn runs in.
    pub channel: String,
    /// Who wrote the turn's message.
    pub speaker: Speaker,
    /// Fired when the turn ends: a long call should stop.
    pub cancel: CancellationToken,
}

/// A host tool that a bot author exposes to the guest.
pub trait HostTool: Send + Sync {
    /// The tool's name: 1 to 64 of `a-z`, `0-9`, `_`, `-`.
    fn name(&self) -> &str;
    /// What the model is told the tool does.
    fn description(&self) -> &str;
    /// The JSON schema of the arguments object.
    fn parameters(&self) -> serde_json::Value;
    /// Runs the tool with validated arguments; an `Err` reaches the guest as a readable
    /// error (`{"ok":false,"error":...}`), so it must not carry host internals.
    fn call(
        &self,
        args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>>;
    /// The credentials this tool holds (an API key of the service it calls): each is
    /// redacted from every tool, MCP and model result the guest is sent. Default: none.
    fn secrets(&self) -> Vec<SecretString> {
        Vec::new()
    }
}

/// How an MCP server is reached. Its `Debug` shows env and header names, never values.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case", tag = "transport")]
pub enum McpTransport {
    /// A child process speaking MCP on stdio. Its env stays on the host; the child does
    /// not inherit the runtime's environment beyond `PATH`, `HOME`, `LANG`, `LC_ALL`,
    /// `TZ` and `TMPDIR` (so a key held in the runtime's env does not reach it).
    Stdio {
        /// The program.
        command: String,
        /// Its arguments (`{channel}` is replaced for a channel-scoped server).
        #[serde(default)]
        args: Vec<String>,
        /// Its environment (values stay on the host; `{channel}` is replaced in them too).
        #[serde(default)]
        env: std::collections::BTreeMap<String, String>,
    },
    /// A streamable-HTTP MCP endpoint; `headers` (e.g. its credentials) stay on the host.
    Http {
        /// The endpoint (`{channel}` is replaced for a channel-scoped server).
        url: String,
        /// Headers sent with each request (values stay on the host; `{channel}` is replaced
        /// in them too).
        #[serde(default)]
        headers: std::collections::BTreeMap<String, String>,
    },
}

impl fmt::Debug for McpTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            McpTransport::Stdio { command, args, env } => f
                .debug_struct("Stdio")
                .field("command", command)
                .field("args", args)
                .field("env", &env.keys().collect::<Vec<_>>())
                .finish(),
            McpTransport::Http { url, headers } => f
                .debug_struct("Http")
                .field("url", url)
                .field("headers", &headers.keys().collect::<Vec<_>>())
                .finish(),
        }
    }
}

/// Whose data one MCP session holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum McpScope {
    /// One session per channel: started on the channel's first call, stopped when the
    /// channel retires ([`Broker::release_channel`]), when the least recently used
    /// session makes room for another (`max_sessions`), and at shutdown. `{channel}` (the
    /// channel's sha256 hex, as its workspace dir) is substituted in `args` and `env`
    /// values (stdio) or in `url` and header values (http), so each channel's data can
    /// live in its own file. The default for stdio servers.
    Channel,
    /// One session for every channel, started with the broker: whatever the server
    /// keeps is seen by every channel (cross-channel). The default for http servers.
    Shared,
}

impl fmt::Display for McpScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            McpScope::Channel => "channel",
            McpScope::Shared => "shared",
        })
    }
}

/// An MCP server and the tools of it that the guest may call.
///
/// Unknown keys are refused by the transport (serde's `deny_unknown_fields` cannot be put
/// on a struct with a flattened field: it would refuse the transport's own keys; every key
/// this struct does not take goes to the transport, whose variants deny unknown fields).
#[derive(Debug, Clone, Deserialize)]
pub struct McpServer {
    /// The server's name (tool calls name it).
    pub name: String,
    /// How it is reached.
    #[serde(flatten)]
    pub transport: McpTransport,
    /// The allow-listed tools; others are never shown to the guest.
    pub tools: Vec<String>,
    /// `channel` or `shared`; `None` takes the transport's default (see [`McpServer::scope`]).
    #[serde(default)]
    pub scope: Option<McpScope>,
    /// Live channel sessions at most (channel scope only; default
    /// [`McpServer::DEFAULT_MAX_SESSIONS`]); past it the least recently used idle
    /// session is stopped, and with every session busy the call is refused (`503`).
    #[serde(default)]
    pub max_sessions: Option<usize>,
    /// Where a stdio server runs: `container` (the default: each session its own confined
    /// container, see [`McpConfine`]) or `host` (an unconfined child of the runtime).
    #[serde(default)]
    pub confine: McpConfine,
    /// The image a container-confined stdio server runs in (`command` is its entrypoint);
    /// required with `confine = "container"` (`scripts/build-mcp-image.sh` builds
    /// `roundtable-sandbox-mcp:latest`, which holds the servers the project tests).
    #[serde(default)]
    pub image: Option<String>,
    /// Gives a container-confined server the engine's default network (it has none
    /// otherwise). Only for a server that must reach the network itself.
    #[serde(default)]
    pub network: bool,
    /// The caps of each of a container-confined server's sessions.
    #[serde(default)]
    pub limits: McpLimits,
    /// The largest message the server may send, in KiB (default
    /// [`McpServer::DEFAULT_MAX_MESSAGE_KB`], 16 to 16384): a stdio session that sends a
    /// longer one (or a line that never ends) is stopped at the cap, an http answer past it
    /// fails its call. Every message is also held to 65,536 JSON values, counted before
    /// it is parsed.
    #[serde(default = "McpServer::default_max_message_kb")]
    pub max_message_kb: usize,
}

/// Where a stdio MCP server runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum McpConfine {
    /// Each session in its own container through the engine, confined as a guest is: not
    /// the service user's groups, no network, read-only root, no capabilities, seccomp
    /// and no-new-privileges, memory/cpu/pids caps, and only its own data dir (`/data`)
    /// writable, held to a disk quota. The default.
    #[default]
    Container,
    /// An unconfined child process on the host, as the service user (with its groups,
    /// such as `docker`) and its whole filesystem view; only its environment is cleared.
    /// `explain` and `doctor` flag it. For servers the operator fully trusts.
    Host,
}

impl fmt::Display for McpConfine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            McpConfine::Container => "container",
            McpConfine::Host => "host",
        })
    }
}

/// The caps of one container-confined MCP session.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpLimits {
    /// Memory in MiB (swap set equal: none); past it the kernel kills the session.
    pub memory_mb: u64,
    /// CPUs (fractions allowed).
    pub cpus: f64,
    /// Processes and threads.
    pub pids: i64,
    /// The `/tmp` tmpfs in MiB (counted in the memory cap).
    pub tmpfs_mb: u64,
    /// Disk quota of the session's data dir in MiB, counted as a workspace's: no file may
    /// grow past it, a call that passes it stops the session, and a data dir over it
    /// refuses calls.
    pub data_mb: u64,
    /// Entries (files, dirs, links) the data dir may hold.
    pub data_files: u64,
}

impl Default for McpLimits {
    fn default() -> Self {
        Self {
            memory_mb: 256,
            cpus: 0.5,
            pids: 64,
            tmpfs_mb: 16,
            data_mb: 64,
            data_files: 10_000,
        }
    }
}

impl McpLimits {
    /// The data dir's quota.
    pub fn data_quota(&self) -> crate::quota::Quota {
        crate::quota::Quota::from_mib(self.data_mb, self.data_files)
    }
}

impl McpServer {
    /// Live channel sessions per server when `max_sessions` is not set.
    pub const DEFAULT_MAX_SESSIONS: usize = 16;
    /// The message cap in KiB when `max_message_kb` is not set.
    pub const DEFAULT_MAX_MESSAGE_KB: usize = 256;

    fn default_max_message_kb() -> usize {
        Self::DEFAULT_MAX_MESSAGE_KB
    }

    /// The caps on each message the server sends.
    pub(crate) fn message_caps(&self) -> bounded::Caps {
        bounded::Caps::bytes(self.max_message_kb.saturating_mul(1024))
    }

    /// A server with the transport's default scope and session cap.
    pub fn new(name: impl Into<String>, transport: McpTransport, tools: &[&str]) -> Self {
        Self {
            name: name.into(),
            transport,
            tools: tools.iter().map(|t| (*t).to_owned()).collect(),
            scope: None,
            max_sessions: None,
            confine: McpConfine::default(),
            image: None,
            network: false,
            limits: McpLimits::default(),
            max_message_kb: Self::DEFAULT_MAX_MESSAGE_KB,
        }
    }

    /// Whether each session runs in its own container (a stdio server not set to `host`).
    pub fn in_container(&self) -> bool {
        matches!(self.transport, McpTransport::Stdio { .. })
            && self.confine == McpConfine::Container
    }

    /// Whether it is a stdio server run unconfined on the host (`confine = "host"`).
    pub fn unconfined(&self) -> bool {
        matches!(self.transport, McpTransport::Stdio { .. }) && self.confine == McpConfine::Host
    }

    /// The effective scope: as configured, else `channel` for a stdio server (its child
    /// and its files are the host's to separate) and `shared` for an http server (a
    /// remote endpoint holds one dataset whatever MCP session it is reached by; use
    /// `scope = "channel"` with `{channel}` in its url only if it keys its data by it).
    pub fn scope(&self) -> McpScope {
        self.scope.unwrap_or(match self.transport {
            McpTransport::Stdio { .. } => McpScope::Channel,
            McpTransport::Http { .. } => McpScope::Shared,
        })
    }

    /// The number of sessions that may live at once: 1 when shared.
    pub fn session_cap(&self) -> usize {
        match self.scope() {
            McpScope::Shared => 1,
            McpScope::Channel => self.max_sessions.unwrap_or(Self::DEFAULT_MAX_SESSIONS),
        }
    }
}

/// Per-turn caps of the broker.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerLimits {
    /// Largest request body the guest may send (`413` past it).
    pub max_request_bytes: usize,
    /// Largest model or tool response relayed to the guest (a streamed answer is cut off
    /// past it with an error event; a whole one gets `502`).
    pub max_response_bytes: usize,
    /// Model calls per turn (`429` past it).
    pub max_model_calls: u32,
    /// Host plus MCP tool calls per turn (`429` past it).
    pub max_tool_calls: u32,
    /// Compactions (`POST /v1/compact`) per turn (`429` past it; the guest then builds the
    /// plain summary itself). Each of their upstream calls also counts as a model call.
    pub max_compactions: u32,
    /// Deadline of one call (`504` past it); for a streamed answer, the time to the
    /// response head and the longest gap between two chunks.
    #[serde(with = "secs")]
    pub call_timeout: Duration,
    /// Calls (model, compaction, host tool, MCP) being served at once in a turn, from reading the
    /// request to the end of the answer (`429` past it).
    pub max_calls_in_flight: usize,
    /// Open connections of a turn; one more is answered `503` and closed.
    pub max_connections: usize,
}

impl Default for BrokerLimits {
    fn default() -> Self {
        Self {
            max_request_bytes: 1 << 20,
            max_response_bytes: 4 << 20,
            max_model_calls: 32,
            max_tool_calls: 64,
            max_compactions: 4,
            call_timeout: Duration::from_secs(60),
            max_calls_in_flight: 4,
            max_connections: 16,
        }
    }
}

impl BrokerLimits {
    fn validate(&self) -> Result<(), BrokerError> {
        let err = |m: &str| Err(BrokerError::InvalidLimits(m.to_owned()));
        if !(1024..=256 << 20).contains(&self.max_request_bytes) {
            return err("max_request_bytes must be 1 KiB to 256 MiB");
        }
        if !(1024..=1 << 30).contains(&self.max_response_bytes) {
            return err("max_response_bytes must be 1 KiB to 1 GiB");
        }
        if !(1..=10_000).contains(&self.max_model_calls) {
            return err("max_model_calls must be 1 to 10000");
        }
        if !(1..=10_000).contains(&self.max_tool_calls) {
            return err("max_tool_calls must be 1 to 10000");
        }
        if !(1..=1000).contains(&self.max_compactions) {
            return err("max_compactions must be 1 to 1000");
        }
        if self.call_timeout < Duration::from_millis(100)
            || self.call_timeout > Duration::from_secs(3600)
        {
            return err("call_timeout must be 0.1 s to 3600 s");
        }
        if !(1..=256).contains(&self.max_calls_in_flight) {
            return err("max_calls_in_flight must be 1 to 256");
        }
        if !(1..=1024).contains(&self.max_connections) {
            return err("max_connections must be 1 to 1024");
        }
        if self.max_connections < self.max_calls_in_flight {
            return err("max_connections must be at least max_calls_in_flight");
        }
        Ok(())
    }
}

mod secs {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(|_| {
            serde::de::Error::custom("call_timeout must be a positive number of seconds")
        })
    }
}

/// The chat-completions fields a guest may send, beyond which a call is refused (`400`
/// naming the field), and the cap on its output tokens.
///
/// Always allowed: [`ALLOWED_MODEL_FIELDS`] (`model` is accepted and replaced by the
/// configured model). `max_tokens` and `max_completion_tokens` are clamped to
/// `max_tokens`; when the guest sends neither, `max_tokens` is set to it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelRequestPolicy {
    /// The most output tokens a call may ask for.
    pub max_tokens: u32,
    /// Fields forwarded besides the built-in list (e.g. `reasoning_effort`), passed as sent.
    pub extra_fields: Vec<String>,
}

impl Default for ModelRequestPolicy {
    fn default() -> Self {
        Self {
            max_tokens: 16_384,
            extra_fields: Vec::new(),
        }
    }
}

/// The chat-completions fields forwarded to the model (besides `model`, which is replaced).
pub const ALLOWED_MODEL_FIELDS: &[&str] = &[
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "response_format",
    "max_tokens",
    "max_completion_tokens",
];

impl ModelRequestPolicy {
    /// Every forwarded field: the built-in list, then the operator's.
    pub fn allowed_fields(&self) -> impl Iterator<Item = &str> {
        ALLOWED_MODEL_FIELDS
            .iter()
            .copied()
            .chain(self.extra_fields.iter().map(String::as_str))
    }

    fn validate(&self) -> Result<(), BrokerError> {
        let err = |m: String| Err(BrokerError::InvalidModelRequest(m));
        if !(1..=10_000_000).contains(&self.max_tokens) {
            return err(format!(
                "max_tokens must be 1 to 10000000, got {}",
                self.max_tokens
            ));
        }
        let mut seen = BTreeSet::new();
        for field in &self.extra_fields {
            let valid = (1..=64).contains(&field.len())
                && field
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
            if !valid {
                return err(format!(
                    "invalid field name {field:?} in extra_fields: use 1 to 64 of A-Z, a-z, 0-9, _, - and ."
                ));
            }
            if field == "model" {
                return err(
                    "model cannot be an extra field: the configured model is always sent".into(),
                );
            }
            if ALLOWED_MODEL_FIELDS.contains(&field.as_str()) || !seen.insert(field) {
                return err(format!("field {field} is already allowed"));
            }
        }
        Ok(())
    }
}

/// A separate summarizer for compaction (the config's `[compaction]` section): its own
/// OpenAI-compatible endpoint, model and key. Like the model key, its key stays in the
/// broker; its `Debug` never shows it.
#[derive(Clone)]
pub struct CompactionModel {
    /// The API base, e.g. `https://summarizer.example.com/v1` (`/chat/completions` is added).
    pub url: String,
    /// The summarizer's model name.
    pub model: String,
    /// The summarizer's key. [`ApiKey::None`] means it was configured without a key (its
    /// variable unset, its file missing or empty): that is logged once when the broker
    /// starts, and every compaction falls back to the main model.
    pub api_key: ApiKey,
    /// Where the key comes from, as `explain` and the startup log show it (never the key).
    pub key_source: String,
    /// Deadline of one summarizer call (1 s to 600 s).
    pub timeout: Duration,
    /// Allow `http://`, and then only to loopback (a local summarizer; as for `model_url`).
    pub allow_http: bool,
}

impl CompactionModel {
    /// The default deadline of a summarizer call.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
}

impl fmt::Debug for CompactionModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompactionModel")
            .field("url", &self.url)
            .field("model", &self.model)
            .field("api_key", &self.api_key)
            .field("key_source", &self.key_source)
            .field("timeout", &self.timeout)
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

/// Everything the broker enforces.
#[derive(Clone)]
pub struct BrokerPolicy {
    /// The model's name.
    pub model: String,
    /// The model's API base.
    pub model_url: String,
    /// The model's key (only the broker holds it).
    pub api_key: ApiKey,
    /// The host tools.
    pub tools: Vec<Arc<dyn HostTool>>,
    /// The MCP servers.
    pub mcp: Vec<McpServer>,
    /// Allow `http://` to loopback endpoints.
    pub allow_http: bool,
    /// The caps on what the guest may ask.
    pub limits: BrokerLimits,
    /// The uid a connecting peer must have (SO_PEERCRED).
    pub worker_uid: u32,
    /// Whether to check the peer's uid. Off only for runtimes that do not report it
    /// (gVisor reports uid 0); the per-turn socket in a 0700 run dir still guards it.
    pub peer_uid_check: bool,
    /// The chat-completions fields forwarded and the output token cap.
    pub model_request: ModelRequestPolicy,
    /// A separate summarizer for compaction; `None` compacts through the main model.
    pub compaction: Option<CompactionModel>,
    /// The engine and identity container-confined MCP servers run with; `None`: only
    /// http and `confine = "host"` servers can be started.
    pub mcp_engine: Option<McpEngine>,
}

/// Words that mark an MCP server's env variable or header as a credential.
const CREDENTIAL_WORDS: &[&str] = &[
    "KEY",
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "AUTH",
    "CREDENTIAL",
    "COOKIE",
    "SESSION",
];
/// A credential inferred from an MCP server's config is redacted from this length on.
const MIN_INFERRED_SECRET: usize = 8;

impl BrokerPolicy {
    /// Every declared secret, redacted from whatever the guest is sent: the model key (a
    /// provider's recent keys), each host tool's [`HostTool::secrets`], and each MCP
    /// server's credentials: the values of its env variables and headers whose name holds
    /// one of [`CREDENTIAL_WORDS`] (and of `Authorization`-style values, the token after
    /// the scheme), from [`MIN_INFERRED_SECRET`] bytes on.
    pub(crate) fn secret_strings(&self) -> Vec<String> {
        let mut out = self.api_key.known();
        if let Some(summarizer) = &self.compaction {
            out.extend(summarizer.api_key.known());
        }
        for tool in &self.tools {
            out.extend(tool.secrets().iter().map(|s| s.expose_secret().to_owned()));
        }
        let credential = |name: &str| {
            let upper = name.to_ascii_uppercase();
            CREDENTIAL_WORDS.iter().any(|w| upper.contains(w))
        };
        let mut inferred = |value: &str| {
            let value = value.trim();
            for v in [Some(value), value.split_once(' ').map(|(_, t)| t.trim())]
                .into_iter()
                .flatten()
            {
                if v.len() >= MIN_INFERRED_SECRET {
                    out.push(v.to_owned());
                }
            }
        };
        for server in &self.mcp {
            match &server.transport {
                McpTransport::Stdio { env, .. } => env
                    .iter()
                    .filter(|(k, _)| credential(k))
                    .for_each(|(_, v)| inferred(v)),
                McpTransport::Http { headers, .. } => headers
                    .iter()
                    .filter(|(k, _)| credential(k))
                    .for_each(|(_, v)| inferred(v)),
            }
        }
        out
    }
}

impl fmt::Debug for BrokerPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokerPolicy")
            .field("model", &self.model)
            .field("model_url", &self.model_url)
            .field("api_key", &self.api_key)
            .field(
                "tools",
                &self.tools.iter().map(|t| t.name()).collect::<Vec<_>>(),
            )
            .field(
                "mcp",
                &self
                    .mcp
                    .iter()
                    .map(|m| (&m.name, &m.tools))
                    .collect::<Vec<_>>(),
            )
            .field("allow_http", &self.allow_http)
            .field("limits", &self.limits)
            .field("worker_uid", &self.worker_uid)
            .field("peer_uid_check", &self.peer_uid_check)
            .field("model_request", &self.model_request)
            .field("compaction", &self.compaction)
            .field("mcp_engine", &self.mcp_engine)
            .finish()
    }
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

/// Checks the policy without any side effect (no process started, no connection made):
/// the model URL, the limits, host tool names and schemas, MCP server names, transports
/// and allow-lists. That the allow-listed tools exist is checked when the broker starts.
pub fn validate_policy(policy: &BrokerPolicy) -> Result<(), BrokerError> {
    model::chat_url(&policy.model_url, policy.allow_http)?;
    policy.limits.validate()?;
    policy.model_request.validate()?;
    if let Some(summarizer) = &policy.compaction {
        compact::validate(summarizer)?;
    }
    let mut seen = BTreeSet::new();
    for tool in &policy.tools {
        let name = tool.name();
        if !valid_tool_name(name) {
            return Err(BrokerError::InvalidToolName(name.to_owned()));
        }
        if builtin_tools::ALL.contains(&name) {
            return Err(BrokerError::BuiltinToolName(name.to_owned()));
        }
        if !seen.insert(name.to_owned()) {
            return Err(BrokerError::DuplicateToolName(name.to_owned()));
        }
        tools::compile_schema(name, &tool.parameters())?;
    }
    let mut servers = BTreeSet::new();
    for server in &policy.mcp {
        mcp::validate_config(server, policy.allow_http)?;
        if !servers.insert(server.name.as_str()) {
            return Err(BrokerError::InvalidMcpServer {
                server: server.name.clone(),
                reason: "configured twice".into(),
            });
        }
    }
    Ok(())
}

/// `[a-z0-9_-]{1,64}`.
pub fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// The runtime-long broker: upstream client, host tools and MCP pool.
pub struct Broker {
    policy: BrokerPolicy,
    upstream: model::Upstream,
    compactor: compact::Compactor,
    tools: tools::HostTools,
    mcp: mcp::McpPool,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Broker")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Broker {
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
        let upstream = model::Upstream::new(&policy)?;
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
        })
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
        let task = tokio::spawn(server::serve(self.clone(), acceptor, ctx, stop.clone()));
        BrokerListener {
            path,
            stop,
            task: Some(task),
        }
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
