//! Part 2, concurrency: N channels each sending one turn at once (N = 1, 8, 32), through
//! the runtime, through the actor layer (`SandboxSupervisor`, `max_containers` 32) and as
//! N bare lifecycles, in interleaved rounds; and the host RSS during 32 at once.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use super::Bench;
use crate::harness::{actors::ActorPath, lifecycle};
use crate::probe::{rss_kib, RssSampler};
use crate::stats::{ratio, round3, Samples, Summary};

/// One N's figures.
#[derive(Debug, Serialize)]
pub struct Level {
    pub runtime_wall: Summary,
    pub runtime_all_replied: Summary,
    pub actors_wall: Summary,
    pub bare_api_wall: Summary,
    pub ratio_p50: f64,
    pub actors_ratio_p50: f64,
    pub runtime_turns_per_s: f64,
}

/// This process's RSS during 32 turns at once (the runtime's) and 32 bare lifecycles.
#[derive(Debug, Serialize)]
pub struct Rss32 {
    pub bench_process_rss_before_kib: u64,
    pub peak_rss_runtime_32_turns_kib: u64,
    pub peak_rss_bare_api_32_lifecycles_kib: u64,
    pub runtime_growth_kib: u64,
    pub bare_api_growth_kib: u64,
}

/// Part 2's figures: by N (`"1"`, `"8"`, `"32"`), and the RSS of 32 at once.
pub struct Concurrency {
    pub levels: BTreeMap<String, Level>,
    pub rss_32: Option<Rss32>,
}

pub async fn run(b: &Bench<'_>) -> Result<Concurrency> {
    let o = b.o;
    println!(
        "\n== 2. concurrency: N channels each sending one turn at once, {} interleaved rounds",
        o.rounds
    );
    println!("   (actors: through SandboxSupervisor with max_containers = 32)");
    let actors = ActorPath::start(&o.image, b.roots, 32).await?;
    println!(
        "{:<4} {:>11} {:>11} {:>11} {:>9} {:>9} {:>9}",
        "N", "runtime ms", "actors ms", "bare API ms", "rt/bare", "act/bare", "turns/s"
    );
    let mut out = Concurrency {
        levels: BTreeMap::new(),
        rss_32: None,
    };
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
                            lifecycle::runtime_turn(b.sandbox, &format!("#conc-{n}-{c}")).await
                        });
                        let timings = futures_util::future::try_join_all(turns).await?;
                        rt_total.push(t0.elapsed());
                        rt_replies.push(timings.iter().map(|t| t.reply).max().unwrap_or_default());
                        rt_peak = rt_peak.max(sampler.peak().await);
                    }
                    1 => {
                        let turns =
                            (0..n).map(|_| lifecycle::bare_turn(b.docker, &o.image, b.stdin, true));
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
        out.levels.insert(
            n.to_string(),
            Level {
                runtime_wall: rt_total.summary(),
                runtime_all_replied: rt_replies.summary(),
                actors_wall: act_total.summary(),
                bare_api_wall: bare_total.summary(),
                ratio_p50: ratio(rt_total.p50(), bare_total.p50()),
                actors_ratio_p50: ratio(act_total.p50(), bare_total.p50()),
                runtime_turns_per_s: round3(turns_per_s),
            },
        );
        if n == 32 {
            println!(
                "host RSS during 32 concurrent turns: runtime peak {} KiB (+{} over {} before), \
                 bare API peak {} KiB (+{})",
                rt_peak,
                rt_peak.saturating_sub(base),
                base,
                bare_peak,
                bare_peak.saturating_sub(base)
            );
            out.rss_32 = Some(Rss32 {
                bench_process_rss_before_kib: base,
                peak_rss_runtime_32_turns_kib: rt_peak,
                peak_rss_bare_api_32_lifecycles_kib: bare_peak,
                runtime_growth_kib: rt_peak.saturating_sub(base),
                bare_api_growth_kib: bare_peak.saturating_sub(base),
            });
        }
    }
    actors.stop();
    Ok(out)
}
