//! `doctor` against the real engine, run as the non-root service user: each failure is
//! detected with its hint and a failing exit code. (Running as root is covered by a unit
//! test of the check and by scripts/test.sh, which runs `doctor` once as root.)

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

fn doctor(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"));
    cmd.arg("doctor").args(args).env_remove("DOCKER_HOST");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn roots() -> (tempfile::TempDir, String, String) {
    let dir = tempfile::Builder::new()
        .prefix("rtd-")
        .tempdir_in("/tmp")
        .unwrap();
    let run = dir.path().join("run");
    let ws = dir.path().join("ws");
    (dir, run.display().to_string(), ws.display().to_string())
}

/// A config file with the roots and the given `[limits]` lines.
fn floor_config(dir: &std::path::Path, run: &str, ws: &str, limits: &str) -> String {
    let path = dir.join("floor.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{run}\"\nworkspace_root = \"{ws}\"\n\
             model = \"m\"\nmodel_url = \"https://example.invalid/v1\"\n[limits]\n{limits}\n"
        ),
    )
    .unwrap();
    path.display().to_string()
}

#[test]
fn a_healthy_host_passes_every_check() {
    assert_ne!(
        nix::unistd::getuid().as_raw(),
        0,
        "run through scripts/test.sh"
    );
    let (d, run, ws) = roots();
    // The shared test machine's disk is often nearly full: no floor here (the next test
    // checks it).
    let config = floor_config(
        d.path(),
        &run,
        &ws,
        "disk_floor_mb = 0\ndisk_floor_percent = 0",
    );
    let (code, out) = doctor(&["--config", &config], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("all 9 checks passed"), "{out}");
    assert!(
        out.contains("ok   runtime         the engine's default (runc)"),
        "{out}"
    );
    assert!(out.contains("ok   workspace disk"), "{out}");
    assert!(out.contains("ok   engine disk     /"), "{out}");
    assert!(out.contains(" MiB free of "), "{out}");
}

#[test]
fn a_filesystem_below_the_free_space_floor_is_detected() {
    let (d, run, ws) = roots();
    let config = floor_config(d.path(), &run, &ws, "disk_floor_mb = 16777216");
    let (code, out) = doctor(&["--config", &config], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("FAIL workspace disk  {ws} (")),
        "{out}"
    );
    assert!(
        out.contains("; floor 16777216 MiB: below the floor, turns are refused"),
        "{out}"
    );
    assert!(out.contains("FAIL engine disk     /"), "{out}");
    assert!(
        out.contains("fix: free space on that filesystem, or lower limits.disk_floor_mb"),
        "{out}"
    );
}

#[test]
fn a_root_dir_with_a_wrong_mode_is_detected() {
    let (_d, run, ws) = roots();
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, out) = doctor(&["--run-root", &run, "--workspace-root", &ws], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("FAIL run_root        {run} has mode 755")),
        "{out}"
    );
    assert!(out.contains(&format!("fix: chmod 700 {run}")), "{out}");
}

#[test]
fn a_missing_image_is_detected() {
    let (_d, run, ws) = roots();
    let (code, out) = doctor(
        &[
            "--run-root",
            &run,
            "--workspace-root",
            &ws,
            "--image",
            "roundtable-missing:none",
        ],
        &[],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL image           roundtable-missing:none is missing"),
        "{out}"
    );
    assert!(
        out.contains("fix: build it: scripts/build-image.sh"),
        "{out}"
    );
}

#[test]
fn an_unreachable_docker_is_detected() {
    let (d, run, ws) = roots();
    let sock = format!("unix://{}/no-docker.sock", d.path().display());
    let (code, out) = doctor(
        &["--run-root", &run, "--workspace-root", &ws],
        &[("DOCKER_HOST", &sock)],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL docker          docker daemon unreachable"),
        "{out}"
    );
    assert!(out.contains("fix: start the daemon"), "{out}");
    assert!(out.contains("not checked, Docker is unreachable"), "{out}");
}

