//! Usage accounting and budgets (issue 23, items 1-3) with the real parts: the broker over
//! its real socket with a scripted upstream that reports `usage` (or not), the SQLite state
//! file (restart, a crash by `kill -9` mid-write, a corrupt file, a locked one), and real
//! turns of the real guest in real containers refused past a budget, before the container
//! and mid-turn, across a restart of the runtime. Runs as the non-root service user.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roundtable_sandbox::internals::budgets::{
    Budget, BudgetBook, BudgetSettings, BudgetStore, CounterKey, SqliteStore, StoreError,
    TurnAccount,
};
use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::internals::turn::channel_segment;
use roundtable_sandbox::{ApiKey, Config, Sandbox, Speaker, TurnFailure};
use roundtable_sandbox_test_support::broker_client::{self as client, post_json};
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use serde_json::json;

const KEY: &str = "sk-budgets-test-7f3a";
const CHAT: &str = "/v1/chat/completions";

fn ann() -> Speaker {
    Speaker {
        id: "u1".into(),
        name: "ann".into(),
    }
}

/// A streamed text chunk as OpenAI sends it with `include_usage` (`"usage":null`).
fn text_event(part: &str) -> String {
    let chunk = json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "scripted",
        "choices": [{"index": 0, "delta": {"content": part}, "finish_reason": null}],
        "usage": null
    });
    format!("data: {chunk}\n\n")
}

/// The usage-only chunk: `choices` empty.
fn usage_event(prompt: u64, completion: u64) -> String {
    let chunk = json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "scripted",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion}
    });
    format!("data: {chunk}\n\n")
}

/// A whole completion answering `content`, with this usage (none: `None`).
fn completion(message: serde_json::Value, usage: Option<(u64, u64)>) -> Step {
    let mut body = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    });
    if let Some((p, c)) = usage {
        body["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    }
    Step::Json(body)
}

fn text_with_usage(content: &str, usage: Option<(u64, u64)>) -> Step {
    completion(json!({"role": "assistant", "content": content}), usage)
}

async fn stream_call(socket: &Path, body: serde_json::Value) -> Vec<u8> {
    let (status, _, mut incoming) = client::post_stream(socket, CHAT, &body).await;
    assert_eq!(status, 200);
    client::read_rest(&mut incoming).await
}

#[tokio::test]
async fn a_stream_without_include_usage_gets_the_upstreams_chunks_minus_the_usage_chunk() {
    let events = [
        text_event("Hello"),
        text_event(", world"),
        usage_event(11, 7),
        "data: [DONE]\n\n".to_owned(),
    ];
    // The usage chunk split across two upstream chunks, the rest as they come.
    let (a, b) = events[2].split_at(40);
    let chunks = vec![
        events[0].clone(),
        events[1].clone() + a,
        b.to_owned(),
        events[3].clone(),
    ];
    let model = ScriptedModel::start(vec![
        Step::Stream {
            chunks: chunks.clone(),
            delay: Duration::ZERO,
        },
        Step::Stream {
            chunks,
            delay: Duration::ZERO,
        },
    ])
    .await;
    let broker = start_broker(broker_policy(&model.url(), KEY)).await;

    // Not asked for: the guest gets every byte but the usage-only chunk's.
    let account = Arc::new(TurnAccount::new("u1", "c", None));
    let turn = BrokerTurn::start_counted(&broker, "chan", ann(), Some(account.clone())).await;
    let got = stream_call(
        turn.socket(),
        json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}),
    )
    .await;
    let expected = [events[0].clone(), events[1].clone(), events[3].clone()].concat();
    assert_eq!(String::from_utf8(got).unwrap(), expected);
    let sent = model.requests()[0].json();
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));
    let usage = account.usage();
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.model_calls,
            usage.estimated
        ),
        (11, 7, 1, false)
    );
    drop(turn);

    // Asked for (other members kept): the guest gets the upstream's stream byte for byte.
    let account = Arc::new(TurnAccount::new("u1", "c", None));
    let turn = BrokerTurn::start_counted(&broker, "chan", ann(), Some(account.clone())).await;
    let got = stream_call(
        turn.socket(),
        json!({"messages": [{"role": "user", "content": "hi"}], "stream": true,
               "stream_options": {"include_usage": true, "x_other": 1}}),
    )
    .await;
    assert_eq!(String::from_utf8(got).unwrap(), events.concat());
    assert_eq!(
        model.requests()[1].json()["stream_options"],
        json!({"include_usage": true, "x_other": 1})
    );
    assert_eq!(account.usage().tokens(), 18);
}

#[tokio::test]
async fn usage_is_read_from_whole_answers_and_estimated_when_absent() {
    let model = ScriptedModel::start(vec![
        text_with_usage("counted", Some((120, 30))),
        text_with_usage("uncounted", None),
        Step::stream_text(&["no", "usage"], Duration::ZERO),
    ])
    .await;
    let broker = start_broker(broker_policy(&model.url(), KEY)).await;
    let account = Arc::new(TurnAccount::new("u1", "c", None));
    let turn = BrokerTurn::start_counted(&broker, "chan", ann(), Some(account.clone())).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let a = post_json(turn.socket(), CHAT, &body).await;
    assert_eq!(a.status, 200);
    let u = account.usage();
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens, u.estimated),
        (120, 30, false)
    );

    let a = post_json(turn.socket(), CHAT, &body).await;
    assert_eq!(a.status, 200);
    let u = account.usage();
    let sent = model.requests()[1].body.len() as u64;
    assert!(u.estimated, "{u:?}");
    assert_eq!(u.prompt_tokens, 120 + sent.div_ceil(4));
    assert_eq!(u.completion_tokens, 30 + (a.body.len() as u64).div_ceil(4));

    let streamed = stream_call(
        turn.socket(),
        json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}),
    )
    .await;
    let u2 = account.usage();
    assert_eq!(
        u2.completion_tokens,
        u.completion_tokens + (streamed.len() as u64).div_ceil(4)
    );
    assert_eq!(u2.model_calls, 3);
}

