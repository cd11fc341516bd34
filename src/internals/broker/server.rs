//! The per-turn HTTP/1.1 server on the unix socket.
//!
//! - [`serve`]: the accept loop over the turn's [`Acceptor`] (a unix listener, with the
//!   peer check: SO_PEERCRED uid must be the worker uid; or the byte streams a backend
//!   carries from its guest, see [`crate::driver::BrokerTransport`]), a cap on open connections (one more is answered `503` and closed), one task per
//!   connection in a `JoinSet` (so stopping the listener aborts them all), a header read
//!   timeout so a slow client blocks nothing; the connection-limit warn line at most once
//!   per 10 s per turn (the rest counted and told);
//! - [`handle`]: routing, method check, body size cap (`413`), a cap on calls in flight
//!   (`429`; the slot is held from the body's first byte to the answer's last), per-turn
//!   call counts (`429`), body read deadline, then the model proxy (the body checked and
//!   rewritten by [`super::model::prepare`], the guest's bytes dropped before the upstream
//!   is called), a host tool or an MCP tool (arguments whose size in JSON values could
//!   inflate in memory are refused before they are parsed);
//! - the answers ([`super::http`]): every refusal is `{"error": "..."}`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, CONTENT_LENGTH};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use roundtable_sandbox_protocol::{paths, ErrorBody};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::bounded::MAX_VALUES;
use super::http::{error_response, holding, refuse, Refused, Response, Turn};
use super::{Broker, TurnContext};
use crate::driver::GuestStream;
use crate::events::{BrokerEvent, EventKind, Refusal};
use crate::TurnPhase;

/// How long a client may take to send a request head.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Where one turn's connections come from.
pub(crate) enum Acceptor {
    /// A unix listener in the turn's run dir; each peer's uid is checked (SO_PEERCRED).
    Unix(UnixListener),
    /// Byte streams the backend carries from its guest (it vouches for their origin).
    Streams(mpsc::Receiver<Box<dyn GuestStream>>),
}

/// One accept's result.
enum Accepted {
    Stream(Box<dyn GuestStream>),
    /// Nothing to serve this time (a refused peer, a failed accept).
    Skip,
    /// No more connections will come (the backend closed its stream source).
    Closed,
}

impl Acceptor {
    async fn accept(&mut self, peer_uid: Option<u32>, ctx: &TurnContext) -> Accepted {
        match self {
            Acceptor::Unix(listener) => {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "broker accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        return Accepted::Skip;
                    }
                };
                match stream.peer_cred() {
                    Ok(cred) if peer_uid.is_none_or(|uid| cred.uid() == uid) => {
                        Accepted::Stream(Box::new(stream))
                    }
                    Ok(cred) => {
                        tracing::warn!(
                            peer_uid = cred.uid(),
                            worker_uid = peer_uid,
                            "broker refused a peer"
                        );
                        // Closed without an answer; reported as the 403 it amounts to.
                        refused(ctx, StatusCode::FORBIDDEN, Refusal::PeerUid);
                        Accepted::Skip
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "broker could not read the peer's credentials");
                        Accepted::Skip
                    }
                }
            }
            Acceptor::Streams(streams) => match streams.recv().await {
                Some(stream) => Accepted::Stream(stream),
                None => Accepted::Closed,
            },
        }
    }
}

/// Accepts connections until `stop` fires; dropping this future aborts every connection.
pub(crate) async fn serve(
    broker: Arc<Broker>,
    mut acceptor: Acceptor,
    ctx: TurnContext,
    stop: CancellationToken,
) {
    let peer_uid = broker
        .policy
        .peer_uid_check
        .then_some(broker.policy.worker_uid);
    let max_connections = broker.policy.limits.max_connections;
    let turn = Arc::new(Turn::new(broker, ctx, stop.clone()));
    let mut connections = JoinSet::new();
    let mut closed = false;
    let mut limit_log = LimitLog::default();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = acceptor.accept(peer_uid, &turn.ctx), if !closed => accepted,
        };
        let stream = match accepted {
            Accepted::Stream(stream) => stream,
            Accepted::Skip => continue,
            Accepted::Closed => {
                closed = true;
                continue;
            }
        };
        if connections.len() >= max_connections {
            refused(
                &turn.ctx,
                StatusCode::SERVICE_UNAVAILABLE,
                Refusal::Connections,
            );
            limit_log.reached(max_connections);
            refuse_connection(&turn, stream, max_connections);
            continue;
        }
        connections.spawn(connection(turn.clone(), stream));
    }
    connections.shutdown().await;
    limit_log.finish(max_connections);
}

