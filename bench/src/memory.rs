//! Memory of the actor layer: RSS growth per idle `ChannelActor`.
//!
//! Runs in a child process of its own (`roundtable-bench --memory-child N`), so nothing of
//! the other measurements is in its heap. Turns use an instant driver (it answers at once
//! without a container: this measures the actors, not Docker), through the real supervisor,
//! channel actors, turn actors and `run_turn` (dirs, broker listener, teardown).
//!
//! Baseline in the same run: the same number of turns on channels that already exist
//! (growth from turn traffic alone: allocator high-water marks), then the same number of
//! turns each on a new channel, left idle. Per channel = (growth with new channels −
//! growth from turns alone) / N.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use roundtable_sandbox::driver::{BoxFuture, ContainerSpec};
use roundtable_sandbox::{ContainerDriver, DriverError, Reply, RunOutcome, Usage};
use roundtable_sandbox_actors::{GuestMessage, SandboxSupervisor, Status, SupervisorOptions};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// A driver that answers every turn at once and runs nothing.
#[derive(Debug)]
struct InstantDriver;

impl ContainerDriver for InstantDriver {
    fn run<'a>(
        &'a self,
        _spec: &'a ContainerSpec,
        _stdin: &'a [u8],
        _cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, DriverError>> {
        Box::pin(async { Ok(RunOutcome::replied(&Reply::text("hi", Usage::default()))) })
    }

    fn remove<'a>(&'a self, _name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(async { Ok(()) })
    }

    fn sweep<'a>(
        &'a self,
        _scope: roundtable_sandbox::driver::SweepScope<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// Concurrent turns in flight while channels are made.
const BATCH: usize = 64;

/// In the child: measures and prints the JSON result on stdout.
pub fn child(channels: usize) -> Result<()> {
    let system = actix::System::new();
    let value = system.block_on(measure(channels))?;
    println!("{value}");
    Ok(())
}

async fn measure(channels: usize) -> Result<Value> {
    let roots = crate::lifecycle::Roots::new()?;
    let core = roundtable_sandbox::Config::builder(&roots.run_root, &roots.workspace_root)
        .model("http://127.0.0.1:9/v1", "bench-model")
        .api_key(roundtable_sandbox::ApiKey::from_static("sk-bench"))
        .allow_http(true)
        .driver(Arc::new(InstantDriver))
        .build();
    let mut config = SupervisorOptions::new(core);
    config.max_containers = BATCH;
    config.idle_timeout = Duration::from_secs(86_400);
    config.sweep_on_start = false;
    let sup = SandboxSupervisor::start(config).await?;
    let speaker = roundtable_sandbox::Speaker {
        id: "u1".into(),
        name: "ann".into(),
    };
    let send_all = |keys: Vec<String>| {
        let sup = sup.clone();
        let speaker = speaker.clone();
        async move {
            for chunk in keys.chunks(BATCH) {
                let answers = chunk
                    .iter()
                    .map(|k| sup.send(GuestMessage::new(k.clone(), speaker.clone(), "hello")));
                for r in futures_util::future::join_all(answers).await {
                    let reply = r.context("mailbox")?.context("turn")?;
                    if !reply.ok {
                        bail!("turn failed: {:?}", reply.error);
                    }
                }
            }
            Ok::<_, anyhow::Error>(())
        }
    };
    let settle = || async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        crate::rss_kib()
    };
    // Warm-up: BATCH channels, many turns on them.
    let warm: Vec<String> = (0..BATCH).map(|i| format!("#warm-{i}")).collect();
    for _ in 0..(channels / BATCH).max(4) {
        send_all(warm.clone()).await?;
    }
    let rss_start = settle().await;
    // Baseline: `channels` more turns on the existing channels.
    send_all(
        (0..channels)
            .map(|i| format!("#warm-{}", i % BATCH))
            .collect(),
    )
    .await?;
    let rss_after_turns = settle().await;
    // Measured: `channels` turns, each on a new channel, left idle.
    send_all((0..channels).map(|i| format!("#idle-{i}")).collect()).await?;
    let rss_after_channels = settle().await;
    let status = sup.send(Status).await?;
    let live = status.totals.live_channels;
    if live != channels + BATCH {
        bail!("expected {} live channels, found {live}", channels + BATCH);
    }
    let turns_growth = rss_after_turns.saturating_sub(rss_start) as f64;
    let channels_growth = rss_after_channels.saturating_sub(rss_after_turns) as f64;
    let per_channel_raw = channels_growth / channels as f64;
    let per_channel = ((channels_growth - turns_growth) / channels as f64).max(0.0);
    Ok(json!({
        "channels": channels,
        "live_channels": live,
        "rss_start_kib": rss_start,
        "rss_after_turns_on_existing_channels_kib": rss_after_turns,
        "rss_after_new_idle_channels_kib": rss_after_channels,
        "growth_turns_only_kib": turns_growth,
        "growth_new_channels_kib": channels_growth,
        "per_channel_raw_kib": crate::stats::round3(per_channel_raw),
        "per_channel_kib": crate::stats::round3(per_channel),
    }))
}

/// In the parent: runs the child and reads its JSON.
pub fn idle_channels(channels: usize) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .args(["--memory-child", &channels.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("run the memory child")?;
    if !out.status.success() {
        bail!("the memory child failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("memory child said {text:?}"))
}
