//! The host's compactor behind `POST /v1/compact` (the port of 0.7.16's
//! `jevCompactor({ logger })`).
//!
//! - [`validate`]: the `[compaction]` rules (URL, model, deadline), without side effects;
//! - [`Compactor::new`]: prepared once per runtime; a summarizer configured without a key is
//!   logged here, once, at warn;
//! - [`handle`]: one compaction request of a turn, under the turn's caps: one of its
//!   calls-in-flight permits for the whole compaction, one compaction at a time, refused
//!   once the turn's model calls are used up or past `max_compactions` (each `429`). The
//!   body is read capped (`min(max_request_bytes, MAX_REQUEST_BYTES)`) into one buffer
//!   within the call deadline; its JSON values are counted, then it is parsed as a typed
//!   [`CompactRequest`] and checked, off the async threads; a refused request is logged at
//!   warn (rate-limited, see [`Warnings`]) and answered with `4xx` (the guest then builds
//!   the plain summary itself).
//!
//! The chain, every step on the host: the configured summarizer (its own URL, model, key
//! and deadline) → the main model (as the guest's own compaction did before) → the plain
//! summary. Each step that fails — no key, the turn's model-call budget used up, the
//! endpoint unreachable, an HTTP error, a timeout, a malformed or empty answer — is logged
//! at warn with the channel's hash (the first 16 hex digits of its sha256, as the turn's
//! span shows it), the reason and `tokens_before`, and the next step runs. Reasons are
//! fixed texts: no upstream body and no guest text reaches the log. An answer is read at
//! most [`MAX_ANSWER_BYTES`] and parsed off the async threads into a typed shape (the
//! first choice's text, copied only up to the summary's size, and the token counts;
//! nothing else is built). Each upstream call
//! takes one call from the turn's model-call budget and asks for at most the operator's
//! `max_tokens`. Whatever summary comes back has every declared secret (the summarizer's
//! key and the model key among them) redacted before it is returned.

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

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
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use tokio::sync::OwnedSemaphorePermit;

use super::bounded::{self, read_body, values_over, Caps, ReadError, MAX_VALUES};
use super::http::holding;
use super::http::{json_response, Response, Turn};
use super::{BrokerError, BrokerPolicy};
use crate::config::model::chat_url;
use crate::config::ApiKey;

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
                let url = crate::config::compaction::validate(s)?;
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

/// The largest upstream answer to a summary request that is read (at most
/// `max_response_bytes`): a summary of the ≤ 96 KiB transcript the request carries is far
/// smaller (24 KB at the default budget); a larger answer is a failed step, never parsed.
pub(crate) const MAX_ANSWER_BYTES: usize = 256 * 1024;
/// Why a request was refused before the chain ran: the status and the message (the guest
/// is told it; the log gets `reason`, which holds no guest text).
struct Refusal {
    status: StatusCode,
    message: String,
    reason: &'static str,
}

/// The body's checks and typed parse (run off the async threads): the JSON-values
/// pre-check, the typed request, its rules.
fn parse_request(body: &[u8]) -> Result<CompactRequest, Refusal> {
    if values_over(body, MAX_VALUES) {
        return Err(Refusal {
            status: StatusCode::BAD_REQUEST,
            message: format!("compaction request too complex (more than {MAX_VALUES} JSON values)"),
            reason: "compaction request too complex",
        });
    }
    // The serde message may quote guest text: it goes back to the guest, not to the log.
    let request: CompactRequest = serde_json::from_slice(body).map_err(|e| Refusal {
        status: StatusCode::BAD_REQUEST,
        message: format!("malformed compaction request: {e}"),
        reason: "malformed compaction request",
    })?;
    request.check().map_err(|e| Refusal {
        status: StatusCode::BAD_REQUEST,
        message: format!("invalid compaction request: {e}"),
        reason: "invalid compaction request",
    })?;
    Ok(request)
}

/// Answers one compaction request ([`handle_now`]); a turn's `429` past its first
/// [`super::http::FREE_REFUSALS`] is answered after [`super::http::REFUSAL_PAUSE`] (the
/// guest's agent loop asks again only after a compaction failed, so a flood of retries is
/// an attacker's).
pub(super) async fn handle(turn: &Turn, req: Request<Incoming>) -> Response {
    let response = handle_now(turn, req).await;
    if response.status() == StatusCode::TOO_MANY_REQUESTS {
        super::http::pace_refusal(&turn.stop, &turn.compaction_refusals).await;
    }
    response
}

