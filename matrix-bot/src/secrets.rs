//! The bot's Matrix credentials: the password or access token it logs in with (from a file
//! or an environment variable, never a flag: a flag shows in `ps` and the shell's history)
//! and the session file that keeps its device and access token across restarts.
//!
//! The session file is JSON (`homeserver`, `user_id`, `device_id`, `access_token`), the
//! service user's alone: made 0600 under a temporary name, synced and renamed into place; a
//! file another user owns, that group or others can read or write, a link or a special
//! file is refused with a sentence that names the fix. It may not lie in a sandbox root
//! (a guest's workspace, a turn's run dir).
//!
//! A password or token file may be the service user's or root's (a credential an operator
//! installed), never readable by group or others.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The most bytes read from a secret or session file.
const MAX_FILE: u64 = 64 * 1024;

/// Errors of the credential files.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The path is not absolute.
    #[error("{what} {path} must be an absolute path")]
    NotAbsolute {
        /// Which file.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// The path lies in a root of the sandbox.
    #[error("{what} {path} must be outside run_root and workspace_root")]
    InsideRoot {
        /// Which file.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// A link, a directory or another special file.
    #[error("{what} {path} is not a regular file")]
    NotAFile {
        /// Which file.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// Another user owns it, or group or others may read or write it.
    #[error("{what} {path} must be private (mode 0600 or 0400, owner uid {uid}{root}); it is mode {mode:04o}, owner uid {owner}")]
    NotPrivate {
        /// Which file.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Its owner.
        owner: u32,
        /// The service user.
        uid: u32,
        /// ", or root" when root may own it.
        root: &'static str,
    },
    /// Larger than any credential.
    #[error("{what} {path} is larger than {MAX_FILE} bytes")]
    TooLarge {
        /// Which file.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// Empty, or not what it should hold.
    #[error("{what} {path}: {why}")]
    Malformed {
        /// Which file.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// Reading, creating or writing it failed.
    #[error("{what} {path}: {doing}: {source}")]
    Io {
        /// Which file.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// What was being done.
        doing: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

fn io<'a>(
    what: &'static str,
    path: &'a Path,
    doing: &'static str,
) -> impl FnOnce(std::io::Error) -> SecretError + 'a {
    move |source| SecretError::Io {
        what,
        path: path.to_owned(),
        doing,
        source,
    }
}

/// Opens `path` without following a link (nor waiting on a FIFO) and checks, through the
/// descriptor, that it is a regular file of `uid`'s (or root's, with `root_ok`) that group
/// and others can neither read nor write; returns its text.
fn read_private(
    what: &'static str,
    path: &Path,
    uid: u32,
    root_ok: bool,
) -> Result<String, SecretError> {
    if !path.is_absolute() {
        return Err(SecretError::NotAbsolute {
            what,
            path: path.to_owned(),
        });
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits())
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(code) if code == nix::errno::Errno::ELOOP as i32 => SecretError::NotAFile {
                what,
                path: path.to_owned(),
            },
            _ => io(what, path, "open")(e),
        })?;
    let meta = file.metadata().map_err(io(what, path, "inspect"))?;
    if !meta.file_type().is_file() {
        return Err(SecretError::NotAFile {
            what,
            path: path.to_owned(),
        });
    }
    let mode = meta.permissions().mode() & 0o7777;
    let owner_ok = meta.uid() == uid || (root_ok && meta.uid() == 0);
    if !owner_ok || mode & 0o077 != 0 {
        return Err(SecretError::NotPrivate {
            what,
            path: path.to_owned(),
            mode,
            owner: meta.uid(),
            uid,
            root: if root_ok { ", or root" } else { "" },
        });
    }
    if meta.len() > MAX_FILE {
        return Err(SecretError::TooLarge {
            what,
            path: path.to_owned(),
        });
    }
    let mut text = String::new();
    (&file)
        .take(MAX_FILE)
        .read_to_string(&mut text)
        .map_err(io(what, path, "read"))?;
    Ok(text)
}

/// A password or access token read from `path` (its one line; a final line break is not
/// part of it).
pub fn read_secret_file(what: &'static str, path: &Path, uid: u32) -> Result<String, SecretError> {
    let text = read_private(what, path, uid, true)?;
    let secret = text.strip_suffix('\n').unwrap_or(&text);
    let secret = secret.strip_suffix('\r').unwrap_or(secret);
    if secret.is_empty() || secret.contains('\n') {
        return Err(SecretError::Malformed {
            what,
            path: path.to_owned(),
            why: "it must hold the secret alone, on one line".into(),
        });
    }
    Ok(secret.to_owned())
}

/// Reads the environment variable `name` and removes it from the environment (no child
/// inherits it); `None` when unset or empty.
pub fn take_env(name: &str) -> Option<String> {
    let value = std::env::var(name).ok();
    std::env::remove_var(name);
    value
        .filter(|v| !v.trim().is_empty())
        .map(|v| v.trim().to_owned())
}

/// The bot's login on its homeserver, kept across restarts.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StoredSession {
    /// The homeserver's URL it was made on (a session is refused on another).
    pub homeserver: String,
    /// The bot's user id.
    pub user_id: String,
    /// Its device.
    pub device_id: String,
    /// Its access token.
    pub access_token: String,
}

impl std::fmt::Debug for StoredSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredSession")
            .field("homeserver", &self.homeserver)
            .field("user_id", &self.user_id)
            .field("device_id", &self.device_id)
            .finish_non_exhaustive()
    }
}