fn book(dir: &Path, settings: BudgetSettings) -> Arc<BudgetBook> {
    let mut settings = settings;
    settings.state_file = Some(dir.join("state.sqlite"));
    BudgetBook::open(&settings, "UTC").unwrap().unwrap()
}

#[tokio::test]
async fn concurrent_turns_of_one_speaker_pass_the_budget_by_at_most_one_call() {
    // Three turns of one speaker in three channels call at once, each call 80 tokens, the
    // budget 100. The first call to be checked holds its worst case (its prompt's estimate
    // and the clamped completion, 16,384), so the other two are refused before they go
    // upstream; once its answer settles it at 80, the next call passes (80 < 100) and the
    // one after is refused: the budget is passed by at most one call.
    let slow = || {
        Step::Delayed(
            Duration::from_millis(400),
            Box::new(text_with_usage("x", Some((50, 30)))),
        )
    };
    let model = ScriptedModel::start(vec![slow(), slow()]).await;
    let broker = start_broker(broker_policy(&model.url(), KEY)).await;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let book = book(
        dir.path(),
        BudgetSettings {
            speaker_tokens_per_day: Some(100),
            ..Default::default()
        },
    );
    let mut turns = Vec::new();
    for ch in ["#a", "#b", "#c"] {
        let account = Arc::new(TurnAccount::new(
            "u1",
            &channel_segment(ch),
            Some(book.clone()),
        ));
        turns.push(BrokerTurn::start_counted(&broker, ch, ann(), Some(account)).await);
    }
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let calls: Vec<_> = turns
        .iter()
        .map(|t| post_json(t.socket(), CHAT, &body))
        .collect();
    let mut statuses: Vec<u16> = futures_util::future::join_all(calls)
        .await
        .iter()
        .map(|a| a.status)
        .collect();
    statuses.sort();
    assert_eq!(statuses, [200, 429, 429]);
    assert_eq!(
        model.requests().len(),
        1,
        "a refused call reached the upstream"
    );
    assert_eq!(book.tokens(&CounterKey::Speaker("u1".into())), 80);
    // Room is left (80 < 100): one more call passes, then the budget is spent.
    assert_eq!(post_json(turns[1].socket(), CHAT, &body).await.status, 200);
    let used = book.tokens(&CounterKey::Speaker("u1".into()));
    assert_eq!(used, 160);
    assert!(used <= 100 + 80, "passed by more than one call");
    for t in &turns {
        let a = post_json(t.socket(), CHAT, &body).await;
        assert_eq!(a.status, 429);
        assert_eq!(
            a.error(),
            "budget speaker_tokens_per_day exceeded: this speaker has used today's 100 tokens; the budget resets at 00:00 UTC"
        );
    }
    assert_eq!(
        model.requests().len(),
        2,
        "a refused call reached the upstream"
    );
}

