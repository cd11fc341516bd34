//! The `[[mcp]]` sections: an MCP server ([`McpServer`]), how it is reached
//! ([`McpTransport`]), for whom ([`McpScope`]), where it runs ([`McpConfine`]) and its caps
//! ([`McpLimits`]), with every rule of one server's entry ([`validate`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use hyper::header::{HeaderName, HeaderValue};
use serde::Deserialize;

use super::{valid_tool_name, ConfigError, KeyRef, PolicyError};

/// Replaced by the channel's sha256 hex in a channel-scoped server's args, env values,
/// url and header values.
pub const CHANNEL_PLACEHOLDER: &str = "{channel}";
/// What `{channel}` becomes in the session that lists and pins a channel-scoped server's
/// tools at startup: 64 zeros, the hash of no channel.
pub const PROBE_SEGMENT: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// The most live sessions one channel-scoped server may be given.
const MAX_SESSIONS: usize = 1024;

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
    /// channel retires (`Broker::release_channel`), when the least recently used
    /// session makes room for another (`max_sessions`), and at shutdown. `{channel}` (the
    /// channel's sha256 hex, as its workspace dir) is substituted in `args` and `env`
    /// values (stdio) or in `url` and header values (http), so each channel's data can
    /// live in its own file. The default for stdio servers.
    Channel,
    /// One session for every channel, started with the broker: whatever the server
    /// keeps is seen by every channel (cross-channel). Its calls run one at a time, handed
    /// out in turn across channels, each up to `call_timeout` from when it holds the
    /// session: one channel's slow call delays the others'. A stdio call that times out
    /// stops the session, and the calls waiting behind it (never sent) run on the restarted
    /// one. The default for http servers.
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
    /// Secrets of a stdio server's environment, each read as the model's key is
    /// ([`KeyRef`]: `{ env = "VAR" }` or `{ file = "…" }`) when a config file is read, then
    /// set in its `env`; every one is redacted from whatever the guest is sent.
    #[serde(default)]
    pub secret_env: BTreeMap<String, KeyRef>,
    /// Secrets of an http server's headers, read and redacted the same way.
    #[serde(default)]
    pub secret_headers: BTreeMap<String, KeyRef>,
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
            secret_env: BTreeMap::new(),
            secret_headers: BTreeMap::new(),
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

    /// Reads its `secret_env` into its environment and its `secret_headers` into its
    /// headers (a config file's secrets: [`KeyRef::read`]); a name already set plainly, or
    /// a secret of the other transport, is an error.
    pub(crate) fn read_secrets(&mut self) -> Result<(), ConfigError> {
        let name = self.name.clone();
        let section = |kind: &str, key: &str| format!("mcp {name}: {kind} {key}");
        let misplaced = |reason: &str| {
            ConfigError::Policy(PolicyError::InvalidMcpServer {
                server: name.clone(),
                reason: reason.to_owned(),
            })
        };
        match &mut self.transport {
            McpTransport::Stdio { env, .. } => {
                if !self.secret_headers.is_empty() {
                    return Err(misplaced("secret_headers apply only to http servers"));
                }
                for (key, source) in &self.secret_env {
                    let value = source.read(&section("secret_env", key))?;
                    if env.contains_key(key) {
                        return Err(misplaced(&format!("{key} is in both env and secret_env")));
                    }
                    env.insert(
                        key.clone(),
                        secrecy::ExposeSecret::expose_secret(&value).to_owned(),
                    );
                }
            }
            McpTransport::Http { headers, .. } => {
                if !self.secret_env.is_empty() {
                    return Err(misplaced("secret_env applies only to stdio servers"));
                }
                for (key, source) in &self.secret_headers {
                    let value = source.read(&section("secret_headers", key))?;
                    if headers.keys().any(|h| h.eq_ignore_ascii_case(key)) {
                        return Err(misplaced(&format!(
                            "{key} is in both headers and secret_headers"
                        )));
                    }
                    headers.insert(
                        key.clone(),
                        secrecy::ExposeSecret::expose_secret(&value).to_owned(),
                    );
                }
            }
        }
        Ok(())
    }

    /// Whether `name` (an env variable or a header) holds one of its `secret_env` or
    /// `secret_headers`.
    pub(crate) fn declared_secret(&self, name: &str) -> bool {
        self.secret_env.contains_key(name)
            || self
                .secret_headers
                .keys()
                .any(|h| h.eq_ignore_ascii_case(name))
    }

    /// The number of sessions that may live at once: 1 when shared.
    pub fn session_cap(&self) -> usize {
        match self.scope() {
            McpScope::Shared => 1,
            McpScope::Channel => self.max_sessions.unwrap_or(Self::DEFAULT_MAX_SESSIONS),
        }
    }
}

/// An MCP tool name: 1 to 64 of `A-Z`, `a-z`, `0-9`, `_`, `-` (a path segment).
fn valid_mcp_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Pure checks of one server's configuration, in order: its name and tool allow-list, its
/// scope, its confinement, its transport; the first refused is the error.
pub(crate) fn validate(config: &McpServer, allow_http: bool) -> Result<(), PolicyError> {
    check_tools(config)
        .and_then(|()| check_scope(config))
        .and_then(|()| check_confinement(config))
        .and_then(|()| check_transport(&config.transport, allow_http))
        .map_err(|reason| PolicyError::InvalidMcpServer {
            server: config.name.clone(),
            reason,
        })
}

