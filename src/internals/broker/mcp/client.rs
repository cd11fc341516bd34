//! The broker's own MCP client: one session with one server, over stdio (a container's
//! attach stream or a host child's pipes) or streamable HTTP. It replaces rmcp's client,
//! whose service loop parsed every message whole into `serde_json::Value` trees on the
//! runtime's threads, up to 16 MiB a line or body (issue 43: 2.46 GB from one answer).
//!
//! Every message from the server goes through the bounded reader
//! ([`crate::broker::bounded`]): cut at the session's byte cap ([`Lines`] on stdio,
//! [`SseEvents`] or [`read_body`] over HTTP), its values counted, then read into the typed
//! shapes of [`super::wire`] on a blocking thread. A message past a cap closes a stdio
//! session (its stream cannot be read on) and fails an HTTP request. What the server sends
//! unasked (notifications, its own requests, answers to nothing) is dropped after its
//! envelope is read (a `ping` answered, any other request refused), and held to a rate:
//! past [`UNSOLICITED_BURST`] at once, refilled at [`UNSOLICITED_PER_SEC`], the session is
//! closed. The client keeps no timer: the pool bounds every request by the call's or the
//! start's deadline, which no parse can starve.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, CONTENT_TYPE};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::wire::{self, AnswerError, Expect, Incoming, Payload};
use crate::broker::bounded::{read_body, Caps, Lines, ReadError, SseEvents};

/// Unsolicited messages a session may send at once.
pub(crate) const UNSOLICITED_BURST: f64 = 100.0;
/// Unsolicited messages a session may send per second, on average.
pub(crate) const UNSOLICITED_PER_SEC: f64 = 20.0;
/// The bytes of one HTTP answer's event stream, in messages of the session's cap.
const SSE_MESSAGES: usize = 64;
/// The header of a streamable-HTTP session's id.
const SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
/// The header of the negotiated protocol version.
const PROTOCOL: HeaderName = HeaderName::from_static("mcp-protocol-version");
/// How long closing an HTTP session (its `DELETE`) or sending a cancellation may take.
const COURTESY: Duration = Duration::from_secs(2);

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ClientError {
    /// The server ended the session: its output ended or its input closed (a stdio
    /// server that exited or was killed); the next use starts anew.
    #[error("MCP server {0} stopped")]
    Stopped(String),
    /// The session is closed (the reason says by whom or why); the next use starts anew.
    #[error("{0}")]
    Closed(String),
    /// The server answered with a JSON-RPC error, or an answer of the wrong shape.
    #[error("{0}")]
    Answer(AnswerError),
    /// The HTTP exchange failed (the session may still be usable).
    #[error("{0}")]
    Http(String),
}

/// One session with a server.
pub(crate) struct Client {
    shared: Arc<Shared>,
    link: Link,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.shared.server)
            .finish_non_exhaustive()
    }
}

enum Link {
    /// The reader and writer tasks of a byte stream (aborted when the client is dropped).
    Stdio {
        outbox: mpsc::Sender<Vec<u8>>,
        _tasks: [AbortOnDropHandle<()>; 2],
    },
    /// A streamable-HTTP endpoint.
    Http(Box<HttpLink>),
}

struct HttpLink {
    client: reqwest::Client,
    url: reqwest::Url,
    headers: HeaderMap,
    /// The session's id and protocol version, once initialized.
    session: Mutex<HeaderMap>,
}

/// What the reader, the requests and their guards share.
struct Shared {
    server: String,
    caps: Caps,
    next_id: AtomicU64,
    pending: Mutex<Pending>,
    /// Fired when the session ends for any reason.
    closed: CancellationToken,
    unsolicited: Mutex<Bucket>,
}

type Waiter = oneshot::Sender<Result<Payload, ClientError>>;

#[derive(Default)]
struct Pending {
    waiting: HashMap<u64, (Expect, Waiter)>,
    /// Why the session ended, once it did.
    ended: Option<ClientError>,
}

