//! The metrics endpoint scraped by a real Prometheus (the Debian package `prometheus`,
//! which scripts/setup.sh --tests installs): the terminal bot runs with `--metrics` and a scripted
//! OpenAI-compatible upstream on loopback, serves turns that succeed, time out, are busy,
//! go over the workspace quota and hit a budget (mid-turn and at admission), while
//! Prometheus scrapes it every second; the test then asks Prometheus's HTTP API for each
//! counter and checks it against what happened, and that no label holds a channel, a
//! speaker or guest text. Runs as the service user, real containers.

#[allow(dead_code)]
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{instance_of, scratch};
use serde_json::{json, Value};

/// How long a reply, a scrape or a state may take: generous, the machine may be busy.
const PATIENCE: Duration = Duration::from_secs(240);
const KEY: &str = "sk-metrics-test-51c2";

/// A free loopback port (bound, then let go: Prometheus binds it next).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// ---- the scripted upstream -------------------------------------------------------------

fn completion(message: Value, prompt: u64, completion: u64) -> Value {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion}
    })
}

fn tool_call(name: &str, args: Value, prompt: u64, out: u64) -> Value {
    completion(
        json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": name, "arguments": args.to_string()}}]}),
        prompt,
        out,
    )
}

/// The answer to one chat request: chosen by the turn's last message (a tool's result
/// gets a closing text; a user message by its keyword).
fn answer(request: &Value) -> Value {
    let messages = request["messages"].as_array().cloned().unwrap_or_default();
    let last = messages.last().cloned().unwrap_or(Value::Null);
    if last["role"] == "tool" {
        return completion(
            json!({"role": "assistant", "content": "after the tool"}),
            50,
            10,
        );
    }
    let text = last["content"].as_str().unwrap_or("");
    let sh = |command: &str| json!({"command": command, "timeout_seconds": 120});
    if text.contains("please-slow") {
        SLOW_SEEN.store(true, Ordering::SeqCst);
        tool_call("sh", sh("sleep 110"), 10, 5)
    } else if text.contains("please-fill") {
        tool_call(
            "sh",
            sh("dd if=/dev/zero of=big bs=1M count=64; sleep 110"),
            10,
            5,
        )
    } else if text.contains("please-spend") {
        tool_call("roll_dice", json!({"sides": 6}), 400, 200)
    } else if text.contains("please-tool") {
        tool_call("roll_dice", json!({"sides": 6}), 30, 10)
    } else {
        completion(json!({"role": "assistant", "content": "hello"}), 100, 20)
    }
}

/// Whether the slow turn's model call has come (its turn is running in its container).
static SLOW_SEEN: AtomicBool = AtomicBool::new(false);

/// Serves chat completions on loopback until the process ends.
fn start_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            std::thread::spawn(move || {
                let _ = serve_one(stream);
            });
        }
    });
    addr
}

fn serve_one(mut stream: TcpStream) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        loop {
            let mut h = String::new();
            reader.read_line(&mut h)?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let reply = answer(&request).to_string();
        write!(
            stream,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
            reply.len()
        )?;
        stream.flush()?;
    }
}

// ---- the bot ----------------------------------------------------------------------------

struct Bot {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    metrics: SocketAddr,
}

fn config(dir: &Path, upstream: SocketAddr) -> std::path::PathBuf {
    let path = dir.join("bot.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"/unused/run\"\n\
             workspace_root = \"/unused/ws\"\nmodel = \"scripted\"\n\
             model_url = \"http://{upstream}/v1\"\nallow_http = true\n\
             api_key_env = \"RT_METRICS_TEST_KEY\"\ninstance = \"{}\"\nturn_timeout_secs = 30\n\
             [limits]\ndisk_floor_mb = 0\ndisk_floor_percent = 0\nworkspace_mb = 16\n\
             [budgets]\nstate_file = \"{}\"\nspeaker_tokens_per_day = 500\n",
            instance_of(dir),
            dir.join("budgets.sqlite").display()
        ),
    )
    .unwrap();
    path
}

impl Bot {
    fn start(dir: &Path, upstream: SocketAddr) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_terminal-bot"))
            .arg("--run-root")
            .arg(dir.join("run"))
            .arg("--workspace-root")
            .arg(dir.join("ws"))
            .arg("--config")
            .arg(config(dir, upstream))
            .args(["--metrics", "127.0.0.1:0"])
            .env("RT_METRICS_TEST_KEY", KEY)
            .env_remove("OPENAI_API_KEY")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let (addr_tx, addr_rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("terminal-bot: metrics at http://") {
                    let addr = rest.trim_end_matches("/metrics").to_owned();
                    let _ = addr_tx.send(addr);
                }
                eprintln!("bot: {line}");
            }
        });
        let metrics = addr_rx
            .recv_timeout(PATIENCE)
            .expect("the bot never said where its metrics are")
            .parse()
            .unwrap();
        let stdin = child.stdin.take();
        Self {
            child,
            stdin,
            lines,
            metrics,
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Waits for the first line of `channel`'s next answer (or error).
    fn reply(&mut self, channel: &str) -> String {
        let prefix = format!("[{channel}] ");
        let deadline = Instant::now() + PATIENCE;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(&prefix) && !l.starts_with(&format!("{prefix}| ")) => {
                    return l
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        panic!("no answer in {channel}");
    }

    fn finish(mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "bot exit {status}");
    }
}

