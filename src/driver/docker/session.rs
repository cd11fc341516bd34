//! Long-lived attached containers (an MCP session's): created, attached (stdin kept open)
//! and started.

use super::*;

impl DockerDriver {
    /// Creates, attaches and starts a long-lived container whose stdin stays open (an MCP
    /// session, see `broker::mcp_container`): its stdout and stderr, and its stdin. Under
    /// gVisor the files its processes hold open are counted inside, on `measured` (the
    /// session's data mount), by the image's `/roundtable-guest --held-files`.
    pub(crate) async fn start_attached(
        &self,
        name: &str,
        body: ContainerCreateBody,
        measured: &'static str,
    ) -> Result<bollard::container::AttachContainerResults, DriverError> {
        let docker = self.engine().await?;
        let image = body.image.clone().unwrap_or_default();
        let runtime = body.host_config.as_ref().and_then(|h| h.runtime.clone());
        let user = body.user.clone().unwrap_or_default();
        let create = CreateContainerOptionsBuilder::new().name(name).build();
        match self
            .call("create", name, docker.create_container(Some(create), body))
            .await
        {
            Ok(_) => {}
            Err(DriverError::Call {
                status, message, ..
            }) if status == Some(404) || message.contains("No such image") => {
                return Err(DriverError::ImageMissing { image })
            }
            Err(DriverError::Call { message, .. })
                if runtime.is_some() && message.to_lowercase().contains("runtime") =>
            {
                return Err(DriverError::RuntimeMissing {
                    runtime: runtime.unwrap_or_default(),
                })
            }
            Err(e) => return Err(e),
        }
        if runtime.as_deref() == Some(crate::driver::GVISOR_RUNTIME) {
            let sandboxed = Sandboxed {
                user,
                dir: measured,
            };
            self.sandboxed
                .lock()
                .unwrap()
                .insert(name.to_owned(), sandboxed);
        }
        self.attach_and_start(docker, name).await
    }

    /// Attaches to a created container's stdin, stdout and stderr, then starts it.
    pub(super) async fn attach_and_start(
        &self,
        docker: &Docker,
        name: &str,
    ) -> Result<bollard::container::AttachContainerResults, DriverError> {
        let attach = AttachContainerOptions {
            stdin: true,
            stdout: true,
            stderr: true,
            stream: true,
            logs: false,
            detach_keys: None,
        };
        let io = self
            .call("attach", name, docker.attach_container(name, Some(attach)))
            .await?;
        self.call("start", name, docker.start_container(name, None))
            .await?;
        Ok(io)
    }

    /// Removes a container (killed first), as a turn's teardown does; a failure is retried
    /// before the next run or sweep.
    pub(crate) async fn remove_container(&self, name: &str) -> Result<(), DriverError> {
        self.remove_inner(name).await
    }

    /// Every container (running or not) carrying all of `labels` (`key=value`): name and
    /// the host source of each bind mount by its target.
    pub(crate) async fn list_labelled(
        &self,
        labels: Vec<String>,
    ) -> Result<Vec<(String, HashMap<String, String>)>, DriverError> {
        let docker = self.engine().await?;
        let filters: HashMap<&str, Vec<String>> = HashMap::from([("label", labels)]);
        let list = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let found = self
            .call("list", "", docker.list_containers(Some(list)))
            .await?;
        Ok(found
            .into_iter()
            .filter_map(|c| {
                let name = c
                    .names
                    .and_then(|n| n.into_iter().next())
                    .map(|n| n.trim_start_matches('/').to_owned())
                    .or(c.id)?;
                let mounts = c
                    .mounts
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|m| Some((m.destination?, m.source?)))
                    .collect();
                Some((name, mounts))
            })
            .collect())
    }
}
