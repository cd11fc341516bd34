//! The credential broker: the only door out of a turn's container.
//!
//! One [`Broker`] lives as long as the runtime (it owns the upstream HTTP client and the
//! MCP server pool); each turn gets a [`BrokerListener`] on `<run_dir>/broker.sock`, bound
//! to that turn's [`TurnContext`] (channel, speaker, cancellation).
//!
//! Parts:
//! - [`ApiKey`]: the model key, a secret that never prints, static or from an async provider;
//! - [`HostTool`]: the trait a bot author implements for a host tool;
//! - [`McpServerConfig`]: an MCP server and the allow-list of its tools;
//! - [`BrokerLimits`]: per-turn caps on sizes, call counts and call time;
//! - [`BrokerPolicy`]: all of the above plus the model endpoint, validated at setup.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use roundtable_sandbox_protocol::{McpServerSpec, Speaker, ToolSpec};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// A boxed future, as the object-safe traits of this crate return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Errors of the broker layer.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("model_url must use https (set allow_http only for offline tests): {0}")]
    InsecureModelUrl(String),
    #[error("invalid model_url: {0}")]
    InvalidModelUrl(String),
    #[error("invalid tool name {0:?}: use 1 to 64 of a-z, 0-9, _ and -")]
    InvalidToolName(String),
    #[error("duplicate tool name: {0}")]
    DuplicateToolName(String),
    #[error("bind broker socket {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("api key provider failed: {0}")]
    ApiKey(String),
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
    Provider(Arc<dyn ApiKeyProvider>),
    /// No key (a local model that needs none).
    None,
}

impl ApiKey {
    /// A fixed key.
    pub fn from_static(key: impl Into<String>) -> Self {
        ApiKey::Static(Arc::new(SecretString::from(key.into())))
    }

    /// Resolves the key for one call.
    pub async fn resolve(&self) -> Result<Option<SecretString>, BrokerError> {
        match self {
            ApiKey::Static(k) => Ok(Some(SecretString::from(k.expose_secret().to_owned()))),
            ApiKey::Provider(p) => p.key().await.map(Some).map_err(BrokerError::ApiKey),
            ApiKey::None => Ok(None),
        }
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
    pub channel: String,
    pub speaker: Speaker,
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
    /// Runs the tool with validated arguments; an `Err` reaches the guest as a readable error.
    fn call(
        &self,
        args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>>;
}

/// How an MCP server is reached.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case", tag = "transport")]
pub enum McpTransport {
    /// A child process speaking MCP on stdio; its env stays on the host.
    Stdio {
        command: String,
        #[serde(default)]
        args: Vec<String>,
        #[serde(default)]
        env: std::collections::BTreeMap<String, String>,
    },
    /// A streamable-HTTP MCP endpoint.
    Http {
        url: String,
        #[serde(default)]
        headers: std::collections::BTreeMap<String, String>,
    },
}

/// An MCP server and the tools of it that the guest may call.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerConfig {
    pub name: String,
    #[serde(flatten)]
    pub transport: McpTransport,
    pub tools: Vec<String>,
}

/// Per-turn caps of the broker.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerLimits {
    pub max_request_bytes: usize,
    pub max_response_bytes: usize,
    pub max_model_calls: u32,
    pub max_tool_calls: u32,
    #[serde(with = "secs")]
    pub call_timeout: Duration,
}

impl Default for BrokerLimits {
    fn default() -> Self {
        Self {
            max_request_bytes: 1 << 20,
            max_response_bytes: 4 << 20,
            max_model_calls: 32,
            max_tool_calls: 64,
            call_timeout: Duration::from_secs(60),
        }
    }
}

mod secs {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_secs_f64(f64::deserialize(d)?))
    }
}

/// Everything the broker enforces.
#[derive(Clone)]
pub struct BrokerPolicy {
    pub model: String,
    pub model_url: String,
    pub api_key: ApiKey,
    pub tools: Vec<Arc<dyn HostTool>>,
    pub mcp: Vec<McpServerConfig>,
    pub allow_http: bool,
    pub limits: BrokerLimits,
    /// The uid a connecting peer must have (SO_PEERCRED).
    pub worker_uid: u32,
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
            .field("mcp", &self.mcp)
            .field("allow_http", &self.allow_http)
            .field("limits", &self.limits)
            .finish()
    }
}

/// One turn's view: who speaks in which channel, and the turn's cancellation.
#[derive(Debug, Clone)]
pub struct TurnContext {
    pub channel: String,
    pub speaker: Speaker,
    pub cancel: CancellationToken,
}

/// Checks the policy without any side effect (no process started, no connection made).
pub fn validate_policy(policy: &BrokerPolicy) -> Result<(), BrokerError> {
    let url = policy.model_url.trim();
    let scheme = url.split("://").next().unwrap_or("");
    if !url.contains("://") || url.len() <= scheme.len() + 3 {
        return Err(BrokerError::InvalidModelUrl(policy.model_url.clone()));
    }
    match scheme {
        "https" => {}
        "http" if policy.allow_http => {}
        "http" => return Err(BrokerError::InsecureModelUrl(policy.model_url.clone())),
        _ => return Err(BrokerError::InvalidModelUrl(policy.model_url.clone())),
    }
    let mut seen = std::collections::BTreeSet::new();
    for tool in &policy.tools {
        let name = tool.name();
        if !valid_tool_name(name) {
            return Err(BrokerError::InvalidToolName(name.to_owned()));
        }
        if !seen.insert(name.to_owned()) {
            return Err(BrokerError::DuplicateToolName(name.to_owned()));
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

/// The runtime-long broker: upstream client and MCP pool.
#[derive(Debug)]
pub struct Broker {
    policy: BrokerPolicy,
}

impl Broker {
    /// Validates the policy and prepares the shared parts.
    pub async fn new(policy: BrokerPolicy) -> Result<Self, BrokerError> {
        validate_policy(&policy)?;
        Ok(Self { policy })
    }

    /// The tool specs handed to each turn: host tools, then allow-listed MCP tools.
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
        (tools, Vec::new())
    }

    /// Listens on `socket` for one turn.
    pub async fn listen(
        self: &Arc<Self>,
        socket: &Path,
        ctx: TurnContext,
    ) -> Result<BrokerListener, BrokerError> {
        let listener = UnixListener::bind(socket).map_err(|source| BrokerError::Bind {
            path: socket.to_owned(),
            source,
        })?;
        let stop = ctx.cancel.child_token();
        let task_stop = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = task_stop.cancelled() => break,
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        drop(stream);
                    }
                }
            }
        });
        Ok(BrokerListener {
            path: socket.to_owned(),
            stop,
            task: Some(task),
        })
    }

    /// Ends the runtime-long parts (MCP children).
    pub async fn shutdown(&self) {}
}

/// One turn's listener. Stopping (or dropping) it ends every call in flight.
#[derive(Debug)]
pub struct BrokerListener {
    path: PathBuf,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl BrokerListener {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, ends every connection and removes the socket file.
    pub async fn stop(mut self) -> Result<(), std::io::Error> {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
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
            task.abort();
        }
    }
}

#[allow(dead_code)]
fn _assert_expose(s: &SecretString) -> usize {
    s.expose_secret().len()
}