impl Turn {
    /// A turn's shared state, its counts at zero.
    fn new(broker: Arc<Broker>, ctx: TurnContext, stop: CancellationToken) -> Self {
        let in_flight = Arc::new(Semaphore::new(broker.policy.limits.max_calls_in_flight));
        let warnings = super::warn::Warnings::new(&ctx.channel);
        Self {
            broker,
            ctx,
            stop,
            model_calls: AtomicU32::new(0),
            tool_calls: AtomicU32::new(0),
            compactions: AtomicU32::new(0),
            compaction_refusals: AtomicU32::new(0),
            egress_refusals: AtomicU32::new(0),
            connection_refusals: AtomicU32::new(0),
            in_flight,
            compacting: Arc::new(Semaphore::new(1)),
            warnings,
            egress: Default::default(),
        }
    }
}

/// The connection-limit warn line, rate-limited: one per window, the rest counted.
#[derive(Default)]
struct LimitLog {
    logged: Option<std::time::Instant>,
    suppressed: u64,
}

impl LimitLog {
    /// One more connection past the limit.
    fn reached(&mut self, limit: usize) {
        if self
            .logged
            .is_none_or(|t| t.elapsed() >= super::warn::WARN_WINDOW)
        {
            tracing::warn!(
                limit,
                suppressed = self.suppressed,
                "broker connection limit reached"
            );
            self.logged = Some(std::time::Instant::now());
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
    }

    /// The turn's end: the lines suppressed since the last one, told.
    fn finish(&self, limit: usize) {
        if self.suppressed > 0 {
            tracing::warn!(
                limit,
                suppressed = self.suppressed,
                "broker connection limit reached (lines suppressed in this turn)"
            );
        }
    }
}

/// A connection past the limit: told why, then closed: a few hundred bytes into a fresh
/// socket's buffer (a peer that reads nothing does not hold the task past the deadline).
fn refuse_connection(turn: &Turn, stream: Box<dyn GuestStream>, limit: usize) {
    let refusal = too_many_connections(limit);
    // Paced past the turn's first few, as its requests' refusals are: a guest that
    // reconnects at once costs the host little.
    let pace = super::http::pace_refusal(&turn.stop, &turn.connection_refusals);
    tokio::spawn(async move {
        let mut stream = stream;
        pace.await;
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            tokio::io::AsyncWriteExt::write_all(&mut stream, &refusal),
        )
        .await;
    });
}

/// Serves one connection's requests until it ends or the turn does (its calls in flight,
/// upstream requests and MCP calls, are then dropped).
async fn connection(turn: Arc<Turn>, stream: Box<dyn GuestStream>) {
    let service_turn = turn.clone();
    let service = hyper::service::service_fn(move |req| {
        let turn = service_turn.clone();
        async move {
            let mut response = handle(&turn, req).await;
            // Every refusal of the broker's own, reported once, here.
            if let Some(Refused(limit)) = response.extensions_mut().remove::<Refused>() {
                refused(&turn.ctx, response.status(), limit);
            }
            Ok::<_, Infallible>(response)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        // max_buf_size alone is a soft bound (a read may overshoot it); the
        // parsed head is checked exactly, with a 431.
        .max_header_size(MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "broker connection ended");
                // hyper's own answers (to a head it cannot parse, or past the cap).
                if let Some((status, limit)) = answered_by_hyper(&e) {
                    refused(&turn.ctx, status, limit);
                }
            }
        }
        // The turn ended: in-flight calls (upstream requests, MCP calls) are dropped.
        _ = turn.stop.cancelled() => {}
    }
}

/// Reports one refusal of the broker.
fn refused(ctx: &TurnContext, status: StatusCode, limit: Refusal) {
    if let Some(events) = &ctx.events {
        events.broker(BrokerEvent::Refused {
            status: status.as_u16(),
            limit,
        });
    }
}

