//! The TOML config file: parsed into a [`ConfigFile`] (unknown keys refused, with the key's
//! path and position), then turned into a [`Config`] with [`TryFrom`]. The key is never in
//! the file: it comes from the variable or the file the config names.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{ApiKey, BrokerLimits, CompactionModel, McpServer, ModelRequestPolicy};

use super::keys::read_key;
use super::{Config, ConfigError, Limits};

/// The TOML form of [`Config`]: the same keys (the key itself excepted). Host tools and a
/// custom driver are code, so they are not in the file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// See [`Config::image`].
    pub image: String,
    /// See [`Config::run_root`].
    pub run_root: PathBuf,
    /// See [`Config::workspace_root`].
    pub workspace_root: PathBuf,
    /// See [`Config::model`].
    pub model: String,
    /// See [`Config::model_url`].
    pub model_url: String,
    /// Name of an environment variable holding the key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Path of a file holding the key.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// See [`Config::prompt`].
    #[serde(default)]
    pub prompt: Option<String>,
    /// See [`Config::time_zone`].
    #[serde(default)]
    pub time_zone: Option<String>,
    /// See [`Config::uid`].
    #[serde(default)]
    pub uid: Option<u32>,
    /// See [`Config::gid`].
    #[serde(default)]
    pub gid: Option<u32>,
    /// `[limits]`: see [`Limits`].
    #[serde(default)]
    pub limits: Limits,
    /// The turn timeout in seconds (see [`Config::turn_timeout`]).
    #[serde(default)]
    pub turn_timeout_secs: Option<f64>,
    /// See [`Config::allow_http`].
    #[serde(default)]
    pub allow_http: bool,
    /// `[broker]`: see [`BrokerLimits`].
    #[serde(default)]
    pub broker: BrokerLimits,
    /// `[[mcp]]`: see [`McpServer`].
    #[serde(default)]
    pub mcp: Vec<McpServer>,
    /// See [`Config::instance`].
    #[serde(default)]
    pub instance: Option<String>,
    /// See [`Config::max_steps`].
    #[serde(default)]
    pub max_steps: Option<u32>,
    /// See [`Config::session_budget`].
    #[serde(default)]
    pub session_budget: Option<u64>,
    /// See [`Config::docker_host`].
    #[serde(default)]
    pub docker_host: Option<String>,
    /// See [`Config::peer_uid_check`] (default true).
    #[serde(default = "yes")]
    pub peer_uid_check: bool,
    /// `[model_request]`: `max_tokens` (the output token cap) and `extra_fields`.
    #[serde(default)]
    pub model_request: ModelRequestPolicy,
    /// See [`Config::runtime`].
    #[serde(default)]
    pub runtime: Option<String>,
    /// `[compaction]`: see [`CompactionFile`].
    #[serde(default)]
    pub compaction: Option<CompactionFile>,
    /// `[warm]`: prepared containers (`enabled`, `max`, `ttl_secs`).
    #[serde(default)]
    pub warm: super::WarmSettings,
    /// `[budgets]`: see [`BudgetSettings`](super::BudgetSettings).
    #[serde(default)]
    pub budgets: super::BudgetSettings,
    /// `[audit]`: see [`AuditSettings`](super::AuditSettings) (`path`, `include_text`).
    #[serde(default)]
    pub audit: super::AuditSettings,
    /// `[[egress]]`: see [`EgressRoute`](super::EgressRoute).
    #[serde(default)]
    pub egress: Vec<super::EgressRoute>,
    /// See [`Config::egress_nameserver`].
    #[serde(default)]
    pub egress_nameserver: Option<std::net::SocketAddr>,
}

/// The `[compaction]` section: a separate summarizer. Its key comes from the environment
/// variable or the file named here, never from the config file itself; one of the two
/// must be named, and it is read as the model's key is (an unset variable, a missing or
/// empty file: a startup error).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactionFile {
    /// OpenAI-compatible API base (`https://…/v1`).
    pub url: String,
    /// The summarizer's model name.
    pub model: String,
    /// Name of an environment variable holding the summarizer's key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Path of a file holding the summarizer's key.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Deadline of one summarizer call (default 60).
    #[serde(default)]
    pub timeout_secs: Option<f64>,
    /// Allow `http://` to loopback (a local summarizer).
    #[serde(default)]
    pub allow_http: bool,
}

fn yes() -> bool {
    true
}

/// A file's number of seconds as a duration (its range is checked with the other rules).
fn seconds(key: &'static str, value: f64) -> Result<Duration, ConfigError> {
    Duration::try_from_secs_f64(value).map_err(|_| ConfigError::Seconds { key, value })
}

impl TryFrom<CompactionFile> for CompactionModel {
    type Error = ConfigError;

    /// The summarizer, its key read from the named variable or file (one must be named;
    /// read and failing as the model's key: an unset variable or an empty file is an
    /// error at startup).
    fn try_from(file: CompactionFile) -> Result<Self, ConfigError> {
        let section = "compaction";
        let key = read_key(
            section,
            file.api_key_env.as_deref(),
            file.api_key_file.as_deref(),
        )?
        .ok_or_else(|| ConfigError::ApiKeyNoSource {
            section: section.to_owned(),
        })?;
        let key_source = match (&file.api_key_env, &file.api_key_file) {
            (Some(var), _) => format!("environment variable {var}"),
            (_, Some(path)) => format!("file {}", path.display()),
            (None, None) => unreachable!("read above"),
        };
        let timeout = match file.timeout_secs {
            None => CompactionModel::DEFAULT_TIMEOUT,
            Some(secs) => seconds("compaction.timeout_secs", secs)?,
        };
        Ok(CompactionModel {
            url: file.url,
            model: file.model,
            api_key: ApiKey::Static(std::sync::Arc::new(key)),
            key_source,
            timeout,
            allow_http: file.allow_http,
        })
    }
}

