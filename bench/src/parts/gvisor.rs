//! Part 1b, the price of gVisor: the same turns through the whole runtime under the engine's default
//! runtime (runc) and under gVisor (`runsc`), interleaved in one run.
//!
//! Two kinds of turn, each on both runtimes:
//! - `trivial`: a cold turn whose guest is a busybox `sh -c` script that reads the turn and
//!   answers at once (as in part 1): the container's start and teardown;
//! - `guest`: a full turn with the real guest program: it reads the turn, loads (and
//!   saves) its session in the workspace, makes one model call through the broker (the
//!   bench's loopback model answers at once) and prints the reply.
//!
//! Each kind runs cold (a new container) and, for the trivial turn on both runtimes and the
//! real guest on runc, warm (in a container prepared before it, untimed); beside them the
//! bare Docker API lifecycle on each runtime (the baseline of issue 24's ratios, its reply
//! known at the exit). `reply` is when the reply is known, `total` when the container and
//! the run dir are gone. Each runtime path also reports its phases (the turn's observer).

use anyhow::{Context, Result};
use roundtable_sandbox::internals::config::GVISOR_RUNTIME;
use roundtable_sandbox::internals::testing::DockerDriverExt;
use roundtable_sandbox::Sandbox;
use std::collections::BTreeMap;

use serde::Serialize;

use crate::harness::lifecycle::{
    bare_turn_on, bench_config, command, runtime_turn_profiled, warm_turn,
};
use crate::stats::{ratio, NamedSamples, Samples, Summary};

/// One path's figures.
#[derive(Debug, Serialize)]
pub struct PathFigures {
    pub reply: Summary,
    pub total: Summary,
    /// The turn's phases, each from its start to the next's (none for a bare path).
    pub phases: BTreeMap<String, Summary>,
}

/// The ratios of part 1b (p50 unless named p95).
#[derive(Debug, Serialize)]
pub struct Ratios {
    pub trivial_gvisor_vs_runc_reply_p50: f64,
    pub trivial_gvisor_vs_runc_reply_p95: f64,
    pub trivial_gvisor_vs_runc_total_p50: f64,
    pub guest_gvisor_vs_runc_reply_p50: f64,
    pub guest_gvisor_vs_runc_reply_p95: f64,
    pub guest_gvisor_vs_runc_total_p50: f64,
    pub warm_reply_vs_bare_reply_p50_runc: f64,
    pub cold_reply_vs_bare_reply_p50_runc: f64,
    pub warm_reply_vs_bare_reply_p50_gvisor: f64,
    pub cold_reply_vs_bare_reply_p50_gvisor: f64,
    pub guest_warm_vs_trivial_warm_reply_p50_runc: f64,
    pub guest_cold_vs_trivial_cold_reply_p50_runc: f64,
}

/// Part 1b's figures: by path (`trivial_runc`, `guest_gvisor_warm`, `bare_runc`, …) and
/// the ratios.
#[derive(Debug, Serialize)]
pub struct Gvisor {
    #[serde(flatten)]
    pub paths: BTreeMap<&'static str, PathFigures>,
    pub ratios: Ratios,
}

/// How a path's turn runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A cold turn through the whole runtime.
    Cold,
    /// A turn through the whole runtime in a container prepared before it (untimed).
    Warm,
    /// The bare Docker API lifecycle (part 1's `bare_api`), the reply known at the exit.
    Bare,
}

/// The paths, in their interleaving order: (name, guest program, runtime, kind).
const PATHS: [(&str, bool, Option<&str>, Kind); 9] = [
    ("trivial_runc", false, None, Kind::Cold),
    ("trivial_gvisor", false, Some(GVISOR_RUNTIME), Kind::Cold),
    ("guest_runc", true, None, Kind::Cold),
    ("guest_gvisor", true, Some(GVISOR_RUNTIME), Kind::Cold),
    ("trivial_runc_warm", false, None, Kind::Warm),
    (
        "trivial_gvisor_warm",
        false,
        Some(GVISOR_RUNTIME),
        Kind::Warm,
    ),
    ("guest_runc_warm", true, None, Kind::Warm),
    ("bare_runc", false, None, Kind::Bare),
    ("bare_gvisor", false, Some(GVISOR_RUNTIME), Kind::Bare),
];

