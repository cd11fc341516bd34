//! The one recording fake container driver, and a host tool that records its speaker.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::broker::BoxFuture;
use crate::driver::{
    BrokerTransport, ContainerProcesses, ContainerSpec, GuestStream, HeldFiles, StartedContainer,
    SweepScope, LABEL_CHANNEL,
};
use crate::protocol::Turn;
use crate::{ContainerDriver, DriverError, HostTool, Reply, RunOutcome, ToolCallContext, Usage};

/// One recorded `run`.
#[derive(Debug, Clone)]
pub struct Run {
    /// The container's name.
    pub name: String,
    /// The channel label (first 16 hex digits of the channel's hash).
    pub channel: String,
    /// The turn the runner wrote to the container's stdin.
    pub turn: Turn,
    /// How it ended; `None` while it runs.
    pub outcome: Option<RunEnd>,
    /// Whether the broker's socket file was in the run dir when the run started.
    pub socket_bound: bool,
}

/// How a recorded run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// It replied (or the wrapped driver returned).
    Ok,
    /// Its cancellation token ended it.
    Cancelled,
    /// It exited with code 3 (`fail`), or the test's verdict was a failure.
    Failed,
    /// It panicked.
    Panicked,
}

/// What the fake recorded.
#[derive(Debug, Default)]
pub struct Record {
    /// Every run, in the order they started.
    pub runs: Vec<Run>,
    /// The names passed to `remove`, in order.
    pub removed: Vec<String>,
    /// `prepare <container>` (a prepared container started, see
    /// [`FakeDriver::set_prepares`]), `start <text>`, `end <text>` and `oom <container>` (the
    /// turn asked whether an OOM kill explains a run), in the order they happened.
    pub events: Vec<String>,
    running_by_channel: HashMap<String, usize>,
    /// Two runs of one channel at once (must never happen).
    pub channel_overlap: bool,
}

/// A run handed to the test by [`FakeDriver::handing_runs`]: the test decides its end.
#[derive(Debug)]
pub struct HandedRun {
    /// The turn's text.
    pub text: String,
    /// The turn's `reset` flag.
    pub reset: bool,
    /// `true`: the run replies `done`; `false` (or dropped): it exits with code 3.
    pub verdict: oneshot::Sender<bool>,
}

/// What a run does, chosen at construction.
enum Mode {
    /// Scripted by the turn's text (see [`FakeDriver::new`]).
    Scripted,
    /// Replies at once with this text, recording nothing.
    Instant(String),
    /// Hands each run to the test and waits for its verdict (or the cancellation).
    HandOver(mpsc::UnboundedSender<HandedRun>),
    /// Runs through a real driver; panics when the run goes on past `panic_after`.
    Around {
        inner: Arc<dyn ContainerDriver>,
        panic_after: Option<Duration>,
    },
    /// Carries the broker's HTTP over in-memory streams: the sender of each container's
    /// relay, from its transport's question to its run.
    Relay(Mutex<HashMap<String, mpsc::Sender<Box<dyn GuestStream>>>>),
}

impl fmt::Debug for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Scripted => f.write_str("Scripted"),
            Self::Instant(text) => f.debug_tuple("Instant").field(text).finish(),
            Self::HandOver(_) => f.write_str("HandOver"),
            Self::Around { panic_after, .. } => f
                .debug_struct("Around")
                .field("panic_after", panic_after)
                .finish_non_exhaustive(),
            Self::Relay(_) => f.write_str("Relay"),
        }
    }
}

