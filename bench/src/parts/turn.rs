//! Part 1, turn overhead: a trivial turn on each path, interleaved (the order rotated each
//! iteration): the runtime cold and warm, the driver alone, the bare Docker API lifecycle
//! (with and without the sealed container's options: `bare_api_default`) and the docker
//! CLI. `reply` is when the reply is known, `total` when the container is removed.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use roundtable_sandbox::Sandbox;
use serde::Serialize;

use super::Bench;
use crate::harness::lifecycle::{self, Timing};
use crate::stats::{ratio, NamedSamples, Samples, Summary};

/// The paths, in their interleaving order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Runtime,
    RuntimeWarm,
    Driver,
    BareApi,
    BareApiDefault,
    DockerCli,
}

const PATHS: [Path; 6] = [
    Path::Runtime,
    Path::RuntimeWarm,
    Path::Driver,
    Path::BareApi,
    Path::BareApiDefault,
    Path::DockerCli,
];

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Runtime => "runtime",
            Path::RuntimeWarm => "runtime_warm",
            Path::Driver => "driver",
            Path::BareApi => "bare_api",
            Path::BareApiDefault => "bare_api_default",
            Path::DockerCli => "docker_cli",
        }
    }
}

/// A path's reply and total times.
#[derive(Debug, Serialize)]
pub struct ReplyTotal {
    pub reply: Summary,
    pub total: Summary,
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

    fn summary(&self) -> ReplyTotal {
        ReplyTotal {
            reply: self.reply.summary(),
            total: self.total.summary(),
        }
    }
}

/// The ratios of part 1 (p50 unless named p95).
#[derive(Debug, Serialize)]
pub struct Ratios {
    pub runtime_warm_reply_vs_bare_reply_p50: f64,
    pub runtime_warm_reply_vs_bare_total_p50: f64,
    pub runtime_warm_reply_vs_runtime_reply_p50: f64,
    pub runtime_reply_vs_bare_reply_p50: f64,
    pub runtime_reply_vs_bare_reply_p95: f64,
    pub runtime_total_vs_bare_total_p50: f64,
    pub runtime_total_vs_bare_total_p95: f64,
    pub runtime_reply_vs_cli_p50: f64,
    pub runtime_reply_vs_cli_p95: f64,
    pub runtime_total_vs_cli_p50: f64,
    pub driver_total_vs_bare_total_p50: f64,
}

/// Part 1's figures.
#[derive(Debug, Serialize)]
pub struct TurnOverhead {
    pub runtime: ReplyTotal,
    pub runtime_warm: ReplyTotal,
    pub driver: ReplyTotal,
    pub bare_api: ReplyTotal,
    pub bare_api_default: ReplyTotal,
    pub docker_cli: ReplyTotal,
    pub ratios: Ratios,
    /// The runtime's phases, each from its start to the next's (`warm:` the warm turns').
    pub runtime_phases: BTreeMap<String, Summary>,
    /// The bare lifecycle's steps.
    pub bare_api_steps: BTreeMap<String, Summary>,
}

async fn one_turn(
    b: &Bench<'_>,
    warm: &Sandbox,
    path: Path,
    profile: &mut NamedSamples,
    i: usize,
) -> Result<Timing> {
    let (image, stdin) = (b.o.image.as_str(), b.stdin);
    match path {
        Path::Runtime | Path::RuntimeWarm => {
            let channel = format!("#bench-{}", i % 8);
            let (t, phases) = if path == Path::Runtime {
                lifecycle::runtime_turn_profiled(b.sandbox, &channel).await?
            } else {
                lifecycle::warm_turn(warm, &channel).await?
            };
            let prefix = if path == Path::Runtime { "" } else { "warm:" };
            profile.push_spans(prefix, &phases);
            Ok(t)
        }
        Path::Driver => lifecycle::driver_turn(b.driver, image, b.roots, stdin).await,
        Path::BareApi => lifecycle::bare_turn(b.docker, image, stdin, true).await,
        Path::BareApiDefault => lifecycle::bare_turn(b.docker, image, stdin, false).await,
        Path::DockerCli => lifecycle::cli_turn(image, stdin).await,
    }
}

