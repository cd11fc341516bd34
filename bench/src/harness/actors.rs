//! Turns through the actor layer (`SandboxSupervisor` → `ChannelActor` → `TurnActor` →
//! `run_turn`) with the real Docker driver, from the tokio side of the bench.
//!
//! The supervisor lives in an actix `System` on a thread of its own; the bench sends it
//! jobs ("N channels, one message each, at once") and gets each job's wall time back.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use roundtable_sandbox_actors::{GuestMessage, SandboxSupervisor, SupervisorOptions};
use tokio::sync::{mpsc, oneshot};

type Job = (usize, oneshot::Sender<Result<Duration>>);

/// The handle of the supervisor's thread.
pub struct ActorPath {
    jobs: mpsc::UnboundedSender<Job>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ActorPath {
    /// Starts a supervisor whose container cap is `max_containers`, on the same image and
    /// entrypoint override as the other paths.
    pub async fn start(
        image: &str,
        roots: &crate::harness::lifecycle::Roots,
        max_containers: usize,
    ) -> Result<Self> {
        let core = roundtable_sandbox::Config::builder(
            &roots.actors_run_root,
            &roots.actors_workspace_root,
        )
        .image(image)
        .model("http://127.0.0.1:9/v1", "bench-model")
        .api_key(roundtable_sandbox::ApiKey::from_static("sk-bench"))
        .allow_http(true)
        .command(crate::harness::lifecycle::command())
        .instance(format!("bench-actors-{}", std::process::id()))
        .build();
        let mut config = SupervisorOptions::new(core);
        config.max_containers = max_containers;
        config.queue_limit = 64;
        config.sweep_on_start = false;
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
        let (ready_tx, ready_rx) = oneshot::channel::<Result<()>>();
        let thread = std::thread::spawn(move || {
            actix::System::new().block_on(async move {
                let sup = match SandboxSupervisor::start(config).await {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                let speaker = roundtable_sandbox::Speaker {
                    id: "u1".into(),
                    name: "ann".into(),
                };
                let mut round = 0u64;
                while let Some((n, answer)) = rx.recv().await {
                    round += 1;
                    let t0 = Instant::now();
                    let sends = (0..n).map(|c| {
                        sup.send(GuestMessage::new(
                            format!("#actors-{round}-{c}"),
                            speaker.clone(),
                            "hello",
                        ))
                    });
                    let mut result = Ok(());
                    for r in futures_util::future::join_all(sends).await {
                        match r {
                            Ok(Ok(reply)) if reply.ok => {}
                            Ok(Ok(reply)) => result = Err(anyhow::anyhow!("{:?}", reply.error)),
                            Ok(Err(e)) => result = Err(e.into()),
                            Err(e) => result = Err(e.into()),
                        }
                    }
                    let _ = answer.send(result.map(|()| t0.elapsed()));
                }
                let _ = sup.send(roundtable_sandbox_actors::Shutdown).await;
            });
        });
        ready_rx.await.context("supervisor thread")??;
        Ok(Self {
            jobs,
            thread: Some(thread),
        })
    }

    /// N channels send one message each at once; the wall time until every reply came.
    pub async fn turns(&self, n: usize) -> Result<Duration> {
        let (tx, rx) = oneshot::channel();
        if self.jobs.send((n, tx)).is_err() {
            bail!("the supervisor thread is gone");
        }
        rx.await.context("supervisor thread")?
    }

    /// Shuts the supervisor down and joins its thread.
    pub fn stop(mut self) {
        let (tx, _) = mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.jobs, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