/// Answers one compaction request, under the turn's caps: the calls-in-flight permit for
/// its whole duration (`429`), one compaction at a time (`429`), the turn's model calls not used up and its compactions not
/// past `max_compactions` (`429`, the guest then builds the plain summary itself).
///
/// The steps: the method and the announced size checked, the turn's caps taken
/// ([`admit`]), the body read within its cap and the call deadline ([`read_request`]),
/// checked and parsed off the async threads ([`parse_off_thread`]), then the chain run.
async fn handle_now(turn: &Turn, req: Request<Incoming>) -> Response {
    if req.method() != Method::POST {
        return refuse(
            turn,
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: use POST",
        );
    }
    let limits = turn.broker.policy.limits;
    let cap = limits.max_request_bytes.min(MAX_REQUEST_BYTES);
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > cap as u64) {
        return refuse(turn, StatusCode::PAYLOAD_TOO_LARGE, &too_large(cap));
    }
    let (permit, one) = match admit(turn) {
        Ok(held) => held,
        Err(refused) => return *refused,
    };
    let body = match read_request(turn, req, cap).await {
        Ok(body) => body,
        Err(refused) => return *refused,
    };
    let request = match parse_off_thread(turn, body).await {
        Ok(request) => request,
        Err(refused) => return *refused,
    };
    let reply = compact(turn, &request).await;
    drop(request);
    drop(one);
    holding(json_response(StatusCode::OK, &reply), permit)
}

/// An answer that ends a request before the chain runs (a refusal).
type Halt = Box<Response>;

/// A refusal by one of the turn's limits, marked with it (logged, rate-limited).
fn refuse_by(
    turn: &Turn,
    status: StatusCode,
    limit: crate::events::Refusal,
    reason: &str,
) -> Response {
    turn.warnings.refused(reason);
    super::http::refuse(status, limit, reason)
}

/// A refusal of the compactor's own (its caps and rules).
fn refuse(turn: &Turn, status: StatusCode, reason: &str) -> Response {
    refuse_by(turn, status, crate::events::Refusal::Compaction, reason)
}

/// A `429` for a turn past its `max` of `what`.
fn too_many(
    turn: &Turn,
    limit: crate::events::Refusal,
    what: &str,
    max: &dyn std::fmt::Display,
) -> Response {
    let reason = format!("too many {what} in this turn (limit {max})");
    refuse_by(turn, StatusCode::TOO_MANY_REQUESTS, limit, &reason)
}

/// The refusal of a body past `cap`.
fn too_large(cap: usize) -> String {
    format!("compaction request too large (limit {cap} bytes)")
}

/// Takes the turn's caps for one compaction: a place among the calls in flight and the
/// turn's one compaction at a time (both held until the answer is sent), with its model
/// calls not used up and its compactions counted against `max_compactions`.
fn admit(turn: &Turn) -> Result<(OwnedSemaphorePermit, OwnedSemaphorePermit), Halt> {
    let limits = turn.broker.policy.limits;
    // A place among the calls in flight, held until the answer is sent (as for a chat call).
    let Ok(permit) = turn.in_flight.clone().try_acquire_owned() else {
        return Err(Box::new(too_many(
            turn,
            crate::events::Refusal::CallsInFlight,
            "calls in flight",
            &limits.max_calls_in_flight,
        )));
    };
    // One compaction at a time per turn: the guest's agent loop never asks for two at once,
    // so a second is only an attacker multiplying what each one holds.
    let Ok(one) = turn.compacting.clone().try_acquire_owned() else {
        return Err(Box::new(refuse(
            turn,
            StatusCode::TOO_MANY_REQUESTS,
            "a compaction is already in flight in this turn",
        )));
    };
    // A turn whose model calls are used up gets no more compactions: each upstream call
    // counts against them, and the plain summary is not served forever.
    if turn.model_calls.load(Ordering::SeqCst) >= limits.max_model_calls {
        return Err(Box::new(too_many(
            turn,
            crate::events::Refusal::ModelCalls,
            "model calls",
            &limits.max_model_calls,
        )));
    }
    if turn.compactions.fetch_add(1, Ordering::SeqCst) >= limits.max_compactions {
        return Err(Box::new(too_many(
            turn,
            crate::events::Refusal::Compaction,
            "compactions",
            &limits.max_compactions,
        )));
    }
    Ok((permit, one))
}

