//! The MCP bridge: `POST /v1/mcp/{server}/{tool}` through an rmcp client pool.
//!
//! - [`validate_config`]: pure checks of one server's configuration;
//! - [`McpPool::start`]: every server started (stdio child or streamable HTTP), its tools
//!   listed, the allow-list checked against them, and each allow-listed tool's description
//!   and input schema **pinned**;
//! - [`McpPool::call`]: only allow-listed tools; arguments validated against the pinned
//!   schema; a dead server is restarted on next use and re-listed, and a server whose
//!   allow-listed tools changed is refused from then on (tool rug-pull); the call is
//!   dropped, which sends `notifications/cancelled`, when the turn ends or the deadline
//!   passes;
//! - [`McpPool::shutdown`]: children closed, then terminated and reaped.
//!
//! Servers live as long as the [`super::Broker`], not per turn. A stdio child gets only
//! its configured env plus a few harmless variables, never the runtime's whole env.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use hyper::header::{HeaderName, HeaderValue};
use hyper::StatusCode;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::ServiceExt;
use roundtable_sandbox_protocol::{McpServerSpec, ToolSpec};
use tokio::io::AsyncBufReadExt;
use tokio_util::sync::CancellationToken;

use super::server::{error_response, Response};
use super::tools::{check_args, compile_schema, tool_result};
use super::{valid_tool_name, BrokerError, BrokerPolicy, McpServerConfig, McpTransport};