async fn sandbox(
    image: &str,
    dir: &std::path::Path,
    name: &str,
    model_url: &str,
    real_guest: bool,
    runtime: Option<&str>,
    warm: bool,
) -> Result<Sandbox> {
    let mut b = bench_config(
        &dir.join(format!("{name}-run")),
        &dir.join(format!("{name}-ws")),
        image,
        model_url,
    );
    if warm {
        b = b.warm(roundtable_sandbox::WarmSettings {
            enabled: true,
            max: 8,
            ttl_secs: None,
        });
    }
    let mut c = b.build();
    if !real_guest {
        c.command = Some(command());
    }
    c.runtime = runtime.map(str::to_owned);
    // gVisor reports every broker peer as uid 0 (docs/security.md#gvisor-runtime--runsc).
    c.peer_uid_check = runtime.is_none();
    c.instance = Some(format!(
        "bench-{}-{}",
        name.replace('_', "-"),
        std::process::id()
    ));
    Sandbox::new(c).await.context("start the runtime")
}

/// Runs the comparison; `None` when the engine does not list runsc.
pub async fn compare(
    driver: &roundtable_sandbox::DockerDriver,
    image: &str,
    model_url: &str,
    iterations: usize,
    warmup: usize,
) -> Result<Option<Gvisor>> {
    let (listed, _) = driver.runtimes().await?;
    if !listed.iter().any(|r| r == GVISOR_RUNTIME) {
        println!(
            "\n== 1b. gVisor: skipped, the engine does not list {GVISOR_RUNTIME} \
             (scripts/setup.sh --gvisor, as root)"
        );
        return Ok(None);
    }
    println!("\n== 1b. runc vs gVisor, trivial vs the real guest, cold vs warm, against the bare lifecycle on each runtime: {iterations} interleaved iterations per path");
    let docker = driver.client().await?.clone();
    let stdin = crate::harness::lifecycle::turn_stdin();
    let dir = tempfile::Builder::new()
        .prefix("rtg-")
        .tempdir_in("/tmp")
        .context("make the bench dir")?;
    let mut sandboxes = Vec::new();
    for (name, real_guest, runtime, kind) in PATHS {
        sandboxes.push(match kind {
            Kind::Bare => None,
            _ => Some(
                sandbox(
                    image,
                    dir.path(),
                    name,
                    model_url,
                    real_guest,
                    runtime,
                    kind == Kind::Warm,
                )
                .await?,
            ),
        });
    }
    let mut profile: Vec<NamedSamples> = PATHS.iter().map(|_| NamedSamples::default()).collect();
    let one = |idx: usize, channel: String| {
        let (s, docker, stdin) = (&sandboxes[idx], &docker, &stdin);
        async move {
            let (_, _, runtime, kind) = PATHS[idx];
            match (kind, s) {
                (Kind::Bare, _) => Ok((
                    bare_turn_on(docker, image, stdin, true, runtime).await?,
                    Vec::new(),
                )),
                (Kind::Warm, Some(s)) => warm_turn(s, &channel).await,
                (_, Some(s)) => runtime_turn_profiled(s, &channel).await,
                (_, None) => unreachable!("a runtime path has its runtime"),
            }
        }
    };
    for i in 0..warmup {
        for idx in 0..PATHS.len() {
            one(idx, format!("#warm-{i}")).await?;
        }
    }
    let mut reply: Vec<Samples> = PATHS.iter().map(|_| Samples::default()).collect();
    let mut total: Vec<Samples> = PATHS.iter().map(|_| Samples::default()).collect();
    for i in 0..iterations {
        for k in 0..PATHS.len() {
            let idx = (i + k) % PATHS.len();
            // The real guest keeps a session per channel: a few channels, as in a chat.
            let (t, phases) = one(idx, format!("#bench-{}", i % 4))
                .await
                .with_context(|| PATHS[idx].0)?;
            reply[idx].push(t.reply);
            total[idx].push(t.total);
            profile[idx].push_spans("", &phases);
        }
    }
    println!(
        "{:<20} {:>10} {:>10} {:>10} {:>10}   (ms)",
        "path", "reply p50", "reply p95", "total p50", "total p95"
    );
    let mut paths = BTreeMap::new();
    for (k, (name, ..)) in PATHS.iter().enumerate() {
        println!(
            "{:<20} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            name,
            reply[k].p50(),
            reply[k].p95(),
            total[k].p50(),
            total[k].p95()
        );
        paths.insert(
            *name,
            PathFigures {
                reply: reply[k].summary(),
                total: total[k].summary(),
                phases: profile[k].summaries(),
            },
        );
    }
    for k in [0, 2, 4, 6, 5] {
        print!("phases of {} (p50 ms):", PATHS[k].0);
        for (n, s) in profile[k].iter() {
            print!(" {n} {:.1}", s.p50());
        }
        println!();
    }
    let r = |a: &Samples, b: &Samples| ratio(a.p50(), b.p50());
    let ratios = Ratios {
        trivial_gvisor_vs_runc_reply_p50: r(&reply[1], &reply[0]),
        trivial_gvisor_vs_runc_reply_p95: ratio(reply[1].p95(), reply[0].p95()),
        trivial_gvisor_vs_runc_total_p50: r(&total[1], &total[0]),
        guest_gvisor_vs_runc_reply_p50: r(&reply[3], &reply[2]),
        guest_gvisor_vs_runc_reply_p95: ratio(reply[3].p95(), reply[2].p95()),
        guest_gvisor_vs_runc_total_p50: r(&total[3], &total[2]),
        warm_reply_vs_bare_reply_p50_runc: r(&reply[4], &reply[7]),
        cold_reply_vs_bare_reply_p50_runc: r(&reply[0], &reply[7]),
        warm_reply_vs_bare_reply_p50_gvisor: r(&reply[5], &reply[8]),
        cold_reply_vs_bare_reply_p50_gvisor: r(&reply[1], &reply[8]),
        guest_warm_vs_trivial_warm_reply_p50_runc: r(&reply[6], &reply[4]),
        guest_cold_vs_trivial_cold_reply_p50_runc: r(&reply[2], &reply[0]),
    };
    println!(
        "gVisor / runc (p50): trivial reply {:.2}, total {:.2}; real guest reply {:.2}, total {:.2}",
        ratios.trivial_gvisor_vs_runc_reply_p50,
        ratios.trivial_gvisor_vs_runc_total_p50,
        ratios.guest_gvisor_vs_runc_reply_p50,
        ratios.guest_gvisor_vs_runc_total_p50,
    );
    println!(
        "reply / bare reply (p50): runc warm {:.3}, cold {:.3}; gVisor warm {:.3}, cold {:.3}; real guest / trivial (runc): warm {:.2}, cold {:.2}",
        ratios.warm_reply_vs_bare_reply_p50_runc,
        ratios.cold_reply_vs_bare_reply_p50_runc,
        ratios.warm_reply_vs_bare_reply_p50_gvisor,
        ratios.cold_reply_vs_bare_reply_p50_gvisor,
        ratios.guest_warm_vs_trivial_warm_reply_p50_runc,
        ratios.guest_cold_vs_trivial_cold_reply_p50_runc,
    );
    for s in sandboxes.into_iter().flatten() {
        s.shutdown().await;
    }
    Ok(Some(Gvisor { paths, ratios }))
}
