//! Bad input, by property: the reset-generation state machine of the actor layer against
//! a model of the 0.7.18 semantics in message order (random sequences of resets,
//! successful and failed turns, resets requested during a turn, bursts of messages and
//! resets sent without awaiting, also behind a running turn, actor panics), and channel
//! keys that look like paths, are huge or are unusual unicode (pure properties, then real
//! turns).

use std::time::Duration;

use actix::Addr;
use proptest::prelude::*;
use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::internals::turn::channel_segment;
use roundtable_sandbox::{Sandbox, Speaker};
use roundtable_sandbox_actors::testing::InjectPanic;
use roundtable_sandbox_actors::*;

#[derive(Debug, Clone)]
enum Op {
    /// StartFresh while the channel is idle.
    Fresh,
    /// A turn; `fresh_during` resets are requested while it runs; it succeeds if `ok`.
    Turn { ok: bool, fresh_during: u8 },
    /// The channel's actor panics while idle.
    Panic,
    /// Messages (`Some(ok)`) and resets (`None`) sent one after the other without awaiting
    /// anything; if `behind`, while a first message's turn runs.
    Burst {
        items: Vec<Option<bool>>,
        behind: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Fresh),
        6 => (any::<bool>(), 0u8..3).prop_map(|(ok, fresh_during)| Op::Turn { ok, fresh_during }),
        1 => Just(Op::Panic),
        3 => (
            proptest::collection::vec(proptest::option::weighted(0.6, any::<bool>()), 1..6),
            any::<bool>()
        )
            .prop_map(|(items, behind)| Op::Burst { items, behind }),
    ]
}

/// The 0.7.18 reset semantics in message order, written as positions in the channel's
/// sequence of messages and resets: a message resets iff a reset before it is still
/// pending; its successful turn consumes exactly the pending resets before it.
#[derive(Debug, Default)]
struct Model {
    /// Position of the next message or reset.
    clock: u64,
    /// Positions of the resets not consumed yet.
    pending: Vec<u64>,
    /// Resets requested since none was pending (the reported generation).
    generation: u64,
}

impl Model {
    fn fresh(&mut self) {
        if self.pending.is_empty() {
            self.generation = 0;
        }
        self.pending.push(self.clock);
        self.generation += 1;
        self.clock += 1;
    }

    /// A message arrives; returns its position.
    fn message(&mut self) -> u64 {
        self.clock += 1;
        self.clock - 1
    }

    /// The reset flag of the message at `at`, when it is admitted.
    fn resets(&self, at: u64) -> bool {
        self.pending.iter().any(|&r| r < at)
    }

    fn finished(&mut self, at: u64, ok: bool) {
        if ok {
            self.pending.retain(|&r| r > at);
        }
    }

    fn reported(&self) -> u64 {
        if self.pending.is_empty() {
            0
        } else {
            self.generation
        }
    }
}

async fn pending(addr: &Addr<SandboxSupervisor>, channel: &str) -> u64 {
    let s = addr.send(Status).await.unwrap();
    s.channels
        .iter()
        .find(|c| c.channel == channel)
        .map_or(0, |c| c.pending_reset)
}

