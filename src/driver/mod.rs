//! Container drivers: how one turn's sealed container is created, run and removed.
//!
//! Parts:
//! - [`ContainerSpec`]: everything that shapes the container (name, identity, mounts,
//!   limits, labels); built by the turn runner, never from guest input;
//! - [`ContainerDriver`]: the pluggable trait (Docker by default; a recording fake in tests);
//! - [`DriverError`]: each way a run can fail, mapped to a distinct reply by the runner;
//! - [`parse_reply`]: the strict parser of the guest's stdout;
//! - [`docker`]: the Docker Engine driver on bollard.

pub mod docker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use roundtable_sandbox_protocol::Reply;
use tokio_util::sync::CancellationToken;

pub use crate::broker::BoxFuture;
pub use docker::{DockerDriver, DockerOptions};

/// Label set on every container of this project; its value is the runtime instance.
pub const LABEL_RUNTIME: &str = "roundtable-sandbox";
/// Label with the first 16 hex digits of the channel's hash.
pub const LABEL_CHANNEL: &str = "roundtable-sandbox.channel";
/// Label with the turn id.
pub const LABEL_TURN: &str = "roundtable-sandbox.turn";
/// Set to `1` to keep containers after their turn (debugging only).
pub const KEEP_CONTAINERS_ENV: &str = "ROUNDTABLE_SANDBOX_KEEP_CONTAINERS";

/// The shape of one turn's container.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerSpec {
    pub name: String,
    pub image: String,
    /// Host dir holding only `broker.sock`; mounted read-only at `/run/roundtable`.
    pub run_dir: PathBuf,
    /// Host dir of this channel's workspace; mounted read-write at `/workspace`.
    pub workspace_dir: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub memory_mb: u64,
    pub cpus: f64,
    pub pids: i64,
    pub tmpfs_mb: u64,
    /// Largest file the guest may write, in MiB (`RLIMIT_FSIZE`; the workspace quota).
    pub file_size_mb: u64,
    /// Cap on stdout bytes; past it the container is killed and the turn fails.
    pub output_cap: usize,
    /// Cap on stderr bytes kept for the debug log.
    pub stderr_cap: usize,
    pub labels: BTreeMap<String, String>,
    /// Replaces the image's entrypoint (tests and benchmarks).
    pub command: Option<Vec<String>>,
    /// The engine's runtime for this container (`runsc`: gVisor); `None`: the engine's default.
    pub runtime: Option<String>,
}

/// How a container run failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("turn cancelled")]
    Cancelled,
    #[error("guest killed: out of memory (limit {limit_mb} MiB)")]
    OutOfMemory { limit_mb: u64 },
    #[error("guest exited with code {code}")]
    Exit { code: i64 },
    #[error("guest killed: a file grew past the workspace quota ({limit_mb} MiB)")]
    FileTooLarge { limit_mb: u64 },
    #[error("guest output exceeds {cap} bytes")]
    OutputTooLarge { cap: usize },
    #[error("guest output is not a valid reply: {reason}")]
    MalformedOutput { reason: String },
    #[error("sandbox image not found: {image} (build it with scripts/build-image.sh)")]
    ImageMissing { image: String },
    #[error("container runtime {runtime} is not known to the engine (register it: scripts/setup.sh --gvisor, as root, for runsc)")]
    RuntimeMissing { runtime: String },
    #[error("docker daemon unreachable: {reason}")]
    DaemonUnreachable { reason: String },
    #[error("docker {op} of {container} timed out after {after:?}")]
    DockerTimeout {
        op: &'static str,
        container: String,
        after: Duration,
    },
    #[error("docker {op} of {container} failed: {reason}")]
    Docker {
        op: &'static str,
        container: String,
        reason: String,
    },
}

/// The processes of one running container, as the host sees them (see
/// [`ContainerDriver::processes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerProcesses {
    /// Host pids (thread-group ids) of every process in the container.
    pub pids: Vec<u32>,
    /// A string that `/proc/<pid>/cgroup` of each of them holds (the container's id): a pid
    /// whose cgroup file does not hold it was reused by another process and is skipped.
    pub cgroup_marker: Option<String>,
}

/// Runs turns in containers. Implementations must be cancellation-safe: when `cancel`
/// fires, the container is killed and `run` returns [`DriverError::Cancelled`] promptly.
pub trait ContainerDriver: Send + Sync + std::fmt::Debug {
    /// Creates and starts the container, writes `stdin` (the turn JSON) to it, and returns
    /// the parsed reply. The container is left for [`ContainerDriver::remove`].
    fn run<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        stdin: &'a [u8],
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Reply, DriverError>>;

