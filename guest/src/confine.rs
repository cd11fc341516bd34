//! Workspace confinement: every path a tool touches resolves inside the workspace root.
//!
//! Paths come from the model, which repeats whatever the guests wrote, so they are hostile.
//! A path is normalised lexically (`..` may not climb above the root; an absolute path is
//! accepted only when it names the root or something under it), then the existing part is
//! canonicalised and must still lie under the canonical root, so a symlink that leads out
//! is refused. Files are opened non-blocking (a FIFO cannot hang the guest), without
//! following a final symlink, and must be regular files.
//!
//! This is defence in depth: the container is the real boundary, and the `sh` tool can
//! reach everything the guest's uid can. What these checks buy is that the file tools
//! never act outside the workspace, whatever the model was talked into.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

/// `O_NONBLOCK | O_NOFOLLOW`: a FIFO cannot block the open, a final symlink is not followed.
fn open_flags() -> i32 {
    (nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_NOFOLLOW).bits()
}

/// Why a path was refused or could not be used.
#[derive(Debug)]
pub enum PathError {
    /// The path leaves the workspace (`..`, an absolute path elsewhere, a symlink out).
    Outside(String),
    /// The path is malformed (empty where a file is needed, a NUL byte).
    Invalid(String),
    /// The path does not exist.
    NotFound(String),
    /// The path exists but is not what the operation needs.
    WrongKind(String, &'static str),
    /// Another I/O error.
    Io(String, io::Error),
}

impl std::fmt::Display for PathError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathError::Outside(p) => write!(f, "path '{p}' is outside the workspace"),
            PathError::Invalid(why) => write!(f, "invalid path: {why}"),
            PathError::NotFound(p) => write!(f, "'{p}' does not exist"),
            PathError::WrongKind(p, what) => write!(f, "'{p}' is not {what}"),
            PathError::Io(p, e) => write!(f, "'{p}': {e}"),
        }
    }
}

impl std::error::Error for PathError {}

/// The workspace root, both as configured (`/workspace`) and canonical.
#[derive(Debug, Clone)]
pub struct Root {
    configured: PathBuf,
    canonical: PathBuf,
}

