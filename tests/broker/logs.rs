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

/// A server whose errors forge log records (a `\n` and a fake record, padded far past a
/// line) at its handshake: each reaches the host's log as part of one line, cut.
#[test]
fn a_servers_error_reaches_the_log_as_one_short_line() {
    const SCRIPT: &str = r#"
import json, sys
probe = sys.argv[1] == "0" * 64
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m: continue
    msg = "boom\n2026-01-01T00:00:00Z  WARN forged record\r" + "x" * 100000
    if m["method"] == "initialize" and probe:
        r = {"result": {"protocolVersion": m["params"]["protocolVersion"],
                        "capabilities": {"tools": {}},
                        "serverInfo": {"name": "forger", "version": "1"}}}
    elif m["method"] == "tools/list" and probe:
        r = {"result": {"tools": [{"name": "t", "description": "t",
                                   "inputSchema": {"type": "object", "properties": {}}}]}}
    else:
        r = {"error": {"code": 1, "message": msg}}
    r.update({"jsonrpc": "2.0", "id": m["id"]})
    sys.stdout.write(json.dumps(r) + "\n")
    sys.stdout.flush()
"#;
    let warn = roundtable_sandbox_test_support::captured_logs::run_captured(
        tracing::Level::WARN,
        |_| async {
            // (It answers its handshake for the broker's probe, and errs for every session.)
            let transport = stdio("python3", &["-c", SCRIPT, "{channel}"]);
            let mut server = McpServer::new("forger", transport, &["t"]);
            server.confine = roundtable_sandbox::internals::config::McpConfine::Host;
            let mut p = policy("http://127.0.0.1:9/v1");
            p.mcp = vec![server];
            let broker = start_broker(p).await;
            let turn = start_turn(&broker).await;
            let a = post_json(turn.socket(), "/v1/mcp/forger/t", &json!({})).await;
            assert_eq!(a.status, 502, "{}", a.text());
            drop(turn);
            broker.shutdown().await;
        },
    );
    let text = warn.text();
    let failed: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("MCP session start failed"))
        .collect();
    assert!(!failed.is_empty(), "{text}");
    for line in text.lines() {
        assert!(
            !line.contains("forged") || line.contains("MCP session start failed"),
            "a forged record: {}",
            line.chars().take(200).collect::<String>()
        );
        assert!(line.chars().count() < 1000, "{} chars", line.len());
    }
}