/// Reads the body into one buffer of the announced size (no second copy of the body),
/// refused past `cap` or when not received within the call deadline.
async fn read_request(turn: &Turn, req: Request<Incoming>, cap: usize) -> Result<Vec<u8>, Halt> {
    let read = bounded::read_request(req.into_body(), cap);
    match tokio::time::timeout(turn.broker.policy.limits.call_timeout, read).await {
        Err(_) => Err(Box::new(refuse(
            turn,
            StatusCode::REQUEST_TIMEOUT,
            "request body not received in time",
        ))),
        Ok(Err(bounded::RequestBody::TooLarge)) => Err(Box::new(refuse(
            turn,
            StatusCode::PAYLOAD_TOO_LARGE,
            &too_large(cap),
        ))),
        Ok(Err(_)) => Err(Box::new(refuse(
            turn,
            StatusCode::BAD_REQUEST,
            "request body unreadable",
        ))),
        Ok(Ok(buf)) => Ok(buf),
    }
}

/// Checks and parses the body off the async threads (it is dropped there); a refused
/// request is the guest's `4xx`, its fixed reason logged.
async fn parse_off_thread(turn: &Turn, body: Vec<u8>) -> Result<CompactRequest, Halt> {
    let parsed = tokio::task::spawn_blocking(move || parse_request(&body)).await;
    match parsed {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(refusal)) => {
            turn.warnings.refused(refusal.reason);
            Err(Box::new(super::http::refuse(
                refusal.status,
                crate::events::Refusal::Compaction,
                &refusal.message,
            )))
        }
        Err(_) => Err(Box::new(refuse(
            turn,
            StatusCode::INTERNAL_SERVER_ERROR,
            "compaction request not parsed",
        ))),
    }
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

    /// The source of a summary this step made.
    fn source(self) -> CompactSource {
        match self {
            Who::Summarizer => CompactSource::Summarizer,
            Who::Model => CompactSource::Model,
        }
    }

    /// What runs when this step fails (as the warning names it).
    fn next_step(self) -> &'static str {
        match self {
            Who::Summarizer => "main model",
            Who::Model => "plain summary",
        }
    }

    fn operation(self) -> crate::events::ModelOperation {
        match self {
            Who::Summarizer => crate::events::ModelOperation::CompactionSummarizer,
            Who::Model => crate::events::ModelOperation::CompactionModel,
        }
    }
}

/// Runs the chain for one checked request.
async fn compact(turn: &Turn, request: &CompactRequest) -> CompactReply {
    let channel = &turn.warnings.channel;
    let broker = &turn.broker;
    let compactor = &broker.compactor;
    let tokens_before = request.tokens_before;
    let mut usage = Usage::default();
    let mut outcome: Option<(String, CompactSource)> = None;

    // The summarizer (when configured), then the main model: each step with its upstream
    // and key; the first summary ends the chain, a failure is logged and the next step runs.
    let policy = &broker.policy;
    for who in [Who::Summarizer, Who::Model] {
        let (url, model, timeout, key) = match who {
            Who::Summarizer => {
                let Some(s) = &compactor.summarizer else {
                    continue;
                };
                let key = match s.key.resolve().await {
                    Ok(Some(key)) if !key.expose_secret().is_empty() => Ok(Some(key)),
                    Ok(_) => Err("the summarizer has no key"),
                    Err(_) => Err("the summarizer's key is unavailable"),
                };
                (&s.url, &s.model, s.timeout, key)
            }
            Who::Model => {
                let key = match policy.api_key.resolve().await {
                    Ok(key) => Ok(key.filter(|k| !k.expose_secret().is_empty())),
                    Err(_) => Err("the model key is unavailable"),
                };
                let timeout = policy.limits.call_timeout;
                (&compactor.model_url, &policy.model, timeout, key)
            }
        };
        let attempt = match key {
            Ok(key) => {
                let target = Target {
                    who,
                    url,
                    model,
                    key: key.as_ref(),
                    timeout,
                };
                call(turn, request, &target, &mut usage).await
            }
            Err(reason) => Err(reason.to_owned()),
        };
        match attempt {
            Ok(summary) => {
                outcome = Some((summary, who.source()));
                break;
            }
            Err(reason) => turn
                .warnings
                .fell_back(&reason, tokens_before, who.next_step()),
        }
    }

    let (summary, source) =
        outcome.unwrap_or_else(|| (plain_summary(request), CompactSource::Plain));
    // The broker's set: the keys just used are in it (a provider's new key rebuilt it).
    let summary = broker.secrets().redact(&summary);
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

/// The upstream one step of the chain calls: its URL, model, key and deadline.
struct Target<'a> {
    who: Who,
    url: &'a reqwest::Url,
    model: &'a str,
    key: Option<&'a SecretString>,
    timeout: Duration,
}

