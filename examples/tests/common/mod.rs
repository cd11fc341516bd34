//! What the bots' end-to-end tests share.

use std::path::{Path, PathBuf};

/// A config file that only sets the free-space floor (the flags set the rest): the shared
/// test machine's disk is often nearly full, and the default floor (5 %) would refuse turns: no floor.
pub fn floor_config(dir: &Path) -> PathBuf {
    let path = dir.join("floor.toml");
    std::fs::write(
        &path,
        "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"/unused/run\"\n\
         workspace_root = \"/unused/ws\"\nmodel = \"offline\"\nmodel_url = \"http://127.0.0.1:9/v1\"\n\
         [limits]\ndisk_floor_mb = 0\ndisk_floor_percent = 0\n",
    )
    .unwrap();
    path
}

/// A private scratch dir under `/tmp` (removed when dropped); panics when run as root (the
/// bots refuse root: the tests run as the service user, through scripts/test.sh).
pub fn scratch(prefix: &str) -> tempfile::TempDir {
    assert_ne!(
        nix::unistd::getuid().as_raw(),
        0,
        "run through scripts/test.sh"
    );
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap()
}
