//! The credential broker over real sockets: a scripted model on loopback, host tools,
//! real MCP servers (`mcp-server-time` from the venv that `scripts/mcp-venv.sh` makes, and
//! a tiny stdio stub in `tests/support/mcp_stub.py`), limits, peer check, cancellation.
//!
//! One test binary, one module per topic: `model` (the model proxy), `tools` (host tools),
//! `limits`, `peer` (peer check, cancellation), `policy`, `mcp` (stdio servers),
//! `mcp_scopes` (session scopes), `mcp_http` (streamable HTTP) and `logs`. This file holds
//! the fixtures they share.

use roundtable_sandbox_test_support::broker_client as client;
use roundtable_sandbox_test_support::captured_logs::Captured;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roundtable_sandbox::broker::{
    validate_policy, ApiKey, BoxFuture, Broker, BrokerError, BrokerLimits, BrokerListener,
    BrokerPolicy, HostTool, McpScope, McpServer, McpTransport, ToolCallContext, TurnContext,
    META_CHANNEL, META_SPEAKER, PROBE_SEGMENT,
};
use roundtable_sandbox::turn::channel_segment;
use roundtable_sandbox::Speaker;
use roundtable_sandbox_test_support::broker_client::{next_chunk, post, post_json};
use roundtable_sandbox_test_support::mcp_stub::{stub_server, stub_server_with};
use roundtable_sandbox_test_support::model::{sse_text_events, ScriptedModel, Step};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::Layer;

const KEY: &str = "sk-test-4f9a1c2b7d3e8a6f";
const MODEL: &str = "configured-model";
const CHAT: &str = "/v1/chat/completions";

fn uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

fn policy(model_url: &str) -> BrokerPolicy {
    BrokerPolicy {
        model: MODEL.into(),
        model_url: model_url.into(),
        api_key: ApiKey::from_static(KEY),
        tools: vec![],
        mcp: vec![],
        allow_http: true,
        limits: BrokerLimits::default(),
        worker_uid: uid(),
        peer_uid_check: true,
        model_request: Default::default(),
        compaction: None,
    }
}

fn speaker() -> Speaker {
    Speaker {
        id: "u-17".into(),
        name: "Ann".into(),
    }
}

/// One turn's listener in a private temp dir (never in the repo).
struct TestTurn {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    cancel: CancellationToken,
    listener: Option<BrokerListener>,
}

impl TestTurn {
    async fn start(broker: &Arc<Broker>) -> Self {
        Self::start_in(broker, "chan-1").await
    }

    /// A turn of `channel`.
    async fn start_in(broker: &Arc<Broker>, channel: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("rtb-")
            .tempdir_in("/tmp")
            .unwrap();
        let socket = dir.path().join("broker.sock");
        let cancel = CancellationToken::new();
        let ctx = TurnContext {
            channel: channel.into(),
            speaker: speaker(),
            cancel: cancel.clone(),
            events: None,
        };
        let listener = broker.listen(&socket, ctx).await.unwrap();
        Self {
            _dir: dir,
            socket,
            cancel,
            listener: Some(listener),
        }
    }

    fn socket(&self) -> &Path {
        &self.socket
    }
}

async fn broker(policy: BrokerPolicy) -> Arc<Broker> {
    Arc::new(Broker::new(policy).await.unwrap())
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

use roundtable_sandbox_test_support::mcp_process::{alive, read_pid, venv, wait_gone};

fn mcp_time_bin() -> PathBuf {
    let bin = venv().join("bin/mcp-server-time");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/mcp-venv.sh (or set ROUNDTABLE_MCP_VENV to a venv with mcp-server-time)",
        bin.display()
    );
    bin
}

/// `mcp-server-time` behind `sh`, which writes the server's pid to `pid_file` first.
fn time_server(pid_file: &Path, tools: &[&str]) -> McpServer {
    McpServer {
        name: "time".into(),
        transport: McpTransport::Stdio {
            command: "sh".into(),
            args: vec![
                "-c".into(),
                r#"echo $$ > "$0"; exec "$1" --local-timezone Etc/UTC"#.into(),
                pid_file.display().to_string(),
                mcp_time_bin().display().to_string(),
            ],
            env: Default::default(),
        },
        scope: None,
        max_sessions: None,
        tools: tools.iter().map(|s| s.to_string()).collect(),
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

#[derive(Default)]
struct Weather {
    seen: Mutex<Vec<(String, Speaker)>>,
}

impl HostTool for Weather {
    fn name(&self) -> &str {
        "weather"
    }
    fn description(&self) -> &str {
        "The weather in a city"
    }
    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1}
            },
            "required": ["city"],
            "additionalProperties": false
        })
    }
    fn call(
        &self,
        args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            self.seen
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
        })
    }
}

/// Waits until its call is cancelled, and tells.
#[derive(Default)]
struct Waits {
    cancelled: Arc<AtomicBool>,
}

impl HostTool for Waits {
    fn name(&self) -> &str {
        "waits"
    }
    fn description(&self) -> &str {
        "Waits forever"
    }
    fn parameters(&self) -> serde_json::Value {
        json!({"type": "object"})
    }
    fn call(
        &self,
        _args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        let flag = self.cancelled.clone();
        Box::pin(async move {
            let token = ctx.cancel.clone();
            tokio::spawn(async move {
                token.cancelled().await;
                flag.store(true, Ordering::SeqCst);
            });
            std::future::pending::<()>().await;
            Ok(String::new())
        })
    }
}

mod limits;
mod logs;
mod mcp;
mod mcp_http;
mod mcp_scopes;
mod model;
mod peer;
mod policy;
mod tools;
