//! A shared MCP session (issue 43, item 5): its calls run one at a time, handed out
//! fairly across channels, and a call that times out stops the session without charging
//! the calls waiting behind it: they run on the restarted session.

use super::*;

/// The stub as a shared server, `tools` allowed, its files in `dir`.
fn shared_stub(dir: &Path, tools: &[&str]) -> McpServer {
    let mut config = stub_server(dir, tools);
    config.scope = Some(McpScope::Shared);
    config
}

/// The tags of the stub's `hold` calls, in the order they reached it.
fn started(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("calls"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Waits until `done` holds; panics after 30 s saying `what`.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Posts `body` to `path` through `turn` from a task of its own.
fn spawn_call(
    turn: &BrokerTurn,
    path: &'static str,
    body: serde_json::Value,
) -> tokio::task::JoinHandle<client::Answer> {
    let socket = turn.socket().to_owned();
    tokio::spawn(async move { post_json(&socket, path, &body).await })
}

#[tokio::test]
async fn a_shared_servers_calls_are_served_fairly_across_channels() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![shared_stub(dir.path(), &["hold"])];
    p.limits.max_calls_in_flight = 8;
    let broker = start_broker(p).await;
    let alpha = start_turn_in(&broker, "#alpha").await;
    let beta = start_turn_in(&broker, "#beta").await;
    let hold =
        |turn: &BrokerTurn, tag: &str| spawn_call(turn, "/v1/mcp/stub/hold", json!({ "tag": tag }));
    // #alpha's first call holds the session (the stub answers it once `open` exists).
    let mut calls = vec![("a1", hold(&alpha, "a1"))];
    until("a1 reaches the server", || started(dir.path()) == ["a1"]).await;
    // Three more of #alpha's queue behind it, in this order; then #beta's one call.
    for (n, tag) in ["a2", "a3", "a4"].into_iter().enumerate() {
        calls.push((tag, hold(&alpha, tag)));
        until(&format!("{tag} waits"), || {
            broker.mcp_waiting("stub") == n + 1
        })
        .await;
    }
    calls.push(("b1", hold(&beta, "b1")));
    until("b1 waits", || broker.mcp_waiting("stub") == 4).await;
    // One call at a time: nothing else reached the server while a1 holds it.
    assert_eq!(started(dir.path()), ["a1"]);
    std::fs::write(dir.path().join("open"), "").unwrap();
    for (tag, call) in calls {
        let a = call.await.unwrap();
        assert_eq!(a.json(), json!({"ok": true, "content": tag}), "{tag}");
    }
    // #beta's one call was served right after the call that held the session, before
    // #alpha's later ones (a plain first-come lock serves a1, a2, a3, a4, b1).
    assert_eq!(started(dir.path()), ["a1", "b1", "a2", "a3", "a4"]);
    assert_eq!(broker.mcp_waiting("stub"), 0);
    assert!(
        broker.mcp_in_use("stub"),
        "the turns that called it still run"
    );
    alpha.cancel.cancel();
    beta.cancel.cancel();
    until("the shared session is idle once its turns end", || {
        !broker.mcp_in_use("stub")
    })
    .await;
    broker.shutdown().await;
}

#[tokio::test]
async fn a_call_that_times_out_restarts_the_shared_session_and_the_waiting_call_runs_there() {
    // The review's case: mcp-server-sqlite shared, one channel's query never ends.
    let dir = tempfile::tempdir().unwrap();
    let mut p = policy("http://127.0.0.1:9/v1");
    let mut server = mcp_process::sqlite_server(
        dir.path(),
        "shared",
        &["create_table", "write_query", "read_query"],
    );
    server.scope = Some(McpScope::Shared);
    p.mcp = vec![server];
    // Room for the restart (a python process) on a loaded machine: the waiting call's
    // timeout covers it.
    p.limits.call_timeout = Duration::from_secs(20);
    let broker = start_broker(p).await;
    let first_pid = read_pid(&dir.path().join("pid-shared"));
    let alpha = start_turn_in(&broker, "#alpha").await;
    let beta = start_turn_in(&broker, "#beta").await;
    let a = post_json(
        beta.socket(),
        "/v1/mcp/sqlite/create_table",
        &json!({"query": "CREATE TABLE notes (body TEXT)"}),
    )
    .await;
    assert_eq!(a.json()["ok"], true, "{}", a.text());

    // #alpha's query never ends; #beta's insert waits behind it.
    let endless = "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c)";
    let slow = spawn_call(
        &alpha,
        "/v1/mcp/sqlite/read_query",
        json!({ "query": endless }),
    );
    until("#alpha's call holds the session", || {
        broker.mcp_running("sqlite")
    })
    .await;
    let insert = spawn_call(
        &beta,
        "/v1/mcp/sqlite/write_query",
        json!({"query": "INSERT INTO notes VALUES ('from beta')"}),
    );
    until("#beta's call waits", || broker.mcp_waiting("sqlite") == 1).await;

    // #alpha's call times out: its session (the process running the query) is stopped.
    let a = slow.await.unwrap();
    assert_eq!(a.status, 504, "{}", a.text());
    assert_eq!(
        a.error(),
        "tool call timed out after 20s; the MCP session was stopped"
    );
    wait_gone(first_pid).await;
    // #beta's call was never sent to the stopped session: it ran on a restarted one, its
    // own timeout counted from then.
    let b = insert.await.unwrap();
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(b.json()["ok"], true, "{}", b.text());
    let second_pid = read_pid(&dir.path().join("pid-shared"));
    assert_ne!(second_pid, first_pid);
    assert!(alive(second_pid));
    let a = post_json(
        alpha.socket(),
        "/v1/mcp/sqlite/read_query",
        &json!({"query": "SELECT body FROM notes"}),
    )
    .await;
    assert!(
        a.json()["content"].as_str().unwrap().contains("from beta"),
        "{}",
        a.text()
    );
    assert_eq!(read_pid(&dir.path().join("pid-shared")), second_pid);
    broker.shutdown().await;
    wait_gone(second_pid).await;
}
