//! `roundtable-bench`: the project's benchmark. Every figure is measured next to its
//! baseline in the same run (interleaved), so the ratios hold on a noisy, shared machine.
//!
//! ```text
//! roundtable-bench [--iterations N] [--rounds N] [--broker-calls N] [--channels N]
//!                  [--only turn,gvisor,concurrency,broker,memory] [--json PATH] [--image IMAGE]
//! ```
//! Run it through `scripts/bench.sh` (it builds the image and the release binary and runs
//! this as the non-root service user; the runtime refuses root).
//!
//! Parts: [`lifecycle`] (one trivial turn on each path), [`broker_bench`] (model calls
//! through the broker and straight to the scripted model), [`stats`] (percentiles).

mod actors_path;
mod broker_bench;
mod hostile;
mod lifecycle;
mod memory;
mod runtimes;
mod stats;

use roundtable_sandbox::internals::testing::DockerDriverExt;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, Parser};
use roundtable_sandbox::DockerDriver;
use serde_json::{json, Value};

use broker_bench::Target;
use lifecycle::Timing;
use stats::{ratio, round3, Samples};

/// The project's benchmark: every figure next to its baseline, measured interleaved in
/// one run. Run it through scripts/bench.sh (it builds the image and the release binary
/// and runs this as the non-root service user).
#[derive(Debug, Parser)]
#[command(name = "roundtable-bench", version)]
struct Options {
    /// Measured turns per path
    #[arg(long, value_name = "N", default_value_t = 30)]
    iterations: usize,
    /// Unmeasured turns per path first
    #[arg(long, value_name = "N", default_value_t = 3)]
    warmup: usize,
    /// Rounds of the concurrency and throughput parts
    #[arg(long, value_name = "N", default_value_t = 3)]
    rounds: usize,
    /// Model calls per broker path
    #[arg(long, value_name = "N", default_value_t = 1000)]
    broker_calls: usize,
    /// Idle channels of the memory part
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    channels: usize,
    /// The parts to run, comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = ["turn", "gvisor", "concurrency", "throughput", "ablation", "broker", "memory", "accounting", "observed", "soak", "store"],
        default_value = "turn,gvisor,concurrency,throughput,broker,memory,accounting,observed"
    )]
    only: Vec<String>,
    /// Seconds of each side of the throughput part (per round)
    #[arg(long, value_name = "N", default_value_t = 30)]
    throughput_seconds: u64,
    /// Seconds each side of the throughput part runs before the turns it counts (its steady
    /// state)
    #[arg(long, value_name = "N", default_value_t = 5)]
    throughput_settle: u64,
    /// Rounds of the throughput part (each runs every side once, in a balanced order; the
    /// target reads the median of the rounds' ratios)
    #[arg(long, value_name = "N", default_value_t = 6)]
    throughput_rounds: usize,
    /// The throughput part also runs N sealed containers alone (the driver's, no runtime):
    /// the engine's price of the seal
    #[arg(long)]
    throughput_driver: bool,
    /// Rounds of the broker throughput in parts 7 and 8 (each runs *off*, *on* and the A/A
    /// control once, in a balanced order; a multiple of 6 balances them fully)
    #[arg(long, value_name = "N", default_value_t = 18)]
    broker_rounds: usize,
    /// Seconds of each variant of the ablation part (per round; `--only ablation`, not run
    /// by default)
    #[arg(long, value_name = "N", default_value_t = 10)]
    ablation_seconds: u64,
    /// Windows of the soak part (`--only soak`, not run by default): each runs the warm
    /// side, then the bare lifecycles, on one runtime kept for the whole part
    #[arg(long, value_name = "N", default_value_t = 10)]
    soak_windows: usize,
    /// Seconds of the warm side in each soak window (the bare side runs a third of it)
    #[arg(long, value_name = "N", default_value_t = 60)]
    soak_seconds: u64,
    /// Channels (and bare lifecycles) of the throughput part
    #[arg(long, value_name = "N", default_value_t = 32)]
    throughput_channels: usize,
    /// Where the JSON results go
    #[arg(long, value_name = "PATH", default_value = "target/bench/results.json")]
    json: String,
    /// The guest image
    #[arg(
        long,
        env = "ROUNDTABLE_IMAGE",
        default_value = "roundtable-sandbox-guest:latest"
    )]
    image: String,
    /// Print a completion script for SHELL and exit
    #[arg(long, value_name = "SHELL", value_enum)]
    completions: Option<clap_complete::Shell>,
    /// Internal: the memory part's child process, measuring N channels
    #[arg(long, value_name = "N", hide = true)]
    memory_child: Option<usize>,
    /// Internal: the memory child with metrics and accounting on
    #[arg(long, hide = true)]
    memory_observed: bool,
    /// Internal: one broker of part 8 alone, `on` (the budget book and the metrics
    /// observer) or `off`, 8 callers in one turn (`on8`, `off8`: in 8 turns) for
    /// `--broker-calls` calls in all, no Docker: for an instruction count of each side
    /// (`valgrind --tool=callgrind`) and its CPU time by thread
    #[arg(long, value_name = "SIDE", hide = true, value_parser = ["on", "off", "on8", "off8"])]
    broker_side: Option<String>,
}

impl Options {
    fn wants(&self, part: &str) -> bool {
        self.only.iter().any(|p| p == part)
    }
}

/// `roundtable-bench hostile`: a hostile turn's host memory against idle (no Docker).
#[derive(Debug, Parser)]
#[command(name = "roundtable-bench hostile")]
struct HostileOptions {
    /// How long the attack lasts
    #[arg(long, value_name = "N", default_value_t = 20)]
    seconds: u64,
    /// Which attack: `chat` (model and tool calls, slow clients, endless streams),
    /// `compaction` (compactions answered with 4 MB) or `mcp` (hostile MCP answers over
    /// stdio and streamable HTTP: the review of issue 43)
    #[arg(long, value_name = "KIND", default_value = "chat", value_parser = ["chat", "compaction", "mcp"])]
    attack: String,
    /// Where the JSON result goes
    #[arg(long, value_name = "PATH", default_value = "target/bench/hostile.json")]
    json: String,
}

fn main() -> Result<()> {
    // The hostile-turn part and its child have arguments of their own.
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, socket, url] = args.as_slice() {
        if flag == "--hostile-host" {
            return hostile::host(socket, url);
        }
    }
    if args.get(1).map(String::as_str) == Some("hostile") {
        return hostile_main(&HostileOptions::parse_from(&args[1..]));
    }
    let options = Options::parse();
    if let Some(channels) = options.memory_child {
        return memory::child(channels, options.memory_observed);
    }
    if let Some(shell) = options.completions {
        clap_complete::generate(
            shell,
            &mut Options::command(),
            "roundtable-bench",
            &mut std::io::stdout(),
        );
        return Ok(());
    }
    if nix::unistd::getuid().is_root() {
        bail!("the runtime refuses root: run scripts/bench.sh (it runs this as the service user)");
    }
    if let Some(side) = &options.broker_side {
        return broker_side(&options, side.starts_with("on"), side.ends_with('8'));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut results = rt.block_on(run(&options))?;
    if options.wants("memory") {
        // The actor layer's measurement runs in a process of its own (an actix system).
        println!(
            "\n== 4. memory: RSS per idle ChannelActor, {} channels",
            options.channels
        );
        let m = memory::idle_channels(options.channels, false)?;
        println!(
            "RSS growth: {} new idle channels +{} KiB, the same turns on existing channels +{} KiB \
             => {:.2} KiB per idle channel ({:.2} KiB raw)",
            options.channels,
            m["growth_new_channels_kib"],
            m["growth_turns_only_kib"],
            m["per_channel_kib"].as_f64().unwrap_or(f64::NAN),
            m["per_channel_raw_kib"].as_f64().unwrap_or(f64::NAN),
        );
        results["memory"]["idle_channels"] = m;
    }
    if options.wants("observed") {
        // Issue 23, item 8: idle channels with metrics and accounting on against all off,
        // alternating child processes (off, on, off, on).
        println!(
            "\n== 8b. memory of {} idle channels: metrics and accounting on vs all off",
            options.channels
        );
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for k in 0..4 {
            let observed = k % 2 == 1;
            let m = memory::idle_channels(options.channels, observed)?;
            let kib = m["growth_new_channels_kib"].as_f64().unwrap_or(f64::NAN);
            println!(
                "  {} : +{kib} KiB for {} new idle channels",
                if observed { "on " } else { "off" },
                options.channels
            );
            if observed {
                on.push(m)
            } else {
                off.push(m)
            }
        }
        let mean = |v: &[Value]| {
            v.iter()
                .map(|m| m["growth_new_channels_kib"].as_f64().unwrap_or(f64::NAN))
                .sum::<f64>()
                / v.len() as f64
        };
        let ratio = mean(&on) / mean(&off);
        println!(
            "idle channels' RSS growth: on {:.0} KiB, off {:.0} KiB (mean of 2 each; {:.3}×)",
            mean(&on),
            mean(&off),
            ratio
        );
        results["observed"]["idle_channels"] = json!({
            "on": on, "off": off, "on_vs_off_growth": round3(ratio),
        });
    }
    results["targets"] = targets(&results);
    print_targets(&results["targets"]);
    println!();
    write_json(&options.json, &results)
}

/// Writes `value` as pretty JSON to `path` (its directory made if missing), and says so.
fn write_json(path: &str, value: &Value) -> Result<()> {
    let path = std::path::Path::new(path);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(value)? + "\n")?;
    println!("JSON written to {}", path.display());
    Ok(())
}

