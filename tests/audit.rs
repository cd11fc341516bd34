//! The audit trail (issue 23 item 5) with the real parts: real turns of the real guest in
//! real containers, driven by the actor layer, against the scripted OpenAI-compatible
//! upstream on loopback, with the SQLite budgets; each outcome's line read back from the
//! file (succeeded, busy, over a budget mid-turn and before its turn, over quota, timed
//! out), no key and (by default) no guest text in it; concurrent turns in several channels
//! give whole lines; a full audit file fails no turn (counted); an unopenable one is a
//! startup error. Runs as the non-root service user.

use std::path::{Path, PathBuf};
use std::time::Duration;

use actix::prelude::*;
use roundtable_sandbox::internals::audit::{AuditSettings, AuditStats};
use roundtable_sandbox::internals::budgets::BudgetSettings;
use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::{ApiKey, ChannelId, Config, Sandbox, SandboxError, Speaker, TurnFailure};
use roundtable_sandbox_actors::{
    GuestMessage, SandboxActorError, SandboxSupervisor, Shutdown, SupervisorOptions,
};
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use serde_json::{json, Value};

const KEY: &str = "sk-audit-test-c0ffee-42";

fn completion(message: Value, usage: (u64, u64)) -> Step {
    Step::Json(json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": usage.0, "completion_tokens": usage.1,
                  "total_tokens": usage.0 + usage.1},
    }))
}

fn text(content: &str, usage: (u64, u64)) -> Step {
    completion(json!({"role": "assistant", "content": content}), usage)
}

fn config(env: &Env, model: &ScriptedModel, audit: &Path, include_text: bool) -> Config {
    let mut c = env.config();
    c.model_url = model.url();
    c.api_key = ApiKey::from_static(KEY);
    c.turn_timeout = Some(Duration::from_secs(60));
    c.audit = AuditSettings {
        path: Some(audit.to_owned()),
        include_text,
    };
    c
}

fn speaker(id: &str) -> Speaker {
    Speaker {
        id: id.into(),
        name: id.into(),
    }
}

/// The file's lines, each checked whole: ends with its line break, is ASCII, parses.
fn lines(path: &Path) -> Vec<Value> {
    let text = std::fs::read(path).unwrap();
    assert!(text.is_empty() || text.ends_with(b"\n"), "a torn last line");
    assert!(
        text.iter()
            .all(|b| *b == b'\n' || (b' '..=b'~').contains(b)),
        "the trail is printable ASCII"
    );
    text.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            serde_json::from_slice(l)
                .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(l)))
        })
        .collect()
}

async fn wait_lines(path: &Path, n: usize) -> Vec<Value> {
    eventually(&format!("{n} audit lines"), Duration::from_secs(60), || {
        std::fs::read(path).is_ok_and(|t| t.iter().filter(|b| **b == b'\n').count() >= n)
    })
    .await;
    lines(path)
}

fn short(channel: &str) -> String {
    ChannelId::new(channel).short().to_owned()
}

async fn say(
    addr: &Addr<SandboxSupervisor>,
    channel: &str,
    who: &str,
    text: &str,
) -> Result<roundtable_sandbox::TurnOutcome, SandboxActorError> {
    addr.send(GuestMessage::new(channel, speaker(who), text))
        .await
        .unwrap()
}

/// The message texts and replies of the trail test: each must stay out of the file.
const MESSAGES: [&str; 8] = [
    "msg-alpha-5b2f please answer",
    "msg-bravo-71c0 answer me",
    "msg-charlie-0e9d while busy",
    "msg-delta-c3a1 list the files",
    "msg-echo-44f2 after the budget",
    "msg-foxtrot-9aa7 make a workspace",
    "msg-golf-2d6e over quota",
    "msg-india-1c5d queued behind bravo",
];
const REPLIES: [&str; 4] = [
    "reply-one-8d1e",
    "reply-two-f07c",
    "reply-five-3b9a",
    "reply-queued-77e0",
];

