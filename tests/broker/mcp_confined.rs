//! Container-confined stdio MCP sessions (the default): real `mcp-server-sqlite` in the
//! image `scripts/build-mcp-image.sh` builds, each session its own container. The review's
//! sqlite attack rerun, the confinement seen from inside, the data quota, the memory cap,
//! a call past its deadline (and a shared session's waiting call run in a new container
//! after one), the sweep, release and shutdown, a killed session restarted.

use super::*;
use roundtable_sandbox::internals::broker::McpEngine;
use roundtable_sandbox::internals::config::{McpConfine, McpLimits};
use roundtable_sandbox_test_support::mcp_process::{mcp_image, sqlite_container};

const SQL_TOOLS: &[&str] = &["create_table", "write_query", "read_query", "list_tables"];

/// The policy's engine (a fresh instance and data root per policy).
fn engine(p: &BrokerPolicy) -> McpEngine {
    p.mcp_engine.clone().expect("the test policy has an engine")
}

/// `mcp-server-sqlite` in its container, on `/data/db.sqlite`.
fn sqlite() -> McpServer {
    sqlite_container(SQL_TOOLS)
}

/// A call's answer.
async fn call(turn: &BrokerTurn, tool: &str, query: &str) -> client::Answer {
    post_json(
        turn.socket(),
        &format!("/v1/mcp/sqlite/{tool}"),
        &json!({ "query": query }),
    )
    .await
}

/// A call that must succeed: its result's text.
async fn sql(turn: &BrokerTurn, tool: &str, query: &str) -> String {
    let a = call(turn, tool, query).await;
    assert_eq!(a.status, 200, "{tool} {query}: {}", a.text());
    assert_eq!(a.json()["ok"], true, "{tool} {query}: {}", a.text());
    a.json()["content"].as_str().unwrap().to_owned()
}

/// A `read_query` the broker answers with `status`: its error.
async fn read_refused(turn: &BrokerTurn, query: &str, status: u16) -> String {
    let a = call(turn, "read_query", query).await;
    assert_eq!(a.status, status, "{}", a.text());
    a.error()
}

/// A table `notes` holding the one row `body`.
async fn notes_with(turn: &BrokerTurn, body: &str) {
    sql(turn, "create_table", "CREATE TABLE notes (body TEXT)").await;
    sql(
        turn,
        "write_query",
        &format!("INSERT INTO notes VALUES ('{body}')"),
    )
    .await;
}

/// A broker whose one MCP server is `server` (its policy, that server in it, changed by
/// `adjust` first), the policy's engine, and a turn of `chan-1`.
async fn start_with(
    server: McpServer,
    adjust: impl FnOnce(&mut BrokerPolicy),
) -> (McpEngine, Arc<Broker>, BrokerTurn) {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![server];
    adjust(&mut p);
    let engine = engine(&p);
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    (engine, broker, turn)
}

/// Shuts the broker down and waits until none of its sessions' containers is left.
async fn shut_down(broker: Arc<Broker>, engine: &McpEngine) {
    broker.shutdown().await;
    wait_containers(engine, 0).await;
}

/// Waits until the instance has exactly `n` containers; panics after 30 s.
async fn wait_containers(engine: &McpEngine, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = containers(engine);
        if now.len() == n {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} MCP containers, found {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The files under `dir`, relative, sorted.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p.clone());
            }
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
        }
    }
    out.sort();
    out
}

