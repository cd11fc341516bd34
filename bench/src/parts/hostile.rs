//! `roundtable-bench hostile`: the host's peak RSS under a hostile turn, against the same
//! process idle, in the same run.
//!
//! The measured process is a child (`roundtable-bench --hostile-host SOCKET MODEL_URL`): a
//! [`Broker`] with the default limits and one host tool, listening for one turn, exactly
//! as the runtime holds it for a turn. Nothing else lives in it: the attacker and the
//! upstream run in the parent, so their buffers are not counted.
//!
//! 1. idle: the child's `VmRSS` once it listens and has settled;
//! 2. the hostile turn, for `--seconds` (default 20), all at once, each attacker retrying
//!    as soon as it is answered:
//!    - 64 connections each sending a 1 MiB body of empty arrays (`[[],[],…]`, the shape
//!      that a `serde_json::Value` inflates most) as the `messages` of a model call, to an
//!      upstream that reads the request and never answers;
//!    - 64 more sending the same as a host tool's arguments;
//!    - 16 connections sending their request head one byte per 100 ms (slow headers);
//!    - 16 connections announcing a 1 MiB body and sending 1 KiB per 100 ms (slow bodies);
//!    - 4 streamed model calls to an upstream that never stops streaming (1 KiB per ms),
//!      two read slowly and two never read;
//! 3. the child's `VmHWM` (the kernel's peak RSS of the process) after the attack.
//!
//! `--attack compaction` runs the compaction attack instead (issue 21): 16 connections each
//! sending a valid ~500 KB compaction request to `/v1/compact` and retrying at once, to an
//! upstream that answers every summary request with a 4 MB completion.
//!
//! Both attacks also measure a second turn in the same process (another channel): one small
//! chat call every 100 ms, its latency before the attack and during it (same run, the
//! ratio of the medians), and the child's CPU time and warn lines during the attack.
//!
//! Two knobs to take the harness apart (issue 21): `ROUNDTABLE_BENCH_NO_OTHER=1` measures the
//! other channel before the attack only; `ROUNDTABLE_BENCH_NO_SUBSCRIBER=1` gives the child no
//! subscriber (its warn lines are then not counted).
//!
//! Printed: idle, peak, peak − idle (the figure with the target: ≤ 64 MiB), peak / idle,
//! the other channel's latency, and what the attackers were answered.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::StreamBody;
use hyper::body::Frame;
use roundtable_sandbox::internals::broker::Broker;
use roundtable_sandbox::internals::broker::{BrokerPolicy, TurnContext};
use roundtable_sandbox::internals::testing::{broker_policy, FnTool};
use roundtable_sandbox::protocol::Speaker;
use serde::Serialize;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

/// The target: the hostile turn's peak over idle.
pub const TARGET_MIB: f64 = 64.0;

fn echo() -> FnTool {
    FnTool::new("echo", "echoes its arguments", |args, _| async move {
        Ok(args.to_string().chars().take(100).collect())
    })
}

/// The other channel's turn socket beside `socket`.
fn other_socket(socket: &Path) -> PathBuf {
    socket.with_file_name("other.sock")
}

/// The attack `run` makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attack {
    /// Model and tool calls, slow clients, endless streams.
    Chat,
    /// Compactions answered with 4 MB.
    Compaction,
    /// Hostile MCP answers.
    Mcp,
    /// Many large egress answers at once (issue 45), the route's per-turn caps out of the
    /// way.
    Egress,
    /// The same flood through a route with its default per-turn caps (32 requests, 16 MiB
    /// in): what an operator who sets none gets.
    EgressDefaults,
}

/// The child's egress route (`--attack egress`, `egress-defaults`): `ROUNDTABLE_BENCH_EGRESS`
/// = the CA's PEM file, a space, the DNS server's address, and ` defaults` to keep the
/// route's per-turn caps.
const EGRESS_ENV: &str = "ROUNDTABLE_BENCH_EGRESS";

