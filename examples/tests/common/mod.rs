//! What the bots' end-to-end tests share.

use std::path::{Path, PathBuf};

/// A config file that only sets the free-space floor (the flags set the rest): the shared
/// test machine's disk is often nearly full, and the default floor (5 %) would refuse turns: no floor.
///
/// Its runtime's containers carry the label `roundtable-sandbox=<instance>` of
/// [`instance_of`]`(dir)`, so a test lists its own containers, never another runtime's on
/// the same engine.
pub fn floor_config(dir: &Path) -> PathBuf {
    floor_config_with(dir, "")
}

/// [`floor_config`] with `sections` (TOML tables, e.g. `[budgets]` and `[audit]`) after it.
#[allow(dead_code)] // Not every test binary that shares this module uses it.
pub fn floor_config_with(dir: &Path, sections: &str) -> PathBuf {
    let path = dir.join("floor.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"/unused/run\"\n\
             workspace_root = \"/unused/ws\"\nmodel = \"offline\"\nmodel_url = \"http://127.0.0.1:9/v1\"\n\
             instance = \"{}\"\n[limits]\ndisk_floor_mb = 0\ndisk_floor_percent = 0\n{sections}",
            instance_of(dir)
        ),
    )
    .unwrap();
    path
}

/// The instance name [`floor_config`] gives the runtime of the test using `dir`: unique on
/// the host (the process id and the dir's own name, lowercased to the allowed alphabet).
pub fn instance_of(dir: &Path) -> String {
    let name: String = dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut instance = format!("ex-{}-{name}", std::process::id());
    instance.truncate(32);
    instance
}

/// A private scratch dir under `/tmp` (removed when dropped); panics when run as root (the
/// bots refuse root: the tests run as the service user, through scripts/test.sh).
pub fn scratch(prefix: &str) -> Scratch {
    assert_ne!(
        nix::unistd::getuid().as_raw(),
        0,
        "run through scripts/test.sh"
    );
    Scratch(
        tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/tmp")
            .unwrap(),
    )
}

/// A test's scratch dir. A test that fails kills its bot (SIGKILL), which leaves the
/// containers its runtime had made (a prepared one waits for its stdin): dropped while its
/// thread unwinds, the dir removes them, by the instance label [`instance_of`] gives its
/// runtime, as the core's test environment does. A passing test's own checks of what is
/// left stay the test of the bots' teardown.
pub struct Scratch(tempfile::TempDir);

impl Scratch {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let label = format!("label=roundtable-sandbox={}", instance_of(self.0.path()));
        let Ok(out) = std::process::Command::new("docker")
            .args(["ps", "-aq", "--filter", &label])
            .output()
        else {
            return;
        };
        let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        if ids.is_empty() {
            return;
        }
        // (A bot still shutting down may remove some first: `rm` then fails for those, so
        // what is left is listed again.)
        let _ = std::process::Command::new("docker")
            .args(["rm", "-f"])
            .args(&ids)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        let left = std::process::Command::new("docker")
            .args(["ps", "-aq", "--filter", &label])
            .output()
            .map_or(ids.len(), |o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .count()
            });
        eprintln!(
            "scratch dir dropped in a panic: {} container(s) of {label} left by the test, {left} still there",
            ids.len(),
        );
    }
}