/// The one fake container driver: runs no container of its own, records every run (its
/// turn, channel label and end), every removal and the start/end order, counts the runs at
/// once (and the most ever), and flags two runs of one channel at once.
///
/// What a run does is chosen at construction:
/// - [`FakeDriver::new`]: scripted by the turn's text;
/// - [`FakeDriver::instant`]: replies at once, records nothing (memory measurements);
/// - [`FakeDriver::handing_runs`]: each run is handed to the test, which decides its end;
/// - [`FakeDriver::around`]: the run goes to a real driver (with the real container), and
///   [`FakeDriver::panicking_after`] makes it panic mid-run;
/// - [`FakeDriver::relaying`]: a backend whose guest reaches the broker only over streams
///   the backend carries (no socket), the run speaking HTTP on them.
///
/// Knobs at any time: [`FakeDriver::release`] lets blocked runs go on,
/// [`FakeDriver::fail_removes`] makes every `remove` fail, [`FakeDriver::set_prepares`]
/// makes it prepare containers for warm turns (its prepared container runs the turn as
/// `run` would, under the prepared container's name; removed, it no longer passes its check).
#[derive(Debug)]
pub struct FakeDriver {
    record: Mutex<Record>,
    gate: Semaphore,
    running: AtomicUsize,
    max_running: AtomicUsize,
    fail_remove: AtomicBool,
    prepares: AtomicBool,
    mode: Mode,
    /// This fake, for the prepared containers it hands out (they outlive a borrow of it).
    this: Weak<FakeDriver>,
}

impl FakeDriver {
    fn with_mode(mode: Mode) -> Arc<Self> {
        Arc::new_cyclic(|this| Self {
            record: Mutex::default(),
            gate: Semaphore::new(0),
            running: AtomicUsize::new(0),
            max_running: AtomicUsize::new(0),
            fail_remove: AtomicBool::new(false),
            prepares: AtomicBool::new(false),
            mode,
            this: this.clone(),
        })
    }

    /// A fake scripted by the turn's text:
    /// - contains `block`: waits for [`FakeDriver::release`] (or the cancellation);
    /// - contains `stubborn`: waits for [`FakeDriver::release`], ignoring the cancellation
    ///   (a container that takes its time to die);
    /// - contains `whoami`: calls the `whoami` host tool through the turn's broker socket;
    /// - contains `fail`: fails with exit code 3;  contains `panic`: panics;
    /// - contains `oom`: asked (see [`ContainerDriver::oom_killed`]), the memory limit killed
    ///   a process of the container;
    /// - otherwise (or then) replies `<speaker id>|<text>|reset=<reset>|<tool answer>`.
    pub fn new() -> Arc<Self> {
        Self::with_mode(Mode::Scripted)
    }

    /// A fake that replies `text` to every turn at once and records nothing (so it holds
    /// no memory per turn).
    pub fn instant(text: impl Into<String>) -> Arc<Self> {
        Self::with_mode(Mode::Instant(text.into()))
    }