/// The key the file names: from its variable or its file (both set is an error; neither
/// is a keyless config). A variable is removed from the environment once read.
fn api_key(file: &ConfigFile) -> Result<ApiKey, ConfigError> {
    let key = read_key(
        "config file",
        file.api_key_env.as_deref(),
        file.api_key_file.as_deref(),
    )?;
    Ok(key.map_or(ApiKey::None, |k| ApiKey::Static(std::sync::Arc::new(k))))
}

impl TryFrom<ConfigFile> for Config {
    type Error = ConfigError;

    /// The [`Config`] the file describes, its key read from the named variable or file.
    /// Only what cannot be represented is refused here; the rules are checked by
    /// [`Config::resolve`].
    fn try_from(file: ConfigFile) -> Result<Self, ConfigError> {
        let api_key = api_key(&file)?;
        let mut mcp = file.mcp;
        for server in &mut mcp {
            server.read_secrets()?;
        }
        let mut builder = Config::builder(file.run_root, file.workspace_root)
            .image(file.image)
            .model(file.model_url, file.model)
            .api_key(api_key)
            .limits(file.limits)
            .allow_http(file.allow_http)
            .broker_limits(file.broker)
            .mcp(mcp)
            .peer_uid_check(file.peer_uid_check)
            .model_request(file.model_request);
        if let Some(prompt) = file.prompt {
            builder = builder.prompt(prompt);
        }
        if let Some(zone) = file.time_zone {
            builder = builder.time_zone(zone);
        }
        if let Some(secs) = file.turn_timeout_secs {
            builder = builder.turn_timeout(seconds("turn_timeout_secs", secs)?);
        }
        if let Some(instance) = file.instance {
            builder = builder.instance(instance);
        }
        if let Some(steps) = file.max_steps {
            builder = builder.max_steps(steps);
        }
        if let Some(budget) = file.session_budget {
            builder = builder.session_budget(budget);
        }
        if let Some(host) = file.docker_host {
            builder = builder.docker_host(host);
        }
        if let Some(runtime) = file.runtime {
            builder = builder.runtime(runtime);
        }
        if let Some(compaction) = file.compaction {
            builder = builder.compaction(compaction.try_into()?);
        }
        if let Some(ns) = file.egress_nameserver {
            builder = builder.egress_nameserver(ns);
        }
        let mut config = builder
            .warm(file.warm)
            .budgets(file.budgets)
            .audit(file.audit)
            .egress(file.egress)
            .build();
        // Either may be set alone (the rule refuses what is not the process's own).
        (config.uid, config.gid) = (file.uid, file.gid);
        Ok(config)
    }
}

impl Config {
    /// Loads a TOML file (see [`ConfigFile`]); unknown keys are refused. The key comes from
    /// the environment variable or file the config names, never from the config file itself.
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        parse(&text, path)?.try_into()
    }

    /// Parses TOML text (see [`ConfigFile`]); errors name the file `<string>`.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        parse(text, Path::new("<string>"))?.try_into()
    }
}

/// The file's text as a [`ConfigFile`]; an error names the key (`limits.memory_mb`) and,
/// where toml knows it, the line and column.
fn parse(text: &str, path: &Path) -> Result<ConfigFile, ConfigError> {
    let parse_error = |message: String| ConfigError::ParseFile {
        path: path.to_owned(),
        message,
    };
    let at = |span: Option<std::ops::Range<usize>>| {
        span.map(|s| format!(" (at {})", line_col(text, s.start)))
            .unwrap_or_default()
    };
    let deserializer = toml::Deserializer::parse(text)
        .map_err(|e| parse_error(e.message().to_owned() + &at(e.span())))?;
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let key = e.path().to_string();
        let inner = e.into_inner();
        let key = if key == "." {
            String::new()
        } else {
            format!("{key}: ")
        };
        parse_error(format!("{key}{}{}", inner.message(), at(inner.span())))
    })
}

fn line_col(text: &str, offset: usize) -> String {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, str::len) + 1;
    format!("line {line}, column {col}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_rejects_unknown_keys_with_position() {
        let text = "image = \"x\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\nmodel_url = \"https://a\"\n[limits]\nmemory = 5\n";
        let err = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(
            err.starts_with("config file <string>: limits.memory: unknown field `memory`"),
            "{err}"
        );
        assert!(err.ends_with("(at line 7, column 1)"), "{err}");
        let text = "image = \"x\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\nmodel_url = \"https://a\"\n[limits]\npids = \"many\"\n";
        let err = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "config file <string>: limits.pids: invalid type: string \"many\", expected i64"
            ),
            "{err}"
        );
    }

    #[test]
    fn toml_reads_key_from_env_never_from_file() {
        let text = "image = \"x\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\nmodel_url = \"https://a\"\napi_key = \"sk-123\"\n";
        let err = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(err.contains("unknown field `api_key`"), "{err}");
        let text = "image = \"x\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\nmodel_url = \"https://a\"\napi_key_env = \"RTS_TEST_SURELY_UNSET_VAR\"\n";
        assert_eq!(
            Config::from_toml_str(text).unwrap_err().to_string(),
            "read api key: environment variable RTS_TEST_SURELY_UNSET_VAR is not set"
        );
    }
}
