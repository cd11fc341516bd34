//! MCP over streamable HTTP (`tests/support/mcp_http.py`): host-side headers, shared or channel
//! scopes.

use super::*;

/// The streamable-HTTP server of `tests/support/mcp_http.py`, killed when dropped.
struct HttpMcp {
    child: std::process::Child,
    url: String,
}

impl HttpMcp {
    async fn start(token: &str) -> Self {
        let python = venv().join("bin/python");
        mcp_time_bin(); // the same venv: fail clearly when it is missing
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new(python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/mcp_http.py"))
            .arg(port.to_string())
            .env("MCP_TOKEN", token)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_listening(port, "the HTTP MCP server").await;
        Self {
            child,
            url: format!("http://127.0.0.1:{port}/mcp"),
        }
    }

    fn config(&self, token: &str) -> McpServer {
        let transport = McpTransport::Http {
            url: self.url.clone(),
            headers: [("x-mcp-token".to_owned(), token.to_owned())].into(),
        };
        McpServer::new("remote", transport, &["echo"])
    }
}

impl Drop for HttpMcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn mcp_over_streamable_http_with_host_side_headers() {
    let server = HttpMcp::start("host-secret-token").await;
    let config = server.config("host-secret-token");
    assert!(!format!("{config:?}").contains("host-secret-token"));
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![config];
    let broker = start_broker(p).await;
    let (_, mcp) = broker.turn_tools();
    assert_eq!(mcp[0].server, "remote");
    assert_eq!(mcp[0].tools.len(), 1);
    assert_eq!(mcp[0].tools[0].description, "Echo the text");
    let turn = start_turn(&broker).await;
    let a = post_json(
        turn.socket(),
        "/v1/mcp/remote/echo",
        &json!({"text": "over http"}),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json(), json!({"ok": true, "content": "over http"}));
    let a = post_json(turn.socket(), "/v1/mcp/remote/hidden", &json!({})).await;
    assert_eq!(a.status, 404);
    broker.shutdown().await;

    // Without the right header the server refuses, and the broker fails at setup.
    let config = server.config("wrong");
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![config];
    let err = Broker::new(p).await.unwrap_err().to_string();
    assert!(
        err.starts_with("MCP server remote could not be started: "),
        "{err}"
    );
    assert!(!err.contains("wrong"), "{err}");
}

#[tokio::test]
async fn mcp_over_streamable_http_default_shared_or_channel_scoped_with_channel_in_url() {
    let server = HttpMcp::start("host-secret-token").await;
    let whoami = |broker: &Arc<Broker>, channel: &'static str| {
        let broker = broker.clone();
        async move {
            let turn = start_turn_in(&broker, channel).await;
            let a = post_json(turn.socket(), "/v1/mcp/remote/whoami", &json!({})).await;
            assert_eq!(a.json()["ok"], true, "{}", a.text());
            serde_json::from_str::<serde_json::Value>(a.json()["content"].as_str().unwrap())
                .unwrap()
        }
    };
    // The default for http: one session for every channel.
    let mut config = server.config("host-secret-token");
    config.tools = vec!["whoami".into()];
    assert_eq!(config.scope(), McpScope::Shared);
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![config];
    let shared = start_broker(p).await;
    let (a, b) = (
        whoami(&shared, "#alpha").await,
        whoami(&shared, "#beta").await,
    );
    assert!(a["session"].is_string(), "{a}");
    assert_eq!(a["session"], b["session"], "{a} {b}");
    assert_eq!(a["meta"][META_CHANNEL], channel_segment("#alpha"), "{a}");
    assert_eq!(b["meta"][META_CHANNEL], channel_segment("#beta"), "{b}");
    assert_eq!(shared.mcp_sessions(), 1);
    shared.shutdown().await;

    // Channel scope: one MCP session per channel, {channel} in the url and a header.
    let mut config = server.config("host-secret-token");
    config.tools = vec!["whoami".into()];
    config.scope = Some(McpScope::Channel);
    config.transport = McpTransport::Http {
        url: format!("{}?channel={{channel}}", server.url),
        headers: [
            ("x-mcp-token".to_owned(), "host-secret-token".to_owned()),
            ("x-channel".to_owned(), "{channel}".to_owned()),
        ]
        .into(),
    };
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![config];
    let broker = start_broker(p).await;
    assert_eq!(broker.mcp_sessions(), 0);
    let (a, b) = (
        whoami(&broker, "#alpha").await,
        whoami(&broker, "#beta").await,
    );
    for (seen, channel) in [(&a, "#alpha"), (&b, "#beta")] {
        assert_eq!(seen["query"], channel_segment(channel), "{seen}");
        assert_eq!(seen["header"], channel_segment(channel), "{seen}");
    }
    assert!(a["session"].is_string(), "{a}");
    assert_ne!(a["session"], b["session"], "{a} {b}");
    assert_eq!(broker.mcp_sessions(), 2);
    broker.release_channel("#alpha").await;
    assert_eq!(broker.mcp_sessions(), 1);
    broker.shutdown().await;
}