    /// A fake that hands each run to the test (through the receiver) and waits for the
    /// test's verdict, or for the run's cancellation.
    pub fn handing_runs() -> (Arc<Self>, mpsc::UnboundedReceiver<HandedRun>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self::with_mode(Mode::HandOver(tx)), rx)
    }

    /// A fake that runs every turn through `inner` (a real driver: the container is real),
    /// recording as usual; `remove` and `sweep` go to `inner` too.
    pub fn around(inner: Arc<dyn ContainerDriver>) -> Arc<Self> {
        Self::with_mode(Mode::Around {
            inner,
            panic_after: None,
        })
    }

    /// [`FakeDriver::around`], except that a run still going after `after` panics (inside
    /// the turn's task, with the real container running): `driver panic mid-run (test)`.
    pub fn panicking_after(inner: Arc<dyn ContainerDriver>, after: Duration) -> Arc<Self> {
        Self::with_mode(Mode::Around {
            inner,
            panic_after: Some(after),
        })
    }

    /// A backend whose container is not on this host: the broker is reached only through
    /// in-memory duplex streams the fake carries ([`BrokerTransport::Streams`]), as a relay
    /// would. Each run opens one stream, POSTs `{}` on it to the path its turn's text names
    /// (e.g. `/v1/tools/whoami`), and replies with the broker's whole answer, head and body.
    pub fn relaying() -> Arc<Self> {
        Self::with_mode(Mode::Relay(Mutex::default()))
    }

    /// Lets `n` blocked runs go on.
    pub fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Makes every later `remove` fail (a teardown that goes wrong), or succeed again.
    pub fn fail_removes(&self, fail: bool) {
        self.fail_remove.store(fail, Ordering::SeqCst);
    }

    /// Makes `start` prepare containers (the runtime's warm turns use them), or refuse as
    /// a driver without prepared containers does (the default).
    pub fn set_prepares(&self, on: bool) {
        self.prepares.store(on, Ordering::SeqCst);
    }

    /// Runs going on now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// The most runs that ever went on at once.
    pub fn max_running(&self) -> usize {
        self.max_running.load(Ordering::SeqCst)
    }

    /// Every run so far.
    pub fn runs(&self) -> Vec<Run> {
        self.lock().runs.clone()
    }

    /// How many runs started.
    pub fn started(&self) -> usize {
        self.lock().runs.len()
    }

    /// The texts of every run, in the order they started.
    pub fn texts(&self) -> Vec<String> {
        self.runs().into_iter().map(|r| r.turn.text).collect()
    }

    /// The names passed to `remove`.
    pub fn removed(&self) -> Vec<String> {
        self.lock().removed.clone()
    }

    /// `start <text>` and `end <text>` in the order they happened.
    pub fn events(&self) -> Vec<String> {
        self.lock().events.clone()
    }

    /// Whether two runs of one channel ever went on at once.
    pub fn overlap(&self) -> bool {
        self.lock().channel_overlap
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, index: usize, end: RunEnd) {
        self.lock().runs[index].outcome = Some(end);
    }

    /// Records the start of a run; the guard records its end however the run ends.
    fn start(&self, spec: &ContainerSpec, turn: &Turn) -> (usize, Running<'_>) {
        let channel = spec.labels.get(LABEL_CHANNEL).cloned().unwrap_or_default();
        let index = {
            let mut r = self.lock();
            let n = r.running_by_channel.entry(channel.clone()).or_default();
            *n += 1;
            if *n > 1 {
                r.channel_overlap = true;
            }
            r.events.push(format!("start {}", turn.text));
            r.runs.push(Run {
                name: spec.name.clone(),
                channel: channel.clone(),
                turn: turn.clone(),
                outcome: None,
                socket_bound: spec.run_dir.join("broker.sock").exists(),
            });
            r.runs.len() - 1
        };
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(now, Ordering::SeqCst);
        let running = Running {
            driver: self,
            channel,
            text: turn.text.clone(),
        };
        (index, running)
    }

    async fn scripted(
        &self,
        index: usize,
        spec: &ContainerSpec,
        turn: &Turn,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, DriverError> {
        if turn.text.contains("stubborn") {
            self.gate.acquire().await.unwrap().forget();
        }
        if turn.text.contains("block") {
            tokio::select! {
                _ = cancel.cancelled() => {
                    self.finish(index, RunEnd::Cancelled);
                    return Err(DriverError::Cancelled);
                }
                permit = self.gate.acquire() => permit.unwrap().forget(),
            }
        }
        let mut tool = String::new();
        if turn.text.contains("whoami") {
            tool = call_tool(&spec.run_dir.join("broker.sock"), "whoami").await;
        }
        if turn.text.contains("fail") {
            self.finish(index, RunEnd::Failed);
            return Ok(RunOutcome::exited(3));
        }
        if turn.text.contains("panic") {
            self.finish(index, RunEnd::Panicked);
            panic!("fake driver panic (test)");
        }
        self.finish(index, RunEnd::Ok);
        Ok(RunOutcome::replied(&Reply::text(
            format!(
                "{}|{}|reset={}|{}",
                turn.speaker.id, turn.text, turn.reset, tool
            ),
            Usage::default(),
        )))
    }

    async fn handed(
        &self,
        index: usize,
        runs: &mpsc::UnboundedSender<HandedRun>,
        turn: &Turn,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, DriverError> {
        let (verdict, rx) = oneshot::channel();
        runs.send(HandedRun {
            text: turn.text.clone(),
            reset: turn.reset,
            verdict,
        })
        .expect("the test keeps the receiver of the handed runs");
        tokio::select! {
            ok = rx => if ok == Ok(true) {
                self.finish(index, RunEnd::Ok);
                Ok(RunOutcome::replied(&Reply::text("done", Usage::default())))
            } else {
                self.finish(index, RunEnd::Failed);
                Ok(RunOutcome::exited(3))
            },
            _ = cancel.cancelled() => {
                self.finish(index, RunEnd::Cancelled);
                Err(DriverError::Cancelled)
            }
        }
    }

    async fn relayed(
        &self,
        index: usize,
        relays: &Mutex<HashMap<String, mpsc::Sender<Box<dyn GuestStream>>>>,
        spec: &ContainerSpec,
        turn: &Turn,
    ) -> Result<RunOutcome, DriverError> {
        let relay = relays
            .lock()
            .unwrap()
            .remove(&spec.name)
            .expect("the turn asks for the transport before the run");
        let (guest, host) = tokio::io::duplex(64 * 1024);
        relay.send(Box::new(host)).await.expect("the broker serves");
        let answer = http_post(guest, &turn.text, "{}").await;
        self.finish(index, RunEnd::Ok);
        Ok(RunOutcome::replied(&Reply::text(answer, Usage::default())))
    }

    async fn wrapped(
        &self,
        index: usize,
        inner: &Arc<dyn ContainerDriver>,
        panic_after: Option<Duration>,
        run: (&ContainerSpec, &[u8], CancellationToken),
    ) -> Result<RunOutcome, DriverError> {
        let (spec, stdin, cancel) = run;
        let run = inner.run(spec, stdin, cancel);
        let outcome = match panic_after {
            None => run.await,
            Some(after) => {
                tokio::pin!(run);
                tokio::select! {
                    r = &mut run => r,
                    _ = tokio::time::sleep(after) => {
                        self.finish(index, RunEnd::Panicked);
                        panic!("driver panic mid-run (test)")
                    }
                }
            }
        };
        let end = match &outcome {
            Err(DriverError::Cancelled) => RunEnd::Cancelled,
            Err(_) => RunEnd::Failed,
            Ok(_) => RunEnd::Ok,
        };
        self.finish(index, end);
        outcome
    }
}

/// Ends a run's bookkeeping however the run ends (returned, cancelled, dropped, panicked).
struct Running<'a> {
    driver: &'a FakeDriver,
    channel: String,
    text: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.driver.running.fetch_sub(1, Ordering::SeqCst);
        let mut r = self.driver.lock();
        *r.running_by_channel
            .entry(self.channel.clone())
            .or_default() -= 1;
        r.events.push(format!("end {}", self.text));
    }
}

