//! What the broker's routes share, below the server that dispatches to them: the body and
//! response types, the JSON answers (every refusal is `{"error": "..."}`), one turn's state
//! as its connections see it, and a body that holds its call's permit.

use std::convert::Infallible;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::CONTENT_TYPE;
use hyper::StatusCode;
use roundtable_sandbox_protocol::ErrorBody;
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::{Broker, TurnContext};
use crate::events::Refusal;

/// The response body type of the broker.
pub(crate) type Body = UnsyncBoxBody<Bytes, std::io::Error>;
/// A broker response.
pub(crate) type Response = hyper::Response<Body>;

/// One turn's state shared by its connections.
pub(super) struct Turn {
    pub(super) broker: Arc<Broker>,
    pub(super) ctx: TurnContext,
    pub(super) stop: CancellationToken,
    pub(super) model_calls: AtomicU32,
    pub(super) tool_calls: AtomicU32,
    /// Compactions asked for (`max_compactions`).
    pub(super) compactions: AtomicU32,
    /// Compactions this turn refused `429` (past [`FREE_REFUSALS`], each answered after
    /// [`REFUSAL_PAUSE`]).
    pub(super) compaction_refusals: AtomicU32,
    /// Egress requests this turn refused (`403` by a rule, `429`), paced the same way.
    pub(super) egress_refusals: AtomicU32,
    /// Connections this turn refused past `max_connections` (`503`), paced the same way.
    pub(super) connection_refusals: AtomicU32,
    /// One permit per call being served (compactions included).
    pub(super) in_flight: Arc<Semaphore>,
    /// One permit: the compaction being served.
    pub(super) compacting: Arc<Semaphore>,
    /// The compactor's warn lines, rate-limited.
    pub(super) warnings: super::warn::Warnings,
    /// What the turn has used of each egress route.
    pub(super) egress: super::egress::used::TurnEgress,
}

/// The refusals of one kind a turn is answered at once; each later one is answered after
/// [`REFUSAL_PAUSE`]. An agent asks again only after its request failed, so a flood of
/// retries is an attacker's: paused, each of its (at most `max_connections`) connections
/// costs the host at most 40 refusals a second, not thousands (the bench's hostile
/// compaction and egress attacks).
pub const FREE_REFUSALS: u32 = 16;
/// How long a refusal past [`FREE_REFUSALS`] waits for its answer, holding nothing of the
/// turn's but its connection (its permits are released first).
pub const REFUSAL_PAUSE: std::time::Duration = std::time::Duration::from_millis(25);

/// Counts one refusal in `refusals` now; the wait before it is answered: past the turn's
/// first [`FREE_REFUSALS`] of its kind, [`REFUSAL_PAUSE`] (or until the turn stops). The
/// wait borrows nothing of the turn's (a refused connection's task holds only its token).
pub(super) fn pace_refusal(
    stop: &CancellationToken,
    refusals: &AtomicU32,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let paced = refusals.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= FREE_REFUSALS;
    let stop = stop.clone();
    async move {
        if paced {
            tokio::select! {
                _ = tokio::time::sleep(REFUSAL_PAUSE) => {}
                _ = stop.cancelled() => {}
            }
        }
    }
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

/// A refusal: `{"error": msg}`, marked as the broker's own refusal of the kind its status
/// names (see [`refuse`] for one of a named limit).
pub(crate) fn error_response(status: StatusCode, msg: &str) -> Response {
    let limit = match status {
        StatusCode::NOT_FOUND => Refusal::UnknownRoute,
        StatusCode::METHOD_NOT_ALLOWED => Refusal::Method,
        StatusCode::PAYLOAD_TOO_LARGE => Refusal::RequestBytes,
        StatusCode::SERVICE_UNAVAILABLE => Refusal::Cancelled,
        StatusCode::REQUEST_TIMEOUT => Refusal::BodyTimeout,
        s if s.is_client_error() => Refusal::Malformed,
        _ => Refusal::Internal,
    };
    refuse(status, limit, msg)
}

/// A refusal by `limit`: `{"error": msg}`, marked ([`Refused`]) so the server reports it as
/// one [`BrokerEvent::Refused`](crate::events::BrokerEvent::Refused).
pub(crate) fn refuse(status: StatusCode, limit: Refusal, msg: &str) -> Response {
    let mut response = failure(status, msg);
    response.extensions_mut().insert(Refused(limit));
    response
}

/// A failure of the call itself (a tool that failed or timed out): `{"error": msg}`, not a
/// refusal.
pub(crate) fn failure(status: StatusCode, msg: &str) -> Response {
    let mut response = json_response(
        status,
        &ErrorBody {
            error: msg.to_owned(),
        },
    );
    response.headers_mut().insert(
        roundtable_sandbox_protocol::egress::BROKER_HEADER,
        hyper::header::HeaderValue::from_static("1"),
    );
    response
}

/// The mark of a broker refusal on its response: the limit that refused.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refused(pub(crate) Refusal);

/// A body that holds its call's in-flight permit until it is sent or dropped.
struct Holding {
    body: Body,
    _permit: OwnedSemaphorePermit,
}

impl hyper::body::Body for Holding {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The response with the call's permit moved into its body.
pub(super) fn holding(response: Response, permit: OwnedSemaphorePermit) -> Response {
    response.map(|body| {
        Holding {
            body,
            _permit: permit,
        }
        .boxed_unsync()
    })
}
