//! [`Limits`]: the container's resource caps and the workspace's quota and floor (their
//! ranges are checked with the other rules, in `validate`).

use serde::Deserialize;

/// The container's resource caps.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Memory in MiB; swap is set equal, so the container cannot swap.
    pub memory_mb: u64,
    /// CPUs (fractions allowed).
    pub cpus: f64,
    /// Maximum number of processes and threads.
    pub pids: i64,
    /// Size of the `/tmp` tmpfs in MiB.
    pub tmpfs_mb: u64,
    /// Cap on the guest's stdout (the reply) in KiB.
    pub output_kb: u64,
    /// Disk quota of a channel's workspace in MiB (see [`crate::quota`]): no file may grow
    /// past it, a turn that passes it is killed, and a workspace over it refuses turns.
    pub workspace_mb: u64,
    /// Entries (files, dirs, links) a channel's workspace may hold.
    pub workspace_files: u64,
    /// Free space (MiB) the filesystems of the workspaces and of the engine's data root must
    /// keep; below it (or below `disk_floor_percent`, whichever is larger) running turns are
    /// killed and new turns refused. 0 and 0 turn the floor off.
    pub disk_floor_mb: u64,
    /// Free space in percent of each guarded filesystem's size (see `disk_floor_mb`).
    pub disk_floor_percent: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mb: 512,
            cpus: 1.0,
            pids: 128,
            tmpfs_mb: 64,
            output_kb: 1024,
            workspace_mb: 1024,
            workspace_files: 100_000,
            disk_floor_mb: 1024,
            disk_floor_percent: 5,
        }
    }
}

impl Limits {
    /// The workspace quota these limits set.
    pub fn workspace_quota(&self) -> crate::quota::Quota {
        crate::quota::Quota::from_mib(self.workspace_mb, self.workspace_files)
    }

    /// The free-space floor these limits set.
    pub fn disk_floor(&self) -> crate::quota::Floor {
        crate::quota::Floor {
            min_bytes: self.disk_floor_mb.saturating_mul(1 << 20),
            min_percent: self.disk_floor_percent,
        }
    }
}
