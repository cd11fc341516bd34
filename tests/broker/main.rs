//! The credential broker over real sockets: a scripted model on loopback, host tools,
//! real MCP servers (`mcp-server-time` from the venv that `scripts/mcp-venv.sh` makes, and
//! a tiny stdio stub in `tests/support/mcp_stub.py`), limits, peer check, cancellation.
//!
//! One test binary, one module per topic: `model` (the model proxy), `tools` (host tools),
//! `limits`, `peer` (peer check, cancellation), `policy`, `mcp` (stdio servers as host children),
//! `mcp_confined` (stdio servers in their own containers, the default), `mcp_scopes` (session scopes), `mcp_shared` (a shared session's fair order and timeouts), `mcp_http` (streamable HTTP) and `logs`. This file holds
//! the fixtures they share.

use roundtable_sandbox_test_support::broker_client as client;
use roundtable_sandbox_test_support::captured_logs::Captured;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roundtable_sandbox::internals::broker::{
    validate_policy, BoxFuture, Broker, BrokerError, BrokerPolicy, META_CHANNEL, META_SPEAKER,
};
use roundtable_sandbox::internals::config::{
    ApiKey, BrokerLimits, McpScope, McpServer, McpTransport, PROBE_SEGMENT,
};
use roundtable_sandbox::internals::testing::{broker_policy, start_broker, BrokerTurn, FnTool};
use roundtable_sandbox::internals::turn::channel_segment;
use roundtable_sandbox::Speaker;
use roundtable_sandbox_test_support::broker_client::{next_chunk, post, post_json};
use roundtable_sandbox_test_support::mcp_stub::{stub_server, stub_server_with};
use roundtable_sandbox_test_support::model::{sse_text_events, ScriptedModel, Step};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing_subscriber::Layer;

const KEY: &str = "sk-test-4f9a1c2b7d3e8a6f";
const MODEL: &str = "configured-model";
const CHAT: &str = "/v1/chat/completions";

fn uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

fn policy(model_url: &str) -> BrokerPolicy {
    broker_policy(model_url, KEY)
}

fn speaker() -> Speaker {
    Speaker {
        id: "u-17".into(),
        name: "Ann".into(),
    }
}

/// A broker offering the host tool `weather` (its model at no address), and the record of
/// the tool's calls.
async fn weather_broker() -> (Seen, Arc<Broker>) {
    let (weather, seen) = weather();
    let mut p = policy("http://127.0.0.1:9/v1");
    p.tools = vec![weather];
    (seen, start_broker(p).await)
}

/// A turn of `chan-1`.
async fn start_turn(broker: &Arc<Broker>) -> BrokerTurn {
    start_turn_in(broker, "chan-1").await
}

/// A turn of `channel`.
async fn start_turn_in(broker: &Arc<Broker>, channel: &str) -> BrokerTurn {
    BrokerTurn::start(broker, channel, speaker()).await
}

fn chat_body(stream: bool) -> serde_json::Value {
    json!({
        "model": "guest-picked-model",
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]
    })
}

async fn post_json_result(
    socket: &Path,
    path: &str,
    body: &serde_json::Value,
) -> std::io::Result<client::Answer> {
    post(socket, path, &[], body.to_string()).await
}

// ---------------------------------------------------------------- MCP helpers

use roundtable_sandbox_test_support::mcp_process::{
    self, alive, read_pid, venv, venv_bin, wait_gone,
};

fn mcp_time_bin() -> PathBuf {
    venv_bin("mcp-server-time")
}