#[test]
fn explain_shows_the_quota_and_the_floor() {
    let (d, run, ws) = roots();
    let config = floor_config(
        d.path(),
        &run,
        &ws,
        "workspace_mb = 64\ndisk_floor_mb = 2048\ndisk_floor_percent = 7",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .args(["explain", "--config", &config])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("disk          workspace quota 64 MiB / 100000 entries per channel; free-space floor max(2048 MiB, 7 %) on the workspaces' and the engine's filesystems"),
        "{text}"
    );
}

#[test]
fn explain_shows_the_model_fields_and_the_turn_caps() {
    let (d, run, ws) = roots();
    let path = d.path().join("fields.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{run}\"\nworkspace_root = \"{ws}\"\n\
             model = \"m\"\nmodel_url = \"https://example.invalid/v1\"\n\
             [broker]\nmax_calls_in_flight = 2\nmax_connections = 8\nmax_compactions = 3\n\
             [model_request]\nmax_tokens = 4096\nextra_fields = [\"reasoning_effort\"]\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .args(["explain", "--config", &path.display().to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("model fields  messages, tools, tool_choice, parallel_tool_calls, stream, stream_options, temperature, top_p, stop, seed, response_format, max_tokens, max_completion_tokens, reasoning_effort (anything else: 400); model forced; max_tokens capped at 4096 (set when absent)"),
        "{text}"
    );
    assert!(
        text.contains("broker turn   2 calls in flight, 8 connections"),
        "{text}"
    );
    assert!(text.contains(" tool calls, 3 compactions, "), "{text}");
}

#[test]
fn a_runtime_the_engine_does_not_list_is_detected_with_the_fix() {
    let (d, run, ws) = roots();
    let config = |runtime: &str| {
        let path = d.path().join(format!("{runtime}.toml"));
        std::fs::write(
            &path,
            format!(
                "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{run}\"\n\
                 workspace_root = \"{ws}\"\nmodel = \"m\"\nmodel_url = \"http://127.0.0.1:9/v1\"\n\
                 allow_http = true\nruntime = \"{runtime}\"\npeer_uid_check = false\n"
            ),
        )
        .unwrap();
        path.display().to_string()
    };
    let (code, out) = doctor(&["--config", &config("roundtable-no-such-runtime")], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL runtime         roundtable-no-such-runtime is not listed by the engine (it lists "),
        "{out}"
    );
    assert!(
        out.contains("fix: add it to \"runtimes\" in /etc/docker/daemon.json"),
        "{out}"
    );
    // The engine always lists runc.
    let (_, out) = doctor(&["--config", &config("runc")], &[]);
    assert!(
        out.contains("ok   runtime         runc, listed by the engine"),
        "{out}"
    );
}

#[test]
fn mcp_servers_are_checked_and_an_unconfined_one_is_flagged() {
    let (d, run, ws) = roots();
    let path = d.path().join("mcp.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{run}\"\nworkspace_root = \"{ws}\"\n\
             model = \"m\"\nmodel_url = \"https://example.invalid/v1\"\n\
             [limits]\ndisk_floor_mb = 0\ndisk_floor_percent = 0\n\
             [[mcp]]\nname = \"notes\"\ntransport = \"stdio\"\ncommand = \"mcp-server-sqlite\"\n\
             image = \"roundtable-mcp-missing:none\"\ntools = [\"read_query\"]\n\
             [[mcp]]\nname = \"wiki\"\ntransport = \"stdio\"\ncommand = \"wiki-mcp\"\nconfine = \"host\"\ntools = [\"search\"]\n"
        ),
    )
    .unwrap();
    let (code, out) = doctor(&["--config", &path.display().to_string()], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL mcp             notes: image roundtable-mcp-missing:none is missing"),
        "{out}"
    );
    assert!(
        out.contains("fix: build it: scripts/build-mcp-image.sh"),
        "{out}"
    );
    assert!(
        out.contains("FAIL mcp             wiki runs UNCONFINED on the host (confine = \"host\"): the service user's rights, groups (docker) and files"),
        "{out}"
    );
    assert!(out.contains("2 of 11 checks failed"), "{out}");
}