/// One summary request to the target with the shared rules; the finished summary, or why
/// not.
///
/// The steps: one of the turn's model calls taken, the request written
/// ([`summary_body`]), the budgets' worst case held ([`hold`]), the request built with
/// its key ([`authorised`]), sent and read within the deadline ([`SummaryCall::exchange`]),
/// then the answer read and its charge settled ([`SummaryCall::answer`]).
async fn call(
    turn: &Turn,
    request: &CompactRequest,
    target: &Target<'_>,
    usage: &mut Usage,
) -> Result<String, String> {
    let name = target.who.name();
    let limits = turn.broker.policy.limits;
    if turn.model_calls.fetch_add(1, Ordering::SeqCst) >= limits.max_model_calls {
        return Err(format!(
            "the turn's model calls are used up (limit {})",
            limits.max_model_calls
        ));
    }
    let body = summary_body(turn, request, target.model);
    let request_bytes = body.len();
    let charge = hold(turn, request_bytes, name)?;
    usage.model_calls += 1;
    crate::events::emit(
        &turn.ctx.events,
        crate::events::EventKind::Phase(crate::TurnPhase::ModelCall),
    );
    let http = match authorised(turn, target, body) {
        Ok(http) => http,
        Err(reason) => {
            if let Some(charge) = charge {
                charge.settle(0, 0, false);
            }
            return Err(reason);
        }
    };
    let cap = limits.max_response_bytes.min(MAX_ANSWER_BYTES);
    let mut call = SummaryCall {
        turn,
        who: target.who,
        charge,
        request_bytes,
        started: std::time::Instant::now(),
    };
    let (status, bytes, truncated) = call.exchange(http, target.timeout, cap).await?;
    let Answer {
        content,
        prompt,
        completion,
    } = call.answer(request, status, bytes, truncated, cap).await?;
    if let Some(n) = prompt {
        usage.prompt_tokens = Some(usage.prompt_tokens.unwrap_or(0).saturating_add(n));
    }
    if let Some(n) = completion {
        usage.completion_tokens = Some(usage.completion_tokens.unwrap_or(0).saturating_add(n));
    }
    finish_summary(request, &content).ok_or_else(|| format!("the {name} answer is empty"))
}

/// The summary request, written straight from its parts (no JSON value built).
fn summary_body(turn: &Turn, request: &CompactRequest, model: &str) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Summarise<'a> {
        model: &'a str,
        messages: &'a [Message],
        stream: bool,
        max_tokens: u32,
    }
    let messages: Vec<Message> = summary_messages(request);
    serde_json::to_vec(&Summarise {
        model,
        messages: &messages,
        stream: false,
        max_tokens: turn.broker.policy.model_request.max_tokens,
    })
    .expect("a summary request serialises")
}

/// Every budget must have room; the call's worst case is then held until its answer
/// settles it (as a chat call's). A refusal is the turn's `BudgetRefused` event.
fn hold(
    turn: &Turn,
    request_bytes: usize,
    name: &str,
) -> Result<Option<crate::budgets::CallCharge>, String> {
    match turn.ctx.account.as_ref().map(|a| {
        a.hold(
            crate::budgets::estimate_tokens(request_bytes),
            u64::from(turn.broker.policy.model_request.max_tokens),
        )
    }) {
        Some(Err(refusal)) => {
            crate::events::emit(
                &turn.ctx.events,
                crate::events::EventKind::BudgetRefused {
                    budget: refusal.budget,
                    mid_turn: true,
                },
            );
            Err(format!("the {name} call is refused: {refusal}"))
        }
        Some(Ok(charge)) => Ok(Some(charge)),
        None => Ok(None),
    }
}

