//! The broker on the runtime's one event seam: every refusal it answers yields exactly one
//! `Refused` event with its status and the limit that refused; a model call and a tool
//! call yield one event each, with their outcome and latency (the model's token usage
//! from the upstream's answer).

use super::*;
use roundtable_sandbox::events::{BrokerEvent, EventKind, ModelOperation, Refusal};
use roundtable_sandbox::internals::testing::Recorder;

/// A turn of a broker built from `p`, its events recorded.
async fn observed(p: BrokerPolicy) -> (BrokerTurn, Recorder) {
    let broker = start_broker(p).await;
    let seen = Recorder::default();
    let turn =
        BrokerTurn::start_observed(&broker, "chan-1", speaker(), Some(seen.observer())).await;
    (turn, seen)
}

/// A raw connection to the turn's socket that has sent `bytes`.
async fn raw(socket: &Path, bytes: &[u8]) -> tokio::net::UnixStream {
    let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    stream
}

/// The start of what the broker answers on `stream`.
async fn head(stream: &mut tokio::net::UnixStream) -> String {
    let mut buf = vec![0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test]
async fn every_refusal_yields_exactly_one_event_with_its_status_and_limit() {
    let model = ScriptedModel::start(vec![Step::text("a"), Step::text("b")]).await;
    let base = || {
        let mut p = policy(&model.url());
        p.tools = vec![weather().0, waits().0];
        p
    };
    let weather = "/v1/tools/weather";
    let oslo = json!({"city": "Oslo"}).to_string();
    // One refusal per turn: the request, then the (status, limit) it must yield once.
    type Case = (
        BrokerPolicy,
        &'static str,
        &'static str,
        String,
        u16,
        Refusal,
    );
    let mut p_bytes = base();
    p_bytes.limits.max_request_bytes = 4096;
    let cases: Vec<Case> = vec![
        (
            base(),
            "POST",
            "/v1/nothing",
            String::new(),
            404,
            Refusal::UnknownRoute,
        ),
        (
            base(),
            "POST",
            "/v1/tools/nosuch",
            oslo.clone(),
            404,
            Refusal::UnknownRoute,
        ),
        (base(), "GET", weather, String::new(), 405, Refusal::Method),
        (
            p_bytes,
            "POST",
            weather,
            "x".repeat(5000),
            413,
            Refusal::RequestBytes,
        ),
        (
            base(),
            "POST",
            weather,
            "[".repeat(70_000),
            400,
            Refusal::ArgumentComplexity,
        ),
        (
            base(),
            "POST",
            CHAT,
            json!({"messages": [], "route": "fallback"}).to_string(),
            400,
            Refusal::ModelField,
        ),
        (
            base(),
            "POST",
            weather,
            json!({"days": 2}).to_string(),
            400,
            Refusal::ToolArguments,
        ),
        (
            base(),
            "POST",
            weather,
            "{not json".into(),
            400,
            Refusal::Malformed,
        ),
        (
            base(),
            "POST",
            "/v1/compact",
            "{}".into(),
            400,
            Refusal::Compaction,
        ),
    ];
    for (p, method, path, body, status, limit) in cases {
        let (turn, seen) = observed(p).await;
        let (got, _, _) = client::send(turn.socket(), method, path, &[], body)
            .await
            .unwrap();
        assert_eq!(got, status, "{method} {path}");
        assert_eq!(seen.refusals(), vec![(status, limit)], "{method} {path}");
    }

    // One call past the turn's model calls, one past its tool calls.
    let mut p = base();
    p.limits.max_model_calls = 1;
    p.limits.max_tool_calls = 1;
    let (turn, seen) = observed(p).await;
    let s = turn.socket();
    assert_eq!(post_json(s, CHAT, &chat_body(false)).await.status, 200);
    assert_eq!(post_json(s, CHAT, &chat_body(false)).await.status, 429);
    assert_eq!(seen.refusals(), vec![(429, Refusal::ModelCalls)]);
    assert_eq!(
        post(s, weather, &[], oslo.clone()).await.unwrap().status,
        200
    );
    assert_eq!(
        post(s, weather, &[], oslo.clone()).await.unwrap().status,
        429
    );
    assert_eq!(
        seen.refusals(),
        vec![(429, Refusal::ModelCalls), (429, Refusal::ToolCalls)]
    );

    // A call past `max_calls_in_flight`: the one in flight holds its place (the next call
    // sent once the held one runs: sent beside it, the held one could be the refused one).
    let started = Arc::new(AtomicBool::new(false));
    let holds = {
        let started = started.clone();
        FnTool::new("holds", "Holds its place", move |_, _| {
            let started = started.clone();
            async move {
                started.store(true, Ordering::SeqCst);
                std::future::pending::<()>().await;
                Ok(String::new())
            }
        })
    };
    let mut p = base();
    p.tools.push(Arc::new(holds));
    p.limits.max_calls_in_flight = 1;
    p.limits.max_tool_calls = 10_000;
    let (turn, seen) = observed(p).await;
    let socket = turn.socket().to_owned();
    let held = tokio::spawn(async move { post(&socket, "/v1/tools/holds", &[], "{}").await });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !started.load(Ordering::SeqCst) {
        assert!(
            std::time::Instant::now() < deadline,
            "the held call never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let a = post(turn.socket(), weather, &[], oslo.clone())
        .await
        .unwrap();
    assert_eq!(a.status, 429, "{}", a.text());
    assert_eq!(seen.refusals(), vec![(429, Refusal::CallsInFlight)]);
    held.abort();

    // A connection past `max_connections`: answered 503 raw and closed.
    let mut p = base();
    p.limits.max_connections = 1;
    p.limits.max_calls_in_flight = 1;
    let (turn, seen) = observed(p).await;
    let _first = raw(turn.socket(), b"").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut second = raw(turn.socket(), b"").await;
    assert!(head(&mut second).await.starts_with("HTTP/1.1 503"));
    assert_eq!(seen.refusals(), vec![(503, Refusal::Connections)]);

    // A body that does not arrive within `call_timeout`.
    let mut p = base();
    p.limits.call_timeout = Duration::from_millis(300);
    let (turn, seen) = observed(p).await;
    let head_only = b"POST /v1/tools/weather HTTP/1.1\r\nhost: b\r\ncontent-length: 100\r\n\r\n{";
    let mut stream = raw(turn.socket(), head_only).await;
    assert!(head(&mut stream).await.starts_with("HTTP/1.1 408"));
    assert_eq!(seen.refusals(), vec![(408, Refusal::BodyTimeout)]);
}

#[tokio::test]
async fn a_model_call_and_a_tool_call_yield_one_event_each() {
    let model = ScriptedModel::start(vec![Step::text("a")]).await;
    let mut p = policy(&model.url());
    p.tools = vec![weather().0];
    let (turn, seen) = observed(p).await;
    assert_eq!(
        post_json(turn.socket(), CHAT, &chat_body(false))
            .await
            .status,
        200
    );
    let args = json!({"city": "Oslo"});
    assert_eq!(
        post_json(turn.socket(), "/v1/tools/weather", &args)
            .await
            .status,
        200
    );
    let events = seen.broker();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        matches!(&events[0], BrokerEvent::ModelCall { status: 200, usage: Some(u), .. }
            if u.prompt_tokens == Some(1) && u.completion_tokens == Some(1)),
        "{events:?}"
    );
    assert!(
        matches!(&events[1], BrokerEvent::ToolCall { name, mcp: false, ok: true, .. } if name == "weather"),
        "{events:?}"
    );
    // The phases the broker reports, for a progress display.
    let phases = seen
        .all()
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Phase(_)))
        .count();
    assert_eq!(phases, 2);
}

