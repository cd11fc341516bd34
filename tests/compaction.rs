//! The host-side compactor (`[compaction]`, `POST /v1/compact`): the real guest in the
//! project's image compacts its session through the broker, which runs a scripted
//! summarizer (an OpenAI-compatible server on loopback, with its own key) or falls back to
//! the scripted main model, then to the plain summary. Every test captures the runtime's
//! logs with its own subscriber in a current-thread runtime, so every broker task logs into
//! it. Runs as the non-root service user (scripts/test.sh).

use roundtable_sandbox_test_support::broker_client as client;
use roundtable_sandbox_test_support::captured_logs::Captured;

use std::time::Duration;

use roundtable_sandbox::internals::broker::BrokerPolicy;
use roundtable_sandbox::internals::config::{ApiKey, CompactionModel};
use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::protocol::chat::Message;
use roundtable_sandbox::protocol::compaction::{CompactReply, CompactRequest, CompactSource};
use roundtable_sandbox::{Config, Sandbox, Speaker};
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use serde_json::{json, Value};

const KEY: &str = "sk-main-cobra-1111-do-not-leak";
const SUM_KEY: &str = "sk-sum-otter-2222-do-not-leak";
const BUDGET: u64 = 2000;

// ---------------------------------------------------------------- harness

/// Runs `test` in a current-thread runtime with a capturing subscriber as the default.
fn with_logs<F: std::future::Future<Output = ()>>(test: impl FnOnce(Captured) -> F) {
    let logs =
        roundtable_sandbox_test_support::captured_logs::run_captured(tracing::Level::INFO, test);
    eprintln!("captured logs:\n{}", logs.text());
}

fn hash(channel: &str) -> String {
    roundtable_sandbox::internals::turn::channel_segment(channel)[..16].to_owned()
}

fn summarizer(s: &ScriptedModel, key: ApiKey, source: &str) -> CompactionModel {
    CompactionModel {
        url: s.url(),
        model: "sum-model".into(),
        api_key: key,
        key_source: source.into(),
        timeout: Duration::from_secs(2),
        allow_http: true,
    }
}

fn config(env: &Env, model: &ScriptedModel, compaction: Option<CompactionModel>) -> Config {
    let mut c = env.config();
    c.model_url = model.url();
    c.allow_http = true;
    c.api_key = ApiKey::from_static(KEY);
    c.turn_timeout = Some(Duration::from_secs(90));
    c.session_budget = Some(BUDGET);
    c.compaction = compaction;
    c
}

fn long(tag: &str) -> String {
    format!("{tag} ").repeat(1500)
}

fn messages(v: &Value) -> Vec<Value> {
    v["messages"].as_array().cloned().unwrap_or_default()
}

fn is_summary_request(v: &Value) -> bool {
    messages(v)
        .first()
        .and_then(|m| m["content"].as_str())
        .is_some_and(|c| c.starts_with("You compact the conversation"))
}

/// The stored session of a channel.
fn session(env: &Env, channel: &str) -> Value {
    let raw = std::fs::read_to_string(env.workspace_of(channel).join(".roundtable/session.json"))
        .unwrap();
    serde_json::from_str(&raw).unwrap()
}

