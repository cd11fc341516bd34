//! The engine runtime a turn runs under (`runtime`: the engine's default, or `runsc` for
//! gVisor), against the real engine. scripts/test.sh runs this file, like the sealed,
//! end-to-end and hostile suites, once per runtime (`ROUNDTABLE_RUNTIME`).

use roundtable_sandbox::internals::testing::DockerDriverExt;
use roundtable_sandbox_test_support::hostile;
use std::time::Duration;

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::Sandbox;

/// What the guest's kernel says about itself, from inside a real turn.
#[tokio::test(flavor = "multi_thread")]
async fn guests_run_under_the_configured_runtime() {
    let env = Env::new();
    let script = r#"cat >/dev/null
        v=$(cat /proc/version)
        test -e /proc/sentry-meminfo && s=present || s=absent
        printf '{"ok":true,"text":"version=%s;sentry=%s"}' "$v" "$s""#;
    let sandbox = env.sh_sandbox(script).await;
    let reply = sandbox.run_turn(request("#kernel", "x")).await.reply;
    let f = hostile::findings(&reply);
    let host_version = std::fs::read_to_string("/proc/version").unwrap();
    if under_gvisor() {
        // gVisor's Sentry answers the guest's syscalls: its own /proc (with the Sentry's
        // memory file) and its own kernel version, never the host's. (Its kernel log,
        // "Starting gVisor...", is closed here: the engine's seccomp profile, applied
        // inside the sandbox by --oci-seccomp, refuses syslog(2) as under runc.)
        assert_eq!(f["sentry"], "present", "{f:?}");
        assert_ne!(f["version"], host_version.trim(), "{f:?}");
    } else {
        // runc: the guest shares the host's kernel.
        assert_eq!(f["sentry"], "absent", "{f:?}");
        assert_eq!(f["version"], host_version.trim(), "{f:?}");
    }
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runtime_the_engine_does_not_know_gives_a_clear_error() {
    let env = Env::new();
    let mut config = env.sh_config("cat >/dev/null; echo '{\"ok\":true,\"text\":\"x\"}'");
    config.runtime = Some("roundtable-no-such-runtime".into());
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#runtime", "x")).await.reply;
    assert_eq!(
        reply.error.as_deref(),
        Some(
            "container runtime roundtable-no-such-runtime is not known to the engine \
             (register it: scripts/setup.sh --gvisor, as root, for runsc)"
        )
    );
    assert_no_leftovers(&sandbox).await;
}

/// Runs `/roundtable-hostile net <targets>` in a plain container of the engine's default
/// runtime as `user`, with `binds` (`host:container:ro`), and returns its findings. It
/// stands for another local user of the host: a host process, not a guest.
async fn connect_as(user: &str, binds: Vec<String>, targets: &[String]) -> String {
    use bollard::models::{ContainerCreateBody, HostConfig};
    use bollard::query_parameters::{
        CreateContainerOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
        WaitContainerOptions,
    };
    use futures_util::StreamExt;
    let driver = roundtable_sandbox::DockerDriver::default();
    let docker = driver.client().await.unwrap();
    let name = format!(
        "roundtable-intruder-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    );
    let body = ContainerCreateBody {
        image: Some(hostile::image()),
        user: Some(user.into()),
        entrypoint: Some(
            ["/roundtable-hostile", "net"]
                .into_iter()
                .map(String::from)
                .chain(targets.iter().cloned())
                .collect(),
        ),
        network_disabled: Some(true),
        host_config: Some(HostConfig {
            binds: Some(binds),
            network_mode: Some("none".into()),
            cap_drop: Some(vec!["ALL".into()]),
            security_opt: Some(vec!["no-new-privileges:true".into()]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let opts = CreateContainerOptionsBuilder::new().name(&name).build();
    docker.create_container(Some(opts), body).await.unwrap();
    docker.start_container(&name, None).await.unwrap();
    let _ = docker
        .wait_container(&name, None::<WaitContainerOptions>)
        .collect::<Vec<_>>()
        .await;
    let logs = LogsOptionsBuilder::new().stdout(true).stderr(true).build();
    let out: Vec<_> = docker.logs(&name, Some(logs)).collect().await;
    let rm = RemoveContainerOptionsBuilder::new().force(true).build();
    docker.remove_container(&name, Some(rm)).await.unwrap();
    out.into_iter().flatten().map(|o| o.to_string()).collect()
}

/// Under gVisor the broker cannot check the peer's uid (gVisor's gofer connects for the
/// guest, so SO_PEERCRED says 0). What keeps another local user away from a turn's socket
/// then is the per-turn run dir, 0700 and owned by the service user, under a 0700 run
/// root. This attacks it while a turn is live: another uid reaches neither the socket
/// through the run root nor through the turn dir itself; the service uid (the control)
/// connects. The same holds under runc, where the uid check is a second layer.
#[tokio::test(flavor = "multi_thread")]
async fn another_local_user_cannot_reach_the_turn_socket() {
    let env = Env::new();
    let sandbox = env.sh_sandbox("cat >/dev/null; sleep 120").await;
    let req = request("#intruder", "x");
    let stop = req.stop.clone();
    let sb = sandbox.clone();
    let turn = tokio::spawn(async move { sb.run_turn(req).await.reply });
    let run_root = sandbox.config().run_root.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let turn_dir = loop {
        let live = run_root_entries(&run_root)
            .into_iter()
            .find(|e| run_root.join(e).join("broker.sock").exists());
        if let Some(dir) = live {
            break run_root.join(dir);
        }
        assert!(std::time::Instant::now() < deadline, "no live turn socket");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let dir_name = turn_dir.file_name().unwrap().to_string_lossy().into_owned();
    let binds = vec![
        format!("{}:/rr:ro", run_root.display()),
        format!("{}:/t:ro", turn_dir.display()),
    ];
    let targets = vec![
        format!("unix:/rr/{dir_name}/broker.sock"),
        "unix:/t/broker.sock".to_owned(),
    ];
    let me = format!(
        "{}:{}",
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw()
    );
    // Another local user (uid and gid that are not the service user's).
    let other = connect_as("4242:4242", binds.clone(), &targets).await;
    // Control: the same probe as the service user connects (so the probe works).
    let control = connect_as(&me, binds, &targets[1..]).await;
    stop.cancel();
    let reply = turn.await.unwrap();
    assert_eq!(reply.error.as_deref(), Some("turn stopped"));
    assert!(
        control.contains("unix:/t/broker.sock=connected"),
        "the service uid reaches its own socket: {control}"
    );
    for t in &targets {
        assert!(
            other.contains(&format!("{t}=error(13)")),
            "another uid must get EACCES on {t}: {other}"
        );
    }
    assert_no_leftovers(&sandbox).await;
}

/// Starts a turn whose guest runs `script`, waits until its container runs, and returns
/// the turn's task, its stop token and the container's inspection.
async fn live_turn(
    sandbox: &Sandbox,
    channel: &str,
) -> (
    tokio::task::JoinHandle<roundtable_sandbox::Reply>,
    tokio_util::sync::CancellationToken,
    bollard::models::ContainerInspectResponse,
) {
    let req = request(channel, "x");
    let stop = req.stop.clone();
    let sb = sandbox.clone();
    let turn = tokio::spawn(async move { sb.run_turn(req).await.reply });
    let driver = roundtable_sandbox::DockerDriver::default();
    let docker = driver.client().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if turn.is_finished() {
            panic!("the turn ended early: {:?}", turn.await.unwrap());
        }
        if let Some(name) = labelled_containers(sandbox).await.first() {
            // Listed while being created: inspect again until it runs.
            if let Ok(c) = docker
                .inspect_container(name.trim_start_matches('/'), None)
                .await
            {
                if c.state.as_ref().and_then(|s| s.running) == Some(true) {
                    return (turn, stop, c);
                }
            }
        }
        assert!(std::time::Instant::now() < deadline, "the turn never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn status_field(pid: i64, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(","))
        .unwrap_or_else(|| "?".into())
}

/// What the engine runs on the host for a turn must be confined there: under runc the
/// container's init (the service uid), under gVisor the Sentry (gVisor's user-space
/// kernel, which serves the guest's syscalls). Both with no_new_privs and a seccomp filter.
/// Under gVisor this is where no-new-privileges and seccomp are checked, since the guest's
/// own /proc shows neither (sealed_turn, security_guest).
#[tokio::test(flavor = "multi_thread")]
async fn the_turn_process_on_the_host_is_confined() {
    let env = Env::new();
    let sandbox = env.sh_sandbox("cat >/dev/null; sleep 120").await;
    let (turn, stop, c) = live_turn(&sandbox, "#host-side").await;
    let pid = c.state.unwrap().pid.unwrap();
    let (nnp, seccomp, uid) = (
        status_field(pid, "NoNewPrivs:"),
        status_field(pid, "Seccomp:"),
        status_field(pid, "Uid:"),
    );
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    stop.cancel();
    assert_eq!(turn.await.unwrap().error.as_deref(), Some("turn stopped"));
    assert_eq!(nnp, "1", "no_new_privs on the host process");
    assert_eq!(seccomp, "2", "a seccomp filter on the host process");
    if under_gvisor() {
        assert!(cmdline.starts_with(b"runsc-sandbox"), "the Sentry");
        // gVisor runs its Sentry as nobody, neither root nor the service user.
        assert_eq!(uid, "65534,65534,65534,65534");
    } else {
        let me = nix::unistd::getuid().as_raw();
        assert_eq!(uid, format!("{me},{me},{me},{me}"));
    }
    assert_no_leftovers(&sandbox).await;
}

/// The pids limit holds a fork bomb under either runtime. Under runc it is the container's
/// pids cgroup. Under gVisor that cgroup counts the sandbox's own host tasks (its Sentry
/// and gofer, and a ptrace stub per guest process), so the driver moves the guest's limit
/// inside (RLIMIT_NPROC, enforced by the Sentry) and sizes the host cgroup for the sandbox
/// (driver::docker::adapt_to_gvisor). First what the engine was given, then the bomb: a
/// subshell forks sleepers until a fork fails; the shell counts with builtins only (no
/// fork) and answers.
#[tokio::test(flavor = "multi_thread")]
async fn a_fork_bomb_is_held_at_the_pids_limit() {
    use roundtable_sandbox::internals::docker::{
        GVISOR_HOST_TASKS_BASE, GVISOR_HOST_TASKS_PER_GUEST_TASK,
    };
    let env = Env::new();
    let mut config = env.sh_config("cat >/dev/null; sleep 120");
    config.limits.pids = 24;
    let sandbox = Sandbox::new(config).await.unwrap();
    let (turn, stop, c) = live_turn(&sandbox, "#bomb").await;
    stop.cancel();
    assert_eq!(turn.await.unwrap().error.as_deref(), Some("turn stopped"));
    let host = c.host_config.unwrap();
    let nproc: Vec<_> = host
        .ulimits
        .unwrap_or_default()
        .into_iter()
        .filter(|u| u.name.as_deref() == Some("nproc"))
        .map(|u| (u.soft, u.hard))
        .collect();
    if under_gvisor() {
        assert_eq!(
            host.pids_limit,
            Some(GVISOR_HOST_TASKS_BASE + GVISOR_HOST_TASKS_PER_GUEST_TASK * 24)
        );
        assert_eq!(nproc, vec![(Some(24), Some(24))]);
    } else {
        // No RLIMIT_NPROC under runc: it would count the service user's host processes.
        assert_eq!(host.pids_limit, Some(24));
        assert!(nproc.is_empty(), "{nproc:?}");
    }

    assert_no_leftovers(&sandbox).await;
    // A runtime holds its run root: the bomb gets roots of its own.
    let env = Env::new();
    let mut config = env.sh_config(
        r#"cat >/dev/null; ( while :; do sleep 1000 & done ) 2>/dev/null &
           i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done
           n=0; for p in /proc/[0-9]*; do n=$((n+1)); done
           printf '{"ok":true,"text":"%s"}' "$n""#,
    );
    config.limits.pids = 24;
    config.turn_timeout = Some(Duration::from_secs(60));
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#bomb", "x")).await.reply;
    let n: usize = reply
        .text
        .as_deref()
        .unwrap_or_else(|| panic!("{reply:?}"))
        .parse()
        .unwrap();
    // Held at the limit (init, the shell and the bomb's sleeps), and the bomb did grow.
    assert!((12..=24).contains(&n), "{n} processes");
    assert_no_leftovers(&sandbox).await;
}

/// A test that fails before its runtime is shut down leaves no container behind: its
/// scratch area, dropped while the test's thread unwinds, removes the containers of its
/// runtime instance (here one created with the instance's label, as a prepared container
/// waiting for its message is, and never started).
#[test]
fn a_failed_test_leaves_no_container_of_its_instance() {
    let (tx, rx) = std::sync::mpsc::channel();
    let failed = std::thread::spawn(move || {
        let env = Env::new();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let instance = rt.block_on(env.instance());
        let out = std::process::Command::new("docker")
            .args(["create", "--label"])
            .arg(format!("roundtable-sandbox={instance}"))
            .arg(image())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(rt.block_on(labelled_containers_of(&instance)).len(), 1);
        tx.send(instance).unwrap();
        panic!("a test's assertion failed (on purpose)");
    })
    .join();
    assert!(failed.is_err(), "the thread was to panic");
    let instance = rx.recv().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(
        rt.block_on(labelled_containers_of(&instance)),
        Vec::<String>::new()
    );
}
