//! The results of a run, typed: what `--json` writes (each part's figures under its name),
//! the machine it ran on, and the issues' targets read from the figures.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::parts::{
    ablation::Ablation, accounting::Accounting, broker::BrokerPart, concurrency,
    egress::EgressPart, gvisor::Gvisor, memory, soak::Soak, store::Store, throughput::Throughput,
    turn::TurnOverhead,
};
use crate::stats::round3;

/// Everything a run measured (a part not run is left out).
#[derive(Debug, Serialize)]
pub struct Results {
    pub machine: Machine,
    pub options: RunOptions,
    pub memory: Memory,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnOverhead>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_memory: Option<memory::Prepared>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gvisor: Option<Gvisor>,
    /// Part 2 by N (`"1"`, `"8"`, `"32"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<BTreeMap<String, concurrency::Level>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throughput: Option<Throughput>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub soak: Option<Soak>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ablation: Option<Ablation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker: Option<BrokerPart>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accounting: Option<Accounting>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed: Option<Accounting>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<Store>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPart>,
    pub targets: Vec<Target>,
}

impl Results {
    /// A run on `machine` with `options`, no part measured yet.
    pub fn new(machine: Machine, options: RunOptions) -> Self {
        Self {
            machine,
            options,
            memory: Memory::default(),
            turn: None,
            warm_memory: None,
            gvisor: None,
            concurrency: None,
            throughput: None,
            soak: None,
            ablation: None,
            broker: None,
            accounting: None,
            observed: None,
            store: None,
            egress: None,
            targets: Vec::new(),
        }
    }
}

/// The options the figures were taken with.
#[derive(Debug, Serialize)]
pub struct RunOptions {
    pub iterations: usize,
    pub warmup: usize,
    pub rounds: usize,
    pub broker_calls: usize,
    pub channels: usize,
    pub image: String,
}

/// The host's memory figures of parts 2 and 4.
#[derive(Debug, Default, Serialize)]
pub struct Memory {
    /// Part 2: this process during 32 turns at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turns_32: Option<concurrency::Rss32>,
    /// Part 4: RSS per idle channel.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_channels: Option<memory::IdleChannels>,
}

/// The machine the run was on.
#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cpus: usize,
    pub virtualisation: &'static str,
    pub mem_mib: u64,
    pub kernel: String,
    pub docker: String,
    pub storage_driver: String,
    pub cgroup: String,
}

impl Machine {
    pub async fn read(docker: &bollard::Docker) -> Self {
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
        let (docker, storage_driver, cgroup) = match docker.info().await {
            Ok(i) => (
                i.server_version.unwrap_or_default(),
                i.driver.unwrap_or_default(),
                i.cgroup_version.map(|v| v.to_string()).unwrap_or_default(),
            ),
            Err(_) => Default::default(),
        };
        Machine {
            cpu,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            virtualisation: if hypervisor {
                "virtual machine"
            } else {
                "bare metal"
            },
            mem_mib: mem_kib / 1024,
            kernel,
            docker,
            storage_driver,
            cgroup,
        }
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} × {} ({}), {} MiB RAM, kernel {}, Docker {} ({})",
            self.cpus,
            self.cpu,
            self.virtualisation,
            self.mem_mib,
            self.kernel,
            self.docker,
            self.storage_driver,
        )
    }
}

/// One of the issues' targets against this run's figure.
#[derive(Debug, Serialize)]
pub struct Target {
    pub target: &'static str,
    /// The figure (`None`: its part was not run).
    pub value: Option<f64>,
    pub limit: f64,
    pub unit: &'static str,
    /// Whether the figure is within the limit (`None`: not measured).
    pub met: Option<bool>,
}

/// A figure at most `limit` (`unit` `×` or `ms`, `KiB`).
fn at_most(target: &'static str, value: Option<f64>, limit: f64, unit: &'static str) -> Target {
    let value = value.filter(|v| !v.is_nan()).map(round3);
    Target {
        target,
        value,
        limit,
        unit,
        met: value.map(|v| v <= limit),
    }
}

/// A ratio at least `limit`.
fn at_least(target: &'static str, value: Option<f64>, limit: f64) -> Target {
    let value = value.filter(|v| !v.is_nan()).map(round3);
    Target {
        target,
        value,
        limit,
        unit: "× (at least)",
        met: value.map(|v| v >= limit),
    }
}