/// Issue 21: `doctor` runs the runtime's own check of what lies above each root (the
/// validation function, not a copy of the rule) and fails on a root another user can swap.
#[test]
fn a_root_under_a_directory_others_can_write_is_detected() {
    let (d, _, ws) = roots();
    let shared = d.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let run = shared.join("run").display().to_string();
    let (code, out) = doctor(&["--run-root", &run, "--workspace-root", &ws], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "FAIL run_root        sandbox root {run} lies under {}, which group or others can write (mode 777, not sticky)",
            shared.display()
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!("fix: chmod go-w {}", shared.display())),
        "{out}"
    );
    assert!(out.contains("ok   workspace_root"), "{out}");
}

#[test]
fn a_corrupt_or_missing_budget_state_file_is_reported_and_explain_shows_the_budgets() {
    let (d, run, ws) = roots();
    let state = d.path().join("budgets.sqlite");
    let config = floor_config(
        d.path(),
        &run,
        &ws,
        &format!(
            "disk_floor_mb = 0\ndisk_floor_percent = 0\n[budgets]\nstate_file = \"{}\"\n\
             speaker_tokens_per_day = 50000\nspeaker_turns_per_minute = 6\n",
            state.display()
        ),
    );
    let (_, out) = doctor(&["--config", &config], &[]);
    assert!(
        out.contains(&format!(
            "ok   state file      {} will be created at startup",
            state.display()
        )),
        "{out}"
    );
    assert!(!state.exists(), "doctor made the state file");
    std::fs::write(&state, b"garbage garbage garbage garbage garbage garbage").unwrap();
    let (code, out) = doctor(&["--config", &config], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "FAIL state file      budget state file {} is not a usable SQLite database",
            state.display()
        )),
        "{out}"
    );
    assert_eq!(
        std::fs::read(&state).unwrap(),
        b"garbage garbage garbage garbage garbage garbage"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .args(["explain", "--config", &config])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.contains(&format!(
            "budgets       50000 tokens per speaker per day, 6 turns per speaker per minute; days start at 00:00 UTC; \
             a turn past one is refused before its container, a model call past one gets 429; counters in {} (SQLite, WAL)",
            state.display()
        )),
        "{out}"
    );
}

/// The budgets' shared store: `explain` and `doctor` name where its URL comes from, never
/// the URL (a password in it); `fail_open` is a WARNING; a URL written in the config file
/// is refused without being echoed.
#[test]
fn the_shared_budget_store_is_shown_by_its_source_never_its_url() {
    let (d, run, ws) = roots();
    let state = d.path().join("journal.sqlite");
    let url_file = d.path().join("budgets-url");
    // Port 1 on loopback: nothing listens there.
    std::fs::write(
        &url_file,
        "postgres://bot:s3cr3t-pw@127.0.0.1:1/bots?sslmode=disable&connect_timeout=2",
    )
    .unwrap();
    let config = floor_config(
        d.path(),
        &run,
        &ws,
        &format!(
            "disk_floor_mb = 0\ndisk_floor_percent = 0\n[budgets]\nstate_file = \"{}\"\n\
             speaker_tokens_per_day = 50000\nstore = {{ file = \"{}\" }}\nnamespace = \"bot-1\"\n\
             fail_open = true\n",
            state.display(),
            url_file.display()
        ),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .args(["explain", "--config", &config])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!(
            "budget store  PostgreSQL, namespace \"bot-1\", its URL from file {} (never shown)",
            url_file.display()
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "WARNING       budgets.fail_open = true: with the database unreachable past 10 s"
        ),
        "{text}"
    );
    assert!(!text.contains("s3cr3t") && !text.contains("bot:"), "{text}");
    let (code, out) = doctor(&["--config", &config], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "FAIL budget store    budget store PostgreSQL (namespace \"bot-1\", URL from file {}): connect:",
            url_file.display()
        )),
        "{out}"
    );
    assert!(
        !out.contains("s3cr3t") && !out.contains("127.0.0.1:1"),
        "{out}"
    );
    // Written in the file itself: refused by doctor's config rules, echoed by nothing.
    let literal = floor_config(
        d.path(),
        &run,
        &ws,
        &format!(
            "[budgets]\nstate_file = \"{}\"\nstore = \"postgres://bot:s3cr3t-pw@db/bots\"\n",
            state.display()
        ),
    );
    let (code, out) = doctor(&["--config", &literal], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("budgets.store must name where its URL comes from, not hold it"),
        "{out}"
    );
    assert!(!out.contains("s3cr3t"), "{out}");
    let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .args(["explain", "--config", &literal])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("s3cr3t"), "{text}");
}