impl Root {
    /// Opens the workspace root; it must exist and be a directory.
    pub fn new(configured: impl Into<PathBuf>) -> io::Result<Self> {
        let configured = configured.into();
        let canonical = configured.canonicalize()?;
        if !canonical.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the workspace is not a directory",
            ));
        }
        Ok(Self {
            configured,
            canonical,
        })
    }

    /// The canonical root directory.
    pub fn path(&self) -> &Path {
        &self.canonical
    }

    /// The workspace-relative form of a canonical path under the root, for messages.
    pub fn display(&self, path: &Path) -> String {
        match path.strip_prefix(&self.canonical) {
            Ok(rel) if rel.as_os_str().is_empty() => ".".to_string(),
            Ok(rel) => rel.display().to_string(),
            Err(_) => path.display().to_string(),
        }
    }

    /// Normalises `raw` lexically into a path relative to the root (empty: the root).
    fn relative(&self, raw: &str) -> Result<PathBuf, PathError> {
        if raw.contains('\0') {
            return Err(PathError::Invalid("the path contains a nul byte".into()));
        }
        let path = Path::new(raw);
        let rest = if path.is_absolute() {
            path.strip_prefix(&self.configured)
                .or_else(|_| path.strip_prefix(&self.canonical))
                .map_err(|_| PathError::Outside(raw.to_string()))?
        } else {
            path
        };
        let mut out = PathBuf::new();
        for component in rest.components() {
            match component {
                Component::Normal(part) => out.push(part),
                Component::CurDir => {}
                Component::ParentDir => {
                    if !out.pop() {
                        return Err(PathError::Outside(raw.to_string()));
                    }
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(PathError::Outside(raw.to_string()));
                }
            }
        }
        Ok(out)
    }

    /// Checks that a canonical path lies under the canonical root.
    fn inside(&self, canonical: PathBuf, raw: &str) -> Result<PathBuf, PathError> {
        if canonical.starts_with(&self.canonical) {
            Ok(canonical)
        } else {
            Err(PathError::Outside(raw.to_string()))
        }
    }

    /// Resolves a path that must exist; symlinks are followed and must stay inside.
    pub fn existing(&self, raw: &str) -> Result<PathBuf, PathError> {
        let rel = self.relative(raw)?;
        let joined = self.canonical.join(&rel);
        let canonical = joined.canonicalize().map_err(|e| match e.kind() {
            io::ErrorKind::NotFound if self.dangling_link(&rel) => {
                PathError::Outside(raw.to_string())
            }
            io::ErrorKind::NotFound => PathError::NotFound(raw.to_string()),
            _ => PathError::Io(raw.to_string(), e),
        })?;
        self.inside(canonical, raw)
    }

    /// Whether some component of `rel` is a symlink that resolves nowhere (for instance
    /// to `/etc/passwd` in an image that has no such file): such a path is refused as
    /// leading out rather than reported missing.
    fn dangling_link(&self, rel: &Path) -> bool {
        let mut current = self.canonical.clone();
        for part in rel.components() {
            current.push(part);
            match current.symlink_metadata() {
                Ok(meta) if meta.file_type().is_symlink() => {
                    return current.canonicalize().is_err();
                }
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// Resolves a file path to create or overwrite: the parent must resolve inside the
    /// workspace (it is created, inside, when `create_parents`), and an existing final
    /// component is resolved like [`Root::existing`].
    pub fn for_writing(&self, raw: &str, create_parents: bool) -> Result<PathBuf, PathError> {
        let rel = self.relative(raw)?;
        let Some(name) = rel.file_name().map(|n| n.to_os_string()) else {
            return Err(PathError::Invalid("a file path is needed".into()));
        };
        let joined = self.canonical.join(&rel);
        if joined.symlink_metadata().is_ok() {
            // Exists (possibly as a symlink, possibly dangling): where does it lead?
            return match joined.canonicalize() {
                Ok(canonical) => self.inside(canonical, raw),
                Err(_) => Err(PathError::Outside(raw.to_string())),
            };
        }
        let parent_rel = rel.parent().unwrap_or(Path::new(""));
        let parent = self.directory(parent_rel, raw, create_parents)?;
        Ok(parent.join(name))
    }

    /// Resolves (and, when asked, creates inside the workspace) the directory `rel`.
    fn directory(&self, rel: &Path, raw: &str, create: bool) -> Result<PathBuf, PathError> {
        let mut current = self.canonical.clone();
        for part in rel.components() {
            let next = current.join(part);
            match next.symlink_metadata() {
                Ok(_) => {
                    let canonical = next
                        .canonicalize()
                        .map_err(|_| PathError::Outside(raw.to_string()))?;
                    current = self.inside(canonical, raw)?;
                    if !current.is_dir() {
                        return Err(PathError::WrongKind(self.display(&current), "a directory"));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound && create => {
                    std::fs::create_dir(&next).map_err(|e| PathError::Io(raw.to_string(), e))?;
                    current = next;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(PathError::NotFound(self.display(&next)));
                }
                Err(e) => return Err(PathError::Io(raw.to_string(), e)),
            }
        }
        Ok(current)
    }
}

/// Opens an existing regular file for reading without blocking on FIFOs or devices and
/// without following a final symlink.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(open_flags())
        .open(path)?;
    only_regular(file)
}

/// Opens (creating if needed, mode 0600) a regular file for writing and truncates it;
/// refuses anything but a regular file.
pub fn create_regular(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(open_flags())
        .open(path)?;
    let file = only_regular(file)?;
    file.set_len(0)?;
    Ok(file)
}

/// `file` if it is a regular file; an error for anything else (a FIFO, a device, a dir).
fn only_regular(file: File) -> io::Result<File> {
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;

    /// `path` was refused as leading out of the root.
    #[track_caller]
    fn assert_outside(path: Result<PathBuf, PathError>) {
        assert!(matches!(path, Err(PathError::Outside(_))), "{path:?}");
    }

    #[test]
    fn lexical_escapes_are_refused() {
        let dir = TempDir::new();
        let root = Root::new(dir.path()).unwrap();
        assert_outside(root.existing("../../etc/passwd"));
        assert_outside(root.existing("/etc/passwd"));
        assert_outside(root.for_writing("a/../../x", true));
        assert!(matches!(root.existing("a\0b"), Err(PathError::Invalid(_))));
        std::fs::write(dir.path().join("x"), "1").unwrap();
        let abs = dir.path().join("x");
        assert_eq!(root.existing(abs.to_str().unwrap()).unwrap(), abs);
        assert_eq!(root.existing("a/../x").unwrap(), abs);
        assert_eq!(root.existing("").unwrap(), dir.path());
    }

    #[test]
    fn symlinks_out_are_refused_and_symlinks_in_are_followed() {
        let dir = TempDir::new();
        let root = Root::new(dir.path()).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("pw")).unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join("etc")).unwrap();
        std::os::unix::fs::symlink("/nonexistent/x", dir.path().join("dangling")).unwrap();
        assert_outside(root.existing("pw"));
        // A link to a file the image lacks is refused as leading out, not "missing".
        assert_outside(root.existing("dangling"));
        assert!(matches!(
            root.existing("missing.txt"),
            Err(PathError::NotFound(_))
        ));
        assert_outside(root.existing("etc/passwd"));
        assert_outside(root.for_writing("pw", true));
        assert_outside(root.for_writing("etc/new", true));
        assert_outside(root.for_writing("dangling", true));
        std::fs::write(dir.path().join("real"), "1").unwrap();
        std::os::unix::fs::symlink("real", dir.path().join("alias")).unwrap();
        assert_eq!(root.existing("alias").unwrap(), dir.path().join("real"));
        let made = root.for_writing("d/e/f.txt", true).unwrap();
        assert_eq!(made, dir.path().join("d/e/f.txt"));
        assert!(dir.path().join("d/e").is_dir());
        assert!(matches!(
            root.for_writing("q/f.txt", false),
            Err(PathError::NotFound(_))
        ));
    }

    #[test]
    fn fifos_do_not_block_and_are_refused() {
        let dir = TempDir::new();
        let fifo = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !status.is_ok_and(|s| s.success()) {
            return; // no mkfifo on this machine
        }
        assert!(open_regular(&fifo).is_err());
        assert!(create_regular(&fifo).is_err());
    }
}