/// Runs part 1 (`warm`: the runtime with warm turns).
pub async fn run(b: &Bench<'_>, warm: &Sandbox) -> Result<TurnOverhead> {
    let o = b.o;
    println!(
        "\n== 1. turn overhead: a trivial turn, {} interleaved iterations per path",
        o.iterations
    );
    for i in 0..o.warmup {
        for p in PATHS {
            one_turn(b, warm, p, &mut NamedSamples::default(), i).await?;
        }
    }
    let mut samples: Vec<PathSamples> = PATHS.iter().map(|_| PathSamples::default()).collect();
    let mut profile = NamedSamples::default();
    let mut bare_steps = NamedSamples::default();
    for i in 0..o.iterations {
        // Rotate the order so no path always follows the same one.
        for k in 0..PATHS.len() {
            let idx = (i + k) % PATHS.len();
            let t = one_turn(b, warm, PATHS[idx], &mut profile, i)
                .await
                .with_context(|| PATHS[idx].name())?;
            samples[idx].push(t);
            if let (Some(steps), Path::BareApi) = (t.steps, PATHS[idx]) {
                for (name, d) in steps {
                    bare_steps.push(name, d);
                }
            }
        }
    }
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>10}   (ms; reply = the reply is known, total = container removed)",
        "path", "reply p50", "reply p95", "total p50", "total p95"
    );
    for (p, s) in PATHS.iter().zip(&samples) {
        println!(
            "{:<12} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            p.name(),
            s.reply.p50(),
            s.reply.p95(),
            s.total.p50(),
            s.total.p95()
        );
    }
    let [rt, rw, driver, bare, bare_default, cli] = &samples[..] else {
        unreachable!("one samples per path")
    };
    let ratios = Ratios {
        runtime_warm_reply_vs_bare_reply_p50: ratio(rw.reply.p50(), bare.reply.p50()),
        runtime_warm_reply_vs_bare_total_p50: ratio(rw.reply.p50(), bare.total.p50()),
        runtime_warm_reply_vs_runtime_reply_p50: ratio(rw.reply.p50(), rt.reply.p50()),
        runtime_reply_vs_bare_reply_p50: ratio(rt.reply.p50(), bare.reply.p50()),
        runtime_reply_vs_bare_reply_p95: ratio(rt.reply.p95(), bare.reply.p95()),
        runtime_total_vs_bare_total_p50: ratio(rt.total.p50(), bare.total.p50()),
        runtime_total_vs_bare_total_p95: ratio(rt.total.p95(), bare.total.p95()),
        runtime_reply_vs_cli_p50: ratio(rt.reply.p50(), cli.total.p50()),
        runtime_reply_vs_cli_p95: ratio(rt.reply.p95(), cli.total.p95()),
        runtime_total_vs_cli_p50: ratio(rt.total.p50(), cli.total.p50()),
        driver_total_vs_bare_total_p50: ratio(driver.total.p50(), bare.total.p50()),
    };
    println!(
        "ratios (p50): runtime_warm reply / bare reply {:.3}, / bare total {:.3}, / runtime (cold) reply {:.3}",
        ratios.runtime_warm_reply_vs_bare_reply_p50,
        ratios.runtime_warm_reply_vs_bare_total_p50,
        ratios.runtime_warm_reply_vs_runtime_reply_p50,
    );
    println!(
        "ratios (p50): runtime/bare reply {:.3}, total {:.3}; runtime/cli reply {:.3}, total {:.3}; driver/bare total {:.3}",
        ratios.runtime_reply_vs_bare_reply_p50,
        ratios.runtime_total_vs_bare_total_p50,
        ratios.runtime_reply_vs_cli_p50,
        ratios.runtime_total_vs_cli_p50,
        ratios.driver_total_vs_bare_total_p50,
    );
    print!("runtime phases (p50 ms, from each phase's start to the next):");
    for (name, s) in profile.iter() {
        print!(" {name} {:.1}", s.p50());
    }
    println!();
    print!("bare API steps (p50 ms):");
    for (name, s) in bare_steps.iter() {
        print!(" {name} {:.1}", s.p50());
    }
    println!();
    Ok(TurnOverhead {
        runtime: rt.summary(),
        runtime_warm: rw.summary(),
        driver: driver.summary(),
        bare_api: bare.summary(),
        bare_api_default: bare_default.summary(),
        docker_cli: cli.summary(),
        ratios,
        runtime_phases: profile.summaries(),
        bare_api_steps: bare_steps.summaries(),
    })
}