/// Waits (polling, for at most a minute on a loaded machine) until `seen` holds `n` broker
/// events: a stream's event comes when its body is dropped, a hyper answer's when its
/// connection ends, both just after the client has read what it reads.
async fn broker_events(seen: &Recorder, n: usize) -> Vec<BrokerEvent> {
    for _ in 0..600 {
        let events = seen.broker();
        if events.len() >= n {
            return events;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen.broker()
}

#[tokio::test]
async fn a_streamed_model_call_yields_one_event_with_the_usage_chunks_counts() {
    let text = |t: &str| {
        let chunk = json!({"choices": [{"index": 0, "delta": {"content": t}}], "usage": null});
        format!("data: {chunk}\n\n")
    };
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}});
    let chunks = vec![
        text("Hello"),
        text(", world"),
        format!("data: {usage}\n\n"),
        "data: [DONE]\n\n".to_owned(),
    ];
    let model = ScriptedModel::start(vec![Step::Stream {
        chunks,
        delay: Duration::ZERO,
    }])
    .await;
    // Observed without an account: the usage chunk is read for the event alone.
    let (turn, seen) = observed(policy(&model.url())).await;
    let (status, _, mut incoming) =
        client::post_stream(turn.socket(), CHAT, &chat_body(true)).await;
    assert_eq!(status, 200);
    let got = client::read_rest(&mut incoming).await;
    // The guest did not ask for the usage chunk: it is not passed on.
    let got = String::from_utf8(got).unwrap();
    assert!(
        got.contains("world") && !got.contains("prompt_tokens"),
        "{got}"
    );
    let events = broker_events(&seen, 1).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        matches!(&events[0], BrokerEvent::ModelCall {
            operation: ModelOperation::Chat, status: 200, usage: Some(u), .. }
            if u.prompt_tokens == Some(11) && u.completion_tokens == Some(7)),
        "{events:?}"
    );
}

