//! [`BrokerPolicy`]: everything the broker enforces, built once from the resolved
//! configuration, and its check ([`validate_policy`]) for a broker driven alone.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use roundtable_sandbox_protocol::builtin_tools;
use secrecy::ExposeSecret;

use super::{HostTool, McpEngine};
use crate::config::{
    self, ApiKey, BrokerLimits, Cidr, CompactionModel, EgressRoute, McpServer, McpTransport,
    ModelRequestPolicy, PolicyError,
};

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
    /// The egress routes (`[[egress]]`).
    pub egress: Vec<EgressRoute>,
    /// The name server egress hosts are resolved with (`None`: the system's).
    pub egress_nameserver: Option<std::net::SocketAddr>,
    /// The container engine's own networks: never an egress address unless a route names
    /// them (filled when the runtime starts).
    pub engine_networks: Vec<Cidr>,
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
    /// server's credentials: its `secret_env` and `secret_headers`, and the values of its
    /// other env variables and headers whose name holds one of [`CREDENTIAL_WORDS`] (and of
    /// `Authorization`-style values, the token after the scheme), from
    /// [`MIN_INFERRED_SECRET`] bytes on.
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
        let mut declared = Vec::new();
        for server in &self.mcp {
            let values = match &server.transport {
                McpTransport::Stdio { env, .. } => env,
                McpTransport::Http { headers, .. } => headers,
            };
            for (name, value) in values {
                if server.declared_secret(name) {
                    declared.push(value.trim().to_owned());
                } else if credential(name) {
                    inferred(value);
                }
            }
        }
        out.extend(declared.into_iter().filter(|v| !v.is_empty()));
        // Each also as a JSON encoder may write it in an upstream's error or echo: `/` as
        // `\/` (PHP's does), `"` and `\` escaped.
        let escaped: Vec<String> = out
            .iter()
            .filter(|s| s.contains(['/', '"', '\\']))
            .flat_map(|s| {
                let quoted = serde_json::Value::String(s.clone()).to_string();
                let json = quoted[1..quoted.len() - 1].to_owned();
                let slashed = json.replace('/', "\\/");
                [json, slashed]
            })
            .collect();
        out.extend(escaped);
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

/// Checks the policy without any side effect (no process started, no connection made):
/// the model URL, the limits, host tool names and schemas, MCP server names, transports
/// and allow-lists. That the allow-listed tools exist is checked when the broker starts.
pub fn validate_policy(policy: &BrokerPolicy) -> Result<(), PolicyError> {
    config::model::chat_url(&policy.model_url, policy.allow_http)?;
    policy.limits.validate()?;
    policy.model_request.validate()?;
    if let Some(summarizer) = &policy.compaction {
        config::compaction::validate(summarizer)?;
    }
    let mut seen = BTreeSet::new();
    for tool in &policy.tools {
        let name = tool.name();
        if !config::valid_tool_name(name) {
            return Err(PolicyError::InvalidToolName(name.to_owned()));
        }
        if builtin_tools::ALL.contains(&name) {
            return Err(PolicyError::BuiltinToolName(name.to_owned()));
        }
        if !seen.insert(name.to_owned()) {
            return Err(PolicyError::DuplicateToolName(name.to_owned()));
        }
        super::tools::compile_schema(name, &tool.parameters())?;
    }
    config::egress::validate(&policy.egress)?;
    let mut servers = BTreeSet::new();
    for server in &policy.mcp {
        config::mcp::validate(server, policy.allow_http)?;
        if !servers.insert(server.name.as_str()) {
            return Err(PolicyError::InvalidMcpServer {
                server: server.name.clone(),
                reason: "configured twice".into(),
            });
        }
    }
    Ok(())
}
