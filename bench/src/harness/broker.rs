//! The broker: a model call through the turn's unix socket against the same call straight
//! to the scripted model on loopback.
//!
//! The client is the guest's own (`roundtable-sandbox-guest-http`, blocking, run off the
//! async runtime): one request per connection, `Connection: close`, the whole answer read
//! and parsed. The scripted model answers a fixed
//! completion, or for `"stream": true` one SSE event at once and the rest after
//! [`STREAM_GAP`] (so the first streamed byte is distinct from the end).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use roundtable_sandbox::events::{EventKind, TurnEvents};
use roundtable_sandbox::internals::audit::AuditTrail;
use roundtable_sandbox::internals::broker::Broker;
use roundtable_sandbox::internals::broker::{BrokerListener, BrokerPolicy, TurnContext};
use roundtable_sandbox::internals::budgets::{BudgetBook, TurnAccount};
use roundtable_sandbox::internals::config::BrokerLimits;
use roundtable_sandbox::internals::testing::broker_policy;
use roundtable_sandbox::protocol::paths::CHAT_COMPLETIONS;
use roundtable_sandbox::protocol::Speaker;
use roundtable_sandbox::TurnPhase;
use roundtable_sandbox_guest_http as http;
use std::io::{Read, Write};
use tokio_util::sync::CancellationToken;

/// Gap between the first streamed event and the rest.
pub const STREAM_GAP: Duration = Duration::from_millis(5);

const COMPLETION: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"hello from the scripted model"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":6,"total_tokens":18}}"#;

fn sse_event(text: &str) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n"
    )
}

/// Budgets far from reached (the accounting runs, nothing is refused) kept in `state_file`.
pub fn unreached_budgets(state_file: PathBuf) -> roundtable_sandbox::BudgetSettings {
    roundtable_sandbox::BudgetSettings {
        state_file: Some(state_file),
        speaker_tokens_per_day: Some(1_000_000_000_000),
        channel_tokens_per_day: Some(1_000_000_000_000),
        bot_tokens_per_day: Some(1_000_000_000_000),
        speaker_turns_per_minute: None,
        ..Default::default()
    }
}

/// The budgets' book of [`unreached_budgets`] in `state_file` (UTC days).
pub fn unreached_book(state_file: PathBuf) -> Result<Arc<BudgetBook>> {
    BudgetBook::open(&unreached_budgets(state_file), "UTC")?.context("a state file is named")
}

