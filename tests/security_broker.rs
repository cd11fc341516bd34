//! Hostile guests against the broker, from inside a real sealed container: the hostile
//! program (tests/support/hostile_guest.rs) speaks raw HTTP/1.1 on the turn's socket and
//! forges the model, the URL, the credentials and the speaker, and calls tools that are
//! not allow-listed. The upstream is a scripted model on loopback that records what
//! reached it; a host tool records who it was called for.

use roundtable_sandbox_test_support::{hostile, mcp_stub};
use std::time::Duration;

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::{ApiKey, Sandbox};
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};

const KEY: &str = "sk-sec-heron-5150-host-only";

#[tokio::test(flavor = "multi_thread")]
async fn attack_forge_the_model_url_and_headers() {
    let env = Env::new();
    let model =
        ScriptedModel::start((0..8).map(|i| Step::text(&format!("answer {i}"))).collect()).await;
    let mut config = hostile::config(&env, &["broker", "forge"]);
    config.model_url = model.url();
    config.api_key = ApiKey::from_static(KEY);
    config.broker_limits.max_model_calls = 5;
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#forge", "x")).await.reply;
    let f = hostile::findings(&reply);
    assert_eq!(f["forged_model"], "200", "{f:?}");
    // An absolute-form target or a query cannot redirect the call: same upstream.
    assert_eq!(f["absolute_uri"], "200");
    assert_eq!(f["query_url"], "200");
    assert_eq!(f["get"], "405");
    assert_eq!(
        f["huge_head"], "431",
        "an oversized request head is refused"
    );
    // Five model calls in the turn, then 429 (three above plus two of the four).
    assert_eq!(f["budget"], "200,200,429,429");
    assert!(!format!("{reply:?}").contains(KEY));

    let reqs = model.requests();
    assert_eq!(
        reqs.len(),
        5,
        "only the admitted calls reached the upstream"
    );
    let host = format!("127.0.0.1:{}", model.addr().port());
    for r in &reqs {
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(r.header_values("host"), vec![host.clone()]);
        assert_eq!(
            r.header_values("authorization"),
            vec![format!("Bearer {KEY}")],
            "the key injected once, the guest's dropped"
        );
        assert_eq!(r.header_values("content-type"), vec!["application/json"]);
        // No encoding asked for: the broker caps the bytes the upstream sends and never
        // inflates them, whatever features another crate turns on in reqwest (the Matrix
        // bot's matrix-sdk turns on gzip).
        assert!(
            r.header_values("accept-encoding").is_empty(),
            "{:?}",
            r.header_values("accept-encoding")
        );
        for forged in [
            "x-api-key",
            "api-key",
            "proxy-authorization",
            "cookie",
            "x-forwarded-host",
            "x-forwarded-for",
            "openai-organization",
        ] {
            assert!(
                r.header_values(forged).is_empty(),
                "{forged} reached upstream"
            );
        }
        assert_eq!(r.json()["model"], "test-model", "the model is forced");
    }
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_send_body_fields_outside_the_allow_list() {
    let env = Env::new();
    let model = ScriptedModel::start(vec![Step::text("capped")]).await;
    let mut config = hostile::config(&env, &["broker", "fields"]);
    config.model_url = model.url();
    config.api_key = ApiKey::from_static(KEY);
    config.model_request.max_tokens = 512;
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#fields", "x")).await.reply;
    let f = hostile::findings(&reply);
    for field in [
        "models",
        "route",
        "provider",
        "plugins",
        "n",
        "service_tier",
        "store",
        "metadata",
        "base_url",
        "api_key",
    ] {
        assert_eq!(
            f[&format!("field_{field}")],
            format!(r#"400:{{"error":"request field not allowed: {field}"}}"#),
            "{f:?}"
        );
    }
    // The one allowed call reached the upstream with its token ask clamped to the cap.
    assert_eq!(f["max_tokens"], "200", "{f:?}");
    let reqs = model.requests();
    assert_eq!(reqs.len(), 1, "only the allowed call reached the upstream");
    let body = reqs[0].json();
    assert_eq!(body["max_tokens"], 512);
    let mut keys: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["max_tokens", "messages", "model"]);
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_call_tools_that_are_not_allow_listed() {
    let env = Env::new();
    let stub_dir = tempfile::tempdir().unwrap();
    let mut config = hostile::config(&env, &["broker", "tools"]);
    config.mcp = vec![mcp_stub::stub_server(stub_dir.path(), &["echo"])];
    config.tools = vec![hostile::whoami().0];
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#tools", "x")).await.reply;
    let f = hostile::findings(&reply);
    assert_eq!(
        f["tool_unlisted"],
        r#"404:{"error":"unknown tool: not_configured"}"#
    );
    assert_eq!(
        f["mcp_unlisted"],
        r#"404:{"error":"unknown MCP tool: stub/secret"}"#
    );
    for probe in [
        "tool_upper",
        "tool_traversal",
        "tool_encoded",
        "mcp_nul",
        "mcp_traversal",
        "mcp_other_server",
    ] {
        assert_eq!(f[probe], "404", "{probe}: {f:?}");
    }
    // The control: the allow-listed tool answers through the same door.
    assert!(f["mcp_allowed"].starts_with("200:"), "{f:?}");
    assert!(f["mcp_allowed"].contains("allowed"), "{f:?}");
    // The MCP server saw exactly one call: the allowed one.
    let log = std::fs::read_to_string(stub_dir.path().join("log")).unwrap();
    assert_eq!(log.matches("tools/call").count(), 1, "{log}");
    sandbox.shutdown().await;
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_pose_as_another_speaker() {
    let env = Env::new();
    let (whoami, calls) = hostile::whoami();
    let mut config = hostile::config(&env, &["broker", "speaker"]);
    config.tools = vec![whoami];
    config.turn_timeout = Some(Duration::from_secs(30));
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#speakers", "x")).await.reply;
    let f = hostile::findings(&reply);
    // Headers and arguments claiming another speaker or channel change nothing: the tool
    // runs for the speaker and channel the host admitted with the message.
    assert!(
        f["speaker"].contains("channel #speakers speaker u1 ann"),
        "{f:?}"
    );
    assert!(f["not_json"].starts_with("400"), "{f:?}");
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    let (channel, speaker, args) = &calls[0];
    assert_eq!(channel, "#speakers");
    assert_eq!((speaker.id.as_str(), speaker.name.as_str()), ("u1", "ann"));
    // The forged claim arrived only as data (the tool's arguments).
    assert_eq!(args["speaker"]["id"], "admin");
    assert_no_leftovers(&sandbox).await;
}