/// `roundtable-bench hostile [--seconds N] [--attack chat|compaction] [--json PATH]`: the host's peak RSS under a
/// hostile turn against idle (see [`hostile`]); no Docker needed.
fn hostile_main(o: &HostileOptions) -> Result<()> {
    if nix::unistd::getuid().is_root() {
        bail!("run it as the service user (scripts/as-service-user.sh)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let attack = match o.attack.as_str() {
        "compaction" => hostile::Attack::Compaction,
        "mcp" => hostile::Attack::Mcp,
        _ => hostile::Attack::Chat,
    };
    let result = rt.block_on(hostile::run(o.seconds, attack))?;
    write_json(&o.json, &result)
}

async fn run(o: &Options) -> Result<Value> {
    let driver = DockerDriver::default();
    let docker = driver.client().await?.clone();
    lifecycle::require_image(&docker, &o.image).await?;
    let swept = lifecycle::sweep_bench_containers(&docker).await?;
    if swept > 0 {
        eprintln!("removed {swept} containers left by an earlier bench run");
    }
    let machine = machine(&docker).await;
    println!(
        "machine: {} × {} ({}), {} MiB RAM, kernel {}, Docker {} ({})",
        machine["cpus"],
        machine["cpu"].as_str().unwrap_or("?"),
        machine["virtualisation"].as_str().unwrap_or("?"),
        machine["mem_mib"],
        machine["kernel"].as_str().unwrap_or("?"),
        machine["docker"].as_str().unwrap_or("?"),
        machine["storage_driver"].as_str().unwrap_or("?"),
    );
    let mut results = json!({
        "machine": machine,
        "options": {
            "iterations": o.iterations, "warmup": o.warmup, "rounds": o.rounds,
            "broker_calls": o.broker_calls, "channels": o.channels, "image": o.image,
        },
        "memory": {},
    });
    let model = broker_bench::Model::start().await?;
    let roots = lifecycle::Roots::new()?;
    let sandbox = lifecycle::sandbox(&o.image, &roots, &model.url()).await?;
    let stdin = lifecycle::turn_stdin();

    if o.wants("turn") {
        let warm = lifecycle::warm_sandbox(&o.image, &roots, &model.url()).await?;
        results["turn"] =
            turn_overhead(o, &sandbox, &warm, &driver, &docker, &roots, &stdin).await?;
        let (adopted, cold) = warm.warm_counts();
        println!("runtime_warm: {adopted} turns in prepared containers, {cold} fell back to cold");
        if cold > 0 {
            anyhow::bail!("{cold} warm turns fell back to a cold start: the figures are not warm");
        }
        results["warm_memory"] = memory::prepared(&warm, 8).await?;
        drop(warm);
    }
    if o.wants("gvisor") {
        if let Some(r) =
            runtimes::compare(&driver, &o.image, &model.url(), o.iterations, o.warmup).await?
        {
            results["gvisor"] = r;
        }
    }
    if o.wants("concurrency") {
        let (conc, rss) = concurrency(o, &sandbox, &docker, &roots, &stdin).await?;
        results["concurrency"] = conc;
        results["memory"]["turns_32"] = rss;
    }
    if o.wants("throughput") {
        results["throughput"] = throughput(o, &docker, &roots, &model.url(), &stdin).await?;
    }
    if o.wants("soak") {
        results["soak"] = soak(o, &docker, &roots, &model.url(), &stdin).await?;
    }
    if o.wants("ablation") {
        results["ablation"] = ablation(o, &docker, &roots, &stdin).await?;
    }
    if o.wants("broker") {
        results["broker"] = broker(o, &model).await?;
    }
    if o.wants("accounting") {
        results["accounting"] = accounting(o, &model, false).await?;
    }
    if o.wants("observed") {
        results["observed"] = accounting(o, &model, true).await?;
    }
    if o.wants("store") {
        results["store"] = budget_store(o, &model).await?;
    }
    let left = lifecycle::sweep_bench_containers(&docker).await?;
    if left > 0 {
        eprintln!("warning: {left} bench containers were left and are now removed");
    }
    if lifecycle::entries(&roots.run_root) + lifecycle::entries(&roots.warm_run_root) != 0 {
        bail!("the runtime left entries in its run root");
    }
    sandbox.shutdown().await;
    Ok(results)
}

async fn machine(docker: &bollard::Docker) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let hypervisor = cpuinfo.contains(" hypervisor");
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let (version, storage, cgroup) = match docker.info().await {
        Ok(i) => (
            i.server_version.unwrap_or_default(),
            i.driver.unwrap_or_default(),
            i.cgroup_version.map(|v| v.to_string()).unwrap_or_default(),
        ),
        Err(_) => Default::default(),
    };
    json!({
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "virtualisation": if hypervisor { "virtual machine" } else { "bare metal" },
        "mem_mib": mem_kib / 1024,
        "kernel": kernel,
        "docker": version,
        "storage_driver": storage,
        "cgroup": cgroup,
    })
}

/// Per path: reply and total samples.
#[derive(Default)]
struct PathSamples {
    reply: Samples,
    total: Samples,
}

impl PathSamples {
    fn push(&mut self, t: Timing) {
        self.reply.push(t.reply);
        self.total.push(t.total);
    }

    fn json(&self) -> Value {
        json!({"reply": self.reply.json(), "total": self.total.json()})
    }
}

const PATHS: [&str; 6] = [
    "runtime",
    "runtime_warm",
    "driver",
    "bare_api",
    "bare_api_default",
    "docker_cli",
];

#[allow(clippy::too_many_arguments)]
async fn one_turn(
    path: &str,
    profile: &mut Vec<(String, Samples)>,
    i: usize,
    sandbox: &roundtable_sandbox::Sandbox,
    warm: &roundtable_sandbox::Sandbox,
    driver: &DockerDriver,
    docker: &bollard::Docker,
    roots: &lifecycle::Roots,
    image: &str,
    stdin: &[u8],
) -> Result<Timing> {
    match path {
        "runtime" | "runtime_warm" => {
            let channel = format!("#bench-{}", i % 8);
            let (t, phases) = if path == "runtime" {
                lifecycle::runtime_turn_profiled(sandbox, &channel).await?
            } else {
                lifecycle::warm_turn(warm, &channel).await?
            };
            // Each phase's span: from its start to the next phase's start.
            for w in phases.windows(2) {
                let span = w[1].1.saturating_sub(w[0].1);
                let name = match path {
                    "runtime" => w[0].0.clone(),
                    _ => format!("warm:{}", w[0].0),
                };
                match profile.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, s)) => s.push(span),
                    None => {
                        let mut s = Samples::default();
                        s.push(span);
                        profile.push((name, s));
                    }
                }
            }
            Ok(t)
        }
        "driver" => lifecycle::driver_turn(driver, image, roots, stdin).await,
        "bare_api" => lifecycle::bare_turn(docker, image, stdin, true).await,
        "bare_api_default" => lifecycle::bare_turn(docker, image, stdin, false).await,
        "docker_cli" => lifecycle::cli_turn(image, stdin).await,
        _ => unreachable!(),
    }
}

async fn turn_overhead(
    o: &Options,
    sandbox: &roundtable_sandbox::Sandbox,
    warm: &roundtable_sandbox::Sandbox,
    driver: &DockerDriver,
    docker: &bollard::Docker,
    roots: &lifecycle::Roots,
    stdin: &[u8],
) -> Result<Value> {
    println!(
        "\n== 1. turn overhead: a trivial turn, {} interleaved iterations per path",
        o.iterations
    );
    for i in 0..o.warmup {
        for p in PATHS {
            one_turn(
                p,
                &mut Vec::new(),
                i,
                sandbox,
                warm,
                driver,
                docker,
                roots,
                &o.image,
                stdin,
            )
            .await?;
        }
    }
    let mut samples: Vec<PathSamples> = PATHS.iter().map(|_| PathSamples::default()).collect();
    let mut profile: Vec<(String, Samples)> = Vec::new();
    let mut bare_steps: Vec<(&str, Samples)> = Vec::new();
    for i in 0..o.iterations {
        // Rotate the order so no path always follows the same one.
        for k in 0..PATHS.len() {
            let idx = (i + k) % PATHS.len();
            let t = one_turn(
                PATHS[idx],
                &mut profile,
                i,
                sandbox,
                warm,
                driver,
                docker,
                roots,
                &o.image,
                stdin,
            )
            .await
            .with_context(|| PATHS[idx])?;
            samples[idx].push(t);
            if let (Some(steps), "bare_api") = (t.steps, PATHS[idx]) {
                for (name, d) in steps {
                    match bare_steps.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, s)) => s.push(d),
                        None => {
                            let mut s = Samples::default();
                            s.push(d);
                            bare_steps.push((name, s));
                        }
                    }
                }
            }
        }
    }
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>10}   (ms; reply = the reply is known, total = container removed)",
        "path", "reply p50", "reply p95", "total p50", "total p95"
    );
    let mut out = json!({});
    for (p, s) in PATHS.iter().zip(&samples) {
        println!(
            "{:<12} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            p,
            s.reply.p50(),
            s.reply.p95(),
            s.total.p50(),
            s.total.p95()
        );
        out[*p] = s.json();
    }
    let (rt, rw, bare, cli) = (&samples[0], &samples[1], &samples[3], &samples[5]);
    let ratios = json!({
        "runtime_warm_reply_vs_bare_reply_p50": ratio(rw.reply.p50(), bare.reply.p50()),
        "runtime_warm_reply_vs_bare_total_p50": ratio(rw.reply.p50(), bare.total.p50()),
        "runtime_warm_reply_vs_runtime_reply_p50": ratio(rw.reply.p50(), rt.reply.p50()),
        "runtime_reply_vs_bare_reply_p50": ratio(rt.reply.p50(), bare.reply.p50()),
        "runtime_reply_vs_bare_reply_p95": ratio(rt.reply.p95(), bare.reply.p95()),
        "runtime_total_vs_bare_total_p50": ratio(rt.total.p50(), bare.total.p50()),
        "runtime_total_vs_bare_total_p95": ratio(rt.total.p95(), bare.total.p95()),
        "runtime_reply_vs_cli_p50": ratio(rt.reply.p50(), cli.total.p50()),
        "runtime_reply_vs_cli_p95": ratio(rt.reply.p95(), cli.total.p95()),
        "runtime_total_vs_cli_p50": ratio(rt.total.p50(), cli.total.p50()),
        "driver_total_vs_bare_total_p50": ratio(samples[2].total.p50(), bare.total.p50()),
    });
    println!(
        "ratios (p50): runtime_warm reply / bare reply {:.3}, / bare total {:.3}, / runtime (cold) reply {:.3}",
        ratios["runtime_warm_reply_vs_bare_reply_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["runtime_warm_reply_vs_bare_total_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["runtime_warm_reply_vs_runtime_reply_p50"].as_f64().unwrap_or(f64::NAN),
    );
    println!(
        "ratios (p50): runtime/bare reply {:.3}, total {:.3}; runtime/cli reply {:.3}, total {:.3}; driver/bare total {:.3}",
        ratios["runtime_reply_vs_bare_reply_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["runtime_total_vs_bare_total_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["runtime_reply_vs_cli_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["runtime_total_vs_cli_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["driver_total_vs_bare_total_p50"].as_f64().unwrap_or(f64::NAN),
    );
    out["ratios"] = ratios;
    print!("runtime phases (p50 ms, from each phase's start to the next):");
    let mut phases = json!({});
    for (name, s) in &profile {
        print!(" {name} {:.1}", s.p50());
        phases[name] = s.json();
    }
    println!();
    out["runtime_phases"] = phases;
    print!("bare API steps (p50 ms):");
    let mut steps = json!({});
    for (name, s) in &bare_steps {
        print!(" {name} {:.1}", s.p50());
        steps[*name] = s.json();
    }
    println!();
    out["bare_api_steps"] = steps;
    Ok(out)
}

/// The process's resident set size in KiB.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Samples the RSS every 2 ms until stopped; returns the peak.
struct RssSampler {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<u64>,
}

impl RssSampler {
    fn start() -> Self {
        let stop = tokio_util::sync::CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let mut peak = rss_kib();
            let mut tick = tokio::time::interval(Duration::from_millis(2));
            loop {
                tokio::select! {
                    _ = s.cancelled() => break,
                    _ = tick.tick() => peak = peak.max(rss_kib()),
                }
            }
            peak.max(rss_kib())
        });
        Self { stop, task }
    }

    async fn peak(self) -> u64 {
        self.stop.cancel();
        self.task.await.unwrap_or(0)
    }
}