impl ContainerDriver for FakeDriver {
    fn run<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        stdin: &'a [u8],
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, DriverError>> {
        Box::pin(async move {
            if let Mode::Instant(text) = &self.mode {
                return Ok(RunOutcome::replied(&Reply::text(
                    text.clone(),
                    Usage::default(),
                )));
            }
            let turn: Turn = serde_json::from_slice(stdin).expect("the runner writes a Turn");
            let (index, _running) = self.start(spec, &turn);
            if cancel.is_cancelled() {
                self.finish(index, RunEnd::Cancelled);
                return Err(DriverError::Cancelled);
            }
            match &self.mode {
                Mode::Instant(_) => unreachable!("answered above"),
                Mode::Scripted => self.scripted(index, spec, &turn, cancel).await,
                Mode::HandOver(runs) => self.handed(index, runs, &turn, cancel).await,
                Mode::Around { inner, panic_after } => {
                    self.wrapped(index, inner, *panic_after, (spec, stdin, cancel))
                        .await
                }
                Mode::Relay(relays) => self.relayed(index, relays, spec, &turn).await,
            }
        })
    }

    fn prepares(&self) -> bool {
        self.prepares.load(Ordering::SeqCst)
    }

    /// Records `prepare <name>` and hands out a container whose turn runs as `run` does.
    fn start<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        _cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Box<dyn StartedContainer>, DriverError>> {
        Box::pin(async move {
            if !self.prepares() {
                return Err(DriverError::Unsupported { op: "start" });
            }
            self.lock().events.push(format!("prepare {}", spec.name));
            let driver = self.this.upgrade().expect("the fake is alive");
            Ok(Box::new(Prepared {
                driver,
                spec: spec.clone(),
            }) as Box<dyn StartedContainer>)
        })
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(async move {
            self.lock().removed.push(name.to_owned());
            if self.fail_remove.load(Ordering::SeqCst) {
                return Err(DriverError::Call {
                    engine: "docker",
                    op: "remove",
                    container: name.to_owned(),
                    status: None,
                    message: "injected failure (test)".into(),
                });
            }
            match &self.mode {
                Mode::Around { inner, .. } => inner.remove(name).await,
                _ => Ok(()),
            }
        })
    }

