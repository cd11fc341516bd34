//! Chaos: faults injected mid-turn. The container is killed or removed behind the
//! runtime's back, an MCP server dies mid-call, the Docker daemon dies or hangs (through
//! a proxy socket: the real daemon is shared and never touched), and the host process is
//! SIGKILLed mid-turn and started again. No turn may hang, every turn must end with a
//! clear reply, and nothing may leak (after the restart's sweep, for the host kill).

use roundtable_sandbox::internals::testing::DockerDriverExt;
use roundtable_sandbox_test_support::{hostile, mcp_stub};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roundtable_sandbox::driver::{DockerOptions, LABEL_RUNTIME};
use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::{ApiKey, Config, DockerDriver, Sandbox, TurnPhase};
use roundtable_sandbox_test_support::docker_proxy::{DockerProxy, Mode};

const SLEEPER: &str = "cat >/dev/null; sleep 300";

/// Runs a turn; once its container exists (and `settle` has passed), `fault` is injected.
async fn turn_with_fault<F, Fut>(
    sandbox: &Sandbox,
    channel: &str,
    settle: Duration,
    fault: F,
) -> (roundtable_sandbox::Reply, Duration)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let sb = sandbox.clone();
    let injector = tokio::spawn(async move {
        // Its container exists (the runtime's one labelled container).
        the_container(&sb).await;
        tokio::time::sleep(settle).await;
        fault().await;
    });
    let started = Instant::now();
    let reply = sandbox.run_turn(request(channel, "x")).await.reply;
    let elapsed = started.elapsed();
    injector.await.unwrap();
    (reply, elapsed)
}

/// What is done to a turn's container from outside, behind the runtime's back.
#[derive(Debug, Clone, Copy)]
enum Hit {
    /// `docker kill` (SIGKILL).
    Kill,
    /// `docker rm -f`.
    Remove,
}

/// A turn of `channel` whose container is hit from outside, through the engine's own
/// client, half a second after it runs.
async fn turn_hit_from_outside(
    sandbox: &Sandbox,
    channel: &str,
    hit: Hit,
) -> (roundtable_sandbox::Reply, Duration) {
    let sb = sandbox.clone();
    let fault = move || async move {
        let name = the_container(&sb).await;
        let driver = DockerDriver::default();
        let docker = driver.client().await.unwrap();
        match hit {
            Hit::Kill => {
                let opts = bollard::query_parameters::KillContainerOptionsBuilder::new()
                    .signal("SIGKILL")
                    .build();
                docker.kill_container(&name, Some(opts)).await.unwrap();
            }
            Hit::Remove => {
                let opts = bollard::query_parameters::RemoveContainerOptionsBuilder::new()
                    .force(true)
                    .build();
                docker.remove_container(&name, Some(opts)).await.unwrap();
            }
        }
    };
    turn_with_fault(sandbox, channel, Duration::from_millis(500), fault).await
}

/// A turn of `channel` during which `proxy`, the runtime's way to the daemon, is set to
/// `mode` once the turn's container runs.
async fn turn_as_the_daemon_goes(
    sandbox: &Sandbox,
    proxy: &Arc<DockerProxy>,
    channel: &str,
    mode: Mode,
) -> (roundtable_sandbox::Reply, Duration) {
    let (p, sb) = (proxy.clone(), sandbox.clone());
    let fault = move || async move {
        // The phase comes before the create and start calls, which a busy daemon answers
        // late: the fault waits until the guest has read its turn to the end (the runtime's
        // start and stdin are done), so it lands on the running turn, not on its start.
        the_guest_sleeping(&sb).await;
        p.set(mode)
    };
    turn_with_fault(sandbox, channel, Duration::from_millis(300), fault).await
}