/// The scripted model: every request gets the same answer.
pub struct Model {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Model {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn answer(req: hyper::Request<hyper::body::Incoming>) -> hyper::Response<Body> {
    let body = roundtable_sandbox_test_support::http::body(req).await;
    let stream = contains(&body, b"\"stream\":true");
    if !stream {
        return hyper::Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(COMPLETION.as_bytes())).boxed())
            .expect("a response");
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    tokio::spawn(async move {
        let _ = tx.send(Bytes::from(sse_event("hel"))).await;
        tokio::time::sleep(STREAM_GAP).await;
        let _ = tx.send(Bytes::from(sse_event("lo"))).await;
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    hyper::Response::builder()
        .header("content-type", "text/event-stream")
        .body(StreamBody::new(frames).boxed())
        .expect("a response")
}

impl Model {
    pub async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = roundtable_sandbox_test_support::http::serve(listener, answer);
        Ok(Self { addr, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

/// A broker with the scripted model as its upstream, listening for one long "turn".
pub struct BrokerUnderTest {
    broker: Arc<Broker>,
    dir: tempfile::TempDir,
    n: u32,
    /// Accounting on: each "turn" counted and checked against these budgets.
    book: Option<Arc<BudgetBook>>,
    /// Events on: each "turn"'s broker events go to this observer (the metrics adapter).
    observer: Option<roundtable_sandbox::events::Observer>,
    /// Audit on: each "turn"'s events are gathered and its line written at its end.
    audit: Option<Arc<AuditTrail>>,
    /// The one long turn's listener and events.
    listener: Option<Listening>,
    /// The turns of [`BrokerUnderTest::listen_turns`] (one caller each).
    turns: Vec<Listening>,
}

/// A "turn" of the bench: its listener and its events (sent as a runtime sends them).
struct Listening {
    listener: BrokerListener,
    events: Option<TurnEvents>,
}

impl Listening {
    /// Stops the listener and ends the turn's events (its audit line is written).
    async fn stop(self) -> Result<()> {
        self.listener.stop().await?;
        if let Some(e) = &self.events {
            e.emit_as_runtime(EventKind::Phase(TurnPhase::Done));
        }
        Ok(())
    }
}

impl BrokerUnderTest {
    pub async fn start(model_url: &str) -> Result<Self> {
        Self::start_counted(model_url, None).await
    }

    /// [`BrokerUnderTest::start`], each turn's usage counted and checked against `book`.
    pub async fn start_counted(model_url: &str, book: Option<Arc<BudgetBook>>) -> Result<Self> {
        Self::start_observed(model_url, book, None, None).await
    }

    /// [`BrokerUnderTest::start_counted`], each turn's events sent to `observer`.
    pub async fn start_observed(
        model_url: &str,
        book: Option<Arc<BudgetBook>>,
        observer: Option<roundtable_sandbox::events::Observer>,
        audit: Option<Arc<AuditTrail>>,
    ) -> Result<Self> {
        let policy = BrokerPolicy {
            model: "bench-model".into(),
            limits: BrokerLimits {
                max_model_calls: 10_000,
                // The throughput part's 8 callers in one "turn": above the default 4 in
                // flight, which would refuse some with 429 (what is measured is the
                // broker's cost per call, not the per-turn cap).
                max_calls_in_flight: 16,
                max_connections: 32,
                ..BrokerLimits::default()
            },
            ..broker_policy(model_url, "sk-bench-never-in-the-container")
        };
        let broker = Arc::new(Broker::new(policy).await.context("start the broker")?);
        let dir = tempfile::Builder::new()
            .prefix("rtb-broker-")
            .tempdir_in("/tmp")?;
        let mut me = Self {
            broker,
            dir,
            listener: None,
            n: 0,
            book,
            observer,
            audit,
            turns: Vec::new(),
        };
        me.relisten().await?;
        Ok(me)
    }

    /// A fresh listener (a new "turn", so the per-turn call count starts again).
    pub async fn relisten(&mut self) -> Result<()> {
        if let Some(l) = self.listener.take() {
            l.stop().await?;
        }
        self.listener = Some(self.turn("#bench", "u1").await?);
        Ok(())
    }

    /// `k` fresh turns at once, each in its own channel with its own speaker (as a busy
    /// bot's broker serves them: every turn's own account and events, the book shared), in
    /// place of the last ones; their sockets.
    pub async fn listen_turns(&mut self, k: usize) -> Result<Vec<PathBuf>> {
        for l in self.turns.drain(..) {
            l.stop().await?;
        }
        for i in 0..k {
            let turn = self.turn(&format!("#bench-{i}"), &format!("u{i}")).await?;
            self.turns.push(turn);
        }
        Ok(self
            .turns
            .iter()
            .map(|l| l.listener.path().to_owned())
            .collect())
    }

    /// A listener for a new turn of `speaker` in `channel`.
    async fn turn(&mut self, channel: &str, speaker: &str) -> Result<Listening> {
        self.n += 1;
        let socket = self.dir.path().join(format!("broker-{}.sock", self.n));
        let ctx = TurnContext {
            channel: channel.into(),
            speaker: Speaker {
                id: speaker.into(),
                name: "ann".into(),
            },
            cancel: CancellationToken::new(),
            events: (self.observer.is_some() || self.audit.is_some()).then(|| {
                roundtable_sandbox::internals::audit::turn_events(
                    self.observer.clone(),
                    self.audit.clone(),
                    u64::from(self.n),
                    channel,
                )
            }),
            account: self.book.as_ref().map(|b| {
                Arc::new(TurnAccount::new(
                    speaker,
                    &roundtable_sandbox::internals::turn::channel_segment(channel),
                    Some(b.clone()),
                ))
            }),
        };
        let events = ctx.events.clone();
        if let Some(e) = &events {
            e.emit_as_runtime(EventKind::Admitted);
        }
        let listener = self.broker.listen(&socket, ctx).await?;
        Ok(Listening { listener, events })
    }

    pub fn socket(&self) -> PathBuf {
        self.listener
            .as_ref()
            .expect("listening")
            .listener
            .path()
            .to_owned()
    }
}

/// Where a call goes.
#[derive(Debug, Clone)]
pub enum Target {
    Broker(PathBuf),
    Direct(SocketAddr),
}

/// The request body of a model call, as a guest would send it.
pub fn chat_body(stream: bool) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "whatever-the-guest-says",
        "stream": stream,
        "messages": [
            {"role": "system", "content": roundtable_sandbox::internals::config::DEFAULT_PROMPT},
            {"role": "user", "content": "ann: hello"}
        ]
    }))
    .expect("json")
}

/// Times of one call.
#[derive(Debug, Clone, Copy)]
pub struct CallTiming {
    /// Until the first byte of the first SSE event (`data:`) arrived.
    pub first_event: Option<Duration>,
    /// Until the connection closed with the whole answer.
    pub total: Duration,
}

/// The largest answer read.
const MAX_ANSWER: usize = 1 << 20;
/// A call that takes longer than this has hung.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// One model call, guest style, on a blocking thread (the timing starts there).
pub async fn call(target: &Target, body: &[u8], stream: bool) -> Result<CallTiming> {
    let (target, body) = (target.clone(), body.to_vec());
    tokio::task::spawn_blocking(move || call_blocking(&target, &body, stream)).await?
}

/// One model call with the guest's client: connect, send, read the whole answer.
pub fn call_blocking(target: &Target, body: &[u8], stream: bool) -> Result<CallTiming> {
    let t0 = Instant::now();
    let accept = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let (response, first_event) = match target {
        Target::Broker(path) => {
            let s = std::os::unix::net::UnixStream::connect(path)?;
            s.set_read_timeout(Some(CALL_TIMEOUT))?;
            s.set_write_timeout(Some(CALL_TIMEOUT))?;
            let mut watch = Watch::new(s, t0);
            let r = http::post(&mut watch, CHAT_COMPLETIONS, accept, body, MAX_ANSWER);
            (r, watch.first_event)
        }
        Target::Direct(addr) => {
            let s = std::net::TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(CALL_TIMEOUT))?;
            s.set_write_timeout(Some(CALL_TIMEOUT))?;
            let mut watch = Watch::new(s, t0);
            let r = http::post(&mut watch, CHAT_COMPLETIONS, accept, body, MAX_ANSWER);
            (r, watch.first_event)
        }
    };
    let total = t0.elapsed();
    let response = response.context("model call")?;
    if response.status != 200 {
        bail!(
            "model call failed with {}: {}",
            response.status,
            String::from_utf8_lossy(&response.body[..response.body.len().min(300)])
        );
    }
    let want: &[u8] = if stream { b"[DONE]" } else { b"scripted model" };
    if !contains(&response.body, want) {
        bail!(
            "incomplete answer: {}",
            String::from_utf8_lossy(&response.body)
        );
    }
    Ok(CallTiming {
        first_event: first_event.filter(|_| stream),
        total,
    })
}

/// A stream that notes when the first SSE event (`data:`) arrives through it.
struct Watch<S> {
    inner: S,
    t0: Instant,
    tail: Vec<u8>,
    first_event: Option<Duration>,
}

impl<S> Watch<S> {
    fn new(inner: S, t0: Instant) -> Self {
        Self {
            inner,
            t0,
            tail: Vec::new(),
            first_event: None,
        }
    }
}

impl<S: Read> Read for Watch<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if self.first_event.is_none() && n > 0 {
            self.tail.extend_from_slice(&buf[..n]);
            if contains(&self.tail, b"data:") {
                self.first_event = Some(self.t0.elapsed());
            }
            // Keep what could be the start of a `data:` split across reads.
            let cut = self.tail.len().saturating_sub(4);
            self.tail.drain(..cut);
        }
        Ok(n)
    }
}

impl<S: Write> Write for Watch<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Calls per second with `workers` concurrent callers, `per_worker` calls each.
pub async fn throughput(target: &Target, workers: usize, per_worker: usize) -> Result<f64> {
    throughput_over(std::slice::from_ref(target), workers, per_worker).await
}

/// [`throughput`] with caller `i` calling `targets[i % len]`.
pub async fn throughput_over(targets: &[Target], workers: usize, per_worker: usize) -> Result<f64> {
    let body = Arc::new(chat_body(false));
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..workers {
        let (target, body) = (targets[i % targets.len()].clone(), body.clone());
        set.spawn_blocking(move || {
            for _ in 0..per_worker {
                call_blocking(&target, &body, false)?;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok((workers * per_worker) as f64 / t0.elapsed().as_secs_f64())
}
