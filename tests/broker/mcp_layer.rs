//! MCP sessions under the guest's seccomp layer and process rules, for any image (issue 43
//! items 2 and 4): each session's command runs under `/roundtable-guest --exec` (the static
//! guest program, read out of the guest image and mounted read-only), so a hostile server
//! can neither reserve blocks past its quota, nor trace its container's init, nor queue a
//! deleted file in a unix socket; a server with a network still resolves names; and a
//! channel's session is paused when its turn ends, resumed at its next call. Each runs
//! under the engine's default runtime and, with `ROUNDTABLE_RUNTIME=runsc`, gVisor.

use super::*;
use roundtable_sandbox::internals::broker::McpEngine;
use roundtable_sandbox_test_support::mcp_process::{mcp_image, sqlite_container};

/// A hostile MCP server (python3 alone, inline): its one tool `probe` plays the review's
/// tricks and reports what the kernel said: `status` (its seccomp lines), `fallocate`
/// (64 MiB reserved with `FALLOC_FL_KEEP_SIZE` on `/data/reserved`: the errno and the
/// blocks the file holds after), `ptrace` (`PTRACE_ATTACH` on pid 1), `scm_rights` (an
/// 8 MiB file opened, deleted and sent over a socketpair with `SCM_RIGHTS`, the socket
/// kept), `ping`.
fn prober() -> McpServer {
    const PRELUDE: &str = r#"
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
KEPT = []
def errno_of(rc):
    return 0 if rc == 0 else ctypes.get_errno()
def probe(trick):
    if trick == "status":
        return {l.split(":")[0]: l.split(":", 1)[1].strip()
                for l in open("/proc/self/status") if l.startswith("Seccomp")}
    if trick == "fallocate":
        fd = os.open("/data/reserved", os.O_RDWR | os.O_CREAT, 0o600)
        e = errno_of(libc.fallocate(fd, 1, 0, 64 << 20))
        blocks = os.fstat(fd).st_blocks * 512
        os.close(fd)
        return {"errno": e, "allocated": blocks}
    if trick == "ptrace":
        return {"errno": errno_of(libc.ptrace(16, 1, None, None))}
    if trick == "scm_rights":
        with open("/data/queued", "wb") as f:
            f.write(b"x" * (8 << 20))
        fd = os.open("/data/queued", os.O_RDONLY)
        os.unlink("/data/queued")
        a, b = socket.socketpair()
        KEPT.extend([a, b])
        try:
            socket.send_fds(a, [b"x"], [fd])
            e = 0
        except OSError as err:
            e = err.errno
        os.close(fd)
        return {"errno": e}
    return {"pong": True}
def call(arguments):
    return probe(arguments["trick"])
"#;
    let properties = json!({"trick": {"type": "string"}});
    let mut config = inline_server("prober", "probe", properties, &["trick"], PRELUDE);
    config.limits.data_mb = 16;
    config
}

/// The prober's report of `trick`.
async fn probe(turn: &BrokerTurn, trick: &str) -> serde_json::Value {
    let a = post_json(
        turn.socket(),
        "/v1/mcp/prober/probe",
        &json!({ "trick": trick }),
    )
    .await;
    assert_eq!(a.status, 200, "{trick}: {}", a.text());
    serde_json::from_str(a.json()["content"].as_str().unwrap()).unwrap()
}

fn gvisor(engine: &McpEngine) -> bool {
    engine.runtime.as_deref() == Some("runsc")
}

const EPERM: i64 = 1;