#[tokio::test]
async fn dropped_calls_are_charged_at_their_worst_case() {
    // The review's attack (issue 43 item 3): a guest sends 200 KB prompts and drops each
    // call after a second, before the (slow) upstream answers, 28 times. Charged only when
    // an answer was read, 1,528 tokens were charged for ~1.3 M sent. Now the first call holds
    // its worst case and keeps it when dropped: every later call is refused before it goes
    // upstream, and so is the speaker's next turn.
    let model = ScriptedModel::start(vec![Step::Hang; 28]).await;
    let broker = start_broker(broker_policy(&model.url(), KEY)).await;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let book = book(
        dir.path(),
        BudgetSettings {
            speaker_tokens_per_day: Some(1000),
            ..Default::default()
        },
    );
    let account = Arc::new(TurnAccount::new(
        "mallory",
        &channel_segment("#a"),
        Some(book.clone()),
    ));
    let turn = BrokerTurn::start_counted(&broker, "#a", ann(), Some(account.clone())).await;
    let prompt = "p".repeat(200_000);
    let body = json!({"messages": [{"role": "user", "content": prompt}]});
    let mut refused = 0;
    for _ in 0..28 {
        let call = post_json(turn.socket(), CHAT, &body);
        match tokio::time::timeout(Duration::from_secs(1), call).await {
            // Dropped by the guest before the answer.
            Err(_) => {}
            Ok(a) => {
                assert_eq!(a.status, 429, "{}", a.text());
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 27);
    // The dropped calls' futures end on the broker's side; then one call was charged at its
    // worst: its prompt's estimate (200 KB / 4) and the clamped completion (16,384).
    let deadline = Instant::now() + Duration::from_secs(10);
    let worst = 200_000 / 4 + 16_384;
    while book.tokens(&CounterKey::Speaker("mallory".into())) < worst {
        assert!(
            Instant::now() < deadline,
            "the dropped call was not charged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let used = book.tokens(&CounterKey::Speaker("mallory".into()));
    assert!((worst..worst + 100).contains(&used), "charged {used}");
    assert!(account.usage().estimated);
    // It reached the upstream: the turn's usage counts it (it counted only answered calls).
    assert_eq!(account.usage().model_calls, 1);
    assert_eq!(
        model.requests().len(),
        1,
        "a refused call reached the upstream"
    );
    // The speaker's next turn is refused at admission.
    assert!(book.admit("mallory", &channel_segment("#b")).is_err());
}

/// A broker of `policy` and a turn of mallory's in `#a`, counted in a budget book of its
/// own (in the temp dir returned first).
async fn mallorys_turn(
    policy: roundtable_sandbox::internals::broker::BrokerPolicy,
) -> (
    tempfile::TempDir,
    Arc<BudgetBook>,
    Arc<TurnAccount>,
    BrokerTurn,
) {
    let broker = start_broker(policy).await;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let book = book(dir.path(), BudgetSettings::default());
    let account = Arc::new(TurnAccount::new(
        "mallory",
        &channel_segment("#a"),
        Some(book.clone()),
    ));
    let turn = BrokerTurn::start_counted(&broker, "#a", ann(), Some(account.clone())).await;
    (dir, book, account, turn)
}

/// A stream whose first event is `first`, on a broker whose calls go quiet after
/// `call_timeout`: the guest reads that event, then drops the stream (`drop_it`) or reads
/// on to the broker's error; asserts the speaker is charged the call's worst case
/// (4000 / 4 + 4000), waiting up to 3 s for it.
async fn assert_worst_case_for_a_cut_stream(first: String, call_timeout: Duration, drop_it: bool) {
    let gate = Arc::new(tokio::sync::Notify::new());
    let events = roundtable_sandbox_test_support::model::sse_text_events(&["one", "two"]);
    let model = ScriptedModel::start(vec![Step::Gated {
        first: vec![first.clone()],
        gate: gate.clone(),
        rest: events[1..].to_vec(),
    }])
    .await;
    let mut policy = broker_policy(&model.url(), KEY);
    policy.limits.call_timeout = call_timeout;
    let (_dir, book, account, turn) = mallorys_turn(policy).await;
    let body = json!({"messages": [{"role": "user", "content": "p".repeat(4000)}],
                      "stream": true, "max_tokens": 4000,
                      "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let (status, _, mut incoming) = client::post_stream(turn.socket(), CHAT, &body).await;
    assert_eq!(status, 200);
    let got = client::next_chunk(&mut incoming).await.unwrap();
    assert_eq!(got, first.as_bytes());
    if drop_it {
        drop(incoming);
    } else {
        let rest = client::next_chunk(&mut incoming).await.unwrap();
        let rest = String::from_utf8_lossy(&rest);
        assert!(rest.contains("model stream timed out"), "{rest}");
    }
    let worst = 4000 / 4 + 4000;
    let deadline = Instant::now() + Duration::from_secs(3);
    while book.tokens(&CounterKey::Speaker("mallory".into())) < worst && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(account.usage().model_calls, 1);
    let used = book.tokens(&CounterKey::Speaker("mallory".into()));
    assert!((worst..worst + 100).contains(&used), "charged {used}");
}

#[tokio::test]
async fn a_stream_dropped_before_its_end_is_charged_at_its_worst_case() {
    // The upstream sends one chunk of a long answer (max_tokens 4,000) and works on; the
    // guest reads that chunk and goes. Settled at what was read (~20 tokens), the tokens
    // the upstream made meanwhile were never charged: the worst case held stays.
    let first = roundtable_sandbox_test_support::model::sse_text_events(&["one"]).remove(0);
    assert_worst_case_for_a_cut_stream(first, Duration::from_secs(60), true).await;
}

#[tokio::test]
async fn an_answer_whose_usage_leaves_out_its_completion_is_charged_the_estimate_of_it() {
    // 40 KB of answer with `usage: {"prompt_tokens": 7}`: charged 7 and the answer's
    // estimate (40,000 / 4), not 7 and nothing.
    let answer = json!({"choices": [{"index": 0, "message": {"role": "assistant",
                        "content": "y".repeat(40_000)}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 7}});
    let model = ScriptedModel::start(vec![Step::Json(answer)]).await;
    let (_dir, book, _, turn) = mallorys_turn(broker_policy(&model.url(), KEY)).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let a = client::post_json(turn.socket(), CHAT, &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let used = book.tokens(&CounterKey::Speaker("mallory".into()));
    assert!((10_007..10_100).contains(&used), "charged {used}");
}

#[tokio::test]
async fn a_running_usage_count_does_not_settle_a_dropped_stream() {
    // `continuous_usage_stats` (vLLM, SGLang): a running count in every chunk. The first
    // one's (5 + 1) is not what the call cost once the guest has gone.
    let chunk = json!({"choices": [{"index": 0, "delta": {"content": "one"}}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1}});
    assert_worst_case_for_a_cut_stream(format!("data: {chunk}\n\n"), Duration::from_secs(60), true)
        .await;
}

#[tokio::test]
async fn a_stream_quiet_past_its_deadline_is_charged_at_its_worst_case() {
    // The upstream goes quiet after its first chunk (a model thinking); the broker ends the
    // stream at the call's deadline. The upstream may have worked on: the worst case, as
    // for a whole answer past its deadline.
    let first = roundtable_sandbox_test_support::model::sse_text_events(&["one"]).remove(0);
    assert_worst_case_for_a_cut_stream(first, Duration::from_secs(1), false).await;
}

#[test]
fn the_counters_survive_a_restart() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let settings = BudgetSettings {
        bot_tokens_per_day: Some(1000),
        speaker_turns_per_minute: Some(2),
        ..Default::default()
    };
    let first = book(dir.path(), settings.clone());
    first.charge("u1", "chan", 600);
    first.admit("u1", "chan").unwrap();
    first.admit("u1", "chan").unwrap();
    drop(first);
    let second = book(dir.path(), settings);
    assert_eq!(second.tokens(&CounterKey::Bot), 600);
    assert_eq!(second.tokens(&CounterKey::Speaker("u1".into())), 600);
    assert_eq!(second.tokens(&CounterKey::Channel("chan".into())), 600);
    let refused = second.admit("u1", "chan").unwrap_err();
    assert_eq!(refused.budget, Budget::SpeakerTurnsPerMinute);
}

#[test]
fn a_corrupt_state_file_is_a_clear_error_and_left_as_it_is() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let path = dir.path().join("state.sqlite");
    let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    std::fs::write(&path, &garbage).unwrap();
    let e = SqliteStore::open(&path).unwrap_err();
    assert!(matches!(e, StoreError::Corrupt { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "budget state file {} is not a usable SQLite database (left as it is; move it aside to start with empty counters): file is not a database",
            path.display()
        )
    );
    assert_eq!(std::fs::read(&path).unwrap(), garbage);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("state.sqlite")]);

    // A real database whose pages were overwritten: damaged, refused, not reset.
    let damaged = dir.path().join("damaged.sqlite");
    {
        let mut s = SqliteStore::open(&damaged).unwrap();
        for i in 0..2000 {
            s.add_tokens(
                "2026-01-01",
                &[(CounterKey::Speaker(format!("speaker-{i}")), 1)],
            )
            .unwrap();
        }
    }
    let mut bytes = std::fs::read(&damaged).unwrap();
    assert!(bytes.len() > 3 * 4096, "{}", bytes.len());
    for b in &mut bytes[4096..3 * 4096] {
        *b = 0x5a;
    }
    std::fs::write(&damaged, &bytes).unwrap();
    let e = SqliteStore::open(&damaged).unwrap_err();
    assert!(matches!(e, StoreError::Corrupt { .. }), "{e:?}");
    assert!(e.to_string().contains(&damaged.display().to_string()));
    assert_eq!(std::fs::read(&damaged).unwrap(), bytes);
}

#[test]
fn a_locked_state_file_is_a_clear_error() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let path = dir.path().join("state.sqlite");
    drop(SqliteStore::open(&path).unwrap());
    // Another process's writer, mid-transaction.
    let other = rusqlite::Connection::open(&path).unwrap();
    other
        .execute_batch("BEGIN EXCLUSIVE; INSERT INTO turns VALUES ('x', 1);")
        .unwrap();
    let e = SqliteStore::open(&path).unwrap_err();
    assert!(matches!(e, StoreError::Locked { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "budget state file {} is locked by another process (one writer at a time; is another bot running on it?): database is locked",
            path.display()
        )
    );
    other.execute_batch("ROLLBACK").unwrap();
    drop(other);
    // One runtime per state file: a second store on it while the first is open is refused.
    let first = SqliteStore::open(&path).unwrap();
    let e = SqliteStore::open(&path).unwrap_err();
    assert!(matches!(e, StoreError::Locked { .. }), "{e:?}");
    drop(first);
    SqliteStore::open(&path).unwrap();
}

const CRASH_CHILD: &str = "ROUNDTABLE_TEST_BUDGET_CRASH_FILE";
const CRASH_TEST: &str = "a_crash_mid_write_keeps_every_committed_count";

#[test]
fn a_crash_mid_write_keeps_every_committed_count() {
    if let Some(path) = std::env::var_os(CRASH_CHILD) {
        // The child: commits one token at a time, says so after each commit, until killed.
        let mut store = SqliteStore::open(Path::new(&path)).unwrap();
        for i in 1u64.. {
            store
                .add_tokens(
                    "2026-01-01",
                    &[
                        (CounterKey::Bot, 1),
                        (CounterKey::Speaker(format!("s{}", i % 50)), 1),
                    ],
                )
                .unwrap();
            println!("@@committed {i}");
        }
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let path = dir.path().join("state.sqlite");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", CRASH_TEST, "--nocapture", "--test-threads=1"])
        .env(CRASH_CHILD, &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let count = |line: &str| {
        line.split_once("@@committed ")
            .map(|(_, n)| n.trim().parse::<u64>().unwrap())
    };
    let mut seen = 0;
    while seen < 300 {
        let line = lines.next().expect("the child ended").unwrap();
        if let Some(n) = count(&line) {
            seen = n;
        }
    }
    // Killed mid-write (it writes without pause).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success());
    for line in lines {
        if let Some(n) = line.ok().as_deref().and_then(count) {
            seen = n;
        }
    }
    let mut store = SqliteStore::open(&path).unwrap();
    let tokens = store.load_tokens("2026-01-01").unwrap();
    let bot = tokens
        .iter()
        .find(|(k, _)| *k == CounterKey::Bot)
        .map(|(_, n)| *n)
        .unwrap();
    let speakers: u64 = tokens
        .iter()
        .filter(|(k, _)| matches!(k, CounterKey::Speaker(_)))
        .map(|(_, n)| *n)
        .sum();
    // Every commit the child reported is there; at most the one it had not yet reported.
    assert!(bot == seen || bot == seen + 1, "bot {bot}, reported {seen}");
    // Each commit is whole: its two rows together.
    assert_eq!(speakers, bot);
}

fn model_config(env: &Env, model: &ScriptedModel, budgets: BudgetSettings) -> Config {
    let mut c = env.config();
    c.model_url = model.url();
    c.allow_http = true;
    c.api_key = ApiKey::from_static(KEY);
    c.turn_timeout = Some(Duration::from_secs(60));
    c.budgets = budgets;
    c
}

#[tokio::test(flavor = "multi_thread")]
async fn real_turns_are_counted_refused_past_the_budget_and_across_a_restart() {
    let env = Env::new();
    let model = ScriptedModel::start(vec![
        // Turn 1: one call, 600 tokens.
        text_with_usage("one", Some((400, 200))),
        // Turn 2: a call of 500 tokens (1100 > 1000) asking for a tool; the next call is
        // refused by the broker (429) and the guest reports it.
        completion(
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "list", "arguments": "{\"path\": \".\"}"}}]}),
            Some((300, 200)),
        ),
        // After the restart: another speaker's turn.
        text_with_usage("three", Some((10, 5))),
    ])
    .await;
    let budgets = BudgetSettings {
        state_file: Some(env.dir.path().join("budgets.sqlite")),
        speaker_tokens_per_day: Some(1000),
        ..Default::default()
    };
    let sandbox = Sandbox::new(model_config(&env, &model, budgets.clone()))
        .await
        .unwrap();

    let one = sandbox.run_turn(request("#one", "hi")).await;
    assert_eq!(one.reply.text.as_deref(), Some("one"), "{one:?}");
    assert_eq!(
        (
            one.usage.prompt_tokens,
            one.usage.completion_tokens,
            one.usage.model_calls
        ),
        (400, 200, 1)
    );
    assert!(!one.usage.estimated);

    let two = sandbox.run_turn(request("#one", "list it")).await;
    assert_eq!(two.failure, Some(TurnFailure::BudgetExceeded), "{two:?}");
    let error = two.reply.error.as_deref().unwrap();
    assert!(
        error.contains(
            "budget speaker_tokens_per_day exceeded: this speaker has used today's 1000 tokens; the budget resets at 00:00 UTC"
        ),
        "{error}"
    );
    assert_eq!((two.usage.tokens(), two.usage.model_calls), (500, 1));
    assert_eq!(model.requests().len(), 2);

    // Past the budget: refused before anything is made for the turn.
    let three = sandbox.run_turn(request("#other", "hi")).await;
    assert_eq!(
        three.failure,
        Some(TurnFailure::BudgetExceeded),
        "{three:?}"
    );
    assert_eq!(
        three.reply.error.as_deref(),
        Some("budget speaker_tokens_per_day exceeded: this speaker has used today's 1000 tokens; the budget resets at 00:00 UTC")
    );
    assert!(!env.workspace_of("#other").exists());
    assert_eq!(model.requests().len(), 2);
    assert_eq!(three.usage, Default::default());

    // A restart of the runtime on the same state file: the counters are kept.
    sandbox.shutdown().await;
    drop(sandbox);
    let sandbox = Sandbox::new(model_config(&env, &model, budgets))
        .await
        .unwrap();
    let book = sandbox.budgets().unwrap();
    assert_eq!(book.tokens(&CounterKey::Speaker("u1".into())), 1100);
    assert_eq!(
        book.tokens(&CounterKey::Channel(channel_segment("#one"))),
        1100
    );
    let again = sandbox.run_turn(request("#other", "hi")).await;
    assert_eq!(again.failure, Some(TurnFailure::BudgetExceeded));
    // Another speaker has their own budget.
    let mut req = request("#other", "hi");
    req.speaker = Speaker {
        id: "u2".into(),
        name: "bo".into(),
    };
    let other = sandbox.run_turn(req).await;
    assert_eq!(other.reply.text.as_deref(), Some("three"), "{other:?}");
    assert_eq!(other.usage.tokens(), 15);
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test]
async fn the_runtime_refuses_a_corrupt_state_file_at_startup() {
    let env = Env::new();
    let path = env.dir.path().join("budgets.sqlite");
    std::fs::write(
        &path,
        b"not a database at all, but long enough to have a header",
    )
    .unwrap();
    let mut c = env.config();
    c.budgets = BudgetSettings {
        state_file: Some(path.clone()),
        bot_tokens_per_day: Some(10),
        ..Default::default()
    };
    let e = Sandbox::new(c).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "budget state file {} is not a usable SQLite database (left as it is; move it aside to start with empty counters): file is not a database",
            path.display()
        )
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"not a database at all, but long enough to have a header"
    );
}

