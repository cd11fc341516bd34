//! Settings for programs that embed the runtime (the CLI and the example bots): a TOML
//! config file and command-line flags, with the embedded offline model as the default
//! when no API key is configured.
//!
//! Precedence: flags over the config file over the environment over defaults. The key only
//! ever comes from the environment (`OPENAI_API_KEY` by default) or from the file named by
//! the config's `api_key_env` / `api_key_file`; never from a flag or the config file itself.

use std::path::PathBuf;

use crate::config::ApiKey;
use crate::config::{Config, ConfigError};
use crate::offline::{OfflineModel, OFFLINE_MODEL};

pub use crate::config::DEFAULT_IMAGE;
/// The default OpenAI-compatible endpoint when a key is given without a URL.
pub const DEFAULT_MODEL_URL: &str = "https://api.openai.com/v1";
/// The default model when a key is given without a model.
pub const DEFAULT_MODEL: &str = "gpt-4o-mini";

/// What the flags and the environment say. With the `cli` feature these are the
/// command-line flags of the CLI and the bots (`#[command(flatten)]`), global to every
/// subcommand; the field docs are their help.
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct Settings {
    /// TOML config file (unknown keys are refused)
    #[cfg_attr(
        feature = "cli",
        arg(long = "config", value_name = "FILE", global = true)
    )]
    pub config_file: Option<PathBuf>,
    /// Guest image [default: roundtable-sandbox-guest:latest]
    #[cfg_attr(feature = "cli", arg(long, value_name = "IMAGE", global = true))]
    pub image: Option<String>,
    /// Private dir for the per-turn broker sockets
    #[cfg_attr(feature = "cli", arg(long, value_name = "DIR", global = true))]
    pub run_root: Option<PathBuf>,
    /// Private dir of the channel workspaces
    #[cfg_attr(feature = "cli", arg(long, value_name = "DIR", global = true))]
    pub workspace_root: Option<PathBuf>,
    /// Model name (with a key: default gpt-4o-mini)
    #[cfg_attr(feature = "cli", arg(long, value_name = "NAME", global = true))]
    pub model: Option<String>,
    /// OpenAI-compatible API base (with a key: default https://api.openai.com/v1)
    #[cfg_attr(feature = "cli", arg(long, value_name = "URL", global = true))]
    pub model_url: Option<String>,
    /// Use the embedded offline model even if OPENAI_API_KEY is set
    #[cfg_attr(feature = "cli", arg(long, global = true))]
    pub offline: bool,
}

/// Errors of turning settings into a configuration.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The config file could not be read or breaks a rule.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The embedded offline model could not start (its loopback listener).
    #[error("start the offline model")]
    StartOfflineModel(#[source] std::io::Error),
}

/// What a usage text says about the settings beyond their flags.
pub const SETTINGS_NOTE: &str = "Without OPENAI_API_KEY (and without --config) the embedded \
offline model is used. The key only ever comes from the environment (or the file the config \
names), never from a flag. Roots default to $ROUNDTABLE_HOME or /tmp/roundtable-sandbox-<uid>.";

impl Settings {
    /// The default base of the two roots: `$ROUNDTABLE_HOME`, else `/tmp/roundtable-sandbox-<uid>`.
    pub fn default_base() -> PathBuf {
        std::env::var_os("ROUNDTABLE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(format!(
                    "/tmp/roundtable-sandbox-{}",
                    nix::unistd::getuid().as_raw()
                ))
            })
    }

    /// The configuration these settings describe (not yet validated), and the offline
    /// model when it is the one configured (keep it alive as long as the runtime).
    pub async fn build(&self) -> Result<(Config, Option<OfflineModel>), SettingsError> {
        let mut config = match &self.config_file {
            Some(path) => Config::from_toml_file(path)?,
            None => {
                let base = Self::default_base();
                // Read once, then gone from the environment (no child inherits it).
                let key = crate::config::read_env_secret("OPENAI_API_KEY")
                    .filter(|k| !k.trim().is_empty());
                let api_key = key.map_or(ApiKey::None, |k| ApiKey::from_static(k.trim()));
                Config::builder(base.join("run"), base.join("workspaces"))
                    .model(
                        std::env::var("OPENAI_BASE_URL")
                            .unwrap_or_else(|_| DEFAULT_MODEL_URL.into()),
                        std::env::var("OPENAI_MODEL").unwrap_or_else(|_| DEFAULT_MODEL.into()),
                    )
                    .api_key(api_key)
                    .build()
            }
        };
        if let Some(image) = &self.image {
            config.image = image.clone();
        }
        if let Some(root) = &self.run_root {
            config.run_root = root.clone();
        }
        if let Some(root) = &self.workspace_root {
            config.workspace_root = root.clone();
        }
        if let Some(model) = &self.model {
            config.model = model.clone();
        }
        if let Some(url) = &self.model_url {
            config.model_url = url.clone();
        }
        let no_key = matches!(config.api_key, ApiKey::None) && self.model_url.is_none();
        let offline = if self.offline || (no_key && self.config_file.is_none()) {
            let model = OfflineModel::start()
                .await
                .map_err(SettingsError::StartOfflineModel)?;
            config.model = OFFLINE_MODEL.into();
            config.model_url = model.url();
            config.api_key = ApiKey::None;
            config.allow_http = true;
            Some(model)
        } else {
            None
        };
        Ok((config, offline))
    }
}
