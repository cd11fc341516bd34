//! Setup the CLI's test binaries share.
// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

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

/// The CLI's binary, without the caller's `DOCKER_HOST`.
pub fn command() -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"));
    cmd.env_remove("DOCKER_HOST");
    cmd
}

/// What `cmd` exited with and printed: its code (-1 for a signal), stdout, stderr.
pub fn outcome(cmd: &mut std::process::Command) -> (i32, String, String) {
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
