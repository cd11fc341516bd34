//! The model proxy: `POST /v1/chat/completions` to the configured upstream.
//!
//! - [`chat_url`]: the model URL check (scheme, no credentials, no query) and the join
//!   `{model_url}/chat/completions`;
//! - [`http_client`]: the upstream HTTP client (rustls with the webpki roots, HTTP/1.1,
//!   no redirects, no proxy), shared with the streamable-HTTP MCP transport;
//! - [`Upstream::chat`]: model forced, headers allow-listed, key injected once, whole
//!   answers capped, streamed answers relayed chunk by chunk through the redactor.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::StatusCode;
use secrecy::ExposeSecret;
use tokio_util::sync::CancellationToken;

use super::redact::{redact, Redactor};
use super::server::{error_response, Response};
use super::{ApiKey, BrokerError, BrokerLimits, BrokerPolicy};

/// How much of an upstream error body is shown to the guest.
const ERROR_SNIPPET: usize = 1000;

/// Checks `model_url` and returns the chat-completions URL: the path of `model_url` (the
/// API base, e.g. `https://host/v1`) with `/chat/completions` appended.
pub(crate) fn chat_url(model_url: &str, allow_http: bool) -> Result<reqwest::Url, BrokerError> {
    let invalid = || BrokerError::InvalidModelUrl(model_url.to_owned());
    let mut url = reqwest::Url::parse(model_url.trim()).map_err(|_| invalid())?;
    match url.scheme() {
        "https" => {}
        "http" if allow_http => {}
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
    model: String,
    key: ApiKey,
    limits: BrokerLimits,
}

impl Upstream {
    pub(crate) fn new(policy: &BrokerPolicy) -> Result<Self, BrokerError> {
        Ok(Self {
            client: http_client(policy.limits.call_timeout.min(Duration::from_secs(10)))?,
            url: chat_url(&policy.model_url, policy.allow_http)?,
            model: policy.model.clone(),
            key: policy.api_key.clone(),
            limits: policy.limits,
        })
    }

    /// Forwards one chat completion. `body` is the guest's parsed JSON object.
    pub(crate) async fn chat(
        &self,
        mut body: serde_json::Map<String, serde_json::Value>,
        accept: Option<HeaderValue>,
        cancel: CancellationToken,
    ) -> Response {
        // The configured model, whatever the guest asked for.
        body.insert(
            "model".into(),
            serde_json::Value::String(self.model.clone()),
        );
        let stream = body.get("stream") == Some(&serde_json::Value::Bool(true));
        let key = match self.key.resolve().await {
            Ok(k) => k.filter(|k| !k.expose_secret().is_empty()),
            Err(e) => {
                tracing::warn!(error = %e, "model key unavailable");
                return error_response(StatusCode::BAD_GATEWAY, "model key unavailable");
            }
        };
        let key_str = key.as_ref().map(|k| k.expose_secret());
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
            .body(serde_json::to_vec(&body).expect("a JSON map serialises"));
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
                4 * ERROR_SNIPPET
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
                tracing::warn!(error = %redact(&e.to_string(), key_str), "model call failed");
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
                let mut redactor = Redactor::new(key_str);
                let mut out = redactor.push(&bytes);
                out.extend(redactor.finish());
                hyper::Response::builder()
                    .status(StatusCode::OK)
                    .header(CONTENT_TYPE, "application/json")
                    .body(super::server::full(out))
                    .expect("a valid response")
            }
            Whole::Body(status, bytes, _) => {
                let text = String::from_utf8_lossy(&bytes);
                let text = redact(text.trim(), key_str);
                let snippet: String = text.chars().take(ERROR_SNIPPET).collect();
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
            Whole::Stream(response) => self.relay(response, key_str.map(str::to_owned)),
        }
    }

    /// Relays a streamed answer chunk by chunk: each upstream chunk is redacted and sent on
    /// at once. A gap longer than the call deadline, an upstream failure or a stream past
    /// `max_response_bytes` ends it with an SSE error event.
    fn relay(&self, response: reqwest::Response, key: Option<String>) -> Response {
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
            redactor: Redactor::new(key.as_deref()),
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
                            (
                                st.redactor.finish(),
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
                        (st.redactor.finish(), Some("model stream failed".to_owned()))
                    }
                    Err(_) => (
                        st.redactor.finish(),
                        Some(format!("model stream timed out after {:?}", st.idle)),
                    ),
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

enum Whole {
    Body(StatusCode, Vec<u8>, bool),
    Stream(reqwest::Response),
}

/// Reads at most `cap` bytes; the flag tells whether there was more.
async fn read_capped(
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