/// A token bucket of unsolicited messages.
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new() -> Self {
        Self {
            tokens: UNSOLICITED_BURST,
            at: Instant::now(),
        }
    }

    fn take(&mut self) -> bool {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * UNSOLICITED_PER_SEC;
        self.tokens = (self.tokens + refill).min(UNSOLICITED_BURST);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl Shared {
    fn new(server: &str, caps: Caps) -> Arc<Self> {
        Arc::new(Self {
            server: server.to_owned(),
            caps,
            next_id: AtomicU64::new(1),
            pending: Mutex::default(),
            closed: CancellationToken::new(),
            unsolicited: Mutex::new(Bucket::new()),
        })
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the session: every request in flight fails with `why`, as does every later one.
    fn end(&self, why: ClientError) {
        let waiting = {
            let mut pending = self.pending();
            if pending.ended.is_some() {
                return;
            }
            pending.ended = Some(why.clone());
            std::mem::take(&mut pending.waiting)
        };
        tracing::debug!(server = %self.server, reason = %why, "MCP session ended");
        for (_, (_, tx)) in waiting {
            let _ = tx.send(Err(why.clone()));
        }
        self.closed.cancel();
    }

    /// Why the session ended (or that it did, if the reason is not known yet).
    fn ended(&self) -> ClientError {
        self.pending()
            .ended
            .clone()
            .unwrap_or_else(|| ClientError::Stopped(self.server.clone()))
    }

    /// Registers request `id`; its answer arrives on the receiver.
    fn register(
        &self,
        id: u64,
        expect: Expect,
    ) -> Result<oneshot::Receiver<Result<Payload, ClientError>>, ClientError> {
        let (tx, rx) = oneshot::channel();
        let mut pending = self.pending();
        if let Some(why) = &pending.ended {
            return Err(why.clone());
        }
        pending.waiting.insert(id, (expect, tx));
        Ok(rx)
    }

    fn expect_of(self: &Arc<Self>) -> impl FnOnce(u64) -> Option<Expect> + Send + 'static {
        let shared = self.clone();
        move |id| shared.pending().waiting.get(&id).map(|(e, _)| *e)
    }

    /// Counts an unsolicited message; false past the rate (the caller ends the session).
    fn unsolicited(&self) -> bool {
        self.unsolicited
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn flood(&self) -> ClientError {
        ClientError::Closed(format!(
            "MCP server {} sent more than {UNSOLICITED_BURST} messages it was not asked for; its session was stopped",
            self.server
        ))
    }

    fn over(&self, e: &ReadError) -> ClientError {
        ClientError::Closed(format!(
            "MCP server {} sent a message {e}; its session was stopped",
            self.server
        ))
    }

    /// Hands one message read from a stdio session to its request; what the server may
    /// have to be answered is returned. `Err`: the session must end.
    fn deliver(&self, incoming: Incoming) -> Result<Option<Vec<u8>>, ClientError> {
        match incoming {
            Incoming::Answer { id, outcome } => {
                if let Some((_, tx)) = self.pending().waiting.remove(&id) {
                    let _ = tx.send(outcome.map_err(ClientError::Answer));
                }
                Ok(None)
            }
            Incoming::Request { id, method } => {
                if !self.unsolicited() {
                    return Err(self.flood());
                }
                tracing::debug!(server = %self.server, %method, "MCP server request answered");
                Ok(wire::answer(&id, &method))
            }
            Incoming::Other => {
                if self.unsolicited() {
                    Ok(None)
                } else {
                    Err(self.flood())
                }
            }
        }
    }
}

/// Removes its request from the pending ones when dropped (answered or not); a call
/// dropped before its answer is cancelled (`notifications/cancelled`).
struct Guard<'a> {
    client: &'a Client,
    id: u64,
    cancel: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        let was_waiting = self
            .client
            .shared
            .pending()
            .waiting
            .remove(&self.id)
            .is_some();
        if was_waiting && self.cancel {
            let params = serde_json::json!({"requestId": self.id, "reason": "the call ended"});
            self.client
                .notify_detached(wire::notification("notifications/cancelled", &params));
        }
    }
}

impl Client {
    /// A session over a byte stream: `output` is what the server writes (its stdout),
    /// `input` what it reads. The reader and writer tasks live as long as the client.
    pub(crate) fn stdio(
        server: &str,
        caps: Caps,
        output: impl AsyncRead + Send + Unpin + 'static,
        input: Pin<Box<dyn AsyncWrite + Send>>,
    ) -> Self {
        let shared = Shared::new(server, caps);
        let (outbox, inbox) = mpsc::channel(16);
        let writer = tokio::spawn(write_loop(shared.clone(), input, inbox));
        let reader = tokio::spawn(read_loop(shared.clone(), output, outbox.clone()));
        Self {
            shared,
            link: Link::Stdio {
                outbox,
                _tasks: [
                    AbortOnDropHandle::new(reader),
                    AbortOnDropHandle::new(writer),
                ],
            },
        }
    }

