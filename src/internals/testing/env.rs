//! The test environment for runtimes against the real Docker engine: private roots, a
//! config for the project's guest image, the leftover check run after every turn, and
//! polling helpers.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::broker::BoxFuture;
use crate::driver::LABEL_RUNTIME;
use crate::{
    ApiKey, Config, DockerDriver, HostTool, Sandbox, Speaker, ToolCallContext, TurnRequest,
};
use bollard::models::ContainerSummary;
use bollard::query_parameters::ListContainersOptionsBuilder;
use tokio_util::sync::CancellationToken;

/// How long a kill, a stop or a teardown may take before a test calls it a hang. Tests run
/// while the machine is busy (other builds and container tests beside them: a container
/// kill or removal, or the first panic's backtrace, can take seconds), so this is generous;
/// it stays far below the 300 s and 1000 s sleeps of the guests they stop, so a pass still
/// shows that the kill, not the guest's own end, finished the turn. The cause is proven by
/// each test's exact error, not by the time.
pub const PROMPTLY: Duration = Duration::from_secs(60);

/// The guest image the test script builds.
pub fn image() -> String {
    std::env::var("ROUNDTABLE_IMAGE").unwrap_or_else(|_| "roundtable-sandbox-guest:latest".into())
}

/// The engine runtime the tests run every guest container under: `ROUNDTABLE_RUNTIME`
/// (scripts/test.sh runs the sealed, end-to-end and hostile suites once with it unset, the
/// engine's default, and once with `runsc`, gVisor); unset or empty: the engine's default.
pub fn runtime() -> Option<String> {
    std::env::var("ROUNDTABLE_RUNTIME")
        .ok()
        .filter(|r| !r.is_empty())
}

/// Whether this run's guests run under gVisor (where some things read differently from
/// inside; each test that adapts says why).
pub fn under_gvisor() -> bool {
    runtime().as_deref() == Some(crate::config::GVISOR_RUNTIME)
}

/// The runtime refuses root: the tests must run as the service user (scripts/test.sh).
pub fn require_non_root() {
    assert_ne!(
        nix::unistd::getuid().as_raw(),
        0,
        "these tests run the runtime, which refuses root: run them with scripts/test.sh \
         (it runs them as the non-root service user)"
    );
}

/// A private scratch area with the two roots (removed when dropped).
#[derive(Debug)]
pub struct Env {
    /// The scratch directory under `/tmp`.
    pub dir: tempfile::TempDir,
    /// The run root (`<dir>/run`), created by the runtime.
    pub run_root: PathBuf,
    /// The workspace root (`<dir>/ws`), created by the runtime.
    pub workspace_root: PathBuf,
}

/// A test that panics (an assertion failed) before its runtime was shut down can leave the
/// containers of its runtime instance running (a prepared container waits for its stdin to
/// close), and no later sweep matches an instance label of a removed scratch area: the
/// scratch area removes them, by the instance label its run root derives, when it is
/// dropped while its thread unwinds. A passing test's own leftover checks stay the test of
/// the runtime's teardown; this only keeps a failed run from leaking containers on the
/// machine.
impl Drop for Env {
    fn drop(&mut self) {
        if std::thread::panicking() {
            reap_instance(&self.run_root);
        }
    }
}

/// Removes (best effort, through the engine's CLI: a drop cannot await) every container
/// labelled with the default runtime instance of `run_root`; says how many on stderr.
fn reap_instance(run_root: &Path) {
    let root = run_root
        .canonicalize()
        .unwrap_or_else(|_| run_root.to_owned());
    let label = format!(
        "label={LABEL_RUNTIME}={}",
        crate::config::default_instance(&root)
    );
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
    let removed = std::process::Command::new("docker")
        .args(["rm", "-f"])
        .args(&ids)
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    eprintln!(
        "test scratch area dropped in a panic: {} container(s) of {label} left by the test {}",
        ids.len(),
        if removed { "removed" } else { "NOT removed" }
    );
}

impl Default for Env {
    fn default() -> Self {
        Self::new()
    }
}

impl Env {
    /// A new scratch area; panics when run as root (see [`require_non_root`]). Installs a
    /// test-writer log subscriber (filtered by `RUST_LOG`) once per process.
    pub fn new() -> Self {
        require_non_root();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let dir = tempfile::Builder::new()
            .prefix("rts-")
            .tempdir_in("/tmp")
            .unwrap();
        let run_root = dir.path().join("run");
        let workspace_root = dir.path().join("ws");
        Self {
            dir,
            run_root,
            workspace_root,
        }
    }

    /// A config for the project's image; the model endpoint is a closed loopback port.
    pub fn config(&self) -> Config {
        let mut c = Config::builder(&self.run_root, &self.workspace_root)
            .image(image())
            .model("http://127.0.0.1:9/v1", "test-model")
            .api_key(ApiKey::from_static("sk-test-never-in-the-container"))
            .allow_http(true)
            .turn_timeout(Duration::from_secs(30))
            .build();
        // No free-space floor: the shared test machine's disk is often nearly full, and the
        // suite must not depend on it (tests/security_quota.rs tests the floor itself).
        c.limits.disk_floor_mb = 0;
        c.limits.disk_floor_percent = 0;
        c.runtime = runtime();
        // Under gVisor the broker sees every peer as uid 0 (gVisor's gofer connects for the
        // guest), so the uid check is off there; what keeps other local users away is then
        // the per-turn 0700 run dir, attacked by
        // `runtime::another_local_user_cannot_reach_the_turn_socket`.
        if under_gvisor() {
            c.peer_uid_check = false;
        }
        c
    }

