//! Hostile MCP answers (issue 43 item 1): every message from a server goes through the one
//! bounded reader, so no answer is parsed whole into a tree, however it is shaped. Over stdio
//! (the stub of `tests/support/mcp_stub.py`, a host child) and streamable HTTP
//! (`tests/support/mcp_hostile_http.py`): each hostile answer fails its call with an error
//! that names the cap, and the next call gets a working session.

use super::*;

const HOSTILE: &[&str] = &[
    "echo",
    "bigmeta",
    "structured",
    "notify",
    "endless",
    "badshape",
];
const CAP: &str = "larger than 262144 bytes";

async fn stub_turn(dir: &Path) -> (Arc<Broker>, BrokerTurn) {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![stub_server(dir, HOSTILE)];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    (broker, turn)
}

/// Calls `tool`; its answer must be a 502 with `error`, then `echo` works in a new session.
async fn refused_then_recovers(
    dir: &Path,
    turn: &BrokerTurn,
    tool: &str,
    args: serde_json::Value,
    error: &str,
) {
    let pid = read_pid(&dir.join("pid"));
    let a = post_json(turn.socket(), &format!("/v1/mcp/stub/{tool}"), &args).await;
    assert_eq!(
        (a.status, a.error()),
        (502, error.to_owned()),
        "{tool}: {}",
        a.text()
    );
    // The session that broke a cap is gone with its process, and the next call starts one.
    wait_gone(pid).await;
    let a = post_json(
        turn.socket(),
        "/v1/mcp/stub/echo",
        &json!({"text": "after"}),
    )
    .await;
    assert_eq!(a.json(), json!({"ok": true, "content": "after"}), "{tool}");
    assert_ne!(read_pid(&dir.join("pid")), pid);
}

#[tokio::test]
async fn mcp_stdio_answers_past_the_caps_stop_the_session_and_the_next_call_works() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, turn) = stub_turn(dir.path()).await;
    let a = post_json(
        turn.socket(),
        "/v1/mcp/stub/echo",
        &json!({"text": "before"}),
    )
    .await;
    assert_eq!(a.json(), json!({"ok": true, "content": "before"}));
    let over = format!("MCP server stub sent a message {CAP}; its session was stopped");
    // The review's 15 MB `_meta` of `{"":0}` (2.46 GB of host memory through rmcp).
    refused_then_recovers(dir.path(), &turn, "bigmeta", json!({}), &over).await;
    // 15 MB of `{}` as structured content (729 MB), and four 15 MB notifications (5.1 GB).
    refused_then_recovers(dir.path(), &turn, "structured", json!({}), &over).await;
    refused_then_recovers(dir.path(), &turn, "notify", json!({"count": 4}), &over).await;
    // A message that never ends is cut at the cap, not at the call's deadline (a 504).
    refused_then_recovers(dir.path(), &turn, "endless", json!({}), &over).await;
    // Under the byte cap, past the values: refused unparsed.
    let values =
        "MCP server stub sent a message of more than 65536 JSON values; its session was stopped";
    refused_then_recovers(dir.path(), &turn, "structured", json!({"mb": 0.2}), values).await;
    broker.shutdown().await;
}

/// A server's answer of the wrong shape fails its call with the parser's kind of error and
/// the position, never the value it quoted (serde quotes a whole string: here 100 kB of the
/// server's text, which no redaction or cut saw).
#[tokio::test]
async fn mcp_an_answer_of_the_wrong_shape_is_not_quoted_back() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, turn) = stub_turn(dir.path()).await;
    let value = format!("SERVER-TEXT-{}", "y".repeat(100_000));
    let a = post_json(
        turn.socket(),
        "/v1/mcp/stub/badshape",
        &json!({"value": value}),
    )
    .await;
    assert_eq!(
        a.status,
        502,
        "{}",
        a.text().chars().take(300).collect::<String>()
    );
    assert_eq!(
        a.error(),
        "MCP server stub: its answer is not a tool result: invalid type: string … at line 1 column 100041"
    );
    broker.shutdown().await;
}

#[tokio::test]
async fn mcp_stdio_unsolicited_messages_are_dropped_and_held_to_a_rate() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, turn) = stub_turn(dir.path()).await;
    // Within the burst: dropped, and the call is answered.
    let a = post_json(
        turn.socket(),
        "/v1/mcp/stub/notify",
        &json!({"count": 50, "mb": 0.0001}),
    )
    .await;
    assert_eq!(
        a.json(),
        json!({"ok": true, "content": "ok"}),
        "{}",
        a.text()
    );
    // Past it: the session is stopped, the call refused with the reason.
    let flood =
        "MCP server stub sent more than 100 messages it was not asked for; its session was stopped";
    tokio::time::sleep(Duration::from_secs(3)).await; // the bucket refills
    refused_then_recovers(
        dir.path(),
        &turn,
        "notify",
        json!({"count": 500, "mb": 0.0001}),
        flood,
    )
    .await;
    broker.shutdown().await;
}

