//! The engine's own networks (their subnets), which no egress route may reach unless it names
//! them: the broker's deny set takes them at startup.

use bollard::query_parameters::ListNetworksOptions;

use super::DockerDriver;
use crate::driver::DriverError;

impl DockerDriver {
    /// The subnets of every network the engine has (`addr/len`).
    pub(crate) async fn network_subnets(&self) -> Result<Vec<String>, DriverError> {
        let docker = self.engine().await?;
        let networks = self
            .call(
                "networks",
                "",
                docker.list_networks(None::<ListNetworksOptions>),
            )
            .await?;
        Ok(networks
            .into_iter()
            .filter_map(|n| n.ipam?.config)
            .flatten()
            .filter_map(|c| c.subnet)
            .collect())
    }
}