/// Where the session is kept.
#[derive(Debug, Clone)]
pub struct SessionFile {
    path: PathBuf,
    uid: u32,
}

const SESSION: &str = "session file";

impl SessionFile {
    /// The session file at `path` for the service user `uid`; `roots` are the sandbox's
    /// run and workspace roots, which it may not lie in.
    pub fn new(path: PathBuf, uid: u32, roots: [&Path; 2]) -> Result<Self, SecretError> {
        if !path.is_absolute() {
            return Err(SecretError::NotAbsolute {
                what: SESSION,
                path,
            });
        }
        if roots.iter().any(|r| path.starts_with(r)) {
            return Err(SecretError::InsideRoot {
                what: SESSION,
                path,
            });
        }
        Ok(Self { path, uid })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored session; `None` when there is no file yet.
    pub fn load(&self) -> Result<Option<StoredSession>, SecretError> {
        match std::fs::symlink_metadata(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(SESSION, &self.path, "inspect")(e)),
            Ok(_) => {}
        }
        let text = read_private(SESSION, &self.path, self.uid, false)?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| SecretError::Malformed {
                what: SESSION,
                path: self.path.clone(),
                why: format!("{e} (move it aside to log in anew)"),
            })
    }

    /// Writes `session` whole: a temporary file (0600) synced and renamed into place.
    pub fn save(&self, session: &StoredSession) -> Result<(), SecretError> {
        let path = &self.path;
        let text = serde_json::to_string_pretty(session).expect("a session serializes");
        let tmp = roundtable_sandbox_examples::write_private_temp(path, text.as_bytes())
            .map_err(io(SESSION, path, "write"))?;
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(SESSION, path, "replace")(e));
        }
        roundtable_sandbox_examples::sync_parent(path).map_err(io(
            SESSION,
            path,
            "sync its directory",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> StoredSession {
        StoredSession {
            homeserver: "http://127.0.0.1:8008/".into(),
            user_id: "@bot:localhost".into(),
            device_id: "DEVICE".into(),
            access_token: "syt_secret".into(),
        }
    }

    /// The session file is made private and refused when it is not (fails if `save` made
    /// it with the umask's mode or `load` skipped the check).
    #[test]
    fn the_session_file_is_private_kept_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let roots = [Path::new("/nonexistent/run"), Path::new("/nonexistent/ws")];
        let file = SessionFile::new(dir.path().join("session.json"), uid, roots).unwrap();
        assert_eq!(file.load().unwrap(), None);
        file.save(&session()).unwrap();
        let meta = std::fs::metadata(file.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
        assert_eq!(file.load().unwrap(), Some(session()));
        // Saved again (a new token): replaced whole, nothing else left beside it.
        let mut next = session();
        next.access_token = "syt_other".into();
        file.save(&next).unwrap();
        assert_eq!(file.load().unwrap(), Some(next));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // The token never shows in a debug print.
        assert!(!format!("{:?}", session()).contains("syt_secret"));

        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o640)).unwrap();
        assert_eq!(
            file.load().unwrap_err().to_string(),
            format!(
                "session file {} must be private (mode 0600 or 0400, owner uid {uid}); it is mode 0640, owner uid {uid}",
                file.path().display()
            )
        );
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(file.path(), "{").unwrap();
        assert!(file
            .load()
            .unwrap_err()
            .to_string()
            .contains("(move it aside to log in anew)"));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(file.path(), &link).unwrap();
        let linked = SessionFile::new(link.clone(), uid, roots).unwrap();
        assert_eq!(
            linked.load().unwrap_err().to_string(),
            format!("session file {} is not a regular file", link.display())
        );
        assert!(SessionFile::new("/nonexistent/ws/s.json".into(), uid, roots).is_err());
        assert!(SessionFile::new("s.json".into(), uid, roots).is_err());
    }

    #[test]
    fn a_secret_file_holds_one_private_line() {
        let dir = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let path = dir.path().join("password");
        std::fs::write(&path, "hunter2\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_secret_file("password file", &path, uid)
            .unwrap_err()
            .to_string()
            .contains("must be private"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            read_secret_file("password file", &path, uid).unwrap(),
            "hunter2"
        );
        std::fs::write(&path, "a\nb\n").unwrap();
        assert!(read_secret_file("password file", &path, uid).is_err());
        std::fs::write(&path, "").unwrap();
        assert!(read_secret_file("password file", &path, uid).is_err());
    }
}
