//! `--broker-side on|off|on8|off8` (internal): one broker of part 8 alone, `on` (the budget
//! book, the audit trail and the metrics observer) or `off`, 8 callers in one turn (`on8`,
//! `off8`: in 8 turns) for `--broker-calls` calls in all, no Docker: for an instruction
//! count of each side (`valgrind --tool=callgrind`) and its CPU time by thread.

use std::sync::Arc;

use anyhow::Result;

use crate::harness::broker::{self as harness, Target};
use crate::harness::lifecycle;
use crate::probe::{process_usage, thread_cpu};
use crate::Options;

/// `--broker-side on|off|on8|off8`: part 8's *on* or *off* broker alone, 8 callers in one
/// turn (or in 8 turns of their own); prints the rate and the CPU time by thread name.
pub fn run(o: &Options, on: bool, eight: bool) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let model = harness::Model::start().await?;
        let state_dir = tempfile::Builder::new()
            .prefix("rtb-budgets-")
            .tempdir_in(lifecycle::bench_dir())?;
        let metrics = on.then(|| Arc::new(roundtable_sandbox_metrics::Metrics::new()));
        let book = match on {
            true => Some(harness::unreached_book(
                state_dir.path().join("broker.sqlite"),
            )?),
            false => None,
        };
        let audit = match on {
            true => Some(roundtable_sandbox::internals::audit::AuditTrail::open(
                &state_dir.path().join("audit.jsonl"),
                false,
            )?),
            false => None,
        };
        let mut b = harness::BrokerUnderTest::start_observed(
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
        let rps = harness::throughput_over(&targets, workers, per).await?;
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
