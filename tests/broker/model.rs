//! The model proxy: key injection, streaming, upstream errors, redaction of an echoed key, the
//! response cap.

use super::*;

/// A chat call (streamed or not) the broker answers with `status`: its error.
async fn chat_refused(turn: &BrokerTurn, stream: bool, status: u16) -> String {
    let a = post_json(turn.socket(), CHAT, &chat_body(stream)).await;
    assert_eq!(a.status, status, "{}", a.text());
    a.error()
}

#[tokio::test]
async fn model_key_injected_once_guest_headers_dropped_model_forced() {
    let model = ScriptedModel::start(vec![Step::text("hello there")]).await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;
    let answer = post(
        turn.socket(),
        CHAT,
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer guest-token"),
            ("api-key", "guest-api-key"),
            ("x-api-key", "guest-x-api-key"),
            ("cookie", "session=guest"),
            ("proxy-authorization", "Basic guest"),
            ("x-custom", "guest"),
        ],
        chat_body(false).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        answer.json()["choices"][0]["message"]["content"],
        "hello there"
    );
    let reqs = model.requests();
    assert_eq!(reqs.len(), 1);
    let req = &reqs[0];
    assert_eq!(req.method, "POST");
    assert_eq!(req.path, "/v1/chat/completions");
    assert_eq!(
        req.header_values("authorization"),
        vec![format!("Bearer {KEY}")]
    );
    for h in [
        "api-key",
        "x-api-key",
        "cookie",
        "proxy-authorization",
        "x-custom",
    ] {
        assert!(req.header_values(h).is_empty(), "{h} reached the upstream");
    }
    let raw = req
        .headers
        .iter()
        .map(|(n, v)| format!("{n}: {v}"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        !raw.contains("guest"),
        "a guest header reached the upstream:\n{raw}"
    );
    let body = req.json();
    assert_eq!(body["model"], MODEL);
    assert_eq!(body["messages"][0]["content"], "hi");
}

#[tokio::test]
async fn streamed_chunks_arrive_in_order_and_unbuffered() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let events = sse_text_events(&["one", "two", "three"]);
    let model = ScriptedModel::start(vec![Step::Gated {
        first: vec![events[0].clone()],
        gate: gate.clone(),
        rest: events[1..].to_vec(),
    }])
    .await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;
    let (status, headers, mut body) =
        client::post_stream(turn.socket(), CHAT, &chat_body(true)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    // The first event arrives while the upstream still holds back the rest.
    let first = tokio::time::timeout(Duration::from_secs(5), next_chunk(&mut body))
        .await
        .expect("the first chunk was buffered")
        .unwrap();
    assert_eq!(first, events[0].as_bytes());
    gate.notify_one();
    let rest = client::read_rest(&mut body).await;
    assert_eq!(String::from_utf8(rest).unwrap(), events[1..].concat());
    assert_eq!(model.requests()[0].json()["stream"], true);
    assert_eq!(model.requests()[0].json()["model"], MODEL);
}

#[tokio::test]
async fn upstream_500_gives_a_clear_error() {
    let model = ScriptedModel::start(vec![
        Step::Status(500, "boom".into()),
        Step::Status(503, String::new()),
    ])
    .await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;
    assert_eq!(
        chat_refused(&turn, false, 502).await,
        "model upstream returned HTTP 500: boom"
    );
    assert_eq!(
        chat_refused(&turn, true, 502).await,
        "model upstream returned HTTP 503"
    );
}

#[tokio::test]
async fn upstream_timeout_gives_504_and_unreachable_gives_502() {
    let model = ScriptedModel::start(vec![Step::Hang]).await;
    let mut p = policy(&model.url());
    p.limits.call_timeout = Duration::from_millis(300);
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    assert_eq!(
        chat_refused(&turn, false, 504).await,
        "model call timed out after 300ms"
    );

    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", closed.local_addr().unwrap());
    drop(closed);
    let broker = start_broker(policy(&url)).await;
    let turn = start_turn(&broker).await;
    assert_eq!(
        chat_refused(&turn, false, 502).await,
        "model upstream unreachable"
    );
}