/// The refusal hyper answered itself when a connection ended on `e`: `431` for a head past
/// [`MAX_HEAD_BYTES`], `414` for a URI past hyper's own cap, `400` for a head it cannot
/// parse. `None` when hyper sent no answer (a header timeout, an HTTP/2 preface, a peer
/// gone).
fn answered_by_hyper(e: &hyper::Error) -> Option<(StatusCode, Refusal)> {
    if e.is_parse_too_large() {
        // hyper's one public sign of which: its message ("URI too long").
        let status = if e.to_string().contains("URI too long") {
            StatusCode::URI_TOO_LONG
        } else {
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        };
        return Some((status, Refusal::HeadBytes));
    }
    if e.is_parse() && !e.is_parse_version_h2() && !e.is_parse_status() {
        return Some((StatusCode::BAD_REQUEST, Refusal::Malformed));
    }
    None
}

/// The raw `503` for a connection past the cap.
fn too_many_connections(limit: usize) -> Vec<u8> {
    let body = serde_json::to_vec(&ErrorBody {
        error: format!("too many connections in this turn (limit {limit})"),
    })
    .expect("serialisable");
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// A name from the path, shortened for an error message.
fn shown(name: &str) -> String {
    name.chars().take(64).collect()
}

#[derive(Clone, Copy)]
enum Route<'a> {
    Chat,
    Tool(&'a str),
    Mcp(&'a str, &'a str),
}

fn route(path: &str) -> Option<Route<'_>> {
    if path == paths::CHAT_COMPLETIONS {
        return Some(Route::Chat);
    }
    if let Some(name) = path.strip_prefix(paths::TOOLS_PREFIX) {
        return (!name.is_empty() && !name.contains('/')).then_some(Route::Tool(name));
    }
    if let Some(rest) = path.strip_prefix(paths::MCP_PREFIX) {
        let (server, tool) = rest.split_once('/')?;
        return (!server.is_empty() && !tool.is_empty() && !tool.contains('/'))
            .then_some(Route::Mcp(server, tool));
    }
    None
}

/// Answers one request: egress and compaction by their own handlers; a model or tool
/// call routed, its target resolved, its size and the turn's caps checked
/// ([`admit`]), its body read ([`read_body`]), then served ([`call`]).
async fn handle(turn: &Turn, req: Request<Incoming>) -> Response {
    let path = req.uri().path().to_owned();
    if let Some(rest) = path.strip_prefix(paths::EGRESS_PREFIX) {
        // Any method; its own caps, the calls-in-flight permit: see `egress::handle`.
        return super::egress::handle(turn, req, rest).await;
    }
    if path == paths::COMPACT {
        // Under the same caps (the calls-in-flight permit, the model calls) and its own
        // count: see `compact::handle`.
        return super::compact::handle(turn, req).await;
    }
    let Some(route) = route(&path) else {
        return error_response(StatusCode::NOT_FOUND, "not found");
    };
    if req.method() != Method::POST {
        return error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: use POST",
        );
    }
    // Resolve the target before reading the body: unknown names are refused at once.
    if let Some(unknown) = unknown_target(turn, route) {
        return unknown;
    }
    let permit = match admit(turn, route, &req) {
        Ok(permit) => permit,
        Err(refused) => return *refused,
    };
    let accept = req
        .headers()
        .get(ACCEPT)
        .filter(|v| v.len() <= 256)
        .cloned();
    let body = match read_body(turn, req).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    holding(call(turn, route, body, accept).await, permit)
}

/// An answer that ends a request before its call (a refusal).
type Halt = Box<Response>;

/// The `404` for a tool or MCP tool the turn does not have.
fn unknown_target(turn: &Turn, route: Route<'_>) -> Option<Response> {
    match route {
        Route::Chat => None,
        Route::Tool(name) => (!turn.broker.tools.contains(name)).then(|| {
            error_response(
                StatusCode::NOT_FOUND,
                &format!("unknown tool: {}", shown(name)),
            )
        }),
        Route::Mcp(server, tool) => (!turn.broker.mcp.allowed(server, tool)).then(|| {
            error_response(
                StatusCode::NOT_FOUND,
                &format!("unknown MCP tool: {}/{}", shown(server), shown(tool)),
            )
        }),
    }
}

/// The `413` for a body past `max_request_bytes`.
fn too_large(turn: &Turn) -> Response {
    error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!(
            "request body too large (limit {} bytes)",
            turn.broker.policy.limits.max_request_bytes
        ),
    )
}