/// A compaction of one message, asked through a broker whose model answers `steps`, in a
/// counted turn of `chan-hash` under `channel_tokens` a day.
struct Compaction {
    model: ScriptedModel,
    book: Arc<BudgetBook>,
    account: Arc<TurnAccount>,
    turn: BrokerTurn,
    _dir: tempfile::TempDir,
    _broker: Arc<roundtable_sandbox::internals::broker::Broker>,
}

impl Compaction {
    async fn start(steps: Vec<Step>, channel_tokens: u64) -> Self {
        let model = ScriptedModel::start(steps).await;
        let broker = start_broker(broker_policy(&model.url(), KEY)).await;
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let book = book(
            dir.path(),
            BudgetSettings {
                channel_tokens_per_day: Some(channel_tokens),
                ..Default::default()
            },
        );
        let account = Arc::new(TurnAccount::new("u1", "chan-hash", Some(book.clone())));
        let turn = BrokerTurn::start_counted(&broker, "chan", ann(), Some(account.clone())).await;
        Self {
            model,
            book,
            account,
            turn,
            _dir: dir,
            _broker: broker,
        }
    }

    /// Asks for the summary: where it came from.
    async fn compact(&self) -> roundtable_sandbox::protocol::compaction::CompactSource {
        use roundtable_sandbox::protocol::chat::Message;
        use roundtable_sandbox::protocol::compaction::{CompactReply, CompactRequest};
        let older = vec![Message::User {
            content: "ann: keep the door code".into(),
        }];
        let body = serde_json::to_value(CompactRequest::new(None, &older, 5000, 2000)).unwrap();
        let a = post_json(self.turn.socket(), "/v1/compact", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        serde_json::from_slice::<CompactReply>(&a.body)
            .unwrap()
            .source
    }
}

#[tokio::test]
async fn compaction_calls_are_counted_and_refused_past_a_budget() {
    use roundtable_sandbox::protocol::compaction::CompactSource;
    let c = Compaction::start(vec![text_with_usage("SUMMARY of it", Some((90, 20)))], 100).await;
    assert_eq!(c.compact().await, CompactSource::Model);
    let u = c.account.usage();
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens, u.model_calls),
        (90, 20, 1)
    );
    assert_eq!(c.book.tokens(&CounterKey::Channel("chan-hash".into())), 110);
    // Past the channel's budget: the compactor's call is refused before the upstream, and
    // the plain summary is built.
    assert_eq!(c.compact().await, CompactSource::Plain);
    assert_eq!(c.model.requests().len(), 1);
    assert_eq!(c.account.usage().model_calls, 1);
}