    /// Records `oom <name>`. Around a real driver, the engine's flag; otherwise whether the
    /// text of the run of that container contains `oom`.
    fn oom_killed<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, DriverError>> {
        let scripted = {
            let mut r = self.lock();
            r.events.push(format!("oom {name}"));
            r.runs
                .iter()
                .any(|run| run.name == name && run.turn.text.contains("oom"))
        };
        match &self.mode {
            Mode::Around { inner, .. } => inner.oom_killed(name),
            _ => Box::pin(async move { Ok(scripted) }),
        }
    }

    fn sweep<'a>(
        &'a self,
        scope: SweepScope<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
        match &self.mode {
            Mode::Around { inner, .. } => inner.sweep(scope),
            _ => Box::pin(async { Ok(Vec::new()) }),
        }
    }

    fn processes<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ContainerProcesses, DriverError>> {
        match &self.mode {
            Mode::Around { inner, .. } => inner.processes(name),
            _ => Box::pin(async { Ok(ContainerProcesses::default()) }),
        }
    }

    /// Relaying, the streams of a new relay; otherwise the unix socket in the run dir.
    fn broker_transport<'a>(
        &'a self,
        spec: &'a ContainerSpec,
    ) -> BoxFuture<'a, Result<BrokerTransport, DriverError>> {
        let transport = match &self.mode {
            Mode::Relay(relays) => {
                let (tx, rx) = mpsc::channel(4);
                relays.lock().unwrap().insert(spec.name.clone(), tx);
                BrokerTransport::Streams(rx)
            }
            _ => BrokerTransport::UnixSocket,
        };
        Box::pin(async { Ok(transport) })
    }

    /// Around a real driver, its count (the container is real); otherwise no process holds
    /// anything.
    fn held_files<'a>(&'a self, name: &'a str) -> BoxFuture<'a, HeldFiles> {
        match &self.mode {
            Mode::Around { inner, .. } => inner.held_files(name),
            _ => Box::pin(async { HeldFiles::Counted { files: 0, bytes: 0 } }),
        }
    }

    /// Around a real driver, its session (an MCP session); otherwise refused (the trait's
    /// default: no session runs on a fake).
    fn start_session<'a>(
        &'a self,
        spec: &'a crate::driver::SessionSpec,
    ) -> BoxFuture<'a, Result<crate::driver::SessionIo, DriverError>> {
        match &self.mode {
            Mode::Around { inner, .. } => inner.start_session(spec),
            _ => Box::pin(async {
                Err(DriverError::Unsupported {
                    op: "start a session",
                })
            }),
        }
    }

    /// Records `pause <name>`; around a real driver, its pause; otherwise done.
    fn pause<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        self.lock().events.push(format!("pause {name}"));
        match &self.mode {
            Mode::Around { inner, .. } => inner.pause(name),
            _ => Box::pin(async { Ok(()) }),
        }
    }

    /// Records `resume <name>`; around a real driver, its resume; otherwise done.
    fn resume<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        self.lock().events.push(format!("resume {name}"));
        match &self.mode {
            Mode::Around { inner, .. } => inner.resume(name),
            _ => Box::pin(async { Ok(()) }),
        }
    }

    /// Around a real driver, its listing; otherwise none.
    fn list_labelled<'a>(
        &'a self,
        labels: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<crate::driver::LabelledContainer>, DriverError>> {
        match &self.mode {
            Mode::Around { inner, .. } => inner.list_labelled(labels),
            _ => Box::pin(async { Ok(Vec::new()) }),
        }
    }

    /// Around a real driver, the image's file; otherwise refused.
    fn image_file<'a>(
        &'a self,
        image: &'a str,
        path: &'a str,
        max: u64,
    ) -> BoxFuture<'a, Result<Vec<u8>, DriverError>> {
        match &self.mode {
            Mode::Around { inner, .. } => inner.image_file(image, path, max),
            _ => Box::pin(async {
                Err(DriverError::Unsupported {
                    op: "read a file of an image",
                })
            }),
        }
    }

    /// Around a real driver, the engine's; otherwise there is none on this host.
    fn data_root(&self) -> BoxFuture<'_, Result<Option<std::path::PathBuf>, DriverError>> {
        match &self.mode {
            Mode::Around { inner, .. } => inner.data_root(),
            _ => Box::pin(async { Ok(None) }),
        }
    }
}

