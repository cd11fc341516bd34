//! Setup the CLI's test binaries share.

use std::path::{Path, PathBuf};

/// A fresh directory under `/tmp` (named `prefix…`) holding the config file `name`, its
/// text made from the directory's path.
pub fn config_in(
    prefix: &str,
    name: &str,
    text: impl FnOnce(&Path) -> String,
) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text(dir.path())).unwrap();
    (dir, path)
}