/// A compaction call that fails after its request went (here an answer past the
/// compactor's 256 KiB) is one call of the turn's, charged its worst case: its charge,
/// dropped unsettled, counted it a second time.
#[tokio::test]
async fn a_failed_compaction_call_is_counted_once() {
    use roundtable_sandbox::protocol::compaction::CompactSource;
    let c = Compaction::start(vec![Step::Huge(512 * 1024)], 1_000_000).await;
    assert_eq!(c.compact().await, CompactSource::Plain);
    assert_eq!(c.model.requests().len(), 1);
    assert_eq!(c.account.usage().model_calls, 1);
    assert!(c.book.tokens(&CounterKey::Channel("chan-hash".into())) > 0);
}

/// Today (UTC), as the book names its day.
fn today() -> String {
    chrono::Utc::now().date_naive().to_string()
}

/// Every counter row of the state file as SQLite holds it: (scope, key, typeof, value as
/// text). Read with the store closed (it holds the file exclusively).
fn raw_rows(path: &Path) -> Vec<(String, String, String, String)> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT scope, key, typeof(tokens), CAST(tokens AS TEXT) FROM tokens ORDER BY scope, key",
        )
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    rows
}

/// Runs `f` with a subscriber that captures this thread's logs (the book loads its store on
/// the caller's thread).
fn with_logs<T>(
    f: impl FnOnce() -> T,
) -> (T, roundtable_sandbox_test_support::captured_logs::Captured) {
    let logs = roundtable_sandbox_test_support::captured_logs::Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    (out, logs)
}