/// The review's attack, rerun against the default (container) confinement: `#bob` learns
/// no host path, and neither `VACUUM INTO` another channel's database, another channel's
/// data dir nor any host path writes anything; `#carol`'s first read finds no row of bob's.
#[tokio::test]
async fn mcp_sqlite_attack_reaches_only_the_channels_own_database() {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![sqlite()];
    let engine = engine(&p);
    let broker = start_broker(p).await;
    let root = engine.data_root.clone();
    let alice_dir = root.join("sqlite").join(channel_segment("#alice"));
    let carol_dir = root.join("sqlite").join(channel_segment("#carol"));

    let alice = start_turn_in(&broker, "#alice").await;
    notes_with(&alice, "alice-private-note").await;
    let alice_db = alice_dir.join("db.sqlite");
    let alice_before = std::fs::read(&alice_db).unwrap();

    let bob = start_turn_in(&broker, "#bob").await;
    // What the database says of itself names only the container's own path.
    let list = sql(&bob, "read_query", "SELECT file FROM pragma_database_list").await;
    assert!(list.contains("/data/db.sqlite"), "{list}");
    assert!(!list.contains(&root.display().to_string()), "{list}");
    // Plant a row in bob's own database (allowed: it is his).
    notes_with(&bob, "bob-planted").await;
    // Every host path a guest could learn or guess, and the container paths around /data.
    let outside = Path::new("/var/tmp").join(format!("rtb-escape-{}.db", std::process::id()));
    let targets = [
        alice_db.display().to_string(),
        carol_dir.join("db.sqlite").display().to_string(),
        root.join("sqlite").join("planted.db").display().to_string(),
        outside.display().to_string(),
        "/data/../alice.db".into(),
        "/planted.db".into(),
        "/opt/planted.db".into(),
    ];
    for target in &targets {
        let a = call(&bob, "write_query", &format!("VACUUM INTO '{target}'")).await;
        assert_eq!(a.status, 200, "{target}: {}", a.text());
        let text = a.text();
        assert!(
            text.contains("unable to open") || text.contains("readonly") || text.contains("error"),
            "VACUUM INTO {target} must fail: {text}"
        );
    }
    assert!(!outside.exists());
    assert!(
        !carol_dir.exists(),
        "carol's data dir is made on her first call only"
    );
    assert_eq!(std::fs::read(&alice_db).unwrap(), alice_before);
    // Alice's data is hers, unchanged.
    let notes = sql(&alice, "read_query", "SELECT body FROM notes").await;
    assert!(
        notes.contains("alice-private-note") && !notes.contains("bob"),
        "{notes}"
    );
    // Carol's first read: a fresh database, none of bob's rows.
    let carol = start_turn_in(&broker, "#carol").await;
    let a = call(&carol, "read_query", "SELECT body FROM notes").await;
    assert_eq!(
        a.json(),
        json!({"ok": true, "content": "Database error: no such table: notes"})
    );
    // On the host: each channel's dir holds its own database, nothing else was written.
    let files = files_under(&root.join("sqlite"));
    for f in &files {
        let top = f.split('/').next().unwrap();
        assert!(
            [
                channel_segment("#alice"),
                channel_segment("#bob"),
                channel_segment("#carol"),
                PROBE_SEGMENT.to_owned()
            ]
            .contains(&top.to_owned()),
            "unexpected {f} in {files:?}"
        );
    }
    shut_down(broker, &engine).await;
}

/// The same attack on a host child (`confine = "host"`, the review's setup): it reaches
/// another channel's file. Kept as the reason `explain` and `doctor` flag that setting.
#[tokio::test]
async fn mcp_sqlite_attack_reproduced_on_a_host_child() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![mcp_process::sqlite_server(
        dir.path(),
        "{channel}",
        SQL_TOOLS,
    )];
    assert_eq!(p.mcp[0].confine, McpConfine::Host);
    let broker = start_broker(p).await;
    let bob = start_turn_in(&broker, "#bob").await;
    let list = sql(&bob, "read_query", "SELECT file FROM pragma_database_list").await;
    assert!(list.contains(&dir.path().display().to_string()), "{list}");
    notes_with(&bob, "bob-planted").await;
    let carol_db = dir.path().join(format!("{}.db", channel_segment("#carol")));
    sql(
        &bob,
        "write_query",
        &format!("VACUUM INTO '{}'", carol_db.display()),
    )
    .await;
    let carol = start_turn_in(&broker, "#carol").await;
    let notes = sql(&carol, "read_query", "SELECT body FROM notes").await;
    assert!(notes.contains("bob-planted"), "{notes}");
    broker.shutdown().await;
}

/// An MCP server (python3 alone, inline) whose one tool reports what its process sees.
fn facts_server() -> McpServer {
    const PRELUDE: &str = r#"
import os
def facts():
    st = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    ifs = [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]]
    def can_write(path):
        try:
            with open(path, "w") as f: f.write("x")
            os.unlink(path); return True
        except OSError: return False
    def read(path):
        try: return open(path).read().strip()
        except OSError as e: return "error: %s" % e
    return {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
            "Groups": st["Groups"].strip(), "Seccomp": st.get("Seccomp", "?").strip(),
            "NoNewPrivs": st.get("NoNewPrivs", "?").strip(), "CapEff": st["CapEff"].strip(),
            "interfaces": ifs, "root_writable": can_write("/probe"),
            "opt_writable": can_write("/opt/probe"), "data_writable": can_write("/data/probe"),
            "docker_sock": os.path.exists("/var/run/docker.sock") or os.path.exists("/run/docker.sock"),
            "memory_max": read("/sys/fs/cgroup/memory.max") if os.path.exists("/sys/fs/cgroup/memory.max") else read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
            "pids_max": read("/sys/fs/cgroup/pids.max") if os.path.exists("/sys/fs/cgroup/pids.max") else read("/sys/fs/cgroup/pids/pids.max"),
            "mounts": [l.split()[4] for l in open("/proc/self/mountinfo")]}
def call(arguments):
    return facts()
"#;
    inline_server("facts", "facts", json!({}), &[], PRELUDE)
}