    /// Removes the named container (killing it); absent is not an error.
    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>>;

    /// Removes the leftover containers of this runtime: labelled with `scope.instance`,
    /// their run dir under `scope.run_root`, and not of a live turn (`scope.live`, asked
    /// after listing). Returns the names removed.
    fn sweep<'a>(
        &'a self,
        scope: SweepScope<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, DriverError>>;

    /// The host pids of the named container's processes (empty when it is not running).
    /// The workspace quota stats their open descriptors to count files deleted while held
    /// open (see [`crate::quota`]). The default (a driver without host processes, such as a
    /// test fake) has none.
    fn processes<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ContainerProcesses, DriverError>> {
        let _ = name;
        Box::pin(async { Ok(ContainerProcesses::default()) })
    }

    /// The host directory where the engine stores images and container layers, whose
    /// filesystem the free-space floor guards (`None`: no such directory, as in a fake).
    fn data_root(&self) -> BoxFuture<'_, Result<Option<PathBuf>, DriverError>> {
        Box::pin(async { Ok(None) })
    }
}

/// What a sweep may remove (see [`ContainerDriver::sweep`]).
#[derive(Clone, Copy)]
pub struct SweepScope<'a> {
    /// The runtime instance (the value of [`LABEL_RUNTIME`]).
    pub instance: &'a str,
    /// The run root: a container whose run dir lies elsewhere belongs to another runtime
    /// that shares the instance name, and is left alone.
    pub run_root: &'a std::path::Path,
    /// Whether the named container is a live turn's (never removed).
    pub live: &'a (dyn Fn(&str) -> bool + Send + Sync),
}

impl std::fmt::Debug for SweepScope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SweepScope")
            .field("instance", &self.instance)
            .field("run_root", &self.run_root)
            .finish_non_exhaustive()
    }
}

/// Strictly parses the guest's stdout: exactly one [`Reply`] JSON document (whitespace
/// around it allowed), no unknown field, a consistent shape, at most `cap` bytes. A failed
/// reply's error is prefixed with [`GUEST_ERROR_PREFIX`].
pub fn parse_reply(stdout: &[u8], cap: usize) -> Result<Reply, DriverError> {
    if stdout.len() > cap {
        return Err(DriverError::OutputTooLarge { cap });
    }
    if stdout.iter().all(u8::is_ascii_whitespace) {
        return Err(DriverError::MalformedOutput {
            reason: "no output".into(),
        });
    }
    let reply: Reply =
        serde_json::from_slice(stdout).map_err(|e| DriverError::MalformedOutput {
            reason: e.to_string(),
        })?;
    let mut reply = reply;
    reply
        .check_shape()
        .map_err(|reason| DriverError::MalformedOutput {
            reason: reason.into(),
        })?;
    // A failure the guest reports is marked as the guest's: it can never pass for one of
    // the host's own errors (a timeout, a stop, an out-of-memory kill).
    if let Some(error) = reply.error.take() {
        reply.error = Some(format!("{GUEST_ERROR_PREFIX}{error}"));
    }
    Ok(reply)
}

/// What every failure reported by the guest itself starts with (see [`parse_reply`]).
pub const GUEST_ERROR_PREFIX: &str = "the guest reported an error: ";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_reply_is_strict() {
        assert_eq!(
            parse_reply(b" {\"ok\":true,\"text\":\"hi\"}\n", 100)
                .unwrap()
                .text
                .as_deref(),
            Some("hi")
        );
        let err = |b: &[u8]| parse_reply(b, 64).unwrap_err().to_string();
        assert_eq!(err(b""), "guest output is not a valid reply: no output");
        assert!(err(b"garbage").starts_with("guest output is not a valid reply: expected value"));
        assert!(err(b"{\"ok\":true,\"text\":\"a\"} trailing").contains("trailing characters"));
        assert!(err(b"{\"ok\":true,\"text\":\"a\",\"admin\":true}").contains("unknown field"));
        assert_eq!(
            err(b"{\"ok\":true}"),
            "guest output is not a valid reply: an ok reply must carry text and no error"
        );
        assert_eq!(err(&[b' '; 65]), "guest output exceeds 64 bytes");
        assert_eq!(
            parse_reply(b"{\"ok\":false,\"error\":\"turn stopped\"}", 100)
                .unwrap()
                .error
                .as_deref(),
            Some("the guest reported an error: turn stopped")
        );
    }
}