/// Waits until the one container of this runtime runs `sleep` (SLEEPER's `cat` has ended).
async fn the_guest_sleeping(sandbox: &Sandbox) {
    let name = the_container(sandbox).await;
    let driver = DockerDriver::default();
    let docker = driver.client().await.unwrap();
    let deadline = Instant::now() + PROMPTLY;
    while Instant::now() < deadline {
        let top = docker.top_processes(&name, None).await;
        let sleeping = top.ok().and_then(|t| t.processes).is_some_and(|ps| {
            ps.iter()
                .any(|p| p.iter().any(|field| field.contains("sleep 300")))
        });
        if sleeping {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the guest never slept");
}

/// The one labelled container of this runtime (waits for it to exist).
async fn the_container(sandbox: &Sandbox) -> String {
    // The phase is reported before the create call, which a busy daemon answers late.
    let deadline = Instant::now() + PROMPTLY;
    while Instant::now() < deadline {
        if let Some(name) = labelled_containers(sandbox).await.into_iter().next() {
            return name.trim_start_matches('/').to_owned();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no container appeared");
}

#[tokio::test(flavor = "multi_thread")]
async fn container_killed_from_outside_mid_turn() {
    let env = Env::new();
    let sandbox = Sandbox::new(env.sh_config(SLEEPER)).await.unwrap();
    let (reply, elapsed) = turn_hit_from_outside(&sandbox, "#kill", Hit::Kill).await;
    assert_eq!(reply.error.as_deref(), Some("guest exited with code 137"));
    assert!(elapsed < PROMPTLY, "{elapsed:?}");
    assert_no_leftovers(&sandbox).await;
    // The channel goes on.
    drop(sandbox);
    let sandbox =
        Sandbox::new(env.sh_config("cat >/dev/null; echo '{\"ok\":true,\"text\":\"on\"}'"))
            .await
            .unwrap();
    assert_eq!(
        sandbox
            .run_turn(request("#kill", "x"))
            .await
            .reply
            .text
            .as_deref(),
        Some("on")
    );
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn container_removed_from_outside_mid_turn() {
    let env = Env::new();
    let sandbox = Sandbox::new(env.sh_config(SLEEPER)).await.unwrap();
    let (reply, elapsed) = turn_hit_from_outside(&sandbox, "#rm", Hit::Remove).await;
    assert!(!reply.ok);
    let error = reply.error.unwrap();
    eprintln!("removed mid-turn: {error}");
    assert!(
        error.starts_with("guest exited with code") || error.starts_with("docker "),
        "{error}"
    );
    assert!(elapsed < PROMPTLY, "{elapsed:?}");
    assert_no_leftovers(&sandbox).await;
}

/// A config whose driver talks to the daemon through `proxy`, with short API deadlines.
fn proxied(env: &Env, proxy: &DockerProxy, script: &str) -> (Config, DockerDriver) {
    let driver = DockerDriver::new(DockerOptions {
        host: proxy.host(),
        call_timeout: Duration::from_secs(2),
    });
    let mut config = env.sh_config(script);
    config.driver = Some(Arc::new(driver.clone()));
    (config, driver)
}

/// The daemon is back: the next turn of `channel` (a new runtime on the same driver, which
/// remembers what it could not remove) removes the leftover first, and answers.
async fn the_daemon_comes_back(
    env: &Env,
    proxy: &DockerProxy,
    driver: &DockerDriver,
    sandbox: Sandbox,
    channel: &str,
) {
    proxy.set(Mode::Forward);
    let mut config = env.sh_config("cat >/dev/null; echo '{\"ok\":true,\"text\":\"back\"}'");
    config.driver = Some(Arc::new(driver.clone()));
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request(channel, "x")).await.reply;
    assert_eq!(reply.text.as_deref(), Some("back"), "{reply:?}");
    assert!(driver.pending_removals().is_empty());
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_daemon_dies_mid_turn_and_comes_back() {
    let env = Env::new();
    let proxy = Arc::new(DockerProxy::start(env.dir.path()));
    let (config, driver) = proxied(&env, &proxy, SLEEPER);
    let sandbox = Sandbox::new(config).await.unwrap();
    let (reply, elapsed) = turn_as_the_daemon_goes(&sandbox, &proxy, "#dies", Mode::Closed).await;
    let error = reply.error.unwrap();
    eprintln!("daemon died mid-turn: {error} after {elapsed:?}");
    assert!(error.starts_with("docker daemon unreachable"), "{error}");
    assert!(elapsed < PROMPTLY, "{elapsed:?}");
    // The runtime's own parts are gone; the container could not be removed while the
    // daemon was away, and is remembered.
    assert!(run_root_entries(&sandbox.config().run_root).is_empty());
    assert_eq!(labelled_containers(&sandbox).await.len(), 1);
    assert_eq!(driver.pending_removals().len(), 1);

    // The daemon comes back: the next turn removes the leftover first.
    the_daemon_comes_back(&env, &proxy, &driver, sandbox, "#dies").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_daemon_hangs_mid_turn_and_comes_back() {
    let env = Env::new();
    let proxy = Arc::new(DockerProxy::start(env.dir.path()));
    let (mut config, driver) = proxied(&env, &proxy, SLEEPER);
    config.turn_timeout = Some(Duration::from_secs(3));
    let sandbox = Sandbox::new(config).await.unwrap();
    let (reply, elapsed) = turn_as_the_daemon_goes(&sandbox, &proxy, "#hangs", Mode::Silent).await;
    eprintln!("daemon hung mid-turn: {:?} after {elapsed:?}", reply.error);
    assert_eq!(reply.error.as_deref(), Some("turn timed out after 3s"));
    // The deadline, then one API deadline for the kill and one for the removal (and a
    // busy machine's slack: a hang would never end).
    assert!(
        elapsed < Duration::from_secs(3 + 2 + 2) + PROMPTLY,
        "{elapsed:?}"
    );
    assert!(run_root_entries(&sandbox.config().run_root).is_empty());
    assert_eq!(driver.pending_removals().len(), 1);

    the_daemon_comes_back(&env, &proxy, &driver, sandbox, "#hangs").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_server_killed_mid_call() {
    let env = Env::new();
    let stub_dir = tempfile::tempdir().unwrap();
    let mut config = hostile::config(&env, &["post", "/v1/mcp/stub/sleep", r#"{"seconds":60}"#]);
    config.mcp = vec![mcp_stub::stub_server(stub_dir.path(), &["sleep", "echo"])];
    let sandbox = Sandbox::new(config).await.unwrap();
    let dir = stub_dir.path().to_owned();
    let killer = tokio::spawn(async move {
        // Once the call reached the server, kill the server.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
            if log.contains("tools/call") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the call never reached the server"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pid: i32 = std::fs::read_to_string(dir.join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    });
    let started = Instant::now();
    let reply = sandbox.run_turn(request("#mcp", "x")).await.reply;
    killer.await.unwrap();
    let f = hostile::findings(&reply);
    eprintln!(
        "MCP server killed mid-call: {f:?} after {:?}",
        started.elapsed()
    );
    assert_eq!(f["status"], "502", "{f:?}");
    assert!(f["body"].contains("stub"), "{f:?}");
    assert!(started.elapsed() < PROMPTLY);
    assert_no_leftovers(&sandbox).await;

    // The server is started again on its next use.
    let mut config = hostile::config(&env, &["post", "/v1/mcp/stub/echo", r#"{"text":"again"}"#]);
    config.mcp = vec![mcp_stub::stub_server(stub_dir.path(), &["sleep", "echo"])];
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    let f = hostile::findings(&sandbox.run_turn(request("#mcp", "x")).await.reply);
    assert_eq!(f["status"], "200", "{f:?}");
    assert!(f["body"].contains("again"));
    sandbox.shutdown().await;
    assert_no_leftovers(&sandbox).await;
}

const CHILD_ENV: &str = "ROUNDTABLE_CHAOS_CHILD_DIR";

fn child_config(dir: &Path) -> Config {
    let mut c = Config::builder(dir.join("run"), dir.join("ws"))
        .image(image())
        .model("http://127.0.0.1:9/v1", "test-model")
        .api_key(ApiKey::from_static("sk-test-never-in-the-container"))
        .allow_http(true)
        .turn_timeout(Duration::from_secs(120))
        .command(vec!["/bin/sh".into(), "-c".into(), SLEEPER.into()])
        .build();
    // As in Env::config: no floor (the shared test machine's disk is often nearly full).
    c.limits.disk_floor_mb = 0;
    c.limits.disk_floor_percent = 0;
    c
}

/// Not a test on its own: the "host process" that `host_process_killed_mid_turn` starts
/// and SIGKILLs. Without its environment variable it does nothing.
#[tokio::test(flavor = "multi_thread")]
async fn host_process_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return;
    };
    let marker = dir.join("running");
    let mut config = child_config(&dir);
    config.observer = Some(Arc::new(move |e: &roundtable_sandbox::Event| {
        if matches!(
            e.kind,
            roundtable_sandbox::EventKind::Phase(TurnPhase::ContainerRunning)
        ) {
            std::fs::write(&marker, b"").unwrap();
        }
    }));
    let sandbox = Sandbox::new(config).await.unwrap();
    sandbox.run_turn(request("#crash", "x")).await;
    panic!("the turn should have been killed with its host process");
}

#[tokio::test(flavor = "multi_thread")]
async fn host_process_killed_mid_turn_then_restarted() {
    let env = Env::new();
    let dir = env.dir.path().to_owned();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "host_process_child", "--nocapture"])
        .env(CHILD_ENV, &dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !dir.join("running").exists() {
        assert!(
            Instant::now() < deadline,
            "the child never started its turn"
        );
        assert!(child.try_wait().unwrap().is_none(), "the child ended early");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Wait until the container really runs.
    let instance = child_config(&dir).resolve().unwrap().instance;
    let deadline = Instant::now() + Duration::from_secs(30);
    while labelled_containers_of(&instance).await.is_empty() {
        assert!(Instant::now() < deadline, "no container appeared");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // An overlapping restart (a second process on the same roots while the first lives)
    // is refused: its sweep would kill the live turn.
    let err = Sandbox::new(child_config(&dir))
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "sandbox root {} is in use by another runtime (pid {}): one runtime per root",
            std::fs::canonicalize(dir.join("run")).unwrap().display(),
            child.id()
        )
    );
    // Kill the host process (SIGKILL: no teardown, no drop guard); the kernel drops its
    // lock with it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    child.kill().unwrap();
    child.wait().unwrap();
    let restarted = Sandbox::new(child_config(&dir)).await.unwrap();

    // What the dead host left: its container (still running) and its run dir.
    let left = labelled_containers(&restarted).await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(run_root_entries(&restarted.config().run_root).len(), 1);
    let ws = dir
        .join("ws")
        .join(roundtable_sandbox::internals::turn::channel_segment(
            "#crash",
        ));
    assert!(ws.is_dir());

    // The restarted host sweeps at startup: the leftovers go, the workspace stays.
    let report = restarted.sweep().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.containers.len(), 1);
    assert_eq!(report.run_dirs.len(), 1);
    assert!(ws.is_dir(), "the channel's data is kept");
    assert_no_leftovers(&restarted).await;
    let _ = LABEL_RUNTIME;
}

/// A crash between the creation of the container an image's file is read from (the MCP
/// sessions' wrapper) and its removal leaves it created, never started, and labelled with
/// its time: a sweep removes one that is old enough, whatever its instance, and leaves a
/// read that may still be in progress.
#[tokio::test(flavor = "multi_thread")]
async fn a_sweep_removes_an_image_read_container_a_crash_left() {
    use roundtable_sandbox::driver::{LABEL_READ, READ_ORPHANED_AFTER};
    let env = Env::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let create = |made: u64| {
        let name = format!("rts-read-{:016x}", uuid::Uuid::new_v4().as_u128() as u64);
        let out = std::process::Command::new("docker")
            .args(["create", "--name", &name, "--network", "none", "--label"])
            .arg(format!("{LABEL_READ}={made}"))
            .args(["--entrypoint", "/nonexistent", &image()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        name
    };
    let exists = |name: &str| {
        std::process::Command::new("docker")
            .args(["inspect", name])
            .output()
            .unwrap()
            .status
            .success()
    };
    let orphan = create(now - READ_ORPHANED_AFTER.as_secs() - 60);
    let in_progress = create(now);
    let sandbox = Sandbox::new(env.config()).await.unwrap();
    let report = sandbox.sweep().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let (orphan_left, in_progress_left) = (exists(&orphan), exists(&in_progress));
    let _ = std::process::Command::new("docker")
        .args(["rm", "-f", &orphan, &in_progress])
        .output();
    assert!(!orphan_left, "the crash's leftover {orphan} was kept");
    assert!(
        in_progress_left,
        "a read in progress ({in_progress}) was removed"
    );
}