/// A stdio transport: `command` run with `args`, no environment of its own.
fn stdio(command: &str, args: &[&str]) -> McpTransport {
    McpTransport::Stdio {
        command: command.into(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        env: Default::default(),
    }
}

/// An MCP server run by python3 alone, inline, in the MCP image: `prelude` defines
/// `call(arguments)`, whose value the one tool `tool` (its input properties `properties`,
/// those in `required` required) answers as JSON text.
fn inline_server(
    name: &str,
    tool: &str,
    properties: serde_json::Value,
    required: &[&str],
    prelude: &str,
) -> McpServer {
    let tools = serde_json::json!([{
        "name": tool,
        "description": "inline test tool",
        "inputSchema": {"type": "object", "properties": properties, "required": required},
    }]);
    let script = format!(
        r#"
import json, sys
NAME, TOOLS = {name:?}, json.loads({tools:?})
{prelude}
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m: continue
    if m["method"] == "initialize":
        r = {{"protocolVersion": m["params"]["protocolVersion"], "capabilities": {{"tools": {{}}}},
             "serverInfo": {{"name": NAME, "version": "1"}}}}
    elif m["method"] == "tools/list":
        r = {{"tools": TOOLS}}
    elif m["method"] == "tools/call":
        got = call(m["params"].get("arguments", {{}}))
        r = {{"content": [{{"type": "text", "text": json.dumps(got)}}]}}
    else:
        r = {{}}
    sys.stdout.write(json.dumps({{"jsonrpc": "2.0", "id": m["id"], "result": r}}) + "\n")
    sys.stdout.flush()
"#,
        tools = tools.to_string(),
    );
    let mut config = McpServer::new(name, stdio("python3", &["-c", &script]), &[tool]);
    config.image = Some(roundtable_sandbox_test_support::mcp_process::mcp_image());
    config
}

/// `docker ARGS`, which must succeed: its output, trimmed.
fn docker(args: &[&str]) -> String {
    let out = std::process::Command::new("docker")
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "docker {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The MCP engine's containers (running or not), by its instance label.
fn containers(engine: &roundtable_sandbox::internals::broker::McpEngine) -> Vec<String> {
    docker(&[
        "ps",
        "-a",
        "--format",
        "{{.Names}}",
        "--filter",
        &format!("label=roundtable-sandbox={}", engine.instance),
    ])
    .lines()
    .map(str::to_owned)
    .collect()
}

/// Waits (20 s at most) until something listens on loopback `port`; `what` names it.
async fn wait_listening(port: u16, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(std::time::Instant::now() < deadline, "{what} did not start");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `mcp-server-time` behind `sh`, which writes the server's pid to `pid_file` first.
fn time_server(pid_file: &Path, tools: &[&str]) -> McpServer {
    let transport = stdio(
        "sh",
        &[
            "-c",
            r#"echo $$ > "$0"; exec "$1" --local-timezone Etc/UTC"#,
            &pid_file.display().to_string(),
            &mcp_time_bin().display().to_string(),
        ],
    );
    McpServer {
        // A host child: these tests watch the server's host pid (reaping, restarts).
        confine: roundtable_sandbox::internals::config::McpConfine::Host,
        ..McpServer::new("time", transport, tools)
    }
}

fn kill9(pid: i32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

// ---------------------------------------------------------------- host tools shared by the topics

/// Who the host tool `weather` was called for: the channel and speaker of each call.
type Seen = Arc<Mutex<Vec<(String, Speaker)>>>;

/// The host tool `weather`, and the record of its calls.
fn weather() -> (Arc<FnTool>, Seen) {
    let seen = Seen::default();
    let record = seen.clone();
    let tool = FnTool::new("weather", "The weather in a city", move |args, ctx| {
        let record = record.clone();
        async move {
            record
                .lock()
                .unwrap()
                .push((ctx.channel.clone(), ctx.speaker.clone()));
            let city = args["city"].as_str().unwrap();
            if city == "Atlantis" {
                return Err("no forecast for Atlantis".into());
            }
            if city == "Leak" {
                return Ok(format!("the key is {KEY}"));
            }
            Ok(format!(
                "sunny in {city} (channel {}, asked by {} {})",
                ctx.channel, ctx.speaker.name, ctx.speaker.id
            ))
        }
    })
    .with_parameters(json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1}
        },
        "required": ["city"],
        "additionalProperties": false
    }));
    (Arc::new(tool), seen)
}

/// The host tool `waits`: waits until its call is cancelled, and tells (the flag).
fn waits() -> (Arc<FnTool>, Arc<AtomicBool>) {
    let cancelled = Arc::new(AtomicBool::new(false));
    let flag = cancelled.clone();
    let tool = FnTool::new("waits", "Waits forever", move |_, ctx| {
        let flag = flag.clone();
        async move {
            let token = ctx.cancel.clone();
            tokio::spawn(async move {
                token.cancelled().await;
                flag.store(true, Ordering::SeqCst);
            });
            std::future::pending::<()>().await;
            Ok(String::new())
        }
    });
    (Arc::new(tool), cancelled)
}

mod egress;
mod events;
mod limits;
mod logs;
mod mcp;
mod mcp_confined;
mod mcp_hostile;
mod mcp_http;
mod mcp_layer;
mod mcp_scopes;
mod mcp_shared;
mod model;
mod peer;
mod policy;
mod tools;