async fn concurrency(
    o: &Options,
    sandbox: &roundtable_sandbox::Sandbox,
    docker: &bollard::Docker,
    roots: &lifecycle::Roots,
    stdin: &[u8],
) -> Result<(Value, Value)> {
    println!(
        "\n== 2. concurrency: N channels each sending one turn at once, {} interleaved rounds",
        o.rounds
    );
    println!("   (actors: through SandboxSupervisor with max_containers = 32)");
    let actors = actors_path::ActorPath::start(&o.image, roots, 32).await?;
    println!(
        "{:<4} {:>11} {:>11} {:>11} {:>9} {:>9} {:>9}",
        "N", "runtime ms", "actors ms", "bare API ms", "rt/bare", "act/bare", "turns/s"
    );
    let mut out = json!({});
    let mut rss = json!({});
    for n in [1usize, 8, 32] {
        let mut rt_total = Samples::default();
        let mut rt_replies = Samples::default();
        let mut act_total = Samples::default();
        let mut bare_total = Samples::default();
        let mut rt_peak = 0u64;
        let mut bare_peak = 0u64;
        let mut base = u64::MAX;
        for r in 0..o.rounds {
            for k in 0..3 {
                base = base.min(rss_kib());
                let sampler = RssSampler::start();
                let t0 = Instant::now();
                match (r + k) % 3 {
                    0 => {
                        let turns = (0..n).map(|c| async move {
                            lifecycle::runtime_turn(sandbox, &format!("#conc-{n}-{c}")).await
                        });
                        let timings = futures_util::future::try_join_all(turns).await?;
                        rt_total.push(t0.elapsed());
                        rt_replies.push(timings.iter().map(|t| t.reply).max().unwrap_or_default());
                        rt_peak = rt_peak.max(sampler.peak().await);
                    }
                    1 => {
                        let turns =
                            (0..n).map(|_| lifecycle::bare_turn(docker, &o.image, stdin, true));
                        futures_util::future::try_join_all(turns).await?;
                        bare_total.push(t0.elapsed());
                        bare_peak = bare_peak.max(sampler.peak().await);
                    }
                    _ => {
                        act_total.push(actors.turns(n).await?);
                        sampler.peak().await;
                    }
                }
            }
        }
        let turns_per_s = n as f64 / (rt_total.p50() / 1000.0);
        println!(
            "{:<4} {:>11.1} {:>11.1} {:>11.1} {:>9.3} {:>9.3} {:>9.1}",
            n,
            rt_total.p50(),
            act_total.p50(),
            bare_total.p50(),
            rt_total.p50() / bare_total.p50(),
            act_total.p50() / bare_total.p50(),
            turns_per_s
        );
        out[n.to_string()] = json!({
            "runtime_wall": rt_total.json(),
            "runtime_all_replied": rt_replies.json(),
            "actors_wall": act_total.json(),
            "bare_api_wall": bare_total.json(),
            "ratio_p50": ratio(rt_total.p50(), bare_total.p50()),
            "actors_ratio_p50": ratio(act_total.p50(), bare_total.p50()),
            "runtime_turns_per_s": round3(turns_per_s),
        });
        if n == 32 {
            rss = json!({
                "bench_process_rss_before_kib": base,
                "peak_rss_runtime_32_turns_kib": rt_peak,
                "peak_rss_bare_api_32_lifecycles_kib": bare_peak,
                "runtime_growth_kib": rt_peak.saturating_sub(base),
                "bare_api_growth_kib": bare_peak.saturating_sub(base),
            });
            println!(
                "host RSS during 32 concurrent turns: runtime peak {} KiB (+{} over {} before), \
                 bare API peak {} KiB (+{})",
                rt_peak,
                rt_peak.saturating_sub(base),
                base,
                bare_peak,
                bare_peak.saturating_sub(base)
            );
        }
    }
    actors.stop();
    Ok((out, rss))
}

/// The sides of the throughput part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TputSide {
    /// N channels of the runtime with warm turns.
    Warm,
    /// N bare lifecycles (the baseline).
    Bare,
    /// N bare lifecycles again: the A/A control (what two identical sides read here).
    Control,
    /// N sealed containers alone (the driver's run and removal, no runtime).
    Driver,
}

impl TputSide {
    fn name(self) -> &'static str {
        match self {
            TputSide::Warm => "runtime_warm",
            TputSide::Bare => "bare_api",
            TputSide::Control => "bare_api_control",
            TputSide::Driver => "driver",
        }
    }
}

/// One side's window: the turns that ended in it, all its turns, its wall time, and the
/// warm side's cold starts and failures.
#[derive(Default)]
struct SideRun {
    done: u64,
    all: u64,
    cold: u64,
    failed: u64,
}