#[actix_rt::test]
async fn each_turn_has_one_line_saying_what_happened() {
    let env = Env::new();
    let audit = env.dir.path().join("audit.jsonl");
    let model = ScriptedModel::start(vec![
        // 1 (#a, u1): one call, 600 tokens.
        text(REPLIES[0], (400, 200)),
        // 2 (#b, u2): 15 tokens; its channel's next message waits (queue_limit 1) and
        // answers 3; the one after, sent at once, is busy.
        text(REPLIES[1], (10, 5)),
        text(REPLIES[3], (10, 5)),
        // 4 (#c, u1): 500 tokens (1100 > 1000) asking for a tool; the next call is refused
        // by the budget (429) and the guest reports it.
        completion(
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "list", "arguments": "{\"path\": \".\"}"}}]}),
            (300, 200),
        ),
        // 5 (#a, u1): refused before its container. 6 (#q, u2): makes its workspace.
        text(REPLIES[2], (10, 5)),
        // 7 (#q, u2): its workspace is over quota before the turn.
    ])
    .await;
    let mut c = config(&env, &model, &audit, false);
    c.budgets = BudgetSettings {
        state_file: Some(env.dir.path().join("budgets.sqlite")),
        speaker_tokens_per_day: Some(1000),
        ..Default::default()
    };
    c.limits.workspace_mb = 1;
    let mut options = SupervisorOptions::new(c);
    options.queue_limit = 1;
    let addr = SandboxSupervisor::start(options).await.unwrap();

    let one = say(&addr, "#a", "u1", MESSAGES[0]).await.unwrap();
    assert_eq!(one.reply.text.as_deref(), Some(REPLIES[0]), "{one:?}");
    // All three sent before any is answered: the second waits behind the first, the
    // third finds the queue full.
    let two = addr.send(GuestMessage::new("#b", speaker("u2"), MESSAGES[1]));
    let queued = addr.send(GuestMessage::new("#b", speaker("u2"), MESSAGES[7]));
    let busy = addr.send(GuestMessage::new("#b", speaker("u2"), MESSAGES[2]));
    let (two, queued, busy) = (
        two.await.unwrap().unwrap(),
        queued.await.unwrap().unwrap(),
        busy.await.unwrap(),
    );
    assert_eq!(two.reply.text.as_deref(), Some(REPLIES[1]), "{two:?}");
    assert_eq!(queued.reply.text.as_deref(), Some(REPLIES[3]), "{queued:?}");
    assert!(
        matches!(busy, Err(SandboxActorError::Busy { .. })),
        "{busy:?}"
    );
    let four = say(&addr, "#c", "u1", MESSAGES[3]).await.unwrap();
    assert_eq!(four.failure, Some(TurnFailure::BudgetExceeded), "{four:?}");
    let five = say(&addr, "#a", "u1", MESSAGES[4]).await.unwrap();
    assert_eq!(five.failure, Some(TurnFailure::BudgetExceeded), "{five:?}");
    let six = say(&addr, "#q", "u2", MESSAGES[5]).await.unwrap();
    assert_eq!(six.reply.text.as_deref(), Some(REPLIES[2]), "{six:?}");
    // 2 MiB in the channel's workspace (quota 1 MiB): its next turn is refused.
    std::fs::write(env.workspace_of("#q").join("big"), vec![7u8; 2 << 20]).unwrap();
    let seven = say(&addr, "#q", "u2", MESSAGES[6]).await.unwrap();
    assert_eq!(seven.failure, Some(TurnFailure::OverQuota), "{seven:?}");
    addr.send(Shutdown).await.unwrap();

    let all = wait_lines(&audit, 8).await;
    assert_eq!(all.len(), 8, "{all:#?}");
    // The refusal is written when it is refused, before the running turn ends.
    let busy_at = all
        .iter()
        .position(|l| l["outcome"] == "busy")
        .expect("a busy line");
    let busy = all[busy_at].clone();
    let mut turns: Vec<Value> = all.into_iter().filter(|l| l["outcome"] != "busy").collect();
    turns.sort_by_key(|l| l["turn"].as_u64());
    let [one, two, three, four, five, six, seven] = <[Value; 7]>::try_from(turns).unwrap();

    for (line, n) in [
        (&one, 0),
        (&two, 1),
        (&three, 7),
        (&four, 3),
        (&five, 4),
        (&six, 5),
        (&seven, 6),
    ] {
        assert_eq!(line["v"], 1);
        assert_eq!(line["bytes_in"], MESSAGES[n].len(), "{line}");
        assert!(line["turn"].as_u64().unwrap() >= 1);
        assert!(line["at"].as_str().unwrap().ends_with('Z'), "{line}");
        assert!(
            line["duration_ms"]["total"].as_f64().unwrap() > 0.0,
            "{line}"
        );
    }
    // 1: succeeded, cold, one model call of 600 tokens.
    assert_eq!(one["outcome"], "ok");
    assert!(one.get("explain").is_none());
    assert_eq!(one["launch"], "cold");
    assert_eq!(one["channel"], short("#a"));
    assert_eq!(one["speaker"], "u1");
    assert_eq!(
        one["model_calls"],
        json!([{"operation": "chat", "status": 200,
                "latency_ms": one["model_calls"][0]["latency_ms"],
                "prompt_tokens": 400, "completion_tokens": 200}])
    );
    assert_eq!(
        one["usage"],
        json!({"prompt_tokens": 400, "completion_tokens": 200, "model_calls": 1,
               "tool_calls": 0, "estimated": false})
    );
    assert_eq!(one["bytes_out"], REPLIES[0].len());
    assert!(one["workspace_bytes"].as_u64().is_some(), "{one}");
    for phase in [
        "preparing",
        "broker_listening",
        "container_running",
        "tearing_down",
    ] {
        assert!(
            one["duration_ms"][phase].as_f64().is_some(),
            "{phase}: {one}"
        );
    }
    assert!(one["tool_calls"].as_array().unwrap().is_empty());
    // 2 and the busy message of its channel.
    assert_eq!(two["outcome"], "ok");
    assert_eq!(
        (&two["speaker"], &two["channel"]),
        (&json!("u2"), &json!(short("#b")))
    );
    assert_eq!(three["outcome"], "ok");
    assert_eq!(three["channel"], short("#b"));
    assert_eq!(busy["turn"], Value::Null);
    assert_eq!(busy["launch"], "none");
    assert_eq!(busy["speaker"], "u2");
    assert_eq!(busy["channel"], short("#b"));
    assert_eq!(
        busy["explain"],
        "the channel's queue was full: the message was refused"
    );
    assert_eq!(busy["bytes_in"], MESSAGES[2].len());
    // 4: over the budget mid-turn: one call answered, the tool run, the next call refused.
    assert_eq!(four["outcome"], "budget_exceeded");
    assert_eq!(four["launch"], "cold");
    assert_eq!(four["budget"]["name"], "speaker_tokens_per_day");
    assert_eq!(four["budget"]["limit"], 1000);
    assert_eq!(
        four["budget"]["message"],
        "this speaker has used today's 1000 tokens; the budget resets at 00:00 UTC"
    );
    assert_eq!(four["usage"]["prompt_tokens"], 300);
    assert_eq!(four["usage"]["model_calls"], 1);
    assert_eq!(four["model_calls"].as_array().unwrap().len(), 1);
    assert_eq!(
        four["refusals"],
        json!([{"status": 429, "limit": "budget", "budget": "speaker_tokens_per_day"}])
    );
    // 5: refused before its container.
    assert_eq!(five["outcome"], "budget_exceeded");
    assert_eq!(five["launch"], "none");
    assert_eq!(five["budget"]["name"], "speaker_tokens_per_day");
    assert!(five
        .get("duration_ms")
        .unwrap()
        .get("container_running")
        .is_none());
    assert_eq!(five["usage"]["model_calls"], 0);
    // 6: its workspace measured after the turn; 7: over quota, never launched.
    assert_eq!(six["outcome"], "ok");
    assert_eq!(seven["outcome"], "over_quota");
    assert_eq!(seven["launch"], "none");
    assert_eq!(
        seven["explain"],
        "the workspace passed its quota (bytes or entries), or a file passed the file-size limit"
    );
    assert_eq!(seven["speaker"], "u2");

    // Never the key; by default no message and no reply.
    let raw = std::fs::read_to_string(&audit).unwrap();
    assert!(!raw.contains(KEY), "the key is in the trail");
    for t in MESSAGES.iter().chain(REPLIES.iter()) {
        assert!(!raw.contains(t), "guest text {t:?} is in the trail");
    }
    assert!(!raw.contains("\"text\"") && !raw.contains("\"reply\""));
    assert_eq!(model.requests().len(), 5);
    // The summary of this very file.
    let summary = roundtable_sandbox::internals::audit::summary::summarize(raw.as_bytes()).unwrap();
    assert_eq!(summary.turns, 8);
    assert_eq!(summary.outcomes["budget_exceeded"], 2);
    assert_eq!(summary.outcomes["ok"], 4);
    assert_eq!(summary.budgets["speaker_tokens_per_day"], 2);
    assert_eq!(summary.speakers["u1"], (1100, 3));
    assert!(summary.unreadable.is_empty());
}

