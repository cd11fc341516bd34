//! The host's compactor behind `POST /v1/compact` (the port of 0.7.16's
//! `jevCompactor({ logger })`).
//!
//! - [`validate`]: the `[compaction]` rules (URL, model, deadline), without side effects;
//! - [`Compactor::new`]: prepared once per runtime; a summarizer configured without a key is
//!   logged here, once, at warn;
//! - [`handle`]: one compaction request of a turn. The body is read capped
//!   (`min(max_request_bytes, MAX_REQUEST_BYTES)`) within the call deadline, parsed as a
//!   typed [`CompactRequest`] and checked; a refused request is logged at warn and answered
//!   with `4xx` (the guest then builds the plain summary itself).
//!
//! The chain, every step on the host: the configured summarizer (its own URL, model, key
//! and deadline) → the main model (as the guest's own compaction did before) → the plain
//! summary. Each step that fails — no key, the turn's model-call budget used up, the
//! endpoint unreachable, an HTTP error, a timeout, a malformed or empty answer — is logged
//! at warn with the channel's hash (the first 16 hex digits of its sha256, as the turn's
//! span shows it), the reason and `tokens_before`, and the next step runs. Reasons are
//! fixed texts: no upstream body and no guest text reaches the log. Each upstream call
//! takes one call from the turn's model-call budget and asks for at most the operator's
//! `max_tokens`. Whatever summary comes back has every declared secret (the summarizer's
//! key and the model key among them) redacted before it is returned.

use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode};
use roundtable_sandbox_protocol::chat::Message;
use roundtable_sandbox_protocol::compaction::{
    finish_summary, plain_summary, summary_messages, CompactReply, CompactRequest, CompactSource,
    MAX_REQUEST_BYTES,
};
use roundtable_sandbox_protocol::Usage;
use secrecy::{ExposeSecret, SecretString};

use super::http::{json_response, Response, Turn};
use super::model::{chat_url, read_capped};
use super::redact::Secrets;
use super::{ApiKey, BrokerError, BrokerPolicy, CompactionModel};
use crate::events::Refusal;

/// Checks a `[compaction]` section: an https URL (http only with `allow_http`, and then only
/// to loopback: `127.0.0.0/8`, `::1`, `localhost`), a model, a deadline of 1 s to 600 s.
pub(crate) fn validate(s: &CompactionModel) -> Result<reqwest::Url, BrokerError> {
    // The model URL's rules (one definition, see `model::chat_url` and `model::loopback`),
    // reported as the compaction section's.
    let url = chat_url(&s.url, s.allow_http).map_err(|e| match e {
        BrokerError::InsecureModelUrl(_) | BrokerError::HttpNotLoopback(_) => {
            BrokerError::InsecureCompactionUrl(s.url.clone())
        }
        _ => BrokerError::InvalidCompactionUrl(s.url.clone()),
    })?;
    if s.model.trim().is_empty() {
        return Err(BrokerError::CompactionModelMissing);
    }
    if s.timeout < Duration::from_secs(1) || s.timeout > Duration::from_secs(600) {
        return Err(BrokerError::CompactionTimeout(s.timeout));
    }
    Ok(url)
}

/// The configured summarizer, ready to call.
struct Summarizer {
    url: reqwest::Url,
    model: String,
    key: ApiKey,
    timeout: Duration,
}

/// The runtime-long compactor.
pub(crate) struct Compactor {
    summarizer: Option<Summarizer>,
    model_url: reqwest::Url,
}

impl Compactor {
    /// Prepares the chain; logs once, at warn, a summarizer configured without a key.
    pub(crate) fn new(policy: &BrokerPolicy) -> Result<Self, BrokerError> {
        let summarizer = match &policy.compaction {
            None => None,
            Some(s) => {
                let url = validate(s)?;
                if matches!(s.api_key, ApiKey::None) {
                    tracing::warn!(
                        key_source = %s.key_source,
                        "compaction summarizer configured without a key; compaction falls back to the main model"
                    );
                }
                Some(Summarizer {
                    url,
                    model: s.model.clone(),
                    key: s.api_key.clone(),
                    timeout: s.timeout,
                })
            }
        };
        Ok(Self {
            summarizer,
            model_url: chat_url(&policy.model_url, policy.allow_http)?,
        })
    }
}

