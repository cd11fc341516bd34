//! Actor-level test helpers, behind the `testing` feature (with the core's fake driver and
//! test environment, re-exported here): a supervisor builder around the fake, status
//! polling, a collector of progress messages, and the [`InjectPanic`] hook.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use actix::prelude::*;
pub use roundtable_sandbox::testing::*;

pub use crate::messages::InjectPanic;
use crate::{SandboxSupervisor, Status, StatusReport, SupervisorOptions, TurnProgress};

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
