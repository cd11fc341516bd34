//! Part 2d, soak: one runtime serving warm turns in `n` channels back to back for
//! `--soak-windows` windows of `--soak-seconds`, each followed by the bare lifecycles for a
//! third of it (the machine's own drift). Per window: the turns/s of each, the runtime's
//! CPU and dockerd's per turn, the engine calls' mean time, and what the process holds
//! (RSS, open files, threads, tokio tasks): a runtime that slows or grows with its age
//! shows here.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

use super::throughput::{bare_loops, warm_loops, warm_runtime};
use super::Bench;
use crate::harness::lifecycle;
use crate::probe::{
    cpu_now, cpu_per_turn, find_process, process_held, CpuPerTurn, EngineCalls, Held,
};
use crate::stats::round3;

/// One window's figures.
#[derive(Debug, Serialize)]
pub struct Window {
    pub window: usize,
    pub warm_turns: u64,
    pub warm_turns_total: u64,
    pub warm_turns_per_s: f64,
    pub bare_turns_per_s: f64,
    pub warm_vs_bare: f64,
    pub cold: u64,
    pub failed: u64,
    pub warm_cpu_ms_per_turn: CpuPerTurn,
    pub bare_cpu_ms_per_turn: CpuPerTurn,
    pub engine_mean_ms: BTreeMap<&'static str, f64>,
    pub held: Held,
}

/// Part 2d's figures.
#[derive(Debug, Serialize)]
pub struct Soak {
    pub channels: usize,
    pub seconds: u64,
    pub bare_seconds: u64,
    pub windows: Vec<Window>,
}

/// A figure that may be missing, as the JSON would show it.
fn or_null(v: Option<f64>) -> String {
    v.map_or_else(|| "null".to_owned(), |v| v.to_string())
}

pub async fn run(b: &Bench<'_>) -> Result<Soak> {
    let o = b.o;
    let n = o.throughput_channels;
    let secs = o.soak_seconds.max(3);
    let bare_secs = (secs / 3).max(1);
    println!(
        "\n== 2d. soak: {n} channels of warm turns on one runtime, {} windows of {secs} s, each followed by {bare_secs} s of {n} bare lifecycles",
        o.soak_windows
    );
    let engine_calls = EngineCalls::default();
    let dockerd = find_process("dockerd");
    let warm = warm_runtime(b, n, "bench-soak", &engine_calls).await?;
    let mut windows = Vec::new();
    let mut total = 0u64;
    for w in 0..o.soak_windows {
        engine_calls.clear();
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
        let bare = bare_loops(
            n,
            until,
            || true,
            || lifecycle::bare_turn(b.docker, &o.image, b.stdin, true),
        )
        .await?;
        let bare_wall = t1.elapsed().as_secs_f64();
        let bare_cpu = cpu_per_turn(cpu_b0, cpu_now(dockerd), bare.all);
        let (warm_rate, bare_rate) = (run.all as f64 / warm_wall, bare.all as f64 / bare_wall);
        println!(
            "window {w}: {total} warm turns so far; warm {warm_rate:.2} turns/s (bench {} ms, dockerd {} ms per turn; {} cold, {} failed), bare {bare_rate:.2} (dockerd {} ms); warm / bare {:.3}; engine ms: {}; held: {}",
            cpu.bench,
            or_null(cpu.dockerd),
            run.cold,
            run.failed,
            or_null(bare_cpu.dockerd),
            warm_rate / bare_rate,
            calls
                .iter()
                .map(|(op, c)| format!("{op} {:.1}", c.mean_ms))
                .collect::<Vec<_>>()
                .join(", "),
            serde_json::to_string(&held)?,
        );
        windows.push(Window {
            window: w,
            warm_turns: run.all,
            warm_turns_total: total,
            warm_turns_per_s: round3(warm_rate),
            bare_turns_per_s: round3(bare_rate),
            warm_vs_bare: round3(warm_rate / bare_rate),
            cold: run.cold,
            failed: run.failed,
            warm_cpu_ms_per_turn: cpu,
            bare_cpu_ms_per_turn: bare_cpu,
            engine_mean_ms: calls
                .iter()
                .map(|(op, c)| (*op, round3(c.mean_ms)))
                .collect(),
            held,
        });
    }
    warm.shutdown().await;
    Ok(Soak {
        channels: n,
        seconds: secs,
        bare_seconds: bare_secs,
        windows,
    })
}
