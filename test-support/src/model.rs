//! A scripted OpenAI-compatible model server on loopback, for tests.
//!
//! ```ignore
//! use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
//!
//! let model = ScriptedModel::start(vec![Step::text("hello")]).await;
//! // configure model_url = model.url()  (e.g. "http://127.0.0.1:PORT/v1", allow_http = true)
//! // ... after the calls:
//! let reqs = model.requests();
//! assert_eq!(reqs[0].path, "/v1/chat/completions");
//! ```
//!
//! Each request (any method, any path) is recorded, then answered by the next [`Step`] of
//! the script; once the script is used up every request gets `500 script exhausted`.
//! Parts: [`Step`] (what to answer, with helpers for completions, tool calls and SSE
//! streams), [`Recorded`] (a request as received), [`ScriptedModel`] (the server).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use tokio::sync::{mpsc, Notify};

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Step {
    /// `200` with this JSON body.
    Json(serde_json::Value),
    /// This status with this raw body (`application/json` content type).
    Status(u16, String),
    /// `200 text/event-stream`: each string sent as its own chunk, `delay` before each.
    Stream {
        chunks: Vec<String>,
        delay: Duration,
    },
    /// Sends `first`, waits until `gate` is notified, then sends `rest`.
    Gated {
        first: Vec<String>,
        gate: Arc<Notify>,
        rest: Vec<String>,
    },
    /// Never answers; the request stays open until the client goes away.
    Hang,
    /// `200` completion whose content is the `Authorization` header received (a leaky upstream).
    EchoKey,
    /// As [`Step::EchoKey`], after this many bytes of `x` (so a cut can fall in the key).
    EchoKeyAfter(usize),
    /// This status with the `Authorization` header received in an error body.
    EchoKeyError(u16),
    /// A stream carrying the `Authorization` header split across two chunks.
    EchoKeyStream,
    /// `200 text/event-stream`: these chunks, then the connection is cut mid-body.
    StreamThenFail(Vec<String>),
    /// `200` completion whose content is `n` bytes of `x` (a huge answer, e.g. 4 MB).
    Huge(usize),
    /// Waits this long, then answers with the step.
    Delayed(Duration, Box<Step>),
}

impl Step {
    /// A chat completion answering `content`.
    pub fn text(content: &str) -> Step {
        Step::Json(completion(
            serde_json::json!({"role": "assistant", "content": content}),
        ))
    }

    /// A chat completion calling one tool with `arguments` (serialised into the call).
    pub fn tool_call(id: &str, name: &str, arguments: serde_json::Value) -> Step {
        Step::Json(completion(serde_json::json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": arguments.to_string()}
            }]
        })))
    }

    /// `step` answered after `delay` (the request counts as in flight meanwhile).
    pub fn delayed(delay: Duration, step: Step) -> Step {
        Step::Delayed(delay, Box::new(step))
    }

    /// A streamed completion: one SSE event per part, then `[DONE]`.
    pub fn stream_text(parts: &[&str], delay: Duration) -> Step {
        Step::Stream {
            chunks: sse_text_events(parts),
            delay,
        }
    }
}

/// The SSE events of a streamed text answer, `[DONE]` included.
pub fn sse_text_events(parts: &[&str]) -> Vec<String> {
    let mut events: Vec<String> = parts
        .iter()
        .map(|p| {
            let chunk = serde_json::json!({
                "id": "chatcmpl-scripted",
                "object": "chat.completion.chunk",
                "model": "scripted",
                "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": null}]
            });
            format!("data: {chunk}\n\n")
        })
        .collect();
    events.push("data: [DONE]\n\n".to_owned());
    events
}

fn completion(message: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    })
}

/// A request as the scripted server received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// Every header line, name lower-cased, in order (repeats kept).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Recorded {
    /// Every value of the header `name` (case-insensitive).
    pub fn header_values(&self, name: &str) -> Vec<String> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The body as JSON (panics if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("the recorded body is JSON")
    }
}

#[derive(Debug)]
struct Shared {
    steps: Mutex<VecDeque<Step>>,
    requests: Mutex<Vec<Recorded>>,
    /// Requests being answered now, and the most there ever were at once.
    in_flight: Mutex<(usize, usize)>,
}

/// Counts a request as in flight until dropped (an abandoned request included).
struct InFlight<'a>(&'a Shared);

impl<'a> InFlight<'a> {
    fn new(shared: &'a Shared) -> Self {
        let mut n = shared.in_flight.lock().unwrap();
        n.0 += 1;
        n.1 = n.1.max(n.0);
        Self(shared)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.lock().unwrap().0 -= 1;
    }
}