/// The HTTP request to the target, its key in the `Authorization` header.
fn authorised(
    turn: &Turn,
    target: &Target<'_>,
    body: Vec<u8>,
) -> Result<reqwest::RequestBuilder, String> {
    let mut http = turn
        .broker
        .upstream
        .client
        .post(target.url.clone())
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, "application/json")
        .body(body);
    if let Some(key) = target.key {
        let Ok(mut value) = HeaderValue::from_str(&format!("Bearer {}", key.expose_secret()))
        else {
            return Err(format!(
                "the {} key is not a valid header value",
                target.who.name()
            ));
        };
        value.set_sensitive(true);
        http = http.header(AUTHORIZATION, value);
    }
    Ok(http)
}

/// One summary call once its request is built: what its answer settles, and what its
/// model call event reports.
struct SummaryCall<'t> {
    turn: &'t Turn,
    who: Who,
    /// The budgets' hold, settled by the answer (kept at its worst case otherwise).
    charge: Option<crate::budgets::CallCharge>,
    request_bytes: usize,
    started: std::time::Instant,
}

impl SummaryCall<'_> {
    /// One model call event per call that was tried, as the guest's calls have: the
    /// upstream's status (or what a guest would have got), its latency and usage.
    fn report(&self, status: StatusCode, counts: Option<(Option<u64>, Option<u64>)>) {
        if let Some(events) = &self.turn.ctx.events {
            events.broker(crate::events::BrokerEvent::ModelCall {
                operation: self.who.operation(),
                status: status.as_u16(),
                latency: self.started.elapsed(),
                usage: counts.map(|(p, c)| Usage {
                    model_calls: 1,
                    prompt_tokens: p,
                    completion_tokens: c,
                    ..Default::default()
                }),
            });
        }
    }

    /// Sends the request and reads its answer (at most `cap` bytes) within `timeout`,
    /// unless the turn is stopped first: the status, the bytes and whether they were cut.
    async fn exchange(
        &mut self,
        http: reqwest::RequestBuilder,
        timeout: Duration,
        cap: usize,
    ) -> Result<(StatusCode, Vec<u8>, bool), String> {
        let name = self.who.name();
        let exchange = async {
            let mut response = http.send().await.map_err(Exchange::Send)?;
            let status = response.status();
            match read_body(&mut response, cap).await {
                Ok(bytes) => Ok((status, bytes, false)),
                Err(ReadError::TooLarge { .. }) => Ok((status, Vec::new(), true)),
                Err(_) => Err(Exchange::Read),
            }
        };
        let outcome = tokio::select! {
            r = tokio::time::timeout(timeout, exchange) => r,
            _ = self.turn.stop.cancelled() => {
                self.count_call();
                self.report(StatusCode::SERVICE_UNAVAILABLE, None);
                return Err("the turn was stopped".to_owned());
            }
        };
        let (status, msg) = match outcome {
            Ok(Ok(r)) => {
                self.count_call();
                return Ok(r);
            }
            Err(_) => (
                StatusCode::GATEWAY_TIMEOUT,
                format!("the {name} timed out after {timeout:?}"),
            ),
            Ok(Err(Exchange::Send(e))) if e.is_connect() => {
                // Nothing reached the upstream: neither charged nor counted.
                if let Some(charge) = self.charge.take() {
                    charge.settle(0, 0, false);
                }
                self.report(StatusCode::BAD_GATEWAY, None);
                return Err(format!("the {name} is unreachable"));
            }
            Ok(Err(Exchange::Send(e))) if e.is_timeout() => {
                (StatusCode::GATEWAY_TIMEOUT, format!("the {name} timed out"))
            }
            Ok(Err(_)) => (
                StatusCode::BAD_GATEWAY,
                format!("the {name} request failed"),
            ),
        };
        // It may have reached the upstream (a deadline, a connection lost after the
        // request went): counted as a call (its charge, dropped, keeps its estimate).
        self.count_call();
        self.report(status, None);
        Err(msg)
    }

    /// One call that reached (or may have reached) the upstream, in the turn's usage: once
    /// (through its charge, which a drop unsettled would count again otherwise).
    fn count_call(&self) {
        match (&self.charge, &self.turn.ctx.account) {
            (Some(charge), _) => charge.count_sent(),
            (None, Some(account)) => account.count_model_call(),
            (None, None) => {}
        }
    }

    /// Reads the upstream's answer: a refusal or a cut answer is a failed step; a
    /// successful one is parsed off the async threads (only the text, copied up to the
    /// summary's size, and the counts are kept; the answer's bytes are dropped there). The
    /// charge is settled, host-counted from the upstream's own usage (or the estimate).
    async fn answer(
        mut self,
        request: &CompactRequest,
        status: StatusCode,
        bytes: Vec<u8>,
        truncated: bool,
        cap: usize,
    ) -> Result<Answer, String> {
        let name = self.who.name();
        if !status.is_success() {
            if let Some(charge) = self.charge.take() {
                charge.settle(crate::budgets::estimate_tokens(self.request_bytes), 0, true);
            }
            self.report(status, None);
            return Err(format!("the {name} returned HTTP {}", status.as_u16()));
        }
        if truncated {
            self.report(StatusCode::BAD_GATEWAY, None);
            return Err(format!("the {name} answer is larger than {cap} bytes"));
        }
        // Room past the summary's cap for a whole key that begins before it: the answer
        // is redacted before it is cut (a key cut first would pass the redaction in part).
        let secrets = self.turn.broker.secrets();
        let keep = request
            .limits()
            .bytes
            .saturating_add(1)
            .saturating_add(secrets.longest());
        let answer_bytes = bytes.len();
        let caps = Caps::bytes(cap);
        let parsed = bounded::off_thread(move || {
            bounded::check(&bytes, caps).ok()?;
            let mut answer = parse_answer(&bytes, keep)?;
            // (`capped` ends at a character boundary: up to 3 bytes short of `keep`.)
            let cut = answer.content.len().saturating_add(4) > keep;
            answer.content = secrets.redact_prefix(&answer.content, cut);
            Some(answer)
        })
        .await;
        self.report(status, parsed.as_ref().map(|a| (a.prompt, a.completion)));
        // Host-counted, from the upstream's own usage (or the estimate), answer or not.
        if let Some(charge) = self.charge.take() {
            match parsed.as_ref().map(|a| (a.prompt, a.completion)) {
                Some((Some(p), Some(c))) => charge.settle(p, c, false),
                // (A count without its completion's: the answer's estimate, not nothing.)
                Some((Some(p), None)) => {
                    charge.settle(p, crate::budgets::estimate_tokens(answer_bytes), true)
                }
                _ => charge.settle(
                    crate::budgets::estimate_tokens(self.request_bytes),
                    crate::budgets::estimate_tokens(answer_bytes),
                    true,
                ),
            }
        }
        parsed.ok_or_else(|| format!("the {name} answer is not a chat completion"))
    }
}

