//! Memory: part 4, RSS growth per idle `ChannelActor` (`--only memory`); part 8b, the same
//! with metrics and accounting on against all off (`--only observed`); part 1c, the memory
//! of prepared containers (with part 1, `--only turn`).
//!
//! Runs in a child process of its own (`roundtable-bench --memory-child N`), so nothing of
//! the other measurements is in its heap. Turns use the fake driver's instant replies
//! (`FakeDriver::instant`: it answers at once without a container and records nothing: this
//! measures the actors, not Docker), through the real supervisor, channel actors, turn
//! actors and `run_turn` (dirs, broker listener, teardown).
//!
//! Baseline in the same run: the same number of turns on channels that already exist
//! (growth from turn traffic alone: allocator high-water marks), then the same number of
//! turns each on a new channel, left idle. Per channel = (growth with new channels −
//! growth from turns alone) / N.

use roundtable_sandbox::internals::testing::DockerDriverExt;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use roundtable_sandbox::internals::testing::FakeDriver;
use roundtable_sandbox_actors::{GuestMessage, SandboxSupervisor, Status, SupervisorOptions};
use serde::{Deserialize, Serialize};

/// Concurrent turns in flight while channels are made.
const BATCH: usize = 64;

/// The memory child's figures (KiB): one run of N idle channels.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdleChannels {
    pub observed: bool,
    pub channels: usize,
    pub live_channels: usize,
    pub rss_start_kib: u64,
    pub rss_after_turns_on_existing_channels_kib: u64,
    pub rss_after_new_idle_channels_kib: u64,
    pub growth_turns_only_kib: f64,
    pub growth_new_channels_kib: f64,
    pub per_channel_raw_kib: f64,
    /// (growth with new channels − growth from turns alone) / N (the target's).
    pub per_channel_kib: f64,
}

/// Part 8b's figures: two children each way, alternating (off, on, off, on).
#[derive(Debug, Serialize)]
pub struct ObservedIdle {
    pub on: Vec<IdleChannels>,
    pub off: Vec<IdleChannels>,
    /// The mean growth on / off (the target's).
    pub on_vs_off_growth: f64,
}

/// The prepared containers' memory, per container (KiB).
#[derive(Debug, Serialize)]
pub struct Prepared {
    pub n: usize,
    pub engine_rss_kib_per_container: f64,
    pub shims_added: usize,
    pub container_cgroup_kib_mean: f64,
    pub host_process_rss_kib_per_container: f64,
}

/// In the child: measures and prints the JSON result on stdout.
pub fn child(channels: usize, observed: bool) -> Result<()> {
    let system = actix::System::new();
    let value = system.block_on(measure(channels, observed))?;
    println!("{}", serde_json::to_string(&value)?);
    Ok(())
}

async fn measure(channels: usize, observed: bool) -> Result<IdleChannels> {
    let roots = crate::harness::lifecycle::Roots::new()?;
    let state_dir = tempfile::Builder::new()
        .prefix("rtb-mem-")
        .tempdir_in("/tmp")?;
    let mut core = roundtable_sandbox::Config::builder(&roots.run_root, &roots.workspace_root)
        .model("http://127.0.0.1:9/v1", "bench-model")
        .api_key(roundtable_sandbox::ApiKey::from_static("sk-bench"))
        .allow_http(true)
        // The fake driver answers every turn at once, runs nothing and records nothing.
        .driver(FakeDriver::instant("hi"))
        .build();
    // Observed: accounting with every budget set (far from reached, its SQLite state file)
    // and the metrics adapter on the event seam, its endpoint served.
    let mut served = None;
    if observed {
        core.budgets = roundtable_sandbox::BudgetSettings {
            state_file: Some(state_dir.path().join("budgets.sqlite")),
            speaker_tokens_per_day: Some(1_000_000_000),
            channel_tokens_per_day: Some(1_000_000_000),
            bot_tokens_per_day: Some(1_000_000_000),
            // No rate limit: one speaker sends every turn of the measurement.
            speaker_turns_per_minute: None,
            ..Default::default()
        };
        let metrics = std::sync::Arc::new(roundtable_sandbox_metrics::Metrics::new());
        core.observer = Some(metrics.observer());
        served = Some(roundtable_sandbox_metrics::MetricsServer::start(
            "127.0.0.1:0".parse()?,
            false,
            metrics,
        )?);
    }
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
        crate::probe::rss_kib()
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
    drop(served);
    Ok(IdleChannels {
        observed,
        channels,
        live_channels: live,
        rss_start_kib: rss_start,
        rss_after_turns_on_existing_channels_kib: rss_after_turns,
        rss_after_new_idle_channels_kib: rss_after_channels,
        growth_turns_only_kib: turns_growth,
        growth_new_channels_kib: channels_growth,
        per_channel_raw_kib: crate::stats::round3(per_channel_raw),
        per_channel_kib: crate::stats::round3(per_channel),
    })
}