/// Answers one compaction request.
pub(super) async fn handle(turn: &Turn, req: Request<Incoming>) -> Response {
    let channel = turn.ctx.channel.short();
    let refuse = |status: StatusCode, reason: &str| {
        tracing::warn!(
            channel = %channel,
            reason,
            "compaction request refused; the guest falls back to the plain summary"
        );
        super::http::refuse(status, Refusal::Compaction, reason)
    };
    if req.method() != Method::POST {
        return refuse(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: use POST",
        );
    }
    let limits = turn.broker.policy.limits;
    let cap = limits.max_request_bytes.min(MAX_REQUEST_BYTES);
    let too_large = format!("compaction request too large (limit {cap} bytes)");
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > cap as u64) {
        return refuse(StatusCode::PAYLOAD_TOO_LARGE, &too_large);
    }
    let body = Limited::new(req.into_body(), cap).collect();
    let body = match tokio::time::timeout(limits.call_timeout, body).await {
        Err(_) => {
            return refuse(
                StatusCode::REQUEST_TIMEOUT,
                "request body not received in time",
            )
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return refuse(StatusCode::PAYLOAD_TOO_LARGE, &too_large)
        }
        Ok(Err(_)) => return refuse(StatusCode::BAD_REQUEST, "request body unreadable"),
        Ok(Ok(b)) => b.to_bytes(),
    };
    // The serde message may quote guest text: it goes back to the guest, not to the log.
    let request: CompactRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(
                channel = %channel,
                reason = "malformed compaction request",
                "compaction request refused; the guest falls back to the plain summary"
            );
            return super::http::refuse(
                StatusCode::BAD_REQUEST,
                Refusal::Compaction,
                &format!("malformed compaction request: {e}"),
            );
        }
    };
    if let Err(e) = request.check() {
        return refuse(
            StatusCode::BAD_REQUEST,
            &format!("invalid compaction request: {e}"),
        );
    }
    let reply = compact(turn, &request, channel).await;
    json_response(StatusCode::OK, &reply)
}

/// Which upstream a step calls.
#[derive(Clone, Copy)]
enum Who {
    Summarizer,
    Model,
}

impl Who {
    fn name(self) -> &'static str {
        match self {
            Who::Summarizer => "summarizer",
            Who::Model => "model",
        }
    }
}

/// Runs the chain for one checked request.
async fn compact(turn: &Turn, request: &CompactRequest, channel: &str) -> CompactReply {
    let broker = &turn.broker;
    let compactor = &broker.compactor;
    let tokens_before = request.tokens_before;
    let mut usage = Usage::default();
    // Every key the answer could echo, redacted from whatever is returned.
    let mut keys: Vec<SecretString> = Vec::new();
    let mut outcome: Option<(String, CompactSource)> = None;

    if let Some(s) = &compactor.summarizer {
        let attempt = match s.key.resolve().await {
            Ok(Some(key)) if !key.expose_secret().is_empty() => {
                keys.push(key.clone());
                call(
                    turn,
                    request,
                    Who::Summarizer,
                    &s.url,
                    &s.model,
                    Some(&key),
                    s.timeout,
                    &mut usage,
                )
                .await
            }
            Ok(_) => Err("the summarizer has no key".to_owned()),
            Err(_) => Err("the summarizer's key is unavailable".to_owned()),
        };
        match attempt {
            Ok(summary) => outcome = Some((summary, CompactSource::Summarizer)),
            Err(reason) => tracing::warn!(
                channel = %channel,
                reason = %reason,
                tokens_before,
                fallback = "main model",
                "compaction fell back"
            ),
        }
    }

    if outcome.is_none() {
        let policy = &broker.policy;
        let attempt = match policy.api_key.resolve().await {
            Ok(key) => {
                let key = key.filter(|k| !k.expose_secret().is_empty());
                keys.extend(key.clone());
                call(
                    turn,
                    request,
                    Who::Model,
                    &compactor.model_url,
                    &policy.model,
                    key.as_ref(),
                    policy.limits.call_timeout,
                    &mut usage,
                )
                .await
            }
            Err(_) => Err("the model key is unavailable".to_owned()),
        };
        match attempt {
            Ok(summary) => outcome = Some((summary, CompactSource::Model)),
            Err(reason) => tracing::warn!(
                channel = %channel,
                reason = %reason,
                tokens_before,
                fallback = "plain summary",
                "compaction fell back"
            ),
        }
    }

    let (summary, source) =
        outcome.unwrap_or_else(|| (plain_summary(request), CompactSource::Plain));
    let mut secrets = broker.policy.secret_strings();
    secrets.extend(keys.iter().map(|k| k.expose_secret().to_owned()));
    let summary = Secrets::new(secrets).redact(&summary);
    tracing::info!(
        channel = %channel,
        source = ?source,
        tokens_before,
        model_calls = usage.model_calls,
        "session compacted"
    );
    CompactReply {
        summary,
        source,
        usage,
    }
}