/// The issues' targets against the figures of this run.
pub fn targets(r: &Results) -> Vec<Target> {
    let turn = |f: fn(&crate::parts::turn::Ratios) -> f64| r.turn.as_ref().map(|t| f(&t.ratios));
    let acc = r.accounting.as_ref();
    let obs = r.observed.as_ref();
    vec![
        at_most(
            "runtime reply / bare API lifecycle (p50)",
            turn(|t| t.runtime_reply_vs_bare_reply_p50),
            1.10,
            "×",
        ),
        at_most(
            "runtime total / bare API lifecycle total (p50)",
            turn(|t| t.runtime_total_vs_bare_total_p50),
            1.10,
            "×",
        ),
        // Issue 16 (warm turns): a turn in a prepared container, and the cold path unchanged.
        at_most(
            "warm reply / bare API lifecycle (p50)",
            turn(|t| t.runtime_warm_reply_vs_bare_reply_p50),
            0.25,
            "×",
        ),
        at_most(
            "cold reply / bare API lifecycle (p50, issue 16)",
            turn(|t| t.runtime_reply_vs_bare_reply_p50),
            1.05,
            "×",
        ),
        at_most(
            "runtime reply / docker CLI (p50)",
            turn(|t| t.runtime_reply_vs_cli_p50),
            0.8,
            "×",
        ),
        at_most(
            "egress GET: broker-added latency (p50 of paired differences)",
            r.egress.as_ref().map(|e| e.added_p50_ms),
            crate::parts::egress::TARGET_ADDED_MS,
            "ms",
        ),
        at_most(
            "broker-added latency (p50)",
            r.broker.as_ref().map(|b| b.added_p50_ms),
            0.5,
            "ms",
        ),
        at_most(
            "RSS per idle channel",
            r.memory.idle_channels.as_ref().map(|m| m.per_channel_kib),
            4.0,
            "KiB",
        ),
        // Issue 23, item 8: accounting and budgets on against off.
        at_most(
            "warm reply with accounting and budgets / without (p50)",
            acc.map(|a| a.warm_reply_on_vs_off_p50),
            1.02,
            "×",
        ),
        // The median of the interleaved pairs' ratios (the best-of ratio spread ±10 % in an
        // A/A control of two identical brokers; the pairs' median, balanced, ±1.6 %).
        at_least(
            "broker throughput with accounting and budgets / without (pairs' median), 8 callers in one turn",
            acc.map(|a| a.rps_paired_on_vs_off),
            0.97,
        ),
        at_least(
            "broker throughput with accounting and budgets / without (pairs' median), 8 turns",
            acc.map(|a| a.turns.rps_paired_on_vs_off),
            0.97,
        ),
        // Issue 23, item 8: metrics, accounting and budgets on against all off.
        at_most(
            "warm reply with metrics and accounting / all off (p50)",
            obs.map(|a| a.warm_reply_on_vs_off_p50),
            1.02,
            "×",
        ),
        at_least(
            "broker throughput with metrics and accounting / all off (pairs' median), 8 callers in one turn",
            obs.map(|a| a.rps_paired_on_vs_off),
            0.97,
        ),
        at_least(
            "broker throughput with metrics and accounting / all off (pairs' median), 8 turns",
            obs.map(|a| a.turns.rps_paired_on_vs_off),
            0.97,
        ),
        // Issue 24: 32 warm channels back to back against 32 bare lifecycles looping.
        at_least(
            "throughput, warm channels / bare lifecycles (rounds' median)",
            r.throughput.as_ref().map(|t| t.ratio),
            1.0,
        ),
        at_most(
            "idle channels' memory with metrics and accounting / all off",
            obs.and_then(|a| a.idle_channels.as_ref())
                .map(|m| m.on_vs_off_growth),
            1.05,
            "×",
        ),
    ]
}

pub fn print_targets(targets: &[Target]) {
    println!("\n== targets");
    for row in targets {
        let met = match row.met {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "not measured",
        };
        println!(
            "{:<48} {:>9} {} (limit {} {})  {}",
            row.target,
            row.value
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into()),
            row.unit,
            row.limit,
            row.unit,
            met
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> Results {
        Results::new(
            Machine {
                cpu: "cpu".into(),
                cpus: 2,
                virtualisation: "virtual machine",
                mem_mib: 1,
                kernel: "k".into(),
                docker: "d".into(),
                storage_driver: "overlay2".into(),
                cgroup: "2".into(),
            },
            RunOptions {
                iterations: 1,
                warmup: 0,
                rounds: 1,
                broker_calls: 1,
                channels: 1,
                image: "i".into(),
            },
        )
    }

    /// A part not run leaves its targets unmeasured and its key out of the JSON.
    #[test]
    fn parts_not_run_are_not_measured_and_not_written() {
        let mut r = empty();
        r.targets = targets(&r);
        assert_eq!(r.targets.len(), 16);
        assert!(r
            .targets
            .iter()
            .all(|t| t.value.is_none() && t.met.is_none()));
        let v = serde_json::to_value(&r).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["machine", "memory", "options", "targets"]);
        assert_eq!(v["memory"], serde_json::json!({}));
    }

    /// The targets read the typed figures; NaN is not a value, and a limit is inclusive.
    #[test]
    fn targets_read_the_figures() {
        let mut r = empty();
        r.memory.idle_channels = Some(memory::IdleChannels {
            observed: false,
            channels: 10,
            live_channels: 74,
            rss_start_kib: 0,
            rss_after_turns_on_existing_channels_kib: 0,
            rss_after_new_idle_channels_kib: 0,
            growth_turns_only_kib: 0.0,
            growth_new_channels_kib: 40.0,
            per_channel_raw_kib: 4.0,
            per_channel_kib: 4.0,
        });
        let t = targets(&r);
        let rss = t
            .iter()
            .find(|t| t.target == "RSS per idle channel")
            .unwrap();
        assert_eq!((rss.value, rss.met), (Some(4.0), Some(true)));
        assert_eq!(at_least("x", Some(0.969_4), 0.97).met, Some(false));
        assert_eq!(at_most("x", Some(f64::NAN), 1.0, "×").met, None);
    }
}
