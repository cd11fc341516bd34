//! Part 2b, throughput: N channels each sending turns back to back (the next message the
//! moment the channel admits it: after its turn's teardown) with warm turns, as a channel
//! actor runs them (its next container is prepared from the reply on, beside the
//! teardown), against N bare lifecycles looping at once, and against a second set of N bare
//! lifecycles (the A/A control), and with `--throughput-driver` N sealed containers alone.
//! Each side runs `throughput_settle` seconds, then `throughput_seconds` in which the turns
//! that end are counted; the sides run in a balanced order in each of `throughput_rounds`
//! rounds. The target reads the median of the rounds' warm / bare ratios.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use roundtable_sandbox::{DockerDriver, Sandbox};
use serde::Serialize;

use super::Bench;
use crate::harness::lifecycle;
use crate::probe::{cpu_now, cpu_per_turn, find_process, CpuPerTurn, EngineCall, EngineCalls};
use crate::stats::{self, round3};

/// The sides of the throughput part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// N channels of the runtime with warm turns.
    Warm,
    /// N bare lifecycles (the baseline).
    Bare,
    /// N bare lifecycles again: the A/A control (what two identical sides read here).
    Control,
    /// N sealed containers alone (the driver's run and removal, no runtime).
    Driver,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Warm => "runtime_warm",
            Side::Bare => "bare_api",
            Side::Control => "bare_api_control",
            Side::Driver => "driver",
        }
    }
}

/// One side's window: the turns that ended in it, all its turns, and the warm side's cold
/// starts and failures.
#[derive(Default)]
pub struct SideRun {
    pub done: u64,
    pub all: u64,
    pub cold: u64,
    pub failed: u64,
}

/// One side's window in one round.
#[derive(Debug, Serialize)]
pub struct Window {
    pub round: usize,
    pub side: &'static str,
    pub turns: u64,
    pub turns_all: u64,
    pub wall_s: f64,
    pub cpu_ms_per_turn: CpuPerTurn,
}

/// Part 2b's figures.
#[derive(Debug, Serialize)]
pub struct Throughput {
    pub channels: usize,
    pub seconds: u64,
    pub settle_seconds: u64,
    pub rounds: usize,
    pub windows: Vec<Window>,
    pub turns_per_s_by_round: BTreeMap<&'static str, Vec<f64>>,
    pub runtime_warm_turns_per_s_p50: f64,
    pub bare_api_turns_per_s_p50: f64,
    /// The median of the rounds' warm / bare ratios (the target's).
    pub ratio: f64,
    /// The A/A control: the median of the rounds' control / bare ratios.
    pub control_ratio: f64,
    pub warm_vs_control_ratio: f64,
    pub driver_vs_bare_ratio: Option<f64>,
    pub turns_started_cold: u64,
    pub turns_failed: u64,
    pub engine_calls_per_warm_turn: BTreeMap<&'static str, EngineCall>,
}

/// A runtime with warm turns for `n` channels back to back (`max` 2 n prepared), its engine
/// calls counted by `engine_calls`.
pub async fn warm_runtime(
    b: &Bench<'_>,
    n: usize,
    instance: &str,
    engine_calls: &EngineCalls,
) -> Result<Sandbox> {
    let c = lifecycle::bench_config(
        &b.roots.actors_run_root,
        &b.roots.actors_workspace_root,
        &b.o.image,
        &b.model.url(),
    )
    .command(lifecycle::command())
    .instance(format!("{instance}-{}", std::process::id()))
    .warm(roundtable_sandbox::WarmSettings {
        enabled: true,
        max: 2 * n,
        ttl_secs: None,
    })
    .observer(engine_calls.observer())
    .build();
    Sandbox::new(c)
        .await
        .with_context(|| format!("start the {instance} runtime"))
}

/// `n` loops of `turn` until `until`, each turn counted in `done` when `counted()`.
pub async fn bare_loops<F, Fut>(
    n: usize,
    until: Instant,
    counted: impl Fn() -> bool + Copy,
    turn: F,
) -> Result<SideRun>
where
    F: Fn() -> Fut + Copy,
    Fut: std::future::Future<Output = Result<lifecycle::Timing>>,
{
    let loops = (0..n).map(|_| async move {
        let mut s = SideRun::default();
        while Instant::now() < until {
            turn().await?;
            s.all += 1;
            s.done += u64::from(counted());
        }
        Ok::<_, anyhow::Error>(s)
    });
    Ok(sum_runs(futures_util::future::try_join_all(loops).await?))
}

