//! Settings for programs that embed the runtime (the CLI and the example bots): a TOML
//! config file and command-line flags, with the embedded offline model as the default
//! when no API key is configured.
//!
//! Precedence: flags over the config file over the environment over defaults. The key only
//! ever comes from the environment (`OPENAI_API_KEY` by default) or from the file named by
//! the config's `api_key_env` / `api_key_file`; never from a flag or the config file itself.

use std::path::PathBuf;

use crate::broker::ApiKey;
use crate::config::{Config, ConfigError};
use crate::offline::{OfflineModel, OFFLINE_MODEL};

/// The image the project's scripts build.
pub const DEFAULT_IMAGE: &str = "roundtable-sandbox-guest:latest";
/// The default OpenAI-compatible endpoint when a key is given without a URL.
pub const DEFAULT_MODEL_URL: &str = "https://api.openai.com/v1";
/// The default model when a key is given without a model.
pub const DEFAULT_MODEL: &str = "gpt-4o-mini";

/// What the flags and the environment say.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub config_file: Option<PathBuf>,
    pub image: Option<String>,
    pub run_root: Option<PathBuf>,
    pub workspace_root: Option<PathBuf>,
    pub model: Option<String>,
    pub model_url: Option<String>,
    /// Force the offline model even when a key is set.
    pub offline: bool,
}

/// The flags [`Settings::take_flag`] understands, for usage texts.
pub const FLAGS_HELP: &str = "  --config FILE          TOML config (unknown keys are refused)
  --image IMAGE          guest image (default roundtable-sandbox-guest:latest)
  --run-root DIR         private dir for per-turn broker sockets
  --workspace-root DIR   private dir of channel workspaces
  --model NAME           model name (with a key: default gpt-4o-mini)
  --model-url URL        OpenAI-compatible API base (with a key: default https://api.openai.com/v1)
  --offline              use the embedded offline model even if OPENAI_API_KEY is set
  Without OPENAI_API_KEY (and no config file) the embedded offline model is used.";

impl Settings {
    /// Takes `flag` (and its value from `rest`) if it is one of the settings' flags.
    /// Returns `Ok(false)` for a flag that is not one of them.
    pub fn take_flag(
        &mut self,
        flag: &str,
        rest: &mut impl Iterator<Item = String>,
    ) -> Result<bool, String> {
        let mut value = || rest.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag {
            "--config" => self.config_file = Some(value()?.into()),
            "--image" => self.image = Some(value()?),
            "--run-root" => self.run_root = Some(value()?.into()),
            "--workspace-root" => self.workspace_root = Some(value()?.into()),
            "--model" => self.model = Some(value()?),
            "--model-url" => self.model_url = Some(value()?),
            "--offline" => self.offline = true,
            _ => return Ok(false),
        }
        Ok(true)
    }

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
    pub async fn build(&self) -> Result<(Config, Option<OfflineModel>), ConfigError> {
        let mut config = match &self.config_file {
            Some(path) => Config::from_toml_file(path)?,
            None => {
                let base = Self::default_base();
                let key = std::env::var("OPENAI_API_KEY")
                    .ok()
                    .filter(|k| !k.trim().is_empty());
                let api_key = key.map_or(ApiKey::None, |k| ApiKey::from_static(k.trim()));
                Config::new(
                    DEFAULT_IMAGE,
                    base.join("run"),
                    base.join("workspaces"),
                    std::env::var("OPENAI_MODEL").unwrap_or_else(|_| DEFAULT_MODEL.into()),
                    std::env::var("OPENAI_BASE_URL").unwrap_or_else(|_| DEFAULT_MODEL_URL.into()),
                    api_key,
                )
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
                .map_err(|e| ConfigError::ApiKeySource(format!("start the offline model: {e}")))?;
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