/// Why a summary call's exchange failed.
enum Exchange {
    /// The request was not sent or not answered.
    Send(reqwest::Error),
    /// The answer could not be read.
    Read,
}

// ---------------------------------------------------------------- the answer, typed

/// What is kept of a chat completion: the first choice's text, copied only up to `cap`
/// bytes, and the token counts. Everything else is skipped as it is read (no value built).
#[derive(Debug, PartialEq)]
struct Answer {
    content: String,
    prompt: Option<u64>,
    completion: Option<u64>,
}

/// The typed read of a non-streamed chat completion; `None` when it is not one.
fn parse_answer(bytes: &[u8], cap: usize) -> Option<Answer> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let answer = AnswerSeed { cap }.deserialize(&mut de).ok()?;
    de.end().ok()?;
    answer
}

/// The first `cap` bytes of `s` (at a character boundary), leading blanks skipped.
fn capped(s: &str, cap: usize) -> String {
    let s = s.trim_start();
    let mut end = s.len().min(cap);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// A visitor that is its own seed: `$seed` is read through `$how` into `$value` (a JSON
/// shape named `$what` in errors) by the visit methods that follow.
macro_rules! seed_visitor {
    ($(#[$doc:meta])* struct $seed:ident $fields:tt => $($rest:tt)*) => {
        $(#[$doc])*
        struct $seed $fields
        seed_visitor!($seed => $($rest)*);
    };
    ($seed:ty => $value:ty, $how:ident, $what:literal; $($visit:tt)*) => {
        impl<'de> DeserializeSeed<'de> for $seed {
            type Value = $value;
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.$how(self)
            }
        }

        impl<'de> Visitor<'de> for $seed {
            type Value = $value;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str($what)
            }
            $($visit)*
        }
    };
}

/// A map key matched against `names` without being copied: its index, or `None`.
struct Key(&'static [&'static str]);

