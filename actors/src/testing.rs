//! Actor-level test helpers, behind the `testing` feature (with the core's fake driver and
//! test environment, re-exported here): a supervisor builder around the fake, status
//! polling, the runtime's one observer installed from a closure, and the [`InjectPanic`]
//! hook.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
pub use roundtable_sandbox::internals::testing::*;

pub use crate::messages::InjectPanic;
use crate::{
    GuestMessage, SandboxActorError, SandboxSupervisor, Status, StatusReport, Stop,
    SupervisorOptions, TurnOutcome,
};
use roundtable_sandbox::events::Event;

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

/// Installs `f` as the runtime's observer (the one hook): it sees every event of the
/// runtime and of the actor layer, on the thread that does the work.
pub fn observe(options: &mut SupervisorOptions, f: impl Fn(&Event) + Send + Sync + 'static) {
    options.config.observer = Some(Arc::new(f));
}

/// Whether `event` is of `channel` (an event names its channel by its short hash).
pub fn of_channel(event: &Event, channel: &str) -> bool {
    event.channel.as_deref() == Some(roundtable_sandbox::ChannelId::new(channel).short())
}