#[actix_rt::test]
async fn a_timed_out_turn_is_a_line_and_include_text_adds_the_guest_text() {
    let env = Env::new();
    let audit = env.dir.path().join("audit.jsonl");
    let model = ScriptedModel::start(vec![Step::Hang]).await;
    let mut c = config(&env, &model, &audit, true);
    c.turn_timeout = Some(Duration::from_secs(3));
    let sandbox = Sandbox::new(c).await.unwrap();
    let mut request = request("#slow", "msg-hotel-6f1b wait for it");
    request.speaker = speaker("evil\u{1b}]0;owned\u{7}\n{\"outcome\":\"ok\"}\u{202e}");
    let out = sandbox.run_turn(request).await;
    assert_eq!(out.failure, Some(TurnFailure::Timeout), "{out:?}");
    assert!(sandbox.flush_audit(Duration::from_secs(30)).await);
    let [line] = <[Value; 1]>::try_from(lines(&audit)).unwrap();
    assert_eq!(line["outcome"], "timeout");
    assert_eq!(
        line["explain"],
        "the turn passed its timeout (counted from admission)"
    );
    assert_eq!(line["launch"], "cold");
    // The speaker's controls and line break are escapes in one line (checked by `lines`),
    // the same text once parsed.
    assert_eq!(
        line["speaker"],
        "evil\u{1b}]0;owned\u{7}\n{\"outcome\":\"ok\"}\u{202e}"
    );
    assert_eq!(line["text"], "msg-hotel-6f1b wait for it");
    assert_eq!(line["reply"], "turn timed out after 3s");
    assert!(!std::fs::read_to_string(&audit).unwrap().contains(KEY));
    assert_eq!(sandbox.audit_stats().unwrap(), stats(1, 0, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_turns_in_several_channels_write_whole_lines() {
    let env = Env::new();
    let audit = env.dir.path().join("audit.jsonl");
    // Every line long (a long speaker id and, with include_text, a 6 KiB message): well
    // past what one small write would hold.
    const TURNS: usize = 8;
    let model = ScriptedModel::start(
        (0..TURNS)
            .map(|_| text(&"r".repeat(3000), (1, 1)))
            .collect(),
    )
    .await;
    let sandbox = Sandbox::new(config(&env, &model, &audit, true))
        .await
        .unwrap();
    let turns = (0..TURNS).map(|i| {
        let sandbox = sandbox.clone();
        async move {
            let mut r = request(&format!("#c{i}"), &format!("{i}{}", "m".repeat(6000)));
            r.speaker = speaker(&format!("speaker-{i}-{}", "s".repeat(500)));
            sandbox.run_turn(r).await
        }
    });
    for out in futures_util::future::join_all(turns).await {
        assert_eq!(out.failure, None, "{out:?}");
    }
    assert!(sandbox.flush_audit(Duration::from_secs(30)).await);
    let all = lines(&audit);
    assert_eq!(all.len(), TURNS);
    let mut seen: Vec<String> = all
        .iter()
        .map(|l| {
            let s = l["speaker"].as_str().unwrap().to_owned();
            let i: usize = s["speaker-".len()..]
                .split('-')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(
                l["text"].as_str().unwrap().len(),
                i.to_string().len() + 6000
            );
            assert_eq!(l["channel"], short(&format!("#c{i}")));
            assert_eq!(l["reply"].as_str().unwrap().len(), 3000);
            s
        })
        .collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), TURNS);
}

#[tokio::test]
async fn a_full_audit_file_fails_no_turn_and_is_counted() {
    let env = Env::new();
    let model = ScriptedModel::start(vec![text("fine", (1, 1))]).await;
    // Every write to /dev/full fails with ENOSPC.
    let sandbox = Sandbox::new(config(&env, &model, Path::new("/dev/full"), false))
        .await
        .unwrap();
    let out = sandbox.run_turn(request("#full", "hi")).await;
    assert_eq!(out.failure, None, "{out:?}");
    assert_eq!(out.reply.text.as_deref(), Some("fine"));
    assert!(sandbox.flush_audit(Duration::from_secs(30)).await);
    assert_eq!(sandbox.audit_stats().unwrap(), stats(0, 1, 0));
}

/// The audit writer's counts: lines `written`, lines whose write `failed`, turns `dropped`.
fn stats(written: u64, failed: u64, dropped: u64) -> AuditStats {
    AuditStats {
        written,
        failed,
        dropped,
    }
}

/// The startup error of a runtime whose audit file is `path`, checked to say that the
/// file cannot be opened for appending.
async fn unopenable(env: &Env, model: &ScriptedModel, path: &Path) -> SandboxError {
    let e = Sandbox::new(config(env, model, path, false))
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "audit file {} cannot be opened for appending",
            path.display()
        )
    );
    e
}

#[tokio::test]
async fn an_unopenable_audit_file_is_a_startup_error() {
    let env = Env::new();
    let model = ScriptedModel::start(vec![]).await;
    let path: PathBuf = env.dir.path().join("readonly.jsonl");
    std::fs::write(&path, b"").unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
    let e = unopenable(&env, &model, &path).await;
    let source = std::error::Error::source(&e).unwrap();
    assert_eq!(source.to_string(), "Permission denied (os error 13)");
    // A directory that does not exist.
    let missing = env.dir.path().join("no/such/dir/audit.jsonl");
    unopenable(&env, &model, &missing).await;
}
