//! The model endpoint's rules (`model_url`: https, or http to loopback with `allow_http`;
//! no credentials, no query) and the `[model_request]` section ([`ModelRequestPolicy`]:
//! the chat-completions fields a guest may send and the output token cap).

use std::collections::BTreeSet;

use serde::Deserialize;

use super::PolicyError;

/// The chat-completions fields a guest may send, beyond which a call is refused (`400`
/// naming the field), and the cap on its output tokens.
///
/// Always allowed: [`ALLOWED_MODEL_FIELDS`] (`model` is accepted and replaced by the
/// configured model). `max_tokens` and `max_completion_tokens` are clamped to
/// `max_tokens`; when the guest sends neither, `max_tokens` is set to it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelRequestPolicy {
    /// The most output tokens a call may ask for.
    pub max_tokens: u32,
    /// Fields forwarded besides the built-in list (e.g. `reasoning_effort`), passed as sent.
    pub extra_fields: Vec<String>,
}

impl Default for ModelRequestPolicy {
    fn default() -> Self {
        Self {
            max_tokens: 16_384,
            extra_fields: Vec::new(),
        }
    }
}

/// The chat-completions fields forwarded to the model (besides `model`, which is replaced).
pub const ALLOWED_MODEL_FIELDS: &[&str] = &[
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "response_format",
    "max_tokens",
    "max_completion_tokens",
];

impl ModelRequestPolicy {
    /// Every forwarded field: the built-in list, then the operator's.
    pub fn allowed_fields(&self) -> impl Iterator<Item = &str> {
        ALLOWED_MODEL_FIELDS
            .iter()
            .copied()
            .chain(self.extra_fields.iter().map(String::as_str))
    }

    pub(crate) fn validate(&self) -> Result<(), PolicyError> {
        let err = |m: String| Err(PolicyError::InvalidModelRequest(m));
        if !(1..=10_000_000).contains(&self.max_tokens) {
            return err(format!(
                "max_tokens must be 1 to 10000000, got {}",
                self.max_tokens
            ));
        }
        let mut seen = BTreeSet::new();
        for field in &self.extra_fields {
            let valid = (1..=64).contains(&field.len())
                && field
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
            if !valid {
                return err(format!(
                    "invalid field name {field:?} in extra_fields: use 1 to 64 of A-Z, a-z, 0-9, _, - and ."
                ));
            }
            if field == "model" {
                return err(
                    "model cannot be an extra field: the configured model is always sent".into(),
                );
            }
            if ALLOWED_MODEL_FIELDS.contains(&field.as_str()) || !seen.insert(field) {
                return err(format!("field {field} is already allowed"));
            }
        }
        Ok(())
    }
}

/// Checks `model_url` and returns the chat-completions URL: the path of `model_url` (the
/// API base, e.g. `https://host/v1`) with `/chat/completions` appended.
pub(crate) fn chat_url(model_url: &str, allow_http: bool) -> Result<reqwest::Url, PolicyError> {
    let invalid = || PolicyError::InvalidModelUrl(model_url.to_owned());
    let mut url = reqwest::Url::parse(model_url.trim()).map_err(|_| invalid())?;
    match url.scheme() {
        "https" => {}
        "http" if allow_http && loopback(&url) => {}
        "http" if allow_http => return Err(PolicyError::HttpNotLoopback(model_url.to_owned())),
        "http" => return Err(PolicyError::InsecureModelUrl(model_url.to_owned())),
        _ => return Err(invalid()),
    }
    if url.host_str().is_none_or(str::is_empty)
        || !url.username().is_empty()
        || url.password().is_some()
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return Err(invalid());
    }
    let path = format!("{}/chat/completions", url.path().trim_end_matches('/'));
    url.set_path(&path);
    Ok(url)
}

/// Whether `url`'s host is loopback: `127.0.0.0/8`, `::1` or `localhost` (the only hosts
/// `allow_http` admits plain HTTP to).
pub(crate) fn loopback(url: &reqwest::Url) -> bool {
    // The URL parser has normalised the host (`127.1` is `127.0.0.1`, IPv6 in brackets).
    let Some(host) = url.host_str() else {
        return false;
    };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) => ip.is_loopback(),
        Ok(std::net::IpAddr::V6(ip)) => ip == std::net::Ipv6Addr::LOCALHOST,
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_url_joins_the_base() {
        let u = |s| chat_url(s, true).map(|u| u.to_string());
        assert_eq!(
            u("https://api.example.com/v1").unwrap(),
            "https://api.example.com/v1/chat/completions"
        );
        assert_eq!(
            u("https://api.example.com/v1/").unwrap(),
            "https://api.example.com/v1/chat/completions"
        );
        assert_eq!(
            u("http://127.0.0.1:8080").unwrap(),
            "http://127.0.0.1:8080/chat/completions"
        );
        assert!(u("https://user:pw@api.example.com/v1").is_err());
        assert!(u("https://api.example.com/v1?x=1").is_err());
        assert!(u("ftp://api.example.com/v1").is_err());
        assert!(u("api.example.com/v1").is_err());
        assert!(matches!(
            chat_url("http://api.example.com/v1", false),
            Err(PolicyError::InsecureModelUrl(_))
        ));
    }
}