/// Issue 43 item 7: a usage near `u64::MAX`, charged in three commits. The SQL adds with
/// saturation, so every row stays an INTEGER at `i64::MAX` (`tokens + excluded.tokens`
/// overflowed to a REAL, 9.22e18, and every later start failed on it until the next day);
/// after a restart the counters load saturated, with no warning, and still refuse.
#[test]
fn a_saturating_usage_is_stored_saturated_and_still_refuses_after_a_restart() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let path = dir.path().join("state.sqlite");
    let settings = BudgetSettings {
        speaker_tokens_per_day: Some(1000),
        bot_tokens_per_day: Some(1_000_000_000_000),
        ..Default::default()
    };
    let first = book(dir.path(), settings.clone());
    for n in [u64::MAX, u64::MAX - 1, 5] {
        first.charge("u1", "chan", n);
        first.flush();
    }
    assert_eq!(first.tokens(&CounterKey::Bot), u64::MAX);
    drop(first);
    let max = i64::MAX.to_string();
    let integer_max = |scope: &str, key: &str| {
        (
            scope.to_owned(),
            key.to_owned(),
            "integer".to_owned(),
            max.clone(),
        )
    };
    assert_eq!(
        raw_rows(&path),
        vec![
            integer_max("bot", ""),
            integer_max("channel", "chan"),
            integer_max("speaker", "u1"),
        ]
    );

    // The restart: loaded saturated, nothing to clamp, the budgets still full.
    let (second, logs) = with_logs(|| book(dir.path(), settings));
    assert_eq!(logs.text(), "", "a clean file is loaded without a warning");
    for key in [
        CounterKey::Bot,
        CounterKey::Channel("chan".into()),
        CounterKey::Speaker("u1".into()),
    ] {
        assert_eq!(second.tokens(&key), i64::MAX as u64, "{key:?}");
    }
    let refused = second.admit("u1", "chan").unwrap_err();
    assert_eq!(refused.budget, Budget::SpeakerTokensPerDay);
    let refused = second.admit("u2", "other").unwrap_err();
    assert_eq!(refused.budget, Budget::BotTokensPerDay);
    // More charges stay at the top.
    second.charge("u1", "chan", u64::MAX);
    second.flush();
    drop(second);
    assert!(
        raw_rows(&path)
            .iter()
            .all(|(_, _, t, v)| t == "integer" && *v == max),
        "{:?}",
        raw_rows(&path)
    );
}

