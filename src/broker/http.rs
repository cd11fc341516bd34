//! What the broker's routes share, below the server that dispatches to them: the body and
//! response types, the JSON answers (every refusal is `{"error": "..."}`), and one turn's
//! state as its connections see it.

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
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::{Broker, TurnContext};

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
    /// One permit per call being served (compactions included).
    pub(super) in_flight: Arc<Semaphore>,
    /// One permit: the compaction being served.
    pub(super) compacting: Arc<Semaphore>,
    /// The compactor's warn lines, rate-limited.
    pub(super) warnings: super::compact::Warnings,
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
