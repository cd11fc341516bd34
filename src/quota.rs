//! The workspace quota: how much disk a channel's workspace may hold.
//!
//! Three layers, none of which needs root or reads a workspace file's content:
//! 1. **Per file, in the kernel**: the container runs with `RLIMIT_FSIZE` at the quota
//!    (`ulimit fsize`), so no single file can grow past it (the writer gets `SIGXFSZ` /
//!    `EFBIG`; the turn fails with a clear error).
//! 2. **During the turn**: a watcher measures the workspace every [`WATCH_INTERVAL`] (or
//!    four times the last measure's duration, if longer) and kills the container as soon
//!    as it is over quota (many files, each under the per-file cap). The overshoot is
//!    bounded by what the guest can write in one interval.
//! 3. **Before each turn**: a workspace over quota refuses the turn with a clear error
//!    until an operator frees space (the channel's dir is `workspace_root/<segment>`).
//!
//! A workspace that cannot be measured (a tree nested past `PATH_MAX`) counts as over
//! quota: the watcher ends the turn and the next turn is refused.
//!
//! The measure ([`measure`]) is metadata only: `readdir` and `lstat`, never following a
//! symlink, never opening a file. It counts allocated blocks (a sparse file costs what it
//! occupies) and entries (an inode flood is refused too), and stops as soon as either
//! limit is passed, so a hostile tree costs the host at most `max_entries` `lstat` calls.
//! A directory the guest made unreadable (`chmod 000`) is given back `u+rwx` — its owner
//! is the service user — so nothing can be hidden from the count.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How often the watcher measures a running turn's workspace (at least; a workspace whose
/// measure takes long is measured less often, so the watcher stays under ~20 % of a core).
pub const WATCH_INTERVAL: Duration = Duration::from_millis(250);

/// What a workspace holds, as far as it was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Allocated bytes (`st_blocks * 512`) of every entry counted.
    pub bytes: u64,
    /// Entries counted (files, dirs, links…), the workspace dir itself excluded.
    pub entries: u64,
}

/// A workspace's quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub max_bytes: u64,
    pub max_entries: u64,
}

impl Quota {
    /// Whether `usage` is past this quota.
    pub fn exceeded_by(&self, usage: &Usage) -> bool {
        usage.bytes > self.max_bytes || usage.entries > self.max_entries
    }
}

/// Why a workspace was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error(
        "this channel's workspace is over its quota ({used} used; the limit is {limit}); \
         an operator must free space in it before the next turn"
    )]
    Exceeded { used: String, limit: String },
    #[error(
        "this channel's workspace cannot be measured ({0}); an operator must fix or clear it \
         before the next turn"
    )]
    Measure(String),
}

impl QuotaError {
    fn exceeded(quota: &Quota, usage: &Usage) -> Self {
        if usage.entries > quota.max_entries {
            QuotaError::Exceeded {
                used: format!("more than {} entries", quota.max_entries),
                limit: format!("{} entries", quota.max_entries),
            }
        } else {
            QuotaError::Exceeded {
                used: format!("{} MiB", usage.bytes.div_ceil(1 << 20)),
                limit: format!("{} MiB", quota.max_bytes >> 20),
            }
        }
    }
}

/// Measures `dir` (metadata only), stopping as soon as `quota` is passed.
pub fn measure(dir: &Path, quota: &Quota) -> std::io::Result<Usage> {
    let mut usage = Usage::default();
    let mut pending: Vec<PathBuf> = vec![dir.to_owned()];
    while let Some(d) = pending.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                // The guest (same uid) took its own rights away: give them back, count.
                let meta = std::fs::symlink_metadata(&d)?;
                if !meta.is_dir() {
                    continue;
                }
                std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))?;
                std::fs::read_dir(&d)?
            }
            // Removed under us (a racing writer): nothing left to count there.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && d != dir => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = match entry {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            usage.entries += 1;
            // DirEntry::metadata is an lstat: a symlink is counted, never followed.
            let meta = match entry.metadata() {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            usage.bytes = usage
                .bytes
                .saturating_add(meta.blocks().saturating_mul(512));
            if quota.exceeded_by(&usage) {
                return Ok(usage);
            }
            if meta.file_type().is_dir() {
                pending.push(entry.path());
            }
        }
    }
    Ok(usage)
}

