//! Channel-scoped MCP sessions through the actor layer, end to end: the real guest in the
//! project's image, a scripted model on loopback, and `mcp-server-sqlite` (PyPI, from the
//! image `scripts/build-mcp-image.sh` builds), each session its own container (the default
//! confinement). A channel's session starts on its first call, keeps its data in the
//! channel's own data dir, and its container is gone once the channel retires.

use std::time::Duration;

use roundtable_sandbox::driver::LABEL_RUNTIME;
use roundtable_sandbox::internals::broker::LABEL_MCP;
use roundtable_sandbox::internals::config::PROBE_SEGMENT;
use roundtable_sandbox::internals::turn::channel_segment;
use roundtable_sandbox_actors::testing::*;
use roundtable_sandbox_actors::*;
use roundtable_sandbox_test_support::mcp_process::sqlite_container;
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use serde_json::json;

/// The tool results of a model request, in order.
fn tool_results(request: &serde_json::Value) -> Vec<String> {
    request["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The instance's MCP session containers.
async fn mcp_containers(instance: &str) -> Vec<String> {
    containers_labelled(&[format!("{LABEL_RUNTIME}={instance}"), LABEL_MCP.to_owned()])
        .await
        .into_iter()
        .flat_map(|c| c.names.unwrap_or_default())
        .collect()
}

/// Waits until the instance has `n` MCP containers; panics after 30 s.
async fn wait_mcp_containers(instance: &str, n: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = mcp_containers(instance).await;
        if now.len() == n {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "expected {n} MCP containers: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether one of `names` is the session container of `channel`.
fn has_channel(names: &[String], channel: &str) -> bool {
    let tag = &channel_segment(channel)[..12];
    names.iter().any(|n| n.contains(tag))
}

#[actix_rt::test]
async fn a_channels_mcp_session_starts_on_first_call_is_its_own_and_stops_when_it_retires() {
    let env = Env::new();
    let model = ScriptedModel::start(vec![
        // #alpha stores a note in its database.
        Step::tool_call(
            "a1",
            "mcp__sqlite__create_table",
            json!({"query": "CREATE TABLE notes (body TEXT)"}),
        ),
        Step::tool_call(
            "a2",
            "mcp__sqlite__write_query",
            json!({"query": "INSERT INTO notes VALUES ('alpha-private-note')"}),
        ),
        Step::text("stored"),
        // #beta tries to read it.
        Step::tool_call(
            "b1",
            "mcp__sqlite__read_query",
            json!({"query": "SELECT body FROM notes"}),
        ),
        Step::text("looked"),
    ])
    .await;
    let mut c = env.config();
    c.model_url = model.url();
    c.turn_timeout = Some(Duration::from_secs(90));
    c.mcp = vec![sqlite_container(&[
        "create_table",
        "write_query",
        "read_query",
    ])];
    let resolved = c.resolve().unwrap();
    let instance = resolved.instance;
    let data = resolved
        .workspace_root
        .join(roundtable_sandbox::internals::config::MCP_DATA_DIR)
        .join("sqlite");
    let mut s = SupervisorOptions::new(c);
    // Generous: #alpha must stay live (its session alive) through #beta's whole turn, which
    // takes seconds on a busy machine (3 s here retired #alpha first under load).
    s.idle_timeout = Duration::from_secs(20);
    let addr = SandboxSupervisor::start(s).await.unwrap();
    // Only the startup listing ran (and is gone); no channel has a session yet.
    wait_mcp_containers(&instance, 0).await;
    assert!(data.join(PROBE_SEGMENT).is_dir());
    assert!(!data.join(channel_segment("#alpha")).exists());

    let reply = addr
        .send(GuestMessage::new("#alpha", speaker("ann"), "remember"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.text.as_deref(), Some("stored"), "{reply:?}");
    let results = tool_results(&model.requests()[2].json());
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(data
        .join(channel_segment("#alpha"))
        .join("db.sqlite")
        .is_file());
    assert!(!has_channel(&mcp_containers(&instance).await, "#beta"));

    let reply = addr
        .send(GuestMessage::new("#beta", speaker("bob"), "look"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.text.as_deref(), Some("looked"), "{reply:?}");
    let results = tool_results(&model.requests()[4].json());
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(results[0].contains("no such table: notes"), "{results:?}");
    assert!(!results[0].contains("alpha-private-note"), "{results:?}");
    // Each channel's session is its own container, alive while the channel is.
    let both = mcp_containers(&instance).await;
    assert_eq!(both.len(), 2, "{both:?}");
    assert!(
        has_channel(&both, "#alpha") && has_channel(&both, "#beta"),
        "{both:?}"
    );

    // Both channels go idle and retire: their sessions' containers are gone.
    status_until(&addr, "both channels retired", |s| s.totals.retired >= 2).await;
    wait_mcp_containers(&instance, 0).await;
    let report = addr.send(Shutdown).await.unwrap();
    assert_eq!(report.stopped_turns, 0);
    let left = labelled_containers_of(&instance).await;
    assert!(left.is_empty(), "leaked containers: {left:?}");
    assert!(env.turn_dirs().is_empty(), "{:?}", env.turn_dirs());
}

#[actix_rt::test]
async fn shutdown_stops_every_channels_mcp_session() {
    let env = Env::new();
    let model = ScriptedModel::start(vec![
        Step::tool_call(
            "a1",
            "mcp__sqlite__read_query",
            json!({"query": "SELECT 1"}),
        ),
        Step::text("done"),
    ])
    .await;
    let mut c = env.config();
    c.model_url = model.url();
    c.turn_timeout = Some(Duration::from_secs(90));
    c.mcp = vec![sqlite_container(&["read_query"])];
    let instance = c.resolve().unwrap().instance;
    let mut s = SupervisorOptions::new(c);
    s.idle_timeout = Duration::from_secs(3600);
    let addr = SandboxSupervisor::start(s).await.unwrap();
    let reply = addr
        .send(GuestMessage::new("#gamma", speaker("ann"), "x"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.text.as_deref(), Some("done"), "{reply:?}");
    assert!(has_channel(&mcp_containers(&instance).await, "#gamma"));
    addr.send(Shutdown).await.unwrap();
    wait_mcp_containers(&instance, 0).await;
    assert!(labelled_containers_of(&instance).await.is_empty());
}

/// Issue 43 item 1: while one channel's MCP call is reading a hostile answer (the stub's
/// `dribble`: the first 100 kB of a 15 MB `_meta`, the rest held back), another channel's
/// turn runs and is answered; then the hostile answer is cut at the message cap, and its
/// channel's turn ends with the tool's error. The replies come in that order.
#[actix_rt::test]
async fn another_channels_turn_is_answered_while_a_hostile_mcp_answer_is_read() {
    use roundtable_sandbox_test_support::mcp_stub::stub_server;
    let env = Env::new();
    let stub = tempfile::tempdir().unwrap();
    let model =
        ScriptedModel::start(vec![Step::tool_call("h1", "mcp__stub__dribble", json!({}))]).await;
    let mut c = env.config();
    c.model_url = model.url();
    c.turn_timeout = Some(Duration::from_secs(90));
    c.mcp = vec![stub_server(stub.path(), &["dribble"])];
    let addr = SandboxSupervisor::start(SupervisorOptions::new(c))
        .await
        .unwrap();
    let (tx, mut replies) = tokio::sync::mpsc::unbounded_channel();
    let hostile = {
        let (addr, tx) = (addr.clone(), tx.clone());
        actix_rt::spawn(async move {
            let r = addr
                .send(GuestMessage::new("#hostile", speaker("mallory"), "read it"))
                .await;
            tx.send(("#hostile", r)).unwrap();
        })
    };
    // The hostile call is being read: its first 100 kB are in.
    let log = stub.path().join("log");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("dribbling")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the hostile call never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = std::time::Instant::now();
    model.push(Step::text("calm answer"));
    let r = addr
        .send(GuestMessage::new("#calm", speaker("ann"), "hello"))
        .await;
    let calm_took = started.elapsed();
    tx.send(("#calm", r)).unwrap();
    // Only now is the rest of the hostile answer written.
    model.push(Step::text("hostile turn over"));
    std::fs::write(stub.path().join("gate"), "go").unwrap();
    hostile.await.unwrap();
    let (first, calm) = replies.recv().await.unwrap();
    let (second, hostile) = replies.recv().await.unwrap();
    assert_eq!((first, second), ("#calm", "#hostile"));
    let calm = calm.unwrap().unwrap();
    assert_eq!(calm.text.as_deref(), Some("calm answer"), "{calm:?}");
    let hostile = hostile.unwrap().unwrap();
    assert_eq!(
        hostile.text.as_deref(),
        Some("hostile turn over"),
        "{hostile:?}"
    );
    // The hostile answer was cut at the cap: the model saw the tool's error.
    let results = tool_results(&model.requests()[2].json());
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(
        results[0].contains("sent a message larger than 262144 bytes"),
        "{results:?}"
    );
    eprintln!("the calm channel's turn took {calm_took:?} while the hostile answer was read");
    addr.send(Shutdown).await.unwrap();
}