    /// A session with a streamable-HTTP endpoint (`headers` sent with every request).
    pub(crate) fn http(
        server: &str,
        caps: Caps,
        client: reqwest::Client,
        url: reqwest::Url,
        headers: HeaderMap,
    ) -> Self {
        Self {
            shared: Shared::new(server, caps),
            link: Link::Http(Box::new(HttpLink {
                client,
                url,
                headers,
                session: Mutex::default(),
            })),
        }
    }

    /// Whether the session has ended (the next use starts a new one).
    pub(crate) fn is_closed(&self) -> bool {
        self.shared.closed.is_cancelled()
    }

    /// Resolves once the session has ended.
    pub(crate) fn closed(&self) -> CancellationToken {
        self.shared.closed.clone()
    }

    /// The MCP handshake: `initialize`, then `notifications/initialized`.
    pub(crate) async fn initialize(&self) -> Result<(), ClientError> {
        let version = match self
            .request("initialize", wire::initialize_params(), Expect::Initialize)
            .await?
        {
            Payload::Initialized(v) => v,
            _ => unreachable!("read as expected"),
        };
        if let Link::Http(link) = &self.link {
            let value = HeaderValue::from_str(&version).expect("a known version");
            link.session().insert(PROTOCOL, value);
        }
        self.notify(wire::notification(
            "notifications/initialized",
            &serde_json::json!({}),
        ))
        .await
    }

    /// The server's tools of `wanted` (its allow-list), page by page (at most
    /// `max_pages`): only theirs kept and their schemas parsed.
    pub(crate) async fn list_tools(
        &self,
        max_pages: usize,
        wanted: &[String],
    ) -> Result<std::collections::BTreeMap<String, (String, serde_json::Value)>, ClientError> {
        let mut all = std::collections::BTreeMap::new();
        let mut cursor: Option<String> = None;
        for _ in 0..max_pages {
            let params = match &cursor {
                Some(c) => serde_json::json!({ "cursor": c }),
                None => serde_json::json!({}),
            };
            let Payload::Tools(page) = self.request("tools/list", params, Expect::Tools).await?
            else {
                unreachable!("read as expected")
            };
            cursor = page.next_cursor.clone();
            all.extend(
                page.into_map(wanted)
                    .map_err(|e| ClientError::Answer(AnswerError::Shape(e)))?,
            );
            if cursor.is_none() {
                return Ok(all);
            }
        }
        Err(ClientError::Http(format!(
            "MCP server {} lists its tools in more than {max_pages} pages",
            self.shared.server
        )))
    }

    /// Calls a tool; dropping the future cancels the call (`notifications/cancelled`).
    pub(crate) async fn call_tool(
        &self,
        name: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        meta: serde_json::Map<String, serde_json::Value>,
    ) -> Result<wire::CallResult, ClientError> {
        let params = serde_json::json!({"name": name, "arguments": arguments, "_meta": meta});
        match self.request("tools/call", params, Expect::Call).await? {
            Payload::Called(r) => Ok(r),
            _ => unreachable!("read as expected"),
        }
    }

    async fn request(
        &self,
        method: &str,
        params: serde_json::Value,
        expect: Expect,
    ) -> Result<Payload, ClientError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let bytes = wire::request(id, method, &params);
        drop(params);
        match &self.link {
            Link::Stdio { outbox, .. } => {
                let rx = self.shared.register(id, expect)?;
                let _guard = Guard {
                    client: self,
                    id,
                    cancel: expect == Expect::Call,
                };
                if outbox.send(bytes).await.is_err() {
                    return Err(self.shared.ended());
                }
                rx.await.unwrap_or_else(|_| Err(self.shared.ended()))
            }
            Link::Http(link) => {
                let mut guard = HttpGuard {
                    client: self,
                    id,
                    armed: expect == Expect::Call,
                };
                let answer = link.exchange(&self.shared, id, expect, bytes).await;
                guard.armed = false;
                answer
            }
        }
    }

    /// Sends a notification (stdio: queued in order; HTTP: posted, `202` expected).
    async fn notify(&self, bytes: Vec<u8>) -> Result<(), ClientError> {
        match &self.link {
            Link::Stdio { outbox, .. } => outbox.send(bytes).await.map_err(|_| self.shared.ended()),
            Link::Http(link) => link.post_notification(&self.shared, bytes).await,
        }
    }

    /// Sends a notification without waiting (from a drop): best effort.
    fn notify_detached(&self, bytes: Vec<u8>) {
        match &self.link {
            Link::Stdio { outbox, .. } => {
                let _ = outbox.try_send(bytes);
            }
            Link::Http(link) => {
                let Ok(handle) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                let request = link.post(bytes);
                handle.spawn(async move {
                    let _ = tokio::time::timeout(COURTESY, request.send()).await;
                });
            }
        }
    }

    /// Ends the session: a stdio server's input closed (its writer stops; its reader with
    /// the client); an HTTP session deleted (best effort, within 2 s).
    pub(crate) async fn close(&self) {
        self.shared.end(ClientError::Closed(format!(
            "MCP server {}: the session was closed",
            self.shared.server
        )));
        if let Link::Http(link) = &self.link {
            let session = link.session().get(SESSION_ID).cloned();
            if let Some(id) = session {
                let request = link
                    .client
                    .delete(link.url.clone())
                    .headers(link.headers.clone())
                    .header(SESSION_ID, id);
                let _ = tokio::time::timeout(COURTESY, request.send()).await;
            }
        }
    }
}