/// The scripted server; stops when dropped.
#[derive(Debug)]
pub struct ScriptedModel {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptedModel {
    /// Starts on `127.0.0.1` with an ephemeral port.
    pub async fn start(script: Vec<Step>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            steps: Mutex::new(script.into()),
            requests: Mutex::new(Vec::new()),
            in_flight: Mutex::new((0, 0)),
        });
        let accept_shared = shared.clone();
        let task = crate::http::serve(listener, move |req| {
            let shared = accept_shared.clone();
            async move { answer(&shared, req).await }
        });
        Self { addr, shared, task }
    }

    /// The API base to configure as `model_url`: `http://127.0.0.1:PORT/v1`.
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The socket address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The requests received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// The most requests that were being answered at once so far.
    pub fn peak_in_flight(&self) -> usize {
        self.shared.in_flight.lock().unwrap().1
    }

    /// Appends a step to the script.
    pub fn push(&self, step: Step) {
        self.shared.steps.lock().unwrap().push_back(step);
    }
}

impl Drop for ScriptedModel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

fn full(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(
            Full::new(body.into())
                .map_err(|never: Infallible| match never {})
                .boxed(),
        )
        .unwrap()
}

/// A body whose chunks come from a channel (each sent as it arrives).
fn channel_body() -> (mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::io::Error>(Frame::data(b)), rx))
    });
    (tx, StreamBody::new(stream).boxed())
}

fn sse(body: Body) -> Response<Body> {
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .body(body)
        .unwrap()
}

async fn answer(shared: &Shared, req: Request<Incoming>) -> Response<Body> {
    let _in_flight = InFlight::new(shared);
    let method = req.method().to_string();
    let path = req.uri().path().to_owned();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(n, v)| {
            (
                n.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let auth = headers
        .iter()
        .find(|(n, _)| n == "authorization")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let body = crate::http::body(req).await.to_vec();
    shared.requests.lock().unwrap().push(Recorded {
        method,
        path,
        headers,
        body,
    });
    let mut step = shared.steps.lock().unwrap().pop_front();
    while let Some(Step::Delayed(delay, inner)) = step {
        tokio::time::sleep(delay).await;
        step = Some(*inner);
    }
    match step {
        None => full(500, "application/json", r#"{"error":"script exhausted"}"#),
        Some(Step::Json(v)) => full(200, "application/json", v.to_string()),
        Some(Step::Status(code, body)) => full(code, "application/json", body),
        Some(Step::Stream { chunks, delay }) => {
            let (tx, body) = channel_body();
            tokio::spawn(async move {
                for c in chunks {
                    tokio::time::sleep(delay).await;
                    if tx.send(Bytes::from(c)).await.is_err() {
                        return;
                    }
                }
            });
            sse(body)
        }
        Some(Step::Gated { first, gate, rest }) => {
            let (tx, body) = channel_body();
            tokio::spawn(async move {
                for c in first {
                    if tx.send(Bytes::from(c)).await.is_err() {
                        return;
                    }
                }
                gate.notified().await;
                for c in rest {
                    if tx.send(Bytes::from(c)).await.is_err() {
                        return;
                    }
                }
            });
            sse(body)
        }
        Some(Step::Hang) => {
            std::future::pending::<()>().await;
            unreachable!()
        }
        Some(Step::EchoKey) => {
            let v = completion(serde_json::json!({
                "role": "assistant",
                "content": format!("I saw {auth}")
            }));
            full(200, "application/json", v.to_string())
        }
        Some(Step::EchoKeyAfter(n)) => {
            let v = completion(serde_json::json!({
                "role": "assistant",
                "content": format!("{}I saw {auth}", "x".repeat(n))
            }));
            full(200, "application/json", v.to_string())
        }
        Some(Step::EchoKeyError(code)) => full(
            code,
            "application/json",
            serde_json::json!({"error": {"message": format!("bad key: {auth}")}}).to_string(),
        ),
        Some(Step::StreamThenFail(chunks)) => {
            let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(16);
            tokio::spawn(async move {
                for c in chunks {
                    if tx.send(Ok(Bytes::from(c))).await.is_err() {
                        return;
                    }
                }
                // Let the chunks reach the client before the cut.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = tx.send(Err(std::io::Error::other("cut"))).await;
            });
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|r| (r.map(Frame::data), rx))
            });
            sse(StreamBody::new(stream).boxed())
        }
        Some(Step::Huge(n)) => {
            let v = completion(serde_json::json!({"role": "assistant", "content": "x".repeat(n)}));
            full(200, "application/json", v.to_string())
        }
        Some(Step::Delayed(..)) => unreachable!("unwrapped above"),
        Some(Step::EchoKeyStream) => {
            let mid = auth.len() / 2 + 3;
            let (a, b) = auth.split_at(mid.min(auth.len()));
            let chunks = vec![
                format!("data: {{\"leak\":\"{a}"),
                format!("{b}\"}}\n\n"),
                "data: [DONE]\n\n".to_owned(),
            ];
            let (tx, body) = channel_body();
            tokio::spawn(async move {
                for c in chunks {
                    if tx.send(Bytes::from(c)).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
            sse(body)
        }
    }
}