/// The server's name, its message size and its tool allow-list (not empty, each name
/// valid and listed once).
fn check_tools(config: &McpServer) -> Result<(), String> {
    if !valid_tool_name(&config.name) {
        return Err("invalid server name: use 1 to 64 of a-z, 0-9, _ and -".into());
    }
    if config.tools.is_empty() {
        return Err("the tool allow-list is empty".into());
    }
    if !(16..=16_384).contains(&config.max_message_kb) {
        return Err(format!(
            "max_message_kb must be 16 to 16384, got {}",
            config.max_message_kb
        ));
    }
    let mut seen = BTreeSet::new();
    for tool in &config.tools {
        if !valid_mcp_tool_name(tool) {
            return Err(format!(
                "invalid tool name {tool:?} in the allow-list: use 1 to 64 of A-Z, a-z, 0-9, _ and -"
            ));
        }
        if !seen.insert(tool) {
            return Err(format!("tool {tool} is allow-listed twice"));
        }
    }
    Ok(())
}

/// The scope: `max_sessions` only for a channel scope, in range; `{channel}` only where
/// it may stand (args and env values, the url and header values) and never in a shared
/// server's.
fn check_scope(config: &McpServer) -> Result<(), String> {
    let has = |s: &String| s.contains(CHANNEL_PLACEHOLDER);
    let scope = config.scope();
    match (scope, config.max_sessions) {
        (McpScope::Shared, Some(_)) => {
            return Err("max_sessions applies only to scope = \"channel\"".into())
        }
        (_, Some(n)) if !(1..=MAX_SESSIONS).contains(&n) => {
            return Err(format!("max_sessions must be 1 to {MAX_SESSIONS}, got {n}"))
        }
        _ => {}
    }
    let uses_channel = match &config.transport {
        McpTransport::Stdio { command, args, env } => {
            if has(command) || env.keys().any(has) {
                return Err("{channel} can be used only in args and env values".into());
            }
            args.iter().any(has) || env.values().any(has)
        }
        McpTransport::Http { url, headers } => {
            if headers.keys().any(has) {
                return Err("{channel} can be used only in the url and header values".into());
            }
            has(url) || headers.values().any(has)
        }
    };
    if uses_channel && scope == McpScope::Shared {
        return Err(
            "{channel} is used but scope is \"shared\" (one session for every channel)".into(),
        );
    }
    Ok(())
}

/// The confinement: confine, image, network and limits only for a stdio server; a
/// contained one with a valid image, a host one with none of them; the limits in range.
fn check_confinement(config: &McpServer) -> Result<(), String> {
    let stdio = matches!(config.transport, McpTransport::Stdio { .. });
    if !stdio
        && (config.confine != McpConfine::Container
            || config.image.is_some()
            || config.network
            || config.limits != McpLimits::default())
    {
        return Err("confine, image, network and limits apply only to stdio servers".into());
    }
    if !stdio {
        return Ok(());
    }
    match (config.confine, &config.image) {
        (McpConfine::Container, None) => {
            return Err(
                "a stdio server runs in its own container: set image (scripts/build-mcp-image.sh builds roundtable-sandbox-mcp:latest), or confine = \"host\" to run it unconfined on the host".into(),
            )
        }
        (McpConfine::Container, Some(image))
            if image.is_empty() || image.chars().any(|c| c.is_whitespace() || c.is_control()) =>
        {
            return Err(format!("invalid image {image:?}"))
        }
        (McpConfine::Host, Some(_)) => {
            return Err(
                "image is set but confine = \"host\" runs the server on the host".into(),
            )
        }
        (McpConfine::Host, _) if config.network || config.limits != McpLimits::default() => {
            return Err("network and limits apply only to confine = \"container\"".into())
        }
        _ => {}
    }
    let l = &config.limits;
    let in_range = (16..=65_536).contains(&l.memory_mb)
        && l.cpus > 0.0
        && l.cpus <= 64.0
        && (8..=4096).contains(&l.pids)
        && (1..=4096).contains(&l.tmpfs_mb)
        && (1..=1_048_576).contains(&l.data_mb)
        && (16..=10_000_000).contains(&l.data_files);
    if !in_range {
        return Err(format!(
            "limits out of range (memory_mb 16 to 65536, cpus above 0 to 64, pids 8 to 4096, tmpfs_mb 1 to 4096, data_mb 1 to 1048576, data_files 16 to 10000000): {l:?}"
        ));
    }
    Ok(())
}

/// The transport: a stdio server's command and environment names; an HTTP server's url
/// (https, or http to loopback with `allow_http`) and header names and values.
fn check_transport(transport: &McpTransport, allow_http: bool) -> Result<(), String> {
    match transport {
        McpTransport::Stdio { command, env, .. } => {
            if command.trim().is_empty() {
                return Err("the command is empty".into());
            }
            if env
                .keys()
                .any(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
            {
                return Err("invalid environment variable name".into());
            }
        }
        McpTransport::Http { url, headers } => {
            let parsed = reqwest::Url::parse(&url.replace(CHANNEL_PLACEHOLDER, PROBE_SEGMENT))
                .map_err(|_| format!("invalid url: {url}"))?;
            match parsed.scheme() {
                "https" => {}
                "http" if allow_http && super::model::loopback(&parsed) => {}
                "http" if allow_http => {
                    return Err(format!(
                        "url uses http to a host that is not loopback (allow_http covers only 127.0.0.0/8, ::1 and localhost): {url}"
                    ))
                }
                "http" => {
                    return Err(format!(
                        "url must use https (set allow_http only for offline tests): {url}"
                    ))
                }
                _ => return Err(format!("invalid url: {url}")),
            }
            for (name, value) in headers {
                if HeaderName::try_from(name.as_str()).is_err()
                    || HeaderValue::try_from(value.replace(CHANNEL_PLACEHOLDER, PROBE_SEGMENT))
                        .is_err()
                {
                    return Err(format!("invalid header {name}"));
                }
            }
        }
    }
    Ok(())
}