/// An HTTP call dropped before its answer is cancelled.
struct HttpGuard<'a> {
    client: &'a Client,
    id: u64,
    armed: bool,
}

impl Drop for HttpGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let params = serde_json::json!({"requestId": self.id, "reason": "the call ended"});
            self.client
                .notify_detached(wire::notification("notifications/cancelled", &params));
        }
    }
}

/// Writes queued messages to the server's input in order; its end closes that input.
async fn write_loop(
    shared: Arc<Shared>,
    mut input: Pin<Box<dyn AsyncWrite + Send>>,
    mut inbox: mpsc::Receiver<Vec<u8>>,
) {
    loop {
        let bytes = tokio::select! {
            biased;
            _ = shared.closed.cancelled() => break,
            next = inbox.recv() => match next {
                Some(bytes) => bytes,
                None => break,
            },
        };
        let written = async {
            input.write_all(&bytes).await?;
            input.flush().await
        };
        let written = tokio::select! {
            r = written => r,
            _ = shared.closed.cancelled() => break,
        };
        if written.is_err() {
            shared.end(ClientError::Stopped(shared.server.clone()));
            return;
        }
    }
    // The server's input closed: a stdio server exits at its end.
    let _ = tokio::time::timeout(COURTESY, input.shutdown()).await;
}

/// Reads the server's output: lines cut at the cap, each read off the async threads and
/// handed to its request. Ends the session at the end of the output, at a line past the
/// caps, or past the rate of unsolicited messages.
async fn read_loop(
    shared: Arc<Shared>,
    mut output: impl AsyncRead + Send + Unpin,
    outbox: mpsc::Sender<Vec<u8>>,
) {
    let mut lines = Lines::new(shared.caps.bytes);
    let mut buf = vec![0u8; 16 * 1024];
    let why = 'read: loop {
        let n = match output.read(&mut buf).await {
            Ok(0) | Err(_) => break ClientError::Stopped(shared.server.clone()),
            Ok(n) => n,
        };
        let got = match lines.push(&buf[..n]) {
            Ok(got) => got,
            Err(e) => break shared.over(&e),
        };
        for line in got {
            let incoming = match wire::read(line, shared.caps, shared.expect_of()).await {
                Ok(i) => i,
                // Not JSON-RPC: unsolicited, as far as the client can tell.
                Err(ReadError::Shape { .. }) => Incoming::Other,
                Err(e) => break 'read shared.over(&e),
            };
            match shared.deliver(incoming) {
                Ok(Some(answer)) => {
                    let _ = outbox.try_send(answer);
                }
                Ok(None) => {}
                Err(why) => break 'read why,
            }
        }
    };
    shared.end(why);
}

