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

use super::bounded::{self, read_body, read_prefix, ReadError};
use super::http::{error_response, Response};
use super::redact::{Redactor, SecretSet, Secrets};
use super::usage::{answer_usage, UsageShape, UsageWire};
use super::{BrokerError, BrokerPolicy};
use crate::budgets::{estimate_tokens, CallCharge};
use crate::config::model::chat_url;
use crate::config::{ApiKey, BrokerLimits, ModelRequestPolicy};
use crate::events::{BrokerEvent, ModelOperation, TurnEvents};

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
    /// Whether the guest asked for the stream's usage chunk itself
    /// (`stream_options.include_usage`); when it did not, the broker asks the upstream for
    /// it and drops it from the guest's stream.
    pub(crate) usage_asked: bool,
    /// The most completion tokens the upstream may produce (the clamped cap sent).
    pub(crate) max_completion: u64,
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

/// Walks a JSON value without building it, for a member that names something to fetch
/// ([`names_a_fetch`]: `url`, `uri`, `image_url`, `fileUri`, `file_data`, …) whose value is
/// a string that is not a `data:` URL: a message part the model's provider would fetch (an
/// `image_url` part in its object or its string form, `video_url`, `audio_url`, a `file`,
/// a `source` of type `url`, a Gemini `file_uri`). The provider fetches it from its own
/// network, a loopback one's from the host's: a way out for a guest that has none, past
/// every egress rule. Such a part is refused; inline `data:` parts pass.
struct FetchScan {
    /// Inside a member that names a fetch: a string here must be a `data:` URL.
    fetch: bool,
}

impl<'de> DeserializeSeed<'de> for FetchScan {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FetchScan {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JSON")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            map.next_value_seed(FetchScan {
                fetch: names_a_fetch(&key),
            })?;
        }
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq
            .next_element_seed(FetchScan { fetch: self.fetch })?
            .is_some()
        {}
        Ok(())
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        let scheme = v.split_once(':').map(|(s, _)| s.trim());
        if self.fetch && !scheme.is_some_and(|s| s.eq_ignore_ascii_case("data")) {
            return Err(E::custom(FETCH_REFUSED));
        }
        Ok(())
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
}

/// Whether a member named `key` may hold something for the provider to fetch: `url` or
/// `uri`, or a name ending so (`image_url`, `fileUri`), or `file_data` (OpenRouter's, a
/// URL or a `data:` one), in any case.
fn names_a_fetch(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.ends_with("url") || key.ends_with("uri") || key == "file_data"
}

