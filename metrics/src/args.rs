//! `--metrics ADDR` for the bots (feature `cli`).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::{check_address, Metrics, MetricsError, MetricsServer};

/// The metrics endpoint's flags: `#[command(flatten)]` them into a bot's command line
/// (global: the CLI's `doctor` and `explain` take them too).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (a loopback address unless
    /// --metrics-allow-remote; bare --metrics: 127.0.0.1:9464)
    #[arg(
        long,
        value_name = "ADDR",
        num_args = 0..=1,
        default_missing_value = "127.0.0.1:9464",
        global = true
    )]
    pub metrics: Option<SocketAddr>,
    /// Allow --metrics on an address that is not loopback (the metrics then reach
    /// whoever reaches that address: put them behind a firewall)
    #[arg(long, requires = "metrics", global = true)]
    pub metrics_allow_remote: bool,
}

impl MetricsArgs {
    /// The address, checked against the loopback rule; `None` when metrics are off.
    pub fn address(&self) -> Result<Option<SocketAddr>, MetricsError> {
        self.metrics
            .map(|addr| check_address(addr, self.metrics_allow_remote).map(|()| addr))
            .transpose()
    }

    /// Starts the endpoint when asked for: the registry (to install its observer) and the
    /// running server.
    pub fn start(&self) -> Result<Option<(Arc<Metrics>, MetricsServer)>, MetricsError> {
        let Some(addr) = self.metrics else {
            return Ok(None);
        };
        let metrics = Arc::new(Metrics::new());
        let server = MetricsServer::start(addr, self.metrics_allow_remote, metrics.clone())?;
        Ok(Some((metrics, server)))
    }
}
