//! Actor-level test helpers, behind the `testing` feature (with the core's fake driver and
//! test environment, re-exported here): a supervisor builder around the fake, status
//! polling, a collector of progress messages, and the [`InjectPanic`] hook.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use actix::prelude::*;
pub use roundtable_sandbox::testing::*;

pub use crate::messages::InjectPanic;
use crate::{
    GuestMessage, SandboxActorError, SandboxSupervisor, Status, StatusReport, Stop,
    SupervisorOptions, TurnOutcome, TurnProgress,
};

/// Actor settings around `env`'s config, running turns with `driver` and offering `tool`:
/// room for 16 containers at once and 32 queued turns per channel.
pub fn fake_supervisor(
    env: &Env,
    driver: &Arc<FakeDriver>,
    tool: &Arc<WhoAmI>,
) -> SupervisorOptions {
    let mut c = env.config();
    c.driver = Some(driver.clone());
    c.tools = vec![tool.clone()];
    let mut s = SupervisorOptions::new(c);
    s.max_containers = 16;
    s.queue_limit = 32;
    s
}

/// Sends `text` from `ann` to `channel` on a task of its own (so a test can hold several
/// turns in flight); the task gives the supervisor's answer.
pub fn send(
    addr: &Addr<SandboxSupervisor>,
    channel: &str,
    text: &str,
) -> tokio::task::JoinHandle<Result<TurnOutcome, SandboxActorError>> {
    send_as(addr, channel, "ann", text)
}

/// [`send`] from the speaker `who` (see [`speaker`]).
pub fn send_as(
    addr: &Addr<SandboxSupervisor>,
    channel: &str,
    who: &str,
    text: &str,
) -> tokio::task::JoinHandle<Result<TurnOutcome, SandboxActorError>> {
    let request = addr.send(GuestMessage::new(channel, speaker(who), text));
    actix_rt::spawn(async move { request.await.expect("supervisor alive") })
}

/// Stops `channel`'s turn (see [`Stop`]); whether a turn was active.
pub async fn stop(addr: &Addr<SandboxSupervisor>, channel: &str) -> bool {
    addr.send(Stop {
        channel: channel.into(),
    })
    .await
    .expect("supervisor alive")
}

/// Waits until no channel is busy: every turn answered and torn down (a reply comes before
/// its teardown).
pub async fn until_idle(addr: &Addr<SandboxSupervisor>) {
    status_until(addr, "every channel idle", |s| s.totals.busy_channels == 0).await;
}

/// Polls the supervisor's status every 5 ms until `cond` holds; panics with `what` and the
/// last status after [`PROMPTLY`].
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
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Collects the progress of the messages it is the recipient of.
#[derive(Debug, Default)]
pub struct Collector {
    /// Every progress message received, in order.
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
