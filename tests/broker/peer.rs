//! The peer check and cancellation: another uid, the check turned off, calls ended with the turn
//! and the listener.

use super::*;

#[tokio::test]
async fn a_peer_with_another_uid_is_refused() {
    let model = ScriptedModel::start(vec![Step::text("x")]).await;
    let mut p = policy(&model.url());
    p.worker_uid = uid() + 1;
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let err = post_json_result(turn.socket(), CHAT, &chat_body(false)).await;
    assert!(err.is_err(), "answered a foreign peer: {err:?}");
    assert!(model.requests().is_empty());
}

#[tokio::test]
async fn the_peer_check_can_be_turned_off_for_runtimes_that_hide_the_uid() {
    let model = ScriptedModel::start(vec![Step::text("x")]).await;
    let mut p = policy(&model.url());
    p.worker_uid = uid() + 1;
    p.peer_uid_check = false;
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let answer = post_json_result(turn.socket(), CHAT, &chat_body(false))
        .await
        .unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(model.requests().len(), 1);
}

#[tokio::test]
async fn cancelling_the_turn_ends_calls_in_flight() {
    let model = ScriptedModel::start(vec![Step::Hang]).await;
    let (waits, cancelled) = waits();
    let mut p = policy(&model.url());
    p.tools = vec![waits];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let socket = turn.socket().to_owned();
    let model_call = tokio::spawn({
        let socket = socket.clone();
        async move { post_json_result(&socket, CHAT, &chat_body(false)).await }
    });
    let tool_call = tokio::spawn({
        let socket = socket.clone();
        async move { post_json_result(&socket, "/v1/tools/waits", &json!({})).await }
    });
    // Both calls are in flight (the upstream has the model request).
    let deadline = Instant::now() + Duration::from_secs(5);
    while model.requests().is_empty() {
        assert!(Instant::now() < deadline, "the model call never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    turn.cancel.cancel();
    let m = tokio::time::timeout(Duration::from_secs(3), model_call)
        .await
        .unwrap()
        .unwrap();
    let t = tokio::time::timeout(Duration::from_secs(3), tool_call)
        .await
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(m.is_err(), "{m:?}");
    assert!(t.is_err(), "{t:?}");
    let deadline = Instant::now() + Duration::from_secs(3);
    while !cancelled.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the handler's token never fired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // No new connection is served after the cancellation.
    assert!(post_json_result(&socket, CHAT, &chat_body(false))
        .await
        .is_err());
}

#[tokio::test]
async fn stopping_the_listener_ends_calls_and_removes_the_socket() {
    let model = ScriptedModel::start(vec![Step::Hang]).await;
    let broker = start_broker(policy(&model.url())).await;
    let mut turn = start_turn(&broker).await;
    let socket = turn.socket().to_owned();
    let call = tokio::spawn({
        let socket = socket.clone();
        async move { post_json_result(&socket, CHAT, &chat_body(false)).await }
    });
    while model.requests().is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listener = turn.listener.take().unwrap();
    assert_eq!(listener.path(), socket);
    listener.stop().await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(3), call)
        .await
        .unwrap()
        .unwrap();
    assert!(r.is_err(), "{r:?}");
    assert!(!socket.exists());
}
