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
//!
//! The lock also holds the root's directory descriptor ([`RootLock::dir`]), opened once
//! and checked again to be a private directory of the service user: the channel
//! directories are made and opened relative to it ([`crate::turn`]), never through the
//! root's path, so a root renamed or replaced after startup is not followed.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

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
    /// The root, opened to be held, is no longer a private directory of the service user
    /// (replaced since it was checked).
    #[error("sandbox root {root} changed since it was checked: it is no longer a private directory of the service user")]
    Changed {
        /// The root.
        root: PathBuf,
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
    #[cfg(any(test, feature = "testing"))]
    root: PathBuf,
    dir: OwnedFd,
    #[cfg(any(test, feature = "testing"))]
    dev: u64,
    #[cfg(any(test, feature = "testing"))]
    ino: u64,
    _file: nix::fcntl::Flock<File>,
}

impl RootLock {
    /// Takes the lock of `root` without waiting: a held lock is [`LockError::InUse`].
    pub fn acquire(root: &Path) -> Result<Self, LockError> {
        let err = |source| LockError::Lock {
            root: root.to_owned(),
            source,
        };
        let io = |e: rustix::io::Errno| err(e.into());
        // The root's descriptor, held for the runtime's life: checked once more here, on
        // what is held, by the rule the configuration checked by path.
        let dir = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(io)?;
        let st = rustix::fs::fstat(&dir).map_err(io)?;
        let service_uid = nix::unistd::getuid().as_raw();
        if !crate::config::is_private_dir(st.st_uid, st.st_mode as u32, service_uid) {
            return Err(LockError::Changed {
                root: root.to_owned(),
            });
        }
        let file = File::from(
            rustix::fs::openat(
                &dir,
                LOCK_FILE,
                OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
            .map_err(io)?,
        );
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
            #[cfg(any(test, feature = "testing"))]
            root: root.to_owned(),
            dir,
            #[cfg(any(test, feature = "testing"))]
            #[allow(clippy::unnecessary_cast)]
            dev: st.st_dev as u64,
            #[cfg(any(test, feature = "testing"))]
            #[allow(clippy::unnecessary_cast)]
            ino: st.st_ino as u64,
            _file: file,
        })
    }

    /// The locked root (tests only).
    #[cfg(any(test, feature = "testing"))]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The root's directory, held since startup: what the channel directories are made
    /// and opened relative to.
    pub fn dir(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    /// The held root's identity (device, inode; tests only).
    #[cfg(any(test, feature = "testing"))]
    pub fn id(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private scratch root (the configuration makes every root 0700).
    fn root() -> tempfile::TempDir {
        tempfile::Builder::new()
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .tempdir()
            .unwrap()
    }

    #[test]
    fn a_second_lock_on_a_root_fails_until_the_first_is_dropped() {
        let dir = root();
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
    fn a_root_no_longer_private_when_held_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = root();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = RootLock::acquire(dir.path()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "sandbox root {} changed since it was checked: it is no longer a private directory of the service user",
                dir.path().display()
            )
        );
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let held = RootLock::acquire(dir.path()).unwrap();
        let meta = std::fs::metadata(dir.path()).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(held.id(), (meta.dev(), meta.ino()));
    }

    #[test]
    fn a_planted_symlink_is_not_followed() {
        let dir = root();
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