/// The refusal of a part the provider would fetch.
const FETCH_REFUSED: &str = "a message part names a URL for the model's provider to fetch; only inline data: URLs are sent (the sandbox has no network, and its model is no way out)";

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
    let mut stream_options: Option<&RawValue> = None;
    let mut out = Vec::with_capacity(raw.len() + model.len() + 64);
    out.extend_from_slice(b"{\"model\":");
    serde_json::to_writer(&mut out, model).expect("a string serialises");
    let cap = u64::from(policy.max_tokens);
    let mut capped = false;
    let mut max_completion = 0u64;
    for (name, value) in fields {
        match name {
            "stream" => {
                stream = serde_json::from_str::<Option<bool>>(value.get())
                    .map_err(|_| "stream must be true or false".to_owned())?
                    .unwrap_or(false);
            }
            "stream_options" => {
                // Written after the loop, once `stream` is known.
                stream_options = Some(value);
                continue;
            }
            "messages" => {
                let mut de = serde_json::Deserializer::from_str(value.get());
                if let Err(e) = (FetchScan { fetch: false }).deserialize(&mut de) {
                    let e = e.to_string();
                    return Err(if e.starts_with(FETCH_REFUSED) {
                        FETCH_REFUSED.to_owned()
                    } else {
                        format!("malformed messages: {e}")
                    });
                }
            }
            "max_tokens" | "max_completion_tokens" => {
                let asked = serde_json::from_str::<Option<u64>>(value.get())
                    .map_err(|_| format!("{name} must be a non-negative integer"))?;
                if let Some(n) = asked {
                    capped = true;
                    max_completion = max_completion.max(n.min(cap));
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
        max_completion = cap;
    }
    let usage_asked = write_stream_options(&mut out, stream, stream_options)?;
    out.push(b'}');
    Ok(Prepared {
        body: out,
        stream,
        usage_asked,
        max_completion,
    })
}

/// Writes `stream_options`: as sent when the answer is not streamed; for a stream, with
/// `include_usage: true` (the host counts every stream's tokens), its other members as
/// sent. Returns whether the guest asked for the usage chunk itself.
fn write_stream_options(
    out: &mut Vec<u8>,
    stream: bool,
    sent: Option<&RawValue>,
) -> Result<bool, String> {
    if !stream {
        if let Some(v) = sent {
            out.extend_from_slice(b",\"stream_options\":");
            out.extend_from_slice(v.get().as_bytes());
        }
        return Ok(false);
    }
    let sent = sent.filter(|v| v.get().trim() != "null");
    // Its members as raw values (nothing below them is built in memory).
    let members: Vec<(String, &RawValue)> = match sent {
        None => Vec::new(),
        Some(v) => {
            let map: std::collections::BTreeMap<String, &RawValue> = serde_json::from_str(v.get())
                .map_err(|_| "stream_options must be an object".to_owned())?;
            map.into_iter().collect()
        }
    };
    let mut asked = false;
    out.extend_from_slice(b",\"stream_options\":{\"include_usage\":true");
    for (name, value) in members {
        if name == "include_usage" {
            asked = serde_json::from_str::<Option<bool>>(value.get())
                .map_err(|_| "stream_options.include_usage must be true or false".to_owned())?
                .unwrap_or(false);
            continue;
        }
        out.push(b',');
        serde_json::to_writer(&mut *out, &name).expect("a string serialises");
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.push(b'}');
    Ok(asked)
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
        // No transparent decompression, whatever features another crate of the bot enables
        // on reqwest (matrix-sdk turns on `gzip`): the broker reads and caps the bytes the
        // upstream sent, and asks for none encoded.
        .no_gzip()
        .no_brotli()
        .no_zstd()
        .no_deflate()
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
    /// The broker's secrets, built once (see [`SecretSet`]).
    secrets: SecretSet,
}

impl Upstream {
    /// The upstream of `policy`; `extra` are secrets the policy does not hold itself (the
    /// egress routes' credentials, read when the broker starts).
    pub(crate) fn new(policy: &BrokerPolicy, extra: Vec<String>) -> Result<Self, BrokerError> {
        Ok(Self {
            client: http_client(policy.limits.call_timeout.min(Duration::from_secs(10)))?,
            url: chat_url(&policy.model_url, policy.allow_http)?,
            key: policy.api_key.clone(),
            limits: policy.limits,
            secrets: SecretSet::new(policy, extra),
        })
    }

    /// Every declared secret of `policy` now (see [`SecretSet`]).
    pub(crate) fn secrets(&self, policy: &BrokerPolicy) -> Secrets {
        self.secrets.get(policy)
    }

    /// Forwards one chat completion ([`prepare`]d). Every secret of `policy` (the key just
    /// resolved among them) is redacted from the answer.
    ///
    /// The steps: the request built with the key, sent and its answer read within the
    /// call's deadline ([`Upstream::exchange`]), then the answer mapped for the guest (a
    /// whole answer, the upstream's refusal or a stream), its charge settled.
    pub(crate) async fn chat(
        &self,
        prepared: Prepared,
        accept: Option<HeaderValue>,
        cancel: CancellationToken,
        policy: &BrokerPolicy,
        charge: Option<CallCharge>,
        events: Option<&TurnEvents>,
    ) -> Answer {
        let started = std::time::Instant::now();
        let Prepared {
            body,
            stream,
            usage_asked,
            max_completion: _,
        } = prepared;
        let sent_bytes = body.len();
        let (request, secrets) = match self.request(body, stream, accept, policy).await {
            Ok(built) => built,
            Err(answer) => {
                settle_unsent(charge);
                return answer;
            }
        };
        let whole = match self.exchange(request, stream, cancel, &secrets).await {
            Ok(whole) => whole,
            Err(Unanswered::Stopped(answer)) => {
                // It may have reached the upstream (a deadline, the turn's stop, a
                // connection lost after the request went): counted as a call, and charged
                // its worst case as its charge is dropped.
                if let Some(c) = &charge {
                    c.count_sent();
                }
                return answer;
            }
            Err(Unanswered::Failed(answer)) => {
                settle_unsent(charge);
                return answer;
            }
        };
        // Counted as sent: it reached the upstream (its answer may still be refused).
        if let Some(c) = &charge {
            c.count_sent();
        }
        let call = Reached {
            charge,
            secrets,
            sent_bytes,
        };
        match whole {
            Whole::Body(status, bytes, truncated) if status.is_success() => {
                if truncated {
                    return Answer::plain(error_response(
                        StatusCode::BAD_GATEWAY,
                        &format!(
                            "model response too large (limit {} bytes)",
                            self.limits.max_response_bytes
                        ),
                    ));
                }
                call.whole(bytes, events.is_some()).await
            }
            Whole::Body(status, bytes, truncated) => call.refused(status, bytes, truncated),
            Whole::Stream(response) => {
                // The stream's event is sent when it ends (with its usage chunk's counts),
                // its latency the head's.
                let report = events.map(|e| (e.clone(), started.elapsed()));
                let Reached {
                    charge,
                    secrets,
                    sent_bytes,
                } = call;
                let tap = (charge.is_some() || report.is_some()).then(|| UsageTap {
                    charge,
                    report,
                    sent_bytes,
                    streamed: 0,
                    usage: None,
                    usage_final: false,
                    ended: false,
                });
                Answer {
                    response: self.relay(response, secrets, SseFilter::new(!usage_asked), tap),
                    usage: None,
                    streamed: true,
                }
            }
        }
    }

    /// The request to send: the body, its headers and the key (resolved now), with the
    /// broker's secrets taken after the key (a provider's new key is in the set). A key
    /// that cannot be had or sent is the guest's `502`.
    async fn request(
        &self,
        body: Vec<u8>,
        stream: bool,
        accept: Option<HeaderValue>,
        policy: &BrokerPolicy,
    ) -> Result<(reqwest::RequestBuilder, Secrets), Answer> {
        let unavailable = || {
            Answer::plain(error_response(
                StatusCode::BAD_GATEWAY,
                "model key unavailable",
            ))
        };
        let key = match self.key.resolve().await {
            Ok(k) => k.filter(|k| !k.expose_secret().is_empty()),
            Err(e) => {
                tracing::warn!(error = %e, "model key unavailable");
                return Err(unavailable());
            }
        };
        let key_str = key.as_ref().map(|k| k.expose_secret());
        // Taken after the key: a provider's new key is in the set.
        let secrets = self.secrets(policy);
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
                return Err(unavailable());
            };
            value.set_sensitive(true);
            request = request.header(AUTHORIZATION, value);
        }
        Ok((request, secrets))
    }

    /// Sends the request and reads its answer within the call's deadline, unless the turn
    /// is cancelled first. The charge stays held at its worst case until the answer
    /// settles it: a call dropped by the guest, ended with its turn or past its deadline
    /// keeps the worst case.
    async fn exchange(
        &self,
        request: reqwest::RequestBuilder,
        stream: bool,
        cancel: CancellationToken,
        secrets: &Secrets,
    ) -> Result<Whole, Unanswered> {
        let timeout = self.limits.call_timeout;
        let outcome = tokio::select! {
            r = tokio::time::timeout(timeout, self.send(request, stream)) => r,
            _ = cancel.cancelled() => {
                return Err(Unanswered::Stopped(Answer::plain(error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "turn cancelled",
                ))));
            }
        };
        match outcome {
            Err(_) => {
                tracing::info!(timeout = ?timeout, "model call timed out");
                Err(Unanswered::Stopped(Answer::plain(error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    &format!("model call timed out after {timeout:?}"),
                ))))
            }
            Ok(Err(e)) => {
                let unsent = matches!(&e, Failure::Send(e) if e.is_connect());
                let answer =
                    Answer::plain(error_response(StatusCode::BAD_GATEWAY, e.message(secrets)));
                Err(if unsent {
                    // What did not reach the upstream is not charged.
                    Unanswered::Failed(answer)
                } else {
                    Unanswered::Stopped(answer)
                })
            }
            Ok(Ok(w)) => Ok(w),
        }
    }

    /// Sends the request and reads its answer through the one bounded reader: a whole
    /// answer past the cap is refused (its length header, or the chunk that passes it); an
    /// error's body is read cut; a successful stream is returned unread.
    async fn send(&self, request: reqwest::RequestBuilder, stream: bool) -> Result<Whole, Failure> {
        let mut response = request.send().await.map_err(Upstream::failed)?;
        if stream && response.status().is_success() {
            return Ok(Whole::Stream(response));
        }
        let status = response.status();
        if status.is_success() {
            let read = read_body(&mut response, self.limits.max_response_bytes).await;
            match read {
                Ok(bytes) => Ok(Whole::Body(status, bytes, false)),
                Err(ReadError::TooLarge { .. }) => Ok(Whole::Body(status, Vec::new(), true)),
                Err(e) => Err(Failure::Read(e)),
            }
        } else {
            let (bytes, cut) = read_prefix(&mut response, ERROR_READ)
                .await
                .map_err(Failure::Read)?;
            Ok(Whole::Body(status, bytes, cut))
        }
    }

    /// Relays a streamed answer chunk by chunk: each upstream chunk is redacted and sent on
    /// at once. A gap longer than the call deadline, an upstream failure or a stream past
    /// `max_response_bytes` ends it with an SSE error event.
    fn relay(
        &self,
        response: reqwest::Response,
        secrets: Secrets,
        filter: SseFilter,
        tap: Option<UsageTap>,
    ) -> Response {
        struct State {
            response: reqwest::Response,
            filter: SseFilter,
            tap: Option<UsageTap>,
            redactor: Redactor,
            total: usize,
            done: bool,
            cap: usize,
            idle: Duration,
        }
        let state = State {
            response,
            filter,
            tap,
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
                            // Cut by the broker at its cap: the upstream made what was read.
                            if let Some(t) = &mut st.tap {
                                t.ended = true;
                            }
                            let held = st.filter.take_held();
                            let clean = st.redactor.push(&held);
                            st.redactor.abandon();
                            (
                                clean,
                                Some(format!("model response too large (limit {} bytes)", st.cap)),
                            )
                        } else {
                            let passed = st.filter.push(&chunk, &mut st.tap);
                            (st.redactor.push(&passed), None)
                        }
                    }
                    Ok(Ok(None)) => {
                        st.done = true;
                        if let Some(t) = &mut st.tap {
                            t.ended = true;
                        }
                        let mut passed = st.filter.finish(&mut st.tap);
                        let mut out = st.redactor.push(&passed);
                        passed.clear();
                        out.extend(st.redactor.finish());
                        (out, None)
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e.without_url(), "model stream failed");
                        let held = st.filter.take_held();
                        let clean = st.redactor.push(&held);
                        st.redactor.abandon();
                        (clean, Some("model stream failed".to_owned()))
                    }
                    Err(_) => {
                        let held = st.filter.take_held();
                        let clean = st.redactor.push(&held);
                        st.redactor.abandon();
                        (
                            clean,
                            Some(format!("model stream timed out after {:?}", st.idle)),
                        )
                    }
                };
                if let Some(error) = error {
                    // (An upstream that failed or went quiet past the call's deadline may
                    // have worked on: charged at the worst case held, as a whole answer
                    // past its deadline is.)
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

/// Settles a call's charge: its `usage`, or the estimate of what was sent and read.
fn settle_whole(
    charge: CallCharge,
    sent_bytes: usize,
    answer_bytes: usize,
    usage: Option<UsageWire>,
) {
    match usage {
        Some(UsageWire {
            prompt_tokens: Some(p),
            completion_tokens: Some(c),
        }) => charge.settle(p, c, false),
        // (A count without its completion's: the answer's estimate, not nothing.)
        Some(UsageWire {
            prompt_tokens: Some(p),
            completion_tokens: None,
        }) => charge.settle(p, estimate_tokens(answer_bytes), true),
        _ => charge.settle(
            estimate_tokens(sent_bytes),
            estimate_tokens(answer_bytes),
            true,
        ),
    }
}

/// A model call's answer: the response for the guest, the usage of a whole answer (for
/// the call's event; `None` when neither budgets nor events read it), and whether it is a
/// stream, whose [`BrokerEvent::ModelCall`] its [`UsageTap`] sends when the stream ends (not
/// the server). Returned beside the response, not in its extensions (no allocation per
/// call).
pub(super) struct Answer {
    pub(super) response: Response,
    pub(super) usage: Option<roundtable_sandbox_protocol::Usage>,
    pub(super) streamed: bool,
}

impl Answer {
    /// An answer that is not the upstream's (a refusal, an error) or carries no usage.
    fn plain(response: Response) -> Self {
        Self {
            response,
            usage: None,
            streamed: false,
        }
    }
}

/// What a stream used, charged (and its model call's event sent, with the usage chunk's
/// counts) when the stream ends however it ends (its last `usage`, or the estimate).
struct UsageTap {
    charge: Option<CallCharge>,
    /// The turn's events and the latency of the stream's head.
    report: Option<(TurnEvents, Duration)>,
    sent_bytes: usize,
    streamed: usize,
    usage: Option<UsageWire>,
    /// `usage` came in the usage-only chunk (no choices) that ends a stream: its final
    /// count, not a running one (`continuous_usage_stats` puts one in every chunk).
    usage_final: bool,
    /// The stream came to its end: the upstream's, or the broker's cut at its cap.
    ended: bool,
}

impl Drop for UsageTap {
    fn drop(&mut self) {
        if let Some(charge) = self.charge.take() {
            if self.ended || self.usage_final {
                settle_whole(charge, self.sent_bytes, self.streamed, self.usage);
            } else {
                // Dropped by the guest before its end, its usage unread: charged at the
                // worst case it held (settled at what was read, the tokens the upstream
                // had made and the guest had not read were never charged).
                drop(charge);
            }
        }
        if let Some((events, latency)) = self.report.take() {
            events.broker(BrokerEvent::ModelCall {
                operation: ModelOperation::Chat,
                status: StatusCode::OK.as_u16(),
                latency,
                usage: self.usage.map(|u| roundtable_sandbox_protocol::Usage {
                    model_calls: 1,
                    prompt_tokens: u.prompt_tokens,
                    completion_tokens: u.completion_tokens,
                    ..Default::default()
                }),
            });
        }
    }
}

/// The largest SSE event held back to be read for its `usage`: the usage chunk is a few
/// hundred bytes; a longer event is passed on as it comes, unread.
const MAX_HELD_EVENT: usize = 64 * 1024;

/// Splits a stream into SSE events (each ends with a blank line), reads each event's
/// `usage`, and drops the usage-only chunk (`choices` empty) the broker asked for on the
/// guest's behalf. Every other byte passes unchanged, in order.
struct SseFilter {
    /// Drop the usage-only chunk (the guest did not ask for it).
    drop_usage_chunk: bool,
    /// The current event's bytes, not yet passed on.
    held: Vec<u8>,
    /// The current event is too long to be read: passed on as it comes.
    passing: bool,
    /// Where the search for the held event's end goes on: before it, `held` has no end
    /// (each byte is looked at once, however the stream is cut).
    scanned: usize,
    /// Bytes the end search looked at (a test's measure of its work).
    #[cfg(test)]
    looked: usize,
}

/// One `data:` event's shape, only what is read of it.
struct ChunkShape {
    choices: Option<Vec<serde::de::IgnoredAny>>,
    usage: Option<UsageWire>,
}

impl SseFilter {
    fn new(drop_usage_chunk: bool) -> Self {
        Self {
            drop_usage_chunk,
            held: Vec::new(),
            passing: false,
            scanned: 0,
            #[cfg(test)]
            looked: 0,
        }
    }

    /// The end of the first event in `held[from..]`: after its first `\n\n` or
    /// `\r\n\r\n`. Searched from `scanned` on, each `\n` looked at once: a search from
    /// the start at every event was quadratic in a chunk of many small events.
    fn event_end(&mut self, from: usize) -> Option<usize> {
        let held = &self.held;
        let mut at = self.scanned.max(from);
        while let Some(i) = memchr::memchr(b'\n', &held[at..]).map(|i| at + i) {
            #[cfg(test)]
            {
                self.looked += i + 1 - at;
            }
            // Undecided until the two bytes after it are here.
            if i + 1 >= held.len() || (held[i + 1] == b'\r' && i + 2 >= held.len()) {
                self.scanned = i;
                return None;
            }
            if held[i + 1] == b'\n' {
                self.scanned = i + 2;
                return Some(i + 2);
            }
            if i > from && held[i - 1] == b'\r' && held[i + 1] == b'\r' && held[i + 2] == b'\n' {
                self.scanned = i + 3;
                return Some(i + 3);
            }
            at = i + 1;
        }
        #[cfg(test)]
        {
            self.looked += held.len() - at;
        }
        self.scanned = held.len();
        None
    }

    /// The bytes to pass on after `chunk`.
    fn push(&mut self, chunk: &[u8], tap: &mut Option<UsageTap>) -> Vec<u8> {
        if let Some(t) = tap {
            t.streamed += chunk.len();
        }
        // Held only when an event may have to be dropped; otherwise passed on at once and
        // only read.
        let hold = self.drop_usage_chunk;
        let mut out = Vec::new();
        if !hold {
            out.extend_from_slice(chunk);
        }
        self.held.extend_from_slice(chunk);
        // The events ended in `held`, read in place and drained once.
        let mut start = 0;
        while let Some(end) = self.event_end(start) {
            // The end of a long event is passed on unread; any other event is read.
            let passing = std::mem::take(&mut self.passing);
            let event = &self.held[start..end];
            let keep = passing || self.keep(event, tap);
            if hold && keep {
                out.extend_from_slice(event);
            }
            start = end;
        }
        self.held.drain(..start);
        self.scanned -= start;
        if (self.passing || self.held.len() > MAX_HELD_EVENT) && self.held.len() > 3 {
            // Too long to be the usage chunk: passed on unread, but the last 3 bytes are
            // kept, as they may begin the event's end.
            self.passing = true;
            let keep = self.held.len() - 3;
            let passed = self.held.drain(..keep);
            if hold {
                out.extend(passed);
            }
            self.scanned = 0;
        }
        out
    }

    /// What is held when the stream ends on an error (an event cut off): passed on
    /// through the redactor like the rest, before its error event.
    fn take_held(&mut self) -> Vec<u8> {
        let held = std::mem::take(&mut self.held);
        self.scanned = 0;
        if self.drop_usage_chunk {
            held
        } else {
            Vec::new()
        }
    }

    /// Reads the event's `usage`; false for the usage-only chunk the guest did not ask for.
    fn keep(&self, event: &[u8], tap: &mut Option<UsageTap>) -> bool {
        let Some(shape) = data_chunk(event) else {
            return true;
        };
        let usage_only = shape.choices.as_ref().is_some_and(Vec::is_empty);
        if let (Some(t), Some(u)) = (tap.as_mut(), shape.usage) {
            if u.prompt_tokens.is_some() {
                t.usage = Some(u);
                t.usage_final = usage_only;
            }
        }
        !(self.drop_usage_chunk && shape.usage.is_some() && usage_only)
    }

    /// What is left at the stream's end (an event without its blank line is passed on).
    fn finish(&mut self, tap: &mut Option<UsageTap>) -> Vec<u8> {
        let rest = std::mem::take(&mut self.held);
        self.scanned = 0;
        if !self.passing {
            if let (Some(t), Some(shape)) = (tap.as_mut(), data_chunk(&rest)) {
                if let Some(u) = shape.usage.filter(|u| u.prompt_tokens.is_some()) {
                    t.usage = Some(u);
                }
            }
        }
        if self.drop_usage_chunk {
            rest
        } else {
            Vec::new()
        }
    }
}

/// The JSON of a one-line `data:` event, read for `choices` and `usage` only.
fn data_chunk(event: &[u8]) -> Option<ChunkShape> {
    let text = std::str::from_utf8(event).ok()?.trim();
    let json = text.strip_prefix("data:")?.trim_start();
    if json.contains('\n') {
        return None;
    }
    let shape = serde_json::from_str::<UsageShape<'_>>(json).ok()?;
    Some(ChunkShape {
        usage: shape.usage(),
        choices: shape.choices,
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

/// Why a model call's exchange failed.
enum Failure {
    /// The request was not sent or not answered.
    Send(reqwest::Error),
    /// The answer could not be read.
    Read(ReadError),
}

impl Upstream {
    fn failed(e: reqwest::Error) -> Failure {
        Failure::Send(e)
    }
}

impl Failure {
    /// Logs the failure (redacted) and gives the guest's message for it.
    fn message(&self, secrets: &Secrets) -> &'static str {
        match self {
            Failure::Send(e) => {
                tracing::warn!(error = %secrets.redact(&e.to_string()), "model call failed");
                if e.is_connect() {
                    "model upstream unreachable"
                } else if e.is_timeout() {
                    "model upstream timed out"
                } else {
                    "model upstream request failed"
                }
            }
            Failure::Read(e) => {
                tracing::warn!(error = %secrets.redact(&e.to_string()), "model answer not read");
                "model upstream request failed"
            }
        }
    }
}

/// A model call that brought no answer to map: the guest's error response, and whether
/// the call's charge stays held at its worst case (`Stopped`: cancelled, past its deadline
/// or failed after it may have reached the upstream) or is settled at nothing (`Failed`:
/// the upstream could not be reached).
enum Unanswered {
    Stopped(Answer),
    Failed(Answer),
}

/// Settles the charge of a call that did not reach the upstream: it is not charged.
fn settle_unsent(charge: Option<CallCharge>) {
    if let Some(c) = charge {
        c.settle(0, 0, false);
    }
}

/// A model call whose request reached the upstream: what its answer settles and is
/// redacted with.
struct Reached {
    charge: Option<CallCharge>,
    secrets: Secrets,
    sent_bytes: usize,
}

impl Reached {
    /// A whole answer within the cap: its `usage` read (for the budgets and the call's
    /// event, `report`; not at all when neither is there) and the answer redacted, both
    /// off the async threads; the charge settled.
    async fn whole(self, bytes: Vec<u8>, report: bool) -> Answer {
        let Reached {
            charge,
            secrets,
            sent_bytes,
        } = self;
        let read_usage = charge.is_some() || report;
        let answer_bytes = bytes.len();
        let (wire, out) = bounded::off_thread(move || {
            let wire = read_usage.then(|| answer_usage(&bytes)).flatten();
            (wire, redact_whole(&secrets, bytes))
        })
        .await;
        if let Some(charge) = charge {
            settle_whole(charge, sent_bytes, answer_bytes, wire);
        }
        let usage = wire.map(|u| roundtable_sandbox_protocol::Usage {
            model_calls: 1,
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            ..Default::default()
        });
        let response = hyper::Response::builder()
            .status(StatusCode::OK)
            .header(CONTENT_TYPE, "application/json")
            .body(super::http::full(out))
            .expect("a valid response");
        Answer {
            response,
            usage,
            streamed: false,
        }
    }

    /// The upstream refused the call: charged the prompt's estimate, and its error body
    /// shown to the guest redacted, then cut. Redacted before it is cut: a secret
    /// straddling the read's end (its start held back by the redactor) is dropped, never
    /// shown in part.
    fn refused(self, status: StatusCode, bytes: Vec<u8>, truncated: bool) -> Answer {
        if let Some(charge) = self.charge {
            charge.settle(estimate_tokens(self.sent_bytes), 0, true);
        }
        let mut redactor = Redactor::new(self.secrets);
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
        Answer::plain(error_response(StatusCode::BAD_GATEWAY, &msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part the provider would fetch is refused wherever it sits; inline `data:` parts,
    /// texts that hold URLs and a schema property named `url` pass.
    #[test]
    fn a_part_the_provider_would_fetch_is_refused() {
        let policy = ModelRequestPolicy::default();
        let body = |messages: &str| format!(r#"{{"messages":{messages}}}"#);
        for fetched in [
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x.example/a.png"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://127.0.0.1:8080/"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"video_url","video_url":{"url":" HTTP://x"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://x"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"//x.example/a"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"\u0068ttps://x"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"image_url","image_url":"https://x/a.png"}]}]"#,
            r#"[{"role":"user","content":[{"type":"audio_url","audio_url":"http://127.0.0.1/"}]}]"#,
            r#"[{"role":"user","content":[{"type":"file","file":{"file_data":"https://x/a.pdf"}}]}]"#,
            r#"[{"role":"user","content":[{"file_data":{"fileUri":"gs://b/o","mimeType":"x"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"x","URL":"https://x"}]}]"#,
        ] {
            assert_eq!(
                prepare(body(fetched).as_bytes(), "m", &policy)
                    .err()
                    .as_deref(),
                Some(FETCH_REFUSED),
                "{fetched}"
            );
        }
        for inline in [
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]"#,
            r#"[{"role":"user","content":[{"type":"image_url","image_url":"data:image/png;base64,AAAA"}]}]"#,
            r#"[{"role":"user","content":[{"type":"file","file":{"file_data":"data:application/pdf;base64,AA"}}]}]"#,
            r#"[{"role":"user","content":"see https://x.example/a.png"}]"#,
            r#"[{"role":"user","content":[{"type":"text","text":"url"}],"url":{"type":"string"}}]"#,
        ] {
            assert!(
                prepare(body(inline).as_bytes(), "m", &policy).is_ok(),
                "{inline}"
            );
        }
    }

    /// Every way of cutting a stream into chunks gives the guest the same bytes: the
    /// upstream's, minus the usage-only chunk when the guest did not ask for it (also after
    /// an event too long to be held).
    #[test]
    fn the_usage_chunk_is_dropped_however_the_stream_is_cut() {
        let text = |t: &str| {
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}}}}],\"usage\":null}}\n\n"
            )
        };
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3}}\r\n\r\n";
        let done = "data: [DONE]\n\n";
        let run = |events: &[String], drop: bool, size: usize| {
            let all = events.concat();
            let mut f = SseFilter::new(drop);
            let mut out = Vec::new();
            let mut tap = None;
            for chunk in all.as_bytes().chunks(size) {
                out.extend(f.push(chunk, &mut tap));
            }
            out.extend(f.finish(&mut tap));
            String::from_utf8(out).unwrap()
        };
        let small = vec![text("a"), text("b"), usage.to_owned(), done.to_owned()];
        let big = vec![
            text("a"),
            text(&"x".repeat(70_000)),
            usage.to_owned(),
            done.to_owned(),
        ];
        for (events, sizes) in [
            (&small, (1..=9).chain([64, 4096]).collect::<Vec<_>>()),
            (&big, vec![300, 1000, 4096, 65_536, 1 << 20]),
        ] {
            let without: String = events
                .iter()
                .filter(|e| e.as_str() != usage)
                .cloned()
                .collect();
            for size in sizes {
                assert_eq!(run(events, true, size), without, "chunks of {size}");
                assert_eq!(
                    run(events, false, size),
                    events.concat(),
                    "chunks of {size}"
                );
            }
        }
    }

    /// A chunk of many small events (LF or CRLF, whole or cut anywhere) is searched for its
    /// events' ends once: each byte looked at once, not once per event before it (the
    /// search from the start at every event made 50,000 events 20 GB of work).
    #[test]
    fn many_events_in_one_chunk_are_split_in_one_pass() {
        for (event, drop) in [("data:1\n\n", true), ("data:1\r\n\r\n", false)] {
            let all = event.repeat(50_000);
            for size in [all.len(), 4096, 7] {
                let mut f = SseFilter::new(drop);
                let mut out = Vec::new();
                for chunk in all.as_bytes().chunks(size) {
                    out.extend(f.push(chunk, &mut None));
                }
                out.extend(f.finish(&mut None));
                assert_eq!(out, all.as_bytes(), "{event:?} in chunks of {size}");
                assert!(
                    f.looked <= all.len() + 2 * all.len() / size + 16,
                    "{event:?} in chunks of {size}: {} bytes looked at for {}",
                    f.looked,
                    all.len()
                );
            }
        }
    }
}
