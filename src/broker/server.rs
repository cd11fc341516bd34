//! The per-turn HTTP/1.1 server on the unix socket.
//!
//! - [`serve`]: the accept loop: the peer check (SO_PEERCRED uid must be the worker uid),
//!   a cap on open connections, one task per connection in a `JoinSet` (so stopping the
//!   listener aborts them all), a header read timeout so a slow client blocks nothing;
//! - [`handle`]: routing, method check, body size cap (`413`), body read deadline, JSON
//!   parsing (`400`), per-turn call counts (`429`), then the model proxy, a host tool or
//!   an MCP tool;
//! - [`error_response`] / [`json_response`]: every refusal is `{"error": "..."}`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{ACCEPT, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use roundtable_sandbox_protocol::{paths, ErrorBody};
use serde::Serialize;
use tokio::net::UnixListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Broker, TurnContext};

/// The response body type of the broker.
pub(crate) type Body = UnsyncBoxBody<Bytes, std::io::Error>;
/// A broker response.
pub(crate) type Response = hyper::Response<Body>;

/// How long a client may take to send a request head.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Open connections per turn; more are closed at once.
const MAX_CONNECTIONS: usize = 64;
/// Largest request head.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// One turn's state shared by its connections.
struct Turn {
    broker: Arc<Broker>,
    ctx: TurnContext,
    stop: CancellationToken,
    model_calls: AtomicU32,
    tool_calls: AtomicU32,
}

/// Accepts connections until `stop` fires; dropping this future aborts every connection.
pub(crate) async fn serve(
    broker: Arc<Broker>,
    listener: UnixListener,
    ctx: TurnContext,
    stop: CancellationToken,
) {
    let worker_uid = broker.policy.worker_uid;
    let check_uid = broker.policy.peer_uid_check;
    let turn = Arc::new(Turn {
        broker,
        ctx,
        stop: stop.clone(),
        model_calls: AtomicU32::new(0),
        tool_calls: AtomicU32::new(0),
    });
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "broker accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match stream.peer_cred() {
            Ok(cred) if !check_uid || cred.uid() == worker_uid => {}
            Ok(cred) => {
                tracing::warn!(peer_uid = cred.uid(), worker_uid, "broker refused a peer");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "broker could not read the peer's credentials");
                continue;
            }
        }
        if connections.len() >= MAX_CONNECTIONS {
            tracing::warn!("broker connection limit reached");
            continue;
        }
        let turn = turn.clone();
        connections.spawn(async move {
            let service_turn = turn.clone();
            let service = hyper::service::service_fn(move |req| {
                let turn = service_turn.clone();
                async move { Ok::<_, Infallible>(handle(&turn, req).await) }
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
                    }
                }
                // The turn ended: in-flight calls (upstream requests, MCP calls) are dropped.
                _ = turn.stop.cancelled() => {}
            }
        });
    }
    connections.shutdown().await;
}

/// A body of bytes.
pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// A JSON answer.
pub(crate) fn json_response(status: StatusCode, value: &impl Serialize) -> Response {
    hyper::Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(full(serde_json::to_vec(value).expect("serialisable")))
        .expect("a valid response")
}

/// A refusal: `{"error": msg}`.
pub(crate) fn error_response(status: StatusCode, msg: &str) -> Response {
    json_response(
        status,
        &ErrorBody {
            error: msg.to_owned(),
        },
    )
}

/// A name from the path, shortened for an error message.
fn shown(name: &str) -> String {
    name.chars().take(64).collect()
}

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

async fn handle(turn: &Turn, req: Request<Incoming>) -> Response {
    let limits = turn.broker.policy.limits;
    let path = req.uri().path().to_owned();
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
    match route {
        Route::Chat => {}
        Route::Tool(name) => {
            if !turn.broker.tools.contains(name) {
                return error_response(
                    StatusCode::NOT_FOUND,
                    &format!("unknown tool: {}", shown(name)),
                );
            }
        }
        Route::Mcp(server, tool) => {
            if !turn.broker.mcp.allowed(server, tool) {
                return error_response(
                    StatusCode::NOT_FOUND,
                    &format!("unknown MCP tool: {}/{}", shown(server), shown(tool)),
                );
            }
        }
    }
    let too_large = || {
        error_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!(
                "request body too large (limit {} bytes)",
                limits.max_request_bytes
            ),
        )
    };
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_request_bytes as u64) {
        return too_large();
    }
    // Count the call before any work is done for it.
    let (counter, max, what) = match route {
        Route::Chat => (&turn.model_calls, limits.max_model_calls, "model"),
        _ => (&turn.tool_calls, limits.max_tool_calls, "tool"),
    };
    if counter.fetch_add(1, Ordering::SeqCst) >= max {
        return error_response(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("too many {what} calls in this turn (limit {max})"),
        );
    }
    let accept = req
        .headers()
        .get(ACCEPT)
        .filter(|v| v.len() <= 256)
        .cloned();
    let body = Limited::new(req.into_body(), limits.max_request_bytes).collect();
    let body = match tokio::time::timeout(limits.call_timeout, body).await {
        Err(_) => {
            return error_response(
                StatusCode::REQUEST_TIMEOUT,
                "request body not received in time",
            )
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
        Ok(Err(_)) => return error_response(StatusCode::BAD_REQUEST, "request body unreadable"),
        Ok(Ok(b)) => b.to_bytes(),
    };
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
    if let Some(events) = &turn.ctx.events {
        events(match route {
            Route::Chat => super::BrokerEvent::ModelCall,
            Route::Tool(_) | Route::Mcp(..) => super::BrokerEvent::ToolCall,
        });
    }
    match route {
        Route::Chat => {
            tracing::debug!("model call");
            turn.broker
                .upstream
                .chat(object, accept, turn.stop.clone())
                .await
        }
        Route::Tool(name) => {
            tracing::debug!(tool = name, "host tool call");
            turn.broker
                .tools
                .call(name, object, &turn.ctx, &turn.stop, &turn.broker.policy)
                .await
        }
        Route::Mcp(server, tool) => {
            tracing::debug!(server, tool, "MCP tool call");
            turn.broker
                .mcp
                .call(
                    server,
                    tool,
                    object,
                    &turn.ctx,
                    &turn.stop,
                    &turn.broker.policy,
                )
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
