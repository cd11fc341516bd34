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
//! Layout: [`parts`] (one module per part, each returning its figures typed),
//! [`results`] (the JSON root, the machine, the targets), [`stats`] (samples, ratios,
//! medians, intervals, balanced orders), [`probe`] (RSS, CPU time, engine calls),
//! [`harness`] (the lifecycles, the scripted model and the broker under test, the actor
//! layer's path). See docs/benchmarks.md for the figures.

mod harness;
mod parts;
mod probe;
mod results;
mod stats;

use roundtable_sandbox::internals::testing::DockerDriverExt;

use anyhow::{bail, Result};
use clap::{CommandFactory, Parser};
use roundtable_sandbox::DockerDriver;
use serde::Serialize;

use harness::{broker::Model, lifecycle};
use parts::{hostile, memory, Bench};
use results::{Machine, Results, RunOptions};

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
        value_parser = ["turn", "gvisor", "concurrency", "throughput", "ablation", "broker", "memory", "accounting", "observed", "soak", "store", "egress"],
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
    /// `compaction` (compactions answered with 4 MB), `egress` (many large egress answers
    /// at once, the route's per-turn caps out of the way), `egress-defaults` (the same, the
    /// caps at their defaults) or `mcp` (hostile MCP answers over
    /// stdio and streamable HTTP: the review of issue 43)
    #[arg(long, value_name = "KIND", default_value = "chat", value_parser = ["chat", "compaction", "mcp", "egress", "egress-defaults"])]
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
        return parts::broker_side::run(&options, side.starts_with("on"), side.ends_with('8'));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut results = rt.block_on(run(&options))?;
    // The actor layer's memory runs in processes of their own (an actix system each).
    if options.wants("memory") {
        results.memory.idle_channels = Some(memory::idle(options.channels)?);
    }
    if options.wants("observed") {
        let idle = memory::observed_idle(options.channels)?;
        if let Some(observed) = &mut results.observed {
            observed.idle_channels = Some(idle);
        }
    }
    results.targets = results::targets(&results);
    results::print_targets(&results.targets);
    println!();
    write_json(&options.json, &results)
}

/// Writes `value` as pretty JSON to `path` (its directory made if missing), and says so.
fn write_json(path: &str, value: &impl Serialize) -> Result<()> {
    let path = std::path::Path::new(path);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(value)? + "\n")?;
    println!("JSON written to {}", path.display());
    Ok(())
}

/// `roundtable-bench hostile [--seconds N] [--attack chat|compaction|mcp|egress|egress-defaults] [--json PATH]`:
/// the host's peak RSS under a hostile turn against idle (see [`hostile`]); no Docker
/// needed.
fn hostile_main(o: &HostileOptions) -> Result<()> {
    if nix::unistd::getuid().is_root() {
        bail!("run it as the service user (scripts/as-service-user.sh)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let attack = match o.attack.as_str() {
        "compaction" => hostile::Attack::Compaction,
        "egress" => hostile::Attack::Egress,
        "egress-defaults" => hostile::Attack::EgressDefaults,
        "mcp" => hostile::Attack::Mcp,
        _ => hostile::Attack::Chat,
    };
    let result = rt.block_on(hostile::run(o.seconds, attack))?;
    write_json(&o.json, &result)
}

/// The Docker parts `--only` names, in order.
async fn run(o: &Options) -> Result<Results> {
    let driver = DockerDriver::default();
    let docker = driver.client().await?.clone();
    lifecycle::require_image(&docker, &o.image).await?;
    let swept = lifecycle::sweep_bench_containers(&docker).await?;
    if swept > 0 {
        eprintln!("removed {swept} containers left by an earlier bench run");
    }
    let machine = Machine::read(&docker).await;
    println!("machine: {machine}");
    let mut results = Results::new(
        machine,
        RunOptions {
            iterations: o.iterations,
            warmup: o.warmup,
            rounds: o.rounds,
            broker_calls: o.broker_calls,
            channels: o.channels,
            image: o.image.clone(),
        },
    );
    let model = Model::start().await?;
    let roots = lifecycle::Roots::new()?;
    let sandbox = lifecycle::sandbox(&o.image, &roots, &model.url()).await?;
    let stdin = lifecycle::turn_stdin();
    let b = Bench {
        o,
        driver: &driver,
        docker: &docker,
        roots: &roots,
        model: &model,
        sandbox: &sandbox,
        stdin: &stdin,
    };

    if o.wants("turn") {
        let warm = lifecycle::warm_sandbox(&o.image, &roots, &model.url()).await?;
        results.turn = Some(parts::turn::run(&b, &warm).await?);
        let (adopted, cold) = warm.warm_counts();
        println!("runtime_warm: {adopted} turns in prepared containers, {cold} fell back to cold");
        if cold > 0 {
            bail!("{cold} warm turns fell back to a cold start: the figures are not warm");
        }
        results.warm_memory = Some(memory::prepared(&warm, 8).await?);
        drop(warm);
    }
    if o.wants("gvisor") {
        results.gvisor =
            parts::gvisor::compare(&driver, &o.image, &model.url(), o.iterations, o.warmup).await?;
    }
    if o.wants("concurrency") {
        let c = parts::concurrency::run(&b).await?;
        results.concurrency = Some(c.levels);
        results.memory.turns_32 = c.rss_32;
    }
    if o.wants("throughput") {
        results.throughput = Some(parts::throughput::run(&b).await?);
    }
    if o.wants("soak") {
        results.soak = Some(parts::soak::run(&b).await?);
    }
    if o.wants("ablation") {
        results.ablation = Some(parts::ablation::run(&b).await?);
    }
    if o.wants("broker") {
        results.broker = Some(parts::broker::run(o, &model).await?);
    }
    if o.wants("accounting") {
        results.accounting = Some(parts::accounting::run(o, &model, false).await?);
    }
    if o.wants("observed") {
        results.observed = Some(parts::accounting::run(o, &model, true).await?);
    }
    if o.wants("store") {
        results.store = Some(parts::store::run(o, &model).await?);
    }
    if o.wants("egress") {
        results.egress = Some(parts::egress::run(o).await?);
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