/// What the MCP session's own process sees: the service uid:gid and no other group (no
/// `docker`), seccomp filtering, no-new-privileges, no capability, no network but `lo`,
/// a read-only root, only `/data` (and the `/tmp` tmpfs) writable, no engine socket, the
/// memory and pids caps in its cgroup.
#[tokio::test]
async fn mcp_container_is_confined_as_the_guest_is() {
    let mut facts = facts_server();
    facts.limits = McpLimits {
        memory_mb: 96,
        pids: 32,
        ..McpLimits::default()
    };
    let (engine, broker, turn) = start_with(facts, |_| {}).await;
    let a = post_json(turn.socket(), "/v1/mcp/facts/facts", &json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let f: serde_json::Value = serde_json::from_str(a.json()["content"].as_str().unwrap()).unwrap();
    eprintln!("MCP container facts: {f}");
    let (uid, gid) = (engine.uid, engine.gid);
    assert_eq!(f["uid"], uid);
    assert_eq!(f["gid"], gid);
    assert_eq!(f["Groups"], gid.to_string(), "no supplementary group: {f}");
    let docker_gid = nix::unistd::Group::from_name("docker")
        .unwrap()
        .map(|g| g.gid.as_raw());
    if let Some(d) = docker_gid {
        assert!(!f["groups"].as_array().unwrap().contains(&json!(d)), "{f}");
    }
    assert_eq!(f["CapEff"], "0000000000000000", "{f}");
    if engine.runtime.as_deref() != Some("runsc") {
        // Under gVisor the process sees the Sentry's kernel, which reports neither (the
        // Sentry itself runs under the engine's seccomp profile, no-new-privileges set).
        assert_eq!(f["NoNewPrivs"], "1", "{f}");
        assert_eq!(f["Seccomp"], "2", "{f}");
        assert_eq!(f["memory_max"], (96u64 << 20).to_string(), "{f}");
        assert_eq!(f["pids_max"], "32", "{f}");
    }
    assert_eq!(f["interfaces"], json!(["lo"]), "{f}");
    assert_eq!(f["root_writable"], false, "{f}");
    assert_eq!(f["opt_writable"], false, "{f}");
    assert_eq!(f["data_writable"], true, "{f}");
    assert_eq!(f["docker_sock"], false, "{f}");
    shut_down(broker, &engine).await;

    // `network = true` is the one way to give a session a network.
    let mut facts = facts_server();
    facts.network = true;
    let (engine, broker, turn) = start_with(facts, |_| {}).await;
    let a = post_json(turn.socket(), "/v1/mcp/facts/facts", &json!({})).await;
    let f: serde_json::Value = serde_json::from_str(a.json()["content"].as_str().unwrap()).unwrap();
    let interfaces = f["interfaces"].as_array().unwrap();
    if engine.runtime.as_deref() == Some("runsc") {
        // The project registers runsc with `--network=none` (scripts/setup-gvisor.sh).
        assert_eq!(f["interfaces"], json!(["lo"]), "{f}");
    } else {
        assert!(interfaces.len() > 1, "{f}");
    }
    shut_down(broker, &engine).await;
}

/// The data dir is held to its quota: one file cannot pass it (`ulimit fsize`), and files
/// that together pass it stop the session and refuse the channel's calls with a clear error.
#[tokio::test]
async fn mcp_data_flood_past_the_quota_is_stopped_and_refused() {
    let (engine, broker, turn) = start_with(sqlite(), |p| p.mcp[0].limits.data_mb = 16).await;
    sql(&turn, "create_table", "CREATE TABLE t (b BLOB)").await;
    let blobs = |n: u32| {
        format!(
            "INSERT INTO t SELECT randomblob(1000000) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<{n}) SELECT x FROM c)"
        )
    };
    // 40 MB in one file: the kernel stops the write at 16 MiB (the server answers with a
    // database error), unless the watcher measures the file and its journal over the quota
    // first and stops the session (507): under gVisor on a loaded machine it often does.
    let big = call(&turn, "write_query", &blobs(40)).await;
    match big.status {
        200 => assert!(big.text().contains("Database error"), "{}", big.text()),
        507 => assert!(big.error().contains("over its quota"), "{}", big.text()),
        _ => panic!("the 40 MB write was not stopped: {}", big.text()),
    }
    let dir = engine
        .data_root
        .join("sqlite")
        .join(channel_segment("chan-1"));
    let db_len = std::fs::metadata(dir.join("db.sqlite")).unwrap().len();
    assert!(db_len <= 16 << 20, "{db_len}");
    // What it left may already be over the quota; an operator frees the space.
    for f in files_under(&dir) {
        std::fs::remove_file(dir.join(f)).unwrap();
    }
    // The watcher may have measured the file and its journal over the quota before they were
    // freed and stop the session during the next call (under gVisor beside a build its
    // measure came late: "17 MiB used", no deleted file in it): that call is refused with
    // the stop, and the next starts a new session on the freed space.
    let a = call(&turn, "create_table", "CREATE TABLE t (b BLOB)").await;
    if a.status != 200 {
        eprintln!("the watcher's stop came after the freeing: {}", a.text());
        assert_eq!(a.status, 507, "{}", a.text());
        let e = a.error();
        assert!(
            e.starts_with("MCP server sqlite: this channel's data is over its quota (")
                && e.ends_with("the limit is 16 MiB); its session was stopped"),
            "{e}"
        );
        wait_containers(&engine, 0).await;
        sql(&turn, "create_table", "CREATE TABLE t (b BLOB)").await;
    }
    // 6 MB, then copies of it: past 16 MiB in all.
    sql(&turn, "write_query", &blobs(6)).await;
    let mut refused = None;
    for i in 0..4 {
        let a = call(
            &turn,
            "write_query",
            &format!("VACUUM INTO '/data/copy{i}.db'"),
        )
        .await;
        if a.status == 507 {
            refused = Some(a.error());
            break;
        }
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let refused = refused.expect("the quota refused a call");
    assert!(
        refused.starts_with("MCP server sqlite: this channel's data is over its quota ("),
        "{refused}"
    );
    assert!(refused.contains("the limit is 16 MiB"), "{refused}");
    wait_containers(&engine, 0).await;
    // Refused until space is freed; no container is started for it.
    let a = call(&turn, "read_query", "SELECT 1").await;
    assert_eq!(a.status, 507, "{}", a.text());
    assert_eq!(containers(&engine).len(), 0);
    for i in 0..4 {
        let _ = std::fs::remove_file(dir.join(format!("copy{i}.db")));
    }
    let ok = sql(&turn, "read_query", "SELECT count(*) AS n FROM t").await;
    assert!(ok.contains("'n': 6"), "{ok}");
    shut_down(broker, &engine).await;
}

/// A query that takes the session past its memory cap: the kernel kills it, the call gets
/// a clear error, the next call restarts the session.
#[tokio::test]
async fn mcp_session_past_its_memory_cap_is_killed_then_restarted() {
    let (engine, broker, turn) = start_with(sqlite(), |p| p.mcp[0].limits.memory_mb = 128).await;
    assert!(sql(&turn, "read_query", "SELECT 1 AS one")
        .await
        .contains("'one': 1"));
    let error = read_refused(
        &turn,
        "SELECT x, zeroblob(10000000) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<100) SELECT x FROM c)",
        502,
    )
    .await;
    assert_eq!(
        error,
        "MCP server sqlite ran out of memory during the call (its limit is 128 MiB) and was stopped; the next call restarts it"
    );
    wait_containers(&engine, 0).await;
    assert!(sql(&turn, "read_query", "SELECT 2 AS two")
        .await
        .contains("'two': 2"));
    assert_eq!(containers(&engine).len(), 1);
    shut_down(broker, &engine).await;
}

/// A call past its deadline stops its session: the container that runs an endless
/// recursive query is gone, no core stays busy; the next call restarts the session.
#[tokio::test]
async fn mcp_call_timing_out_stops_the_container() {
    let (engine, broker, turn) = start_with(sqlite(), |p| {
        // The deadline covers the session's cold start (the first call below): 2.7 s at a
        // load of 9, once past 10 s beside two builds; 30 s leaves room on any machine that
        // passes the rest of the suite, at the cost of the recursive query's 30 s wait.
        p.limits.call_timeout = Duration::from_secs(30);
    })
    .await;
    sql(&turn, "read_query", "SELECT 1 AS one").await;
    let running = wait_containers(&engine, 1).await;
    let started = Instant::now();
    let error = read_refused(
        &turn,
        "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT x FROM c)",
        504,
    )
    .await;
    assert_eq!(
        error,
        "tool call timed out after 30s; the MCP session was stopped"
    );
    // Stopped before the answer: the container is gone at once.
    assert_eq!(containers(&engine), Vec::<String>::new(), "{running:?}");
    eprintln!(
        "MCP call timeout to container gone: {:?}",
        started.elapsed()
    );
    assert!(sql(&turn, "read_query", "SELECT 2 AS two")
        .await
        .contains("'two': 2"));
    shut_down(broker, &engine).await;
}

/// The review's case in containers (issue 43, item 5): a shared session, one channel's
/// query never ends, another channel's call waits behind it. The timed-out call's
/// container is removed before the waiting call is handed the session, which then runs in
/// a new container on the same data.
#[tokio::test]
async fn mcp_shared_container_restarts_for_the_call_waiting_behind_a_timed_out_one() {
    let mut server = sqlite();
    server.scope = Some(McpScope::Shared);
    let (engine, broker, alpha) = start_with(server, |p| {
        // As above: room for the waiting call's cold start on a loaded machine.
        p.limits.call_timeout = Duration::from_secs(30);
    })
    .await;
    let beta = start_turn_in(&broker, "#beta").await;
    sql(&beta, "create_table", "CREATE TABLE notes (body TEXT)").await;
    let first = wait_containers(&engine, 1).await;
    let socket = alpha.socket().to_owned();
    let slow = tokio::spawn(async move {
        post_json(
            &socket,
            "/v1/mcp/sqlite/read_query",
            &json!({"query": "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT x FROM c)"}),
        )
        .await
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !broker.mcp_running("sqlite") {
        assert!(Instant::now() < deadline, "the slow call never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let socket = beta.socket().to_owned();
    let insert = tokio::spawn(async move {
        post_json(
            &socket,
            "/v1/mcp/sqlite/write_query",
            &json!({"query": "INSERT INTO notes VALUES ('from beta')"}),
        )
        .await
    });
    while broker.mcp_waiting("sqlite") != 1 {
        assert!(Instant::now() < deadline, "the insert never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = slow.await.unwrap();
    assert_eq!(a.status, 504, "{}", a.text());
    let b = insert.await.unwrap();
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(b.json()["ok"], true, "{}", b.text());
    let second = wait_containers(&engine, 1).await;
    assert_ne!(second, first, "the insert ran in a new container");
    assert!(sql(&alpha, "read_query", "SELECT body FROM notes")
        .await
        .contains("from beta"));
    shut_down(broker, &engine).await;
}

/// A turn cancelled mid-call stops the session as well (the call's work does not outlive
/// the turn).
#[tokio::test]
async fn mcp_call_cancelled_with_the_turn_stops_the_container() {
    let (engine, broker, turn) = start_with(sqlite(), |_| {}).await;
    sql(&turn, "read_query", "SELECT 1 AS one").await;
    let socket = turn.socket().to_owned();
    let pending = tokio::spawn(async move {
        post_json_result(
            &socket,
            "/v1/mcp/sqlite/read_query",
            &json!({"query": "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT x FROM c)"}),
        )
        .await
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    turn.cancel.cancel();
    let _ = pending.await;
    wait_containers(&engine, 0).await;
    drop(turn);
    broker.shutdown().await;
}

/// Calls dropped at every point of their session's start (the guest closing its connection
/// 0 to 380 ms after sending): no container is left behind, those the engine finished
/// making after the call was gone included.
#[tokio::test]
async fn mcp_calls_dropped_while_their_session_starts_leave_no_container() {
    let (engine, broker, turn) = start_with(sqlite(), |_| {}).await;
    for i in 0..20u64 {
        let socket = turn.socket().to_owned();
        let pending = tokio::spawn(async move {
            post_json_result(
                &socket,
                "/v1/mcp/sqlite/read_query",
                &json!({"query": "SELECT 1 AS one"}),
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(i * 20)).await;
        pending.abort();
        let _ = pending.await;
    }
    // Every session the dropped calls started is ended, its container removed; the next
    // call starts its own, the one container left (before the shutdown, which removes
    // whatever carries the instance's label).
    sql(&turn, "read_query", "SELECT 1 AS one").await;
    wait_containers(&engine, 1).await;
    drop(turn);
    shut_down(broker, &engine).await;
}

/// Sessions' containers: one per channel, removed when the channel retires and at
/// shutdown; one killed from outside is restarted on the next call, on the same data;
/// leftovers of a crashed runtime (this instance, data under this data root) are swept at
/// startup, another runtime's are kept.
#[tokio::test]
async fn mcp_containers_follow_the_sessions_and_leftovers_are_swept() {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.mcp = vec![sqlite()];
    let engine = engine(&p);
    let started = Instant::now();
    let broker = start_broker(p.clone()).await;
    let startup = started.elapsed();
    // The probe session that pinned the tools is gone.
    wait_containers(&engine, 0).await;
    let alpha = start_turn_in(&broker, "#alpha").await;
    let started = Instant::now();
    sql(&alpha, "create_table", "CREATE TABLE notes (body TEXT)").await;
    let first_call = started.elapsed();
    let started = Instant::now();
    sql(
        &alpha,
        "write_query",
        "INSERT INTO notes VALUES ('alpha-note')",
    )
    .await;
    let later_call = started.elapsed();
    eprintln!(
        "mcp-server-sqlite container session: broker start (start + handshake + list + stop) {startup:?}, first call {first_call:?}, a later call {later_call:?}"
    );
    let beta = start_turn_in(&broker, "#beta").await;
    sql(&beta, "read_query", "SELECT 1 AS one").await;
    let both = wait_containers(&engine, 2).await;
    assert!(
        both.iter().all(|n| n.starts_with("rtb-mcp-sqlite-")),
        "{both:?}"
    );
    // Killed from outside: restarted on the next call, on the channel's own data.
    let alpha_tag = &channel_segment("#alpha")[..12];
    let alpha_container = both.iter().find(|n| n.contains(alpha_tag)).unwrap().clone();
    docker(&["kill", &alpha_container]);
    let mut notes = call(&alpha, "read_query", "SELECT body FROM notes").await;
    if notes.status != 200 {
        // The kill was seen by this call: the next one restarts.
        assert_eq!(notes.status, 502, "{}", notes.text());
        notes = call(&alpha, "read_query", "SELECT body FROM notes").await;
    }
    assert!(notes.text().contains("alpha-note"), "{}", notes.text());
    // The killed one was removed when its session was replaced by a new one.
    let now = wait_containers(&engine, 2).await;
    assert!(!now.contains(&alpha_container), "{now:?}");
    // Released: the channel's container is removed.
    broker.release_channel("#alpha").await;
    let left = wait_containers(&engine, 1).await;
    assert!(!left.iter().any(|n| n.contains(alpha_tag)), "{left:?}");
    // A crash (no shutdown): the broker is forgotten with its sessions' containers.
    std::mem::forget(beta);
    std::mem::forget(broker);
    // Another runtime's container with this instance name but its data elsewhere.
    let elsewhere = tempfile::tempdir().unwrap();
    let foreign = docker(&[
        "create",
        "--label",
        &format!("roundtable-sandbox={}", engine.instance),
        "--label",
        "roundtable-sandbox.mcp=sqlite",
        "--network",
        "none",
        "-v",
        &format!("{}:/data", elsewhere.path().display()),
        &mcp_image(),
        "true",
    ]);
    // Restarted with no server in a container (the config's MCP servers gone): what the
    // crashed run left is swept all the same (it was only when a server ran in one).
    let mut p = p;
    p.mcp = vec![];
    let broker = start_broker(p).await;
    let left = wait_containers(&engine, 1).await;
    assert_eq!(left.len(), 1);
    assert!(foreign.starts_with(&docker(&["inspect", "-f", "{{.Id}}", &left[0]])[..12]));
    docker(&["rm", "-f", &foreign]);
    shut_down(broker, &engine).await;
}

/// A server whose image is missing fails the broker's start with the fix; a stdio server
/// with no engine configured cannot start either.
#[tokio::test]
async fn mcp_container_setup_errors_name_the_fix() {
    let mut p = policy("http://127.0.0.1:9/v1");
    let mut server = sqlite();
    server.image = Some("roundtable-mcp-missing:none".into());
    p.mcp = vec![server];
    let engine = engine(&p);
    let err = Broker::new(p.clone()).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "MCP server sqlite could not be started: MCP image roundtable-mcp-missing:none not found (build it: scripts/build-mcp-image.sh)"
    );
    wait_containers(&engine, 0).await;
    p.mcp = vec![sqlite()];
    p.mcp_engine = None;
    let err = Broker::new(p).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "MCP server sqlite could not be started: it runs in a container but the broker has no container engine"
    );
}

/// A hostile MCP server (python3 alone, inline) for the data quota: `hold` keeps 4 files of
/// 12 MiB each in `/data`, each unlinked after opening and written through its descriptor
/// (in the call when `wait`, then the call sleeps; else in a thread started after the
/// answer is sent); `spill` answers, then a thread of its own writes 48 named 1 MiB files;
/// `ping` answers `pong`. Each file stays under a 16 MiB `ulimit fsize`.
fn hostile_server() -> McpServer {
    const SCRIPT: &str = r#"
import json, os, sys, threading, time
HELD = []
MIB = b"x" * (1 << 20)
def hold():
    for i in range(4):
        path = "/data/held%d" % i
        f = open(path, "wb")
        os.unlink(path)
        for _ in range(12):
            f.write(MIB)
            f.flush()
        HELD.append(f)
def spill():
    for i in range(48):
        with open("/data/spill%d" % i, "wb") as f:
            f.write(MIB)
        time.sleep(0.02)
def answer(m, r):
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}) + "\n")
    sys.stdout.flush()
def text(t):
    return {"content": [{"type": "text", "text": t}]}
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m: continue
    after = None
    if m["method"] == "initialize":
        r = {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {}},
             "serverInfo": {"name": "hostile", "version": "1"}}
    elif m["method"] == "tools/list":
        obj = {"type": "object", "properties": {}}
        r = {"tools": [
            {"name": "hold", "description": "hold deleted files open",
             "inputSchema": {"type": "object", "properties": {"wait": {"type": "boolean"}}}},
            {"name": "spill", "description": "write files after answering", "inputSchema": obj},
            {"name": "ping", "description": "pong", "inputSchema": obj}]}
    elif m["method"] == "tools/call":
        name = m["params"]["name"]
        if name == "hold" and m["params"].get("arguments", {}).get("wait"):
            hold()
            time.sleep(300)
            r = text("held")
        elif name == "hold":
            after, r = hold, text("holding")
        elif name == "spill":
            after, r = spill, text("spilling")
        else:
            r = text("pong")
    else:
        r = {}
    answer(m, r)
    if after:
        threading.Thread(target=after, daemon=True).start()
"#;
    let mut config = McpServer::new(
        "hostile",
        McpTransport::Stdio {
            command: "python3".into(),
            args: vec!["-c".into(), SCRIPT.into()],
            env: Default::default(),
        },
        &["hold", "spill", "ping"],
    );
    config.image = Some(mcp_image());
    config.limits.data_mb = 16;
    config
}

/// A call to the hostile server's `tool`.
async fn hostile(turn: &BrokerTurn, tool: &str, args: serde_json::Value) -> client::Answer {
    post_json(turn.socket(), &format!("/v1/mcp/hostile/{tool}"), &args).await
}

/// The `507` of the hostile server's data over its quota: its error.
fn over_quota_error(a: &client::Answer) -> String {
    assert_eq!(a.status, 507, "{}", a.text());
    let e = a.error();
    assert!(
        e.starts_with("MCP server hostile: this channel's data is over its quota ("),
        "{e}"
    );
    e
}

/// The watcher's error for the hostile server's data past its 16 MiB.
fn assert_over_quota(a: &client::Answer, held: bool) {
    let e = over_quota_error(a);
    assert!(
        e.ends_with("the limit is 16 MiB); its session was stopped"),
        "{e}"
    );
    assert_eq!(e.contains("deleted files held open"), held, "{e}");
}

/// Whether the hostile server's answer `a` came before its thread passed the quota: then it
/// says `content`; else the watcher stopped the session first (on a loaded machine it may,
/// before the answer is relayed) and `a` is its error, for deleted files held open when
/// `held`.
fn answered_before_the_watcher(a: &client::Answer, content: &str, held: bool) -> bool {
    let answered = a.status == 200;
    if answered {
        assert_eq!(a.json()["content"], content, "{}", a.text());
    } else {
        eprintln!("the watcher came first: {}", a.text());
        assert_over_quota(a, held);
    }
    answered
}

/// Files the session deletes while it holds them open count against its data quota, as a
/// turn's do: in a call (the call is refused `507` and the session stopped) and after one
/// (a thread of the server's: the session is stopped with no call, the next call refused).
/// Their bytes go with the container, so the call after that starts the session again.
#[tokio::test]
async fn mcp_data_held_open_after_deletion_is_counted() {
    let mut p = policy("http://127.0.0.1:9/v1");
    p.limits.call_timeout = Duration::from_secs(20);
    p.mcp = vec![hostile_server()];
    // Under gVisor the host cannot see the sandbox's descriptors: the image's measurer
    // counts them inside (`/roundtable-guest --held-files /data`).
    let engine = engine(&p);
    let broker = start_broker(p).await;
    let turn = start_turn(&broker).await;
    // In the call: 48 MiB in 4 deleted files, the call waiting.
    let a = hostile(&turn, "hold", json!({ "wait": true })).await;
    eprintln!("held in a call: {}", a.text());
    assert_over_quota(&a, true);
    wait_containers(&engine, 0).await;
    // Their bytes went with the container (a file killed between its open and its unlink
    // keeps its name and what it had, under 12 MiB): the next call starts the session.
    let a = hostile(&turn, "ping", json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    // After the call: the answer is sent first, then a thread holds the files (on a loaded
    // machine the watcher may stop the session before its answer is relayed: either order).
    let a = hostile(&turn, "hold", json!({ "wait": false })).await;
    let answered = answered_before_the_watcher(&a, "holding", true);
    // The watcher stops the session with no call in flight.
    wait_containers(&engine, 0).await;
    if answered {
        let a = hostile(&turn, "ping", json!({})).await;
        eprintln!("held after a call, the next call: {}", a.text());
        assert_over_quota(&a, true);
    }
    let a = hostile(&turn, "ping", json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json()["content"], "pong", "{}", a.text());
    broker.shutdown().await;
    wait_containers(&engine, 0).await;
}

/// A session is watched between its calls: a server that answers, then writes in a thread
/// of its own, is stopped when its data passes the quota (no call in flight), and its next
/// calls are refused until an operator frees space.
#[tokio::test]
async fn mcp_data_written_after_the_call_returned_is_watched() {
    let (engine, broker, turn) = start_with(hostile_server(), |_| {}).await;
    let a = hostile(&turn, "spill", json!({})).await;
    // The answer is sent before the thread starts; on a loaded machine the watcher may stop
    // the session before the answer is relayed (either order).
    answered_before_the_watcher(&a, "spilling", false);
    wait_containers(&engine, 0).await;
    let dir = engine
        .data_root
        .join("hostile")
        .join(channel_segment("chan-1"));
    let written = files_under(&dir).len();
    eprintln!(
        "spilled after the call: {written} of 48 files of 1 MiB when the session was stopped"
    );
    // The files stay: the check before each call refuses (before the session's own
    // error is reached), and no container is started.
    for _ in 0..2 {
        let a = hostile(&turn, "ping", json!({})).await;
        // What is counted depends on where the killed writer's last file lies in the dir.
        let e = over_quota_error(&a);
        assert!(
            e.ends_with("entries; the limit is 16 MiB in 10000 entries); its session is stopped and calls are refused until an operator frees space"),
            "{e}"
        );
        assert_eq!(containers(&engine).len(), 0);
    }
    for f in files_under(&dir) {
        std::fs::remove_file(dir.join(f)).unwrap();
    }
    let a = hostile(&turn, "ping", json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    shut_down(broker, &engine).await;
}

/// [`mcp_image`] with `VOLUME /v` and a `HEALTHCHECK` (committed from it here: no
/// registry): the shape of many public server images.
fn image_with_a_volume() -> String {
    let image = "roundtable-sandbox-mcp-volume:test".to_owned();
    let name = format!("rtb-volume-image-{}", std::process::id());
    docker(&["create", "--name", &name, &mcp_image(), "true"]);
    docker(&[
        "commit",
        "--change",
        "VOLUME /v",
        "--change",
        "HEALTHCHECK --interval=1s CMD [\"true\"]",
        &name,
        &image,
    ]);
    docker(&["rm", &name]);
    image
}

/// An image's `VOLUME` is no storage past the quota: the engine would make it a writable
/// anonymous volume under the read-only root, outside `/data`'s quota and the floor; a
/// session gets a tmpfs of its size there instead (its pages count against its memory).
/// Its `HEALTHCHECK` (an exec the engine would start now and then, outside the seccomp
/// layer) is not run.
#[tokio::test]
async fn mcp_an_images_volume_is_a_capped_tmpfs() {
    const SCRIPT: &str = r#"
import json, sys
def fill():
    fstype = [l.split()[2] for l in open("/proc/mounts") if l.split()[1] == "/v"]
    written = 0
    try:
        for i in range(16):
            with open("/v/f%d" % i, "wb") as f:
                for _ in range(4):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1
    except OSError as e:
        pass
    return {"fstype": fstype, "written_mb": written}
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m: continue
    if m["method"] == "initialize":
        r = {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {}},
             "serverInfo": {"name": "volume", "version": "1"}}
    elif m["method"] == "tools/list":
        r = {"tools": [{"name": "fill", "description": "fill /v",
                        "inputSchema": {"type": "object", "properties": {}}}]}
    elif m["method"] == "tools/call":
        r = {"content": [{"type": "text", "text": json.dumps(fill())}]}
    else:
        r = {}
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}) + "\n")
    sys.stdout.flush()
"#;
    let image = tokio::task::spawn_blocking(image_with_a_volume)
        .await
        .unwrap();
    let mut server = McpServer::new(
        "volume",
        McpTransport::Stdio {
            command: "python3".into(),
            args: vec!["-c".into(), SCRIPT.into()],
            env: Default::default(),
        },
        &["fill"],
    );
    server.image = Some(image);
    server.limits.data_mb = 16;
    server.limits.tmpfs_mb = 8;
    let (engine, broker, turn) = start_with(server, |_| {}).await;
    let a = post_json(turn.socket(), "/v1/mcp/volume/fill", &json!({})).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let f: serde_json::Value = serde_json::from_str(a.json()["content"].as_str().unwrap()).unwrap();
    assert_eq!(f["fstype"], json!(["tmpfs"]), "{f}");
    // 64 MiB asked for, 8 MiB of tmpfs given.
    assert!(f["written_mb"].as_u64().unwrap() <= 8, "{f}");
    let session = containers(&engine);
    assert_eq!(session.len(), 1, "{session:?}");
    let health = docker(&[
        "inspect",
        "-f",
        "{{json .Config.Healthcheck.Test}} {{json .State.Health}}",
        &session[0],
    ]);
    assert_eq!(health, r#"["NONE"] null"#);
    shut_down(broker, &engine).await;
    let _ = std::process::Command::new("docker")
        .args(["rmi", "roundtable-sandbox-mcp-volume:test"])
        .output();
}