/// The review's tricks, each refused: the layer is installed (under runc a second filter
/// on the engine's; under gVisor the Sentry's own seccomp reports the session filtered,
/// which it does not without the layer), `fallocate(FALLOC_FL_KEEP_SIZE)` past `data_mb`
/// reserves nothing, `ptrace(PTRACE_ATTACH, 1)` and `SCM_RIGHTS` are refused; the session
/// still answers and its data dir holds nothing of it.
#[tokio::test]
async fn mcp_session_runs_under_the_guests_seccomp_layer() {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![prober()];
    let engine = p.mcp_engine.clone().unwrap();
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    let status = probe(&turn, "status").await;
    eprintln!("MCP session's seccomp: {status}");
    assert_eq!(status["Seccomp"], "2", "{status}");
    if !gvisor(&engine) {
        // The engine's default profile, then the guest's layer.
        assert_eq!(status["Seccomp_filters"], "2", "{status}");
    }
    let reserved = probe(&turn, "fallocate").await;
    assert_eq!(reserved["errno"], EPERM, "{reserved}");
    assert!(
        reserved["allocated"].as_u64().unwrap() < 1 << 20,
        "{reserved}"
    );
    let traced = probe(&turn, "ptrace").await;
    assert_eq!(traced["errno"], EPERM, "{traced}");
    let passed = probe(&turn, "scm_rights").await;
    assert_eq!(passed["errno"], EPERM, "{passed}");
    assert_eq!(probe(&turn, "ping").await["pong"], true);
    let dir = engine
        .data_root
        .join("prober")
        .join(channel_segment("chan-1"));
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["reserved"], "{dir:?}");
    assert_eq!(std::fs::metadata(dir.join("reserved")).unwrap().len(), 0);
    broker.shutdown().await;
}

/// The guest program as the broker mounts it: read out of the guest image.
fn guest_program(dir: &Path) -> PathBuf {
    let image = roundtable_sandbox::internals::testing::image();
    let id = docker(&["create", &image]);
    let path = dir.join("roundtable-guest");
    docker(&[
        "cp",
        &format!("{id}:/roundtable-guest"),
        &path.display().to_string(),
    ]);
    docker(&["rm", &id]);
    path
}

/// What the module doc says of DNS with `network = true`, against the real glibc of the
/// MCP image (Debian bookworm): under the layer, its resolver's parallel queries
/// (`sendmmsg`) fail; with `RES_OPTIONS=single-request` (what such a session is given) it
/// resolves with `send(2)`; descriptor passing stays refused either way. The name server is
/// the container's own, on its loopback (nothing leaves the container).
#[tokio::test]
async fn mcp_dns_under_the_layer_needs_single_request_only() {
    const SCRIPT: &str = r#"
import json, os, socket, struct, threading
def serve(s):
    while True:
        q, addr = s.recvfrom(512)
        end = q[12:].index(0) + 5
        qtype = struct.unpack(">H", q[12 + end - 4:12 + end - 2])[0]
        ans, n = b"", 0
        if qtype == 1:
            ans, n = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + bytes([10, 1, 2, 3]), 1
        s.sendto(q[:2] + b"\x81\x80" + struct.pack(">HHHH", 1, n, 0, 0) + q[12:12 + end] + ans, addr)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 53))
threading.Thread(target=serve, args=(s,), daemon=True).start()
out = {}
try:
    out["resolved"] = sorted({a[4][0] for a in socket.getaddrinfo("mcp.test", 80)})
except OSError as e:
    out["resolved"] = str(e)
a, b = socket.socketpair()
try:
    socket.send_fds(a, [b"x"], [b.fileno()])
    out["send_fds"] = 0
except OSError as e:
    out["send_fds"] = e.errno
