//! The broker against a hostile guest and a leaky upstream, over real sockets: only
//! allow-listed chat-completions fields reach the model (token caps clamped), the caps on
//! calls in flight and on connections refuse with a clear message, no piece of a declared
//! secret leaves (the key at every offset across chunk boundaries, at the byte cap, at the
//! error snippet's cut, on the timeout and stream-failure paths; in host-tool and MCP
//! results), and plain HTTP only to loopback.

use roundtable_sandbox_test_support::{broker_client as client, mcp_stub};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use roundtable_sandbox::internals::broker::{BoxFuture, Broker, BrokerPolicy};
use roundtable_sandbox::internals::config::{ApiKey, ApiKeyProvider, BrokerLimits};
use roundtable_sandbox::internals::testing::{broker_policy, start_broker, BrokerTurn, FnTool};
use roundtable_sandbox::Speaker;
use roundtable_sandbox_test_support::broker_client::{post, post_json};
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use secrecy::SecretString;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The model key: no 3-byte piece of it occurs in any text the tests build around it.
const KEY: &str = "Zq7Xk2Wv9Pm4Rt8Yn3Ls";
const CHAT: &str = "/v1/chat/completions";

fn policy(model_url: &str) -> BrokerPolicy {
    broker_policy(model_url, KEY)
}

/// A turn of Mallory in `chan-h`.
async fn start_turn(broker: &Arc<Broker>) -> BrokerTurn {
    let mallory = Speaker {
        id: "u-1".into(),
        name: "Mallory".into(),
    };
    BrokerTurn::start(broker, "chan-h", mallory).await
}

/// A turn of a broker whose upstream answers with `steps`, one a call (up to 1000 model
/// calls in the turn): the model, the broker and the turn, each to be kept.
async fn scripted_turn(steps: Vec<Step>) -> (ScriptedModel, Arc<Broker>, BrokerTurn) {
    let model = ScriptedModel::start(steps).await;
    let mut p = policy(&model.url());
    p.limits.max_model_calls = 1000;
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    (model, broker, turn)
}

/// Every 3-byte piece of the key found in `text`.
fn key_pieces(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    KEY.as_bytes()
        .windows(3)
        .filter(|w| bytes.windows(3).any(|b| b == *w))
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect()
}

/// Reads a streamed answer to its end.
async fn read_stream(socket: &Path, body: &serde_json::Value) -> (u16, String) {
    let (status, _, mut incoming) = client::post_stream(socket, CHAT, body).await;
    let all = client::read_rest(&mut incoming).await;
    (status, String::from_utf8_lossy(&all).into_owned())
}

fn streamed() -> serde_json::Value {
    json!({"stream": true, "messages": [{"role": "user", "content": "hi"}]})
}

/// The SSE error event the broker ends a failed stream with.
fn error_event(message: &str) -> String {
    format!("\n\ndata: {}\n\n", json!({"error": {"message": message}}))
}

// ------------------------------------------------------------ 1. only known fields

#[tokio::test]
async fn fields_outside_the_allow_list_are_refused_naming_the_field() {
    let model = ScriptedModel::start(vec![]).await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;
    let fields = [
        ("models", json!(["openai/gpt-4o", "anthropic/claude-opus"])),
        ("route", json!("fallback")),
        ("provider", json!({"order": ["expensive"]})),
        ("plugins", json!([{"id": "web"}])),
        ("n", json!(64)),
        ("service_tier", json!("priority")),
        ("store", json!(true)),
        ("metadata", json!({"who": "guest"})),
        ("logit_bias", json!({"1": 100})),
        ("base_url", json!("http://evil.example/v1")),
        ("api_key", json!("sk-guest")),
        ("user", json!("someone-else")),
        ("Messages", json!([])),
    ];
    for (field, value) in fields {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body[field] = value;
        let a = post_json(turn.socket(), CHAT, &body).await;
        assert_eq!(a.status, 400, "{field}: {}", a.text());
        assert_eq!(a.error(), format!("request field not allowed: {field}"));
    }
    // A long field name is cut in the message.
    let long = "x".repeat(500);
    let a = post(turn.socket(), CHAT, &[], format!("{{\"{long}\":1}}"))
        .await
        .unwrap();
    assert_eq!(a.status, 400);
    assert_eq!(
        a.error(),
        format!("request field not allowed: {}", "x".repeat(64))
    );
    assert!(
        model.requests().is_empty(),
        "a refused call reached the upstream"
    );
}

