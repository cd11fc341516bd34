//! Typed turn outcomes through the real runtime: the actor layer with the Docker driver and
//! the project's image, whose guest is replaced by a busybox script that branches on the
//! turn's text. Each kind of failure reaches the embedder as its [`TurnFailure`], beside the
//! unchanged reply text; every test ends with nothing left behind.

use std::time::Duration;

use actix::prelude::*;
use std::sync::Arc;

use roundtable_sandbox::events::EventKind;
use roundtable_sandbox::internals::testing::Recorder;
use roundtable_sandbox::internals::turn::channel_segment;
use roundtable_sandbox::ChannelId;
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
    let rec = Recorder::default();
    let addr = SandboxSupervisor::start(observed(&env, Duration::from_secs(60), &rec))
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
    // Each turn's one end, of its kind.
    for (channel, kind) in [
        ("#ok", None),
        ("#oom", Some(TurnFailure::OutOfMemory)),
        ("#guest", Some(TurnFailure::GuestError)),
        ("#garbage", Some(TurnFailure::MalformedOutput)),
        ("#exit", Some(TurnFailure::GuestExit)),
        ("#big", Some(TurnFailure::OverQuota)),
        ("#late", Some(TurnFailure::ShuttingDown)),
    ] {
        assert_one_end(&rec, channel, kind);
    }
    // A cold turn's events: admitted first, its phases, its end (not warm).
    let kinds: Vec<EventKind> = rec.of("#ok").into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds.first(), Some(&EventKind::Admitted), "{kinds:?}");
    for phase in [
        TurnPhase::Preparing,
        TurnPhase::BrokerListening,
        TurnPhase::ContainerRunning,
        TurnPhase::Replied,
        TurnPhase::TearingDown,
        TurnPhase::Done,
    ] {
        assert!(
            kinds.contains(&EventKind::Phase(phase)),
            "{phase:?}: {kinds:?}"
        );
    }
    assert!(kinds.contains(&EventKind::Ended {
        failure: None,
        warm: false
    }));
    // The engine's calls, by operation.
    let engine: Vec<&'static str> = rec
        .all()
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Engine { op, .. } => Some(op),
            _ => None,
        })
        .collect();
    assert!(
        engine.contains(&"create") && engine.contains(&"remove"),
        "{engine:?}"
    );
}

#[actix_rt::test]
async fn timeout_stop_and_busy_are_typed() {
    let env = Env::new();
    let rec = Recorder::default();
    let addr = SandboxSupervisor::start(observed(&env, Duration::from_secs(8), &rec))
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
    // One end each, of the kind the caller got: #stop's stopped turn, its busy refusal and
    // its queued turn that ran; the queue depth and the timeout.
    let mut ends = rec.ends("#stop");
    ends.sort_by_key(|f| format!("{f:?}"));
    assert_eq!(
        ends,
        vec![None, Some(TurnFailure::Busy), Some(TurnFailure::Stopped)]
    );
    assert!(rec
        .of("#stop")
        .iter()
        .any(|e| e.kind == EventKind::Queued { depth: 1 }));
    assert_one_end(&rec, "#slow", Some(TurnFailure::Timeout));
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
    let rec = Recorder::default();
    let addr = SandboxSupervisor::start(observed(&env, Duration::from_secs(60), &rec))
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
    let mut floor = observed(&env, Duration::from_secs(60), &rec);
    floor.config.limits.disk_floor_percent = 90;
    let addr = SandboxSupervisor::start(floor).await.unwrap();
    let (kind, error) = ran(&addr, "#floor", "hello").await;
    assert_eq!(kind, Some(TurnFailure::DiskFloor), "{error}");
    assert!(error.contains("below its floor"), "{error}");
    addr.send(Shutdown).await.unwrap();

    assert_nothing_left(&env);

    let env = Env::new();
    let mut dead = observed(&env, Duration::from_secs(60), &rec);
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
    for (channel, kind) in [
        ("#full", TurnFailure::OverQuota),
        ("#floor", TurnFailure::DiskFloor),
        ("#dead", TurnFailure::EngineUnavailable),
    ] {
        assert_one_end(&rec, channel, Some(kind));
    }
}

// ---------------------------------------------------------------- the event seam
//
// Every kind of failure a turn can end with, driven through the same real parts (the actor
// layer's own kinds through the supervisor; the wait for a slot with the fake driver, whose
// run holds the one slot past the waiter's deadline), yields exactly one `Ended` event of
// its kind for its channel, with the turn's other events (admitted, phases, queue depth,
// the wait for a slot, the engine's calls).

