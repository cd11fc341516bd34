//! The price of gVisor: the same turns through the whole runtime under the engine's default
//! runtime (runc) and under gVisor (`runsc`), interleaved in one run.
//!
//! Two kinds of turn, each on both runtimes:
//! - `trivial`: a cold turn whose guest is a busybox `sh -c` script that reads the turn and
//!   answers at once (as in part 1): the container's start and teardown;
//! - `guest`: a full turn with the real guest program: it reads the turn, loads (and
//!   saves) its session in the workspace, makes one model call through the broker (the
//!   bench's loopback model answers at once) and prints the reply.
//!
//! Every turn is cold (a new container); `reply` is when the reply is known, `total` when
//! the container and the run dir are gone.

use anyhow::{Context, Result};
use roundtable_sandbox::config::GVISOR_RUNTIME;
use roundtable_sandbox::Sandbox;
use serde_json::{json, Value};

use crate::lifecycle::{bench_config, command, runtime_turn};
use crate::stats::{ratio, Samples};

/// The paths, in their interleaving order: (name, guest program, runtime).
const PATHS: [(&str, bool, Option<&str>); 4] = [
    ("trivial_runc", false, None),
    ("trivial_gvisor", false, Some(GVISOR_RUNTIME)),
    ("guest_runc", true, None),
    ("guest_gvisor", true, Some(GVISOR_RUNTIME)),
];

async fn sandbox(
    image: &str,
    dir: &std::path::Path,
    name: &str,
    model_url: &str,
    real_guest: bool,
    runtime: Option<&str>,
) -> Result<Sandbox> {
    let mut c = bench_config(
        &dir.join(format!("{name}-run")),
        &dir.join(format!("{name}-ws")),
        image,
        model_url,
    )
    .build();
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
) -> Result<Option<Value>> {
    let (listed, _) = driver.runtimes().await?;
    if !listed.iter().any(|r| r == GVISOR_RUNTIME) {
        println!(
            "\n== 1b. gVisor: skipped, the engine does not list {GVISOR_RUNTIME} \
             (scripts/setup.sh --gvisor, as root)"
        );
        return Ok(None);
    }
    println!("\n== 1b. runc vs gVisor: cold turns through the whole runtime, {iterations} interleaved iterations per path");
    let dir = tempfile::Builder::new()
        .prefix("rtg-")
        .tempdir_in("/tmp")
        .context("make the bench dir")?;
    let mut sandboxes = Vec::new();
    for (name, real_guest, runtime) in PATHS {
        sandboxes.push(sandbox(image, dir.path(), name, model_url, real_guest, runtime).await?);
    }
    for i in 0..warmup {
        for s in &sandboxes {
            runtime_turn(s, &format!("#warm-{i}")).await?;
        }
    }
    let mut reply: Vec<Samples> = PATHS.iter().map(|_| Samples::default()).collect();
    let mut total: Vec<Samples> = PATHS.iter().map(|_| Samples::default()).collect();
    for i in 0..iterations {
        for k in 0..PATHS.len() {
            let idx = (i + k) % PATHS.len();
            // The real guest keeps a session per channel: a few channels, as in a chat.
            let t = runtime_turn(&sandboxes[idx], &format!("#bench-{}", i % 4))
                .await
                .with_context(|| PATHS[idx].0)?;
            reply[idx].push(t.reply);
            total[idx].push(t.total);
        }
    }
    println!(
        "{:<15} {:>10} {:>10} {:>10} {:>10}   (ms)",
        "path", "reply p50", "reply p95", "total p50", "total p95"
    );
    let mut out = json!({});
    for (k, (name, ..)) in PATHS.iter().enumerate() {
        println!(
            "{:<15} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            name,
            reply[k].p50(),
            reply[k].p95(),
            total[k].p50(),
            total[k].p95()
        );
        out[*name] = json!({"reply": reply[k].json(), "total": total[k].json()});
    }
    let ratios = json!({
        "trivial_gvisor_vs_runc_reply_p50": ratio(reply[1].p50(), reply[0].p50()),
        "trivial_gvisor_vs_runc_reply_p95": ratio(reply[1].p95(), reply[0].p95()),
        "trivial_gvisor_vs_runc_total_p50": ratio(total[1].p50(), total[0].p50()),
        "guest_gvisor_vs_runc_reply_p50": ratio(reply[3].p50(), reply[2].p50()),
        "guest_gvisor_vs_runc_reply_p95": ratio(reply[3].p95(), reply[2].p95()),
        "guest_gvisor_vs_runc_total_p50": ratio(total[3].p50(), total[2].p50()),
    });
    println!(
        "gVisor / runc (p50): trivial reply {:.2}, total {:.2}; real guest reply {:.2}, total {:.2}",
        ratios["trivial_gvisor_vs_runc_reply_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["trivial_gvisor_vs_runc_total_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["guest_gvisor_vs_runc_reply_p50"].as_f64().unwrap_or(f64::NAN),
        ratios["guest_gvisor_vs_runc_total_p50"].as_f64().unwrap_or(f64::NAN),
    );
    out["ratios"] = ratios;
    for s in sandboxes {
        s.shutdown().await;
    }
    Ok(Some(out))
}
