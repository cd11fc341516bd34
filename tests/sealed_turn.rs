//! The sealed turn against the real Docker engine, the runtime running as a non-root user.
//!
//! Most turns here replace the guest with a busybox `sh -c` script from the project's image,
//! so each test controls exactly what the "guest" does: probe its sandbox, sleep, flood,
//! bomb memory or pids. Every test ends by checking that nothing leaked.

use roundtable_sandbox::internals::testing::DockerDriverExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::Sandbox;

/// Reads the turn, then prints `{"ok":true,"text":<what the script echoes>}`.
fn reply_with(body: &str) -> String {
    format!("cat >/dev/null; out=$({{ {body}; }} | tr '\\n' ' ' | sed 's/ *$//'); printf '{{\"ok\":true,\"text\":\"%s\"}}' \"$out\"")
}

#[tokio::test(flavor = "multi_thread")]
async fn sealed_container_as_observed_from_inside() {
    let env = Env::new();
    let probe = r#"
        cat > /tmp/turn.json
        r=""
        touch /workspace/probe 2>/dev/null && r="$r workspace=rw" || r="$r workspace=ro"
        touch /run/roundtable/x 2>/dev/null && r="$r rundir=rw" || r="$r rundir=ro"
        touch /rootfs-probe 2>/dev/null && r="$r rootfs=rw" || r="$r rootfs=ro"
        r="$r net=$(ls /sys/class/net | tr '\n' ',')"
        r="$r uid=$(id -u) gid=$(id -g)"
        r="$r capeff=$(grep CapEff /proc/self/status | tr -d ' \t' | cut -d: -f2)"
        r="$r capbnd=$(grep CapBnd /proc/self/status | tr -d ' \t' | cut -d: -f2)"
        r="$r nnp=$(grep NoNewPrivs /proc/self/status | tr -d ' \t' | cut -d: -f2)"
        test -S /run/roundtable/broker.sock && r="$r socket=yes" || r="$r socket=no"
        r="$r rundir_entries=$(ls -A /run/roundtable | tr '\n' ',')"
        r="$r pid1=$(cat /proc/1/comm)"
        grep -q '"reset":false' /tmp/turn.json && r="$r turn=json" || r="$r turn=$(wc -c < /tmp/turn.json)"
        grep -q 'sk-test' /tmp/turn.json && r="$r key=LEAKED"
        env | grep -q 'sk-test' && r="$r env=LEAKED"
        printf '{"ok":true,"text":"%s"}' "$r"
    "#;
    let sandbox = env.sh_sandbox(probe).await;
    let reply = sandbox.run_turn(request("#probe", "hello")).await.reply;
    assert!(reply.ok, "{reply:?}");
    let text = reply.text.unwrap();
    let uid = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    // gVisor's /proc/self/status has no NoNewPrivs line: the flag is checked on the host
    // side there (runtime::the_turn_process_on_the_host_is_confined).
    let nnp = if under_gvisor() { "nnp= " } else { "nnp=1" };
    for expected in [
        "workspace=rw".to_string(),
        "rundir=ro".into(),
        "rootfs=ro".into(),
        "net=lo,".into(),
        format!("uid={uid} gid={gid}"),
        "capeff=0000000000000000".into(),
        "capbnd=0000000000000000".into(),
        nnp.into(),
        "socket=yes".into(),
        "rundir_entries=broker.sock,".into(),
        "turn=json".into(),
    ] {
        assert!(text.contains(&expected), "missing {expected:?} in {text:?}");
    }
    assert!(!text.contains("LEAKED"), "{text}");
    // An init process is PID 1, the guest is its child.
    assert!(!text.contains("pid1=sh"), "{text}");
    // The workspace file landed in this channel's own dir, created 0700.
    let ws = env.workspace_of("#probe");
    assert!(ws.join("probe").exists());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&ws).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn workspace_persists_per_channel_and_the_root_is_never_mounted() {
    let env = Env::new();
    let script = reply_with(
        "echo seen >> /workspace/log; wc -l < /workspace/log | tr -d ' '; ls -A /workspace; \
         grep ' /workspace ' /proc/self/mountinfo | cut -d' ' -f4",
    );
    let sandbox = env.sh_sandbox(&script).await;
    let a1 = sandbox.run_turn(request("#a", "one")).await.reply;
    let a2 = sandbox.run_turn(request("#a", "two")).await.reply;
    let b1 = sandbox.run_turn(request("#b", "one")).await.reply;
    let text = |r: roundtable_sandbox::Reply| r.text.unwrap_or_else(|| panic!("{:?}", r.error));
    let (a1, a2, b1) = (text(a1), text(a2), text(b1));
    assert!(a1.starts_with('1'), "{a1}");
    assert!(
        a2.starts_with('2'),
        "second turn of #a sees the first: {a2}"
    );
    assert!(b1.starts_with('1'), "#b has its own workspace: {b1}");
    // The mounted directory is the channel's segment, not the workspace root. (gVisor's
    // mountinfo shows no host path at all, only `/`: nothing of the host's layout.)
    let seg_a = roundtable_sandbox::internals::turn::channel_segment("#a");
    if under_gvisor() {
        assert!(a1.ends_with(" /"), "no host path under gVisor: {a1}");
    } else {
        assert!(a1.ends_with(&seg_a), "mount root is the channel dir: {a1}");
    }
    assert_ne!(
        env.workspace_of("#a"),
        env.workspace_of("#b"),
        "channels map to distinct dirs"
    );
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn reply_reaches_the_callback_before_teardown() {
    let env = Env::new();
    let sandbox = env.sh_sandbox(&reply_with("echo hi")).await;
    let seen = Arc::new(Mutex::new(None));
    let seen2 = seen.clone();
    let run_root = sandbox.config().run_root.clone();
    let sb = sandbox.clone();
    let reply = sandbox
        .run(sandbox.admit(request("#cb", "x")), None, move |o| {
            let dirs = run_root_entries(&run_root);
            *seen2.lock().unwrap() = Some((o.reply.clone(), dirs));
        })
        .await
        .reply;
    let (cb_reply, dirs_at_callback) = seen.lock().unwrap().take().unwrap();
    assert_eq!(cb_reply, reply);
    assert_eq!(reply.text.as_deref(), Some("hi"));
    assert_eq!(dirs_at_callback.len(), 1, "run dir still there at callback");
    assert!(dirs_at_callback[0].starts_with("turn-"));
    assert_no_leftovers(&sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn timeout_kills_the_container_promptly() {
    let env = Env::new();
    let mut config = env.sh_config("cat >/dev/null; sleep 300");
    config.turn_timeout = Some(Duration::from_secs(2));
    let sandbox = Sandbox::new(config).await.unwrap();
    let started = Instant::now();
    let reply = sandbox.run_turn(request("#slow", "x")).await.reply;
    let elapsed = started.elapsed();
    assert_eq!(reply.error.as_deref(), Some("turn timed out after 2s"));
    assert_no_leftovers(&sandbox).await;
    // The guest sleeps 300 s: ending this soon is the deadline's kill.
    assert!(
        elapsed < Duration::from_secs(2) + PROMPTLY,
        "container gone soon after the deadline, took {elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_timeout_counts_from_admission_and_covers_preparation() {
    let env = Env::new();
    let mut config = env.sh_config("cat >/dev/null; sleep 300");
    // A long timeout, so that "3 s left" (from admission) and "the whole timeout" (from
    // the call) stay far apart even when a busy machine's kill and teardown take long.
    config.turn_timeout = Some(Duration::from_secs(120));
    // The turns' phases, from the runtime's one observer.
    let phases = Arc::new(Mutex::new(Vec::new()));
    let seen = phases.clone();
    config.observer = Some(Arc::new(move |e: &roundtable_sandbox::Event| {
        if let roundtable_sandbox::EventKind::Phase(p) = e.kind {
            seen.lock().unwrap().push(p);
        }
    }));
    let sandbox = Sandbox::new(config).await.unwrap();
    let ago = |secs| {
        Instant::now()
            .checked_sub(Duration::from_secs(secs))
            .unwrap()
    };

    // Admitted longer ago than the timeout: it ends before any preparation.
    let mut late = request("#admitted", "x");
    late.admitted = Some(ago(121));
    let reply = sandbox.run_turn(late).await.reply;
    assert_eq!(reply.error.as_deref(), Some("turn timed out after 120s"));
    use roundtable_sandbox::TurnPhase::*;
    assert_eq!(
        *phases.lock().unwrap(),
        vec![Preparing, Replied, TearingDown, Done],
        "no broker, no container"
    );
    assert!(!env.workspace_of("#admitted").exists(), "no workspace made");
    assert_no_leftovers(&sandbox).await;

    // Admitted 117 s ago: 3 s are left for the container (not 120).
    let mut req = request("#admitted", "x");
    req.admitted = Some(ago(117));
    let started = Instant::now();
    let reply = sandbox.run_turn(req).await.reply;
    let elapsed = started.elapsed();
    assert_eq!(reply.error.as_deref(), Some("turn timed out after 120s"));
    assert!(
        elapsed < Duration::from_secs(3) + PROMPTLY,
        "the deadline was 3 s after the call, the reply came after {elapsed:?}"
    );
    assert!(elapsed >= Duration::from_secs(3), "{elapsed:?}");
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_channel_workspace_is_named_by_the_sha256_of_its_key() {
    let env = Env::new();
    let sandbox = env
        .sh_sandbox(&reply_with("echo hi > /workspace/f; echo ok"))
        .await;
    // Known vectors: FIPS 180-2's "abc", and `printf '%s' '#general' | sha256sum`.
    let vectors = [
        (
            "abc",
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        ),
        (
            "#general",
            "4c49f3f24629f5ee4ad5b3965db47985e01eafc53922f9d011eed513e41e149d",
        ),
    ];
    for (channel, _) in vectors {
        let reply = sandbox.run_turn(request(channel, "x")).await.reply;
        assert_eq!(reply.text.as_deref(), Some("ok"), "{reply:?}");
    }
    // The runtime's own lock file (one runtime per root) is not a workspace.
    let mut names = run_root_entries(&sandbox.config().workspace_root);
    names.sort();
    let mut expected: Vec<String> = vectors.iter().map(|(_, h)| h.to_string()).collect();
    expected.sort();
    assert_eq!(names, expected);
    for (channel, hash) in vectors {
        assert_eq!(
            roundtable_sandbox::internals::turn::channel_segment(channel),
            hash
        );
        let file = sandbox.config().workspace_root.join(hash).join("f");
        assert_eq!(std::fs::read_to_string(file).unwrap(), "hi\n");
    }
    assert_no_leftovers(&sandbox).await;
}

/// A turn of `channel` whose guest sleeps 300 s, its stop token handed to `stop` before it
/// starts: it ends with the stopped error and leaves nothing. Returns how long it took.
async fn stopped_turn(
    channel: &str,
    stop: impl FnOnce(tokio_util::sync::CancellationToken),
) -> Duration {
    let env = Env::new();
    let sandbox = env.sh_sandbox("cat >/dev/null; sleep 300").await;
    let req = request(channel, "x");
    stop(req.stop.clone());
    let started = Instant::now();
    let reply = sandbox.run_turn(req).await.reply;
    let took = started.elapsed();
    assert_eq!(reply.error.as_deref(), Some("turn stopped"));
    assert_no_leftovers(&sandbox).await;
    took
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_ends_the_turn_with_the_stopped_error() {
    let took = stopped_turn("#stop", |stop| {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            stop.cancel();
        });
    })
    .await;
    assert!(took < PROMPTLY);
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_before_start_is_clean() {
    stopped_turn("#early", |stop| stop.cancel()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_bomb_gives_the_memory_error() {
    let env = Env::new();
    let mut config =
        env.sh_config("cat >/dev/null; x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}");
    config.limits.memory_mb = 32;
    let reply = one_turn(config, "#oom").await;
    assert_eq!(
        reply.error.as_deref(),
        Some("guest killed: out of memory (limit 32 MiB)")
    );
}

/// A child the memory limit kills is the guest's business when the guest still answers
/// (exit 0, a reply): its turn stands. When it does not answer, the OOM kill is the
/// turn's error, ahead of what the output looks like.
#[tokio::test(flavor = "multi_thread")]
async fn a_child_killed_for_memory_fails_the_turn_only_when_the_guest_does_not_answer() {
    let env = Env::new();
    // The subshell holds the memory (the largest task: the OOM killer's pick); the shell
    // that answers holds almost none.
    let bomb = "cat >/dev/null; (x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x})";
    let run = |then: &'static str| {
        let mut config = env.sh_config(&format!("{bomb}; {then}"));
        config.limits.memory_mb = 32;
        one_turn(config, "#child-oom")
    };
    let garbage = run("printf 'not a reply'").await;
    assert_eq!(
        garbage.error.as_deref(),
        Some("guest killed: out of memory (limit 32 MiB)")
    );
    let failed = run("exit 5").await;
    assert_eq!(
        failed.error.as_deref(),
        Some("guest killed: out of memory (limit 32 MiB)")
    );
    // gVisor's memory limit is on the whole sandbox: its OOM kill ends every process.
    if !under_gvisor() {
        let answered = run(r#"printf '{"ok":true,"text":"answered"}'"#).await;
        assert_eq!(answered.error, None, "{answered:?}");
        assert_eq!(answered.text.as_deref(), Some("answered"));
    }
}

/// A turn whose future is dropped before its teardown still has its container removed: a
/// prepared container whose turn an embedder's timeout drops mid-run, and a cold one whose
/// reply callback panics after the run returned (the driver's own guard has stood down).
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_dropped_before_its_teardown_still_removes_its_container() {
    use tokio_util::sync::CancellationToken;
    let env = Env::new();
    let script = r#"t=$(cat); case "$t" in *'"text":"sleep'*) sleep 300;; esac; printf '{"ok":true,"text":"hi"}'"#;
    let sandbox = env.sh_sandbox(script).await;
    let instance = sandbox.config().instance.clone();
    let until_none_left = |why: &'static str| {
        let instance = instance.clone();
        async move {
            let started = Instant::now();
            while !labelled_containers_of(&instance).await.is_empty() {
                assert!(started.elapsed() < PROMPTLY, "container left behind: {why}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };

    let prepared = sandbox
        .prepare_turn("#dropped", CancellationToken::new())
        .await
        .unwrap()
        .expect("warm turns are on by default");
    assert_eq!(labelled_containers_of(&instance).await.len(), 1);
    let turn = sandbox.run(
        sandbox.admit(request("#dropped", "sleep")),
        Some(prepared),
        |_| {},
    );
    tokio::time::timeout(Duration::from_secs(2), turn)
        .await
        .expect_err("the guest sleeps");
    until_none_left("a prepared container's turn dropped").await;

    let cold = sandbox.clone();
    let panicked = tokio::spawn(async move {
        cold.run(cold.admit(request("#dropped", "hello")), None, |o| {
            panic!("reply callback (test): {:?}", o.reply.text)
        })
        .await
    })
    .await
    .expect_err("the callback panics");
    assert!(panicked.is_panic());
    until_none_left("a cold turn whose reply callback panicked").await;
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fork_bomb_is_bounded_by_the_pids_limit() {
    let env = Env::new();
    // A fork bomb; the shell then samples, with builtins only (it cannot fork while the
    // bomb holds the limit), the kernel's own count of its tasks (the pids cgroup's
    // `pids.current`, as the container sees it; a count of `/proc` entries is not one
    // instant, and under this churn it overcounts) 20 times, reads the limit and how many
    // forks the limit refused, answers and exits, which ends the container (the init
    // process follows its child).
    let mut config = env.sh_config(
        r#"cat >/dev/null; b() { b | b & }; b
           d=/sys/fs/cgroup/pids; [ -e $d/pids.current ] || d=/sys/fs/cgroup
           peak=0; s=0
           while [ $s -lt 20 ]; do
             read n < $d/pids.current
             [ $n -gt $peak ] && peak=$n
             i=0; while [ $i -lt 5000 ]; do i=$((i+1)); done
             s=$((s+1))
           done
           read max < $d/pids.max
           read what refused < $d/pids.events
           printf '{"ok":true,"text":"%s %s %s"}' "$peak" "$max" "$refused""#,
    );
    config.limits.pids = 16;
    config.turn_timeout = Some(Duration::from_secs(60));
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#fork", "x")).await.reply;
    if under_gvisor() {
        // Under gVisor the limit is RLIMIT_NPROC inside the Sentry (driver::docker::
        // adapt_to_gvisor), and the Sentry has no pids cgroup for the shell to read. Whether
        // the shell itself meets the limit is a race: it forks once for the bomb and then
        // only if a step is not a builtin; when it does, busybox sh exits 2 on the failed
        // fork, otherwise it answers. Either way the turn ends with that clear reply and
        // leaves nothing (seen failing in CI when only the exit was accepted). The bound
        // itself is counted by runtime::a_fork_bomb_is_held_at_the_pids_limit.
        assert!(
            reply.ok || reply.error.as_deref() == Some("guest exited with code 2"),
            "{reply:?}"
        );
        assert_no_leftovers(&sandbox).await;
        return;
    }
    let text = reply.text.clone().unwrap_or_else(|| panic!("{reply:?}"));
    let seen: Vec<&str> = text.split(' ').collect();
    eprintln!("fork bomb: peak, limit, forks refused = {seen:?} (limit 16)");
    let (peak, max, refused): (u32, &str, u64) =
        (seen[0].parse().unwrap(), seen[1], seen[2].parse().unwrap());
    assert_eq!(max, "16", "the limit the kernel applies");
    assert!(peak <= 16, "{peak} tasks past a limit of 16");
    // The probe is not blind: the bomb reached the limit, which refused its forks (the
    // bomb then collapses, so the peak sampled afterwards varies from run to run).
    assert!(refused > 0, "no fork was refused");
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stdout_flood_garbage_and_exit_codes_each_give_their_error() {
    let env = Env::new();
    let cases: [(&str, u64, &str); 4] = [
        ("cat >/dev/null; yes", 4, "guest output exceeds 4096 bytes"),
        (
            "cat >/dev/null; echo 'I am the host: all is fine'",
            1024,
            "guest output is not a valid reply: expected value at line 1 column 1",
        ),
        ("cat >/dev/null; exit 3", 1024, "guest exited with code 3"),
        (
            "cat >/dev/null; echo '{\"ok\":true,\"text\":\"x\",\"from\":\"host\"}'",
            1024,
            "guest output is not a valid reply: unknown field `from`, expected one of `ok`, `text`, `error`, `usage` at line 1 column 28",
        ),
    ];
    for (script, output_kb, expected) in cases {
        let mut config = env.sh_config(script);
        config.limits.output_kb = output_kb;
        let reply = one_turn(config, "#bad").await;
        assert_eq!(reply.error.as_deref(), Some(expected), "{script}");
        assert!(!reply.ok);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_image_and_unreachable_daemon_give_clear_errors() {
    let env = Env::new();
    let mut config = env.sh_config("true");
    config.image = "roundtable-sandbox-missing:nope".into();
    let reply = one_turn(config, "#img").await;
    assert_eq!(
        reply.error.as_deref(),
        Some("sandbox image not found: roundtable-sandbox-missing:nope (build it with scripts/build-image.sh)")
    );

    let mut config = env.sh_config("true");
    config.docker_host = Some(format!(
        "unix://{}/no-docker.sock",
        env.dir.path().display()
    ));
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#daemon", "x")).await.reply;
    let error = reply.error.unwrap();
    assert!(error.starts_with("docker daemon unreachable: "), "{error}");
    assert!(run_root_entries(&sandbox.config().run_root).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_that_never_answers_is_cut_by_the_call_deadline() {
    // A socket that accepts and never answers: the per-call deadline ends the wait.
    let env = Env::new();
    let path = env.dir.path().join("silent.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            if let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        }
    });
    let mut config = env.sh_config("true");
    config.docker_host = Some(format!("unix://{}", path.display()));
    config.turn_timeout = Some(Duration::from_secs(60));
    let sandbox = Sandbox::new(config).await.unwrap();
    let started = Instant::now();
    let reply = sandbox.run_turn(request("#hung", "x")).await.reply;
    let error = reply.error.unwrap();
    assert!(
        error.starts_with("docker daemon unreachable: no answer from"),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(run_root_entries(&sandbox.config().run_root).is_empty());
    hold.abort();
}

#[tokio::test(flavor = "multi_thread")]
async fn sweep_removes_labelled_containers_and_stale_run_dirs() {
    use roundtable_sandbox::driver::LABEL_RUNTIME;
    let env = Env::new();
    let sandbox = env.sh_sandbox("true").await;
    // What a killed runtime leaves: a labelled container still running, a run dir.
    let stale_dir = sandbox.config().run_root.join("turn-stale1");
    std::fs::create_dir(&stale_dir).unwrap();
    let name = format!("roundtable-sandbox-test-{}", &sandbox.config().instance);
    start_labelled_container(
        &name,
        &[(LABEL_RUNTIME, sandbox.config().instance.as_str())],
        &stale_dir,
        &env.workspace_of("#crash"),
    )
    .await;
    assert_eq!(labelled_containers(&sandbox).await.len(), 1);
    drop(sandbox);

    // The restarted runtime sweeps at startup.
    let restarted = env.sh_sandbox("true").await;
    let report = restarted.sweep().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.containers, vec![name]);
    assert_eq!(report.run_dirs, vec![stale_dir]);
    assert_no_leftovers(&restarted).await;
}

/// A guest that waits until the host creates `go` in its workspace, then answers `done`.
const WAIT_FOR_GO: &str = "cat >/dev/null; while [ ! -e /workspace/go ]; do sleep 0.2; done; printf '{\"ok\":true,\"text\":\"done\"}'";

/// Starts a turn of `#live` (its guest waits for `go`, see [`WAIT_FOR_GO`]) on a task of
/// its own; once it runs, returns the task, its container's name and its run dir.
async fn start_live_turn(
    sandbox: &Sandbox,
) -> (
    tokio::task::JoinHandle<roundtable_sandbox::Reply>,
    String,
    String,
) {
    let turn = tokio::spawn({
        let sandbox = sandbox.clone();
        async move { sandbox.run_turn(request("#live", "x")).await.reply }
    });
    let (container, run_dir) = live_turn_of(sandbox).await;
    (turn, container, run_dir)
}

/// Waits (generously) until the runtime has a container and a run dir for a live turn.
async fn live_turn_of(sandbox: &Sandbox) -> (String, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let containers = labelled_containers(sandbox).await;
        let dirs = run_root_entries(&sandbox.config().run_root);
        if let (Some(c), Some(d)) = (containers.first(), dirs.first()) {
            return (c.trim_start_matches('/').to_owned(), d.clone());
        }
        assert!(Instant::now() < deadline, "no live turn appeared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates and starts a sleeping container with these labels whose run dir is `run_dir`.
async fn start_labelled_container(
    name: &str,
    labels: &[(&str, &str)],
    run_dir: &std::path::Path,
    workspace: &std::path::Path,
) {
    let sleep = vec!["/bin/sleep".into(), "300".into()];
    start_container_running(name, labels, run_dir, workspace, 64, sleep).await
}

/// Creates and starts a container with these labels, memory limit and command.
async fn start_container_running(
    name: &str,
    labels: &[(&str, &str)],
    run_dir: &std::path::Path,
    workspace: &std::path::Path,
    memory_mb: u64,
    command: Vec<String>,
) {
    use roundtable_sandbox::driver::ContainerSpec;
    use roundtable_sandbox::internals::docker::create_body;
    std::fs::create_dir_all(run_dir).unwrap();
    std::fs::create_dir_all(workspace).unwrap();
    let spec = ContainerSpec {
        name: name.to_owned(),
        image: image(),
        run_dir: run_dir.to_owned(),
        workspace_dir: workspace.to_owned(),
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        memory_mb,
        cpus: 0.5,
        pids: 16,
        tmpfs_mb: 1,
        file_size_mb: 64,
        output_cap: 1024,
        stderr_cap: 1024,
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        command: Some(command),
        runtime: runtime(),
    };
    let driver = roundtable_sandbox::DockerDriver::default();
    let docker = driver.client().await.unwrap();
    let opts = bollard::query_parameters::CreateContainerOptionsBuilder::new()
        .name(name)
        .build();
    docker
        .create_container(Some(opts), create_body(&spec))
        .await
        .unwrap();
    docker.start_container(name, None).await.unwrap();
}

async fn container_running(name: &str) -> bool {
    let driver = roundtable_sandbox::DockerDriver::default();
    let docker = driver.client().await.unwrap();
    match docker.inspect_container(name, None).await {
        Ok(c) => c.state.and_then(|s| s.running) == Some(true),
        Err(_) => false,
    }
}

/// The engine may not have seen a container's end when its caller has (an MCP session's
/// stdio closed by the kill, under load): asked about a container still running, the driver
/// waits a while for its end before it answers that no OOM kill happened.
#[tokio::test(flavor = "multi_thread")]
async fn an_oom_kill_is_found_when_asked_while_the_engine_still_lists_the_container_running() {
    use roundtable_sandbox::driver::ContainerDriver;
    let env = Env::new();
    let name = format!("rt-oom-ask-{}", uuid::Uuid::new_v4().simple());
    let _cleanup = RemoveOnDrop(vec![name.clone()]);
    let dir = env.run_root.join("oom-ask");
    let bomb = "sleep 1; x=a; while :; do x=$x$x; done";
    let command = vec!["/bin/sh".into(), "-c".into(), bomb.into()];
    let (run_dir, workspace) = (dir.join("run"), dir.join("ws"));
    let label = [("roundtable-sandbox.test", "oom-ask")];
    start_container_running(&name, &label, &run_dir, &workspace, 16, command).await;
    assert!(
        container_running(&name).await,
        "the container ended before it was asked"
    );
    let driver = roundtable_sandbox::DockerDriver::default();
    assert!(
        driver.oom_killed(&name).await.unwrap(),
        "the OOM kill was not found"
    );
}

/// Removes the named containers (this test's own) when dropped, a failing test included.
struct RemoveOnDrop(Vec<String>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker")
            .args(["rm", "-f"])
            .args(&self.0)
            .output();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_runtime_on_the_same_roots_fails_at_startup_and_spares_the_first() {
    let env = Env::new();
    let first = env.sh_sandbox(WAIT_FOR_GO).await;
    let run_root = first.config().run_root.clone();
    let workspace_root = first.config().workspace_root.clone();
    let (turn, container, run_dir) = start_live_turn(&first).await;

    let in_use = |root: &std::path::Path| {
        format!(
            "sandbox root {} is in use by another runtime (pid {}): one runtime per root",
            root.display(),
            std::process::id()
        )
    };
    // The same roots (an overlapping restart): refused before anything starts.
    let err = Sandbox::new(env.sh_config("true")).await.unwrap_err();
    assert_eq!(err.to_string(), in_use(&run_root));
    // The same run root, another workspace root.
    let mut config = env.sh_config("true");
    config.workspace_root = env.dir.path().join("ws2");
    let err = Sandbox::new(config).await.unwrap_err();
    assert_eq!(err.to_string(), in_use(&run_root));
    // Another run root, the same workspace root: two runtimes would run two turns of one
    // channel on one workspace at once.
    let mut config = env.sh_config("true");
    config.run_root = env.dir.path().join("run2");
    let err = Sandbox::new(config).await.unwrap_err();
    assert_eq!(err.to_string(), in_use(&workspace_root));

    // The first runtime's turn was not touched: it runs on and answers.
    assert!(container_running(&container).await, "{container}");
    assert!(run_root.join(&run_dir).is_dir());
    std::fs::write(env.workspace_of("#live").join("go"), "").unwrap();
    let reply = turn.await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("done"), "{reply:?}");
    assert_no_leftovers(&first).await;

    // Once the first runtime is gone (every clone dropped), its successor starts.
    drop(first);
    let second = env.sh_sandbox("true").await;
    let report = second.sweep().await;
    assert!(report.containers.is_empty() && report.run_dirs.is_empty());
    assert_no_leftovers(&second).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sweep_spares_live_turns_and_other_runtimes_containers() {
    use roundtable_sandbox::driver::LABEL_RUNTIME;
    let env = Env::new();
    let sandbox = env.sh_sandbox(WAIT_FOR_GO).await;
    let instance = sandbox.config().instance.clone();
    let run_root = sandbox.config().run_root.clone();
    let (turn, live_container, live_dir) = start_live_turn(&sandbox).await;

    let pid = std::process::id();
    let ws = env.dir.path().join("other-ws");
    let _cleanup = RemoveOnDrop(vec![
        format!("roundtable-sandbox-stale-{pid}"),
        format!("roundtable-sandbox-other-{pid}"),
        format!("roundtable-sandbox-other-root-{pid}"),
        live_container.clone(),
    ]);
    // Positive control: what a crashed runtime of this instance left (removed).
    let stale = format!("roundtable-sandbox-stale-{pid}");
    start_labelled_container(
        &stale,
        &[(LABEL_RUNTIME, &instance)],
        &run_root.join("turn-stale1"),
        &ws,
    )
    .await;
    // Another instance's container (kept).
    let other_instance = format!("roundtable-sandbox-other-{pid}");
    start_labelled_container(
        &other_instance,
        &[(LABEL_RUNTIME, "some-other-instance")],
        &env.dir.path().join("other-run/turn-a"),
        &ws,
    )
    .await;
    // A runtime that shares this instance name but has another run root (kept).
    let other_root = format!("roundtable-sandbox-other-root-{pid}");
    start_labelled_container(
        &other_root,
        &[(LABEL_RUNTIME, &instance)],
        &env.dir.path().join("other-run/turn-b"),
        &ws,
    )
    .await;

    let report = sandbox.sweep().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.containers, vec![stale.clone()]);
    assert_eq!(report.run_dirs, vec![run_root.join("turn-stale1")]);
    assert!(
        container_running(&live_container).await,
        "the live turn's container survives"
    );
    assert!(
        run_root.join(&live_dir).join("broker.sock").exists(),
        "the live turn's run dir survives"
    );
    assert!(container_running(&other_instance).await);
    assert!(container_running(&other_root).await);
    assert!(!container_running(&stale).await);

    // The live turn ends normally.
    std::fs::write(env.workspace_of("#live").join("go"), "").unwrap();
    let reply = turn.await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("done"), "{reply:?}");
    drop(_cleanup);
    assert_no_leftovers(&sandbox).await;
}

/// A turn asks the engine for no inspect when it ends in a reply: where its container's
/// processes are listed (the liveness check, the quota's count of held files) is found by
/// the id the engine gave at creation, in the engine's cgroup layout (`docker/<id>` or
/// `docker-<id>.scope`, the two cgroup drivers'), not by asking the engine. Cold and warm
/// alike (the warm turn's container is started the same way). The guest holds a deleted
/// file open for a second, so the quota's watcher lists its processes a few times.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_that_replies_asks_the_engine_for_no_inspect() {
    let env = Env::new();
    engine_calls_of_a_replying_turn(&env, None).await;
}

/// The same on a slow engine: the quota's watcher ticks while the container is being
/// started (seen in CI beside a build: its look at the processes asked the engine), and
/// finds that no process runs yet without asking.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_on_an_engine_slow_to_start_asks_for_no_inspect() {
    let env = Env::new();
    let proxy = roundtable_sandbox_test_support::docker_proxy::DockerProxy::start(env.dir.path());
    // Three ticks of the quota watcher (`quota::WATCH_INTERVAL`, 250 ms).
    proxy.delay_starts(Duration::from_millis(750));
    engine_calls_of_a_replying_turn(&env, Some(proxy.host())).await;
}

/// One turn whose guest holds a deleted file open for a second, through the engine at
/// `docker_host`: its engine calls have no inspect.
async fn engine_calls_of_a_replying_turn(env: &Env, docker_host: Option<String>) {
    let ops = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let mut config = env.sh_config(
        "cat >/dev/null; exec 3>/workspace/held; rm /workspace/held; \
         head -c 3000000 /dev/zero >&3; sleep 1; \
         printf '{\"ok\":true,\"text\":\"done\"}'",
    );
    config.docker_host = docker_host;
    config.observer = Some({
        let ops = ops.clone();
        Arc::new(move |e: &roundtable_sandbox::events::Event| {
            if let roundtable_sandbox::events::EventKind::Engine { op, .. } = e.kind {
                ops.lock().unwrap().push(op);
            }
        })
    });
    let sandbox = Sandbox::new(config).await.unwrap();
    let outcome = sandbox.run_turn(request("#no-inspect", "x")).await;
    assert!(outcome.reply.ok, "{:?}", outcome.reply);
    let ops = ops.lock().unwrap().clone();
    assert!(ops.contains(&"create") && ops.contains(&"start"), "{ops:?}");
    assert!(!ops.contains(&"inspect"), "{ops:?}");
    assert_no_leftovers(&sandbox).await;
}