/// One summary request to `url` with the shared rules; the finished summary, or why not.
#[allow(clippy::too_many_arguments)]
async fn call(
    turn: &Turn,
    request: &CompactRequest,
    who: Who,
    url: &reqwest::Url,
    model: &str,
    key: Option<&SecretString>,
    timeout: Duration,
    usage: &mut Usage,
) -> Result<String, String> {
    let name = who.name();
    let limits = turn.broker.policy.limits;
    if turn.model_calls.fetch_add(1, Ordering::SeqCst) >= limits.max_model_calls {
        return Err(format!(
            "the turn's model calls are used up (limit {})",
            limits.max_model_calls
        ));
    }
    usage.model_calls += 1;
    crate::events::emit(
        &turn.ctx.events,
        crate::events::EventKind::Phase(crate::TurnPhase::ModelCall),
    );
    let messages: Vec<Message> = summary_messages(request);
    let body = serde_json::json!({
        "model": model,
        "messages": messages,
        "stream": false,
        "max_tokens": turn.broker.policy.model_request.max_tokens,
    });
    let mut http = turn
        .broker
        .upstream
        .client
        .post(url.clone())
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, "application/json")
        .body(serde_json::to_vec(&body).expect("a JSON value serialises"));
    if let Some(key) = key {
        let Ok(mut value) = HeaderValue::from_str(&format!("Bearer {}", key.expose_secret()))
        else {
            return Err(format!("the {name} key is not a valid header value"));
        };
        value.set_sensitive(true);
        http = http.header(AUTHORIZATION, value);
    }
    let cap = limits.max_response_bytes;
    let exchange = async {
        let response = http.send().await?;
        let status = response.status();
        let (bytes, truncated) = read_capped(response, cap).await?;
        Ok::<_, reqwest::Error>((status, bytes, truncated))
    };
    let outcome = tokio::select! {
        r = tokio::time::timeout(timeout, exchange) => r,
        _ = turn.stop.cancelled() => return Err("the turn was stopped".to_owned()),
    };
    let (status, bytes, truncated) = match outcome {
        Err(_) => return Err(format!("the {name} timed out after {timeout:?}")),
        Ok(Err(e)) if e.is_connect() => return Err(format!("the {name} is unreachable")),
        Ok(Err(e)) if e.is_timeout() => return Err(format!("the {name} timed out")),
        Ok(Err(_)) => return Err(format!("the {name} request failed")),
        Ok(Ok(r)) => r,
    };
    if !status.is_success() {
        return Err(format!("the {name} returned HTTP {}", status.as_u16()));
    }
    if truncated {
        return Err(format!("the {name} answer is larger than {cap} bytes"));
    }
    let Some((content, prompt, completion)) = parse_answer(&bytes) else {
        return Err(format!("the {name} answer is not a chat completion"));
    };
    if let Some(n) = prompt {
        usage.prompt_tokens = Some(usage.prompt_tokens.unwrap_or(0).saturating_add(n));
    }
    if let Some(n) = completion {
        usage.completion_tokens = Some(usage.completion_tokens.unwrap_or(0).saturating_add(n));
    }
    finish_summary(request, &content).ok_or_else(|| format!("the {name} answer is empty"))
}

/// The text content and token counts of a non-streamed chat completion.
fn parse_answer(bytes: &[u8]) -> Option<(String, Option<u64>, Option<u64>)> {
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let message = value.pointer("/choices/0/message")?.as_object()?;
    let content = match message.get("content") {
        None | Some(serde_json::Value::Null) => String::new(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(serde_json::Value::as_str))
            .collect(),
        Some(_) => return None,
    };
    let usage = value.get("usage");
    let tokens = |key: &str| {
        usage
            .and_then(|u| u.get(key))
            .and_then(serde_json::Value::as_u64)
    };
    Some((
        content,
        tokens("prompt_tokens"),
        tokens("completion_tokens"),
    ))
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
                    Err(BrokerError::InsecureCompactionUrl(_))
                ),
                "{u}"
            );
        }
        assert!(matches!(
            validate(&summarizer("ftp://x/v1", true)),
            Err(BrokerError::InvalidCompactionUrl(_))
        ));
    }

    #[test]
    fn answers_parse_leniently_and_strictly_enough() {
        let (c, p, q) = parse_answer(
            br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
        )
        .unwrap();
        assert_eq!((c.as_str(), p, q), ("hi", Some(3), Some(1)));
        let (c, _, _) = parse_answer(
            br#"{"choices":[{"message":{"content":[{"type":"text","text":"a"},{"text":"b"}]}}]}"#,
        )
        .unwrap();
        assert_eq!(c, "ab");
        assert!(parse_answer(b"{}").is_none());
        assert!(parse_answer(b"nope").is_none());
        assert!(parse_answer(br#"{"choices":[{"message":{"content":5}}]}"#).is_none());
    }
}