#[test]
fn doctor_checks_the_metrics_address_and_explain_shows_it() {
    let (d, run, ws) = roots();
    let config = floor_config(
        d.path(),
        &run,
        &ws,
        "disk_floor_mb = 0\ndisk_floor_percent = 0\n",
    );
    // A port another process holds: not bindable.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap();
    let (code, out) = doctor(&["--config", &config, "--metrics", &addr.to_string()], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "FAIL metrics         bind the metrics address {addr}: Address already in use"
        )),
        "{out}"
    );
    drop(held);
    let (_, out) = doctor(&["--config", &config, "--metrics", &addr.to_string()], &[]);
    assert!(
        out.contains(&format!(
            "ok   metrics         http://{addr}/metrics can be served"
        )),
        "{out}"
    );
    // Not loopback, not allowed: refused before any bind.
    let (code, out) = doctor(&["--config", &config, "--metrics", "0.0.0.0:9464"], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "FAIL metrics         metrics address 0.0.0.0:9464 is not a loopback address (give --metrics-allow-remote to serve metrics beyond this host)"
        ),
        "{out}"
    );
    // Without --metrics doctor says nothing of it.
    let (_, out) = doctor(&["--config", &config], &[]);
    assert!(!out.contains("metrics"), "{out}");
    let explain = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
            .args(["explain", "--config", &config])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(explain(&[])
        .contains("metrics       off (the bots serve Prometheus metrics with --metrics ADDR)"));
    assert!(explain(&["--metrics"]).contains(
        "metrics       http://127.0.0.1:9464/metrics (Prometheus; loopback only; labels never name a channel, a speaker or guest text)"
    ));
    assert!(
        explain(&["--metrics", "[::]:9464", "--metrics-allow-remote"]).contains(
            "metrics       http://[::]:9464/metrics (Prometheus; REACHABLE beyond this host;"
        )
    );
}

/// Issue 22 item 3: `doctor` names every violation of the runtime's own rules (the startup
/// validation in its every-violation mode, not a copy of a rule), one line each; the
/// runtime at startup names the first (`config_rules::every_violation_is_collected_for_doctor_and_startup_names_the_first`).
#[test]
fn every_config_violation_is_named_by_doctor() {
    let (d, run, ws) = roots();
    let path = d.path().join("three.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"Not An Image\"\nrun_root = \"{run}\"\nworkspace_root = \"{ws}\"\n\
             model = \"m\"\nmodel_url = \"https://example.invalid/v1\"\nmax_steps = 0\n\
             [limits]\nmemory_mb = 15\ndisk_floor_mb = 0\ndisk_floor_percent = 0\n"
        ),
    )
    .unwrap();
    let (code, out) = doctor(&["--config", &path.display().to_string()], &[]);
    assert_eq!(code, 1, "{out}");
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("FAIL config"))
        .collect();
    assert_eq!(
        lines,
        [
            "FAIL config          invalid image reference: \"Not An Image\"",
            "FAIL config          limits.memory_mb must be 16 to 1048576, got 15",
            "FAIL config          max_steps must be 1 to 256, got 0",
        ],
        "{out}"
    );
    assert!(
        out.contains(
            "fix: change the setting it names: the runtime refuses this configuration at startup"
        ),
        "{out}"
    );
    assert!(!std::path::Path::new(&run).exists(), "doctor made a root");
}

