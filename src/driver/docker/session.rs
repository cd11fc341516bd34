//! Long-lived attached containers (an MCP session's, [`ContainerDriver::start_session`]):
//! created with a turn's hardening and the session's own argv, mounts and network,
//! attached (stdin kept open) and started; and a file read out of an image
//! ([`ContainerDriver::image_file`]: a container created from it, never started, its
//! archive read, removed).

use bollard::query_parameters::{
    AttachContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
};

use super::*;
use crate::driver::{SessionIo, SessionOutput, SessionSpec};

impl DockerDriver {
    /// Creates, attaches and starts a session's container (see
    /// [`ContainerDriver::start_session`]). Under gVisor the files its processes hold open
    /// are counted inside, on `spec.measured`, by `/roundtable-guest --held-files`.
    pub(super) async fn start_session_inner(
        &self,
        spec: &SessionSpec,
    ) -> Result<SessionIo, DriverError> {
        let docker = self.engine().await?;
        self.retry_pending_removals().await;
        let name = spec.name.as_str();
        let volumes = self.image_volumes(docker, &spec.image).await?;
        self.create(
            docker,
            name,
            create::session_body(spec, &volumes),
            spec.runtime.as_deref(),
        )
        .await?;
        if spec.runtime.as_deref() == Some(crate::driver::GVISOR_RUNTIME) {
            let sandboxed = Sandboxed {
                user: format!("{}:{}", spec.uid, spec.gid),
                dir: spec.measured.clone(),
            };
            self.sandboxed
                .lock()
                .unwrap()
                .insert(name.to_owned(), sandboxed);
        }
        let bollard::container::AttachContainerResults { output, input } =
            self.attach_and_start(docker, name).await?;
        let output = output
            .take_while(|frame| std::future::ready(frame.is_ok()))
            .filter_map(|frame| {
                std::future::ready(match frame {
                    Ok(LogOutput::StdOut { message }) => Some(SessionOutput::Stdout(message)),
                    Ok(LogOutput::StdErr { message }) => Some(SessionOutput::Stderr(message)),
                    _ => None,
                })
            });
        Ok(SessionIo {
            output: Box::pin(output),
            input,
        })
    }

    /// The regular file `path` of `image` (see [`ContainerDriver::image_file`]).
    pub(super) async fn image_file_inner(
        &self,
        image: &str,
        path: &str,
        max: u64,
    ) -> Result<Vec<u8>, DriverError> {
        let docker = self.engine().await?;
        let name = format!("rtb-read-{:016x}", uuid::Uuid::new_v4().as_u128() as u64);
        self.create(
            docker,
            &name,
            read_body(image, super::lifecycle::since_epoch().as_secs()),
            None,
        )
        .await?;
        let read = self.read_archive(docker, &name, path, max).await;
        if let Err(e) = self.remove_inner(&name).await {
            tracing::warn!(container = %name, error = %e, "remove the container an image file was read from");
        }
        read
    }

    /// The one regular file an archive of `path` in container `name` holds.
    async fn read_archive(
        &self,
        docker: &Docker,
        name: &str,
        path: &str,
        max: u64,
    ) -> Result<Vec<u8>, DriverError> {
        let failed = |message: String| DriverError::Call {
            engine: ENGINE,
            op: "read a file of an image",
            container: name.to_owned(),
            status: None,
            message,
        };
        let options = DownloadFromContainerOptionsBuilder::new()
            .path(path)
            .build();
        let mut stream = docker.download_from_container(name, Some(options));
        // The archive: the file, its header and padding (tar's blocks), no more.
        let cap = max.saturating_add(64 * 1024);
        let mut archive = Vec::new();
        let read = async {
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| classify("archive", name, e))?;
                archive.extend_from_slice(&chunk);
                if archive.len() as u64 > cap {
                    return Err(failed(format!("{path} is larger than {max} bytes")));
                }
            }
            Ok(())
        };
        tokio::time::timeout(self.options.call_timeout, read)
            .await
            .map_err(|_| DriverError::CallTimeout {
                engine: ENGINE,
                op: "archive",
                container: name.to_owned(),
                after: self.options.call_timeout,
            })??;
        let mut entries = tar::Archive::new(&archive[..]);
        let mut entries = entries.entries().map_err(|e| failed(e.to_string()))?;
        let mut entry = match entries.next() {
            Some(Ok(entry)) => entry,
            Some(Err(e)) => return Err(failed(e.to_string())),
            None => return Err(failed(format!("{path} is not in the image"))),
        };
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(failed(format!("{path} is not a regular file")));
        }
        if entry.header().size().unwrap_or(u64::MAX) > max {
            return Err(failed(format!("{path} is larger than {max} bytes")));
        }
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut bytes).map_err(|e| failed(e.to_string()))?;
        Ok(bytes)
    }

    /// Attaches to a created container's stdin, stdout and stderr, then starts it.
    pub(super) async fn attach_and_start(
        &self,
        docker: &Docker,
        name: &str,
    ) -> Result<bollard::container::AttachContainerResults, DriverError> {
        let attach = AttachContainerOptionsBuilder::new()
            .stdin(true)
            .stdout(true)
            .stderr(true)
            .stream(true)
            .logs(false)
            .build();
        let io = self
            .call("attach", name, docker.attach_container(name, Some(attach)))
            .await?;
        self.call("start", name, docker.start_container(name, None))
            .await?;
        Ok(io)
    }
}

/// The container an image's file is read from: never started (its entrypoint does not
/// exist), no network, labelled [`LABEL_READ`] with `made` (Unix seconds) for the sweep.
fn read_body(image: &str, made: u64) -> ContainerCreateBody {
    ContainerCreateBody {
        image: Some(image.to_owned()),
        entrypoint: Some(vec!["/nonexistent".into()]),
        network_disabled: Some(true),
        labels: Some(HashMap::from([(LABEL_READ.to_owned(), made.to_string())])),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The read container carries its label and time, so a crash's leftover is swept.
    #[test]
    fn a_read_container_is_labelled_with_its_time() {
        let body = read_body("img", 1234);
        assert_eq!(
            body.labels.unwrap().get(LABEL_READ).map(String::as_str),
            Some("1234")
        );
        assert_eq!(body.entrypoint.unwrap(), vec!["/nonexistent".to_owned()]);
    }
}
