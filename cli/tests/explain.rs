//! `explain` shows each MCP server's scope: one session per channel (with its cap) or one
//! shared by every channel, flagged with both of its hazards: its data is every channel's,
//! and so is its availability (one call at a time; a timeout's effect on the others).

use std::process::Command;

mod common;

#[test]
fn explain_shows_each_mcp_servers_scope() {
    let (dir, path) = common::config_in("rte-", "c.toml", |dir| {
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\nworkspace_root = \"{}\"\n\
             model = \"m\"\nmodel_url = \"https://example.invalid/v1\"\n\
             [[mcp]]\nname = \"notes\"\ntransport = \"stdio\"\ncommand = \"mcp-server-sqlite\"\n\
             image = \"roundtable-sandbox-mcp:latest\"\nargs = [\"--db-path\", \"/data/db.sqlite\"]\ntools = [\"read_query\"]\nmax_sessions = 8\n\
             [[mcp]]\nname = \"wiki\"\ntransport = \"stdio\"\ncommand = \"wiki-mcp\"\nconfine = \"host\"\nscope = \"shared\"\ntools = [\"search\"]\n\
             [[mcp]]\nname = \"remote\"\ntransport = \"http\"\nurl = \"https://mcp.example.invalid/mcp\"\ntools = [\"search\"]\n\
             [[mcp]]\nname = \"fetch\"\ntransport = \"stdio\"\ncommand = \"mcp-server-fetch\"\n\
             image = \"roundtable-sandbox-mcp:latest\"\nnetwork = true\ntools = [\"fetch\"]\n",
            dir.join("run").display(),
            dir.join("ws").display()
        )
    });
    let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .args(["explain", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mcp: Vec<&str> = stdout.lines().filter(|l| l.starts_with("mcp ")).collect();
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    let ws = std::fs::canonicalize(dir.path().join("ws"))
        .unwrap_or_else(|_| dir.path().join("ws"))
        .display()
        .to_string();
    assert!(
        stdout.contains("WARNING       mcp wiki runs unconfined on the host: whatever a guest makes it do, it does with the service user's rights"),
        "{stdout}"
    );
    // A container server with the engine's network: flagged (it is not under egress's
    // deny set); one without is not.
    assert!(
        stdout.lines().any(|l| l == "WARNING       mcp fetch has the engine's default network (network = true): a guest can make it reach the host's bridge address, the other containers there and a cloud metadata service, which egress routes refuse"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("mcp notes has the engine's default network"),
        "{stdout}"
    );
    // Every shared server is flagged with both hazards (issue 43), by its transport.
    let shared = "is shared by every channel: whatever it keeps, every channel can read; its calls run one at a time, in turn across channels, so one channel's slow call delays the others' (each call up to 60s), and ";
    let channel = "; scope = \"channel\" gives each channel its own session";
    for (server, timeout) in [
        ("wiki", "a call that times out stops the session for every channel (the calls waiting run on a restarted one; what the server kept only in memory is lost)"),
        ("remote", "a call that times out is cancelled and the session kept (the calls behind it wait for whatever the remote still does for it)"),
    ] {
        let line = format!("WARNING       mcp {server} {shared}{timeout}{channel}");
        assert!(stdout.lines().any(|l| l == line), "{line}\n{stdout}");
    }
    assert!(!stdout.contains("mcp notes is shared"), "{stdout}");
    assert_eq!(
        mcp,
        [
            format!("mcp           notes: stdio `mcp-server-sqlite` in a container of roundtable-sandbox-mcp:latest per session (user {uid}:{gid}, no other group, network none, read-only root, memory 256 MiB, 0.5 cpus, 64 pids, only its data dir {ws}/.mcp/notes/<sha256(channel)> -> /data, quota 64 MiB / 10000 entries); one session per channel (at most 8, least recently used stopped first); allow-list: read_query").as_str(),
            format!("mcp           wiki: stdio `wiki-mcp` UNCONFINED on the host (confine = \"host\": user {uid}:{gid} with its groups, its files, its network); one session shared by every channel (cross-channel; its calls one at a time, in turn across channels); allow-list: search").as_str(),
            "mcp           remote: http mcp.example.invalid; one session shared by every channel (cross-channel; its calls one at a time, in turn across channels); allow-list: search",
            format!("mcp           fetch: stdio `mcp-server-fetch` in a container of roundtable-sandbox-mcp:latest per session (user {uid}:{gid}, no other group, network ON (network = true), read-only root, memory 256 MiB, 0.5 cpus, 64 pids, only its data dir {ws}/.mcp/fetch/<sha256(channel)> -> /data, quota 64 MiB / 10000 entries); one session per channel (at most 16, least recently used stopped first); allow-list: fetch").as_str(),
        ],
        "{stdout}"
    );
}
