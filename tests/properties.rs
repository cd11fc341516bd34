//! Bad input, by property: the reset-generation state machine of the actor layer against
//! a model of the 0.7.18 semantics (random sequences of resets, successful and failed
//! turns, resets requested during a turn, actor panics), and channel keys that look like
//! paths, are huge or are unusual unicode (pure properties, then real turns).

#[path = "support/sandbox.rs"]
mod sandbox_support;

use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use proptest::prelude::*;
use roundtable_sandbox::driver::{BoxFuture, ContainerDriver, ContainerSpec, DriverError};
use roundtable_sandbox::turn::channel_segment;
use roundtable_sandbox::{Reply, Sandbox, Speaker, Usage};
use roundtable_sandbox_actors::*;
use sandbox_support::*;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// A driver that hands each run to the test: the `reset` flag the turn carried, and a
/// sender for the outcome (true: a successful reply; false: a failed run).
#[derive(Debug)]
struct Gated {
    runs: mpsc::UnboundedSender<(bool, oneshot::Sender<bool>)>,
}

impl ContainerDriver for Gated {
    fn run<'a>(
        &'a self,
        _spec: &'a ContainerSpec,
        stdin: &'a [u8],
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Reply, DriverError>> {
        Box::pin(async move {
            let turn: serde_json::Value = serde_json::from_slice(stdin).unwrap();
            let (tx, rx) = oneshot::channel();
            self.runs
                .send((turn["reset"].as_bool().unwrap(), tx))
                .unwrap();
            tokio::select! {
                ok = rx => match ok {
                    Ok(true) => Ok(Reply::text("done", Usage::default())),
                    _ => Err(DriverError::Exit { code: 3 }),
                },
                _ = cancel.cancelled() => Err(DriverError::Cancelled),
            }
        })
    }

    fn remove<'a>(&'a self, _name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(async { Ok(()) })
    }

    fn sweep<'a>(&'a self, _instance: &'a str) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// StartFresh while the channel is idle.
    Fresh,
    /// A turn; `fresh_during` resets are requested while it runs; it succeeds if `ok`.
    Turn { ok: bool, fresh_during: u8 },
    /// The channel's actor panics while idle.
    Panic,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Fresh),
        6 => (any::<bool>(), 0u8..3).prop_map(|(ok, fresh_during)| Op::Turn { ok, fresh_during }),
        1 => Just(Op::Panic),
    ]
}

async fn pending(addr: &Addr<SandboxSupervisor>, channel: &str) -> u64 {
    let s = addr.send(Status).await.unwrap();
    s.channels
        .iter()
        .find(|c| c.channel == channel)
        .map_or(0, |c| c.pending_reset)
}

/// Runs `ops` on one channel (and a bystander channel that must never be affected) and
/// checks every step against the model: `g` is the pending generation (0: none).
async fn check_reset_model(ops: Vec<Op>) {
    let env = Env::new();
    let (tx, mut runs) = mpsc::unbounded_channel();
    let mut config = env.config();
    config.driver = Some(Arc::new(Gated { runs: tx }));
    let addr = SandboxSupervisor::start(SupervisorConfig::new(config))
        .await
        .unwrap();
    let speaker = Speaker {
        id: "u1".into(),
        name: "ann".into(),
    };
    let (ch, bystander) = ("#model", "#bystander");
    let mut g: u64 = 0;
    for op in ops {
        match op {
            Op::Fresh => {
                addr.send(StartFresh { channel: ch.into() }).await.unwrap();
                g += 1;
            }
            Op::Panic => {
                addr.send(InjectPanic { channel: ch.into() }).await.unwrap();
            }
            Op::Turn { ok, fresh_during } => {
                let answer = addr.send(GuestMessage::new(ch, speaker.clone(), "x"));
                let answer = actix_rt::spawn(answer);
                let (reset, outcome) = tokio::time::timeout(Duration::from_secs(10), runs.recv())
                    .await
                    .expect("the turn reached the driver")
                    .unwrap();
                // Snapshot at admission: reset iff a generation is pending.
                assert_eq!(reset, g > 0, "reset flag with g = {g}");
                let snapshot = g;
                for _ in 0..fresh_during {
                    addr.send(StartFresh { channel: ch.into() }).await.unwrap();
                    g += 1;
                }
                outcome.send(ok).unwrap();
                let reply = answer.await.unwrap().unwrap().unwrap();
                assert_eq!(reply.ok, ok, "{reply:?}");
                // A successful turn consumes only the generation it started with.
                if ok && snapshot > 0 && g == snapshot {
                    g = 0;
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
            g,
            "pending generation after the step"
        );
        assert_eq!(
            pending(&addr, bystander).await,
            0,
            "other channels untouched"
        );
    }
    // The model's last word: a pending reset reaches the next turn.
    let answer = actix_rt::spawn(addr.send(GuestMessage::new(ch, speaker.clone(), "x")));
    let (reset, outcome) = runs.recv().await.unwrap();
    assert_eq!(reset, g > 0);
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
        let reply = sandbox.run_turn(req).await;
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
    // One dir per distinct key, each named by its hash, nothing else in the root.
    let mut names: Vec<String> = std::fs::read_dir(&sandbox.config().workspace_root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut expected: Vec<String> = keys.iter().map(|k| channel_segment(k)).collect();
    expected.sort();
    assert_eq!(names, expected);
    assert_no_leftovers(&sandbox).await;
}