/// Admits one call under the turn's caps: its announced size, a place among the calls in
/// flight (held until the answer is sent), then the call counted (model or tool) before
/// any work is done for it.
fn admit(
    turn: &Turn,
    route: Route<'_>,
    req: &Request<Incoming>,
) -> Result<tokio::sync::OwnedSemaphorePermit, Halt> {
    let limits = turn.broker.policy.limits;
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_request_bytes as u64) {
        return Err(Box::new(too_large(turn)));
    }
    // A place among the calls in flight, held until the answer is sent; a refusal here
    // does not use up the turn's call budget.
    let Ok(permit) = turn.in_flight.clone().try_acquire_owned() else {
        return Err(Box::new(refuse(
            StatusCode::TOO_MANY_REQUESTS,
            Refusal::CallsInFlight,
            &format!(
                "too many calls in flight in this turn (limit {})",
                limits.max_calls_in_flight
            ),
        )));
    };
    // Count the call before any work is done for it.
    let (counter, max, what, limit) = match route {
        Route::Chat => (
            &turn.model_calls,
            limits.max_model_calls,
            "model",
            Refusal::ModelCalls,
        ),
        _ => (
            &turn.tool_calls,
            limits.max_tool_calls,
            "tool",
            Refusal::ToolCalls,
        ),
    };
    if counter.fetch_add(1, Ordering::SeqCst) >= max {
        return Err(Box::new(refuse(
            StatusCode::TOO_MANY_REQUESTS,
            limit,
            &format!("too many {what} calls in this turn (limit {max})"),
        )));
    }
    Ok(permit)
}

/// Reads the body within `max_request_bytes` and the call deadline.
async fn read_body(turn: &Turn, req: Request<Incoming>) -> Result<Bytes, Response> {
    let limits = turn.broker.policy.limits;
    let body = super::bounded::read_request(req.into_body(), limits.max_request_bytes);
    match tokio::time::timeout(limits.call_timeout, body).await {
        Err(_) => Err(error_response(
            StatusCode::REQUEST_TIMEOUT,
            "request body not received in time",
        )),
        Ok(Err(super::bounded::RequestBody::TooLarge)) => Err(too_large(turn)),
        Ok(Err(super::bounded::RequestBody::Unreadable)) => Err(error_response(
            StatusCode::BAD_REQUEST,
            "request body unreadable",
        )),
        Ok(Ok(b)) => Ok(Bytes::from(b)),
    }
}

/// Serves one admitted call whose body has been read.
async fn call(turn: &Turn, route: Route<'_>, body: Bytes, accept: Option<HeaderValue>) -> Response {
    match route {
        Route::Chat => model_call(turn, body, accept).await,
        Route::Tool(_) | Route::Mcp(..) => tool_route_call(turn, route, body).await,
    }
}

/// A model call: the body checked and rewritten ([`super::model::prepare`]), the budgets'
/// worst case held ([`hold`]), then forwarded; its event sent (a stream's, by the stream
/// when it ends).
async fn model_call(turn: &Turn, body: Bytes, accept: Option<HeaderValue>) -> Response {
    let policy = &turn.broker.policy;
    let prepared = match super::model::prepare(&body, &policy.model, &policy.model_request) {
        Ok(p) => p,
        Err(msg) => return refuse(StatusCode::BAD_REQUEST, Refusal::ModelField, &msg),
    };
    // The guest's bytes are not held while the upstream answers.
    drop(body);
    let charge = match hold(turn, &prepared) {
        Ok(charge) => charge,
        Err(refusal) => {
            return refuse(
                StatusCode::TOO_MANY_REQUESTS,
                Refusal::Budget(refusal.budget),
                &refusal.to_string(),
            )
        }
    };
    crate::events::emit(&turn.ctx.events, EventKind::Phase(TurnPhase::ModelCall));
    tracing::debug!("model call");
    let started = std::time::Instant::now();
    let super::model::Answer {
        mut response,
        usage,
        streamed,
    } = turn
        .broker
        .upstream
        .chat(
            prepared,
            accept,
            turn.stop.clone(),
            policy,
            charge,
            turn.ctx.events.as_ref(),
        )
        .await;
    // Forwarded: whatever the upstream answered is the model call's outcome. A
    // stream's event is sent by the stream when it ends (with its usage chunk's).
    response.extensions_mut().remove::<Refused>();
    if let (Some(events), false) = (&turn.ctx.events, streamed) {
        events.broker(BrokerEvent::ModelCall {
            operation: crate::events::ModelOperation::Chat,
            status: response.status().as_u16(),
            latency: started.elapsed(),
            usage,
        });
    }
    response
}

