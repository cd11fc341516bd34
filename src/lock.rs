//! One runtime per root: an exclusive `flock` on a lock file in each root, held for the
//! runtime's life.
//!
//! The startup sweep removes every container labelled with the instance and every stale
//! `turn-*` dir, so a second runtime on the same run root (an overlapping restart, a second
//! process) would kill the first one's live turns; two runtimes on one workspace root
//! would run two turns of one channel on one workspace at once (each runtime serialises
//! only its own turns). [`Sandbox::new`](crate::Sandbox::new) therefore takes both locks
//! before anything else starts, and a second runtime fails with [`LockError::InUse`].
//!
//! The lock is `flock(LOCK_EX | LOCK_NB)` on `<root>/.roundtable-sandbox.lock` (created
//! 0600, never followed through a symlink). The kernel drops it when the last descriptor
//! closes: when the last clone of the [`Sandbox`](crate::Sandbox) is dropped, or when the
//! process dies however it dies, so a crashed runtime never blocks its successor. The file
//! holds the holder's pid, shown in the error (informational only: the lock is the flock).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The lock file's name in each root (never a `turn-*` dir, never a 64-hex workspace).
pub const LOCK_FILE: &str = ".roundtable-sandbox.lock";

/// Errors of taking a root's lock.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("sandbox root {root} is in use by another runtime{holder}: one runtime per root")]
    /// Another runtime holds the root.
    InUse {
        /// The root.
        root: PathBuf,
        /// Who holds it, where known (` (pid N)`), or empty.
        holder: String,
    },
    /// The lock file could not be opened or locked.
    #[error("lock sandbox root {root}")]
    Lock {
        /// The root.
        root: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A held root lock; dropping it releases the lock.
#[derive(Debug)]
pub struct RootLock {
    root: PathBuf,
    _file: nix::fcntl::Flock<File>,
}

impl RootLock {
    /// Takes the lock of `root` without waiting: a held lock is [`LockError::InUse`].
    pub fn acquire(root: &Path) -> Result<Self, LockError> {
        let err = |source| LockError::Lock {
            root: root.to_owned(),
            source,
        };
        let path = root.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&path)
            .map_err(err)?;
        let mut file =
            match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(locked) => locked,
                Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                    let mut text = String::new();
                    let _ = file.read_to_string(&mut text);
                    let holder = match text.trim().parse::<u32>() {
                        Ok(pid) => format!(" (pid {pid})"),
                        Err(_) => String::new(),
                    };
                    return Err(LockError::InUse {
                        root: root.to_owned(),
                        holder,
                    });
                }
                Err((_, errno)) => return Err(err(errno.into())),
            };
        // Held: record who holds it.
        file.set_len(0).map_err(err)?;
        file.rewind().map_err(err)?;
        writeln!(file, "{}", std::process::id()).map_err(err)?;
        Ok(Self {
            root: root.to_owned(),
            _file: file,
        })
    }

    /// The locked root.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_root_fails_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let first = RootLock::acquire(dir.path()).unwrap();
        let err = RootLock::acquire(dir.path()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "sandbox root {} is in use by another runtime (pid {}): one runtime per root",
                dir.path().display(),
                std::process::id()
            )
        );
        drop(first);
        let again = RootLock::acquire(dir.path()).unwrap();
        assert_eq!(again.root(), dir.path());
    }

    #[test]
    fn a_planted_symlink_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "x").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(LOCK_FILE)).unwrap();
        let err = RootLock::acquire(dir.path()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("lock sandbox root {}", dir.path().display())
        );
        // The cause: the link is refused, not followed.
        let cause = std::error::Error::source(&err).unwrap().to_string();
        assert!(cause.contains("symbolic links"), "{cause}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "x");
    }
}