/// Issue 43 item 7: what a damaged or foreign writer left (REAL, TEXT, negative, NULL,
/// out of range; turns with a REAL or TEXT time) never fails a start: each value is read
/// by the one rule (`clamp_count`) with one warning per table naming the file and the
/// rows, the budgets work on the clamped counts, and a counter's next charge rewrites its
/// row clean with the same rule (the SQL and the loader agree: a negative row charged 10
/// is 10, not 5).
#[test]
fn values_a_start_never_writes_are_loaded_clamped_with_one_warning() {
    use roundtable_sandbox::internals::budgets::{clamp_count, ReadCount, StoredCount, MAX_STORED};
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let path = dir.path().join("state.sqlite");
    drop(SqliteStore::open(&path).unwrap());
    let now_ms = chrono::Utc::now().timestamp_millis();
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        let day = today();
        let put = |scope: &str, key: &str, value: rusqlite::types::Value| {
            conn.execute(
                "INSERT INTO tokens (day, scope, key, tokens) VALUES (?1, ?2, ?3, ?4)",
                rusqlite::params![day, scope, key, value],
            )
            .unwrap();
        };
        use rusqlite::types::Value;
        put("speaker", "overflowed", Value::Real(9.223372036854776e18));
        put("speaker", "fraction", Value::Real(12.7));
        put("speaker", "text", Value::Text("lots".into()));
        put("speaker", "negative", Value::Integer(-5));
        put("speaker", "clean", Value::Integer(7));
        put("channel", "far-below", Value::Real(-1e300));
        put("bot", "", Value::Integer(40));
        for (speaker, at) in [
            ("u1", Value::Text("soon".into())),
            ("u2", Value::Real(now_ms as f64 - 1000.5)),
            ("u3", Value::Integer(now_ms - 5000)),
            // Far in the future (a foreign writer, a clock set back): counts as now.
            ("u4", Value::Integer(i64::MAX)),
        ] {
            conn.execute(
                "INSERT INTO turns (speaker, at_ms) VALUES (?1, ?2)",
                rusqlite::params![speaker, at],
            )
            .unwrap();
        }
    }
    let settings = BudgetSettings {
        speaker_tokens_per_day: Some(100),
        speaker_turns_per_minute: Some(1),
        ..Default::default()
    };
    let (b, logs) = with_logs(|| book(dir.path(), settings.clone()));
    let warnings = logs.lines(&["WARN"]);
    assert_eq!(warnings.len(), 2, "{}", logs.text());
    let p = path.display();
    let clamped = format!(
        "clamped (REAL, TEXT, NULL, BLOB or negative: read as 0 if negative, a REAL as its whole part up to {MAX_STORED}, anything else as spent, {MAX_STORED})"
    );
    let tail = "the runtime goes on with them so (a counter's next charge rewrites it clean; an unreadable turn is pruned)";
    assert!(
        warnings[0].ends_with(&format!(
            "budget state file {p}: 5 of 7 counter row(s) loaded were not clean: 5 {clamped}; {tail}"
        )),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[1].ends_with(&format!(
            "budget state file {p}: 2 of 4 turn row(s) loaded were not clean: 1 {clamped}; 1 skipped (a key, speaker or time that is not readable); {tail}"
        )),
        "{}",
        warnings[1]
    );
    let tokens = |key: &str| b.tokens(&CounterKey::Speaker(key.into()));
    assert_eq!(
        [
            tokens("overflowed"),
            tokens("fraction"),
            tokens("text"),
            tokens("negative"),
            tokens("clean")
        ],
        [MAX_STORED, 12, MAX_STORED, 0, 7]
    );
    assert_eq!(b.tokens(&CounterKey::Channel("far-below".into())), 0);
    assert_eq!(b.tokens(&CounterKey::Bot), 40);
    // The budgets on the clamped counts: a count nobody can read is spent.
    for (speaker, refused) in [
        ("overflowed", true),
        ("text", true),
        ("fraction", false),
        ("negative", false),
    ] {
        let r = b.check_tokens(speaker, "c");
        assert_eq!(r.is_err(), refused, "{speaker}: {r:?}");
    }
    // The turns: u2's (a REAL time) and u3's count in this minute; u1's (no time) does not.
    assert_eq!(
        b.admit("u2", "c").unwrap_err().budget,
        Budget::SpeakerTurnsPerMinute
    );
    assert_eq!(
        b.admit("u3", "c").unwrap_err().budget,
        Budget::SpeakerTurnsPerMinute
    );
    b.admit("u1", "c").unwrap();
    assert_eq!(
        b.admit("u4", "c").unwrap_err().message,
        "this speaker has started 1 turns in the last minute; try again in 60 s"
    );
    // Each damaged row's next charge rewrites it clean, by the same rule.
    for speaker in ["overflowed", "fraction", "text", "negative"] {
        b.charge(speaker, "far-below", 10);
    }
    b.flush();
    drop(b);
    let rows = raw_rows(&path);
    let row = |scope: &str, key: &str| {
        let r = rows
            .iter()
            .find(|r| r.0 == scope && r.1 == key)
            .unwrap_or_else(|| panic!("{scope} {key}: {rows:?}"));
        (r.2.clone(), r.3.clone())
    };
    let int = |n: u64| ("integer".to_owned(), n.to_string());
    assert_eq!(row("speaker", "overflowed"), int(MAX_STORED));
    assert_eq!(row("speaker", "fraction"), int(22));
    assert_eq!(row("speaker", "text"), int(MAX_STORED));
    assert_eq!(row("speaker", "negative"), int(10));
    assert_eq!(row("channel", "far-below"), int(40));
    assert_eq!(row("bot", ""), int(80));
    // The rule itself, as the PostgreSQL store will read its values.
    assert_eq!(clamp_count(StoredCount::Integer(3)), ReadCount::Clean(3));
    assert_eq!(
        clamp_count(StoredCount::Real(f64::NAN)),
        ReadCount::Clamped(MAX_STORED)
    );
    assert_eq!(
        clamp_count(StoredCount::Real(f64::INFINITY)),
        ReadCount::Clamped(MAX_STORED)
    );
    assert_eq!(
        clamp_count(StoredCount::Null),
        ReadCount::Clamped(MAX_STORED)
    );
    assert_eq!(
        clamp_count(StoredCount::Blob),
        ReadCount::Clamped(MAX_STORED)
    );

    // A foreign writer's schema, without NOT NULL: a NULL count is spent, a NULL speaker's
    // turn skipped; the start goes on.
    let foreign = dir.path().join("foreign.sqlite");
    {
        let conn = rusqlite::Connection::open(&foreign).unwrap();
        conn.execute_batch(
            "CREATE TABLE tokens (day TEXT, scope TEXT, key TEXT, tokens INTEGER,
                 PRIMARY KEY (day, scope, key)) WITHOUT ROWID;
             CREATE TABLE turns (speaker TEXT, at_ms INTEGER);",
        )
        .unwrap();
        conn.execute(
            "INSERT INTO tokens VALUES (?1, 'speaker', 'nobody-knows', NULL), (?1, 'bot', '', 3)",
            [today()],
        )
        .unwrap();
        conn.execute("INSERT INTO turns VALUES (NULL, ?1)", [now_ms])
            .unwrap();
    }
    let mut settings = settings;
    settings.state_file = Some(foreign.clone());
    let (b, logs) = with_logs(|| BudgetBook::open(&settings, "UTC").unwrap().unwrap());
    assert_eq!(
        logs.lines(&["WARN", "1 of 2 counter row(s)"]).len(),
        1,
        "{}",
        logs.text()
    );
    assert_eq!(
        logs.lines(&["WARN", "1 of 1 turn row(s)"]).len(),
        1,
        "{}",
        logs.text()
    );
    assert_eq!(
        b.tokens(&CounterKey::Speaker("nobody-knows".into())),
        MAX_STORED
    );
    assert_eq!(b.tokens(&CounterKey::Bot), 3);
    b.charge("nobody-knows", "c", 1);
    b.flush();
    drop(b);
    let rows = raw_rows(&foreign);
    assert!(
        rows.contains(&(
            "speaker".into(),
            "nobody-knows".into(),
            "integer".into(),
            i64::MAX.to_string()
        )),
        "{rows:?}"
    );
}