seed_visitor! {
    Key => Option<usize>, deserialize_str, "a key";
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().position(|n| *n == v))
    }
}

/// Reads a map, each value of a key in `names` through `value`, every other one skipped.
fn each_entry<'de, A: MapAccess<'de>>(
    mut map: A,
    names: &'static [&'static str],
    mut value: impl FnMut(usize, &mut A) -> Result<(), A::Error>,
) -> Result<(), A::Error> {
    while let Some(key) = map.next_key_seed(Key(names))? {
        match key {
            Some(i) => value(i, &mut map)?,
            None => {
                map.next_value::<IgnoredAny>()?;
            }
        }
    }
    Ok(())
}

/// Reads a map for the value of its key `name` through a seed of `seed`'s (the last such
/// value, if the key is repeated); every other value skipped.
fn field<'de, A: MapAccess<'de>, S: DeserializeSeed<'de>>(
    map: A,
    name: &'static [&'static str],
    seed: impl Fn() -> S,
) -> Result<Option<S::Value>, A::Error> {
    let mut value = None;
    each_entry(map, name, |_, map| {
        value = Some(map.next_value_seed(seed())?);
        Ok(())
    })?;
    Ok(value)
}

/// Which JSON shapes a lenient field takes; any other is skipped and read as `None`: always
/// booleans, signed integers, floats, null and lists, and each of `u64`, `str` and `map`
/// named.
macro_rules! lenient_otherwise_none {
    ($($also:ident),*) => {
        $(lenient_otherwise_none!(@$also);)*
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(None)
        }
    };
    (@u64) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@str) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@map) => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(None)
        }
    };
}

seed_visitor! {
    /// The whole answer: `choices` and `usage`.
    struct AnswerSeed { cap: usize } => Option<Answer>, deserialize_map, "a chat completion";
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let mut content = None;
        let mut usage = (None, None);
        each_entry(map, &["choices", "usage"], |i, map| {
            if i == 0 {
                content = map.next_value_seed(Choices { cap: self.cap })?;
            } else {
                usage = map.next_value_seed(UsageSeed)?.unwrap_or_default();
            }
            Ok(())
        })?;
        Ok(content.map(|content| Answer {
            content,
            prompt: usage.0,
            completion: usage.1,
        }))
    }
}

seed_visitor! {
    /// `choices`: the first one's message text; the others skipped.
    struct Choices { cap: usize } => Option<String>, deserialize_seq, "a list of choices";
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first = seq.next_element_seed(Choice { cap: self.cap })?.flatten();
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(first)
    }
}

seed_visitor! {
    /// One choice: its `message`'s text (`None` without a message).
    struct Choice { cap: usize } => Option<String>, deserialize_map, "a choice";
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        field(map, &["message"], || MessageSeed { cap: self.cap })
    }
}

seed_visitor! {
    /// A message: its `content` (empty when absent or null).
    struct MessageSeed { cap: usize } => String, deserialize_map, "a message";
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Ok(field(map, &["content"], || Content { cap: self.cap })?.unwrap_or_default())
    }
}

seed_visitor! {
    /// `content`: a string, null, or a list of parts whose `text`s are joined; capped.
    struct Content { cap: usize } => String, deserialize_any, "a string, null or a list of parts";
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(capped(v, self.cap))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(String::new())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = String::new();
        loop {
            let left = self.cap.saturating_sub(out.len());
            let Some(part) = seq.next_element_seed(Part { cap: left })? else {
                break;
            };
            // Each part was copied only up to what is left of the cap.
            if let Some(text) = part {
                out.push_str(&text);
            }
        }
        Ok(out)
    }
}

