//! The model proxy: `POST /v1/chat/completions` to the configured upstream.
//!
//! - [`chat_url`]: the model URL check (scheme, no credentials, no query) and the join
//!   `{model_url}/chat/completions`;
//! - [`http_client`]: the upstream HTTP client (rustls with the webpki roots, HTTP/1.1,
//!   no redirects, no proxy), shared with the streamable-HTTP MCP transport;
//! - [`prepare`]: the guest's body read as a map of raw JSON values (nothing below the top
//!   level is built in memory), every field checked against the allow-list (`400` naming
//!   the first other one), `model` replaced, `stream` read, the token caps clamped, and a
//!   new body written from the allowed fields (a duplicate field is sent once);
//! - [`Upstream::chat`]: headers allow-listed, key injected once, whole answers capped,
//!   streamed answers relayed chunk by chunk through the redactor; no piece of a secret is
//!   sent on any path (the error snippet is redacted before it is cut).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::StatusCode;
use secrecy::ExposeSecret;
use tokio_util::sync::CancellationToken;

use serde::de::{DeserializeSeed, Error as _, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::http::{error_response, Response};
use super::redact::{Redactor, Secrets};
use super::{ApiKey, BrokerError, BrokerLimits, BrokerPolicy, ModelRequestPolicy};

/// How much of an upstream error body is shown to the guest (characters).
const ERROR_SNIPPET: usize = 1000;
/// How much of an upstream error body is read.
const ERROR_READ: usize = 4 * ERROR_SNIPPET;

/// A chat-completions body ready to forward.
pub(crate) struct Prepared {
    /// The body sent upstream: the configured model and the allowed fields.
    pub(crate) body: Vec<u8>,
    /// Whether the guest asked for a streamed answer.
    pub(crate) stream: bool,
}

/// The allowed fields of a body, each a raw value borrowed from the body (`model` skipped).
struct Fields<'p> {
    allowed: &'p [&'p str],
    /// The first field not allowed, when that is why the parse stopped.
    refused: &'p std::cell::RefCell<Option<String>>,
}

impl<'de, 'p> DeserializeSeed<'de> for Fields<'p> {
    type Value = Vec<(&'p str, &'de RawValue)>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, 'p> Visitor<'de> for Fields<'p> {
    type Value = Vec<(&'p str, &'de RawValue)>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out: Vec<(&'p str, &'de RawValue)> = Vec::with_capacity(self.allowed.len());
        while let Some(key) = map.next_key::<String>()? {
            if key == "model" {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            let Some(name) = self.allowed.iter().copied().find(|a| *a == key) else {
                // Refused before its value is read.
                *self.refused.borrow_mut() = Some(key);
                return Err(A::Error::custom("field not allowed"));
            };
            let value: &'de RawValue = map.next_value()?;
            // A repeated field is sent once, with its last value (what most parsers keep).
            match out.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = value,
                None => out.push((name, value)),
            }
        }
        Ok(out)
    }
}