/// [`settings`] with `rec` observing the runtime.
fn observed(env: &Env, timeout: Duration, rec: &Recorder) -> SupervisorOptions {
    let mut s = settings(env, timeout);
    s.config.observer = Some(rec.observer());
    s
}

/// Exactly one `Ended` event for the channel, of this kind.
fn assert_one_end(rec: &Recorder, channel: &str, failure: Option<TurnFailure>) {
    assert_eq!(
        rec.ends(channel),
        vec![failure],
        "{channel}: {:?}",
        rec.of(channel)
    );
}

#[actix_rt::test]
async fn internal_restart_and_missing_image_yield_one_end_each() {
    let env = Env::new();
    let rec = Recorder::default();
    let addr = SandboxSupervisor::start(observed(&env, Duration::from_secs(60), &rec))
        .await
        .unwrap();
    // A channel's workspace that is a file: the host cannot prepare the turn.
    std::fs::write(
        env.workspace_root
            .join(ChannelId::new("#internal").segment()),
        b"x",
    )
    .unwrap();
    let outcome = send(&addr, "#internal", "hello").await.unwrap().unwrap();
    assert_eq!(outcome.failure, Some(TurnFailure::Internal), "{outcome:?}");
    assert_one_end(&rec, "#internal", Some(TurnFailure::Internal));

    // The channel's actor panics mid-turn: the caller and the event say ChannelRestarted.
    let turn = send(&addr, "#restart", "sleep long");
    until_container_running(&addr, "#restart").await;
    assert!(addr
        .send(InjectPanic {
            channel: "#restart".into()
        })
        .await
        .unwrap());
    let answer = turn.await.unwrap();
    assert!(
        matches!(answer, Err(SandboxActorError::ChannelRestarted)),
        "{answer:?}"
    );
    until_idle(&addr).await;
    assert_one_end(&rec, "#restart", Some(TurnFailure::ChannelRestarted));
    addr.send(Shutdown).await.unwrap();
    assert_nothing_left(&env);

    let env = Env::new();
    let mut missing = observed(&env, Duration::from_secs(60), &rec);
    missing.config.image = "roundtable-sandbox-never-built:none".into();
    let addr = SandboxSupervisor::start(missing).await.unwrap();
    let outcome = send(&addr, "#image", "hello").await.unwrap().unwrap();
    assert_eq!(
        outcome.failure,
        Some(TurnFailure::ImageMissing),
        "{outcome:?}"
    );
    assert_one_end(&rec, "#image", Some(TurnFailure::ImageMissing));
    addr.send(Shutdown).await.unwrap();
    assert_nothing_left(&env);
}

/// The wait for a container slot is the actor layer's logic: the fake driver holds the one
/// slot past the waiter's deadline (its run ignores the cancellation until released).
#[actix_rt::test]
async fn a_slot_timeout_yields_one_end_and_the_wait_is_reported() {
    let env = Env::new();
    let rec = Recorder::default();
    let driver = FakeDriver::new();
    let mut options = fake_supervisor(&env, &driver, &Arc::new(WhoAmI::default()));
    options.max_containers = 1;
    options.config.turn_timeout = Some(Duration::from_secs(2));
    options.config.observer = Some(rec.observer());
    let addr = SandboxSupervisor::start(options).await.unwrap();
    let held = send(&addr, "#hold", "stubborn");
    status_until(&addr, "holding the slot", |_| driver.running() == 1).await;
    let slot = send(&addr, "#slot", "hello").await.unwrap().unwrap();
    assert_eq!(slot.failure, Some(TurnFailure::SlotTimeout), "{slot:?}");
    assert_one_end(&rec, "#slot", Some(TurnFailure::SlotTimeout));
    assert!(rec
        .of("#slot")
        .iter()
        .any(|e| e.kind == EventKind::WaitingForSlot));
    driver.release(1);
    let held = held.await.unwrap().unwrap();
    assert_eq!(held.failure, Some(TurnFailure::Timeout), "{held:?}");
    assert_one_end(&rec, "#hold", Some(TurnFailure::Timeout));
    // The next turn gets the slot after a wait, which is reported with its length.
    let held = send(&addr, "#hold", "stubborn");
    status_until(&addr, "holding the slot", |_| driver.running() == 1).await;
    let next = send(&addr, "#next", "hello");
    status_until(&addr, "waiting", |s| s.totals.waiting_for_slot >= 1).await;
    driver.release(1);
    held.await.unwrap().unwrap();
    assert_eq!(next.await.unwrap().unwrap().failure, None);
    assert!(rec
        .of("#next")
        .iter()
        .any(|e| matches!(e.kind, EventKind::WaitedForSlot { .. })));
    until_idle(&addr).await;
    addr.send(Shutdown).await.unwrap();
}