/// Every token budget must have room, this turn's tokens so far and the calls in flight
/// included; the call's worst case is then held until its answer settles it (the guest
/// reports the 429; the turn's failure is typed by the host). A refusal is logged and is
/// the turn's `BudgetRefused` event.
fn hold(
    turn: &Turn,
    prepared: &super::model::Prepared,
) -> Result<Option<crate::budgets::CallCharge>, crate::budgets::BudgetRefusal> {
    let Some(account) = &turn.ctx.account else {
        return Ok(None);
    };
    let prompt = crate::budgets::estimate_tokens(prepared.body.len());
    match account.hold(prompt, prepared.max_completion) {
        Ok(charge) => Ok(Some(charge)),
        Err(refusal) => {
            tracing::info!(
                budget = refusal.budget.key(),
                "model call refused by a budget"
            );
            crate::events::emit(
                &turn.ctx.events,
                EventKind::BudgetRefused {
                    budget: refusal.budget,
                    mid_turn: true,
                },
            );
            Err(refusal)
        }
    }
}

/// A host or MCP tool call: its arguments checked (their size in JSON values, then a JSON
/// object), the call made ([`tool_call`]), its event sent and the host's count of it.
async fn tool_route_call(turn: &Turn, route: Route<'_>, body: Bytes) -> Response {
    if super::bounded::values_over(&body, MAX_VALUES) {
        return refuse(
            StatusCode::BAD_REQUEST,
            Refusal::ArgumentComplexity,
            &format!("tool arguments too complex (more than {MAX_VALUES} JSON values)"),
        );
    }
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &format!("malformed JSON: {e}")),
    };
    let serde_json::Value::Object(object) = value else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "the request body must be a JSON object",
        );
    };
    drop(body);
    crate::events::emit(&turn.ctx.events, EventKind::Phase(TurnPhase::ToolCall));
    let started = std::time::Instant::now();
    let (name, mcp) = match route {
        Route::Mcp(server, tool) => (format!("{server}/{tool}"), true),
        Route::Tool(name) => (name.to_owned(), false),
        Route::Chat => unreachable!("a model call"),
    };
    let response = tool_call(turn, route, object).await;
    // A refused call is reported as its refusal (by the service), a call made as a call.
    if let (Some(events), None) = (&turn.ctx.events, response.extensions().get::<Refused>()) {
        events.broker(BrokerEvent::ToolCall {
            name,
            mcp,
            ok: response.status().is_success(),
            latency: started.elapsed(),
        });
    }
    if let Some(account) = &turn.ctx.account {
        account.count_tool_call();
    }
    response
}

/// Runs one host or MCP tool call whose arguments are an object.
async fn tool_call(
    turn: &Turn,
    route: Route<'_>,
    object: serde_json::Map<String, serde_json::Value>,
) -> Response {
    let policy = &turn.broker.policy;
    // A key provider's key is redacted from tool results: have it before the first one.
    if policy.api_key.unfetched() {
        if let Err(e) = policy.api_key.resolve().await {
            tracing::warn!(error = %e, "model key unavailable");
        }
    }
    match route {
        Route::Chat => unreachable!("answered above"),
        Route::Tool(name) => {
            tracing::debug!(tool = name, "host tool call");
            turn.broker
                .tools
                .call(name, object, &turn.ctx, &turn.stop, &turn.broker)
                .await
        }
        Route::Mcp(server, tool) => {
            tracing::debug!(server, tool, "MCP tool call");
            turn.broker
                .mcp
                .call(server, tool, object, &turn.ctx, &turn.stop, &turn.broker)
                .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert!(matches!(route("/v1/chat/completions"), Some(Route::Chat)));
        assert!(matches!(route("/v1/tools/x"), Some(Route::Tool("x"))));
        assert!(route("/v1/tools/").is_none());
        assert!(route("/v1/tools/a/b").is_none());
        assert!(matches!(route("/v1/mcp/s/t"), Some(Route::Mcp("s", "t"))));
        assert!(route("/v1/mcp/s").is_none());
        assert!(route("/v1/mcp/s/t/u").is_none());
        assert!(route("/v1/models").is_none());
    }
}