seed_visitor! {
    /// One part of a list content: its `text`, if it is a string.
    struct Part { cap: usize } => Option<String>, deserialize_any, "a part";
    lenient_otherwise_none!(u64, str);
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Ok(field(map, &["text"], || Text { cap: self.cap })?.flatten())
    }
}

seed_visitor! {
    /// A string copied up to `cap` bytes; anything else skipped as `None`.
    struct Text { cap: usize } => Option<String>, deserialize_any, "a text";
    lenient_otherwise_none!(u64, map);
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let mut end = v.len().min(self.cap);
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        Ok(Some(v[..end].to_owned()))
    }
}

/// `usage`: the prompt and completion token counts (non-integers read as absent).
struct UsageSeed;

seed_visitor! {
    UsageSeed => Option<(Option<u64>, Option<u64>)>, deserialize_any, "token counts";
    lenient_otherwise_none!(u64, str);
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let mut tokens = (None, None);
        each_entry(map, &["prompt_tokens", "completion_tokens"], |i, map| {
            let n = map.next_value_seed(Count)?;
            if i == 0 {
                tokens.0 = n;
            } else {
                tokens.1 = n;
            }
            Ok(())
        })?;
        Ok(Some(tokens))
    }
}

/// A token count: a non-negative integer, anything else skipped as `None`.
struct Count;

seed_visitor! {
    Count => Option<u64>, deserialize_any, "a token count";
    lenient_otherwise_none!(str, map);
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_leniently_and_strictly_enough() {
        let parse = |b: &[u8]| parse_answer(b, 100);
        let a = parse(
            br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}},{"message":{"content":"no"}}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"extra":[[],{"a":[1,2]}]}"#,
        )
        .unwrap();
        assert_eq!(
            a,
            Answer {
                content: "hi".into(),
                prompt: Some(3),
                completion: Some(1)
            }
        );
        let a = parse(
            br#"{"choices":[{"message":{"content":[{"type":"text","text":"a"},{"text":"b"},{"text":5},"c",7,{"x":1}]}}]}"#,
        )
        .unwrap();
        assert_eq!(a.content, "ab");
        let a = parse(br#"{"choices":[{"message":{"content":null}}],"usage":{"prompt_tokens":-1,"completion_tokens":2.5}}"#).unwrap();
        assert_eq!(
            (a.content.as_str(), a.prompt, a.completion),
            ("", None, None)
        );
        assert_eq!(
            parse(br#"{"choices":[{"message":{}}],"usage":null}"#)
                .unwrap()
                .content,
            ""
        );
        for bad in [
            &b"{}"[..],
            b"nope",
            br#"{"choices":[{"message":{"content":5}}]}"#,
            br#"{"choices":[]}"#,
            br#"{"choices":[{"text":"legacy"}]}"#,
            br#"{"choices":[{"message":null}]}"#,
            br#"{"choices":{"0":{"message":{"content":"x"}}}}"#,
            br#"{"choices":[{"message":{"content":"x"}}]} trailing"#,
        ] {
            assert!(parse(bad).is_none(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_text_is_copied_only_up_to_the_cap() {
        let long = format!(
            r#"{{"choices":[{{"message":{{"content":"  {}"}}}}]}}"#,
            "é".repeat(1000)
        );
        let a = parse_answer(long.as_bytes(), 9).unwrap();
        assert_eq!(
            a.content, "éééé",
            "cut at a character boundary, leading blanks skipped"
        );
        assert!(a.content.capacity() <= 9);
        // Escaped text (unescaped by the reader, then copied up to the cap).
        let escaped = format!(
            r#"{{"choices":[{{"message":{{"content":"{}"}}}}]}}"#,
            r"\u00e9".repeat(1000)
        );
        assert_eq!(parse_answer(escaped.as_bytes(), 5).unwrap().content, "éé");
        let parts = format!(
            r#"{{"choices":[{{"message":{{"content":[{{"text":"{0}"}},{{"text":"{0}"}},{{"text":"{0}"}}]}}}}]}}"#,
            "z".repeat(60)
        );
        assert_eq!(
            parse_answer(parts.as_bytes(), 100).unwrap().content.len(),
            100
        );
    }
}