/// Part 4: RSS per idle channel, in a child process of its own (an actix system).
pub fn idle(channels: usize) -> Result<IdleChannels> {
    println!("\n== 4. memory: RSS per idle ChannelActor, {channels} channels");
    let m = idle_channels(channels, false)?;
    println!(
        "RSS growth: {} new idle channels +{} KiB, the same turns on existing channels +{} KiB \
         => {:.2} KiB per idle channel ({:.2} KiB raw)",
        channels,
        m.growth_new_channels_kib,
        m.growth_turns_only_kib,
        m.per_channel_kib,
        m.per_channel_raw_kib,
    );
    Ok(m)
}

/// Part 8b (issue 23, item 8): idle channels with metrics and accounting on against all
/// off, alternating child processes (off, on, off, on).
pub fn observed_idle(channels: usize) -> Result<ObservedIdle> {
    println!("\n== 8b. memory of {channels} idle channels: metrics and accounting on vs all off");
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for k in 0..4 {
        let observed = k % 2 == 1;
        let m = idle_channels(channels, observed)?;
        println!(
            "  {} : +{} KiB for {channels} new idle channels",
            if observed { "on " } else { "off" },
            m.growth_new_channels_kib,
        );
        if observed {
            on.push(m)
        } else {
            off.push(m)
        }
    }
    let mean = |v: &[IdleChannels]| {
        v.iter().map(|m| m.growth_new_channels_kib).sum::<f64>() / v.len() as f64
    };
    let ratio = mean(&on) / mean(&off);
    println!(
        "idle channels' RSS growth: on {:.0} KiB, off {:.0} KiB (mean of 2 each; {:.3}×)",
        mean(&on),
        mean(&off),
        ratio
    );
    Ok(ObservedIdle {
        on,
        off,
        on_vs_off_growth: crate::stats::round3(ratio),
    })
}

/// In the parent: runs the child and reads its JSON.
fn idle_channels(channels: usize, observed: bool) -> Result<IdleChannels> {
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe);
    child.args(["--memory-child", &channels.to_string()]);
    if observed {
        child.arg("--memory-observed");
    }
    let out = child
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

/// RSS (KiB) of the engine's host processes: `dockerd`, `containerd` and every
/// `containerd-shim*` (one per container), from `/proc`.
fn engine_rss_kib() -> (u64, usize) {
    let mut total = 0;
    let mut shims = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let path = entry.path();
        let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
            continue;
        };
        let comm = comm.trim();
        let engine =
            comm == "dockerd" || comm == "containerd" || comm.starts_with("containerd-shim");
        if !engine {
            continue;
        }
        shims += usize::from(comm.starts_with("containerd-shim"));
        total += std::fs::read_to_string(path.join("status"))
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    (total, shims)
}

/// Memory charged to a container's cgroup (KiB; v1 or v2), found from its init's pid.
async fn container_kib(docker: &bollard::Docker, name: &str) -> Option<u64> {
    let inspected = docker.inspect_container(name, None).await.ok()?;
    let id = inspected.id?;
    let candidates = [
        format!("/sys/fs/cgroup/memory/docker/{id}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/system.slice/docker-{id}.scope/memory.current"),
        format!("/sys/fs/cgroup/docker/{id}/memory.current"),
    ];
    candidates
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| t.trim().parse::<u64>().ok())
        .map(|b| b / 1024)
}

/// The extra memory of `n` prepared containers (waiting for their turn): the engine's
/// host processes (dockerd, containerd, one shim each), the containers' own cgroups, and
/// this process (the attach streams and exit watchers it holds), each per container.
pub async fn prepared(warm: &roundtable_sandbox::Sandbox, n: usize) -> Result<Prepared> {
    println!("\n== 1c. memory of prepared containers: {n} prepared at once, waiting");
    let docker = roundtable_sandbox::DockerDriver::default();
    let client = docker.client().await?.clone();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (engine_before, shims_before) = engine_rss_kib();
    let host_before = crate::probe::rss_kib();
    let mut prepared = Vec::new();
    for i in 0..n {
        prepared.push(crate::harness::lifecycle::prepare(warm, &format!("#mem-{i}")).await?);
    }
    // Let the guests settle (blocked on stdin).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (engine_after, shims_after) = engine_rss_kib();
    let host_after = crate::probe::rss_kib();
    let mut cgroup = Vec::new();
    for p in &prepared {
        if let Some(kib) = container_kib(&client, p.container()).await {
            cgroup.push(kib);
        }
    }
    for p in prepared {
        p.discard("bench").await;
    }
    let per = |before: u64, after: u64| after.saturating_sub(before) as f64 / n as f64;
    let engine = per(engine_before, engine_after);
    let host = per(host_before, host_after);
    let cgroup_mean = if cgroup.is_empty() {
        f64::NAN
    } else {
        cgroup.iter().sum::<u64>() as f64 / cgroup.len() as f64
    };
    println!(
        "per prepared container (KiB): engine host processes +{engine:.0} ({} shims more), container cgroup {cgroup_mean:.0}, this process +{host:.0}",
        shims_after.saturating_sub(shims_before)
    );
    Ok(Prepared {
        n,
        engine_rss_kib_per_container: engine,
        shims_added: shims_after.saturating_sub(shims_before),
        container_cgroup_kib_mean: cgroup_mean,
        host_process_rss_kib_per_container: host,
    })
}
