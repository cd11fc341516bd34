//! Part 2c, ablation (`--only ablation`, not run by default): where the engine's time per
//! sealed container goes: the throughput of N lifecycles looping at once for each variant
//! of the sealed container with one of its options taken away (and the bare lifecycle),
//! variants rotated between rounds.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

use super::Bench;
use crate::harness::lifecycle;
use crate::probe::{cpu_now, find_process, machine_busy};
use crate::stats::{ratio, round3, Samples};

/// One variant's figures.
#[derive(Debug, Serialize)]
pub struct Variant {
    pub turns_per_s_p50: f64,
    pub vs_bare: f64,
    pub vs_sealed: f64,
    pub machine_cpu_ms_per_turn: f64,
    pub dockerd_cpu_ms_per_turn: f64,
}

/// Part 2c's figures, by variant.
#[derive(Debug, Serialize)]
pub struct Ablation {
    pub channels: usize,
    pub seconds: u64,
    pub rounds: usize,
    pub variants: BTreeMap<&'static str, Variant>,
}

/// How a variant's lifecycle runs.
enum Run {
    Sealed(bollard::models::ContainerCreateBody),
    SealedDetached(bollard::models::ContainerCreateBody),
    Bare,
    BareDetached,
}

pub async fn run(b: &Bench<'_>) -> Result<Ablation> {
    let o = b.o;
    let (docker, roots, stdin) = (b.docker, b.roots, b.stdin);
    let (n, secs) = (o.throughput_channels, o.ablation_seconds);
    println!(
        "\n== 2c. ablation: {n} lifecycles looping at once for each variant of the sealed container, {secs} s each, {} rotating rounds",
        o.rounds
    );
    // The variants, their bodies made once (a body names no container: each lifecycle its
    // own): the sealed container with each option taken away, then without its stdio (what
    // an attach-free turn would cost), then the bare lifecycle with and without attach.
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
            let (busy0, d0) = (machine_busy(), cpu_now(dockerd).dockerd);
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
            if let (Some(a), Some(b)) = (d0, cpu_now(dockerd).dockerd) {
                dockerd_ms[v].push(per(b.saturating_sub(a)));
            }
        }
    }
    let bare = rates[names.len() - 2].p50();
    let sealed = rates[0].p50();
    let mut out = BTreeMap::new();
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
            *what,
            Variant {
                turns_per_s_p50: round3(rate),
                vs_bare: ratio(rate, bare),
                vs_sealed: ratio(rate, sealed),
                machine_cpu_ms_per_turn: round3(machine),
                dockerd_cpu_ms_per_turn: round3(dockerd),
            },
        );
    }
    Ok(Ablation {
        channels: n,
        seconds: secs,
        rounds: o.rounds,
        variants: out,
    })
}