/// A container the fake prepared: it waits until it is removed.
#[derive(Debug)]
struct Prepared {
    driver: Arc<FakeDriver>,
    spec: ContainerSpec,
}

impl StartedContainer for Prepared {
    fn name(&self) -> &str {
        &self.spec.name
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), DriverError>> {
        Box::pin(async move {
            if self.driver.lock().removed.contains(&self.spec.name) {
                return Err(DriverError::Exited {
                    container: self.spec.name.clone(),
                    code: -1,
                });
            }
            Ok(())
        })
    }

    fn run(
        self: Box<Self>,
        stdin: Vec<u8>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<RunOutcome, DriverError>> {
        Box::pin(async move { self.driver.run(&self.spec, &stdin, cancel).await })
    }
}

/// A bare HTTP/1.1 POST to the broker's tool path on its unix socket; returns the
/// response body.
async fn call_tool(socket: &Path, name: &str) -> String {
    let stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    let response = http_post(stream, &format!("/v1/tools/{name}"), "{}").await;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or(response)
}

/// One HTTP/1.1 POST of the JSON `body` to `path` on `stream`; the whole answer (head and
/// body) as text.
async fn http_post(mut stream: impl GuestStream, path: &str, body: &str) -> String {
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A host tool answering with the speaker the broker bound to the call
/// (`speaker=<id>`); it records each call's channel and speaker id.
#[derive(Debug, Default)]
pub struct WhoAmI {
    /// `(channel, speaker id)` of every call.
    pub seen: Mutex<Vec<(String, String)>>,
}

impl HostTool for WhoAmI {
    fn name(&self) -> &str {
        "whoami"
    }
    fn description(&self) -> &str {
        "Says who is speaking"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false})
    }
    fn call(
        &self,
        _args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        self.seen
            .lock()
            .unwrap()
            .push((ctx.channel.clone(), ctx.speaker.id.clone()));
        Box::pin(async move { Ok(format!("speaker={}", ctx.speaker.id)) })
    }
}
