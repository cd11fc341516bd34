//! Readings of this process and of the machine the parts take beside their figures: RSS,
//! CPU time (this process's, dockerd's, the machine's, by thread), context switches, what
//! the process holds, the runtime's engine calls, and a `/metrics` scraper.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::stats::round3;

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
pub struct RssSampler {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<u64>,
}

impl RssSampler {
    pub fn start() -> Self {
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

    pub async fn peak(self) -> u64 {
        self.stop.cancel();
        self.task.await.unwrap_or(0)
    }
}

/// A process's CPU time (user + system), in clock ticks.
pub fn cpu_ticks(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = text.rsplit_once(')').context("/proc/pid/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| -> Result<u64> { Ok(fields.get(i).context("stat field")?.parse()?) };
    Ok(tick(11)? + tick(12)?)
}

/// The pid of the first process named `comm` (for its CPU time), if any is visible.
pub fn find_process(comm: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        (name.trim() == comm).then_some(pid)
    })
}

/// The whole machine's busy CPU time so far (every CPU's user, nice, system, irq, softirq
/// and steal from `/proc/stat`), in clock ticks.
pub fn machine_busy() -> u64 {
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

/// This process's and dockerd's CPU time at one moment, in clock ticks.
#[derive(Debug, Clone, Copy)]
pub struct CpuNow {
    pub bench: u64,
    pub dockerd: Option<u64>,
}

/// This process's and dockerd's CPU time so far.
pub fn cpu_now(dockerd: Option<u32>) -> CpuNow {
    CpuNow {
        bench: cpu_ticks(std::process::id()).unwrap_or(0),
        dockerd: dockerd.and_then(|p| cpu_ticks(p).ok()),
    }
}

/// CPU ms per turn of this process and of dockerd (when visible).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CpuPerTurn {
    pub bench: f64,
    pub dockerd: Option<f64>,
}

/// CPU ms per turn between two readings of [`cpu_now`] (clock ticks of 10 ms).
pub fn cpu_per_turn(a: CpuNow, b: CpuNow, turns: u64) -> CpuPerTurn {
    let per = |t: u64| round3(t as f64 * 10.0 / turns.max(1) as f64);
    CpuPerTurn {
        bench: per(b.bench.saturating_sub(a.bench)),
        dockerd: a
            .dockerd
            .zip(b.dockerd)
            .map(|(a, b)| per(b.saturating_sub(a))),
    }
}

/// What this process holds at one moment.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Held {
    pub rss_kib: u64,
    pub fds: usize,
    pub threads: usize,
    pub tokio_tasks: usize,
}

/// What this process holds now: RSS (KiB), open files, threads, the tokio runtime's live
/// tasks.
pub fn process_held() -> Held {
    let count = |dir: &str| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    Held {
        rss_kib: rss_kib(),
        fds: count("/proc/self/fd"),
        threads: count("/proc/self/task"),
        tokio_tasks: tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks(),
    }
}

/// This process's user and system CPU time so far (µs) and its voluntary and involuntary
/// context switches, every thread.
pub fn process_usage() -> [f64; 4] {
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

/// CPU time (µs) of this process's threads, summed by thread name: each thread's time on a
/// CPU from `schedstat` (nanoseconds; `stat`'s ticks are 10 ms, too coarse for a writer
/// thread's share).
pub fn thread_cpu() -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
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

/// One engine operation's calls per turn and their mean time.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct EngineCall {
    pub calls: f64,
    pub mean_ms: f64,
}

/// Counts the runtime's engine calls by operation (its events' `Engine`), with their time.
#[derive(Clone, Default)]
pub struct EngineCalls(Arc<Mutex<BTreeMap<&'static str, (u64, Duration)>>>);

impl EngineCalls {
    pub fn observer(&self) -> roundtable_sandbox::events::Observer {
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

    /// Forgets the calls counted so far.
    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }

    /// Calls per turn of `turns`, and each call's mean time in ms, by operation.
    pub fn per(&self, turns: u64) -> BTreeMap<&'static str, EngineCall> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(op, (n, t))| {
                (
                    *op,
                    EngineCall {
                        calls: *n as f64 / turns as f64,
                        mean_ms: t.as_secs_f64() * 1000.0 / (*n).max(1) as f64,
                    },
                )
            })
            .collect()
    }
}

/// Scrapes `/metrics` once a second on a thread of its own, as Prometheus would.
pub struct Scraper {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Scraper {
    pub fn start(addr: std::net::SocketAddr) -> Self {
        use std::io::{Read, Write};
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut n = 0;
            while !stopped.load(Ordering::Relaxed) {
                if let Ok(mut s) = std::net::TcpStream::connect(addr) {
                    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
                    let mut body = Vec::new();
                    if s.read_to_end(&mut body).is_ok() && body.starts_with(b"HTTP/1.0 200") {
                        n += 1;
                    }
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            n
        });
        Self { stop, thread }
    }

    /// Stops it; the scrapes that succeeded.
    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}