/// `tokens_before=N` of a log line.
fn tokens_before(line: &str) -> u64 {
    let rest = line
        .split("tokens_before=")
        .nth(1)
        .unwrap_or_else(|| panic!("no tokens_before in {line}"));
    rest.split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

// ---------------------------------------------------------------- through the real guest

/// The summarizer's answer becomes the session's summary; its key is injected by the
/// broker only, redacted from what comes back, and nowhere the container can look.
#[test]
fn a_configured_summarizer_writes_the_summary_and_its_key_stays_on_the_host() {
    with_logs(|logs| async move {
        let env = Env::new();
        let channel = "#sum-used";
        let model = ScriptedModel::start(vec![Step::text(&long("alpha"))]).await;
        let sum = ScriptedModel::start(vec![
            Step::text(
                "SUMMARIZER-ONE: ann set the rule to answer in French.\nFiles to reload:\n- notes.txt",
            ),
            // A leaky summarizer: its answer carries the Authorization header it received.
            Step::EchoKey,
        ])
        .await;
        let mut c = config(
            &env,
            &model,
            Some(summarizer(&sum, ApiKey::from_static(SUM_KEY), "test")),
        );
        // The guest runs under a probe that looks for the summarizer's key everywhere
        // afterwards (assembled from halves so the probe's command line never holds it).
        let probe = r#"
            cat > /tmp/turn.json
            /roundtable-guest < /tmp/turn.json > /tmp/reply.json 2>/tmp/guest.err
            K="sk-sum-otter"; K="$K-2222-do-not-leak"
            found=""
            grep -q "$K" /tmp/turn.json && found="$found turn-json"
            grep -q "$K" /tmp/reply.json && found="$found reply"
            grep -q "$K" /tmp/guest.err && found="$found stderr"
            env | grep -q "$K" && found="$found env"
            for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do
              grep -q "$K" "$f" 2>/dev/null && found="$found $f"
            done
            grep -rqs "$K" /workspace /run /tmp/turn.json /tmp/reply.json /etc && found="$found files"
            ok=$(grep -c '"ok":true' /tmp/reply.json)
            calls=$(sed -n 's/.*"modelCalls":\([0-9]*\).*/\1/p' /tmp/reply.json)
            printf '{"ok":true,"text":"found=[%s] guest_ok=%s calls=%s"}' "$found" "$ok" "$calls"
        "#;
        c.command = Some(vec!["/bin/sh".into(), "-c".into(), probe.into()]);
        let sandbox = Sandbox::new(c).await.unwrap();

        let r = sandbox
            .run_turn(request(channel, "rule: always answer in French"))
            .await
            .reply;
        assert_eq!(
            r.text.as_deref(),
            Some("found=[] guest_ok=1 calls=1"),
            "{r:?}"
        );
        // Over budget now: the summarizer summarises, then the main model answers.
        model.push(Step::text(&long("beta")));
        let r = sandbox.run_turn(request(channel, "second")).await.reply;
        assert_eq!(
            r.text.as_deref(),
            Some("found=[] guest_ok=1 calls=2"),
            "{r:?}"
        );
        assert!(
            session(&env, channel)["summary"]
                .as_str()
                .unwrap()
                .starts_with("SUMMARIZER-ONE: ann set the rule"),
            "the summarizer's answer is the summary"
        );
        model.push(Step::text("ok"));
        let r = sandbox.run_turn(request(channel, "third")).await.reply;
        assert_eq!(
            r.text.as_deref(),
            Some("found=[] guest_ok=1 calls=2"),
            "{r:?}"
        );

        let sums = sum.requests();
        assert_eq!(sums.len(), 2);
        for s in &sums {
            assert_eq!(s.path, "/v1/chat/completions");
            assert_eq!(
                s.header_values("authorization"),
                vec![format!("Bearer {SUM_KEY}")]
            );
            let body = s.json();
            assert_eq!(body["model"], "sum-model");
            assert!(is_summary_request(&body), "{body}");
            assert!(!s.body.windows(KEY.len()).any(|w| w == KEY.as_bytes()));
        }
        // The same rules as before: the previous summary once, the rules goal, the reload list.
        let second = messages(&sums[1].json())[1]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(second.matches("SUMMARIZER-ONE").count(), 1, "{second}");
        assert!(second.contains("standing rule"));
        assert!(second.contains("Files to reload:\n- notes.txt"), "{second}");

        let main = model.requests();
        assert_eq!(main.len(), 3, "the main model only answered");
        for m in &main {
            assert_eq!(
                m.header_values("authorization"),
                vec![format!("Bearer {KEY}")]
            );
            assert!(!is_summary_request(&m.json()));
            let all = format!("{:?}{}", m.headers, String::from_utf8_lossy(&m.body));
            assert!(
                !all.contains(SUM_KEY),
                "the summarizer's key reached the model"
            );
        }
        let t2 = String::from_utf8_lossy(&main[1].body).into_owned();
        assert!(t2.contains("SUMMARIZER-ONE"));
        let t3 = String::from_utf8_lossy(&main[2].body).into_owned();
        assert!(t3.contains("I saw Bearer [redacted]"), "{t3}");
        let stored = session(&env, channel);
        let summary = stored["summary"].as_str().unwrap();
        assert!(summary.starts_with("I saw Bearer [redacted]"), "{summary}");
        assert!(!stored.to_string().contains(SUM_KEY));

        let h = hash(channel);
        let done = logs.lines(&["session compacted", &h, "source=Summarizer"]);
        assert_eq!(done.len(), 2, "{}", logs.text());
        assert!(logs.lines(&["compaction fell back", &h]).is_empty());
        assert!(!logs.text().contains(SUM_KEY) && !logs.text().contains(KEY));
        assert_no_leftovers(&sandbox).await;
    });
}

/// A summarizer that errs, answers garbage or hangs: each time the main model summarises
/// instead, and when it fails too the plain summary is used; each fallback is a warn line
/// with the channel's hash, the reason and tokens_before, and no guest or upstream text.
#[test]
fn a_failing_summarizer_falls_back_and_each_fallback_is_logged_at_warn() {
    with_logs(|logs| async move {
        let env = Env::new();
        let channel = "#sum-failing";
        let model = ScriptedModel::start(vec![Step::text(&long("alpha"))]).await;
        let sum = ScriptedModel::start(vec![
            Step::Status(500, r#"{"error":"boom UPSTREAM-WORDS-93"}"#.into()),
            Step::Json(json!({"nope": "UPSTREAM-WORDS-93"})),
            Step::Hang,
        ])
        .await;
        let sandbox = Sandbox::new(config(
            &env,
            &model,
            Some(summarizer(&sum, ApiKey::from_static(SUM_KEY), "test")),
        ))
        .await
        .unwrap();
        let r = sandbox
            .run_turn(request(
                channel,
                "GUEST-WORDS-41 rule: always answer in French",
            ))
            .await
            .reply;
        assert!(r.ok, "{r:?}");

        // 1: the summarizer answers 500; the main model summarises.
        model.push(Step::text("MAIN-SUMMARY-ONE"));
        model.push(Step::text(&long("beta")));
        let r = sandbox
            .run_turn(request(channel, "GUEST-WORDS-41 two"))
            .await
            .reply;
        assert!(r.ok, "{r:?}");
        assert_eq!(r.usage.unwrap().model_calls, 3, "summarizer, model, answer");
        assert!(session(&env, channel)["summary"]
            .as_str()
            .unwrap()
            .starts_with("MAIN-SUMMARY-ONE"));
        // 2: the summarizer's answer is not a chat completion.
        model.push(Step::text("MAIN-SUMMARY-TWO"));
        model.push(Step::text(&long("gamma")));
        let r = sandbox
            .run_turn(request(channel, "GUEST-WORDS-41 three"))
            .await
            .reply;
        assert!(r.ok, "{r:?}");
        // 3: the summarizer hangs past its deadline and the main model fails too.
        model.push(Step::Status(503, r#"{"error":"UPSTREAM-WORDS-93"}"#.into()));
        model.push(Step::text("done"));
        let r = sandbox
            .run_turn(request(channel, "GUEST-WORDS-41 four"))
            .await
            .reply;
        assert_eq!(r.text.as_deref(), Some("done"), "{r:?}");
        // Each call counted once: the summarizer's that timed out too (its charge, dropped
        // unsettled, counted it a second time).
        assert_eq!(
            r.usage.unwrap().model_calls,
            3,
            "summarizer (timed out), model (503), answer"
        );
        let summary = session(&env, channel)["summary"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(summary.starts_with("Plain summary"), "{summary}");
        assert!(
            summary.contains("MAIN-SUMMARY-TWO"),
            "the previous summary is kept"
        );

        let main = model.requests();
        let summaries: Vec<bool> = main.iter().map(|m| is_summary_request(&m.json())).collect();
        assert_eq!(
            summaries,
            vec![false, true, false, true, false, true, false],
            "the main model got each fallback summary request"
        );
        assert_eq!(sum.requests().len(), 3);

        let h = hash(channel);
        let fell = logs.lines(&["WARN", "compaction fell back", &format!("channel={h}")]);
        let expected = [
            (
                "reason=the summarizer returned HTTP 500",
                "fallback=\"main model\"",
            ),
            (
                "reason=the summarizer answer is not a chat completion",
                "fallback=\"main model\"",
            ),
            (
                "reason=the summarizer timed out after 2s",
                "fallback=\"main model\"",
            ),
            (
                "reason=the model returned HTTP 503",
                "fallback=\"plain summary\"",
            ),
        ];
        assert_eq!(fell.len(), expected.len(), "{}", logs.text());
        for (line, (reason, fallback)) in fell.iter().zip(expected) {
            assert!(line.contains(reason), "{line}");
            assert!(line.contains(fallback), "{line}");
            assert!(tokens_before(line) > BUDGET, "{line}");
        }
        let all = logs.text();
        assert!(!all.contains("GUEST-WORDS-41"), "guest text was logged");
        assert!(
            !all.contains("UPSTREAM-WORDS-93"),
            "upstream text was logged"
        );
        assert!(!all.contains(SUM_KEY) && !all.contains(KEY));
        assert_no_leftovers(&sandbox).await;
    });
}

/// A summarizer configured without a key: logged once at startup, then every compaction
/// goes through the main model (each fallback logged), the summarizer is never called.
#[test]
fn a_summarizer_without_a_key_is_logged_once_and_compaction_falls_back() {
    with_logs(|logs| async move {
        let env = Env::new();
        let channel = "#sum-keyless";
        let model = ScriptedModel::start(vec![Step::text(&long("alpha"))]).await;
        let sum = ScriptedModel::start(vec![Step::text("never")]).await;
        let source = "environment variable RTS_KEYLESS_SUMMARIZER_TEST";
        let sandbox = Sandbox::new(config(
            &env,
            &model,
            Some(summarizer(&sum, ApiKey::None, source)),
        ))
        .await
        .unwrap();
        assert!(sandbox.run_turn(request(channel, "one")).await.reply.ok);
        for (i, tag) in ["beta", "gamma"].into_iter().enumerate() {
            model.push(Step::text(&format!("MAIN-SUMMARY-{i}")));
            model.push(Step::text(&long(tag)));
            let r = sandbox.run_turn(request(channel, tag)).await.reply;
            assert!(r.ok, "{r:?}");
            assert!(session(&env, channel)["summary"]
                .as_str()
                .unwrap()
                .starts_with(&format!("MAIN-SUMMARY-{i}")));
        }
        assert!(
            sum.requests().is_empty(),
            "the keyless summarizer was called"
        );
        let startup = logs.lines(&[
            "WARN",
            "compaction summarizer configured without a key",
            source,
        ]);
        assert_eq!(startup.len(), 1, "{}", logs.text());
        let h = hash(channel);
        let fell = logs.lines(&[
            "WARN",
            "compaction fell back",
            &format!("channel={h}"),
            "reason=the summarizer has no key",
        ]);
        assert_eq!(fell.len(), 2, "{}", logs.text());
        assert!(fell.iter().all(|l| tokens_before(l) > BUDGET));
        assert_no_leftovers(&sandbox).await;
    });
}

/// Without `[compaction]` the main model summarises as before; when it fails, the plain
/// summary is used and the fallback is now visible at warn on the host.
#[test]
fn without_a_summarizer_a_failed_summary_is_a_plain_summary_logged_at_warn() {
    with_logs(|logs| async move {
        let env = Env::new();
        let channel = "#no-summarizer";
        let model = ScriptedModel::start(vec![
            Step::text(&long("alpha")),
            Step::Status(500, r#"{"error":"down"}"#.into()),
            Step::text("fine"),
        ])
        .await;
        let sandbox = Sandbox::new(config(&env, &model, None)).await.unwrap();
        assert!(sandbox.run_turn(request(channel, "one")).await.reply.ok);
        let r = sandbox.run_turn(request(channel, "two")).await.reply;
        assert_eq!(r.text.as_deref(), Some("fine"), "{r:?}");
        assert_eq!(r.usage.unwrap().model_calls, 2);
        let summary = session(&env, channel)["summary"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(summary.starts_with("Plain summary"), "{summary}");
        assert!(is_summary_request(&model.requests()[1].json()));
        let fell = logs.lines(&[
            "WARN",
            "compaction fell back",
            &format!("channel={}", hash(channel)),
            "reason=the model returned HTTP 500",
            "fallback=\"plain summary\"",
        ]);
        assert_eq!(fell.len(), 1, "{}", logs.text());
        assert!(tokens_before(&fell[0]) > BUDGET);
        assert_no_leftovers(&sandbox).await;
    });
}

// ---------------------------------------------------------------- the route itself

fn policy(model: &ScriptedModel, compaction: Option<CompactionModel>) -> BrokerPolicy {
    BrokerPolicy {
        compaction,
        ..broker_policy(&model.url(), KEY)
    }
}

fn compact_request(tokens_before: u64) -> CompactRequest {
    let older = vec![
        Message::User {
            content: "ann: GUEST-WORDS-41 keep the door code".into(),
        },
        Message::Assistant {
            content: Some("kept".into()),
            tool_calls: vec![],
        },
    ];
    CompactRequest::new(Some("PREVIOUS"), &older, tokens_before, BUDGET)
}

/// The calls of a compaction count against the turn's model calls (3 here), the
/// summarizer's included; once they are used up the route refuses (`429`, logged) instead
/// of serving the plain summary, and both keys are redacted from what is returned.
#[test]
fn compaction_calls_count_against_the_turn_and_keys_are_redacted() {
    with_logs(|logs| async move {
        let model = ScriptedModel::start(vec![Step::EchoKey]).await;
        let sum = ScriptedModel::start(vec![Step::EchoKey]).await;
        let mut p = policy(
            &model,
            Some(summarizer(&sum, ApiKey::from_static(SUM_KEY), "test")),
        );
        p.limits.max_model_calls = 3;
        let broker = start_broker(p).await;
        let mut turn = BrokerTurn::start(&broker, "chan-budget", Speaker::default()).await;
        let socket = turn.socket.clone();
        let body = serde_json::to_value(compact_request(4321)).unwrap();

        // 1: the summarizer echoes its key: redacted.
        let a = client::post_json(&socket, "/v1/compact", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let reply: CompactReply = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(reply.source, CompactSource::Summarizer);
        assert_eq!(reply.usage.model_calls, 1);
        assert!(
            reply.summary.starts_with("I saw Bearer [redacted]"),
            "{}",
            reply.summary
        );
        assert!(!a.text().contains(SUM_KEY));
        // 2: the summarizer fails (its script is used up); the main model echoes its key.
        let a = client::post_json(&socket, "/v1/compact", &body).await;
        let reply: CompactReply = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(reply.source, CompactSource::Model, "{reply:?}");
        assert_eq!(reply.usage.model_calls, 2);
        assert!(
            reply.summary.starts_with("I saw Bearer [redacted]"),
            "{}",
            reply.summary
        );
        assert!(!a.text().contains(KEY));
        // 3 and 4: the turn's model calls are used up: refused, no upstream call, no
        // plain summary.
        for _ in 0..2 {
            let a = client::post_json(&socket, "/v1/compact", &body).await;
            assert_eq!(a.status, 429, "{}", a.text());
            assert_eq!(a.error(), "too many model calls in this turn (limit 3)");
        }
        assert_eq!(sum.requests().len(), 2);
        assert_eq!(model.requests().len(), 1);
        // And a model call of the same turn is refused: the compactions counted.
        let a = client::post_json(
            &socket,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(a.status, 429, "{}", a.text());
        let refused = logs.lines(&[
            "compaction request refused",
            "reason=too many model calls in this turn (limit 3)",
            &format!("channel={}", hash("chan-budget")),
        ]);
        assert_eq!(refused.len(), 1, "{}", logs.text());
        assert!(!logs.text().contains("GUEST-WORDS-41"));
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// A summary cut at the guest's budget (192 bytes for a budget of 256) never ends in a
/// piece of an echoed key: the answer is redacted before it is cut, and a tail that may be
/// the start of a key is dropped with the cut.
#[test]
fn a_summary_cut_inside_an_echoed_key_shows_no_piece_of_it() {
    with_logs(|_logs| async move {
        let model = ScriptedModel::start(vec![Step::EchoKeyAfter(170)]).await;
        let broker = start_broker(policy(&model, None)).await;
        let mut turn = BrokerTurn::start(&broker, "chan-cut", Speaker::default()).await;
        let mut request = compact_request(4321);
        request.budget = 256;
        let body = serde_json::to_value(&request).unwrap();
        let a = client::post_json(&turn.socket, "/v1/compact", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let reply: CompactReply = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(reply.source, CompactSource::Model, "{reply:?}");
        assert!(
            reply.summary.starts_with(&"x".repeat(170)),
            "{}",
            reply.summary
        );
        // The key's first 6 bytes, "sk-mai", are all a cut at 192 bytes could leave.
        assert!(!reply.summary.contains(&KEY[..6]), "{}", reply.summary);
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// Past `max_compactions` (2 here) a turn's compactions are refused `429` naming the limit,
/// with model calls to spare; a refusal for the calls in flight does not use one up.
#[test]
fn compactions_past_the_turns_cap_are_refused() {
    with_logs(|logs| async move {
        let model = ScriptedModel::start(vec![Step::text("ONE"), Step::text("TWO")]).await;
        let mut p = policy(&model, None);
        p.limits.max_compactions = 2;
        let broker = start_broker(p).await;
        let mut turn = BrokerTurn::start(&broker, "chan-cap", Speaker::default()).await;
        let body = serde_json::to_value(compact_request(9)).unwrap();
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(client::post_json(&turn.socket, "/v1/compact", &body).await);
        }
        let seen = outcomes(&seen);
        let refused = (
            429,
            "too many compactions in this turn (limit 2)".to_owned(),
        );
        assert_eq!(
            seen,
            [
                (200, "Model".to_owned()),
                (200, "Model".to_owned()),
                refused.clone(),
                refused
            ]
        );
        assert_eq!(model.requests().len(), 2);
        // The turn's chat calls are not touched: 30 of 32 left.
        model.push(Step::text("chat"));
        let a = client::post_json(
            &turn.socket,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(
            logs.lines(&["compaction request refused", "too many compactions"])
                .len(),
            1,
            "{}",
            logs.text()
        );
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// A turn's compaction refusals past its first `FREE_REFUSALS` are each answered after
/// `REFUSAL_PAUSE` (the bench's hostile compaction attack: retries at once made another
/// channel ×4.4 slower unpaced). A lower bound of the sleeps: load only makes it longer.
#[test]
fn compaction_refusals_past_the_first_few_are_paced() {
    use roundtable_sandbox::internals::broker::{FREE_REFUSALS, REFUSAL_PAUSE};
    with_logs(|_| async move {
        let model = ScriptedModel::start(vec![Step::text("ONE")]).await;
        let mut p = policy(&model, None);
        p.limits.max_compactions = 1;
        let broker = start_broker(p).await;
        let mut turn = BrokerTurn::start(&broker, "chan-paced", Speaker::default()).await;
        let body = serde_json::to_value(compact_request(9)).unwrap();
        let a = client::post_json(&turn.socket, "/v1/compact", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let paced = 20;
        let started = std::time::Instant::now();
        for _ in 0..FREE_REFUSALS + paced {
            let a = client::post_json(&turn.socket, "/v1/compact", &body).await;
            assert_eq!(a.status, 429, "{}", a.text());
        }
        let took = started.elapsed();
        assert!(
            took >= REFUSAL_PAUSE * paced,
            "{} refusals took {took:?}: the last {paced} were not paced",
            FREE_REFUSALS + paced
        );
        assert_eq!(model.requests().len(), 1);
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// Malformed, oversized or unchecked requests are refused (the guest then builds the
/// plain summary) and logged at warn with the channel's hash, no guest text.
#[test]
fn bad_compaction_requests_are_refused_and_logged() {
    with_logs(|logs| async move {
        let model = ScriptedModel::start(vec![]).await;
        let mut p = policy(&model, None);
        p.limits.max_request_bytes = 64 * 1024;
        let broker = start_broker(p).await;
        let mut turn = BrokerTurn::start(&broker, "chan-bad", Speaker::default()).await;
        let socket = turn.socket.clone();
        let a = client::post_json(
            &socket,
            "/v1/compact",
            &json!({"messages": [], "tokensBefore": 1, "budget": 1, "apiKey": "GUEST-WORDS-41"}),
        )
        .await;
        assert_eq!(a.status, 400);
        assert!(
            a.error()
                .starts_with("malformed compaction request: unknown field `apiKey`"),
            "{}",
            a.error()
        );
        let mut bad = compact_request(1);
        bad.reload = vec!["a\u{202e}b".into()];
        let a =
            client::post_json(&socket, "/v1/compact", &serde_json::to_value(&bad).unwrap()).await;
        assert_eq!(a.status, 400);
        assert_eq!(
            a.error(),
            "invalid compaction request: a file to reload is not a clean path"
        );
        let mut big = compact_request(1);
        big.messages[0] = Message::User {
            content: "GUEST-WORDS-41 ".repeat(10_000),
        };
        let a =
            client::post_json(&socket, "/v1/compact", &serde_json::to_value(&big).unwrap()).await;
        assert_eq!(a.status, 413);
        assert_eq!(
            a.error(),
            "compaction request too large (limit 65536 bytes)"
        );
        let a = client::send(&socket, "GET", "/v1/compact", &[], "").await;
        assert_eq!(a.unwrap().0, 405);
        let refused = logs.lines(&[
            "WARN",
            "compaction request refused",
            &format!("channel={}", hash("chan-bad")),
        ]);
        assert_eq!(refused.len(), 4, "{}", logs.text());
        assert!(!logs.text().contains("GUEST-WORDS-41"));
        assert!(model.requests().is_empty());
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

// ---------------------------------------------------------------- the per-turn caps

/// The status and error (or source) of each answer.
fn outcomes(answers: &[client::Answer]) -> Vec<(u16, String)> {
    answers
        .iter()
        .map(|a| {
            let what = if a.status == 200 {
                format!(
                    "{:?}",
                    serde_json::from_slice::<CompactReply>(&a.body)
                        .unwrap()
                        .source
                )
            } else {
                a.error()
            };
            (a.status, what)
        })
        .collect()
}

/// 16 compactions of one turn at once: one reaches the upstream at a time, the others are
/// refused `429` (before: all 16 were upstream at once); with the turn's calls in flight
/// taken by 4 hung chat calls, a compaction is refused `429` naming that limit.
#[test]
fn compactions_hold_the_calls_in_flight_cap() {
    with_logs(|_logs| async move {
        let model = ScriptedModel::start(
            (0..16)
                .map(|_| Step::delayed(Duration::from_millis(1500), Step::text("SUMMARY-OK")))
                .collect(),
        )
        .await;
        let mut p = policy(&model, None);
        p.limits.max_compactions = 16;
        let broker = start_broker(p).await;
        let mut turn = BrokerTurn::start(&broker, "chan-flight", Speaker::default()).await;
        let body = serde_json::to_value(compact_request(100)).unwrap();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..16 {
            let socket = turn.socket.clone();
            let body = body.clone();
            set.spawn(async move { client::post_json(&socket, "/v1/compact", &body).await });
        }
        let mut answers = Vec::new();
        while let Some(a) = set.join_next().await {
            answers.push(a.unwrap());
        }
        let seen = outcomes(&answers);
        assert_eq!(model.peak_in_flight(), 1, "upstream at once: {seen:?}");
        let refused = seen
            .iter()
            .filter(|(s, e)| *s == 429 && e == "a compaction is already in flight in this turn")
            .count();
        let served = seen
            .iter()
            .filter(|(s, e)| *s == 200 && e == "Model")
            .count();
        assert!(refused >= 1 && served >= 1, "{seen:?}");
        assert_eq!(refused + served, 16, "{seen:?}");

        // The turn's 4 calls in flight held by hung chat calls: the compaction gets none.
        let hung = ScriptedModel::start((0..4).map(|_| Step::Hang).collect()).await;
        let mut p = policy(&hung, None);
        p.limits.max_compactions = 16;
        let broker = start_broker(p).await;
        let mut turn2 = BrokerTurn::start(&broker, "chan-flight-2", Speaker::default()).await;
        let mut chats = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let socket = turn2.socket.clone();
            chats.spawn(async move {
                client::post_json(
                    &socket,
                    "/v1/chat/completions",
                    &json!({"messages": [{"role": "user", "content": "hang"}]}),
                )
                .await
            });
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while hung.requests().len() < 4 {
            assert!(
                std::time::Instant::now() < deadline,
                "the chat calls never arrived"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let a = client::post_json(&turn2.socket, "/v1/compact", &body).await;
        assert_eq!(a.status, 429, "{}", a.text());
        assert_eq!(a.error(), "too many calls in flight in this turn (limit 4)");
        assert_eq!(
            hung.requests().len(),
            4,
            "the compaction reached no upstream"
        );
        chats.abort_all();
        turn2.listener.take().unwrap().stop().await.unwrap();
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// The compaction request's JSON values are counted before it is parsed, like tool
/// arguments: 100,000 reload entries (400 KB) are refused unparsed.
#[test]
fn a_compaction_request_that_would_inflate_is_refused_before_parsing() {
    with_logs(|_logs| async move {
        let model = ScriptedModel::start(vec![]).await;
        let broker = start_broker(policy(&model, None)).await;
        let mut turn = BrokerTurn::start(&broker, "chan-values", Speaker::default()).await;
        let mut body = String::from(
            r#"{"messages":[{"role":"user","content":"x"}],"tokensBefore":1,"budget":1,"reload":["a""#,
        );
        body.push_str(&r#","a""#.repeat(100_000));
        body.push_str("]}");
        let a = client::post(
            &turn.socket,
            "/v1/compact",
            &[("content-type", "application/json")],
            body,
        )
        .await
        .unwrap();
        assert_eq!(a.status, 400, "{}", a.text());
        assert_eq!(
            a.error(),
            "compaction request too complex (more than 65536 JSON values)"
        );
        assert!(model.requests().is_empty());
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// A message of the request with more tool calls than a guest keeps is refused.
#[test]
fn a_compaction_request_with_too_many_tool_calls_in_a_message_is_refused() {
    with_logs(|_logs| async move {
        let model = ScriptedModel::start(vec![Step::text("SUMMARY")]).await;
        let broker = start_broker(policy(&model, None)).await;
        let mut turn = BrokerTurn::start(&broker, "chan-calls", Speaker::default()).await;
        let calls: Vec<Value> = (0..100)
            .map(|i| json!({"id": format!("c{i}"), "type": "function", "function": {"name": "read", "arguments": "{}"}}))
            .collect();
        let body = json!({
            "messages": [{"role": "assistant", "content": null, "tool_calls": calls}],
            "tokensBefore": 1,
            "budget": BUDGET,
        });
        let a = client::post_json(&turn.socket, "/v1/compact", &body).await;
        assert_eq!(a.status, 400, "{}", a.text());
        assert_eq!(
            a.error(),
            "invalid compaction request: a message has too many tool calls (100 > 32)"
        );
        assert!(model.requests().is_empty());
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// A 4 MB answer from the summarizer and from the main model is not parsed: each is a
/// logged fallback (the answer cap named), the plain summary is returned; an answer under
/// the cap is cut to the summary's size.
#[test]
fn a_huge_compaction_answer_falls_back_without_being_parsed() {
    with_logs(|logs| async move {
        let model = ScriptedModel::start(vec![Step::Huge(4_000_000)]).await;
        let sum = ScriptedModel::start(vec![Step::Huge(4_000_000), Step::Huge(200_000)]).await;
        let p = policy(
            &model,
            Some(summarizer(&sum, ApiKey::from_static(SUM_KEY), "test")),
        );
        let broker = start_broker(p).await;
        let mut turn = BrokerTurn::start(&broker, "chan-huge", Speaker::default()).await;
        let body = serde_json::to_value(compact_request(77)).unwrap();
        let a = client::post_json(&turn.socket, "/v1/compact", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let reply: CompactReply = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(
            reply.source,
            CompactSource::Plain,
            "{}",
            reply.summary.len()
        );
        for who in ["summarizer", "model"] {
            let lines = logs.lines(&[
                "compaction fell back",
                &format!("reason=the {who} answer is larger than 262144 bytes"),
                "tokens_before=77",
            ]);
            assert_eq!(lines.len(), 1, "{who}: {}", logs.text());
        }
        // 200 KB: under the cap, parsed, cut to the summary's size (1,500 bytes and the mark).
        let a = client::post_json(&turn.socket, "/v1/compact", &body).await;
        let reply: CompactReply = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(reply.source, CompactSource::Summarizer);
        assert!(reply.summary.len() < 1600, "{}", reply.summary.len());
        turn.listener.take().unwrap().stop().await.unwrap();
    });
}

/// A flood of compactions past the turn's budget: each is refused, and the warn lines are
/// rate-limited (one per reason per window, the rest counted and reported once when the
/// turn ends), not one per request.
#[test]
fn warn_lines_are_bounded_under_a_compaction_flood() {
    with_logs(|logs| async move {
        let model = ScriptedModel::start(vec![Step::text("SUMMARY-ONE")]).await;
        let mut p = policy(&model, None);
        p.limits.max_model_calls = 1;
        let broker = start_broker(p).await;
        let mut turn = BrokerTurn::start(&broker, "chan-flood", Speaker::default()).await;
        let body = serde_json::to_value(compact_request(5)).unwrap();
        let mut seen = Vec::new();
        for _ in 0..200 {
            seen.push(client::post_json(&turn.socket, "/v1/compact", &body).await);
        }
        let seen = outcomes(&seen);
        assert_eq!(seen[0], (200, "Model".to_owned()));
        assert!(
            seen[1..].iter().all(|o| *o
                == (
                    429,
                    "too many model calls in this turn (limit 1)".to_owned()
                )),
            "{:?}",
            &seen[1..4]
        );
        assert_eq!(model.requests().len(), 1);
        turn.listener.take().unwrap().stop().await.unwrap();
        drop(broker);
        let warns = logs.lines(&["WARN", "compaction"]);
        assert!(
            warns.len() <= 4,
            "{} warn lines:\n{}",
            warns.len(),
            logs.text()
        );
        let suppressed = logs.lines(&[
            "compaction warn lines suppressed",
            &format!("channel={}", hash("chan-flood")),
        ]);
        assert_eq!(suppressed.len(), 1, "{}", logs.text());
        assert!(
            suppressed[0].contains("suppressed=19") || suppressed[0].contains("suppressed=198"),
            "{}",
            suppressed[0]
        );
    });
}