#[tokio::test]
async fn allowed_fields_pass_unchanged_and_the_model_is_forced() {
    let model = ScriptedModel::start(vec![Step::text("ok")]).await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;
    let body = json!({
        "model": "guest-picked",
        "messages": [{"role": "user", "content": "hi \u{e9} \"q\""}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "stream": false,
        "stream_options": null,
        "temperature": 0.25,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 7,
        "response_format": {"type": "json_object"},
        "max_tokens": 100,
        "max_completion_tokens": 200
    });
    let a = post_json(turn.socket(), CHAT, &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let got = model.requests()[0].json();
    let mut want = body.clone();
    want["model"] = json!("configured-model");
    assert_eq!(got, want);
}

#[tokio::test]
async fn token_caps_are_clamped_and_set_when_absent() {
    let model = ScriptedModel::start((0..5).map(|_| Step::text("ok")).collect()).await;
    let mut p = policy(&model.url());
    p.model_request.max_tokens = 1000;
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            json!({"messages": msgs, "max_tokens": 1_000_000_000u64}),
            json!({"max_tokens": 1000}),
        ),
        (
            json!({"messages": msgs, "max_completion_tokens": 5000}),
            json!({"max_completion_tokens": 1000}),
        ),
        (
            json!({"messages": msgs, "max_tokens": 10, "max_completion_tokens": 99999}),
            json!({"max_tokens": 10, "max_completion_tokens": 1000}),
        ),
        (json!({"messages": msgs}), json!({"max_tokens": 1000})),
        (
            json!({"messages": msgs, "max_tokens": null}),
            json!({"max_tokens": 1000}),
        ),
    ];
    for (i, (body, want)) in cases.iter().enumerate() {
        let a = post_json(turn.socket(), CHAT, body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let got = model.requests()[i].json();
        for field in ["max_tokens", "max_completion_tokens"] {
            assert_eq!(
                got.get(field),
                want.get(field),
                "case {i}: {field} in {got}"
            );
        }
    }
    for bad in [json!(-1), json!(1.5), json!("100"), json!([1])] {
        let a = post_json(
            turn.socket(),
            CHAT,
            &json!({"messages": msgs, "max_tokens": bad}),
        )
        .await;
        assert_eq!(a.status, 400);
        assert_eq!(a.error(), "max_tokens must be a non-negative integer");
    }
    let a = post_json(
        turn.socket(),
        CHAT,
        &json!({"messages": msgs, "stream": "yes"}),
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(a.error(), "stream must be true or false");
    let a = post(turn.socket(), CHAT, &[], "[1,2]").await.unwrap();
    assert_eq!(a.status, 400);
    assert_eq!(a.error(), "the request body must be a JSON object");
    assert_eq!(model.requests().len(), cases.len());
}

#[tokio::test]
async fn the_operator_can_extend_the_allow_list() {
    let model = ScriptedModel::start(vec![Step::text("ok")]).await;
    let mut p = policy(&model.url());
    p.model_request.extra_fields = vec!["reasoning_effort".into()];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let body = json!({"messages": [], "reasoning_effort": "low"});
    let a = post_json(turn.socket(), CHAT, &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(model.requests()[0].json()["reasoning_effort"], "low");
    let a = post_json(
        turn.socket(),
        CHAT,
        &json!({"messages": [], "models": ["x"]}),
    )
    .await;
    assert_eq!(a.error(), "request field not allowed: models");
}

#[tokio::test]
async fn duplicate_fields_reach_the_upstream_once() {
    let model = ScriptedModel::start(vec![Step::text("ok")]).await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;
    let raw = r#"{"model":"a","messages":[],"model":"b","temperature":1,"temperature":0.5}"#;
    let a = post(turn.socket(), CHAT, &[], raw).await.unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    let body = String::from_utf8(model.requests()[0].body.clone()).unwrap();
    assert_eq!(body.matches("\"model\"").count(), 1, "{body}");
    assert_eq!(body.matches("\"temperature\"").count(), 1, "{body}");
    assert_eq!(model.requests()[0].json()["model"], "configured-model");
}

// ------------------------------------------------------------ 2. caps

/// A host tool that waits until cancelled.
fn waits() -> FnTool {
    FnTool::new("waits", "waits", |_, _| std::future::pending())
}

#[tokio::test]
async fn calls_in_flight_past_the_cap_are_refused_with_429() {
    let model = ScriptedModel::start((0..8).map(|_| Step::Hang).collect()).await;
    let mut p = policy(&model.url());
    p.tools = vec![Arc::new(waits())];
    assert_eq!(p.limits.max_calls_in_flight, 4, "the default");
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let body = json!({"messages": []}).to_string();
    // Three model calls and one tool call hang: four in flight.
    let mut held = Vec::new();
    for _ in 0..3 {
        let socket = turn.socket().to_owned();
        let body = body.clone();
        held.push(tokio::spawn(
            async move { post(&socket, CHAT, &[], body).await },
        ));
    }
    let socket = turn.socket().to_owned();
    held.push(tokio::spawn(async move {
        post(&socket, "/v1/tools/waits", &[], "{}").await
    }));
    let deadline = Instant::now() + Duration::from_secs(30);
    while model.requests().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the calls never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The tool call is admitted once its permit is taken; poll until the fifth is refused.
    let refused = loop {
        let a = post(turn.socket(), CHAT, &[], body.clone()).await.unwrap();
        if a.status == 429 {
            break a;
        }
        assert!(
            Instant::now() < deadline,
            "a fifth call in flight was admitted: {}",
            a.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        refused.error(),
        "too many calls in flight in this turn (limit 4)"
    );
    let a = post(turn.socket(), "/v1/tools/waits", &[], "{}")
        .await
        .unwrap();
    assert_eq!(a.status, 429);
    assert_eq!(a.error(), "too many calls in flight in this turn (limit 4)");
    assert_eq!(
        model.requests().len(),
        3,
        "a refused call reached the upstream"
    );
    // A refusal does not use up the turn's call budget, and a finished call frees its slot.
    held.pop().unwrap().abort();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let socket = turn.socket().to_owned();
        let body = body.clone();
        let next = tokio::spawn(async move { post(&socket, CHAT, &[], body).await });
        // Admitted, it hangs upstream like the others; refused, it is answered at once.
        while !next.is_finished() && model.requests().len() < 4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if model.requests().len() == 4 {
            held.push(next);
            break;
        }
        let a = next.await.unwrap().unwrap();
        assert_eq!(a.status, 429, "{}", a.text());
        assert!(Instant::now() < deadline, "the freed slot was never reused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for h in held {
        h.abort();
    }
}

/// Reads what the broker wrote on a raw connection until it closes or `limit` passes.
async fn read_all(s: &mut tokio::net::UnixStream, limit: Duration) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A raw connection to `socket` that has sent `bytes`.
async fn connect_sending(socket: &Path, bytes: &[u8]) -> tokio::net::UnixStream {
    let mut s = tokio::net::UnixStream::connect(socket).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s
}

#[tokio::test]
async fn connections_past_the_cap_are_refused_with_503() {
    let broker = start_broker(policy("http://127.0.0.1:9/v1")).await;
    assert_eq!(BrokerLimits::default().max_connections, 16, "the default");
    let turn = start_turn(&broker).await;
    // Sixteen idle connections (each sends half a request head and waits).
    let mut idle = Vec::new();
    for _ in 0..16 {
        idle.push(connect_sending(turn.socket(), b"POST /v1/chat/completions HTTP/1.1\r\n").await);
    }
    // The accept loop takes them in order: the seventeenth is answered 503 and closed.
    let mut s = tokio::net::UnixStream::connect(turn.socket())
        .await
        .unwrap();
    let answer = read_all(&mut s, Duration::from_secs(30)).await;
    assert!(
        answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{answer:?}"
    );
    assert!(
        answer.ends_with(r#"{"error":"too many connections in this turn (limit 16)"}"#),
        "{answer:?}"
    );
    // One closed frees a place: a request on a new connection is served again.
    drop(idle.pop());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut s = connect_sending(
            turn.socket(),
            b"GET /nowhere HTTP/1.1\r\nhost: b\r\nconnection: close\r\n\r\n",
        )
        .await;
        let answer = read_all(&mut s, Duration::from_secs(10)).await;
        if answer.starts_with("HTTP/1.1 404") {
            break;
        }
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
        assert!(
            Instant::now() < deadline,
            "the freed connection place was never reused"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A guest that reconnects at once past the cap (the bench's hostile egress attack: some
/// 22,000 refused connections a second made another channel ×5 slower) is paced: past the
/// turn's first `FREE_REFUSALS` refused connections, each 503 is written after
/// `REFUSAL_PAUSE`. (A lower bound of the sleeps: load only makes it longer.)
#[tokio::test]
async fn refused_connections_past_the_first_few_are_paced() {
    use roundtable_sandbox::internals::broker::{FREE_REFUSALS, REFUSAL_PAUSE};
    let broker = start_broker(policy("http://127.0.0.1:9/v1")).await;
    let turn = start_turn(&broker).await;
    let mut idle = Vec::new();
    for _ in 0..16 {
        idle.push(connect_sending(turn.socket(), b"POST /v1/chat/completions HTTP/1.1\r\n").await);
    }
    let paced = 20;
    let started = Instant::now();
    for _ in 0..FREE_REFUSALS + paced {
        let mut s = tokio::net::UnixStream::connect(turn.socket())
            .await
            .unwrap();
        let answer = read_all(&mut s, Duration::from_secs(30)).await;
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer:?}");
    }
    let took = started.elapsed();
    assert!(
        took >= REFUSAL_PAUSE * paced,
        "{} refused connections took {took:?}: the last {paced} were not paced",
        FREE_REFUSALS + paced
    );
    drop(idle);
}

/// A host tool that says what it was given.
fn echo() -> FnTool {
    FnTool::new("echo", "echo", |args, _| async move {
        Ok(args["say"].as_str().unwrap_or("?").to_owned())
    })
    .with_secret("tool-secret-Hh6Gg5Ff4")
}

#[tokio::test]
async fn tool_arguments_that_would_inflate_are_refused_before_parsing() {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.tools = vec![Arc::new(echo())];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    // 1 MiB of empty arrays: ~350,000 values, ~16 MiB as a serde_json::Value.
    let mut body = String::from(r#"{"a":["#);
    while body.len() < (1 << 20) - 10 {
        body.push_str("[],");
    }
    body.push_str("[]]}");
    let a = post(turn.socket(), "/v1/tools/echo", &[], body)
        .await
        .unwrap();
    assert_eq!(a.status, 400, "{}", a.text());
    assert_eq!(
        a.error(),
        "tool arguments too complex (more than 65536 JSON values)"
    );
    // 229 KB of `{"":0}` objects: 65,535 values counted one each (it passed), a ~21 MB
    // tree (an object's map node is ~630 bytes): counted 9 each, refused.
    let body = format!(r#"{{"a":[{}]}}"#, vec![r#"{"":0}"#; 32_766].join(","));
    let a = post(turn.socket(), "/v1/tools/echo", &[], body)
        .await
        .unwrap();
    assert_eq!(
        (a.status, a.error()),
        (
            400,
            "tool arguments too complex (more than 65536 JSON values)".to_owned()
        )
    );
    // Rows of a few members each pass (5,000 of them: ~55,000 counted).
    let rows: Vec<_> = (0..5000).map(|i| json!({"id": i, "name": "x"})).collect();
    let a = post_json(
        turn.socket(),
        "/v1/tools/echo",
        &json!({"say": "rows", "rows": rows}),
    )
    .await;
    assert_eq!(a.json()["content"], "rows");
    // Ordinary arguments, and one large string, pass.
    let a = post_json(
        turn.socket(),
        "/v1/tools/echo",
        &json!({"say": "x".repeat(500_000)}),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let a = post_json(
        turn.socket(),
        "/v1/tools/echo",
        &json!({"say": "hi", "list": (0..60_000).collect::<Vec<_>>()}),
    )
    .await;
    assert_eq!(a.json()["content"], "hi");
}

// ------------------------------------------------------------ 4. no piece of the key

#[tokio::test]
async fn the_key_at_every_offset_across_chunk_boundaries_is_redacted() {
    const CHUNK: usize = 8;
    let offsets = 0..CHUNK + KEY.len() + 1;
    let before = |k: usize| format!("data: {}", ".".repeat(k));
    let after = ".tail\n\n";
    let steps = offsets
        .clone()
        .map(|k| {
            let payload = format!("{}{KEY}{after}", before(k));
            let chunks = payload
                .as_bytes()
                .chunks(CHUNK)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            Step::Stream {
                chunks,
                delay: Duration::from_millis(1),
            }
        })
        .collect();
    let (_model, _broker, turn) = scripted_turn(steps).await;
    for k in offsets {
        let (status, text) = read_stream(turn.socket(), &streamed()).await;
        assert_eq!(status, 200);
        assert_eq!(
            text,
            format!("{}[redacted]{after}", before(k)),
            "offset {k}"
        );
    }
}

#[tokio::test]
async fn a_stream_cut_at_the_byte_cap_sends_no_piece_of_the_key() {
    let cap = 1024;
    let mut steps = Vec::new();
    for j in 1..KEY.len() {
        // The first chunk ends with the key's first j bytes; the second passes the cap.
        let first = format!("data: {}{}", ".".repeat(cap - 6 - j - 10), &KEY[..j]);
        let second = format!("{}{}", &KEY[j..], ".".repeat(64));
        steps.push(Step::Stream {
            chunks: vec![first, second],
            delay: Duration::from_millis(1),
        });
    }
    let model = ScriptedModel::start(steps).await;
    let mut p = policy(&model.url());
    p.limits.max_response_bytes = cap;
    p.limits.max_model_calls = 1000;
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    for j in 1..KEY.len() {
        let (status, text) = read_stream(turn.socket(), &streamed()).await;
        assert_eq!(status, 200);
        let want = format!(
            "data: {}{}",
            ".".repeat(cap - 6 - j - 10),
            error_event(&format!("model response too large (limit {cap} bytes)"))
        );
        assert_eq!(text, want, "key cut after {j} bytes");
    }
}

#[tokio::test]
async fn a_stream_that_times_out_or_fails_sends_no_piece_of_the_key() {
    let n = KEY.len() - 1;
    let mut steps = Vec::new();
    let gate = Arc::new(tokio::sync::Notify::new());
    for j in 1..=n {
        steps.push(Step::Gated {
            first: vec![format!("data: .{}", &KEY[..j])],
            gate: gate.clone(),
            rest: vec![],
        });
    }
    for j in 1..=n {
        steps.push(Step::StreamThenFail(vec![format!("data: .{}", &KEY[..j])]));
    }
    let model = ScriptedModel::start(steps).await;
    let mut p = policy(&model.url());
    // Generous for a busy machine: the head must arrive within it, the stall outlasts it.
    p.limits.call_timeout = Duration::from_secs(3);
    p.limits.max_model_calls = 1000;
    let broker = start_broker(p).await;
    // One turn per call, all at once: the stalls overlap.
    let mut set = tokio::task::JoinSet::new();
    let mut turns = Vec::new();
    for _ in 0..n {
        let turn = start_turn(&broker).await;
        let socket = turn.socket().to_owned();
        turns.push(turn);
        set.spawn(async move { read_stream(&socket, &streamed()).await });
    }
    let timed_out = error_event("model stream timed out after 3s");
    while let Some(r) = set.join_next().await {
        let (status, text) = r.unwrap();
        assert_eq!(status, 200);
        assert_eq!(text, format!("data: .{timed_out}"));
    }
    let failed = error_event("model stream failed");
    for _ in 1..=n {
        let turn = start_turn(&broker).await;
        let (status, text) = read_stream(turn.socket(), &streamed()).await;
        assert_eq!(status, 200);
        assert_eq!(text, format!("data: .{failed}"));
    }
}

#[tokio::test]
async fn a_whole_answer_ending_in_part_of_the_key_sends_no_piece_of_it() {
    let steps = (1..KEY.len())
        .map(|j| Step::Status(200, format!("{{\"a\":1}} {}", &KEY[..j])))
        .collect();
    let model = ScriptedModel::start(steps).await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;
    for j in 1..KEY.len() {
        let a = post_json(turn.socket(), CHAT, &json!({"messages": []})).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.text(), "{\"a\":1} [redacted]", "key cut after {j} bytes");
    }
}

#[tokio::test]
async fn the_error_snippet_cut_sends_no_piece_of_the_key() {
    // The upstream's error body is read up to a cut; the key straddles it at every split,
    // after blanks that are trimmed (so the piece would be the snippet's start).
    let cut = 4000;
    let steps = (1..KEY.len())
        .map(|j| Step::Status(500, format!("{}{KEY} more", " ".repeat(cut - j))))
        .chain([Step::Status(500, format!("{{\"error\":\"{KEY}\"}}"))])
        .collect();
    let (_model, _broker, turn) = scripted_turn(steps).await;
    for j in 1..KEY.len() {
        let a = post_json(turn.socket(), CHAT, &json!({"messages": []})).await;
        assert_eq!(a.status, 502);
        let msg = a.error();
        assert!(key_pieces(&msg).is_empty(), "cut after {j}: {msg:?}");
        assert_eq!(msg, "model upstream returned HTTP 500", "cut after {j}");
    }
    let a = post_json(turn.socket(), CHAT, &json!({"messages": []})).await;
    assert_eq!(
        a.error(),
        "model upstream returned HTTP 500: {\"error\":\"[redacted]\"}"
    );
}

struct Provider;

impl ApiKeyProvider for Provider {
    fn key(&self) -> BoxFuture<'_, Result<SecretString, String>> {
        Box::pin(async { Ok(SecretString::from("provided-Kk8Jj7Ii6")) })
    }
}

#[tokio::test]
async fn declared_secrets_are_redacted_from_host_tool_and_mcp_results() {
    let dir = tempfile::tempdir().unwrap();
    let mut stub = mcp_stub::stub_server(dir.path(), &["echo"]);
    let mcp_token = "mcp-token-Qq1Ww2Ee3Rr4";
    // A declared secret (`secret_env`) is redacted whatever its name and length.
    let declared = "Zz9Yy8";
    if let roundtable_sandbox::internals::config::McpTransport::Stdio { env, .. } =
        &mut stub.transport
    {
        env.insert("STUB_API_TOKEN".into(), mcp_token.into());
        env.insert("STUB_PLAIN".into(), declared.into());
    }
    stub.secret_env.insert(
        "STUB_PLAIN".into(),
        roundtable_sandbox::KeyRef {
            env: Some("unused".into()),
            file: None,
        },
    );
    let mut p = policy("http://127.0.0.1:9/v1");
    p.tools = vec![Arc::new(echo())];
    p.mcp = vec![stub];
    p.api_key = ApiKey::from_provider(Provider);
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let secrets = [
        "provided-Kk8Jj7Ii6",
        "tool-secret-Hh6Gg5Ff4",
        mcp_token,
        declared,
    ];
    for secret in secrets {
        let say = format!("<{secret}>");
        let a = post_json(turn.socket(), "/v1/tools/echo", &json!({"say": say})).await;
        assert_eq!(a.json()["content"], "<[redacted]>", "host tool: {secret}");
        let a = post_json(turn.socket(), "/v1/mcp/stub/echo", &json!({"text": say})).await;
        assert_eq!(a.json()["content"], "<[redacted]>", "MCP: {secret}");
    }
}

// ------------------------------------------------------------ 5. plain HTTP only to loopback

#[tokio::test]
async fn plain_http_is_refused_to_any_host_but_loopback() {
    for url in [
        "http://10.0.0.1/v1",
        "http://example.com/v1",
        "http://169.254.169.254/latest",
        "http://[fe80::1]/v1",
        "http://localhost.evil.example/v1",
        "http://0.0.0.0:8080/v1",
    ] {
        let e = roundtable_sandbox::internals::broker::validate_policy(&policy(url)).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("model_url uses http to a host that is not loopback (allow_http covers only 127.0.0.0/8, ::1 and localhost): {url}")
        );
    }
    for url in [
        "http://127.0.0.1:9/v1",
        "http://127.9.8.7/v1",
        "http://[::1]:8080/v1",
        "http://localhost:1234/v1",
        "http://LOCALHOST/v1",
        "https://example.com/v1",
    ] {
        roundtable_sandbox::internals::broker::validate_policy(&policy(url)).unwrap();
    }
}
