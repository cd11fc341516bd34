//! [`ConfigError`]: every rule a configuration can break, each with its own message.

use std::path::PathBuf;
use std::time::Duration;

use roundtable_sandbox_protocol::builtin_tools;

use super::{MAX_SOCKET_PATH, SOCKET_SUFFIX};

/// Errors of the configuration layer; each names the rule that failed and carries the
/// refused value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The Docker driver runs only on a Linux host.
    #[error("Docker sandbox execution requires a native Linux host")]
    NotLinux,
    /// `model` is empty.
    #[error("model is required")]
    ModelMissing,
    /// `time_zone` is no IANA zone name (nor one of its links or ICU's legacy ids).
    #[error("invalid time zone: {0:?}")]
    InvalidTimeZone(String),
    /// `time_zone` resolves to a zone the guest's tz database lacks.
    #[error("time zone {given:?} resolves to {canonical}, which the guest's tz database does not have; use an IANA zone name")]
    TimeZoneUnsupported {
        /// The name given.
        given: String,
        /// What it resolves to.
        canonical: &'static str,
    },
    /// `turn_timeout` is outside 1 s to 600 s.
    #[error("turn_timeout must be 1 s to 600 s, got {0:?}")]
    TurnTimeout(Duration),
    /// `image` is not a Docker image reference.
    #[error("invalid image reference: {0:?}")]
    InvalidImage(String),
    /// `limits.memory_mb` is out of range.
    #[error("limits.memory_mb must be 16 to 1048576, got {0}")]
    MemoryLimit(u64),
    /// `limits.cpus` is out of range.
    #[error("limits.cpus must be above 0 and at most 1024, got {0}")]
    CpuLimit(f64),
    /// `limits.pids` is out of range.
    #[error("limits.pids must be 8 to 65536, got {0}")]
    PidsLimit(i64),
    /// `limits.tmpfs_mb` is out of range.
    #[error("limits.tmpfs_mb must be 1 to 4096, got {0}")]
    TmpfsLimit(u64),
    /// `limits.output_kb` is out of range.
    #[error("limits.output_kb must be 1 to 65536, got {0}")]
    OutputLimit(u64),
    /// `limits.workspace_mb` is out of range.
    #[error("limits.workspace_mb must be 1 to 16777216, got {0}")]
    WorkspaceLimit(u64),
    /// `limits.workspace_files` is out of range.
    #[error("limits.workspace_files must be 16 to 10000000, got {0}")]
    WorkspaceFilesLimit(u64),
    /// `limits.disk_floor_mb` is out of range.
    #[error("limits.disk_floor_mb must be 0 to 16777216, got {0}")]
    DiskFloorLimit(u64),
    /// `limits.disk_floor_percent` is out of range.
    #[error("limits.disk_floor_percent must be 0 to 90, got {0}")]
    DiskFloorPercent(u64),
    /// `max_steps` is out of range.
    #[error("max_steps must be 1 to 256, got {0}")]
    MaxSteps(u32),
    /// `session_budget` is out of range.
    #[error("session_budget must be 1000 to 10000000 estimated tokens, got {0}")]
    SessionBudget(u64),
    /// A root is relative, or `/`.
    #[error("sandbox roots must be absolute dedicated directories: {0}")]
    RootNotAbsolute(PathBuf),
    /// A root could not be created.
    #[error("create sandbox root {path}")]
    CreateRoot {
        /// The root.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A root's metadata or canonical path could not be read.
    #[error("inspect sandbox root {path}")]
    InspectRoot {
        /// The root.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A root is not a directory of the service user closed to everyone else.
    #[error("sandbox roots must be private directories owned by the service user: {0}")]
    RootNotPrivate(PathBuf),
    /// A directory above a root can be written by group or others and is not sticky: its
    /// writers could replace the root after startup.
    #[error("sandbox root {root} lies under {ancestor}, which group or others can write (mode {mode:o}, not sticky): every directory above a root must be owned by root or the service user and writable by no one else unless sticky")]
    RootAncestorWritable {
        /// The root, as configured.
        root: PathBuf,
        /// The directory above it.
        ancestor: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A directory above a root is owned by a user other than root and the service user,
    /// who could replace the root after startup.
    #[error("sandbox root {root} lies under {ancestor}, which uid {owner} owns: every directory above a root must be owned by root or the service user and writable by no one else unless sticky")]
    RootAncestorOwner {
        /// The root, as configured.
        root: PathBuf,
        /// The directory above it.
        ancestor: PathBuf,
        /// Its owner.
        owner: u32,
    },
    /// The two roots are the same directory, or one is inside the other.
    #[error("sandbox roots must be separate: {0} and {1}")]
    RootsNotSeparate(PathBuf, PathBuf),
    /// The process runs as root, or `uid`/`gid` are not the process's own.
    #[error("run the host as a non-root user; worker uid/gid must match it")]
    Identity,
    /// `run_root` is too long for a turn's socket path.
    #[error("broker socket path too long: {0} leaves no room for {SOCKET_SUFFIX} in {MAX_SOCKET_PATH} bytes")]
    SocketPathTooLong(PathBuf),
    /// `instance` is not a valid label value.
    #[error("invalid instance name {0:?}: use 1 to 32 of a-z, 0-9 and -")]
    InvalidInstance(String),
    /// `runtime` is not a valid engine runtime name.
    #[error("invalid runtime name {0:?}: use 1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-'")]
    InvalidRuntime(String),
    /// gVisor is selected with the peer uid check on (it would refuse every turn).
    #[error("runtime {0} reports every broker peer as uid 0: set peer_uid_check = false (the per-turn 0700 run dir is then the only door to the socket)")]
    PeerUidCheckUnderRuntime(String),
    /// A rule of the broker's policy (model url, tools, MCP servers, compaction, limits).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The config file could not be read.
    #[error("read config file {path}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The config file is not valid TOML of the expected shape (unknown key, wrong type).
    #[error("config file {path}: {message}")]
    ParseFile {
        /// The file (`<string>` for text).
        path: PathBuf,
        /// The key and position, and what is wrong there.
        message: String,
    },
    /// A section names both `api_key_env` and `api_key_file`.
    #[error("{section}: set api_key_env or api_key_file, not both")]
    ApiKeyBothSources {
        /// `config file`, `compaction` or an MCP server's secret.
        section: String,
    },
    /// A section that needs a key names neither `api_key_env` nor `api_key_file`.
    #[error("{section}: set api_key_env or api_key_file")]
    ApiKeyNoSource {
        /// `compaction` or an MCP server's secret.
        section: String,
    },
    /// A secret's source (a [`KeyRef`](super::KeyRef)) names neither `env` nor `file`, or
    /// both.
    #[error("{section}: set one of env or file")]
    SecretSource {
        /// The secret, as `mcp <server>: secret_env <NAME>`.
        section: String,
    },
    /// The variable named by `api_key_env` is unset or empty.
    #[error("read api key: environment variable {var} is not set")]
    ApiKeyEnvUnset {
        /// The variable's name.
        var: String,
    },
    /// The file named by `api_key_file` is empty.
    #[error("read api key file {path}: it is empty")]
    ApiKeyFileEmpty {
        /// The file.
        path: PathBuf,
    },
    /// The file named by `api_key_file` could not be read.
    #[error("read api key file {path}")]
    ReadApiKeyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A number of seconds in the file is no duration (negative, not finite, too large).
    #[error("{key} must be a number of seconds, got {value}")]
    Seconds {
        /// The key (`turn_timeout_secs`, `compaction.timeout_secs`).
        key: &'static str,
        /// The refused value.
        value: f64,
    },
    /// A `[warm]` setting is out of its range.
    #[error("invalid [warm] setting: {0}")]
    Warm(String),
    /// `[budgets]` breaks a rule.
    #[error("budgets.{0}")]
    Budgets(String),
    /// `[audit]` breaks a rule.
    #[error("audit.{0}")]
    Audit(String),
}

/// A rule of the broker's policy, checked with the configuration: the model endpoint and
/// `[model_request]`, host tools, `[[mcp]]` servers, `[compaction]` and `[broker]`.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// An `[[egress]]` route breaks a rule.
    #[error("egress route {route}: {reason}")]
    InvalidEgressRoute {
        /// The route.
        route: String,
        /// The rule.
        reason: String,
    },
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