/// Issue 43 item 7: `doctor` loads the day's counters exactly as a start does. A file whose
/// counters a start reads only clamped (the REAL 9.22e18 of an overflowed sum, and
/// a TEXT) is a FAIL line with the start's own warning, and is left as it is; a file a
/// start cannot load at all (a foreign `tokens` table without the column) is a FAIL line
/// with the error the start fails with; a clean one passes with what it loaded.
#[test]
fn a_state_file_a_start_would_clamp_or_cannot_load_is_a_fail_line() {
    let (d, run, ws) = roots();
    let state = d.path().join("budgets.sqlite");
    let config = floor_config(
        d.path(),
        &run,
        &ws,
        &format!(
            "disk_floor_mb = 0\ndisk_floor_percent = 0\n[budgets]\nstate_file = \"{}\"\n\
             speaker_tokens_per_day = 50000\n",
            state.display()
        ),
    );
    let today = chrono::Utc::now().date_naive().to_string();
    // A clean file: today's counters load.
    drop(roundtable_sandbox::operator::SqliteStore::open(&state).unwrap());
    let conn = rusqlite::Connection::open(&state).unwrap();
    conn.execute(
        "INSERT INTO tokens VALUES (?1, 'speaker', 'ann', 10), (?1, 'bot', '', 10)",
        [&today],
    )
    .unwrap();
    drop(conn);
    let (code, out) = doctor(&["--config", &config], &[]);
    assert!(
        out.contains(&format!(
            "ok   state file      {} opens and loads (SQLite, WAL, checked; today's 2 counter(s), 0 turn(s) of the last minute)",
            state.display()
        )),
        "{code} {out}"
    );

    // What the overflowing writer left, and a foreign writer's text.
    let conn = rusqlite::Connection::open(&state).unwrap();
    conn.execute(
        "UPDATE tokens SET tokens = 9223372036854775807.0 + 9223372036854775807.0 WHERE scope = 'bot'",
        [],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO tokens VALUES (?1, 'channel', 'c', 'many')",
        [&today],
    )
    .unwrap();
    drop(conn);
    let (code, out) = doctor(&["--config", &config], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "FAIL state file      budget state file {}: 2 of 3 counter row(s) loaded were not clean: 2 clamped \
             (REAL, TEXT, NULL, BLOB or negative: read as 0 if negative, a REAL as its whole part up to \
             9223372036854775807, anything else as spent, 9223372036854775807); the runtime goes on with them \
             so (a counter's next charge rewrites it clean; an unreadable turn is pruned)\n",
            state.display()
        )),
        "{out}"
    );
    assert!(
        out.contains("fix: a start goes on with these values clamped; to clear them now, stop the bot and fix or delete those rows with sqlite3"),
        "{out}"
    );
    let conn = rusqlite::Connection::open(&state).unwrap();
    let kinds: Vec<String> = conn
        .prepare("SELECT typeof(tokens) FROM tokens ORDER BY scope")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(kinds, ["real", "text", "integer"], "doctor changed a value");
    drop(conn);

    // A foreign schema that opens but cannot be loaded: what a start says, doctor says.
    std::fs::remove_file(&state).unwrap();
    let conn = rusqlite::Connection::open(&state).unwrap();
    conn.execute_batch(
        "CREATE TABLE tokens (day TEXT, scope TEXT, key TEXT, used INTEGER,
             PRIMARY KEY (day, scope, key)) WITHOUT ROWID;",
    )
    .unwrap();
    drop(conn);
    let (code, out) = doctor(&["--config", &config], &[]);
    assert_eq!(code, 1, "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("FAIL state file"))
        .unwrap_or_else(|| panic!("{out}"));
    let expected = format!(
        "budget state file {}: no such column: tokens",
        state.display()
    );
    assert!(line.contains(&expected), "{out}");
    // The start (the `turn` command starts a runtime) fails on it with the same error,
    // before any container.
    let start = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .args([
            "turn",
            "--config",
            &config,
            "--channel",
            "#c",
            "--speaker",
            "s",
            "hi",
        ])
        .env_remove("DOCKER_HOST")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&start.stderr);
    assert!(!start.status.success(), "{said}");
    let reason = line.split("FAIL state file      ").nth(1).unwrap();
    assert!(said.contains(reason), "doctor: {reason}\nstart: {said}");
}
