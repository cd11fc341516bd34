//! The metrics endpoint (`--metrics`), as `explain` shows it and as `doctor` checks it.

use roundtable_sandbox_metrics::MetricsArgs;

use crate::check::{fail, pass, Check};

/// `explain`'s line for the metrics endpoint.
pub(crate) fn explain(metrics: &MetricsArgs) {
    println!(
        "metrics       {}",
        match metrics.address() {
            Ok(None) => "off (the bots serve Prometheus metrics with --metrics ADDR)".to_owned(),
            Ok(Some(addr)) => format!(
                "http://{addr}/metrics (Prometheus; {}; labels never name a channel, a speaker or guest text)",
                if addr.ip().is_loopback() { "loopback only" } else { "REACHABLE beyond this host" }
            ),
            Err(e) => format!("refused: {e}"),
        }
    );
}

/// `doctor`'s line for the metrics endpoint, when one is asked for.
pub(crate) fn doctor(args: &MetricsArgs) -> Option<Check> {
    metrics_check(args)
}

/// The metrics address (`--metrics`): loopback unless allowed otherwise, and bindable now.
fn metrics_check(args: &MetricsArgs) -> Option<Check> {
    const NAME: &str = "metrics";
    let addr = match args.address() {
        Ok(addr) => addr?,
        Err(e) => {
            return Some(fail(
                NAME,
                e.to_string(),
                "serve metrics on 127.0.0.1 (and scrape there), or allow it explicitly",
            ))
        }
    };
    Some(match roundtable_sandbox_metrics::bindable(addr) {
        Ok(()) => pass(NAME, format!("http://{addr}/metrics can be served")),
        Err(e) => fail(
            NAME,
            format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            ),
            "choose a free port (another process holds it, or the address is not this host's)",
        ),
    })
}