/// Throughput: N channels each sending turns back to back (the next message the moment the
/// channel admits it: after its turn's teardown) with warm turns, as a channel actor runs
/// them (its next container is prepared from the reply on, beside the teardown), against
/// N bare lifecycles looping at once, and against a second set of N bare lifecycles (the
/// A/A control), and with `--throughput-driver` N sealed containers alone. Each side runs
/// `throughput_settle` seconds, then `throughput_seconds` in which the turns that end are
/// counted; the sides run in a balanced order in each of `throughput_rounds` rounds. The
/// target reads the median of the rounds' warm / bare ratios.
async fn throughput(
    o: &Options,
    docker: &bollard::Docker,
    roots: &lifecycle::Roots,
    model_url: &str,
    stdin: &[u8],
) -> Result<Value> {
    let (n, secs) = (o.throughput_channels, o.throughput_seconds);
    let settle = Duration::from_secs(o.throughput_settle);
    // The engine calls the runtime makes (where the daemon's time per warm turn goes).
    let engine_calls = EngineCalls::default();
    let dockerd = find_process("dockerd");
    let mut sides = vec![TputSide::Warm, TputSide::Bare, TputSide::Control];
    if o.throughput_driver {
        sides.push(TputSide::Driver);
    }
    println!(
        "\n== 2b. throughput: {n} channels back to back with warm turns vs {n} bare lifecycles looping (and {n} more: the A/A control{}), {secs} s each side (the turns that end in it, after {} s of settling), {} rounds in a balanced order",
        if o.throughput_driver {
            format!("; and {n} sealed containers alone, the driver's")
        } else {
            String::new()
        },
        settle.as_secs(),
        o.throughput_rounds
    );
    let c = lifecycle::bench_config(
        &roots.actors_run_root,
        &roots.actors_workspace_root,
        &o.image,
        model_url,
    )
    .command(lifecycle::command())
    .instance(format!("bench-tput-{}", std::process::id()))
    .warm(roundtable_sandbox::WarmSettings {
        enabled: true,
        max: 2 * n,
        ttl_secs: None,
    })
    .observer(engine_calls.observer())
    .build();
    let warm = roundtable_sandbox::Sandbox::new(c)
        .await
        .context("start the throughput runtime")?;
    let driver = DockerDriver::default();
    // Turns/s by side, one per round, in the order of `sides`.
    let mut rates: Vec<Vec<f64>> = sides.iter().map(|_| Vec::new()).collect();
    let mut rounds = Vec::new();
    let (mut fell_cold, mut failed) = (0u64, 0u64);
    for r in 0..o.throughput_rounds {
        for k in stats::balanced_order(sides.len(), r) {
            let side = sides[k];
            // Every side runs `settle` seconds before its window and is counted only for
            // the turns that end inside the window: each in its steady state (the warm
            // side's first preparations, a loop's last turn and the discard of its unused
            // prepared container fall outside), the same rule for all.
            let t0 = Instant::now();
            let from = t0 + settle;
            let until = from + Duration::from_secs(secs);
            let counted = move || (from..=until).contains(&Instant::now());
            let cpu0 = cpu_now(dockerd);
            let run = match side {
                TputSide::Warm => warm_loops(&warm, n, until, counted).await,
                TputSide::Bare | TputSide::Control => {
                    let loops = (0..n).map(|_| async move {
                        let mut s = SideRun::default();
                        while Instant::now() < until {
                            lifecycle::bare_turn(docker, &o.image, stdin, true).await?;
                            s.all += 1;
                            s.done += u64::from(counted());
                        }
                        Ok::<_, anyhow::Error>(s)
                    });
                    sum_runs(futures_util::future::try_join_all(loops).await?)
                }
                TputSide::Driver => {
                    let loops = (0..n).map(|_| async {
                        let mut s = SideRun::default();
                        while Instant::now() < until {
                            lifecycle::driver_turn(&driver, &o.image, roots, stdin).await?;
                            s.all += 1;
                            s.done += u64::from(counted());
                        }
                        Ok::<_, anyhow::Error>(s)
                    });
                    sum_runs(futures_util::future::try_join_all(loops).await?)
                }
            };
            let wall = t0.elapsed().as_secs_f64();
            fell_cold += run.cold;
            failed += run.failed;
            rates[k].push(run.done as f64 / secs as f64);
            rounds.push(json!({"round": r, "side": side.name(), "turns": run.done, "turns_all": run.all, "wall_s": round3(wall), "cpu_ms_per_turn": cpu_per_turn(cpu0, cpu_now(dockerd), run.all)}));
        }
    }
    let rate_of = |s: TputSide| &rates[sides.iter().position(|x| *x == s).unwrap_or(0)];
    let (rt, bare, ctl) = (
        rate_of(TputSide::Warm),
        rate_of(TputSide::Bare),
        rate_of(TputSide::Control),
    );
    let paired = stats::paired_median(rt, bare);
    let control = stats::paired_median(ctl, bare);
    let warm_vs_control = stats::paired_median(rt, ctl);
    let driver_paired = o
        .throughput_driver
        .then(|| stats::paired_median(rate_of(TputSide::Driver), bare));
    let warm_turns: u64 = rounds
        .iter()
        .filter(|r| r["side"] == "runtime_warm")
        .filter_map(|r| r["turns_all"].as_u64())
        .sum();
    let per_turn = engine_calls.per(warm_turns.max(1));
    for side in &sides {
        let of_side: Vec<&Value> = rounds.iter().filter(|r| r["side"] == side.name()).collect();
        let mean = |k: &str| {
            of_side
                .iter()
                .filter_map(|r| r["cpu_ms_per_turn"][k].as_f64())
                .sum::<f64>()
                / of_side.len().max(1) as f64
        };
        println!(
            "CPU per turn, {}: this process {:.1} ms, dockerd {:.1} ms",
            side.name(),
            mean("bench"),
            mean("dockerd")
        );
    }
    println!(
        "engine calls per warm turn (the runtime's, preparation included): {}",
        per_turn
            .iter()
            .map(|(op, (calls, ms))| format!("{op} {calls:.2} ({ms:.1} ms)"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    for (side, r) in sides.iter().zip(&rates) {
        println!("turns/s by round, {:<17} {}", side.name(), show(r));
    }
    println!(
        "turns/s (medians): runtime warm {:.2}, bare API {:.2}, control {:.2}; median of the {} rounds' ratios: warm / bare {paired:.3}x, A/A control / bare {control:.3}x, warm / control {warm_vs_control:.3}x{} ({fell_cold} turns started cold, {failed} failed)",
        stats::median(rt),
        stats::median(bare),
        stats::median(ctl),
        o.throughput_rounds,
        driver_paired
            .map(|d| format!(", sealed container alone / bare {d:.3}x"))
            .unwrap_or_default(),
    );
    warm.shutdown().await;
    let by_side: serde_json::Map<String, Value> = sides
        .iter()
        .zip(&rates)
        .map(|(s, r)| {
            (
                s.name().to_owned(),
                json!(r.iter().map(|x| round3(*x)).collect::<Vec<_>>()),
            )
        })
        .collect();
    Ok(json!({
        "channels": n,
        "seconds": secs,
        "settle_seconds": settle.as_secs(),
        "rounds": o.throughput_rounds,
        "windows": rounds,
        "turns_per_s_by_round": by_side,
        "runtime_warm_turns_per_s_p50": round3(stats::median(rt)),
        "bare_api_turns_per_s_p50": round3(stats::median(bare)),
        "ratio": round3(paired),
        "control_ratio": round3(control),
        "warm_vs_control_ratio": round3(warm_vs_control),
        "driver_vs_bare_ratio": driver_paired.map(round3),
        "turns_started_cold": fell_cold,
        "turns_failed": failed,
        "engine_calls_per_warm_turn": per_turn
            .iter()
            .map(|(op, (calls, ms))| (op.to_string(), json!({"calls": round3(*calls), "mean_ms": round3(*ms)})))
            .collect::<serde_json::Map<_, _>>(),
    }))
}

/// 2d. Soak: one runtime serving warm turns in `n` channels back to back for
/// `--soak-windows` windows of `--soak-seconds`, each followed by the bare lifecycles for a
/// third of it (the machine's own drift). Per window: the turns/s of each, the runtime's
/// CPU and dockerd's per turn, the engine calls' mean time, and what the process holds
/// (RSS, open files, threads, tokio tasks): a runtime that slows or grows with its age
/// shows here.
async fn soak(
    o: &Options,
    docker: &bollard::Docker,
    roots: &lifecycle::Roots,
    model_url: &str,
    stdin: &[u8],
) -> Result<Value> {
    let n = o.throughput_channels;
    let secs = o.soak_seconds.max(3);
    let bare_secs = (secs / 3).max(1);
    println!(
        "\n== 2d. soak: {n} channels of warm turns on one runtime, {} windows of {secs} s, each followed by {bare_secs} s of {n} bare lifecycles",
        o.soak_windows
    );
    let engine_calls = EngineCalls::default();
    let dockerd = find_process("dockerd");
    let c = lifecycle::bench_config(
        &roots.actors_run_root,
        &roots.actors_workspace_root,
        &o.image,
        model_url,
    )
    .command(lifecycle::command())
    .instance(format!("bench-soak-{}", std::process::id()))
    .warm(roundtable_sandbox::WarmSettings {
        enabled: true,
        max: 2 * n,
        ttl_secs: None,
    })
    .observer(engine_calls.observer())
    .build();
    let warm = roundtable_sandbox::Sandbox::new(c)
        .await
        .context("start the soak runtime")?;
    let mut windows = Vec::new();
    let mut total = 0u64;
    for w in 0..o.soak_windows {
        engine_calls.0.lock().unwrap().clear();
        let cpu0 = cpu_now(dockerd);
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs(secs);
        let run = warm_loops(&warm, n, until, || true).await;
        let warm_wall = t0.elapsed().as_secs_f64();
        let cpu = cpu_per_turn(cpu0, cpu_now(dockerd), run.all);
        let calls = engine_calls.per(run.all.max(1));
        total += run.all;
        let held = process_held();
        let cpu_b0 = cpu_now(dockerd);
        let t1 = Instant::now();
        let until = t1 + Duration::from_secs(bare_secs);
        let loops = (0..n).map(|_| async move {
            let mut s = SideRun::default();
            while Instant::now() < until {
                lifecycle::bare_turn(docker, &o.image, stdin, true).await?;
                s.all += 1;
            }
            Ok::<_, anyhow::Error>(s)
        });
        let bare = sum_runs(futures_util::future::try_join_all(loops).await?);
        let bare_wall = t1.elapsed().as_secs_f64();
        let bare_cpu = cpu_per_turn(cpu_b0, cpu_now(dockerd), bare.all);
        let (warm_rate, bare_rate) = (run.all as f64 / warm_wall, bare.all as f64 / bare_wall);
        println!(
            "window {w}: {total} warm turns so far; warm {warm_rate:.2} turns/s (bench {} ms, dockerd {} ms per turn; {} cold, {} failed), bare {bare_rate:.2} (dockerd {} ms); warm / bare {:.3}; engine ms: {}; held: {held}",
            cpu["bench"], cpu["dockerd"], run.cold, run.failed, bare_cpu["dockerd"],
            warm_rate / bare_rate,
            calls
                .iter()
                .map(|(op, (_, ms))| format!("{op} {ms:.1}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
        windows.push(json!({
            "window": w, "warm_turns": run.all, "warm_turns_total": total,
            "warm_turns_per_s": round3(warm_rate), "bare_turns_per_s": round3(bare_rate),
            "warm_vs_bare": round3(warm_rate / bare_rate),
            "cold": run.cold, "failed": run.failed,
            "warm_cpu_ms_per_turn": cpu, "bare_cpu_ms_per_turn": bare_cpu,
            "engine_mean_ms": calls.iter().map(|(op, (_, ms))| (op.to_string(), json!(round3(*ms)))).collect::<serde_json::Map<_, _>>(),
            "held": held,
        }));
    }
    warm.shutdown().await;
    Ok(json!({"channels": n, "seconds": secs, "bare_seconds": bare_secs, "windows": windows}))
}

/// What this process holds now: RSS (KiB), open files, threads, the tokio runtime's live
/// tasks.
fn process_held() -> Value {
    let count = |dir: &str| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    json!({
        "rss_kib": rss_kib(),
        "fds": count("/proc/self/fd"),
        "threads": count("/proc/self/task"),
        "tokio_tasks": tokio::runtime::Handle::current().metrics().num_alive_tasks(),
    })
}

/// The sum of the loops' runs of one side.
fn sum_runs(runs: Vec<SideRun>) -> SideRun {
    runs.into_iter().fold(SideRun::default(), |a, b| SideRun {
        done: a.done + b.done,
        all: a.all + b.all,
        cold: a.cold + b.cold,
        failed: a.failed + b.failed,
    })
}

/// The warm side: `n` channels each sending turns back to back until `until`, the next
/// container prepared from each reply on (as a channel actor does).
async fn warm_loops(
    warm: &roundtable_sandbox::Sandbox,
    n: usize,
    until: Instant,
    counted: impl Fn() -> bool + Copy,
) -> SideRun {
    let loops = (0..n).map(|c| async move {
        let channel = format!("#tput-{c}");
        let mut s = SideRun::default();
        let mut prepared = lifecycle::prepare(warm, &channel).await.ok();
        while Instant::now() < until {
            if prepared.is_none() {
                s.cold += 1;
            }
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let request = roundtable_sandbox::TurnRequest {
                channel: channel.as_str().into(),
                speaker: roundtable_sandbox::protocol::Speaker {
                    id: "u1".into(),
                    name: "ann".into(),
                },
                text: "hello".into(),
                reset: false,
                stop: tokio_util::sync::CancellationToken::new(),
                admitted: None,
                limits_key: None,
            };
            let turn = warm.run(warm.admit(request), prepared.take(), move |_| {
                let _ = tx.send(());
            });
            // The next container is prepared from the reply on.
            let next = async {
                if rx.await.is_ok() {
                    lifecycle::prepare(warm, &channel).await.ok()
                } else {
                    None
                }
            };
            let (outcome, next) = tokio::join!(turn, next);
            prepared = next;
            if outcome.reply.ok {
                s.all += 1;
                s.done += u64::from(counted());
            } else {
                s.failed += 1;
            }
        }
        if let Some(p) = prepared {
            p.discard("the throughput part ended").await;
        }
        s
    });
    sum_runs(futures_util::future::join_all(loops).await)
}

/// 2c. Where the engine's time per sealed container goes: the throughput of N lifecycles
/// looping at once for each variant of the sealed container with one of its options taken
/// away (and the bare lifecycle), variants rotated between rounds.
async fn ablation(
    o: &Options,
    docker: &bollard::Docker,
    roots: &lifecycle::Roots,
    stdin: &[u8],
) -> Result<Value> {
    let (n, secs) = (o.throughput_channels, o.ablation_seconds);
    println!(
        "\n== 2c. ablation: {n} lifecycles looping at once for each variant of the sealed container, {secs} s each, {} rotating rounds",
        o.rounds
    );
    // The variants, their bodies made once (a body names no container: each lifecycle its
    // own): the sealed container with each option taken away, then without its stdio (what
    // an attach-free turn would cost), then the bare lifecycle with and without attach.
    enum Run {
        Sealed(bollard::models::ContainerCreateBody),
        SealedDetached(bollard::models::ContainerCreateBody),
        Bare,
        BareDetached,
    }
    let bodies = lifecycle::ablations(&lifecycle::driver_spec(&o.image, roots));
    let detached_sealed = lifecycle::without_stdio(bodies[0].1.clone());
    let variants: Vec<(&'static str, Run)> = bodies
        .into_iter()
        .map(|(what, body)| (what, Run::Sealed(body)))
        .chain([
            (
                "sealed without attach (no stdio)",
                Run::SealedDetached(detached_sealed),
            ),
            ("bare lifecycle", Run::Bare),
            (
                "bare lifecycle without attach (no stdio)",
                Run::BareDetached,
            ),
        ])
        .collect();
    let names: Vec<&'static str> = variants.iter().map(|(what, _)| *what).collect();
    let mut rates: Vec<Samples> = names.iter().map(|_| Samples::default()).collect();
    // CPU ms per lifecycle, by variant: the whole machine's and dockerd's.
    let mut machine_ms: Vec<Vec<f64>> = names.iter().map(|_| Vec::new()).collect();
    let mut dockerd_ms: Vec<Vec<f64>> = names.iter().map(|_| Vec::new()).collect();
    let dockerd = find_process("dockerd");
    for r in 0..o.rounds {
        for k in 0..names.len() {
            let v = (r + k) % names.len();
            let until = Instant::now() + Duration::from_secs(secs);
            let t0 = Instant::now();
            let (busy0, d0) = (machine_busy(), cpu_now(dockerd).1);
            let run = &variants[v].1;
            let loops = (0..n).map(|_| async move {
                let mut done = 0u64;
                while Instant::now() < until {
                    let name = || lifecycle::driver_spec(&o.image, roots).name;
                    match run {
                        Run::Sealed(body) => {
                            let body = body.clone();
                            lifecycle::body_turn(docker, &name(), body, stdin, Instant::now())
                                .await?;
                        }
                        Run::SealedDetached(body) => {
                            lifecycle::detached_body_turn(docker, &name(), body.clone()).await?;
                        }
                        Run::Bare => {
                            lifecycle::bare_turn(docker, &o.image, stdin, true).await?;
                        }
                        Run::BareDetached => lifecycle::detached_turn(docker, &o.image).await?,
                    }
                    done += 1;
                }
                Ok::<_, anyhow::Error>(done)
            });
            let done: u64 = futures_util::future::try_join_all(loops)
                .await?
                .iter()
                .sum();
            rates[v].push(Duration::from_secs_f64(
                done as f64 / t0.elapsed().as_secs_f64() / 1000.0,
            ));
            let per = |ticks: u64| ticks as f64 * 10.0 / done.max(1) as f64;
            machine_ms[v].push(per(machine_busy().saturating_sub(busy0)));
            if let (Some(a), Some(b)) = (d0, cpu_now(dockerd).1) {
                dockerd_ms[v].push(per(b.saturating_sub(a)));
            }
        }
    }
    let bare = rates[names.len() - 2].p50();
    let sealed = rates[0].p50();
    let mut out = serde_json::Map::new();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    for (i, (what, r)) in names.iter().zip(&rates).enumerate() {
        let rate = r.p50();
        let (machine, dockerd) = (mean(&machine_ms[i]), mean(&dockerd_ms[i]));
        println!(
            "{what:<42} {rate:>6.2} turns/s  {:.3}x of bare  {:.3}x of sealed  CPU/turn: machine {machine:.1} ms, dockerd {dockerd:.1} ms",
            rate / bare,
            rate / sealed
        );
        out.insert(
            what.to_string(),
            json!({"turns_per_s_p50": round3(rate), "vs_bare": ratio(rate, bare), "vs_sealed": ratio(rate, sealed),
                   "machine_cpu_ms_per_turn": round3(machine), "dockerd_cpu_ms_per_turn": round3(dockerd)}),
        );
    }
    Ok(json!({"channels": n, "seconds": secs, "rounds": o.rounds, "variants": out}))
}

/// The pid of the first process named `comm` (for its CPU time), if any is visible.
fn find_process(comm: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        (name.trim() == comm).then_some(pid)
    })
}

/// The whole machine's busy CPU time so far (every CPU's user, nice, system, irq, softirq
/// and steal from `/proc/stat`), in clock ticks.
fn machine_busy() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|t| {
            let cpu = t.lines().next()?.strip_prefix("cpu ")?.to_owned();
            let f: Vec<u64> = cpu
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal
            Some([0, 1, 2, 5, 6, 7].iter().filter_map(|&i| f.get(i)).sum())
        })
        .unwrap_or(0)
}

/// This process's and dockerd's CPU time so far, in clock ticks.
fn cpu_now(dockerd: Option<u32>) -> (u64, Option<u64>) {
    (
        hostile::cpu_ticks(std::process::id()).unwrap_or(0),
        dockerd.and_then(|p| hostile::cpu_ticks(p).ok()),
    )
}

/// CPU ms per turn between two readings of [`cpu_now`] (clock ticks of 10 ms).
fn cpu_per_turn(a: (u64, Option<u64>), b: (u64, Option<u64>), turns: u64) -> Value {
    let per = |t: u64| round3(t as f64 * 10.0 / turns.max(1) as f64);
    json!({
        "bench": per(b.0.saturating_sub(a.0)),
        "dockerd": a.1.zip(b.1).map(|(a, b)| per(b.saturating_sub(a))),
    })
}

/// Counts the runtime's engine calls by operation (its events' `Engine`), with their time.
#[derive(Clone, Default)]
struct EngineCalls(Arc<Mutex<BTreeMap<&'static str, (u64, Duration)>>>);

impl EngineCalls {
    fn observer(&self) -> roundtable_sandbox::events::Observer {
        let calls = self.0.clone();
        Arc::new(move |e: &roundtable_sandbox::events::Event| {
            if let roundtable_sandbox::events::EventKind::Engine { op, latency, .. } = e.kind {
                let mut calls = calls.lock().unwrap();
                let c = calls.entry(op).or_default();
                c.0 += 1;
                c.1 += latency;
            }
        })
    }

    /// Calls per turn of `turns`, and each call's mean time in ms, by operation.
    fn per(&self, turns: u64) -> Vec<(&'static str, (f64, f64))> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(op, (n, t))| {
                (
                    *op,
                    (
                        *n as f64 / turns as f64,
                        t.as_secs_f64() * 1000.0 / (*n).max(1) as f64,
                    ),
                )
            })
            .collect()
    }
}

async fn broker(o: &Options, model: &broker_bench::Model) -> Result<Value> {
    println!(
        "\n== 3. broker: a model call through the broker vs straight to the scripted model, {} interleaved calls each",
        o.broker_calls
    );
    let mut b = broker_bench::BrokerUnderTest::start(&model.url()).await?;
    let direct = Target::Direct(model.addr);
    let plain = broker_bench::chat_body(false);
    let streamed = broker_bench::chat_body(true);
    let mut out = json!({});

    // Round trips (non-streamed) and first streamed event, interleaved.
    let mut rt_b = Samples::default();
    let mut rt_d = Samples::default();
    let mut fe_b = Samples::default();
    let mut fe_d = Samples::default();
    let mut st_b = Samples::default();
    let mut st_d = Samples::default();
    let mut calls = 0usize;
    for i in 0..(o.broker_calls + 50) {
        if calls + 4 > 9_000 {
            b.relisten().await?;
            calls = 0;
        }
        let via = Target::Broker(b.socket());
        let warm = i < 50;
        let order: [&Target; 2] = if i % 2 == 0 {
            [&via, &direct]
        } else {
            [&direct, &via]
        };
        for t in order {
            let plain_t = broker_bench::call(t, &plain, false).await?;
            let stream_t = broker_bench::call(t, &streamed, true).await?;
            calls += 2;
            if warm {
                continue;
            }
            let (rt, fe, st) = match t {
                Target::Broker(_) => (&mut rt_b, &mut fe_b, &mut st_b),
                Target::Direct(_) => (&mut rt_d, &mut fe_d, &mut st_d),
            };
            rt.push(plain_t.total);
            fe.push(stream_t.first_event.context("no event")?);
            st.push(stream_t.total);
        }
    }
    println!(
        "{:<30} {:>10} {:>10} {:>10} {:>10}",
        "(ms)", "broker p50", "direct p50", "broker p95", "direct p95"
    );
    for (name, bs, ds) in [
        ("round trip", &rt_b, &rt_d),
        ("first streamed event", &fe_b, &fe_d),
        ("whole stream", &st_b, &st_d),
    ] {
        println!(
            "{:<30} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
            name,
            bs.p50(),
            ds.p50(),
            bs.p95(),
            ds.p95()
        );
    }
    let added = rt_b.p50() - rt_d.p50();
    let added_fe = fe_b.p50() - fe_d.p50();
    println!(
        "broker-added p50: round trip {:.3} ms, first streamed event {:.3} ms",
        added, added_fe
    );
    out["round_trip"] = json!({"broker": rt_b.json(), "direct": rt_d.json()});
    out["first_streamed_event"] = json!({"broker": fe_b.json(), "direct": fe_d.json()});
    out["whole_stream"] = json!({"broker": st_b.json(), "direct": st_d.json()});
    out["added_p50_ms"] = json!(round3(added));
    out["added_p95_ms"] = json!(round3(rt_b.p95() - rt_d.p95()));
    out["added_first_event_p50_ms"] = json!(round3(added_fe));

    // Throughput: 8 concurrent guest-style callers, alternating paths.
    let (workers, per) = (8usize, (o.broker_calls / 4).max(25));
    let mut rps_b = Vec::new();
    let mut rps_d = Vec::new();
    for k in 0..4 {
        b.relisten().await?;
        let via = Target::Broker(b.socket());
        if k % 2 == 0 {
            rps_b.push(broker_bench::throughput(&via, workers, per).await?);
            rps_d.push(broker_bench::throughput(&direct, workers, per).await?);
        } else {
            rps_d.push(broker_bench::throughput(&direct, workers, per).await?);
            rps_b.push(broker_bench::throughput(&via, workers, per).await?);
        }
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!(
        "requests/s with {workers} concurrent callers (best of {}): broker {:.0}, direct {:.0} ({:.2}×)",
        rps_b.len(),
        best(&rps_b),
        best(&rps_d),
        best(&rps_b) / best(&rps_d)
    );
    out["rps"] = json!({
        "workers": workers, "calls_per_worker": per,
        "broker": rps_b.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        "direct": rps_d.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        "broker_best": round3(best(&rps_b)), "direct_best": round3(best(&rps_d)),
    });
    Ok(out)
}

/// Issue 23, item 8: the same warm turns and broker calls with accounting and budgets on
/// (a SQLite state file, every budget set far from reached) against off, interleaved;
/// `with_metrics`: the metrics adapter on the event seam too, its endpoint served and
/// scraped every second, against all off.
async fn accounting(o: &Options, model: &broker_bench::Model, with_metrics: bool) -> Result<Value> {
    println!(
        "\n== {}: {} warm turns and {} broker calls each, interleaved",
        if with_metrics {
            "8. metrics, accounting, budgets and audit on vs all off"
        } else {
            "7. accounting, budgets and audit on vs off"
        },
        o.iterations,
        o.broker_calls
    );
    let state_dir = tempfile::Builder::new()
        .prefix("rtb-budgets-")
        .tempdir_in(lifecycle::bench_dir())?;
    let state_file = state_dir.path().join("budgets.sqlite");
    let (off_roots, on_roots) = (lifecycle::Roots::new()?, lifecycle::Roots::new()?);
    let off = lifecycle::warm_sandbox(&o.image, &off_roots, &model.url()).await?;
    let metrics =
        with_metrics.then(|| std::sync::Arc::new(roundtable_sandbox_metrics::Metrics::new()));
    let server = match &metrics {
        Some(m) => Some(roundtable_sandbox_metrics::MetricsServer::start(
            "127.0.0.1:0".parse()?,
            false,
            m.clone(),
        )?),
        None => None,
    };
    let scraper = server.as_ref().map(|s| Scraper::start(s.local_addr()));
    let observer = metrics.as_ref().map(|m| m.observer());
    let on = lifecycle::observed_warm_sandbox(
        &o.image,
        &on_roots,
        &model.url(),
        &state_file,
        observer.clone(),
    )
    .await?;
    let (mut reply_off, mut reply_on) = (Samples::default(), Samples::default());
    // When each phase of the warm turns began, by side (on, off): where a difference is.
    let mut phases: [BTreeMap<String, Samples>; 2] = Default::default();
    for i in 0..(o.iterations + o.warmup) {
        let channel = format!("#bench-{}", i % 8);
        let order: [(&roundtable_sandbox::Sandbox, bool); 2] = if i % 2 == 0 {
            [(&off, false), (&on, true)]
        } else {
            [(&on, true), (&off, false)]
        };
        for (sandbox, counted) in order {
            let (t, began) = lifecycle::warm_turn(sandbox, &channel).await?;
            if i >= o.warmup {
                for (phase, at) in began {
                    phases[usize::from(!counted)]
                        .entry(phase)
                        .or_default()
                        .push(at);
                }
                if counted {
                    reply_on.push(t.reply);
                } else {
                    reply_off.push(t.reply);
                }
            }
        }
    }
    off.shutdown().await;
    on.shutdown().await;
    drop((off, on));

    let book = roundtable_sandbox::internals::budgets::BudgetBook::open(
        &roundtable_sandbox::BudgetSettings {
            state_file: Some(state_dir.path().join("broker.sqlite")),
            speaker_tokens_per_day: Some(1_000_000_000_000),
            channel_tokens_per_day: Some(1_000_000_000_000),
            bot_tokens_per_day: Some(1_000_000_000_000),
            speaker_turns_per_minute: None,
            ..Default::default()
        },
        "UTC",
    )?
    .context("a state file is named")?;
    let mut b_off = broker_bench::BrokerUnderTest::start(&model.url()).await?;
    // The *on* broker's turns audited too, as the warm turns' runtime's are: each "turn"'s
    // model calls gathered, its line written when the round stops it.
    let audit = roundtable_sandbox::internals::audit::AuditTrail::open(
        &state_dir.path().join("broker-audit.jsonl"),
        false,
    )?;
    let mut b_on = broker_bench::BrokerUnderTest::start_observed(
        &model.url(),
        Some(book),
        observer,
        Some(audit.clone()),
    )
    .await?;
    let plain = broker_bench::chat_body(false);
    let (mut rt_off, mut rt_on) = (Samples::default(), Samples::default());
    let mut calls = 0usize;
    for i in 0..(o.broker_calls + 50) {
        if calls + 2 > 9_000 {
            b_off.relisten().await?;
            b_on.relisten().await?;
            calls = 0;
        }
        let (via_off, via_on) = (
            Target::Broker(b_off.socket()),
            Target::Broker(b_on.socket()),
        );
        let order = if i % 2 == 0 {
            [(&via_off, false), (&via_on, true)]
        } else {
            [(&via_on, true), (&via_off, false)]
        };
        for (t, counted) in order {
            let timing = broker_bench::call(t, &plain, false).await?;
            if i >= 50 {
                if counted {
                    rt_on.push(timing.total);
                } else {
                    rt_off.push(timing.total);
                }
            }
        }
        calls += 1;
    }
    // `--broker-rounds` (18) interleaved runs of 9,600 calls each (under the bench broker's
    // 10,000 calls per "turn"; about a second each): short runs of a few thousand calls
    // spread by ±25 %. The process's CPU time per request (callers, broker and model all
    // in this process) is measured beside each run: it moves less than the rate with what
    // else runs. A third broker, all off like the *off* one, is the A/A control: its ratio
    // to *off* is what this machine reads for two identical brokers.
    let (workers, per, runs) = (8usize, 1_200usize, o.broker_rounds);
    let b_ctl = broker_bench::BrokerUnderTest::start(&model.url()).await?;
    let mut brokers = [b_off, b_on, b_ctl];
    // Two shapes: the 8 callers in one turn (the bench's first shape: a turn's calls at
    // once, past the default 4 in flight), and in 8 turns of one caller each (a busy bot:
    // each turn's calls one after another, every turn its own account and events).
    let one_turn = broker_rounds(&mut brokers, runs, workers, per, 1).await?;
    let eight_turns = broker_rounds(&mut brokers, runs, workers, per, workers).await?;
    let reply_ratio = reply_on.p50() / reply_off.p50();
    let reply_ci = stats::paired_p50_ratio_ci(&reply_on, &reply_off);
    println!(
        "warm reply p50: on {:.2} ms, off {:.2} ms ({:.3}×, 95 % interval {}); broker round trip p50: on {:.3} ms, off {:.3} ms",
        reply_on.p50(),
        reply_off.p50(),
        reply_ratio,
        interval(reply_ci),
        rt_on.p50(),
        rt_off.p50(),
    );
    let phase_starts: serde_json::Map<String, Value> = phases[0]
        .iter()
        .filter_map(|(phase, on)| Some((phase, on, phases[1].get(phase)?)))
        .map(|(phase, on, off)| {
            (
                phase.clone(),
                json!({"on_p50_ms": round3(on.p50()), "off_p50_ms": round3(off.p50())}),
            )
        })
        .collect();
    // Each iteration ran one turn a side back to back: the median of the iterations' on −
    // off differences (µs), with its interval, says where a difference is.
    let paired_diff = |on: &Samples, off: &Samples| {
        let d: Vec<f64> = on
            .values()
            .iter()
            .zip(off.values())
            .map(|(a, b)| (a - b) * 1000.0)
            .collect();
        format!(
            "{:+.0} µs {}",
            stats::median(&d),
            stats::median_ci(&d)
                .map_or_else(String::new, |(lo, hi)| format!("[{lo:+.0}, {hi:+.0}]"))
        )
    };
    println!(
        "  on − off, the iterations' median (95 % interval): reply {}; phase began: {}",
        paired_diff(&reply_on, &reply_off),
        phases[0]
            .iter()
            .filter_map(|(phase, on)| Some((phase, paired_diff(on, phases[1].get(phase)?))))
            .map(|(phase, d)| format!("{phase} {d}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  warm turns' phases began at (p50 ms, on / off): {}; the reply: deciles on {} / off {}",
        phase_starts
            .iter()
            .map(|(p, v)| format!("{p} {} / {}", v["on_p50_ms"], v["off_p50_ms"]))
            .collect::<Vec<_>>()
            .join(", "),
        deciles(&reply_on),
        deciles(&reply_off),
    );
    let one = one_turn.report(&format!("{workers} callers in one turn"));
    let eight = eight_turns.report(&format!("{workers} turns of one caller"));
    let scrapes = scraper.map(Scraper::stop);
    let model_calls = metrics.as_ref().and_then(|m| {
        m.sample("gen_ai_client_operation_duration_seconds_count{gen_ai_operation_name=\"chat\",roundtable_operation=\"chat\",error_type=\"none\"}")
    });
    if let (Some(scrapes), Some(calls)) = (scrapes, model_calls) {
        println!("  (metrics: {scrapes} scrapes of /metrics during the part; {calls} model calls recorded)");
    }
    drop(server);
    drop(brokers);
    let audited = audit
        .flush(std::time::Duration::from_secs(30))
        .then(|| audit.stats());
    if let Some(st) = audited {
        println!(
            "  (audit: {} lines of the broker's turns written)",
            st.written
        );
    }
    Ok(json!({
        "broker_audit_lines": audited.map(|s| s.written),
        "scrapes": scrapes,
        "model_calls_recorded": model_calls,
        "warm_reply": {"on": reply_on.json(), "off": reply_off.json()},
        // Each iteration's pair (ms, in order): runs of the same code can be pooled.
        "warm_reply_pairs": {
            "on": reply_on.values().iter().map(|x| round3(*x)).collect::<Vec<_>>(),
            "off": reply_off.values().iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        },
        "warm_reply_on_vs_off_p50": round3(reply_ratio),
        "warm_reply_on_vs_off_p50_ci95": reply_ci.map(|(a, b)| [round3(a), round3(b)]),
        "warm_phase_starts": phase_starts,
        "broker_round_trip": {"on": rt_on.json(), "off": rt_off.json()},
        "rps_paired_on_vs_off": one["rps_paired_on_vs_off"],
        "one_turn": one,
        "turns": eight,
    }))
}

/// Issue 47: the budgets' PostgreSQL store against the SQLite file, same run (`--only
/// store`, not run by default): warm turns of three runtimes interleaved (SQLite, PostgreSQL,
/// and a second SQLite one, the A/A control), each with every budget set far from reached;
/// then part 8's broker rounds with a SQLite book, a PostgreSQL book and a second SQLite
/// one (the control). The PostgreSQL server runs here, on loopback, as this user, with
/// `fsync` on (as the SQLite file's `synchronous = FULL`). The PostgreSQL store's
/// statements and round trips are counted per commit interval and per turn.
async fn budget_store(o: &Options, model: &broker_bench::Model) -> Result<Value> {
    use roundtable_sandbox::internals::budgets::{BudgetBook, COMMIT_INTERVAL};
    use roundtable_sandbox_test_support::postgres::Postgres;
    println!(
        "\n== 11. budgets: PostgreSQL store vs SQLite file: {} warm turns a side and {} broker rounds",
        o.iterations, o.broker_rounds
    );
    let pg = tokio::task::spawn_blocking(Postgres::start).await?;
    pg.create_db("bench");
    let dir = tempfile::Builder::new()
        .prefix("rtb-store-")
        .tempdir_in(lifecycle::bench_dir())?;
    let url_file = dir.path().join("budgets-url");
    std::fs::write(&url_file, pg.url("bench"))?;
    let roots = [
        lifecycle::Roots::new()?,
        lifecycle::Roots::new()?,
        lifecycle::Roots::new()?,
    ];
    let sides = [
        lifecycle::budget_store_sandbox(
            &o.image,
            &roots[0],
            &model.url(),
            &dir.path().join("a.sqlite"),
            None,
            "a",
        )
        .await?,
        lifecycle::budget_store_sandbox(
            &o.image,
            &roots[1],
            &model.url(),
            &dir.path().join("b.sqlite"),
            Some(&url_file),
            "bench",
        )
        .await?,
        lifecycle::budget_store_sandbox(
            &o.image,
            &roots[2],
            &model.url(),
            &dir.path().join("c.sqlite"),
            None,
            "c",
        )
        .await?,
    ];
    let stats = sides[1]
        .budgets()
        .and_then(|b| b.store_stats())
        .context("the PostgreSQL side's store")?;
    let mut reply: [Samples; 3] = Default::default();
    let count = |s: &roundtable_sandbox::internals::budgets::PgStats| {
        use std::sync::atomic::Ordering::Relaxed;
        (s.statements.load(Relaxed), s.round_trips.load(Relaxed))
    };
    let mut measured = (count(&stats), Instant::now(), 0usize);
    for i in 0..(o.iterations + o.warmup) {
        if i == o.warmup {
            measured = (count(&stats), Instant::now(), 0);
        }
        let channel = format!("#bench-{}", i % 8);
        // The three in a rotating order.
        for k in 0..3 {
            let side = (i + k) % 3;
            let (t, _) = lifecycle::warm_turn(&sides[side], &channel).await?;
            if i >= o.warmup {
                reply[side].push(t.reply);
                if side == 1 {
                    measured.2 += 1;
                }
            }
        }
    }
    let ((st0, rt0), t0, turns) = measured;
    let (st1, rt1) = count(&stats);
    let secs = t0.elapsed().as_secs_f64();
    let intervals = secs / COMMIT_INTERVAL.as_secs_f64();
    for s in &sides {
        s.shutdown().await;
    }
    drop(sides);
    let ratio_pg = reply[1].p50() / reply[0].p50();
    let ci_pg = stats::paired_p50_ratio_ci(&reply[1], &reply[0]);
    let ratio_aa = reply[2].p50() / reply[0].p50();
    let ci_aa = stats::paired_p50_ratio_ci(&reply[2], &reply[0]);
    let (st, rt) = ((st1 - st0) as f64, (rt1 - rt0) as f64);
    println!(
        "warm reply p50: SQLite {:.2} ms, PostgreSQL {:.2} ms: {ratio_pg:.3}× (95 % interval {}); \
         A/A control (a second SQLite runtime / the first): {ratio_aa:.3}× ({})",
        reply[0].p50(),
        reply[1].p50(),
        interval(ci_pg),
        interval(ci_aa),
    );
    println!(
        "  PostgreSQL store during the warm turns ({turns} turns of its side in {secs:.1} s, {:.2} turns/s of it, \
         {:.2} turns/s in all): {:.2} statements and {:.2} round trips per commit interval, {:.2} statements \
         and {:.2} round trips per turn",
        turns as f64 / secs,
        3.0 * turns as f64 / secs,
        st / intervals,
        rt / intervals,
        st / turns.max(1) as f64,
        rt / turns.max(1) as f64,
    );
    // The broker: three books, one broker each.
    let settings = |file: &str, store: bool| roundtable_sandbox::BudgetSettings {
        state_file: Some(dir.path().join(file)),
        speaker_tokens_per_day: Some(1_000_000_000_000),
        channel_tokens_per_day: Some(1_000_000_000_000),
        bot_tokens_per_day: Some(1_000_000_000_000),
        store: store.then(|| {
            roundtable_sandbox::StoreSource::Ref(roundtable_sandbox::KeyRef {
                env: None,
                file: Some(url_file.clone()),
            })
        }),
        namespace: store.then(|| "broker".to_owned()),
        ..Default::default()
    };
    let books = [
        BudgetBook::open(&settings("ba.sqlite", false), "UTC")?.context("book")?,
        BudgetBook::open(&settings("bb.sqlite", true), "UTC")?.context("book")?,
        BudgetBook::open(&settings("bc.sqlite", false), "UTC")?.context("book")?,
    ];
    let bstats = books[1].store_stats().context("the broker's store")?;
    let mut brokers = [
        broker_bench::BrokerUnderTest::start_observed(
            &model.url(),
            Some(books[0].clone()),
            None,
            None,
        )
        .await?,
        broker_bench::BrokerUnderTest::start_observed(
            &model.url(),
            Some(books[1].clone()),
            None,
            None,
        )
        .await?,
        broker_bench::BrokerUnderTest::start_observed(
            &model.url(),
            Some(books[2].clone()),
            None,
            None,
        )
        .await?,
    ];
    let (b0, bt0) = (count(&bstats), Instant::now());
    let rounds = broker_rounds(&mut brokers, o.broker_rounds, 8, 1_200, 1).await?;
    let (b1, bsecs) = (count(&bstats), bt0.elapsed().as_secs_f64());
    println!("  (broker: off = SQLite book, on = PostgreSQL book, control = a second SQLite book)");
    let broker = rounds.report("8 callers in one turn, SQLite vs PostgreSQL book");
    let calls = (o.broker_rounds * 8 * 1_200 * 3) as f64;
    let pg_calls = calls / 3.0;
    let bintervals = bsecs / COMMIT_INTERVAL.as_secs_f64();
    println!(
        "  PostgreSQL store during the broker rounds ({pg_calls:.0} calls of its broker in {bsecs:.1} s): \
         {:.2} statements and {:.2} round trips per commit interval",
        (b1.0 - b0.0) as f64 / bintervals,
        (b1.1 - b0.1) as f64 / bintervals,
    );
    drop(brokers);
    drop(books);
    Ok(json!({
        "warm_reply": {"sqlite": reply[0].json(), "postgres": reply[1].json(), "control": reply[2].json()},
        "warm_reply_pg_vs_sqlite_p50": round3(ratio_pg),
        "warm_reply_pg_vs_sqlite_p50_ci95": ci_pg.map(|(a, b)| [round3(a), round3(b)]),
        "warm_reply_control_p50": round3(ratio_aa),
        "warm_reply_control_p50_ci95": ci_aa.map(|(a, b)| [round3(a), round3(b)]),
        "pg_per_interval_warm": {"statements": round3(st / intervals), "round_trips": round3(rt / intervals)},
        "pg_per_turn": {"statements": round3(st / turns.max(1) as f64), "round_trips": round3(rt / turns.max(1) as f64)},
        "pg_turn_rate": round3(turns as f64 / secs),
        "pg_per_interval_broker": {
            "statements": round3((b1.0 - b0.0) as f64 / bintervals),
            "round_trips": round3((b1.1 - b0.1) as f64 / bintervals),
        },
        "broker": broker,
    }))
}

/// `--broker-side on|off|on8|off8`: part 8's *on* or *off* broker alone, 8 callers in one
/// turn (or in 8 turns of their own); prints the rate and the CPU time by thread name.
fn broker_side(o: &Options, on: bool, eight: bool) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let model = broker_bench::Model::start().await?;
        let state_dir = tempfile::Builder::new()
            .prefix("rtb-budgets-")
            .tempdir_in(lifecycle::bench_dir())?;
        let metrics = on.then(|| Arc::new(roundtable_sandbox_metrics::Metrics::new()));
        let book = match on {
            true => roundtable_sandbox::internals::budgets::BudgetBook::open(
                &roundtable_sandbox::BudgetSettings {
                    state_file: Some(state_dir.path().join("broker.sqlite")),
                    speaker_tokens_per_day: Some(1_000_000_000_000),
                    channel_tokens_per_day: Some(1_000_000_000_000),
                    bot_tokens_per_day: Some(1_000_000_000_000),
                    speaker_turns_per_minute: None,
                    ..Default::default()
                },
                "UTC",
            )?,
            false => None,
        };
        let audit = match on {
            true => Some(roundtable_sandbox::internals::audit::AuditTrail::open(
                &state_dir.path().join("audit.jsonl"),
                false,
            )?),
            false => None,
        };
        let mut b = broker_bench::BrokerUnderTest::start_observed(
            &model.url(),
            book,
            metrics.as_ref().map(|m| m.observer()),
            audit,
        )
        .await?;
        let targets: Vec<Target> = match eight {
            true => b
                .listen_turns(8)
                .await?
                .into_iter()
                .map(Target::Broker)
                .collect(),
            false => vec![Target::Broker(b.socket())],
        };
        let (workers, per) = (8usize, (o.broker_calls / 8).clamp(1, 100_000));
        let before = thread_cpu();
        let rps = broker_bench::throughput_over(&targets, workers, per).await?;
        let after = thread_cpu();
        let [user, system, ..] = process_usage();
        println!(
            "broker {}: {} calls, {rps:.0}/s; process CPU user {:.0} ms, system {:.0} ms",
            if on { "on" } else { "off" },
            workers * per,
            user / 1e3,
            system / 1e3
        );
        let mut by: Vec<(String, f64)> = after
            .into_iter()
            .map(|(name, t)| {
                let t0 = before.get(&name).copied().unwrap_or(0.0);
                (name, t - t0)
            })
            .filter(|(_, t)| *t > 0.0)
            .collect();
        by.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (name, t) in by {
            println!(
                "  thread {name}: {:.1} µs per call",
                t / (workers * per) as f64
            );
        }
        Ok(())
    })
}

/// CPU time (µs) of this process's threads, summed by thread name: each thread's time on a
/// CPU from `schedstat` (nanoseconds; `stat`'s ticks are 10 ms, too coarse for a writer
/// thread's share).
fn thread_cpu() -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in dir.flatten() {
        let (Ok(name), Ok(stat)) = (
            std::fs::read_to_string(task.path().join("comm")),
            std::fs::read_to_string(task.path().join("schedstat")),
        ) else {
            continue;
        };
        let ns = stat
            .split(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        *out.entry(name.trim().to_owned()).or_insert(0.0) += ns / 1e3;
    }
    out
}

/// The 10th to 90th percentiles of `s` (ms), for a distribution's shape at a glance.
fn deciles(s: &Samples) -> String {
    (1..10)
        .map(|d| format!("{:.2}", s.pct(f64::from(d) * 10.0)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The broker throughput rounds of parts 7 and 8, by side (*off*, *on*, the control): each
/// round's requests/s, and per request its process CPU, user and system time (µs) and
/// voluntary and involuntary context switches.
#[derive(Default)]
struct BrokerRounds {
    rps: [Vec<f64>; 3],
    usage: [Vec<[f64; 4]>; 3],
}

/// `runs` rounds of the three brokers in a balanced order, `workers` callers of `per` calls
/// each, spread over `turns` turns of each broker (fresh ones every round).
async fn broker_rounds(
    brokers: &mut [broker_bench::BrokerUnderTest; 3],
    runs: usize,
    workers: usize,
    per: usize,
    turns: usize,
) -> Result<BrokerRounds> {
    let mut out = BrokerRounds::default();
    for k in 0..runs {
        let mut vias: Vec<Vec<Target>> = Vec::new();
        for b in brokers.iter_mut() {
            vias.push(if turns == 1 {
                b.relisten().await?;
                vec![Target::Broker(b.socket())]
            } else {
                b.listen_turns(turns)
                    .await?
                    .into_iter()
                    .map(Target::Broker)
                    .collect()
            });
        }
        // The three in a balanced order: over six rounds each runs in each position
        // twice and right after each other side once (the rotation k, k+1, k+2 put *off*
        // right after the control in two rounds of three: the control read 0.94).
        for side in stats::balanced_order(3, k) {
            let u0 = process_usage();
            let rps = broker_bench::throughput_over(&vias[side], workers, per).await?;
            let u1 = process_usage();
            let calls = (workers * per) as f64;
            out.rps[side].push(rps);
            out.usage[side].push(std::array::from_fn(|i| (u1[i] - u0[i]) / calls));
        }
    }
    Ok(out)
}

impl BrokerRounds {
    /// CPU µs per request of each round of `side`.
    fn cpu(&self, side: usize) -> Vec<f64> {
        self.usage[side].iter().map(|u| u[0] + u[1]).collect()
    }

    /// Prints the shape's figures (`what`) and returns them as JSON.
    fn report(&self, what: &str) -> Value {
        let (median, paired) = (stats::median, stats::paired_median);
        let [off, on, ctl] = &self.rps;
        let (cpu_off, cpu_on, cpu_ctl) = (self.cpu(0), self.cpu(1), self.cpu(2));
        let runs = off.len();
        // Each pair ran back to back: the median of the pairs' ratios cancels the machine's
        // drift between pairs (seen: one side's rate moving 8,000 to 11,600 over a part).
        let rps_paired = paired(on, off);
        let cpu_paired = paired(&cpu_on, &cpu_off);
        let (rps_aa, cpu_aa) = (paired(ctl, off), paired(&cpu_ctl, &cpu_off));
        // The pairs' median's 95 % interval (distribution-free): what the run can tell apart.
        let (rps_ci, aa_ci) = (
            stats::paired_median_ci(on, off),
            stats::paired_median_ci(ctl, off),
        );
        println!(
            "requests/s, {what} (medians of {runs}): on {:.0}, off {:.0}; median of the {runs} pairs' ratios {rps_paired:.3}× \
             (95 % interval {}); process CPU per request (medians): on {:.1} µs, off {:.1} µs (pairs {cpu_paired:.3}×)",
            median(on),
            median(off),
            interval(rps_ci),
            median(&cpu_on),
            median(&cpu_off),
        );
        println!(
            "  A/A control (a second all-off broker / off, same rounds): requests/s pairs {rps_aa:.3}× ({}), \
             CPU per request pairs {cpu_aa:.3}×",
            interval(aa_ci),
        );
        for (name, d) in ["off", "on", "control"].iter().zip(&self.usage) {
            let col = |i: usize| median(&d.iter().map(|x| x[i]).collect::<Vec<_>>());
            println!(
                "  per request, {name}: user {:.1} µs, system {:.1} µs, voluntary switches {:.2}, involuntary {:.2}",
                col(0),
                col(1),
                col(2),
                col(3)
            );
        }
        let list = |v: &[f64]| v.iter().map(|x| round3(*x)).collect::<Vec<_>>();
        json!({
            "rps": {"on": list(on), "off": list(off), "control": list(ctl)},
            "cpu_us_per_request": {"on": list(&cpu_on), "off": list(&cpu_off), "control": list(&cpu_ctl)},
            "rps_paired_on_vs_off": round3(rps_paired),
            "rps_paired_on_vs_off_ci95": rps_ci.map(|(a, b)| [round3(a), round3(b)]),
            "cpu_per_request_paired_on_vs_off": round3(cpu_paired),
            "control_rps_paired": round3(rps_aa),
            "control_rps_paired_ci95": aa_ci.map(|(a, b)| [round3(a), round3(b)]),
            "control_cpu_per_request_paired": round3(cpu_aa),
        })
    }
}

/// A 95 % interval as `[lo, hi]`, or why there is none.
fn interval(ci: Option<(f64, f64)>) -> String {
    ci.map_or_else(
        || "too few samples".to_owned(),
        |(lo, hi)| format!("[{lo:.3}, {hi:.3}]"),
    )
}

/// This process's user and system CPU time so far (µs) and its voluntary and involuntary
/// context switches, every thread.
fn process_usage() -> [f64; 4] {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_SELF).map_or([0.0; 4], |u| {
        let us = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 * 1e6 + tv.tv_usec() as f64;
        [
            us(u.user_time()),
            us(u.system_time()),
            u.voluntary_context_switches() as f64,
            u.involuntary_context_switches() as f64,
        ]
    })
}

/// Scrapes `/metrics` once a second on a thread of its own, as Prometheus would.
struct Scraper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Scraper {
    fn start(addr: std::net::SocketAddr) -> Self {
        use std::io::{Read, Write};
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut n = 0;
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(mut s) = std::net::TcpStream::connect(addr) {
                    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
                    let mut body = Vec::new();
                    if s.read_to_end(&mut body).is_ok() && body.starts_with(b"HTTP/1.0 200") {
                        n += 1;
                    }
                }
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            n
        });
        Self { stop, thread }
    }

    fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// The issue's targets against the figures of this run.
fn targets(r: &Value) -> Value {
    let f = |v: &Value| v.as_f64();
    let mut t = Vec::new();
    let mut add = |name: &str, value: Option<f64>, limit: f64, unit: &str| {
        t.push(json!({
            "target": name, "value": value.map(round3), "limit": limit, "unit": unit,
            "met": value.map(|v| v <= limit),
        }));
    };
    let ratios = &r["turn"]["ratios"];
    add(
        "runtime reply / bare API lifecycle (p50)",
        f(&ratios["runtime_reply_vs_bare_reply_p50"]),
        1.10,
        "×",
    );
    add(
        "runtime total / bare API lifecycle total (p50)",
        f(&ratios["runtime_total_vs_bare_total_p50"]),
        1.10,
        "×",
    );
    // Issue 16 (warm turns): a turn in a prepared container, and the cold path unchanged.
    add(
        "warm reply / bare API lifecycle (p50)",
        f(&ratios["runtime_warm_reply_vs_bare_reply_p50"]),
        0.25,
        "×",
    );
    add(
        "cold reply / bare API lifecycle (p50, issue 16)",
        f(&ratios["runtime_reply_vs_bare_reply_p50"]),
        1.05,
        "×",
    );
    add(
        "runtime reply / docker CLI (p50)",
        f(&ratios["runtime_reply_vs_cli_p50"]),
        0.8,
        "×",
    );
    add(
        "broker-added latency (p50)",
        f(&r["broker"]["added_p50_ms"]),
        0.5,
        "ms",
    );
    add(
        "RSS per idle channel",
        f(&r["memory"]["idle_channels"]["per_channel_kib"]),
        4.0,
        "KiB",
    );
    // Issue 23, item 8: accounting and budgets on against off.
    add(
        "warm reply with accounting and budgets / without (p50)",
        f(&r["accounting"]["warm_reply_on_vs_off_p50"]),
        1.02,
        "×",
    );
    // The median of the interleaved pairs' ratios (the best-of ratio spread ±10 % in an
    // A/A control of two identical brokers; the pairs' median, balanced, ±1.6 %).
    let at_least = |name: &str, value: Option<f64>, limit: f64| {
        json!({
            "target": name, "value": value.map(round3), "limit": limit, "unit": "× (at least)",
            "met": value.map(|v| v >= limit),
        })
    };
    t.push(at_least(
        "broker throughput with accounting and budgets / without (pairs' median), 8 callers in one turn",
        f(&r["accounting"]["rps_paired_on_vs_off"]),
        0.97,
    ));
    t.push(at_least(
        "broker throughput with accounting and budgets / without (pairs' median), 8 turns",
        f(&r["accounting"]["turns"]["rps_paired_on_vs_off"]),
        0.97,
    ));
    // Issue 23, item 8: metrics, accounting and budgets on against all off.
    let at_most = |name: &str, value: Option<f64>, limit: f64| {
        json!({
            "target": name, "value": value.map(round3), "limit": limit, "unit": "×",
            "met": value.map(|v| v <= limit),
        })
    };
    t.push(at_most(
        "warm reply with metrics and accounting / all off (p50)",
        f(&r["observed"]["warm_reply_on_vs_off_p50"]),
        1.02,
    ));
    t.push(at_least(
        "broker throughput with metrics and accounting / all off (pairs' median), 8 callers in one turn",
        f(&r["observed"]["rps_paired_on_vs_off"]),
        0.97,
    ));
    t.push(at_least(
        "broker throughput with metrics and accounting / all off (pairs' median), 8 turns",
        f(&r["observed"]["turns"]["rps_paired_on_vs_off"]),
        0.97,
    ));
    // Issue 24: 32 warm channels back to back against 32 bare lifecycles looping.
    t.push(at_least(
        "throughput, warm channels / bare lifecycles (rounds' median)",
        f(&r["throughput"]["ratio"]),
        1.0,
    ));
    t.push(at_most(
        "idle channels' memory with metrics and accounting / all off",
        f(&r["observed"]["idle_channels"]["on_vs_off_growth"]),
        1.05,
    ));
    Value::Array(t)
}

fn print_targets(t: &Value) {
    println!("\n== targets");
    for row in t.as_array().into_iter().flatten() {
        let met = match row["met"].as_bool() {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "not measured",
        };
        println!(
            "{:<48} {:>9} {} (limit {} {})  {}",
            row["target"].as_str().unwrap_or(""),
            row["value"]
                .as_f64()
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into()),
            row["unit"].as_str().unwrap_or(""),
            row["limit"],
            row["unit"].as_str().unwrap_or(""),
            met
        );
    }
}