pub async fn run(b: &Bench<'_>) -> Result<Throughput> {
    let o = b.o;
    let (n, secs) = (o.throughput_channels, o.throughput_seconds);
    let settle = Duration::from_secs(o.throughput_settle);
    // The engine calls the runtime makes (where the daemon's time per warm turn goes).
    let engine_calls = EngineCalls::default();
    let dockerd = find_process("dockerd");
    let mut sides = vec![Side::Warm, Side::Bare, Side::Control];
    if o.throughput_driver {
        sides.push(Side::Driver);
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
    let warm = warm_runtime(b, n, "bench-tput", &engine_calls).await?;
    let driver = DockerDriver::default();
    // Turns/s by side, one per round, in the order of `sides`.
    let mut rates: Vec<Vec<f64>> = sides.iter().map(|_| Vec::new()).collect();
    let mut windows = Vec::new();
    let (mut fell_cold, mut failed) = (0u64, 0u64);
    let (image, stdin) = (o.image.as_str(), b.stdin);
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
                Side::Warm => warm_loops(&warm, n, until, counted).await,
                Side::Bare | Side::Control => {
                    bare_loops(n, until, counted, || {
                        lifecycle::bare_turn(b.docker, image, stdin, true)
                    })
                    .await?
                }
                Side::Driver => {
                    bare_loops(n, until, counted, || {
                        lifecycle::driver_turn(&driver, image, b.roots, stdin)
                    })
                    .await?
                }
            };
            let wall = t0.elapsed().as_secs_f64();
            fell_cold += run.cold;
            failed += run.failed;
            rates[k].push(run.done as f64 / secs as f64);
            windows.push(Window {
                round: r,
                side: side.name(),
                turns: run.done,
                turns_all: run.all,
                wall_s: round3(wall),
                cpu_ms_per_turn: cpu_per_turn(cpu0, cpu_now(dockerd), run.all),
            });
        }
    }
    let rate_of = |s: Side| &rates[sides.iter().position(|x| *x == s).unwrap_or(0)];
    let (rt, bare, ctl) = (
        rate_of(Side::Warm),
        rate_of(Side::Bare),
        rate_of(Side::Control),
    );
    let paired = stats::paired_median(rt, bare);
    let control = stats::paired_median(ctl, bare);
    let warm_vs_control = stats::paired_median(rt, ctl);
    let driver_paired = o
        .throughput_driver
        .then(|| stats::paired_median(rate_of(Side::Driver), bare));
    let warm_turns: u64 = windows
        .iter()
        .filter(|w| w.side == Side::Warm.name())
        .map(|w| w.turns_all)
        .sum();
    let per_turn = engine_calls.per(warm_turns.max(1));
    for side in &sides {
        let of_side: Vec<&Window> = windows.iter().filter(|w| w.side == side.name()).collect();
        let mean = |cpu: fn(&CpuPerTurn) -> Option<f64>| {
            of_side
                .iter()
                .filter_map(|w| cpu(&w.cpu_ms_per_turn))
                .sum::<f64>()
                / of_side.len().max(1) as f64
        };
        println!(
            "CPU per turn, {}: this process {:.1} ms, dockerd {:.1} ms",
            side.name(),
            mean(|c| Some(c.bench)),
            mean(|c| c.dockerd)
        );
    }
    println!(
        "engine calls per warm turn (the runtime's, preparation included): {}",
        per_turn
            .iter()
            .map(|(op, c)| format!("{op} {:.2} ({:.1} ms)", c.calls, c.mean_ms))
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
    Ok(Throughput {
        channels: n,
        seconds: secs,
        settle_seconds: settle.as_secs(),
        rounds: o.throughput_rounds,
        turns_per_s_by_round: sides
            .iter()
            .zip(&rates)
            .map(|(s, r)| (s.name(), stats::round3_all(r)))
            .collect(),
        windows,
        runtime_warm_turns_per_s_p50: round3(stats::median(rt)),
        bare_api_turns_per_s_p50: round3(stats::median(bare)),
        ratio: round3(paired),
        control_ratio: round3(control),
        warm_vs_control_ratio: round3(warm_vs_control),
        driver_vs_bare_ratio: driver_paired.map(round3),
        turns_started_cold: fell_cold,
        turns_failed: failed,
        engine_calls_per_warm_turn: per_turn
            .into_iter()
            .map(|(op, c)| {
                let calls = round3(c.calls);
                let mean_ms = round3(c.mean_ms);
                (op, EngineCall { calls, mean_ms })
            })
            .collect(),
    })
}

/// The sum of the loops' runs of one side.
pub fn sum_runs(runs: Vec<SideRun>) -> SideRun {
    runs.into_iter().fold(SideRun::default(), |a, b| SideRun {
        done: a.done + b.done,
        all: a.all + b.all,
        cold: a.cold + b.cold,
        failed: a.failed + b.failed,
    })
}

/// The warm side: `n` channels each sending turns back to back until `until`, the next
/// container prepared from each reply on (as a channel actor does).
pub async fn warm_loops(
    warm: &Sandbox,
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
