//! Typed turn outcomes through the real runtime: the actor layer with the Docker driver and
//! the project's image, whose guest is replaced by a busybox script that branches on the
//! turn's text. Each kind of failure reaches the embedder as its [`TurnFailure`], beside the
//! unchanged reply text; every test ends with nothing left behind.

use std::time::Duration;

use actix::prelude::*;
use roundtable_sandbox::turn::channel_segment;
use roundtable_sandbox_actors::testing::*;
use roundtable_sandbox_actors::*;

const SCRIPT: &str = r#"t=$(cat); case "$t" in
*'"text":"sleep'*) sleep 300;;
*'"text":"oom'*) x=$(head -c 400000000 /dev/zero | tr '\0' a); echo ${#x};;
*'"text":"guest'*) printf '{"ok":false,"error":"no model today"}'; exit 0;;
*'"text":"garbage'*) printf 'not a reply'; exit 0;;
*'"text":"exit'*) exit 3;;
*'"text":"bigfile'*) exec head -c 3000000 /dev/zero > /workspace/big;;
esac; printf '{"ok":true,"text":"hi"}'"#;

fn settings(env: &Env, timeout: Duration) -> SupervisorOptions {
    let mut c = env.sh_config(SCRIPT);
    c.turn_timeout = Some(timeout);
    c.limits.memory_mb = 32;
    c.limits.workspace_mb = 1;
    // The cold path (tests/warm.rs: the typed exits of turns in prepared containers).
    c.warm.enabled = false;
    let mut s = SupervisorOptions::new(c);
    s.max_containers = 4;
    s.queue_limit = 1;
    s
}

/// The outcome's kind and error text (a turn that ran, ok or not).
async fn ran(
    addr: &Addr<SandboxSupervisor>,
    channel: &str,
    text: &str,
) -> (Option<TurnFailure>, String) {
    let outcome = send(addr, channel, text).await.unwrap().unwrap();
    assert_eq!(outcome.failure.is_none(), outcome.reply.ok, "{outcome:?}");
    (
        outcome.failure,
        outcome.reply.error.clone().unwrap_or_default(),
    )
}

async fn until_container_running(addr: &Addr<SandboxSupervisor>, channel: &str) {
    status_until(addr, "container running", |s| {
        s.channels.iter().any(|c| {
            c.channel == channel && c.state == ChannelState::Running(TurnPhase::ContainerRunning)
        })
    })
    .await;
}

fn assert_nothing_left(env: &Env) {
    assert!(
        env.turn_dirs().is_empty(),
        "leaked run dirs: {:?}",
        env.turn_dirs()
    );
}