/// Issue 43 item 6: a message's `limits_key` is what the per-speaker budgets count it under
/// (a bot whose speaker id the sender can change at will, an IRC nick, passes something
/// the sender cannot): a new nick with the same key is refused, the same nick with another
/// key is not. The key reaches neither the turn the guest gets nor the audit trail, which
/// show the speaker; without a key the speaker's id is counted, as before.
#[actix_rt::test]
async fn a_limits_key_keys_the_speakers_budgets_and_stays_out_of_the_turn_and_the_audit() {
    use roundtable_sandbox::AuditSettings;
    use roundtable_sandbox_actors::{GuestMessage, SandboxSupervisor, Shutdown, SupervisorOptions};
    const LIMITS: &str = "limits-key-3c9e-never-shown";
    const OTHER: &str = "limits-key-71fa-never-shown";
    let env = Env::new();
    let driver = FakeDriver::new();
    let audit = env.dir.path().join("audit.jsonl");
    let mut config = env.config();
    config.driver = Some(driver.clone());
    config.audit = AuditSettings {
        path: Some(audit.clone()),
        include_text: true,
    };
    config.budgets = BudgetSettings {
        state_file: Some(env.dir.path().join("budgets.sqlite")),
        speaker_turns_per_minute: Some(1),
        ..Default::default()
    };
    let sandbox = SandboxSupervisor::start(SupervisorOptions::new(config))
        .await
        .unwrap();
    let say = |nick: &str, key: Option<&str>, channel: &str| {
        let speaker = Speaker {
            id: nick.into(),
            name: nick.into(),
        };
        let mut message = GuestMessage::new(channel, speaker, "hello");
        if let Some(key) = key {
            message = message.with_limits_key(key);
        }
        sandbox.send(message)
    };
    let failure = |o: roundtable_sandbox::TurnOutcome| (o.failure, o.reply.text, o.reply.error);
    // ann's turn, under the key.
    let one = failure(say("ann", Some(LIMITS), "#a").await.unwrap().unwrap());
    assert_eq!(one.0, None, "{one:?}");
    // A new nick with the same key (a NICK change on one connection): the same budget.
    let two = failure(say("bob", Some(LIMITS), "#b").await.unwrap().unwrap());
    assert_eq!(two.0, Some(TurnFailure::BudgetExceeded), "{two:?}");
    assert!(
        two.2
            .as_deref()
            .unwrap()
            .starts_with("budget speaker_turns_per_minute exceeded: this speaker has started 1 turns in the last minute; try again in "),
        "{two:?}"
    );
    // The same nick with another key (another sender): a budget of its own.
    let three = failure(say("ann", Some(OTHER), "#c").await.unwrap().unwrap());
    assert_eq!(three.0, None, "{three:?}");
    // No key: the speaker's id, as before (ann's id has no turn counted yet).
    let four = failure(say("ann", None, "#d").await.unwrap().unwrap());
    assert_eq!(four.0, None, "{four:?}");
    let five = failure(say("ann", None, "#e").await.unwrap().unwrap());
    assert_eq!(five.0, Some(TurnFailure::BudgetExceeded), "{five:?}");
    sandbox.send(Shutdown).await.unwrap();

    // The turns the guest got: the speaker, never the key.
    let runs = driver.runs();
    assert_eq!(runs.len(), 3);
    for run in &runs {
        let turn = serde_json::to_string(&run.turn).unwrap();
        assert_eq!(run.turn.speaker.id, "ann");
        assert!(!turn.contains("limits-key"), "{turn}");
    }
    // The audit trail: one line per turn, the speaker's id, never the key.
    eventually("five audit lines", Duration::from_secs(30), || {
        std::fs::read_to_string(&audit).is_ok_and(|t| t.lines().count() == 5)
    })
    .await;
    let trail = std::fs::read_to_string(&audit).unwrap();
    assert!(!trail.contains("limits-key"), "{trail}");
    let mut speakers: Vec<(u64, String)> = trail
        .lines()
        .map(|l| {
            let line: serde_json::Value = serde_json::from_str(l).unwrap();
            (line["turn"].as_u64().unwrap(), line["speaker"].to_string())
        })
        .collect();
    // Written as each turn ends: in the turns' order.
    speakers.sort();
    let speakers: Vec<&str> = speakers.iter().map(|(_, s)| s.as_str()).collect();
    assert_eq!(
        speakers,
        ["\"ann\"", "\"bob\"", "\"ann\"", "\"ann\"", "\"ann\""],
        "{trail}"
    );
}