#[tokio::test]
async fn the_compactors_upstream_calls_are_model_call_events_of_their_own_operation() {
    let model = ScriptedModel::start(vec![Step::text("the model's summary")]).await;
    let sum = ScriptedModel::start(vec![Step::text("the summarizer's summary")]).await;
    let mut p = policy(&model.url());
    p.compaction = Some(roundtable_sandbox::internals::config::CompactionModel {
        url: sum.url(),
        model: "sum-model".into(),
        api_key: ApiKey::from_static("sk-sum-events-1"),
        key_source: "test".into(),
        timeout: Duration::from_secs(20),
        allow_http: true,
    });
    let (turn, seen) = observed(p).await;
    let older = vec![
        roundtable_sandbox::protocol::chat::Message::User {
            content: "ann: keep the door code".into(),
        },
        roundtable_sandbox::protocol::chat::Message::Assistant {
            content: Some("kept".into()),
            tool_calls: vec![],
        },
    ];
    let request =
        roundtable_sandbox::protocol::compaction::CompactRequest::new(None, &older, 4000, 2000);
    let body = serde_json::to_value(&request).unwrap();
    // 1: the summarizer answers; 2: its script is used up (500), the main model answers.
    for _ in 0..2 {
        let a = post_json(turn.socket(), "/v1/compact", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let calls: Vec<_> = seen
        .broker()
        .into_iter()
        .map(|e| match e {
            BrokerEvent::ModelCall {
                operation,
                status,
                usage,
                ..
            } => (operation, status, usage.map(|u| u.prompt_tokens)),
            other => panic!("not a model call: {other:?}"),
        })
        .collect();
    assert_eq!(
        calls,
        vec![
            (ModelOperation::CompactionSummarizer, 200, Some(Some(1))),
            (ModelOperation::CompactionSummarizer, 500, None),
            (ModelOperation::CompactionModel, 200, Some(Some(1))),
        ]
    );
    assert_eq!(
        ModelOperation::CompactionSummarizer.key(),
        "compaction_summarizer"
    );
}

#[tokio::test]
async fn a_budget_refusal_is_one_refused_event_naming_the_budget() {
    use roundtable_sandbox::internals::budgets::{Budget, BudgetBook, BudgetSettings, TurnAccount};
    let model = ScriptedModel::start(vec![Step::text("a")]).await;
    let broker = start_broker(policy(&model.url())).await;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let settings = BudgetSettings {
        speaker_tokens_per_day: Some(1),
        state_file: Some(dir.path().join("state.sqlite")),
        ..Default::default()
    };
    let book: Arc<BudgetBook> = BudgetBook::open(&settings, "UTC").unwrap().unwrap();
    let account = Arc::new(TurnAccount::new(
        "u-17",
        &channel_segment("chan-1"),
        Some(book),
    ));
    let seen = Recorder::default();
    let turn = BrokerTurn::start_with(
        &broker,
        "chan-1",
        speaker(),
        Some(seen.observer()),
        Some(account),
    )
    .await;
    // The first call uses the day's token (and more); the second is refused.
    assert_eq!(
        post_json(turn.socket(), CHAT, &chat_body(false))
            .await
            .status,
        200
    );
    let refused = post_json(turn.socket(), CHAT, &chat_body(false)).await;
    assert_eq!(refused.status, 429);
    assert!(
        refused
            .error()
            .starts_with("budget speaker_tokens_per_day exceeded"),
        "{}",
        refused.error()
    );
    assert_eq!(
        seen.refusals(),
        vec![(429, Refusal::Budget(Budget::SpeakerTokensPerDay))]
    );
    // The refused call is no model call.
    let calls = seen
        .broker()
        .iter()
        .filter(|e| matches!(e, BrokerEvent::ModelCall { .. }))
        .count();
    assert_eq!(calls, 1);
}

#[tokio::test]
async fn the_refusals_hyper_answers_itself_are_events_too() {
    let model = ScriptedModel::start(vec![]).await;
    // A head past the broker's 64 KiB cap: hyper answers 431.
    let (turn, seen) = observed(policy(&model.url())).await;
    let mut big = b"POST /v1/tools/weather HTTP/1.1\r\nhost: b\r\nx-big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 70_000));
    big.extend_from_slice(b"\r\n\r\n");
    let mut stream = raw(turn.socket(), &big).await;
    assert!(head(&mut stream).await.starts_with("HTTP/1.1 431"));
    broker_events(&seen, 1).await;
    assert_eq!(seen.refusals(), vec![(431, Refusal::HeadBytes)]);

    // A head hyper cannot parse: it answers 400.
    let (turn, seen) = observed(policy(&model.url())).await;
    let mut stream = raw(
        turn.socket(),
        b"POST /v1/tools/weather HTTP/1.1\r\nno colon here\r\n\r\n",
    )
    .await;
    assert!(head(&mut stream).await.starts_with("HTTP/1.1 400"));
    broker_events(&seen, 1).await;
    assert_eq!(seen.refusals(), vec![(400, Refusal::Malformed)]);
}