// ---- Prometheus -------------------------------------------------------------------------

struct Prometheus {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(dir: &Path, target: SocketAddr) -> Self {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
                 scrape_configs:\n  - job_name: bot\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run prometheus (scripts/setup.sh --tests installs the Debian package)");
        let p = Self { child, addr };
        let deadline = Instant::now() + PATIENCE;
        while p.get("/-/ready").map(|(s, _)| s) != Some(200) {
            assert!(Instant::now() < deadline, "prometheus never became ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// A GET on Prometheus: status and body.
    fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut s = TcpStream::connect(self.addr).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.0\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let (head, body) = out.split_once("\r\n\r\n")?;
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((status, body.to_owned()))
    }

    fn api(&self, path: &str, query: &str) -> Value {
        let encoded: String = query
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let (status, body) = self
            .get(&format!("{path}{encoded}"))
            .expect("prometheus answers");
        assert_eq!(status, 200, "{query}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    /// The value of an instant query that yields one number (none: `None`).
    fn value(&self, query: &str) -> Option<f64> {
        let v = self.api("/api/v1/query?query=", query);
        let result = v["data"]["result"].as_array()?;
        assert!(result.len() <= 1, "{query}: {result:?}");
        result.first()?["value"][1].as_str()?.parse().ok()
    }
}

#[test]
fn prometheus_scrapes_the_bot_and_each_counter_matches_what_happened() {
    let dir = scratch("rtm-");
    let upstream = start_upstream();
    let mut bot = Bot::start(dir.path(), upstream);
    let prometheus = Prometheus::start(dir.path(), bot.metrics);
    // Scraped at least once before the first turn: every counter starts from the scrape.
    let deadline = Instant::now() + PATIENCE;
    while prometheus.value("up{job=\"bot\"}") != Some(1.0) {
        assert!(
            Instant::now() < deadline,
            "prometheus never scraped the bot"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // Succeed: two plain turns and one with a host tool call (two model calls).
    bot.send("#a ann: hi there");
    assert_eq!(bot.reply("#a"), "[#a] > hello");
    bot.send("#a ann: hi again");
    assert_eq!(bot.reply("#a"), "[#a] > hello");
    bot.send("#c ann: please-tool");
    assert_eq!(bot.reply("#c"), "[#c] > after the tool");

    // Time out: the guest sleeps past the 30 s turn timeout. Behind it eight messages
    // queue (the queue's default bound) and a ninth is busy.
    bot.send("#t tim: please-slow");
    // The queue fills once the slow turn runs (its model call reached the upstream).
    let deadline = Instant::now() + PATIENCE;
    while !SLOW_SEEN.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the slow turn never ran");
        std::thread::sleep(Duration::from_millis(300));
    }
    for i in 1..=8 {
        bot.send(&format!("#t bo{i}: hi from the queue"));
    }
    bot.send("#t late: one too many");
    let busy = bot.reply("#t");
    assert!(busy.starts_with("[#t] error: "), "{busy}");
    assert!(busy.contains("waiting"), "{busy}");
    let timed_out = bot.reply("#t");
    assert!(timed_out.starts_with("[#t] error: "), "{timed_out}");
    for _ in 1..=8 {
        assert_eq!(bot.reply("#t"), "[#t] > hello");
    }

    // Over the workspace quota (16 MB; the guest writes 64).
    bot.send("#q quinn: please-fill");
    let quota = bot.reply("#q");
    assert!(quota.starts_with("[#q] error: "), "{quota}");

    // A budget: 600 tokens on the first call (budget 500), so the second call is refused
    // mid-turn; then the speaker's next turn is refused at admission.
    bot.send("#b spender: please-spend");
    let mid = bot.reply("#b");
    assert!(mid.contains("speaker_tokens_per_day"), "{mid}");
    bot.send("#b spender: once more");
    let admission = bot.reply("#b");
    assert!(
        admission.starts_with(
            "[#b] error: budget speaker_tokens_per_day exceeded: this speaker has used today's 500 tokens"
        ),
        "{admission}"
    );

    // Every turn has ended: wait for Prometheus to have scraped the last one, and the last
    // admitted turn's duration (its `Facts`, sent after its teardown, a while after its
    // `Ended`: a scrape between the two saw 16 turns and 14 durations in CI).
    let (total, admitted) = (16.0, 15.0);
    let deadline = Instant::now() + PATIENCE;
    while prometheus.value("sum(roundtable_turns_total)") != Some(total)
        || prometheus.value("sum(roundtable_turn_duration_seconds_count)") != Some(admitted)
    {
        assert!(
            Instant::now() < deadline,
            "prometheus never saw {total} turns and {admitted} durations: {:?}, {:?}",
            prometheus.value("sum(roundtable_turns_total)"),
            prometheus.value("sum(roundtable_turn_duration_seconds_count)")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let v = |q: &str| prometheus.value(q);
    let turns = |outcome: &str| v(&format!("roundtable_turns_total{{outcome=\"{outcome}\"}}"));
    assert_eq!(turns("ok"), Some(11.0));
    assert_eq!(turns("timeout"), Some(1.0));
    assert_eq!(turns("busy"), Some(1.0));
    assert_eq!(turns("over_quota"), Some(1.0));
    assert_eq!(turns("budget_exceeded"), Some(2.0));
    // Every admitted turn has a duration (the busy message was never admitted), warm or
    // cold; the warm ones are the adoptions.
    assert_eq!(v("sum(roundtable_turn_duration_seconds_count)"), Some(15.0));
    assert_eq!(
        v("sum(roundtable_turn_duration_seconds_count{outcome=\"ok\"})"),
        Some(11.0)
    );
    let warm =
        v("sum(roundtable_turn_duration_seconds_count{launch_type=\"warm\"})").unwrap_or(0.0);
    assert_eq!(v("roundtable_warm_adoptions_total"), Some(warm));
    assert!(
        v("roundtable_turn_phase_duration_seconds_count{phase=\"container_running\"}")
            .unwrap_or(0.0)
            >= 1.0
    );
    // The queue held eight while the slow turn ran; it is empty now, and no container runs.
    assert_eq!(v("max_over_time(roundtable_queue_depth[10m])"), Some(8.0));
    assert_eq!(v("roundtable_queue_depth"), Some(0.0));
    assert_eq!(v("roundtable_containers_running"), Some(0.0));
    assert!(v("max_over_time(roundtable_containers_running[10m])").unwrap_or(0.0) >= 1.0);
    // Model calls (each the upstream answered; the refused one never reached it): ten plain
    // (100 in, 20 out), the tool turn's two (30/10, 50/10), the slow and the fill turns'
    // (10/5 each), the spender's (400/200).
    assert_eq!(
        v("sum(gen_ai_client_operation_duration_seconds_count{gen_ai_operation_name=\"chat\",error_type=\"none\"})"),
        Some(15.0)
    );
    assert_eq!(
        v("gen_ai_client_token_usage_sum{gen_ai_token_type=\"input\"}"),
        Some(1500.0)
    );
    assert_eq!(
        v("gen_ai_client_token_usage_sum{gen_ai_token_type=\"output\"}"),
        Some(430.0)
    );
    assert_eq!(
        v("gen_ai_client_token_usage_count{gen_ai_token_type=\"input\"}"),
        Some(15.0)
    );
    // Host tool calls: the tool turn's and the spender's.
    assert_eq!(
        v("roundtable_tool_calls_total{kind=\"host\",outcome=\"ok\"}"),
        Some(2.0)
    );
    // The budget: one model call refused mid-turn (a broker 429 named `budget`), one turn
    // at admission.
    assert_eq!(
        v("roundtable_broker_refusals_total{status=\"429\",limit=\"budget\"}"),
        Some(1.0)
    );
    assert_eq!(v("sum(roundtable_broker_refusals_total)"), Some(1.0));
    let budget = |stage: &str| {
        v(&format!(
            "roundtable_budget_refusals_total{{budget=\"speaker_tokens_per_day\",stage=\"{stage}\"}}"
        ))
    };
    assert_eq!(budget("model_call"), Some(1.0));
    assert_eq!(budget("admission"), Some(1.0));

    // No label names a channel (its key or its hash), a speaker or any text of a guest's.
    let series = prometheus.api(
        "/api/v1/series?match[]=",
        "{__name__=~\"roundtable_.+|gen_ai_.+\"}",
    );
    let series = series["data"].as_array().unwrap().clone();
    assert!(series.len() > 20, "{series:?}");
    // Speakers: no value is one; text and channels: no value holds one.
    let speakers = ["ann", "tim", "quinn", "spender", "late", "bo1", "bo8"];
    let mut forbidden: Vec<String> = ["#", "please", "there", "queue", "again"]
        .map(String::from)
        .to_vec();
    for c in ["#a", "#c", "#t", "#q", "#b"] {
        forbidden.push(roundtable_sandbox::ChannelId::new(c).short().to_owned());
    }
    for s in &series {
        for (name, value) in s.as_object().unwrap() {
            let value = value.as_str().unwrap();
            if matches!(name.as_str(), "__name__" | "job" | "instance") {
                continue;
            }
            assert!(
                !speakers.contains(&value),
                "label {name}={value:?} is a speaker"
            );
            for f in &forbidden {
                assert!(
                    !value.contains(f.as_str()),
                    "label {name}={value:?} holds {f:?}"
                );
            }
        }
    }
    bot.finish();
}