/// Runs `ops` on one channel (and a bystander channel that must never be affected) and
/// checks every step against the [`Model`].
async fn check_reset_model(ops: Vec<Op>) {
    let env = Env::new();
    // The fake driver hands each run to the test: its text, its reset flag, and the sender
    // of its verdict (true: a successful reply; false: a failed run).
    let (driver, mut runs) = FakeDriver::handing_runs();
    let mut config = env.config();
    config.driver = Some(driver);
    let addr = SandboxSupervisor::start(SupervisorOptions::new(config))
        .await
        .unwrap();
    let speaker = Speaker {
        id: "u1".into(),
        name: "ann".into(),
    };
    let (ch, bystander) = ("#model", "#bystander");
    let mut model = Model::default();
    let mut texts = 0u64;
    let mut next_text = || {
        texts += 1;
        format!("m{texts}")
    };
    // Sends `text` to the modelled channel; the task gives the supervisor's answer.
    let send =
        |text: &str| actix_rt::spawn(addr.send(GuestMessage::new(ch, speaker.clone(), text)));
    for op in ops {
        match op {
            Op::Fresh => {
                addr.send(StartFresh { channel: ch.into() }).await.unwrap();
                model.fresh();
            }
            Op::Panic => {
                addr.send(InjectPanic { channel: ch.into() }).await.unwrap();
            }
            Op::Turn { ok, fresh_during } => {
                let text = next_text();
                let at = model.message();
                let answer = send(&text);
                let HandedRun {
                    text: ran,
                    reset,
                    verdict: outcome,
                } = tokio::time::timeout(Duration::from_secs(10), runs.recv())
                    .await
                    .expect("the turn reached the driver")
                    .unwrap();
                assert_eq!(ran, text);
                assert_eq!(reset, model.resets(at), "reset flag of {text}: {model:?}");
                for _ in 0..fresh_during {
                    addr.send(StartFresh { channel: ch.into() }).await.unwrap();
                    model.fresh();
                }
                outcome.send(ok).unwrap();
                let reply = answer.await.unwrap().unwrap().unwrap();
                assert_eq!(reply.ok, ok, "{reply:?}");
                // A successful turn consumes only the resets that arrived before it.
                model.finished(at, ok);
            }
            Op::Burst { items, behind } => {
                // (text, position, outcome, answer) of each message, in sending order.
                let mut sent = Vec::new();
                let mut first_run = None;
                if behind {
                    let text = next_text();
                    let at = model.message();
                    let answer = send(&text);
                    let run = tokio::time::timeout(Duration::from_secs(10), runs.recv())
                        .await
                        .expect("the first turn reached the driver")
                        .unwrap();
                    first_run = Some(run);
                    sent.push((text, at, true, answer));
                }
                // No await from here until every item is sent.
                for item in &items {
                    match item {
                        None => {
                            addr.do_send(StartFresh { channel: ch.into() });
                            model.fresh();
                        }
                        Some(ok) => {
                            let text = next_text();
                            let at = model.message();
                            let answer = send(&text);
                            sent.push((text, at, *ok, answer));
                        }
                    }
                }
                for (text, at, ok, answer) in sent {
                    let HandedRun {
                        text: ran,
                        reset,
                        verdict: outcome,
                    } = match first_run.take() {
                        Some(run) => run,
                        None => tokio::time::timeout(Duration::from_secs(10), runs.recv())
                            .await
                            .expect("the turn reached the driver")
                            .unwrap(),
                    };
                    assert_eq!(ran, text, "turns run in message order");
                    assert_eq!(reset, model.resets(at), "reset flag of {text}: {model:?}");
                    outcome.send(ok).unwrap();
                    let reply = answer.await.unwrap().unwrap().unwrap();
                    assert_eq!(reply.ok, ok, "{reply:?}");
                    model.finished(at, ok);
                }
            }
        }
        // Wait for the channel to settle (the reply is sent before teardown ends); a busy
        // machine may take longer than the 1 s this once waited before checking anyway.
        let deadline = std::time::Instant::now() + PROMPTLY;
        loop {
            let s = addr.send(Status).await.unwrap();
            if s.totals.busy_channels == 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never settled: {:?}",
                s.totals
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            pending(&addr, ch).await,
            model.reported(),
            "pending generation after the step: {model:?}"
        );
        assert_eq!(
            pending(&addr, bystander).await,
            0,
            "other channels untouched"
        );
    }
    // The model's last word: a pending reset reaches the next turn.
    let at = model.message();
    let answer = send("last");
    let HandedRun {
        reset,
        verdict: outcome,
        ..
    } = runs.recv().await.unwrap();
    assert_eq!(reset, model.resets(at));
    outcome.send(true).unwrap();
    assert!(answer.await.unwrap().unwrap().unwrap().ok);
    addr.send(Shutdown).await.unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn reset_generation_follows_the_0_7_18_model(ops in proptest::collection::vec(op(), 1..12)) {
        actix_rt::System::new().block_on(check_reset_model(ops));
    }

    #[test]
    fn any_channel_key_maps_to_one_private_segment(key in any::<String>(), other in any::<String>()) {
        let seg = channel_segment(&key);
        prop_assert_eq!(seg.len(), 64);
        prop_assert!(seg.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        let root = std::path::Path::new("/srv/ws");
        let dir = root.join(&seg);
        prop_assert_eq!(dir.parent(), Some(root));
        prop_assert_eq!(channel_segment(&key), seg.clone());
        if key != other {
            prop_assert_ne!(channel_segment(&other), seg);
        }
    }

    #[test]
    fn path_like_channel_keys_stay_inside(parts in proptest::collection::vec(
        prop_oneof![
            Just("..".to_owned()),
            Just(".".to_owned()),
            Just("/".to_owned()),
            Just("\0".to_owned()),
            Just("%2e%2e".to_owned()),
            Just("\\".to_owned()),
            Just("~".to_owned()),
            "[a-z]{0,3}",
        ],
        0..20,
    )) {
        let key: String = parts.concat();
        let seg = channel_segment(&key);
        let dir = std::path::Path::new("/srv/ws").join(&seg);
        prop_assert!(dir.starts_with("/srv/ws"));
        prop_assert_eq!(dir.components().count(), 4);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn odd_channel_keys_get_private_workspaces_in_real_turns() {
    let env = Env::new();
    let sandbox = Sandbox::new(env.sh_config(
        r#"cat >/dev/null; echo mine > /workspace/note; n=$(ls -A /workspace | wc -l); printf '{"ok":true,"text":"%s"}' "$n""#,
    ))
    .await
    .unwrap();
    let huge = "k".repeat(1 << 20);
    let keys: Vec<&str> = vec![
        "../../etc",
        "/",
        "",
        ".",
        "..",
        "a/../../b",
        "\0nul",
        "%2e%2e%2f",
        "C:\\Windows\\..",
        "\u{202e}gnp.exe",
        "a\u{200b}b",
        "\u{1f980}\u{1f469}\u{200d}\u{1f469}\u{200d}\u{1f467}",
        "line\nbreak\r\n",
        "\u{ffff}\u{fffe}",
        &huge,
    ];
    for key in &keys {
        let mut req = request(key, "x");
        req.speaker.name = (*key).chars().take(100).collect();
        let reply = sandbox.run_turn(req).await.reply;
        assert_eq!(
            reply.text.as_deref(),
            Some("1"),
            "{:?}: {reply:?}",
            &key[..key.len().min(40)]
        );
        let ws = env.workspace_of(key);
        assert!(ws.join("note").is_file());
        assert_eq!(ws.parent(), Some(sandbox.config().workspace_root.as_path()));
    }
    // One dir per distinct key, each named by its hash, nothing else in the root but the
    // runtime's lock file.
    let mut names = run_root_entries(&sandbox.config().workspace_root);
    names.sort();
    let mut expected: Vec<String> = keys.iter().map(|k| channel_segment(k)).collect();
    expected.sort();
    assert_eq!(names, expected);
    assert_no_leftovers(&sandbox).await;
}
