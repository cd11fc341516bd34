//! Long-lived attached containers, as an MCP session's runs ([`ContainerDriver::start_session`]),
//! and what the MCP pool asks of a backend besides: pause and resume, a listing by label
//! (its sweep), a file read out of an image (the guest program it wraps each session's
//! command with). A backend that implements none of these refuses them
//! ([`DriverError::Unsupported`]): no MCP session runs there, none runs unconfined.
//!
//! [`ContainerDriver::start_session`]: super::ContainerDriver::start_session
//! [`DriverError::Unsupported`]: super::DriverError::Unsupported

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::pin::Pin;

/// A bind mount of a session's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionMount {
    /// The host path.
    pub source: PathBuf,
    /// Where it appears in the container.
    pub target: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// The shape of a long-lived container whose stdin stays open (an MCP session), hardened as
/// a turn's container is (no capabilities, no new privileges, read-only root, an init,
/// memory = swap, cpu, pids, `/tmp` tmpfs and file-size caps, no core dumps, first in line
/// for the OOM killer), with its own argv, environment and mounts, and the engine's default
/// network only when `network` is set.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionSpec {
    /// The container's name.
    pub name: String,
    /// The image.
    pub image: String,
    /// The uid it runs as (never 0).
    pub uid: u32,
    /// The gid it runs as; no supplementary group is given.
    pub gid: u32,
    /// Memory in MiB (swap is the same: none).
    pub memory_mb: u64,
    /// CPUs.
    pub cpus: f64,
    /// Processes and threads.
    pub pids: i64,
    /// The `/tmp` tmpfs in MiB.
    pub tmpfs_mb: u64,
    /// Largest file it may write, in MiB (`RLIMIT_FSIZE`).
    pub file_size_mb: u64,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// The whole argv (replaces the image's entrypoint and command).
    pub argv: Vec<String>,
    /// Its environment (`KEY=value`), added to the image's.
    pub env: Vec<String>,
    /// Its working directory.
    pub working_dir: String,
    /// Its only mounts.
    pub mounts: Vec<SessionMount>,
    /// The engine's default network (otherwise none).
    pub network: bool,
    /// The engine's runtime (`runsc`: gVisor); `None`: the engine's default.
    pub runtime: Option<String>,
    /// The directory whose files held open with no name left count, where the backend
    /// counts them inside the sandbox ([`super::HeldFiles::Counted`]).
    pub measured: String,
}

/// One piece of what a session's container writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionOutput {
    /// Bytes of its stdout.
    Stdout(bytes::Bytes),
    /// Bytes of its stderr.
    Stderr(bytes::Bytes),
}

/// A started session's stdio: what it writes (ends when its output ends or fails) and its
/// stdin.
pub struct SessionIo {
    /// Its stdout and stderr, in order.
    pub output: Pin<Box<dyn futures_util::Stream<Item = SessionOutput> + Send>>,
    /// Its stdin.
    pub input: Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
}

impl std::fmt::Debug for SessionIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionIo").finish_non_exhaustive()
    }
}

/// A container found by its labels ([`super::ContainerDriver::list_labelled`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LabelledContainer {
    /// Its name.
    pub name: String,
    /// The host source of each bind mount, by its target.
    pub mounts: BTreeMap<String, String>,
}

/// Whether `bytes` is a static ELF64 executable: no `PT_INTERP` program header (no dynamic
/// loader), every program header within the file.
pub fn is_static_elf(bytes: &[u8]) -> bool {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[0x20..0x28]);
    let Ok(phoff) = usize::try_from(u64::from_le_bytes(b)) else {
        return false;
    };
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).all(|i| {
        let Some(o) = i
            .checked_mul(phentsize)
            .and_then(|x| x.checked_add(phoff))
            .filter(|o| o.checked_add(4).is_some_and(|end| end <= bytes.len()))
        else {
            return false;
        };
        u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) != 3
    })
}
