//! Part 12, egress (issue 45): a `GET` through the broker's egress route against the same
//! `GET` straight to the loopback HTTPS site, interleaved, **both on new connections** (the
//! broker opens one per request: it resolves, checks the address and connects to the
//! address it checked, so a pooled direct path would not be the same request), and an A/A
//! control (the direct path against itself) that gives the machine's noise on the same
//! run. The site (a CA the bench makes) and its DNS server are loopback-only
//! (test-support's, as the tests'). No Docker.
//!
//! The hostile side (many large answers at once: the host's RSS against idle) is
//! `roundtable-bench hostile --attack egress` ([`super::hostile`]).

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use roundtable_sandbox::internals::broker::{Broker, BrokerPolicy, TurnContext};
use roundtable_sandbox::internals::testing::broker_policy;
use roundtable_sandbox::protocol::Speaker;
use roundtable_sandbox::EgressRoute;
use roundtable_sandbox_test_support::egress::{direct_get, Dns, TestCa, Upstream, REACHABLE};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use crate::stats::{interval, median, median_ci, round3, Samples, Summary};
use crate::Options;

/// The target: what the broker adds to an egress `GET` (p50), at most.
pub const TARGET_ADDED_MS: f64 = 1.0;

/// Part 12's figures.
#[derive(Debug, Serialize)]
pub struct EgressPart {
    pub requests: usize,
    pub broker: Summary,
    pub direct: Summary,
    /// The A/A control: the direct path measured again, interleaved with the others.
    pub direct_again: Summary,
    /// Broker − direct, the median of the paired differences (the target's figure).
    pub added_p50_ms: f64,
    pub added_p50_ms_ci95: Option<[f64; 2]>,
    /// Direct − direct again: the noise.
    pub a_a_p50_ms: f64,
    pub a_a_p50_ms_ci95: Option<[f64; 2]>,
}

/// A route of any host (`*`) that may reach the site's loopback address (on `port`) and
/// trusts the bench's CA; its per-turn caps out of the way of a measurement.
pub fn route(ca_pem: &Path, port: u16) -> EgressRoute {
    let mut r = EgressRoute::hosts("web", &["*"]);
    r.ports = vec![port];
    r.allow_private = vec![format!("{REACHABLE}/32")];
    r.ca_file = Some(ca_pem.to_owned());
    r.limits.max_requests_per_turn = 10_000;
    r.limits.max_bytes_in_per_turn = 1 << 40;
    r.limits.max_bytes_out_per_turn = 1 << 40;
    r
}

/// The broker's side of one request: a new connection to the turn's socket, the `GET`,
/// the answer read to its end; its status.
pub async fn broker_get(socket: &Path, path: &str) -> Result<u16> {
    let mut s = UnixStream::connect(socket).await?;
    let head = format!("GET {path} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n");
    s.write_all(head.as_bytes()).await?;
    let mut all = Vec::new();
    s.read_to_end(&mut all).await?;
    let status = String::from_utf8_lossy(&all[..all.len().min(16)])
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok(status)
}

pub async fn run(o: &Options) -> Result<EgressPart> {
    let n = o.broker_calls;
    println!(
        "\n== 12. egress: a GET through the broker's route vs straight to the loopback HTTPS site, {n} interleaved requests each, new connections on both (+ the direct path again: A/A)"
    );
    let ca = TestCa::new();
    let up = Upstream::start(&ca, REACHABLE, 0).await;
    let dns = Dns::start(&[("egress.test", &[REACHABLE])]).await;
    let policy = BrokerPolicy {
        egress: vec![route(&ca.pem_file, up.addr.port())],
        egress_nameserver: Some(dns.addr),
        ..broker_policy("http://127.0.0.1:9/v1", "sk-bench-egress-never-leaves")
    };
    let broker = Arc::new(Broker::new(policy).await.context("start the broker")?);
    let dir = tempfile::Builder::new()
        .prefix("rtb-egress-")
        .tempdir_in("/tmp")?;
    let socket = dir.path().join("broker.sock");
    let ctx = TurnContext {
        channel: "#bench".into(),
        speaker: Speaker {
            id: "u1".into(),
            name: "bench".into(),
        },
        cancel: CancellationToken::new(),
        events: None,
        account: None,
    };
    let mut listener = broker.listen(&socket, ctx.clone()).await?;
    let port = up.addr.port();
    let via = format!("/v1/egress/web/https/egress.test:{port}/echo");
    let client = ca.client_config();
    let direct = || direct_get(client.clone(), up.addr, "egress.test", "/echo");
    let (mut b, mut d, mut a) = (Samples::default(), Samples::default(), Samples::default());
    let mut sent = 0;
    for i in 0..(n + 20) {
        // A turn's route allows 10,000 requests: a new turn's listener before that.
        if sent + 3 > 9_000 {
            listener.stop().await?;
            listener = broker.listen(&socket, ctx.clone()).await?;
            sent = 0;
        }
        let mut times = [std::time::Duration::ZERO; 3];
        // Each of the 6 orders of the three paths in turn.
        let order = [
            [0, 1, 2],
            [1, 2, 0],
            [2, 0, 1],
            [0, 2, 1],
            [2, 1, 0],
            [1, 0, 2],
        ][i % 6];
        for path in order {
            let started = std::time::Instant::now();
            let status = match path {
                0 => broker_get(&socket, &via).await?,
                _ => direct().await?.0,
            };
            times[path] = started.elapsed();
            if status != 200 {
                bail!("an egress GET was answered {status}");
            }
        }
        sent += 1;
        if i >= 20 {
            b.push(times[0]);
            d.push(times[1]);
            a.push(times[2]);
        }
    }
    listener.stop().await?;
    // The paired differences (ms): each round's three requests ran back to back.
    let diff = |x: &Samples, y: &Samples| -> Vec<f64> {
        x.values()
            .iter()
            .zip(y.values())
            .map(|(p, q)| p - q)
            .collect()
    };
    let (added_d, noise_d) = (diff(&b, &d), diff(&d, &a));
    let (added, added_ci) = (median(&added_d), median_ci(&added_d));
    let (noise, noise_ci) = (median(&noise_d), median_ci(&noise_d));
    println!("{:<24} {:>10} {:>10} {:>10}", "(ms)", "p50", "p95", "mean");
    for (name, s) in [("broker", &b), ("direct", &d), ("direct again (A/A)", &a)] {
        println!(
            "{:<24} {:>10.3} {:>10.3} {:>10.3}",
            name,
            s.p50(),
            s.p95(),
            s.mean()
        );
    }
    println!(
        "broker-added p50 {added:.3} ms {} (target ≤ {TARGET_ADDED_MS} ms: {}); A/A {noise:.3} ms {}",
        interval(added_ci),
        if added <= TARGET_ADDED_MS { "met" } else { "NOT met" },
        interval(noise_ci)
    );
    let ci = |c: Option<(f64, f64)>| c.map(|(l, h)| [round3(l), round3(h)]);
    Ok(EgressPart {
        requests: b.len(),
        broker: b.summary(),
        direct: d.summary(),
        direct_again: a.summary(),
        added_p50_ms: round3(added),
        added_p50_ms_ci95: ci(added_ci),
        a_a_p50_ms: round3(noise),
        a_a_p50_ms_ci95: ci(noise_ci),
    })
}