print(json.dumps(out))
"#;
    let dir = tempfile::tempdir().unwrap();
    let guest = guest_program(dir.path());
    let runtime = std::env::var("ROUNDTABLE_RUNTIME")
        .ok()
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "runc".into());
    let run = |options: &str| {
        let mut args = vec![
            "run".to_owned(),
            "--rm".into(),
            "--runtime".into(),
            runtime.clone(),
            "--user".into(),
            format!("{}:{}", uid(), nix::unistd::getgid().as_raw()),
            "--network".into(),
            "bridge".into(),
            "--dns".into(),
            "127.0.0.1".into(),
            "--cap-drop".into(),
            "ALL".into(),
            "--security-opt".into(),
            "no-new-privileges:true".into(),
            "--read-only".into(),
            "-v".into(),
            format!("{}:/roundtable-guest:ro", guest.display()),
            "--entrypoint".into(),
            "/roundtable-guest".into(),
        ];
        if !options.is_empty() {
            args.extend(["-e".into(), format!("RES_OPTIONS={options}")]);
        }
        args.extend([
            mcp_image(),
            "--exec".into(),
            "python3".into(),
            "-c".into(),
            SCRIPT.into(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out: serde_json::Value = serde_json::from_str(&docker(&args)).unwrap();
        eprintln!("RES_OPTIONS={options:?} under {runtime}: {out}");
        out
    };
    let parallel = run("");
    assert!(
        parallel["resolved"]
            .as_str()
            .is_some_and(|e| e.contains("name resolution")),
        "{parallel}"
    );
    assert_eq!(parallel["send_fds"], EPERM);
    let single = run("single-request");
    assert_eq!(single["resolved"], json!(["10.1.2.3"]), "{single}");
    assert_eq!(single["send_fds"], EPERM);
}

/// The engine's state of the instance's one container.
fn state(engine: &McpEngine) -> String {
    let names = containers(engine);
    assert_eq!(names.len(), 1, "{names:?}");
    docker(&["inspect", "-f", "{{.State.Status}}", &names[0]])
}

/// Waits until that container's state is `want`; panics after 30 s.
async fn wait_state(engine: &McpEngine, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = state(engine);
        if now == want {
            return;
        }
        assert!(Instant::now() < deadline, "state {now}, expected {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// No channel session's work outlives its turn: once the turn ends its container is
/// paused (none of its processes runs), the next turn's call resumes it and is answered
/// from the same session (the table the first turn made is there); a shared session is
/// never paused.
#[tokio::test]
async fn mcp_channel_session_is_paused_when_its_turn_ends() {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![sqlite_container(&["create_table", "list_tables"])];
    let engine = p.mcp_engine.clone().unwrap();
    let broker = start_broker(p).await;
    let mut turn = start_turn(&broker).await;
    let call = |socket: PathBuf, tool: &'static str, query: &'static str| async move {
        post_json(
            &socket,
            &format!("/v1/mcp/sqlite/{tool}"),
            &json!({ "query": query }),
        )
        .await
    };
    let a = call(
        turn.socket().to_owned(),
        "create_table",
        "CREATE TABLE t (x)",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(state(&engine), "running");
    turn.listener.take().unwrap().stop().await.unwrap();
    wait_state(&engine, "paused").await;
    let next = start_turn(&broker).await;
    let a = post_json(next.socket(), "/v1/mcp/sqlite/list_tables", &json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(
        a.json()["content"].as_str().unwrap().contains("'t'"),
        "{}",
        a.text()
    );
    assert_eq!(state(&engine), "running");
    drop(next);
    wait_state(&engine, "paused").await;
    broker.shutdown().await;

    // Shared: its session serves every channel; no turn's end pauses it.
    let mut p = policy("http://127.0.0.1:9/v1");
    let mut shared = sqlite_container(&["list_tables"]);
    shared.scope = Some(McpScope::Shared);
    p.mcp = vec![shared];
    let engine = p.mcp_engine.clone().unwrap();
    let broker = start_broker(p).await;
    let mut turn = start_turn(&broker).await;
    let a = post_json(turn.socket(), "/v1/mcp/sqlite/list_tables", &json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    turn.listener.take().unwrap().stop().await.unwrap();
    let other = start_turn_in(&broker, "chan-2").await;
    let a = post_json(other.socket(), "/v1/mcp/sqlite/list_tables", &json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    drop(other);
    let second = start_turn(&broker).await;
    let a = post_json(second.socket(), "/v1/mcp/sqlite/list_tables", &json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(state(&engine), "running");
    broker.shutdown().await;
}
