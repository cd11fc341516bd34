//! The broker's request handling: raw bytes from a hostile guest, written to a turn's
//! unix socket (HTTP parsing, routing, limits, JSON and schema checks, the model proxy
//! against a closed port). Any bytes get an HTTP/1.x answer or a closed connection, never a
//! panic (libfuzzer aborts on a panic in any thread) or a hang, and never the key.
#![no_main]

use std::io::{Read, Write};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use roundtable_sandbox::internals::broker::{BoxFuture, Broker, BrokerPolicy, HostTool, ToolCallContext, TurnContext};
use roundtable_sandbox::internals::config::{BrokerLimits};
use roundtable_sandbox::{ApiKey, Speaker};

const KEY: &str = "sk-fuzz-secret-0000";

struct Echo;

impl HostTool for Echo {
    fn name(&self) -> &str {
        "echo"
    }
    fn description(&self) -> &str {
        "Echo"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 64}, "n": {"type": "integer"}},
            "required": ["text"],
            "additionalProperties": false
        })
    }
    fn call(
        &self,
        args: serde_json::Value,
        _ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move { Ok(format!("{args} {KEY}")) })
    }
}

struct State {
    rt: tokio::runtime::Runtime,
    broker: Arc<Broker>,
    dir: std::path::PathBuf,
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let policy = BrokerPolicy {
            model: "fuzz-model".into(),
            model_url: "http://127.0.0.1:9/v1".into(),
            api_key: ApiKey::from_static(KEY),
            tools: vec![Arc::new(Echo)],
            mcp: Vec::new(),
            allow_http: true,
            limits: BrokerLimits {
                max_request_bytes: 64 * 1024,
                max_model_calls: 10_000,
                max_tool_calls: 10_000,
                call_timeout: Duration::from_secs(2),
                ..BrokerLimits::default()
            },
            // The fuzzer's own uid is the worker uid the peer check expects.
            worker_uid: std::fs::metadata("/proc/self")
                .map(|m| {
                    use std::os::unix::fs::MetadataExt;
                    m.uid()
                })
                .unwrap(),
            peer_uid_check: true,
            model_request: Default::default(),
            compaction: None,
        };
        let broker = Arc::new(rt.block_on(Broker::new(policy)).unwrap());
        let dir = std::env::temp_dir().join(format!("rts-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        State { rt, broker, dir }
    })
}

fuzz_target!(|data: &[u8]| {
    let s = state();
    let socket = s.dir.join("broker.sock");
    let ctx = TurnContext {
        channel: "#fuzz".into(),
        speaker: Speaker {
            id: "u1".into(),
            name: "fuzz".into(),
        },
        cancel: tokio_util::sync::CancellationToken::new(),
        events: None,
        account: None,
    };
    let listener = s.rt.block_on(s.broker.listen(&socket, ctx)).unwrap();
    let mut stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let _ = stream.write_all(data);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut answer = Vec::new();
    match stream.read_to_end(&mut answer) {
        Ok(_) => {}
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut =>
        {
            panic!("the broker hung on a request")
        }
        Err(_) => {}
    }
    if !answer.is_empty() {
        assert!(
            answer.starts_with(b"HTTP/1.1 ") || answer.starts_with(b"HTTP/1.0 "),
            "{:?}",
            String::from_utf8_lossy(&answer)
        );
    }
    // The key must never come back, unless the request itself carried it (the broker
    // quotes a guest's unknown tool name back to it, and a guest may know any string).
    let holds_key = |b: &[u8]| b.windows(KEY.len()).any(|w| w == KEY.as_bytes());
    assert!(
        holds_key(data) || !holds_key(&answer),
        "the key leaked: {:?}",
        String::from_utf8_lossy(&answer)
    );
    s.rt.block_on(listener.stop()).unwrap();
});
