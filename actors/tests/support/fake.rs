//! Test support for the actor layer: a recording fake container driver, a host tool that
//! records the speaker of each call, private roots, and small polling helpers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use roundtable_sandbox::driver::{
    BoxFuture, ContainerSpec, DriverError, RunOutcome, LABEL_CHANNEL,
};
use roundtable_sandbox::protocol::Turn;
use roundtable_sandbox::{ContainerDriver, HostTool, Reply, Speaker, ToolCallContext, Usage};
use roundtable_sandbox_actors::{
    SandboxSupervisor, Status, StatusReport, SupervisorOptions, TurnProgress,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// One recorded `run`.
#[derive(Debug, Clone)]
pub struct Run {
    pub name: String,
    /// The channel label (first 16 hex digits of the channel's hash).
    pub channel: String,
    pub turn: Turn,
    /// How it ended: "ok", "cancelled", "failed", "panicked"; None while running.
    pub outcome: Option<&'static str>,
}

#[derive(Debug, Default)]
pub struct Record {
    pub runs: Vec<Run>,
    pub removed: Vec<String>,
    /// "start <text>" and "end <text>" in the order they happened.
    pub events: Vec<String>,
    running_by_channel: HashMap<String, usize>,
    /// Two runs of one channel at once (must never happen).
    pub channel_overlap: bool,
}

/// A container driver that runs nothing. The turn's text scripts it:
/// - contains `block`: waits for [`FakeDriver::release`] (or the cancellation);
/// - contains `stubborn`: waits for [`FakeDriver::release`], ignoring the cancellation (a
///   container that takes its time to die);
/// - contains `whoami`: calls the `whoami` host tool through the turn's broker socket;
/// - contains `fail`: fails with exit code 3;  contains `panic`: panics;
/// - otherwise (or then) replies `<speaker id>|<text>|reset=<reset>|<tool answer>`.
#[derive(Debug)]
pub struct FakeDriver {
    pub record: Mutex<Record>,
    gate: tokio::sync::Semaphore,
    running: AtomicUsize,
    max_running: AtomicUsize,
    /// Makes every `remove` fail (a teardown that goes wrong).
    pub fail_remove: AtomicBool,
}

impl FakeDriver {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            record: Mutex::default(),
            gate: tokio::sync::Semaphore::new(0),
            running: AtomicUsize::new(0),
            max_running: AtomicUsize::new(0),
            fail_remove: AtomicBool::new(false),
        })
    }

    /// Lets `n` blocked runs go on.
    pub fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    pub fn max_running(&self) -> usize {
        self.max_running.load(Ordering::SeqCst)
    }

    pub fn runs(&self) -> Vec<Run> {
        self.record.lock().unwrap().runs.clone()
    }

    pub fn started(&self) -> usize {
        self.record.lock().unwrap().runs.len()
    }

    pub fn texts(&self) -> Vec<String> {
        self.runs().into_iter().map(|r| r.turn.text).collect()
    }

    pub fn removed(&self) -> Vec<String> {
        self.record.lock().unwrap().removed.clone()
    }

    pub fn events(&self) -> Vec<String> {
        self.record.lock().unwrap().events.clone()
    }

    pub fn overlap(&self) -> bool {
        self.record.lock().unwrap().channel_overlap
    }

    fn finish(&self, index: usize, outcome: &'static str) {
        let mut r = self.record.lock().unwrap();
        r.runs[index].outcome = Some(outcome);
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
        let mut r = self.driver.record.lock().unwrap_or_else(|e| e.into_inner());
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
            let turn: Turn = serde_json::from_slice(stdin).expect("the runner writes a Turn");
            let channel = spec.labels.get(LABEL_CHANNEL).cloned().unwrap_or_default();
            let index = {
                let mut r = self.record.lock().unwrap();
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
                });
                r.runs.len() - 1
            };
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_running.fetch_max(now, Ordering::SeqCst);
            let _running = Running {
                driver: self,
                channel,
                text: turn.text.clone(),
            };
            if cancel.is_cancelled() {
                self.finish(index, "cancelled");
                return Err(DriverError::Cancelled);
            }
            if turn.text.contains("stubborn") {
                self.gate.acquire().await.unwrap().forget();
            }
            if turn.text.contains("block") {
                tokio::select! {
                    _ = cancel.cancelled() => {
                        self.finish(index, "cancelled");
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
                self.finish(index, "failed");
                return Ok(RunOutcome::exited(3));
            }
            if turn.text.contains("panic") {
                self.finish(index, "panicked");
                panic!("fake driver panic (test)");
            }
            self.finish(index, "ok");
            Ok(RunOutcome::replied(&Reply::text(
                format!(
                    "{}|{}|reset={}|{}",
                    turn.speaker.id, turn.text, turn.reset, tool
                ),
                Usage::default(),
            )))
        })
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(async move {
            self.record.lock().unwrap().removed.push(name.to_owned());
            if self.fail_remove.load(Ordering::SeqCst) {
                return Err(DriverError::Call {
                    engine: "docker",
                    op: "remove",
                    container: name.to_owned(),
                    status: None,
                    message: "injected failure (test)".into(),
                });
            }
            Ok(())
        })
    }

    fn sweep<'a>(
        &'a self,
        _scope: roundtable_sandbox::driver::SweepScope<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// A bare HTTP/1.1 POST to the broker's tool path; returns the response body.