#[actix_rt::test]
async fn what_the_container_did_is_typed_once_by_the_turn() {
    let env = Env::new();
    let addr = SandboxSupervisor::start(settings(&env, Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(ran(&addr, "#ok", "hello").await, (None, String::new()));
    assert_eq!(
        ran(&addr, "#oom", "oom please").await,
        (
            Some(TurnFailure::OutOfMemory),
            "guest killed: out of memory (limit 32 MiB)".into()
        )
    );
    assert_eq!(
        ran(&addr, "#guest", "guest error").await,
        (
            Some(TurnFailure::GuestError),
            "the guest reported an error: no model today".into()
        )
    );
    let (kind, error) = ran(&addr, "#garbage", "garbage out").await;
    assert_eq!(kind, Some(TurnFailure::MalformedOutput), "{error}");
    assert!(
        error.starts_with("guest output is not a valid reply: "),
        "{error}"
    );
    assert_eq!(
        ran(&addr, "#exit", "exit now").await,
        (
            Some(TurnFailure::GuestExit),
            "guest exited with code 3".into()
        )
    );
    // A file past the 1 MiB workspace quota: RLIMIT_FSIZE kills the writer (or the quota
    // watcher ends the turn first, on a slow machine).
    let (kind, error) = ran(&addr, "#big", "bigfile").await;
    assert_eq!(kind, Some(TurnFailure::OverQuota), "{error}");
    assert!(
        error == "guest killed: a file grew past the workspace quota (1 MiB)"
            || error.starts_with("this channel's workspace is over its quota"),
        "{error}"
    );
    until_idle(&addr).await;
    addr.send(Shutdown).await.unwrap();
    // After shutdown: refused, typed.
    let refused = send(&addr, "#late", "hello").await.unwrap().unwrap_err();
    assert_eq!(refused.failure(), TurnFailure::ShuttingDown, "{refused}");
    assert_nothing_left(&env);
}

#[actix_rt::test]
async fn timeout_stop_and_busy_are_typed() {
    let env = Env::new();
    let addr = SandboxSupervisor::start(settings(&env, Duration::from_secs(8)))
        .await
        .unwrap();
    let timed_out = send(&addr, "#slow", "sleep forever");

    let stopped = send(&addr, "#stop", "sleep long");
    until_container_running(&addr, "#stop").await;
    // The queue holds one message: the next is refused at once, as busy.
    let queued = send(&addr, "#stop", "hello");
    status_until(&addr, "one queued", |s| s.totals.queued >= 1).await;
    let busy = send(&addr, "#stop", "hello").await.unwrap().unwrap_err();
    assert_eq!(busy.failure(), TurnFailure::Busy, "{busy}");
    assert!(stop(&addr, "#stop").await);
    let stopped = stopped.await.unwrap().unwrap();
    assert_eq!(stopped.failure, Some(TurnFailure::Stopped));
    assert_eq!(stopped.reply.error.as_deref(), Some("turn stopped"));
    let queued = queued.await.unwrap().unwrap();
    assert_eq!(queued.failure, None, "{queued:?}");

    let timed_out = timed_out.await.unwrap().unwrap();
    assert_eq!(timed_out.failure, Some(TurnFailure::Timeout));
    assert_eq!(
        timed_out.reply.error.as_deref(),
        Some("turn timed out after 8s")
    );
    until_idle(&addr).await;
    assert_nothing_left(&env);
}

#[actix_rt::test]
async fn quota_floor_and_an_unreachable_engine_are_typed() {
    let env = Env::new();
    // A workspace already past its quota is refused before any container.
    let ws = env.workspace_root.join(channel_segment("#full"));
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(&ws)
        .unwrap();
    std::fs::write(ws.join("old"), vec![0u8; 2 << 20]).unwrap();
    let addr = SandboxSupervisor::start(settings(&env, Duration::from_secs(60)))
        .await
        .unwrap();
    let (kind, error) = ran(&addr, "#full", "hello").await;
    assert_eq!(kind, Some(TurnFailure::OverQuota), "{error}");
    assert!(
        error.starts_with("this channel's workspace is over its quota"),
        "{error}"
    );
    addr.send(Shutdown).await.unwrap();

    assert_nothing_left(&env);

    // A floor of 90 % free: the test machine's filesystems are never that empty. (Each
    // runtime gets its own roots: one runtime per root.)
    let env = Env::new();
    let mut floor = settings(&env, Duration::from_secs(60));
    floor.config.limits.disk_floor_percent = 90;
    let addr = SandboxSupervisor::start(floor).await.unwrap();
    let (kind, error) = ran(&addr, "#floor", "hello").await;
    assert_eq!(kind, Some(TurnFailure::DiskFloor), "{error}");
    assert!(error.contains("below its floor"), "{error}");
    addr.send(Shutdown).await.unwrap();

    assert_nothing_left(&env);

    let env = Env::new();
    let mut dead = settings(&env, Duration::from_secs(60));
    dead.config.docker_host = Some(format!(
        "unix://{}/no-docker.sock",
        env.dir.path().display()
    ));
    dead.sweep_on_start = false;
    let addr = SandboxSupervisor::start(dead).await.unwrap();
    let (kind, error) = ran(&addr, "#dead", "hello").await;
    assert_eq!(kind, Some(TurnFailure::EngineUnavailable), "{error}");
    assert!(error.starts_with("docker daemon unreachable: "), "{error}");
    addr.send(Shutdown).await.unwrap();
    assert_nothing_left(&env);
}