#[tokio::test]
async fn mcp_message_cap_is_configurable_per_server() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = policy("http://127.0.0.1:9/v1");
    let mut server = stub_server(dir.path(), HOSTILE);
    server.max_message_kb = 16;
    p.mcp = vec![server];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let a = post_json(
        turn.socket(),
        "/v1/mcp/stub/echo",
        &json!({"text": "x".repeat(20_000)}),
    )
    .await;
    assert_eq!(
        (a.status, a.error()),
        (
            502,
            "MCP server stub sent a message larger than 16384 bytes; its session was stopped"
                .to_owned()
        )
    );
    let a = post_json(
        turn.socket(),
        "/v1/mcp/stub/echo",
        &json!({"text": "x".repeat(10_000)}),
    )
    .await;
    assert_eq!(a.json()["ok"], true);
    broker.shutdown().await;
}

/// The hostile streamable-HTTP server, killed when dropped.
struct HostileHttp {
    child: std::process::Child,
    url: String,
}

impl HostileHttp {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/mcp_hostile_http.py"))
            .arg(port.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_listening(port, "the hostile HTTP server").await;
        Self {
            child,
            url: format!("http://127.0.0.1:{port}/mcp"),
        }
    }
}

impl Drop for HostileHttp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn mcp_http_answers_past_the_caps_fail_their_call() {
    let server = HostileHttp::start().await;
    let mut p = policy("http://127.0.0.1:9/v1");
    p.allow_http = true;
    let transport = McpTransport::Http {
        url: server.url.clone(),
        headers: Default::default(),
    };
    p.mcp = vec![McpServer::new(
        "hostile",
        transport,
        &["echo", "bigbody", "bigevent", "flood", "slowflood"],
    )];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let call = |tool: &'static str| {
        let socket = turn.socket().to_owned();
        async move {
            post_json(
                &socket,
                &format!("/v1/mcp/hostile/{tool}"),
                &json!({"text": "hi"}),
            )
            .await
        }
    };
    assert_eq!(
        call("echo").await.json(),
        json!({"ok": true, "content": "hi"})
    );
    let over = format!("MCP server hostile sent a message {CAP}");
    for tool in ["bigbody", "bigevent"] {
        let a = call(tool).await;
        assert_eq!((a.status, a.error()), (502, over.clone()), "{tool}");
        assert_eq!(call("echo").await.json()["ok"], true, "after {tool}");
    }
    let flood = "MCP server hostile sent more than 100 messages it was not asked for; its session was stopped";
    for tool in ["flood", "slowflood"] {
        let a = call(tool).await;
        assert_eq!((a.status, a.error()), (502, flood.to_owned()), "{tool}");
        // A new session (the flood stopped the old one) answers.
        assert_eq!(call("echo").await.json()["ok"], true, "after {tool}");
    }
    broker.shutdown().await;
}

/// A listing's tools outside the allow-list are dropped unread (every listed tool's schema
/// was built as a tree: a listing of 16 pages within the message caps held ~340 MB), and an
/// allowed tool's schema is held to its own caps (64 KiB, 16,384 JSON values): a start past
/// them fails with an error that names the cap.
#[tokio::test]
async fn mcp_tool_schemas_are_read_for_allowed_tools_only_and_capped() {
    let dir = tempfile::tempdir().unwrap();
    // `secret` (never allowed) with a schema that is no object: not read, so no failure.
    std::fs::write(dir.path().join("schemas"), r#"{"secret": [1, 2, 3]}"#).unwrap();
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![stub_server(dir.path(), &["echo"])];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let a = post_json(turn.socket(), "/v1/mcp/stub/echo", &json!({"text": "hi"})).await;
    assert_eq!(a.json(), json!({"ok": true, "content": "hi"}));
    broker.shutdown().await;
    // The allowed `echo` with a schema of 2,100 properties (more than 16,384 values, an object counting 9).
    let props: serde_json::Map<String, serde_json::Value> = (0..2100)
        .map(|i| (format!("p{i}"), json!({"type": "string"})))
        .collect();
    std::fs::write(
        dir.path().join("schemas"),
        json!({"echo": {"type": "object", "properties": props}}).to_string(),
    )
    .unwrap();
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![stub_server(dir.path(), &["echo"])];
    let err = Broker::new(p).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "MCP server stub could not be started: its answer is of more than 16384 JSON values"
    );
}

/// A server's schema with a `pattern` that backtracks (`(a|aa)*` before a lookahead, which
/// makes fancy-regex backtrack): each match is held to 10,000 steps, past them the arguments are refused
/// (fancy-regex's own limit is a million steps a match: a guest's 20,000 such strings were
/// minutes of a thread), and the check runs off the runtime's threads.
#[tokio::test]
async fn mcp_a_schema_pattern_that_backtracks_is_held_to_its_steps() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("schemas"),
        json!({"echo": {"type": "object", "properties": {
            "text": {"type": "string", "pattern": "^(a|aa)*(?!b)c"}}}})
        .to_string(),
    )
    .unwrap();
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![stub_server(dir.path(), &["echo"])];
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    // (a|aa)* over 25 a's: within fancy-regex's million steps (a plain "does not match"
    // after ~45 ms), past 10,000.
    let a = post_json(
        turn.socket(),
        "/v1/mcp/stub/echo",
        &json!({"text": "a".repeat(25)}),
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.text());
    assert!(a.error().contains("backtracking"), "{}", a.error());
    // Within its steps, a pattern still judges.
    let a = post_json(turn.socket(), "/v1/mcp/stub/echo", &json!({"text": "aac"})).await;
    assert_eq!(a.json(), json!({"ok": true, "content": "aac"}));
    broker.shutdown().await;
}