#[tokio::test]
async fn a_key_echoed_by_the_upstream_is_redacted() {
    let model = ScriptedModel::start(vec![
        Step::EchoKey,
        Step::EchoKeyError(401),
        Step::EchoKeyStream,
    ])
    .await;
    let broker = start_broker(policy(&model.url())).await;
    let turn = start_turn(&broker).await;

    let a = post_json(turn.socket(), CHAT, &chat_body(false)).await;
    assert_eq!(a.status, 200);
    assert!(!a.text().contains(KEY), "{}", a.text());
    assert_eq!(
        a.json()["choices"][0]["message"]["content"],
        "I saw Bearer [redacted]"
    );

    assert_eq!(
        chat_refused(&turn, false, 502).await,
        r#"model upstream returned HTTP 401: {"error":{"message":"bad key: Bearer [redacted]"}}"#
    );

    // Streamed, with the key split across two upstream chunks.
    let a = post_json(turn.socket(), CHAT, &chat_body(true)).await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.text(),
        "data: {\"leak\":\"Bearer [redacted]\"}\n\ndata: [DONE]\n\n"
    );
    assert_eq!(model.requests().len(), 3);
}

/// A key with `/` in it, echoed by an upstream whose JSON encoder writes `\/`: redacted in
/// that form too.
#[tokio::test]
async fn a_key_echoed_with_its_slashes_escaped_is_redacted() {
    const SLASHED: &str = "sk-test/4f9a1c2b/7d3e8a6f";
    let echoed = SLASHED.replace('/', "\\/");
    let model = ScriptedModel::start(vec![Step::Status(
        401,
        format!(r#"{{"error":"bad key {echoed}"}}"#),
    )])
    .await;
    let broker = start_broker(broker_policy(&model.url(), SLASHED)).await;
    let turn = start_turn(&broker).await;
    assert_eq!(
        chat_refused(&turn, false, 502).await,
        r#"model upstream returned HTTP 401: {"error":"bad key [redacted]"}"#
    );
}

#[tokio::test]
async fn a_key_from_a_provider_is_injected() {
    struct Vault;
    impl roundtable_sandbox::internals::config::ApiKeyProvider for Vault {
        fn key(&self) -> BoxFuture<'_, Result<secrecy::SecretString, String>> {
            Box::pin(async { Ok(secrecy::SecretString::from("sk-from-vault-0001")) })
        }
    }
    let model = ScriptedModel::start(vec![Step::EchoKey]).await;
    let mut p = policy(&model.url());
    p.api_key = ApiKey::from_provider(Vault);
    assert!(!format!("{p:?}").contains("sk-"));
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let a = post_json(turn.socket(), CHAT, &chat_body(false)).await;
    assert_eq!(a.status, 200);
    assert!(!a.text().contains("sk-from-vault-0001"));
    assert_eq!(
        model.requests()[0].header_values("authorization"),
        vec!["Bearer sk-from-vault-0001".to_owned()]
    );
}

#[tokio::test]
async fn a_model_response_past_the_cap_is_refused() {
    let big = "x".repeat(4096);
    let model = ScriptedModel::start(vec![
        Step::text(&big),
        Step::stream_text(&[&big, &big], Duration::ZERO),
    ])
    .await;
    let mut p = policy(&model.url());
    p.limits.max_response_bytes = 2048;
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    assert_eq!(
        chat_refused(&turn, false, 502).await,
        "model response too large (limit 2048 bytes)"
    );
    let a = post_json(turn.socket(), CHAT, &chat_body(true)).await;
    assert_eq!(a.status, 200);
    assert!(!a.text().contains(&big));
    assert!(a.text().ends_with(
        "data: {\"error\":{\"message\":\"model response too large (limit 2048 bytes)\"}}\n\n"
    ));
}
