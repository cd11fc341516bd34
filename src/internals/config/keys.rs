//! The model's key ([`ApiKey`]: a static secret, an async [`ApiKeyProvider`], or none) and
//! every secret a config file names: each read from an environment variable (removed once
//! read) or a file, never from the config file itself, and failing the same way wherever
//! it is named (the model's key, the summarizer's, an MCP server's `secret_env` and
//! `secret_headers`): both sources named, a variable unset, a file unreadable or empty.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use futures_util::future::BoxFuture;

use super::ConfigError;

/// A key provider failed to give the key (its own message).
#[derive(Debug, thiserror::Error)]
#[error("api key provider failed: {0}")]
pub struct KeyError(pub String);

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
    /// Keys handed out that had not been seen: the broker's redaction set is built again
    /// when it moves.
    new_keys: std::sync::atomic::AtomicU64,
}

impl ProvidedKey {
    async fn fetch(&self) -> Result<SecretString, KeyError> {
        let key = self.provider.key().await.map_err(KeyError)?;
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
                self.new_keys
                    .fetch_add(1, std::sync::atomic::Ordering::Release);
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
            new_keys: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// Resolves the key for one call.
    pub async fn resolve(&self) -> Result<Option<SecretString>, KeyError> {
        match self {
            ApiKey::Static(k) => Ok(Some(SecretString::from(k.expose_secret().to_owned()))),
            ApiKey::Provider(p) => p.fetch().await.map(Some),
            ApiKey::None => Ok(None),
        }
    }

    /// The keys known without an await (a static key, a provider's recent keys); each is
    /// redacted from what the guest is sent.
    pub(crate) fn known(&self) -> Vec<String> {
        match self {
            ApiKey::Static(k) if !k.expose_secret().is_empty() => {
                vec![k.expose_secret().to_owned()]
            }
            ApiKey::Provider(p) => p.seen(),
            _ => Vec::new(),
        }
    }

    /// How many new keys a provider has handed out (0 for a static key or none).
    pub(crate) fn generation(&self) -> u64 {
        match self {
            ApiKey::Provider(p) => p.new_keys.load(std::sync::atomic::Ordering::Acquire),
            _ => 0,
        }
    }

    /// Whether a provider has not handed out a key yet.
    pub(crate) fn unfetched(&self) -> bool {
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

/// Where a secret named in a config file comes from: an environment variable (removed from
/// the environment once read) or a file, exactly one. In TOML `{ env = "VAR" }` or
/// `{ file = "/run/secrets/x" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRef {
    /// The environment variable holding it.
    #[serde(default)]
    pub env: Option<String>,
    /// The file holding it (its whole content, blanks around it trimmed).
    #[serde(default)]
    pub file: Option<PathBuf>,
}

/// Reads the secret named by `env` or `file` for `section` (in errors): `Ok(None)` when
/// neither is named. Every secret of a config file is read here and fails the same way:
/// both named, a variable unset or empty, a file unreadable or empty. The process is made
/// private first (see [`crate::make_process_private`]); a variable is removed once read.
pub(crate) fn read_key(
    section: &str,
    env: Option<&str>,
    file: Option<&Path>,
) -> Result<Option<SecretString>, ConfigError> {
    private_before_secret();
    let value = match (env, file) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::ApiKeyBothSources {
                section: section.to_owned(),
            })
        }
        (None, None) => return Ok(None),
        (Some(var), None) => match read_env_secret(var) {
            Some(v) if !v.trim().is_empty() => v,
            _ => {
                return Err(ConfigError::ApiKeyEnvUnset {
                    var: var.to_owned(),
                })
            }
        },
        (None, Some(path)) => match std::fs::read_to_string(path) {
            Ok(v) if !v.trim().is_empty() => v,
            Ok(_) => {
                return Err(ConfigError::ApiKeyFileEmpty {
                    path: path.to_owned(),
                })
            }
            Err(source) => {
                return Err(ConfigError::ReadApiKeyFile {
                    path: path.to_owned(),
                    source,
                })
            }
        },
    };
    Ok(Some(SecretString::from(value.trim().to_owned())))
}

impl KeyRef {
    /// Its secret (`section` names it in errors); naming neither source is an error here.
    pub(crate) fn read(&self, section: &str) -> Result<SecretString, ConfigError> {
        if self.env.is_some() == self.file.is_some() {
            return Err(ConfigError::SecretSource {
                section: section.to_owned(),
            });
        }
        read_key(section, self.env.as_deref(), self.file.as_deref())
            .map(|key| key.expect("a source is named"))
    }
}

/// Makes the process private before a secret is read (see [`crate::make_process_private`]).
fn private_before_secret() {
    if let Err(e) = crate::make_process_private() {
        tracing::warn!(error = %e, "make the process private before reading a key");
    }
}

/// Reads a secret from the environment variable `var` and removes the variable (no child
/// inherits it); the process is made private first (see [`crate::make_process_private`];
/// a failure there is logged, and [`crate::Sandbox::new`] refuses to start on it).
pub(crate) fn read_env_secret(var: &str) -> Option<String> {
    private_before_secret();
    let value = std::env::var(var).ok();
    if value.is_some() {
        crate::forget_env_secret(var);
    }
    value
}