/// Refuses a workspace over quota (the check before a turn).
pub fn check(dir: &Path, quota: &Quota) -> Result<Usage, QuotaError> {
    let usage = measure(dir, quota).map_err(|e| QuotaError::Measure(e.to_string()))?;
    if quota.exceeded_by(&usage) {
        return Err(QuotaError::exceeded(quota, &usage));
    }
    Ok(usage)
}

/// Measures `dir` every [`WATCH_INTERVAL`] or more (off the async threads); returns the error as
/// soon as it is over quota. Never returns otherwise: race it against the turn.
pub async fn watch(dir: PathBuf, quota: Quota) -> QuotaError {
    let mut pause = WATCH_INTERVAL;
    loop {
        tokio::time::sleep(pause).await;
        let d = dir.clone();
        let started = std::time::Instant::now();
        let measured = tokio::task::spawn_blocking(move || measure(&d, &quota)).await;
        pause = WATCH_INTERVAL.max(started.elapsed() * 4);
        match measured {
            Ok(Ok(usage)) if quota.exceeded_by(&usage) => {
                return QuotaError::exceeded(&quota, &usage);
            }
            Ok(Ok(_)) => {}
            // A workspace that cannot be measured (a tree nested past PATH_MAX, a dir
            // swapped for a file) could hide any amount of data: once is a race, twice in
            // a row ends the turn like an exceeded quota.
            Ok(Err(e)) => {
                let d = dir.clone();
                match tokio::task::spawn_blocking(move || measure(&d, &quota)).await {
                    Ok(Ok(usage)) if quota.exceeded_by(&usage) => {
                        return QuotaError::exceeded(&quota, &usage);
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(_)) => return QuotaError::Measure(e.to_string()),
                    Err(e) => tracing::debug!(error = %e, "workspace measure task"),
                }
            }
            Err(e) => tracing::debug!(error = %e, "workspace measure task"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(mb: u64, entries: u64) -> Quota {
        Quota {
            max_bytes: mb << 20,
            max_entries: entries,
        }
    }

    #[test]
    fn counts_blocks_and_entries_without_following_links() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/a"), vec![1u8; 100_000]).unwrap();
        // A sparse file: large size, few blocks.
        let f = std::fs::File::create(d.join("sparse")).unwrap();
        f.set_len(1 << 40).unwrap();
        // A link to a big tree outside is counted as a link, not followed.
        std::os::unix::fs::symlink("/usr", d.join("usr")).unwrap();
        let u = measure(d, &quota(1024, 1000)).unwrap();
        assert_eq!(u.entries, 4);
        assert!(u.bytes >= 100_000 && u.bytes < 200_000, "{u:?}");
        assert!(check(d, &quota(1024, 1000)).is_ok());
        assert_eq!(
            check(d, &quota(1024, 3)).unwrap_err().to_string(),
            "this channel's workspace is over its quota (more than 3 entries used; the limit is 3 entries); an operator must free space in it before the next turn"
        );
        std::fs::write(d.join("big"), vec![1u8; 2 << 20]).unwrap();
        assert_eq!(
            check(d, &quota(1, 1000)).unwrap_err().to_string(),
            "this channel's workspace is over its quota (3 MiB used; the limit is 1 MiB); an operator must free space in it before the next turn"
        );
    }

    #[test]
    fn an_unreadable_dir_is_opened_again_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let hidden = dir.path().join("hidden");
        std::fs::create_dir(&hidden).unwrap();
        std::fs::write(hidden.join("x"), vec![1u8; 50_000]).unwrap();
        std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o000)).unwrap();
        let u = measure(dir.path(), &quota(1024, 1000)).unwrap();
        assert_eq!(u.entries, 2, "{u:?}");
        assert!(u.bytes >= 50_000);
    }
}
