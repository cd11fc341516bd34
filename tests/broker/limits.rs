//! Limits: body size, calls per turn, malformed JSON, a slow client.

use super::*;

#[tokio::test]
async fn an_oversized_body_gives_413() {
    let model = ScriptedModel::start(vec![]).await;
    let mut p = policy(&model.url());
    p.limits.max_request_bytes = 4096;
    p.tools = vec![weather().0];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let big = json!({"city": "x".repeat(5000)}).to_string();
    let a = post(turn.socket(), "/v1/tools/weather", &[], big.clone())
        .await
        .unwrap();
    assert_eq!(a.status, 413);
    assert_eq!(a.error(), "request body too large (limit 4096 bytes)");
    let a = post(turn.socket(), CHAT, &[], big).await.unwrap();
    assert_eq!(a.status, 413);
    // Without a declared length (chunked), the cap holds while reading.
    let mut stream = tokio::net::UnixStream::connect(turn.socket())
        .await
        .unwrap();
    let chunk = "a".repeat(3000);
    let raw = format!(
        "POST /v1/tools/weather HTTP/1.1\r\nhost: b\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len(),
        chunk.len()
    );
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(model.requests().is_empty());
}

#[tokio::test]
async fn one_call_too_many_gives_429() {
    let model = ScriptedModel::start(vec![Step::text("a"), Step::text("b")]).await;
    let mut p = policy(&model.url());
    p.limits.max_model_calls = 2;
    p.limits.max_tool_calls = 1;
    p.tools = vec![weather().0];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let s = turn.socket();
    for _ in 0..2 {
        assert_eq!(post_json(s, CHAT, &chat_body(false)).await.status, 200);
    }
    let a = post_json(s, CHAT, &chat_body(false)).await;
    assert_eq!(a.status, 429);
    assert_eq!(a.error(), "too many model calls in this turn (limit 2)");
    assert_eq!(model.requests().len(), 2);
    let args = json!({"city": "Oslo"});
    assert_eq!(post_json(s, "/v1/tools/weather", &args).await.status, 200);
    let a = post_json(s, "/v1/tools/weather", &args).await;
    assert_eq!(a.status, 429);
    assert_eq!(a.error(), "too many tool calls in this turn (limit 1)");
    // The counts are per turn: the next turn starts afresh.
    drop(turn);
    let turn = start_turn(&broker).await;
    assert_eq!(
        post_json(turn.socket(), "/v1/tools/weather", &args)
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn malformed_json_gives_400() {
    let model = ScriptedModel::start(vec![]).await;
    let mut p = policy(&model.url());
    p.tools = vec![weather().0];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let a = post(turn.socket(), CHAT, &[], "{not json").await.unwrap();
    assert_eq!(a.status, 400);
    assert_eq!(
        a.error(),
        "malformed JSON: key must be a string at line 1 column 2"
    );
    let a = post(turn.socket(), "/v1/tools/weather", &[], "")
        .await
        .unwrap();
    assert_eq!(a.status, 400);
    assert_eq!(
        a.error(),
        "malformed JSON: EOF while parsing a value at line 1 column 0"
    );
    assert!(model.requests().is_empty());
}

#[tokio::test]
async fn a_slow_client_blocks_neither_its_turn_nor_another() {
    let (_, broker) = weather_broker().await;
    let a_turn = start_turn(&broker).await;
    let b_turn = start_turn(&broker).await;
    // Half a request head, never finished; and a head whose body never comes.
    let mut slow = tokio::net::UnixStream::connect(a_turn.socket())
        .await
        .unwrap();
    slow.write_all(b"POST /v1/tools/weather HTTP/1.1\r\nhost: b\r\ncontent-le")
        .await
        .unwrap();
    let mut slow_body = tokio::net::UnixStream::connect(a_turn.socket())
        .await
        .unwrap();
    slow_body
        .write_all(b"POST /v1/tools/weather HTTP/1.1\r\nhost: b\r\ncontent-length: 100\r\n\r\n{")
        .await
        .unwrap();
    let args = json!({"city": "Oslo"});
    let started = Instant::now();
    for turn in [&b_turn, &a_turn] {
        let a = tokio::time::timeout(
            Duration::from_secs(5),
            post_json(turn.socket(), "/v1/tools/weather", &args),
        )
        .await
        .expect("blocked by a slow client");
        assert_eq!(a.status, 200);
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    drop((slow, slow_body));
}