/// Checks a guest's chat-completions body and writes the one to send; the error is the
/// `400` message.
pub(crate) fn prepare(
    raw: &[u8],
    model: &str,
    policy: &ModelRequestPolicy,
) -> Result<Prepared, String> {
    let allowed: Vec<&str> = policy.allowed_fields().collect();
    let refused = std::cell::RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(raw);
    let parsed = Fields {
        allowed: &allowed,
        refused: &refused,
    }
    .deserialize(&mut de)
    .and_then(|fields| de.end().map(|()| fields));
    let fields = match parsed {
        Ok(fields) => fields,
        Err(e) => {
            if let Some(field) = refused.into_inner() {
                let shown: String = field.chars().take(64).collect();
                return Err(format!("request field not allowed: {shown}"));
            }
            let first = raw.iter().find(|b| !b.is_ascii_whitespace());
            if first != Some(&b'{') && serde_json::from_slice::<serde::de::IgnoredAny>(raw).is_ok()
            {
                return Err("the request body must be a JSON object".into());
            }
            return Err(format!("malformed JSON: {e}"));
        }
    };
    let mut stream = false;
    let mut out = Vec::with_capacity(raw.len() + model.len() + 64);
    out.extend_from_slice(b"{\"model\":");
    serde_json::to_writer(&mut out, model).expect("a string serialises");
    let cap = u64::from(policy.max_tokens);
    let mut capped = false;
    for (name, value) in fields {
        match name {
            "stream" => {
                stream = serde_json::from_str::<Option<bool>>(value.get())
                    .map_err(|_| "stream must be true or false".to_owned())?
                    .unwrap_or(false);
            }
            "max_tokens" | "max_completion_tokens" => {
                let asked = serde_json::from_str::<Option<u64>>(value.get())
                    .map_err(|_| format!("{name} must be a non-negative integer"))?;
                if let Some(n) = asked {
                    capped = true;
                    out.extend_from_slice(format!(",\"{name}\":{}", n.min(cap)).as_bytes());
                }
                continue;
            }
            _ => {}
        }
        out.push(b',');
        serde_json::to_writer(&mut out, name).expect("a string serialises");
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    if !capped {
        // No cap asked for: the provider's default may be the model's maximum.
        out.extend_from_slice(format!(",\"max_tokens\":{cap}").as_bytes());
    }
    out.push(b'}');
    Ok(Prepared { body: out, stream })
}

/// Checks `model_url` and returns the chat-completions URL: the path of `model_url` (the
/// API base, e.g. `https://host/v1`) with `/chat/completions` appended.
pub(crate) fn chat_url(model_url: &str, allow_http: bool) -> Result<reqwest::Url, BrokerError> {
    let invalid = || BrokerError::InvalidModelUrl(model_url.to_owned());
    let mut url = reqwest::Url::parse(model_url.trim()).map_err(|_| invalid())?;
    match url.scheme() {
        "https" => {}
        "http" if allow_http && loopback(&url) => {}
        "http" if allow_http => return Err(BrokerError::HttpNotLoopback(model_url.to_owned())),
        "http" => return Err(BrokerError::InsecureModelUrl(model_url.to_owned())),
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

/// The HTTP client for upstream calls: HTTP/1.1 over rustls (ring, webpki roots), never
/// following a redirect and never using a proxy from the environment.
pub(crate) fn http_client(connect_timeout: Duration) -> Result<reqwest::Client, BrokerError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| BrokerError::HttpClient(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .connect_timeout(connect_timeout)
        .user_agent(concat!(
            "roundtable-sandbox-broker/",
            env!("CARGO_PKG_VERSION")
        ))
        .build()
        .map_err(|e| BrokerError::HttpClient(e.to_string()))
}

/// The configured model endpoint.
pub(crate) struct Upstream {
    pub(crate) client: reqwest::Client,
    url: reqwest::Url,
    key: ApiKey,
    limits: BrokerLimits,
}

impl Upstream {
    pub(crate) fn new(policy: &BrokerPolicy) -> Result<Self, BrokerError> {
        Ok(Self {
            client: http_client(policy.limits.call_timeout.min(Duration::from_secs(10)))?,
            url: chat_url(&policy.model_url, policy.allow_http)?,
            key: policy.api_key.clone(),
            limits: policy.limits,
        })
    }

    /// Forwards one chat completion ([`prepare`]d). Every secret of `policy` (the key just
    /// resolved among them) is redacted from the answer.
    pub(crate) async fn chat(
        &self,
        prepared: Prepared,
        accept: Option<HeaderValue>,
        cancel: CancellationToken,
        policy: &BrokerPolicy,
    ) -> Response {
        let Prepared { body, stream } = prepared;
        let key = match self.key.resolve().await {
            Ok(k) => k.filter(|k| !k.expose_secret().is_empty()),
            Err(e) => {
                tracing::warn!(error = %e, "model key unavailable");
                return error_response(StatusCode::BAD_GATEWAY, "model key unavailable");
            }
        };
        let key_str = key.as_ref().map(|k| k.expose_secret());
        let mut secrets = policy.secret_strings();
        secrets.extend(key_str.map(str::to_owned));
        let secrets = Secrets::new(secrets);
        let mut request = self
            .client
            .post(self.url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(
                ACCEPT,
                accept.unwrap_or_else(|| {
                    HeaderValue::from_static(if stream {
                        "text/event-stream"
                    } else {
                        "application/json"
                    })
                }),
            )
            // Moved into the request: dropped once it is sent.
            .body(body);
        if let Some(k) = key_str {
            let Ok(mut value) = HeaderValue::from_str(&format!("Bearer {k}")) else {
                tracing::warn!("model key is not a valid header value");
                return error_response(StatusCode::BAD_GATEWAY, "model key unavailable");
            };
            value.set_sensitive(true);
            request = request.header(AUTHORIZATION, value);
        }
        let timeout = self.limits.call_timeout;
        let send = async {
            let response = request.send().await?;
            if stream && response.status().is_success() {
                return Ok(Whole::Stream(response));
            }
            let status = response.status();
            let cap = if status.is_success() {
                self.limits.max_response_bytes
            } else {
                ERROR_READ
            };
            let (bytes, truncated) = read_capped(response, cap).await?;
            Ok(Whole::Body(status, bytes, truncated))
        };
        let outcome = tokio::select! {
            r = tokio::time::timeout(timeout, send) => r,
            _ = cancel.cancelled() => {
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "turn cancelled");
            }
        };
        let whole = match outcome {
            Err(_) => {
                tracing::info!(timeout = ?timeout, "model call timed out");
                return error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    &format!("model call timed out after {timeout:?}"),
                );
            }
            Ok(Err(e)) => {
                let e: reqwest::Error = e;
                tracing::warn!(error = %secrets.redact(&e.to_string()), "model call failed");
                let msg = if e.is_connect() {
                    "model upstream unreachable"
                } else if e.is_timeout() {
                    "model upstream timed out"
                } else {
                    "model upstream request failed"
                };
                return error_response(StatusCode::BAD_GATEWAY, msg);
            }
            Ok(Ok(w)) => w,
        };
        match whole {
            Whole::Body(status, bytes, truncated) if status.is_success() => {
                if truncated {
                    return error_response(
                        StatusCode::BAD_GATEWAY,
                        &format!(
                            "model response too large (limit {} bytes)",
                            self.limits.max_response_bytes
                        ),
                    );
                }
                let usage = upstream_usage(&bytes);
                let out = redact_whole(&secrets, bytes);
                let mut response = hyper::Response::builder()
                    .status(StatusCode::OK)
                    .header(CONTENT_TYPE, "application/json")
                    .body(super::http::full(out))
                    .expect("a valid response");
                if let Some(usage) = usage {
                    response.extensions_mut().insert(usage);
                }
                response
            }
            Whole::Body(status, bytes, truncated) => {
                // Redacted before it is cut: a secret straddling the read's end (its start
                // held back by the redactor) is dropped, never shown in part.
                let mut redactor = Redactor::new(secrets);
                let mut clean = redactor.push(&bytes);
                drop(bytes);
                if truncated {
                    redactor.abandon();
                } else {
                    clean.extend(redactor.finish());
                }
                let text = String::from_utf8_lossy(&clean);
                let snippet: String = text.trim().chars().take(ERROR_SNIPPET).collect();
                tracing::info!(status = status.as_u16(), "model upstream refused the call");
                let msg = if snippet.is_empty() {
                    format!("model upstream returned HTTP {}", status.as_u16())
                } else {
                    format!(
                        "model upstream returned HTTP {}: {snippet}",
                        status.as_u16()
                    )
                };
                error_response(StatusCode::BAD_GATEWAY, &msg)
            }
            Whole::Stream(response) => self.relay(response, secrets),
        }
    }

    /// Relays a streamed answer chunk by chunk: each upstream chunk is redacted and sent on
    /// at once. A gap longer than the call deadline, an upstream failure or a stream past
    /// `max_response_bytes` ends it with an SSE error event.
    fn relay(&self, response: reqwest::Response, secrets: Secrets) -> Response {
        struct State {
            response: reqwest::Response,
            redactor: Redactor,
            total: usize,
            done: bool,
            cap: usize,
            idle: Duration,
        }
        let state = State {
            response,
            redactor: Redactor::new(secrets),
            total: 0,
            done: false,
            cap: self.limits.max_response_bytes,
            idle: self.limits.call_timeout,
        };
        let body = futures_util::stream::unfold(state, |mut st| async move {
            loop {
                if st.done {
                    return None;
                }
                let (mut out, error) = match tokio::time::timeout(st.idle, st.response.chunk())
                    .await
                {
                    Ok(Ok(Some(chunk))) => {
                        st.total += chunk.len();
                        if st.total > st.cap {
                            st.redactor.abandon();
                            (
                                Vec::new(),
                                Some(format!("model response too large (limit {} bytes)", st.cap)),
                            )
                        } else {
                            (st.redactor.push(&chunk), None)
                        }
                    }
                    Ok(Ok(None)) => {
                        st.done = true;
                        (st.redactor.finish(), None)
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e.without_url(), "model stream failed");
                        st.redactor.abandon();
                        (Vec::new(), Some("model stream failed".to_owned()))
                    }
                    Err(_) => {
                        st.redactor.abandon();
                        (
                            Vec::new(),
                            Some(format!("model stream timed out after {:?}", st.idle)),
                        )
                    }
                };
                if let Some(error) = error {
                    st.done = true;
                    let event = serde_json::json!({"error": {"message": error}});
                    out.extend_from_slice(format!("\n\ndata: {event}\n\n").as_bytes());
                }
                if !out.is_empty() {
                    return Some((Ok::<_, std::io::Error>(Frame::data(Bytes::from(out))), st));
                }
            }
        });
        hyper::Response::builder()
            .status(StatusCode::OK)
            .header(CONTENT_TYPE, "text/event-stream")
            .header("cache-control", "no-cache")
            .body(http_body_util::StreamBody::new(body).boxed_unsync())
            .expect("a valid response")
    }
}

/// The token usage a whole chat completion reports (`usage.prompt_tokens`,
/// `usage.completion_tokens`), for the turn's events; `None` when it says nothing.
fn upstream_usage(body: &[u8]) -> Option<roundtable_sandbox_protocol::Usage> {
    #[derive(serde::Deserialize)]
    struct Answer {
        usage: Option<Counts>,
    }
    #[derive(serde::Deserialize)]
    struct Counts {
        prompt_tokens: Option<u64>,
        completion_tokens: Option<u64>,
    }
    let counts = serde_json::from_slice::<Answer>(body).ok()?.usage?;
    Some(roundtable_sandbox_protocol::Usage {
        model_calls: 1,
        prompt_tokens: counts.prompt_tokens,
        completion_tokens: counts.completion_tokens,
        ..Default::default()
    })
}

/// A whole answer with every secret replaced; an answer that ends with the start of a
/// secret ends with [`super::redact::REDACTED`] instead.
fn redact_whole(secrets: &Secrets, bytes: Vec<u8>) -> Vec<u8> {
    let mut redactor = Redactor::new(secrets.clone());
    if !secrets.could_occur(&bytes) {
        return bytes;
    }
    let mut out = redactor.push(&bytes);
    drop(bytes);
    out.extend(redactor.finish());
    out
}

enum Whole {
    Body(StatusCode, Vec<u8>, bool),
    Stream(reqwest::Response),
}

/// Reads at most `cap` bytes; the flag tells whether there was more.
pub(super) async fn read_capped(
    mut response: reqwest::Response,
    cap: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if out.len() + chunk.len() > cap {
            out.extend_from_slice(&chunk[..cap - out.len()]);
            return Ok((out, true));
        }
        out.extend_from_slice(&chunk);
    }
    Ok((out, false))
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
            Err(BrokerError::InsecureModelUrl(_))
        ));
    }
}
