//! Parts 7 and 8 (issue 23, item 8): the same warm turns and broker calls with accounting
//! and budgets on (a SQLite state file, every budget set far from reached) and the audit
//! trail, against all off, interleaved; part 8 (`observed`) adds the metrics adapter on the
//! event seam, its endpoint served and scraped every second. The broker's throughput runs in
//! rounds of three brokers (*off*, *on* and a second *off*: the A/A control) in a balanced
//! order, in two shapes (8 callers in one turn; 8 turns of one caller); part 11 (`store`)
//! runs the same rounds ([`broker_rounds`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Result;
use roundtable_sandbox::Sandbox;
use serde::Serialize;

use super::memory::ObservedIdle;
use crate::harness::broker::{self as harness, BrokerUnderTest, Model, Target};
use crate::harness::lifecycle;
use crate::probe::{process_usage, Scraper};
use crate::stats::{self, ci95, deciles, interval, paired_diff, round3, round3_all, Samples};
use crate::Options;

/// A figure with the thing measured on and off.
#[derive(Debug, Serialize)]
pub struct OnOff<T> {
    pub on: T,
    pub off: T,
}

/// A figure of the three brokers of a round.
#[derive(Debug, Serialize)]
pub struct OnOffControl<T> {
    pub on: T,
    pub off: T,
    pub control: T,
}

/// When a phase of the warm turns began, p50 by side.
#[derive(Debug, Serialize)]
pub struct PhaseStart {
    pub on_p50_ms: f64,
    pub off_p50_ms: f64,
}

/// One shape of the broker rounds: by round and side, and the pairs' medians.
#[derive(Debug, Serialize)]
pub struct RoundsReport {
    pub rps: OnOffControl<Vec<f64>>,
    pub cpu_us_per_request: OnOffControl<Vec<f64>>,
    /// The median of the rounds' on / off ratios (the targets').
    pub rps_paired_on_vs_off: f64,
    pub rps_paired_on_vs_off_ci95: Option<[f64; 2]>,
    pub cpu_per_request_paired_on_vs_off: f64,
    /// The A/A control: a second all-off broker / off.
    pub control_rps_paired: f64,
    pub control_rps_paired_ci95: Option<[f64; 2]>,
    pub control_cpu_per_request_paired: f64,
}

/// Part 7's or 8's figures.
#[derive(Debug, Serialize)]
pub struct Accounting {
    pub broker_audit_lines: Option<u64>,
    pub scrapes: Option<u64>,
    pub model_calls_recorded: Option<f64>,
    pub warm_reply: OnOff<stats::Summary>,
    /// Each iteration's pair (ms, in order): runs of the same code can be pooled
    /// (scripts/pool-warm-pairs.py).
    pub warm_reply_pairs: OnOff<Vec<f64>>,
    pub warm_reply_on_vs_off_p50: f64,
    pub warm_reply_on_vs_off_p50_ci95: Option<[f64; 2]>,
    pub warm_phase_starts: BTreeMap<String, PhaseStart>,
    pub broker_round_trip: OnOff<stats::Summary>,
    /// The one-turn shape's pairs' median (as `one_turn.rps_paired_on_vs_off`).
    pub rps_paired_on_vs_off: f64,
    pub one_turn: RoundsReport,
    pub turns: RoundsReport,
    /// Part 8b: idle channels' memory with metrics and accounting on vs off (`observed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_channels: Option<ObservedIdle>,
}

/// The warm turns of both sides, interleaved: the reply times and when each phase began.
struct WarmSides {
    reply_on: Samples,
    reply_off: Samples,
    /// When each phase of the warm turns began, by side (on, off).
    phases: [BTreeMap<String, Samples>; 2],
}

async fn warm_sides(o: &Options, on: &Sandbox, off: &Sandbox) -> Result<WarmSides> {
    let mut w = WarmSides {
        reply_on: Samples::default(),
        reply_off: Samples::default(),
        phases: Default::default(),
    };
    for i in 0..(o.iterations + o.warmup) {
        let channel = format!("#bench-{}", i % 8);
        let order: [(&Sandbox, bool); 2] = if i % 2 == 0 {
            [(off, false), (on, true)]
        } else {
            [(on, true), (off, false)]
        };
        for (sandbox, counted) in order {
            let (t, began) = lifecycle::warm_turn(sandbox, &channel).await?;
            if i >= o.warmup {
                for (phase, at) in began {
                    w.phases[usize::from(!counted)]
                        .entry(phase)
                        .or_default()
                        .push(at);
                }
                if counted {
                    w.reply_on.push(t.reply);
                } else {
                    w.reply_off.push(t.reply);
                }
            }
        }
    }
    Ok(w)
}

