//! The actor layer against the real Docker engine: stop, shutdown, supervision and cleanup.
//! The guest is replaced by a busybox script of the project's image that branches on the
//! turn's text: `sleep…` sleeps 300 s, `fail…` exits 3, anything else answers "hi".
//! Every test ends by checking that no labelled container and no run dir is left.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use actix::prelude::*;
use roundtable_sandbox::driver::LABEL_RUNTIME;
use roundtable_sandbox::events::{Event, EventKind};
use roundtable_sandbox::{DockerDriver, TurnPhase};
use roundtable_sandbox_actors::testing::*;
use roundtable_sandbox_actors::*;

const SCRIPT: &str = r#"t=$(cat); case "$t" in *'"text":"sleep'*) sleep 300;; *'"text":"fail'*) exit 3;; esac; printf '{"ok":true,"text":"hi"}'"#;

fn config(env: &Env) -> SupervisorOptions {
    let mut c = env.sh_config(SCRIPT);
    // The cold path: one container per turn, made at admission (tests/warm.rs runs the
    // same exits through prepared containers).
    c.warm.enabled = false;
    let mut s = SupervisorOptions::new(c);
    s.max_containers = 4;
    s
}

async fn running_containers(instance: &str) -> usize {
    containers_labelled(&[format!("{LABEL_RUNTIME}={instance}")])
        .await
        .iter()
        .filter(|c| c.state.is_some_and(|s| s.to_string() == "running"))
        .count()
}

async fn assert_no_leftovers(env: &Env, instance: &str) {
    assert_no_leftovers_in(instance, &env.run_root).await;
}

