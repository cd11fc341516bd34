//! The `[compaction]` section: a separate summarizer ([`CompactionModel`]) and its rules.

use std::fmt;
use std::time::Duration;

use super::model::chat_url;
use super::{ApiKey, PolicyError};

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

/// Checks a `[compaction]` section: an https URL (http only with `allow_http`, and then only
/// to loopback: `127.0.0.0/8`, `::1`, `localhost`), a model, a deadline of 1 s to 600 s.
pub(crate) fn validate(s: &CompactionModel) -> Result<reqwest::Url, PolicyError> {
    // The model URL's rules (one definition, see `model::chat_url` and `model::loopback`),
    // reported as the compaction section's.
    let url = chat_url(&s.url, s.allow_http).map_err(|e| match e {
        PolicyError::InsecureModelUrl(_) | PolicyError::HttpNotLoopback(_) => {
            PolicyError::InsecureCompactionUrl(s.url.clone())
        }
        _ => PolicyError::InvalidCompactionUrl(s.url.clone()),
    })?;
    if s.model.trim().is_empty() {
        return Err(PolicyError::CompactionModelMissing);
    }
    if s.timeout < Duration::from_secs(1) || s.timeout > Duration::from_secs(600) {
        return Err(PolicyError::CompactionTimeout(s.timeout));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summarizer(url: &str, allow_http: bool) -> CompactionModel {
        CompactionModel {
            url: url.into(),
            model: "s".into(),
            api_key: ApiKey::None,
            key_source: "test".into(),
            timeout: CompactionModel::DEFAULT_TIMEOUT,
            allow_http,
        }
    }

    #[test]
    fn http_only_to_a_loopback_address_and_only_when_allowed() {
        let ok = |u: &str, allow: bool| validate(&summarizer(u, allow)).map(|u| u.to_string());
        assert_eq!(
            ok("https://sum.example.com/v1", false).unwrap(),
            "https://sum.example.com/v1/chat/completions"
        );
        assert!(ok("http://127.0.0.1:8080/v1", true).is_ok());
        assert!(ok("http://127.9.9.9/v1", true).is_ok());
        assert!(ok("http://[::1]:9/v1", true).is_ok());
        assert!(ok("http://localhost:9/v1", true).is_ok());
        for (u, allow) in [
            ("http://127.0.0.1:8080/v1", false),
            ("http://10.0.0.1/v1", true),
            ("http://localhost.evil.example/v1", true),
            ("http://sum.example.com/v1", true),
        ] {
            assert!(
                matches!(
                    validate(&summarizer(u, allow)),
                    Err(PolicyError::InsecureCompactionUrl(_))
                ),
                "{u}"
            );
        }
        assert!(matches!(
            validate(&summarizer("ftp://x/v1", true)),
            Err(PolicyError::InvalidCompactionUrl(_))
        ));
    }
}