    /// A config whose container runs `sh -c script` instead of the guest.
    pub fn sh_config(&self, script: &str) -> Config {
        let mut c = self.config();
        c.command = Some(vec!["/bin/sh".into(), "-c".into(), script.into()]);
        c
    }

    /// A runtime of [`Env::sh_config`]: its containers run `sh -c script`.
    pub async fn sh_sandbox(&self, script: &str) -> Sandbox {
        Sandbox::new(self.sh_config(script)).await.unwrap()
    }

    /// The workspace directory of `channel` under the workspace root.
    pub fn workspace_of(&self, channel: &str) -> PathBuf {
        self.workspace_root
            .join(crate::turn::channel_segment(channel))
    }

    /// The runtime instance's label value, as the core derives it from the run root (a
    /// runtime of [`Env::config`] is started to read it, then dropped).
    pub async fn instance(&self) -> String {
        let sandbox = Sandbox::new(self.config()).await.unwrap();
        sandbox.config().instance.clone()
    }

    /// `turn-` dirs and sockets left under the run root.
    pub fn turn_dirs(&self) -> Vec<String> {
        run_root_entries(&self.run_root)
    }
}

/// A turn request of speaker `u1` ("ann") in `channel`, not a reset, never stopped.
pub fn request(channel: &str, text: &str) -> TurnRequest {
    TurnRequest {
        channel: channel.into(),
        speaker: Speaker {
            id: "u1".into(),
            name: "ann".into(),
        },
        text: text.into(),
        reset: false,
        stop: CancellationToken::new(),
        admitted: None,
        limits_key: None,
    }
}

/// Containers carrying this runtime's instance label.
pub async fn labelled_containers(sandbox: &Sandbox) -> Vec<String> {
    labelled_containers_of(&sandbox.config().instance).await
}

/// Containers labelled with the runtime instance `instance`.
pub async fn labelled_containers_of(instance: &str) -> Vec<String> {
    containers_labelled(&[format!("{LABEL_RUNTIME}={instance}")])
        .await
        .into_iter()
        .flat_map(|c| c.names.unwrap_or_default())
        .collect()
}

/// The containers, running or not, that carry every one of `labels` (each `key=value`),
/// as the engine lists them.
pub async fn containers_labelled(labels: &[String]) -> Vec<ContainerSummary> {
    let driver = DockerDriver::default();
    let docker = driver.engine().await.unwrap();
    let filters = std::collections::HashMap::from([("label", labels.to_vec())]);
    let opts = ListContainersOptionsBuilder::new()
        .all(true)
        .filters(&filters)
        .build();
    docker.list_containers(Some(opts)).await.unwrap()
}

/// Entries of a root (the run root's turn dirs and sockets, the workspace root's channel
/// workspaces), the runtime's lock file aside.
pub fn run_root_entries(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != crate::lock::LOCK_FILE)
                .collect()
        })
        .unwrap_or_default()
}

/// One turn of `channel` (text `x`) on a fresh runtime of `config`: its reply, once checked
/// that the turn left nothing behind.
pub async fn one_turn(config: Config, channel: &str) -> crate::Reply {
    let sandbox = Sandbox::new(config).await.unwrap();
    let outcome = sandbox.run_turn(request(channel, "x")).await;
    assert_no_leftovers(&sandbox).await;
    outcome.reply
}

/// Nothing of a turn may be left: no labelled container, no turn dir, no socket.
pub async fn assert_no_leftovers(sandbox: &Sandbox) {
    assert_no_leftovers_in(&sandbox.config().instance, &sandbox.config().run_root).await;
}

/// [`assert_no_leftovers`] for a runtime instance and run root (no runtime needed).
pub async fn assert_no_leftovers_in(instance: &str, run_root: &Path) {
    let containers = labelled_containers_of(instance).await;
    assert!(containers.is_empty(), "leaked containers: {containers:?}");
    let entries = run_root_entries(run_root);
    assert!(entries.is_empty(), "leaked run dir entries: {entries:?}");
}

/// A host tool of a given name, for the policy rules; it answers nothing. The name
/// `bad-schema` gets an invalid parameter schema.
#[derive(Debug)]
pub struct NamedTool(
    /// The tool's name.
    pub &'static str,
);

impl HostTool for NamedTool {
    fn name(&self) -> &str {
        self.0
    }
    fn description(&self) -> &str {
        ""
    }
    fn parameters(&self) -> serde_json::Value {
        if self.0 == "bad-schema" {
            serde_json::json!({"type": 12})
        } else {
            serde_json::json!({"type": "object"})
        }
    }
    fn call(
        &self,
        _: serde_json::Value,
        _: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async { Ok(String::new()) })
    }
}

/// A speaker with id `id` and name `<id> (name)`.
pub fn speaker(id: &str) -> Speaker {
    Speaker {
        id: id.into(),
        name: format!("{id} (name)"),
    }
}

/// Polls `cond` every 5 ms until it holds; panics with `what` after `within`.
pub async fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let started = Instant::now();
    while !cond() {
        assert!(started.elapsed() < within, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