async fn until_running(addr: &Addr<SandboxSupervisor>, instance: &str, n: usize) {
    status_until(addr, "containers running", |s| {
        s.channels
            .iter()
            .filter(|c| c.state == ChannelState::Running(TurnPhase::ContainerRunning))
            .count()
            >= n
    })
    .await;
    let started = Instant::now();
    while running_containers(instance).await < n {
        assert!(started.elapsed() < PROMPTLY, "containers never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[actix_rt::test]
async fn replies_and_failures_leave_nothing_behind() {
    let env = Env::new();
    let instance = env.instance().await;
    let addr = SandboxSupervisor::start(config(&env)).await.unwrap();
    let ok = send(&addr, "#c", "hello").await.unwrap().unwrap();
    assert_eq!(ok.text.as_deref(), Some("hi"), "{ok:?}");
    let failed = send(&addr, "#c", "fail please").await.unwrap().unwrap();
    assert_eq!(failed.error.as_deref(), Some("guest exited with code 3"));
    until_idle(&addr).await;
    assert_no_leftovers(&env, &instance).await;
}

#[actix_rt::test]
async fn stop_kills_the_running_container_promptly() {
    let env = Env::new();
    let instance = env.instance().await;
    let addr = SandboxSupervisor::start(config(&env)).await.unwrap();
    let turn = send(&addr, "#stop", "sleep long");
    until_running(&addr, &instance, 1).await;

    let started = Instant::now();
    assert!(stop(&addr, "#stop").await);
    let reply = turn.await.unwrap().unwrap();
    let replied = started.elapsed();
    assert_eq!(reply.error.as_deref(), Some("turn stopped"));
    // The reply comes once the driver saw the container exit: it is dead by now.
    assert_eq!(running_containers(&instance).await, 0);
    // The guest sleeps 300 s: a reply this soon is the kill's (was a 1 s bound, which a
    // busy machine's Docker daemon does not always meet).
    assert!(replied < PROMPTLY, "stopped in {replied:?}");
    until_idle(&addr).await;
    let torn_down = started.elapsed();
    assert_no_leftovers(&env, &instance).await;
    println!("stop: reply after {replied:?}, torn down after {torn_down:?}");
}

#[actix_rt::test]
async fn stop_during_broker_startup_leaves_nothing_behind() {
    let env = Env::new();
    let instance = env.instance().await;
    let mut config = config(&env);
    let supervisor: Arc<OnceLock<Addr<SandboxSupervisor>>> = Arc::new(OnceLock::new());
    let sup = supervisor.clone();
    observe(&mut config, move |e: &Event| {
        if of_channel(e, "#early") && matches!(e.kind, EventKind::Phase(TurnPhase::BrokerListening))
        {
            sup.get().unwrap().do_send(Stop {
                channel: "#early".into(),
            });
        }
    });
    let addr = SandboxSupervisor::start(config).await.unwrap();
    supervisor.set(addr.clone()).unwrap();
    let started = Instant::now();
    let reply = send(&addr, "#early", "sleep long").await.unwrap().unwrap();
    assert_eq!(reply.error.as_deref(), Some("turn stopped"));
    assert!(started.elapsed() < PROMPTLY, "{:?}", started.elapsed());
    until_idle(&addr).await;
    assert_no_leftovers(&env, &instance).await;
}

#[actix_rt::test]
async fn shutdown_with_running_and_queued_turns_answers_everyone_and_leaks_nothing() {
    let env = Env::new();
    let instance = env.instance().await;
    let mut config = config(&env);
    config.max_containers = 2;
    let addr = SandboxSupervisor::start(config).await.unwrap();
    let mut callers = vec![send(&addr, "#a", "sleep a"), send(&addr, "#b", "sleep b")];
    until_running(&addr, &instance, 2).await;
    callers.push(send(&addr, "#c", "sleep c")); // waits for a slot
    callers.push(send(&addr, "#a", "queued a2"));
    callers.push(send(&addr, "#b", "queued b2"));
    status_until(&addr, "queued", |s| {
        s.totals.queued == 2 && s.totals.waiting_for_slot == 1
    })
    .await;

    let started = Instant::now();
    let report = addr.send(Shutdown).await.unwrap();
    let took = started.elapsed();
    assert_eq!(
        report,
        ShutdownReport {
            stopped_turns: 3,
            refused_queued: 2
        }
    );
    // Resolved after teardown.
    assert_no_leftovers(&env, &instance).await;
    for caller in callers {
        let answer = tokio::time::timeout(PROMPTLY, caller)
            .await
            .expect("answered")
            .unwrap();
        assert!(
            matches!(answer, Err(SandboxActorError::ShuttingDown)),
            "{answer:?}"
        );
    }
    assert!(took < PROMPTLY, "shutdown took {took:?}");
    println!("shutdown of 2 running containers took {took:?}");
}

#[actix_rt::test]
async fn a_channel_actor_panic_ends_the_running_container() {
    let env = Env::new();
    let instance = env.instance().await;
    let addr = SandboxSupervisor::start(config(&env)).await.unwrap();
    addr.send(StartFresh {
        channel: "#p".into(),
    })
    .await
    .unwrap();
    let turn = send(&addr, "#p", "sleep long");
    until_running(&addr, &instance, 1).await;
    let started = Instant::now();
    assert!(addr
        .send(InjectPanic {
            channel: "#p".into()
        })
        .await
        .unwrap());
    // The panic hook prints a backtrace first (RUST_BACKTRACE=1: the first one loads the
    // debug binary's symbols, 3 s on a busy machine, which failed the 1 s bound this had).
    let answer = tokio::time::timeout(PROMPTLY, turn)
        .await
        .expect("no hang")
        .unwrap();
    assert!(
        matches!(answer, Err(SandboxActorError::ChannelRestarted)),
        "{answer:?}"
    );
    assert!(started.elapsed() < PROMPTLY);
    until_idle(&addr).await;
    assert_no_leftovers(&env, &instance).await;
    let s = addr.send(Status).await.unwrap();
    let p = s.channels.iter().find(|c| c.channel == "#p").unwrap();
    assert_eq!((p.restarts, p.pending_reset), (1, 1));
    let next = send(&addr, "#p", "hello").await.unwrap().unwrap();
    assert_eq!(next.text.as_deref(), Some("hi"));
    until_idle(&addr).await;
    assert_no_leftovers(&env, &instance).await;
}

#[actix_rt::test]
async fn a_panic_in_the_turn_with_a_running_container_still_tears_it_down() {
    let env = Env::new();
    let instance = env.instance().await;
    let mut config = config(&env);
    // The Docker driver, except that a run still going after 1 s panics (inside the turn's
    // task, with the real container running).
    config.config.driver = Some(FakeDriver::panicking_after(
        Arc::new(DockerDriver::default()),
        Duration::from_secs(1),
    ));
    let addr = SandboxSupervisor::start(config).await.unwrap();
    let turn = send(&addr, "#tp", "sleep long");
    until_running(&addr, &instance, 1).await;
    let answer = tokio::time::timeout(PROMPTLY, turn)
        .await
        .expect("no hang")
        .unwrap();
    match answer {
        Err(SandboxActorError::TurnPanicked { message }) => {
            assert_eq!(message, "driver panic mid-run (test)")
        }
        other => panic!("{other:?}"),
    }
    // The core's drop guards removed the run dir and spawned the container's removal.
    let started = Instant::now();
    while !labelled_containers_of(&instance).await.is_empty() {
        assert!(started.elapsed() < PROMPTLY, "container left behind");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    until_idle(&addr).await;
    assert_no_leftovers(&env, &instance).await;
    // The channel goes on.
    let next = send(&addr, "#tp", "hello").await.unwrap().unwrap();
    assert_eq!(next.text.as_deref(), Some("hi"));
    until_idle(&addr).await;
    assert_no_leftovers(&env, &instance).await;
}

#[actix_rt::test]
async fn the_turn_timeout_runs_from_admission_through_the_slot_wait() {
    let env = Env::new();
    let instance = env.instance().await;
    let mut config = config(&env);
    config.max_containers = 1;
    // The slot wait is the margin between "from admission" and "from the slot": long, so
    // a busy machine's slow kill and reply stay inside it.
    let timeout = Duration::from_secs(40);
    let slot_wait = Duration::from_secs(20);
    config.config.turn_timeout = Some(timeout);
    // When #late got its slot (its turn's Preparing phase).
    let slot_at: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
    let slot = slot_at.clone();
    observe(&mut config, move |e: &Event| {
        if of_channel(e, "#late") && matches!(e.kind, EventKind::Phase(TurnPhase::Preparing)) {
            slot.lock().unwrap().get_or_insert_with(Instant::now);
        }
    });
    let addr = SandboxSupervisor::start(config).await.unwrap();

    let holder = send(&addr, "#holder", "sleep long");
    until_running(&addr, &instance, 1).await;
    // The real container's name: roundtable-sandbox-<16 hex of sha256(channel)>-<8 hex>.
    let names = labelled_containers_of(&instance).await;
    assert_eq!(names.len(), 1, "{names:?}");
    let segment = roundtable_sandbox::internals::turn::channel_segment("#holder");
    let name = names[0].trim_start_matches('/');
    let turn = name
        .strip_prefix(&format!("roundtable-sandbox-{}-", &segment[..16]))
        .unwrap_or_else(|| panic!("{name}"));
    assert!(
        turn.len() == 8
            && turn
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{name}"
    );

    let admitted = Instant::now();
    let late = send(&addr, "#late", "sleep late");
    status_until(&addr, "#late waiting for a slot", |s| {
        s.channels
            .iter()
            .any(|c| c.channel == "#late" && c.state == ChannelState::WaitingForSlot)
    })
    .await;
    // #late waits 20 s of its 40 s for the slot, then runs a container that never ends.
    tokio::time::sleep(slot_wait).await;
    stop(&addr, "#holder").await;
    let _ = holder.await.unwrap();
    let reply = tokio::time::timeout(timeout + PROMPTLY, late)
        .await
        .expect("no hang")
        .unwrap()
        .unwrap();
    let replied = admitted.elapsed();
    assert_eq!(reply.error.as_deref(), Some("turn timed out after 40s"));
    let got_slot = slot_at.lock().unwrap().expect("#late got a slot") - admitted;
    assert!(got_slot >= slot_wait, "{got_slot:?}");
    // From admission: not before 40 s, and before 40 s counted from the slot would end.
    assert!(replied >= timeout, "{replied:?}");
    assert!(
        replied < got_slot + timeout,
        "replied after {replied:?}, the slot came after {got_slot:?}"
    );
    println!("timeout from admission: slot after {got_slot:?}, reply after {replied:?}");
    until_idle(&addr).await;
    assert_no_leftovers(&env, &instance).await;
}