/// Runs part 7 (`with_metrics` false) or 8.
pub async fn run(o: &Options, model: &Model, with_metrics: bool) -> Result<Accounting> {
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
    let metrics = with_metrics.then(|| Arc::new(roundtable_sandbox_metrics::Metrics::new()));
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
    let warm = warm_sides(o, &on, &off).await?;
    off.shutdown().await;
    on.shutdown().await;
    drop((off, on));

    let book = harness::unreached_book(state_dir.path().join("broker.sqlite"))?;
    let mut b_off = BrokerUnderTest::start(&model.url()).await?;
    // The *on* broker's turns audited too, as the warm turns' runtime's are: each "turn"'s
    // model calls gathered, its line written when the round stops it.
    let audit = roundtable_sandbox::internals::audit::AuditTrail::open(
        &state_dir.path().join("broker-audit.jsonl"),
        false,
    )?;
    let mut b_on =
        BrokerUnderTest::start_observed(&model.url(), Some(book), observer, Some(audit.clone()))
            .await?;
    let plain = harness::chat_body(false);
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
            let timing = harness::call(t, &plain, false).await?;
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
    let b_ctl = BrokerUnderTest::start(&model.url()).await?;
    let mut brokers = [b_off, b_on, b_ctl];
    // Two shapes: the 8 callers in one turn (the bench's first shape: a turn's calls at
    // once, past the default 4 in flight), and in 8 turns of one caller each (a busy bot:
    // each turn's calls one after another, every turn its own account and events).
    let one_turn = broker_rounds(&mut brokers, runs, workers, per, 1).await?;
    let eight_turns = broker_rounds(&mut brokers, runs, workers, per, workers).await?;
    let WarmSides {
        reply_on,
        reply_off,
        phases,
    } = warm;
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
    let phase_starts: BTreeMap<String, PhaseStart> = phases[0]
        .iter()
        .filter_map(|(phase, on)| Some((phase, on, phases[1].get(phase)?)))
        .map(|(phase, on, off)| {
            let on_p50_ms = round3(on.p50());
            let off_p50_ms = round3(off.p50());
            (
                phase.clone(),
                PhaseStart {
                    on_p50_ms,
                    off_p50_ms,
                },
            )
        })
        .collect();
    // Each iteration ran one turn a side back to back: the median of the iterations' on −
    // off differences (µs), with its interval, says where a difference is.
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
            .map(|(p, v)| format!("{p} {} / {}", v.on_p50_ms, v.off_p50_ms))
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
    if let Some(st) = &audited {
        println!(
            "  (audit: {} lines of the broker's turns written)",
            st.written
        );
    }
    Ok(Accounting {
        broker_audit_lines: audited.map(|s| s.written),
        scrapes,
        model_calls_recorded: model_calls,
        warm_reply: OnOff {
            on: reply_on.summary(),
            off: reply_off.summary(),
        },
        warm_reply_pairs: OnOff {
            on: round3_all(reply_on.values()),
            off: round3_all(reply_off.values()),
        },
        warm_reply_on_vs_off_p50: round3(reply_ratio),
        warm_reply_on_vs_off_p50_ci95: ci95(reply_ci),
        warm_phase_starts: phase_starts,
        broker_round_trip: OnOff {
            on: rt_on.summary(),
            off: rt_off.summary(),
        },
        rps_paired_on_vs_off: one.rps_paired_on_vs_off,
        one_turn: one,
        turns: eight,
        idle_channels: None,
    })
}

/// The broker throughput rounds of parts 7, 8 and 11, by side (*off*, *on*, the control):
/// each round's requests/s, and per request its process CPU, user and system time (µs) and
/// voluntary and involuntary context switches.
#[derive(Default)]
pub struct BrokerRounds {
    rps: [Vec<f64>; 3],
    usage: [Vec<[f64; 4]>; 3],
}

/// `runs` rounds of the three brokers in a balanced order, `workers` callers of `per` calls
/// each, spread over `turns` turns of each broker (fresh ones every round).
pub async fn broker_rounds(
    brokers: &mut [BrokerUnderTest; 3],
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
            let rps = harness::throughput_over(&vias[side], workers, per).await?;
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

    /// Prints the shape's figures (`what`) and returns them.
    pub fn report(&self, what: &str) -> RoundsReport {
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
        RoundsReport {
            rps: OnOffControl {
                on: round3_all(on),
                off: round3_all(off),
                control: round3_all(ctl),
            },
            cpu_us_per_request: OnOffControl {
                on: round3_all(&cpu_on),
                off: round3_all(&cpu_off),
                control: round3_all(&cpu_ctl),
            },
            rps_paired_on_vs_off: round3(rps_paired),
            rps_paired_on_vs_off_ci95: ci95(rps_ci),
            cpu_per_request_paired_on_vs_off: round3(cpu_paired),
            control_rps_paired: round3(rps_aa),
            control_rps_paired_ci95: ci95(aa_ci),
            control_cpu_per_request_paired: round3(cpu_aa),
        }
    }
}