/// Variables a stdio child inherits from the runtime; everything else it gets is configured.
const INHERITED_ENV: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"];
/// How long starting (or restarting) a server may take.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to exit at shutdown before it is killed.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// An MCP tool name: 1 to 64 of `A-Z`, `a-z`, `0-9`, `_`, `-` (a path segment).
fn valid_mcp_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Pure checks of one server's configuration.
pub(crate) fn validate_config(
    config: &McpServerConfig,
    allow_http: bool,
) -> Result<(), BrokerError> {
    let err = |reason: String| BrokerError::InvalidMcpServer {
        server: config.name.clone(),
        reason,
    };
    if !valid_tool_name(&config.name) {
        return Err(err(
            "invalid server name: use 1 to 64 of a-z, 0-9, _ and -".into()
        ));
    }
    if config.tools.is_empty() {
        return Err(err("the tool allow-list is empty".into()));
    }
    let mut seen = BTreeSet::new();
    for tool in &config.tools {
        if !valid_mcp_tool_name(tool) {
            return Err(err(format!(
                "invalid tool name {tool:?} in the allow-list: use 1 to 64 of A-Z, a-z, 0-9, _ and -"
            )));
        }
        if !seen.insert(tool) {
            return Err(err(format!("tool {tool} is allow-listed twice")));
        }
    }
    match &config.transport {
        McpTransport::Stdio { command, env, .. } => {
            if command.trim().is_empty() {
                return Err(err("the command is empty".into()));
            }
            if env
                .keys()
                .any(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
            {
                return Err(err("invalid environment variable name".into()));
            }
        }
        McpTransport::Http { url, headers } => {
            let parsed =
                reqwest::Url::parse(url).map_err(|_| err(format!("invalid url: {url}")))?;
            match parsed.scheme() {
                "https" => {}
                "http" if allow_http => {}
                "http" => {
                    return Err(err(format!(
                        "url must use https (set allow_http only for offline tests): {url}"
                    )))
                }
                _ => return Err(err(format!("invalid url: {url}"))),
            }
            for (name, value) in headers {
                if HeaderName::try_from(name.as_str()).is_err()
                    || HeaderValue::try_from(value.as_str()).is_err()
                {
                    return Err(err(format!("invalid header {name}")));
                }
            }
        }
    }
    Ok(())
}

/// An allow-listed tool as first read.
struct Pinned {
    description: String,
    schema: serde_json::Value,
    validator: jsonschema::Validator,
}

enum State {
    Running(RunningService<RoleClient, ()>),
    Dead,
    Refused(String),
    Shutdown,
}

struct Server {
    config: McpServerConfig,
    pins: BTreeMap<String, Pinned>,
    state: tokio::sync::Mutex<State>,
}

/// The MCP servers of a broker.
pub(crate) struct McpPool {
    servers: BTreeMap<String, Arc<Server>>,
    /// Server names in configuration order (the order handed to the turn).
    order: Vec<String>,
    http: reqwest::Client,
}

impl McpPool {
    /// Starts every server, lists its tools and pins the allow-listed ones.
    pub(crate) async fn start(
        configs: &[McpServerConfig],
        call_timeout: Duration,
    ) -> Result<Self, BrokerError> {
        let http = super::model::http_client(call_timeout.min(Duration::from_secs(10)))?;
        let mut pool = Self {
            servers: BTreeMap::new(),
            order: configs.iter().map(|c| c.name.clone()).collect(),
            http,
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

    async fn start_one(&self, config: &McpServerConfig) -> Result<Server, BrokerError> {
        let start_err = |error: String| BrokerError::McpStart {
            server: config.name.clone(),
            error,
        };
        let service = connect(config, &self.http).await.map_err(start_err)?;
        let listed = match list(&service).await {
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
                    return Err(e);
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
        tracing::info!(server = %config.name, tools = pins.len(), "MCP server ready");
        Ok(Server {
            config: config.clone(),
            pins,
            state: tokio::sync::Mutex::new(State::Running(service)),
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

    /// Calls an allow-listed tool.
    pub(crate) async fn call(
        &self,
        server: &str,
        tool: &str,
        args: serde_json::Map<String, serde_json::Value>,
        stop: &CancellationToken,
        policy: &BrokerPolicy,
    ) -> Response {
        let Some((srv, pin)) = self
            .servers
            .get(server)
            .and_then(|s| s.pins.get(tool).map(|p| (s, p)))
        else {
            return error_response(
                StatusCode::NOT_FOUND,
                &format!("unknown MCP tool: {server}/{tool}"),
            );
        };
        let value = serde_json::Value::Object(args);
        if let Err(msg) = check_args(&pin.validator, &value) {
            return error_response(StatusCode::BAD_REQUEST, &msg);
        }
        let serde_json::Value::Object(args) = value else {
            unreachable!("built from an object")
        };
        let timeout = policy.limits.call_timeout;
        let work = async {
            let peer = self.ready(srv).await?;
            let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(args);
            // Dropping this future (deadline, turn stop) sends notifications/cancelled.
            match peer.call_tool(params).await {
                Ok(result) => Ok(result),
                Err(ServiceError::McpError(e)) => Err(CallError::Tool(e.message.to_string())),
                Err(e) => {
                    tracing::warn!(server, error = %e, "MCP call failed");
                    let closed = matches!(
                        e,
                        ServiceError::TransportClosed | ServiceError::TransportSend(_)
                    ) || peer.is_transport_closed();
                    if closed {
                        // Restarted on next use.
                        let mut state = srv.state.lock().await;
                        if let State::Running(s) = &*state {
                            if s.is_closed() || s.peer().is_transport_closed() {
                                *state = State::Dead;
                            }
                        }
                        Err(CallError::Failed(format!(
                            "MCP server {server} stopped during the call"
                        )))
                    } else {
                        Err(CallError::Failed(format!(
                            "MCP server {server} failed the call"
                        )))
                    }
                }
            }
        };
        let outcome = tokio::select! {
            r = tokio::time::timeout(timeout, work) => r,
            _ = stop.cancelled() => {
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "turn cancelled");
            }
        };
        match outcome {
            Err(_) => error_response(
                StatusCode::GATEWAY_TIMEOUT,
                &format!("tool call timed out after {timeout:?}"),
            ),
            Ok(Err(CallError::Failed(msg))) => error_response(StatusCode::BAD_GATEWAY, &msg),
            Ok(Err(CallError::Tool(msg))) => tool_result(Err(format!("MCP error: {msg}")), policy),
            Ok(Ok(result)) => {
                let text = result_text(&result.content, result.structured_content.as_ref());
                if result.is_error == Some(true) {
                    tool_result(Err(text), policy)
                } else {
                    tool_result(Ok(text), policy)
                }
            }
        }
    }

    /// The server's peer, restarting a dead server (and re-checking its pins) first.
    async fn ready(&self, srv: &Server) -> Result<rmcp::Peer<RoleClient>, CallError> {
        let name = &srv.config.name;
        let mut state = srv.state.lock().await;
        match &*state {
            State::Running(s) if !s.is_closed() && !s.peer().is_transport_closed() => {
                return Ok(s.peer().clone());
            }
            State::Refused(why) => return Err(CallError::Failed(why.clone())),
            State::Shutdown => {
                return Err(CallError::Failed(format!("MCP server {name} is shut down")))
            }
            _ => {}
        }
        let old = std::mem::replace(&mut *state, State::Dead);
        if let State::Running(s) = old {
            close(s).await;
        }
        tracing::info!(server = %name, "restarting MCP server");
        let unavailable = || CallError::Failed(format!("MCP server {name} is unavailable"));
        let service = connect(&srv.config, &self.http).await.map_err(|e| {
            tracing::warn!(server = %name, error = %e, "MCP server restart failed");
            unavailable()
        })?;
        let listed = match list(&service).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(server = %name, error = %e, "MCP server listing failed");
                close(service).await;
                return Err(unavailable());
            }
        };
        for (tool, pin) in &srv.pins {
            let same = listed
                .get(tool)
                .is_some_and(|(d, s)| *d == pin.description && *s == pin.schema);
            if !same {
                let why = format!(
                    "MCP server {name} changed tool {tool} since it was approved; it is refused"
                );
                tracing::warn!(server = %name, tool = %tool, "MCP tool changed after pinning; server refused");
                close(service).await;
                *state = State::Refused(why.clone());
                return Err(CallError::Failed(why));
            }
        }
        let peer = service.peer().clone();
        *state = State::Running(service);
        Ok(peer)
    }

    /// Closes every server; a child that does not exit is terminated, then killed, and
    /// always reaped.
    pub(crate) async fn shutdown(&self) {
        for srv in self.servers.values() {
            let old = std::mem::replace(&mut *srv.state.lock().await, State::Shutdown);
            if let State::Running(s) = old {
                close(s).await;
            }
        }
    }
}

enum CallError {
    /// The server failed (a `502`).
    Failed(String),
    /// The server answered the call with an error (a readable `{"ok":false}`).
    Tool(String),
}

/// Starts one server and runs the MCP handshake.
async fn connect(
    config: &McpServerConfig,
    http: &reqwest::Client,
) -> Result<RunningService<RoleClient, ()>, String> {
    let start = async {
        match &config.transport {
            McpTransport::Stdio { command, args, env } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args).env_clear().kill_on_drop(true);
                for var in INHERITED_ENV {
                    if let Some(v) = std::env::var_os(var) {
                        cmd.env(var, v);
                    }
                }
                cmd.envs(env);
                let (process, stderr) = TokioChildProcess::builder(cmd)
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("spawn {command}: {e}"))?;
                if let Some(stderr) = stderr {
                    let server = config.name.clone();
                    tokio::spawn(async move {
                        let mut lines = tokio::io::BufReader::new(stderr).lines();
                        while let Ok(Some(line)) = lines.next_line().await {
                            let line: String = line.chars().take(500).collect();
                            tracing::debug!(server = %server, "MCP stderr: {line}");
                        }
                    });
                }
                ().serve(process).await.map_err(|e| e.to_string())
            }
            McpTransport::Http { url, headers } => {
                let mut custom = HashMap::new();
                for (k, v) in headers {
                    let name = HeaderName::try_from(k.as_str()).map_err(|e| e.to_string())?;
                    let mut value = HeaderValue::try_from(v.as_str()).map_err(|e| e.to_string())?;
                    value.set_sensitive(true);
                    custom.insert(name, value);
                }
                let transport = StreamableHttpClientTransport::with_client(
                    http.clone(),
                    StreamableHttpClientTransportConfig::with_uri(url.as_str())
                        .custom_headers(custom),
                );
                ().serve(transport).await.map_err(|e| e.to_string())
            }
        }
    };
    tokio::time::timeout(START_TIMEOUT, start)
        .await
        .map_err(|_| format!("no MCP handshake within {START_TIMEOUT:?}"))?
}

/// The server's tools: name → (description, input schema).
async fn list(
    service: &RunningService<RoleClient, ()>,
) -> Result<BTreeMap<String, (String, serde_json::Value)>, String> {
    let tools = tokio::time::timeout(START_TIMEOUT, service.peer().list_all_tools())
        .await
        .map_err(|_| format!("no tool list within {START_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    Ok(tools
        .into_iter()
        .map(|t| {
            (
                t.name.to_string(),
                (
                    t.description.map(Cow::into_owned).unwrap_or_default(),
                    serde_json::Value::Object((*t.input_schema).clone()),
                ),
            )
        })
        .collect())
}

/// Closes a server (for a child: stdin closed, then SIGTERM, then SIGKILL; reaped).
async fn close(mut service: RunningService<RoleClient, ()>) {
    if tokio::time::timeout(SHUTDOWN_TIMEOUT, service.close())
        .await
        .is_err()
    {
        tracing::warn!("MCP server did not close in time");
    }
}

/// The text of a tool result: text blocks joined; other blocks (and structured content
/// when there is no text) as JSON.
fn result_text(
    content: &[rmcp::model::ContentBlock],
    structured: Option<&serde_json::Value>,
) -> String {
    let mut parts = Vec::new();
    for block in content {
        let v = serde_json::to_value(block).unwrap_or_default();
        match v.get("text").and_then(|t| t.as_str()) {
            Some(t) if v.get("type").and_then(|t| t.as_str()) == Some("text") => {
                parts.push(t.to_owned())
            }
            _ => parts.push(v.to_string()),
        }
    }
    if parts.is_empty() {
        if let Some(s) = structured {
            parts.push(s.to_string());
        }
    }
    parts.join("\n")
}
