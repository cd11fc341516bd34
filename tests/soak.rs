//! Soak: many turns across 50 channels through the actor layer and real containers, with
//! random stops, resets and channel-actor panics, warm turns on (the default: channels
//! prepare their next container, `warm.max` of them at once), then checks that nothing
//! leaked (idle, only the prepared containers and their run dirs are left; after shutdown
//! no labelled container, no run dir or socket; no file descriptor) and that the host's
//! memory stayed flat, and that no pending reset was lost.
//!
//! `ROUNDTABLE_SOAK_TURNS` sets the number of turns (default 1,000: about 2.5 minutes on a
//! 2-core machine; docs/security.md has the figures).
//! `ROUNDTABLE_SOAK_SEED` sets the random seed (default: fixed).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox_actors::testing::InjectPanic;
use roundtable_sandbox_actors::*;

/// The guest: `slow…` sleeps (to be stopped), anything else answers at once with whether
/// the turn asked for a fresh session.
const SCRIPT: &str = r#"t=$(cat); case "$t" in *'"text":"slow'*) sleep 60;; esac
case "$t" in *'"reset":true'*) r=fresh;; *) r=cont;; esac
printf '{"ok":true,"text":"%s"}' "$r""#;

const CHANNELS: usize = 50;

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn rss_kib() -> u64 {
    roundtable_sandbox_test_support::process::status_kib("VmRSS")
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn channel(i: u64) -> String {
    format!("#soak-{i}")
}

async fn until_idle(addr: &Addr<SandboxSupervisor>) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let s = addr.send(Status).await.unwrap();
        if s.totals.busy_channels == 0 && s.totals.queued == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "never idle: {:?}", s.totals);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until no preparation is in flight (every prepared container waits in its
/// channel's slot), and returns how many wait.
async fn settled_prepared(addr: &Addr<SandboxSupervisor>) -> usize {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = addr.send(Status).await.unwrap();
        let waiting = s.channels.iter().filter(|c| c.prepared).count();
        if waiting == s.totals.prepared {
            return waiting;
        }
        assert!(
            Instant::now() < deadline,
            "preparations never settled: {:?}",
            s.totals
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[derive(Default, Debug)]
struct Tally {
    ok: AtomicUsize,
    stopped: AtomicUsize,
    busy: AtomicUsize,
    restarted: AtomicUsize,
    other_errors: AtomicUsize,
}

#[actix_rt::test]
async fn soak_turns_across_channels_with_stops_resets_and_panics() {
    let turns: usize = std::env::var("ROUNDTABLE_SOAK_TURNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let seed: u64 = std::env::var("ROUNDTABLE_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234_abcd_0001);
    let env = Env::new();
    let mut config = env.sh_config(SCRIPT);
    // The deadline counts from admission, and a message may wait behind its channel's
    // queue and for one of the 4 slots: on a busy machine (other builds beside it, 3 to 6 s
    // a turn) the default 30 s is within reach, and a timed-out turn is an unexpected answer
    // here. The slow turns are stopped, not timed out.
    config.turn_timeout = Some(Duration::from_secs(180));
    // The leftover check needs the instance and run root only: one runtime per root.
    let resolved = config.resolve().unwrap();
    let mut settings = SupervisorOptions::new(config);
    settings.max_containers = 4;
    let addr = SandboxSupervisor::start(settings).await.unwrap();
    let mut rng = Rng(seed);
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    // RSS, open descriptors, and prepared containers then (each holds two engine streams).
    let mut baseline: Option<(u64, usize, usize)> = None;
    let mut in_flight: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    let (mut stops, mut resets, mut panics) = (0usize, 0usize, 0usize);

    for n in 0..turns {
        if n == 50 {
            // Warmed up (connections pooled, actors spawned): the reference point.
            for h in in_flight.drain(..) {
                h.await.unwrap();
            }
            // One panic first: with RUST_BACKTRACE set, the first panic's backtrace loads
            // this debug binary's symbols once (~190 MiB, cached for the process), which is
            // not a leak; the growth that counts is what comes after.
            addr.send(InjectPanic {
                channel: channel(0),
            })
            .await
            .unwrap();
            until_idle(&addr).await;
            let prepared = settled_prepared(&addr).await;
            baseline = Some((rss_kib(), open_fds(), prepared));
        }
        let ch = channel(rng.below(CHANNELS as u64));
        let roll = rng.below(100);
        if roll < 10 {
            addr.send(StartFresh {
                channel: ch.clone(),
            })
            .await
            .unwrap();
            resets += 1;
        } else if roll == 10 {
            addr.send(InjectPanic {
                channel: ch.clone(),
            })
            .await
            .unwrap();
            panics += 1;
        }
        let slow = rng.below(100) < 8;
        if slow {
            stops += 1;
        }
        let text = if slow { "slow" } else { "hello" };
        let answer = addr.send(GuestMessage::new(
            ch.clone(),
            roundtable_sandbox::Speaker {
                id: "u1".into(),
                name: "ann".into(),
            },
            text,
        ));
        let tally = tally.clone();
        let stopper = addr.clone();
        in_flight.push(actix_rt::spawn(async move {
            let stopping = async {
                if slow {
                    // Stop it as soon as it runs (it may first wait behind others).
                    loop {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        let _ = stopper
                            .send(Stop {
                                channel: ch.clone(),
                            })
                            .await;
                    }
                }
                std::future::pending::<()>().await
            };
            let reply = tokio::select! {
                r = tokio::time::timeout(Duration::from_secs(300), answer) => r,
                _ = stopping => unreachable!(),
            };
            let reply = reply.expect("a turn hung").expect("the supervisor answers");
            let counter = match &reply {
                Ok(r) if r.ok => &tally.ok,
                Ok(r) if r.error.as_deref() == Some("turn stopped") => &tally.stopped,
                Err(SandboxActorError::Busy { .. }) => &tally.busy,
                Err(SandboxActorError::ChannelRestarted) => &tally.restarted,
                other => {
                    eprintln!("soak: unexpected answer {other:?}");
                    &tally.other_errors
                }
            };
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        // Keep a bounded number of messages outstanding.
        if in_flight.len() >= 16 {
            in_flight.remove(0).await.unwrap();
        }
    }
    for h in in_flight.drain(..) {
        h.await.unwrap();
    }
    until_idle(&addr).await;
    let elapsed = started.elapsed();

    // A few resets left pending, two of them across an actor panic.
    for i in 0..5 {
        addr.send(StartFresh {
            channel: channel(i),
        })
        .await
        .unwrap();
    }
    for i in 0..2 {
        addr.send(InjectPanic {
            channel: channel(i),
        })
        .await
        .unwrap();
    }

    // No pending reset was lost: each channel with one starts its next turn fresh, and
    // that turn consumes it.
    let status = addr.send(Status).await.unwrap();
    let pending: BTreeMap<String, u64> = status
        .channels
        .iter()
        .map(|c| (c.channel.clone(), c.pending_reset))
        .collect();
    let speaker = roundtable_sandbox::Speaker {
        id: "u1".into(),
        name: "ann".into(),
    };
    let mut checked = 0;
    for i in 0..CHANNELS as u64 {
        let ch = channel(i);
        let expected = if pending.get(&ch).copied().unwrap_or(0) > 0 {
            "fresh"
        } else {
            "cont"
        };
        let reply = addr
            .send(GuestMessage::new(ch.clone(), speaker.clone(), "check"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(reply.text.as_deref(), Some(expected), "{ch}: {reply:?}");
        if i < 5 {
            assert_eq!(
                expected, "fresh",
                "{ch}: the reset requested last is pending"
            );
        }
        if expected == "fresh" {
            checked += 1;
            let again = addr
                .send(GuestMessage::new(ch.clone(), speaker.clone(), "check"))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(again.text.as_deref(), Some("cont"), "{ch}: consumed once");
        }
    }
    until_idle(&addr).await;

    // Nothing leaked (idle: only the prepared containers wait, each with its run dir),
    // memory stayed flat.
    let prepared = settled_prepared(&addr).await;
    let containers = labelled_containers_of(&resolved.instance).await;
    assert_eq!(
        containers.len(),
        prepared,
        "leaked containers: {containers:?}"
    );
    let entries = run_root_entries(&resolved.run_root);
    assert_eq!(
        entries.len(),
        prepared,
        "leaked run dir entries: {entries:?}"
    );
    let (rss0, fds0, prepared0) = baseline.unwrap_or((rss_kib(), open_fds(), prepared));
    let (rss1, fds1) = (rss_kib(), open_fds());
    let more_prepared = prepared.saturating_sub(prepared0);
    let report = format!(
        "soak: {turns} turns across {CHANNELS} channels in {:.1}s ({:.0} ms/turn); \
         {resets} resets, {stops} stops, {panics} actor panics; answers {tally:?}; \
         {checked} pending resets verified; RSS {rss0} -> {rss1} KiB; fds {fds0} -> {fds1}; \
         prepared containers {prepared0} -> {prepared}",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1000.0 / turns as f64
    );
    eprintln!("{report}");
    assert_eq!(tally.other_errors.load(Ordering::SeqCst), 0, "{report}");
    assert!(
        fds1 <= fds0 + 4 + 2 * more_prepared,
        "file descriptors leaked: {report}"
    );
    assert!(rss1 <= rss0 + 32 * 1024, "memory grew: {report}");
    let shutdown = addr.send(Shutdown).await.unwrap();
    assert_eq!(shutdown.stopped_turns, 0);
    assert_no_leftovers_in(&resolved.instance, &resolved.run_root).await;
}