/// The child's MCP servers (`--attack mcp`): `ROUNDTABLE_BENCH_MCP` = the stub's dir, a
/// space, the hostile HTTP server's URL.
const MCP_ENV: &str = "ROUNDTABLE_BENCH_MCP";

/// The hostile MCP servers of the child, from [`MCP_ENV`].
fn mcp_servers() -> Vec<roundtable_sandbox::McpServer> {
    use roundtable_sandbox::{McpConfine, McpServer, McpTransport};
    let Some(spec) = std::env::var(MCP_ENV).ok() else {
        return Vec::new();
    };
    let (dir, url) = spec.split_once(' ').unwrap_or((&spec, ""));
    let stub = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/support/mcp_stub.py");
    let mut stdio = McpServer::new(
        "stub",
        McpTransport::Stdio {
            command: "python3".into(),
            args: vec![stub.display().to_string()],
            env: [("STUB_DIR".to_owned(), dir.to_owned())].into(),
        },
        &["echo", "bigmeta", "structured", "notify", "endless"],
    );
    stdio.confine = McpConfine::Host;
    let http = McpServer::new(
        "hostile",
        McpTransport::Http {
            url: url.to_owned(),
            headers: Default::default(),
        },
        &["bigbody", "bigevent"],
    );
    vec![stdio, http]
}

/// The hostile streamable-HTTP MCP server, on a free loopback port.
fn hostile_http() -> Result<(std::process::Child, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/support/mcp_hostile_http.py");
    let child = Command::new("python3")
        .arg(script)
        .arg(port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start the hostile HTTP MCP server")?;
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok((child, format!("http://127.0.0.1:{port}/mcp")));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("the hostile HTTP MCP server did not start")
}

/// In the child: a broker listening on `socket` (the hostile turn) and beside it (another
/// channel's turn) until stdin closes; warn lines go to stderr.
pub fn host(socket: &str, model_url: &str) -> Result<()> {
    // `ROUNDTABLE_BENCH_NO_SUBSCRIBER=1`: no subscriber (what the harness costs, issue 21).
    if std::env::var_os("ROUNDTABLE_BENCH_NO_SUBSCRIBER").is_none() {
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .init();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut policy = BrokerPolicy {
            model: "bench-model".into(),
            tools: vec![Arc::new(echo())],
            mcp: mcp_servers(),
            ..broker_policy(model_url, "sk-bench-hostile-never-leaves")
        };
        if !policy.mcp.is_empty() {
            policy.allow_http = true;
            policy.limits.max_tool_calls = 10_000;
        }
        // `<CA file> <DNS address> <site port> [defaults]`.
        if let Ok(egress) = std::env::var(EGRESS_ENV) {
            let words: Vec<&str> = egress.split(' ').collect();
            let [ca, dns, port, rest @ ..] = words.as_slice() else {
                anyhow::bail!("{EGRESS_ENV}: {egress:?} is not <CA> <DNS> <port> [defaults]");
            };
            let defaults = rest == ["defaults"];
            let port = port.parse().context("the site's port")?;
            let mut route = super::egress::route(Path::new(ca), port);
            if defaults {
                route.limits = roundtable_sandbox::EgressRoute::hosts("web", &["*"]).limits;
            }
            policy.egress = vec![route];
            policy.egress_nameserver = Some(dns.parse().context("the DNS address")?);
        }
        // The other channel's turn has calls to spare for its 10 calls a second (a broker
        // of its own, in the same process and runtime: what it measures is the host's
        // threads and CPU that the hostile turn leaves it).
        let mut spare = policy.clone();
        spare.limits.max_model_calls = 10_000;
        let broker = Arc::new(Broker::new(policy).await.context("start the broker")?);
        let spare = Arc::new(Broker::new(spare).await.context("start the broker")?);
        let ctx = |channel: &str| TurnContext {
            channel: channel.into(),
            speaker: Speaker {
                id: "u1".into(),
                name: "mallory".into(),
            },
            cancel: CancellationToken::new(),
            events: None,
            account: None,
        };
        let listener = broker.listen(Path::new(socket), ctx("#hostile")).await?;
        let other = spare
            .listen(&other_socket(Path::new(socket)), ctx("#other"))
            .await?;
        println!("ready");
        // Until the parent closes our stdin.
        tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).unwrap_or(0) > 0 {}
        })
        .await?;
        listener.stop().await?;
        other.stop().await?;
        Ok(())
    })
}

fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

type UpBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// The upstream: a streamed call never ends; a summary request is answered with a 4 MB
/// completion; the other channel's call with a short one; any other call is read whole
/// and never answered.
async fn upstream() -> Result<(String, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = roundtable_sandbox_test_support::http::serve(listener, answer_hostile);
    Ok((format!("http://{addr}/v1"), task))
}

/// The hostile upstream's answer (see [`upstream`]).
async fn answer_hostile(req: hyper::Request<hyper::body::Incoming>) -> hyper::Response<UpBody> {
    let body = roundtable_sandbox_test_support::http::body(req).await;
    let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    let streamed = has(b"\"stream\":true");
    let summary = has(b"You compact the conversation");
    let ping = has(PING.as_bytes());
    drop(body);
    if summary || ping {
        let content = if summary {
            "x".repeat(4_000_000)
        } else {
            "pong".into()
        };
        let answer = json!({
            "choices": [{"message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}
        });
        return hyper::Response::builder()
            .header("content-type", "application/json")
            .body(UpBody::new(http_body_util::Full::new(Bytes::from(
                answer.to_string(),
            ))))
            .expect("a response");
    }
    if !streamed {
        std::future::pending::<()>().await;
    }
    let event = Bytes::from(format!(
        "data: {}\n\n",
        json!({"choices": [{"delta": {"content": "x".repeat(1000)}}]})
    ));
    let frames = futures_util::stream::unfold(event, |event| async move {
        tokio::time::sleep(Duration::from_millis(1)).await;
        Some((Ok::<_, Infallible>(Frame::data(event.clone())), event))
    });
    hyper::Response::builder()
        .header("content-type", "text/event-stream")
        .body(UpBody::new(StreamBody::new(frames)))
        .expect("a response")
}

/// The other channel's message.
const PING: &str = "ping-from-the-other-channel";

/// A valid compaction request of about `size` bytes (many short guest messages).
fn compaction_body(size: usize) -> Bytes {
    use roundtable_sandbox::protocol::chat::Message;
    use roundtable_sandbox::protocol::compaction::CompactRequest;
    let mut request = CompactRequest {
        messages: Vec::new(),
        omitted: 0,
        previous_summary: Some("p".repeat(60_000)),
        reload: vec!["notes.txt".into()],
        tokens_before: 1_000_000,
        budget: 4_000_000,
    };
    let text = "mallory: ".to_owned() + &"y".repeat(240);
    let mut len = 60_200;
    while len + 300 < size && request.messages.len() < 2048 {
        request.messages.push(Message::User {
            content: text.clone(),
        });
        len += text.len() + 30;
    }
    Bytes::from(serde_json::to_vec(&request).expect("serialisable"))
}

/// `{"<field>":[[],[],…]}` of `size` bytes.
fn nested_body(field: &str, size: usize) -> Bytes {
    let mut body = format!("{{\"{field}\":[").into_bytes();
    while body.len() + 3 + 4 <= size {
        body.extend_from_slice(b"[],");
    }
    body.extend_from_slice(b"[]]}");
    Bytes::from(body)
}

#[derive(Default)]
struct Tally(Mutex<BTreeMap<String, u64>>);

impl Tally {
    fn add(&self, what: impl Into<String>) {
        *self.0.lock().unwrap().entry(what.into()).or_default() += 1;
    }
}

/// The status of an answer's head, or what happened instead.
async fn read_status(s: &mut UnixStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
        match s.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            end if !buf.starts_with(b"HTTP/") => {
                return if end.is_ok() { "closed" } else { "reset" }.into()
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)
        .unwrap_or("?")
        .to_owned()
}

fn head(path: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n\
         Content-Length: {len}\r\nConnection: close\r\n\r\n"
    )
}

/// One attacker sending `body` to `path` until `end`, retrying `pause` after each answer.
async fn flood(
    socket: PathBuf,
    path: &'static str,
    body: Bytes,
    pause: Duration,
    end: Instant,
    tally: Arc<Tally>,
) {
    while Instant::now() < end {
        let Ok(mut s) = UnixStream::connect(&socket).await else {
            tally.add(format!("{path} connect failed"));
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let answer = tokio::time::timeout(end.saturating_duration_since(Instant::now()), async {
            let sent = async {
                s.write_all(head(path, body.len()).as_bytes()).await?;
                s.write_all(&body).await
            };
            match sent.await {
                Ok(()) => read_status(&mut s).await,
                // Refused before the body was read: the answer may be there all the same.
                Err(_) => format!("{} before the body was sent", read_status(&mut s).await),
            }
        })
        .await;
        match answer {
            Ok(status) => tally.add(format!("{path} {status}")),
            Err(_) => tally.add(format!("{path} still open at the end")),
        }
        tokio::time::sleep(pause).await;
    }
}

/// One connection trickling `bytes` one `step` per 100 ms until `end`.
async fn trickle(
    socket: PathBuf,
    what: &'static str,
    bytes: Vec<u8>,
    step: usize,
    end: Instant,
    tally: Arc<Tally>,
) {
    while Instant::now() < end {
        let Ok(mut s) = UnixStream::connect(&socket).await else {
            tally.add(format!("{what} connect failed"));
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut outcome = "still open at the end".to_owned();
        for piece in bytes.chunks(step) {
            if Instant::now() >= end {
                break;
            }
            if s.write_all(piece).await.is_err() {
                outcome = "cut off by the broker".into();
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if outcome != "cut off by the broker" && Instant::now() < end {
            let left = end.saturating_duration_since(Instant::now());
            if let Ok(status) = tokio::time::timeout(left, read_status(&mut s)).await {
                outcome = status;
            }
        }
        tally.add(format!("{what}: {outcome}"));
    }
}

/// One attacker `GET`ting `path` through the egress route until `end`, at once again
/// after each answer (read whole).
async fn egress_flood(socket: PathBuf, path: String, end: Instant, tally: Arc<Tally>) {
    while Instant::now() < end {
        let left = end.saturating_duration_since(Instant::now());
        let answer = tokio::time::timeout(left, super::egress::broker_get(&socket, &path)).await;
        let what = path.rsplit('/').next().unwrap_or("?").to_owned();
        match answer {
            Ok(Ok(status)) => tally.add(format!("egress {what} {status}")),
            Ok(Err(_)) => tally.add(format!("egress {what} failed")),
            Err(_) => tally.add(format!("egress {what} still open at the end")),
        }
    }
}

/// A streamed model call read `per_read` bytes per 10 ms (0: never read).
async fn stream_reader(socket: PathBuf, per_read: usize, end: Instant, tally: Arc<Tally>) {
    while Instant::now() < end {
        let Ok(mut s) = UnixStream::connect(&socket).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let body = br#"{"stream":true,"messages":[{"role":"user","content":"go on forever"}]}"#;
        let mut req = head("/v1/chat/completions", body.len()).into_bytes();
        req.extend_from_slice(body);
        if s.write_all(&req).await.is_err() {
            tally.add("stream write failed");
            continue;
        }
        let mut read = 0usize;
        let mut buf = vec![0u8; per_read.max(1)];
        if per_read > 0 {
            let status = read_status(&mut s).await;
            if status != "200" {
                tally.add(format!("stream (read {per_read} B / 10 ms): {status}"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        }
        let outcome = loop {
            if Instant::now() >= end {
                break "still streaming at the end";
            }
            if per_read == 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            match s.read(&mut buf).await {
                Ok(0) => break "ended by the broker",
                Ok(n) => read += n,
                Err(_) => break "reset",
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        tally.add(format!(
            "stream (read {per_read} B / 10 ms): {outcome} after {} KiB",
            read / 1024
        ));
    }
}

/// The other channel's chat calls, one every 100 ms until `end`: each call's latency (ms).
async fn other_channel(socket: PathBuf, end: Instant) -> Vec<f64> {
    let body = format!(r#"{{"messages":[{{"role":"user","content":"{PING}"}}]}}"#);
    let mut out = Vec::new();
    while Instant::now() < end {
        let started = Instant::now();
        let mut req = head("/v1/chat/completions", body.len()).into_bytes();
        req.extend_from_slice(body.as_bytes());
        let answered = async {
            let mut s = UnixStream::connect(&socket).await.ok()?;
            s.write_all(&req).await.ok()?;
            let mut all = Vec::new();
            s.read_to_end(&mut all).await.ok()?;
            all.starts_with(b"HTTP/1.1 200").then_some(())
        };
        if tokio::time::timeout(Duration::from_secs(10), answered)
            .await
            .ok()
            .flatten()
            .is_some()
        {
            out.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    out
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The hostile turn's figures.
#[derive(Debug, Serialize)]
pub struct Hostile {
    pub attack: String,
    pub other_channel_p50_ms_before: f64,
    pub other_channel_p50_ms_during: f64,
    pub other_channel_ratio: f64,
    pub child_cpu_s: f64,
    pub warn_lines: u64,
    pub seconds: u64,
    pub idle_kib: u64,
    /// The child's VmHWM after the attack.
    pub peak_kib: u64,
    pub peak_sampled_kib: u64,
    pub after_kib: u64,
    /// Peak − idle (the target's, at most [`TARGET_MIB`]).
    pub over_idle_mib: f64,
    pub ratio: f64,
    pub target_mib: f64,
    pub met: bool,
    /// What the attackers were answered, counted.
    pub answers: BTreeMap<String, u64>,
}

/// The measurement; prints the figures and returns them.
pub async fn run(seconds: u64, attack: Attack) -> Result<Hostile> {
    let (model_url, upstream_task) = upstream().await?;
    let dir = tempfile::Builder::new()
        .prefix("rtb-hostile-")
        .tempdir_in("/tmp")?;
    let socket = dir.path().join("broker.sock");
    let mut mcp_http = None;
    let mut command = Command::new(std::env::current_exe()?);
    // `--attack egress`: the site and its DNS live here, in the parent (not counted).
    let web = match attack {
        Attack::Egress | Attack::EgressDefaults => {
            use roundtable_sandbox_test_support::egress::{Dns, TestCa, Upstream, REACHABLE};
            let ca = TestCa::new();
            let up = Upstream::start(&ca, REACHABLE, 0).await;
            let dns = Dns::start(&[("egress.test", &[REACHABLE])]).await;
            let caps = if attack == Attack::EgressDefaults {
                " defaults"
            } else {
                ""
            };
            command.env(
                EGRESS_ENV,
                format!(
                    "{} {} {}{caps}",
                    ca.pem_file.display(),
                    dns.addr,
                    up.addr.port()
                ),
            );
            Some((ca, up, dns))
        }
        _ => None,
    };
    if attack == Attack::Mcp {
        let (server, url) = hostile_http()?;
        mcp_http = Some(server);
        command.env(MCP_ENV, format!("{} {url}", dir.path().display()));
    }
    let mut child = command
        .args([
            "--hostile-host",
            socket.to_str().context("socket path")?,
            &model_url,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start the hostile host child")?;
    let pid = child.id();
    // The child's warn lines, counted (the first few shown).
    let stderr = child.stderr.take().context("child stderr")?;
    let warns = std::thread::spawn(move || {
        let mut n = 0u64;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("WARN") {
                n += 1;
            }
            if n <= 3 {
                eprintln!("child: {line}");
            }
        }
        n
    });
    let mut stdout = BufReader::new(child.stdout.take().context("child stdout")?);
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    if line.trim() != "ready" {
        let _ = child.kill();
        bail!("the hostile host child said {line:?}");
    }
    // Settle, then idle is the mean of a few samples.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut idle = 0;
    for _ in 0..5 {
        idle += status_kib(pid, "VmRSS:")?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let idle_kib = idle / 5;
    let idle_hwm_kib = status_kib(pid, "VmHWM:")?;
    let other = other_socket(&socket);
    let mut quiet = other_channel(other.clone(), Instant::now() + Duration::from_secs(3)).await;
    let idle_hwm_kib = idle_hwm_kib.max(status_kib(pid, "VmHWM:")?);

    println!(
        "\n== hostile turn ({attack:?} attack): {seconds} s against one turn's broker (child pid {pid}, default limits)"
    );
    let tally = Arc::new(Tally::default());
    let cpu_before = crate::probe::cpu_ticks(pid)?;
    let end = Instant::now() + Duration::from_secs(seconds);
    // `ROUNDTABLE_BENCH_NO_OTHER=1`: the other channel is measured before the attack only
    // (what its calls during the attack cost the peak, issue 21).
    let busy = match std::env::var_os("ROUNDTABLE_BENCH_NO_OTHER") {
        None => tokio::spawn(other_channel(other, end)),
        Some(_) => tokio::spawn(async { vec![f64::NAN] }),
    };
    let mut set = tokio::task::JoinSet::new();
    if attack == Attack::Compaction {
        let body = compaction_body(500_000);
        println!("compaction request: {} bytes", body.len());
        for _ in 0..16 {
            set.spawn(flood(
                socket.clone(),
                "/v1/compact",
                body.clone(),
                Duration::ZERO,
                end,
                tally.clone(),
            ));
        }
    }
    let chat = nested_body("messages", 1 << 20);
    let tool = nested_body("a", 1 << 20);
    let pause = Duration::from_millis(50);
    for _ in 0..if attack == Attack::Chat { 64 } else { 0 } {
        set.spawn(flood(
            socket.clone(),
            "/v1/chat/completions",
            chat.clone(),
            pause,
            end,
            tally.clone(),
        ));
        set.spawn(flood(
            socket.clone(),
            "/v1/tools/echo",
            tool.clone(),
            pause,
            end,
            tally.clone(),
        ));
    }
    let slow_head = head("/v1/chat/completions", 2).into_bytes();
    let mut slow_body = head("/v1/tools/echo", 1 << 20).into_bytes();
    slow_body.extend_from_slice(&nested_body("a", 1 << 20));
    for _ in 0..if attack == Attack::Chat { 16 } else { 0 } {
        set.spawn(trickle(
            socket.clone(),
            "slow head",
            slow_head.clone(),
            1,
            end,
            tally.clone(),
        ));
        set.spawn(trickle(
            socket.clone(),
            "slow body",
            slow_body.clone(),
            1024,
            end,
            tally.clone(),
        ));
    }
    if attack == Attack::Mcp {
        let calls: [(&'static str, &str); 6] = [
            ("/v1/mcp/stub/bigmeta", "{}"),
            ("/v1/mcp/stub/structured", "{}"),
            ("/v1/mcp/stub/notify", r#"{"count":4}"#),
            ("/v1/mcp/stub/endless", "{}"),
            ("/v1/mcp/hostile/bigbody", "{}"),
            ("/v1/mcp/hostile/bigevent", "{}"),
        ];
        // `ROUNDTABLE_BENCH_MCP_ONLY=PATH`: that answer alone (each measured on its own).
        let only = std::env::var("ROUNDTABLE_BENCH_MCP_ONLY").ok();
        let mut calls = calls.to_vec();
        calls.push(("/v1/mcp/stub/structured", r#"{"mb":0.2}"#));
        calls.retain(|(path, body)| {
            only.as_deref()
                .is_none_or(|o| o == *path || o == format!("{path} {body}"))
        });
        for (path, body) in calls {
            set.spawn(flood(
                socket.clone(),
                path,
                Bytes::from(body.to_owned()),
                Duration::ZERO,
                end,
                tally.clone(),
            ));
        }
    }
    if let Some((_, up, _)) = &web {
        // 16 connections each for a 1 MiB answer (the route's `max_response_bytes`), an
        // endless one (cut at the cap) and a gzip bomb (cut at the cap after decoding),
        // each retrying as soon as it is answered.
        let port = up.addr.port();
        for what in ["big?kb=1024", "endless", "bomb"] {
            let path = format!("/v1/egress/web/https/egress.test:{port}/{what}");
            for _ in 0..16 {
                set.spawn(egress_flood(
                    socket.clone(),
                    path.clone(),
                    end,
                    tally.clone(),
                ));
            }
        }
    }
    let readers: &[usize] = if attack == Attack::Chat {
        &[0, 0, 1024, 1024]
    } else {
        &[]
    };
    for &per_read in readers {
        set.spawn(stream_reader(socket.clone(), per_read, end, tally.clone()));
    }
    let mut peak_sampled = 0;
    while Instant::now() < end {
        peak_sampled = peak_sampled.max(status_kib(pid, "VmRSS:").unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let hwm_kib = status_kib(pid, "VmHWM:")?;
    let after_kib = status_kib(pid, "VmRSS:")?;
    let cpu = (crate::probe::cpu_ticks(pid)? - cpu_before) as f64 / 100.0;
    let mut busy = busy.await?;
    // Each attacker records how its last attempt ended, then stops.
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while set.join_next().await.is_some() {}
    })
    .await;
    set.abort_all();
    while set.join_next().await.is_some() {}
    drop(child.stdin.take());
    let exited = tokio::task::spawn_blocking(move || child.wait()).await??;
    upstream_task.abort();
    drop(web);
    if let Some(mut server) = mcp_http {
        let _ = server.kill();
        let _ = server.wait();
    }
    if !exited.success() {
        bail!("the hostile host child failed ({exited})");
    }
    let warn_lines = warns.join().unwrap_or(0);
    let (quiet_n, busy_n) = (quiet.len(), busy.len());
    let (quiet_ms, busy_ms) = (median(&mut quiet), median(&mut busy));

    let mib = |kib: u64| kib as f64 / 1024.0;
    let over = mib(hwm_kib.saturating_sub(idle_kib));
    println!(
        "idle RSS            {:>8.1} MiB (VmHWM before the attack {:.1} MiB)",
        mib(idle_kib),
        mib(idle_hwm_kib)
    );
    println!(
        "peak RSS (VmHWM)    {:>8.1} MiB (highest 5 ms sample {:.1} MiB)",
        mib(hwm_kib),
        mib(peak_sampled)
    );
    println!("RSS after           {:>8.1} MiB", mib(after_kib));
    println!(
        "peak − idle         {over:>8.1} MiB (target ≤ {TARGET_MIB} MiB: {}), peak / idle {:.2}",
        if over <= TARGET_MIB { "met" } else { "NOT met" },
        hwm_kib as f64 / idle_kib.max(1) as f64
    );
    println!(
        "other channel       p50 {quiet_ms:.2} ms before ({quiet_n} calls), {busy_ms:.2} ms during ({busy_n} calls): ×{:.2}",
        busy_ms / quiet_ms
    );
    println!("child CPU           {cpu:.2} s during the attack; {warn_lines} warn lines");
    println!("what the attackers were answered:");
    let answers = tally.0.lock().unwrap().clone();
    for (what, n) in &answers {
        println!("  {n:>6}  {what}");
    }
    Ok(Hostile {
        attack: format!("{attack:?}").to_lowercase(),
        other_channel_p50_ms_before: quiet_ms,
        other_channel_p50_ms_during: busy_ms,
        other_channel_ratio: busy_ms / quiet_ms,
        child_cpu_s: cpu,
        warn_lines,
        seconds,
        idle_kib,
        peak_kib: hwm_kib,
        peak_sampled_kib: peak_sampled,
        after_kib,
        over_idle_mib: over,
        ratio: hwm_kib as f64 / idle_kib.max(1) as f64,
        target_mib: TARGET_MIB,
        met: over <= TARGET_MIB,
        answers,
    })
}