impl HttpLink {
    fn session(&self) -> std::sync::MutexGuard<'_, HeaderMap> {
        self.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn post(&self, body: Vec<u8>) -> reqwest::RequestBuilder {
        self.client
            .post(self.url.clone())
            .headers(self.headers.clone())
            .headers(self.session().clone())
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "application/json, text/event-stream")
            .body(body)
    }

    async fn post_notification(&self, shared: &Shared, body: Vec<u8>) -> Result<(), ClientError> {
        let mut response = self
            .post(body)
            .send()
            .await
            .map_err(|e| self.failed(shared, &e))?;
        let status = response.status();
        // Whatever it says is read within the cap, and not kept.
        let _ = read_body(&mut response, shared.caps.bytes).await;
        if status.is_success() {
            Ok(())
        } else {
            Err(ClientError::Http(format!(
                "MCP server {} answered a notification with HTTP {}",
                shared.server,
                status.as_u16()
            )))
        }
    }

    fn failed(&self, shared: &Shared, e: &reqwest::Error) -> ClientError {
        tracing::debug!(server = %shared.server, connect = e.is_connect(), timeout = e.is_timeout(), "MCP http request failed");
        if e.is_connect() {
            let why = ClientError::Closed(format!("MCP server {} is unreachable", shared.server));
            shared.end(why.clone());
            why
        } else {
            ClientError::Http(format!("MCP server {}: the request failed", shared.server))
        }
    }

    /// Posts one request and reads its answer: a JSON body, or an event stream up to the
    /// answer (other messages in it counted as unsolicited and dropped).
    async fn exchange(
        &self,
        shared: &Arc<Shared>,
        id: u64,
        expect: Expect,
        body: Vec<u8>,
    ) -> Result<Payload, ClientError> {
        if let Some(why) = &shared.pending().ended {
            return Err(why.clone());
        }
        let response = self
            .post(body)
            .send()
            .await
            .map_err(|e| self.failed(shared, &e))?;
        let status = response.status();
        if status == reqwest::StatusCode::NOT_FOUND && self.session().contains_key(SESSION_ID) {
            let why =
                ClientError::Closed(format!("MCP server {} ended the session", shared.server));
            shared.end(why.clone());
            return Err(why);
        }
        if !status.is_success() {
            return Err(ClientError::Http(format!(
                "MCP server {} answered HTTP {}",
                shared.server,
                status.as_u16()
            )));
        }
        if let Some(session) = response.headers().get(SESSION_ID).cloned() {
            self.session().insert(SESSION_ID, session);
        }
        let event_stream = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if event_stream {
            self.read_stream(shared, response, id, expect).await
        } else {
            Self::read_json(shared, response, id, expect).await
        }
    }

    /// The answer in a JSON body.
    async fn read_json(
        shared: &Shared,
        mut response: reqwest::Response,
        id: u64,
        expect: Expect,
    ) -> Result<Payload, ClientError> {
        let expect_id = move |got: u64| (got == id).then_some(expect);
        let http_err = sent_badly(&shared.server);
        let bytes = read_body(&mut response, shared.caps.bytes)
            .await
            .map_err(http_err)?;
        match wire::read(bytes, shared.caps, expect_id)
            .await
            .map_err(http_err)?
        {
            Incoming::Answer { outcome, .. } => outcome.map_err(ClientError::Answer),
            _ => Err(ClientError::Http(format!(
                "MCP server {} did not answer the request",
                shared.server
            ))),
        }
    }

    /// The answer in an event stream, read up to it (other messages in it counted as
    /// unsolicited and dropped; a server's own request answered with a courtesy).
    async fn read_stream(
        &self,
        shared: &Arc<Shared>,
        mut response: reqwest::Response,
        id: u64,
        expect: Expect,
    ) -> Result<Payload, ClientError> {
        let expect_id = move |got: u64| (got == id).then_some(expect);
        let http_err = sent_badly(&shared.server);
        let mut events = SseEvents::new(shared.caps.bytes);
        let mut total = 0usize;
        let cap = shared.caps.bytes.saturating_mul(SSE_MESSAGES);
        loop {
            let chunk = response
                .chunk()
                .await
                .map_err(|e| self.failed(shared, &e))?;
            let (got, end) = match chunk {
                Some(chunk) => {
                    total += chunk.len();
                    if total > cap {
                        return Err(http_err(ReadError::TooLarge { cap }));
                    }
                    (events.push(&chunk).map_err(http_err)?, false)
                }
                None => (events.finish().into_iter().collect(), true),
            };
            for event in got {
                match wire::read(event, shared.caps, expect_id)
                    .await
                    .map_err(http_err)?
                {
                    Incoming::Answer { outcome, .. } => {
                        return outcome.map_err(ClientError::Answer)
                    }
                    Incoming::Request { id, method } if shared.unsolicited() => {
                        if let Some(answer) = wire::answer(&id, &method) {
                            let answer = self.post(answer);
                            tokio::spawn(async move {
                                let _ = tokio::time::timeout(COURTESY, answer.send()).await;
                            });
                        }
                    }
                    Incoming::Other if shared.unsolicited() => {}
                    _ => {
                        let why = shared.flood();
                        shared.end(why.clone());
                        return Err(why);
                    }
                }
            }
            if end {
                return Err(ClientError::Http(format!(
                    "MCP server {} ended its event stream without the answer",
                    shared.server
                )));
            }
        }
    }
}

/// A message of MCP server `server` that could not be read, as the call's error.
fn sent_badly(server: &str) -> impl Fn(ReadError) -> ClientError + Copy + '_ {
    move |e| ClientError::Http(format!("MCP server {server} sent a message {e}"))
}
