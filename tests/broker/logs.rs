//! Logs: never the key, nor guest text at info.

use super::*;

/// Logs at TRACE and INFO+ in a current-thread runtime, so every task of the broker
/// (connections, upstream client) logs into this test's subscribers.
#[test]
fn logs_never_hold_the_key_nor_guest_text_at_info() {
    use tracing_subscriber::layer::SubscriberExt;
    let all = Captured::default();
    let info = Captured::default();
    let subscriber = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(all.clone())
                .with_ansi(false)
                .with_filter(tracing_subscriber::filter::LevelFilter::TRACE),
        )
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(info.clone())
                .with_ansi(false)
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
        );
    let _guard = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    const GUEST: &str = "guest-words-7c1d";
    rt.block_on(async {
        let model = ScriptedModel::start(vec![
            Step::EchoKey,
            Step::EchoKeyError(401),
            Step::EchoKeyStream,
            Step::Hang,
        ])
        .await;
        let mut p = policy(&model.url());
        p.limits.call_timeout = Duration::from_millis(300);
        p.tools = vec![weather().0];
        let broker = start_broker(p).await;
        let turn = start_turn(&broker).await;
        let s = turn.socket();
        let mut body = chat_body(false);
        body["messages"][0]["content"] = json!(GUEST);
        for stream in [false, false, true, false] {
            body["stream"] = json!(stream);
            post_json(s, CHAT, &body).await;
        }
        post_json(s, "/v1/tools/weather", &json!({"city": GUEST})).await;
        post_json(s, "/v1/tools/weather", &json!({"city": 1, "x": GUEST})).await;
        post(s, CHAT, &[], format!("{{{GUEST}")).await.unwrap();
        post_json(s, &format!("/v1/tools/{GUEST}"), &json!({})).await;
    });
    drop(rt);
    let all = all.text();
    let info = info.text();
    assert!(all.contains("model call"), "nothing was captured:\n{all}");
    assert!(!all.contains(KEY), "the key was logged:\n{all}");
    assert!(
        !info.contains(GUEST),
        "guest text was logged at info:\n{info}"
    );
}