async fn call_tool(socket: &std::path::Path, name: &str) -> String {
    let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    let request = format!(
        "POST /v1/tools/{name} HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n\
         Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or(response)
}

/// A host tool answering with the speaker the broker bound to the call.
#[derive(Debug, Default)]
pub struct WhoAmI {
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

// Private roots, the non-root check, the project image and the leftover listing are the
// core tests' own (one Env for every crate's container tests).
#[path = "../../../tests/support/sandbox.rs"]
mod core_support;
#[allow(unused_imports)] // each test binary uses a part
pub use core_support::{image, labelled_containers_of, require_non_root, Env, PROMPTLY};

impl Env {
    /// Actor settings around a config using `driver` and the `whoami` tool.
    pub fn fake(&self, driver: &Arc<FakeDriver>, tool: &Arc<WhoAmI>) -> SupervisorOptions {
        let mut c = self.config();
        c.driver = Some(driver.clone());
        c.tools = vec![tool.clone()];
        let mut s = SupervisorOptions::new(c);
        s.max_containers = 16;
        s.queue_limit = 32;
        s
    }

    /// `turn-` dirs left under the run root.
    pub fn turn_dirs(&self) -> Vec<String> {
        core_support::run_root_entries(&self.run_root)
    }
}

pub fn speaker(id: &str) -> Speaker {
    Speaker {
        id: id.into(),
        name: format!("{id} (name)"),
    }
}

/// Polls `cond` every 5 ms until it holds; panics with `what` after `within`.
pub async fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let started = Instant::now();
    while !cond() {
        assert!(started.elapsed() < within, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls the supervisor's status until `cond` holds.
pub async fn status_until(
    addr: &Addr<SandboxSupervisor>,
    what: &str,
    cond: impl Fn(&StatusReport) -> bool,
) -> StatusReport {
    let started = Instant::now();
    loop {
        let status = addr.send(Status).await.unwrap();
        if cond(&status) {
            return status;
        }
        assert!(
            started.elapsed() < PROMPTLY,
            "timed out waiting for: {what}; last status: {status:#?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Collects the progress of the messages it is the recipient of.
#[derive(Debug, Default)]
pub struct Collector {
    pub seen: Arc<Mutex<Vec<TurnProgress>>>,
}

impl Actor for Collector {
    type Context = Context<Self>;
}

impl Handler<TurnProgress> for Collector {
    type Result = ();
    fn handle(&mut self, msg: TurnProgress, _: &mut Self::Context) {
        self.seen.lock().unwrap().push(msg);
    }
}
