//! `explain` shows the runtime every guest container runs under, what replaces the
//! broker's peer-uid check when a runtime needs it off, and whether turns are warm.

use std::process::Command;

fn explain(config: Option<&str>, run: &str, ws: &str) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"));
    cmd.arg("explain").env_remove("DOCKER_HOST");
    match config {
        Some(c) => cmd.args(["--config", c]),
        None => cmd.args(["--run-root", run, "--workspace-root", ws]),
    };
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A config file in `dir` with its roots under `dir`, plus `extra` lines; returns its path.
fn config_file(dir: &std::path::Path, extra: &str) -> String {
    let (run, ws) = (dir.join("run"), dir.join("ws"));
    let path = dir.join("config.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\n\
             workspace_root = \"{}\"\nmodel = \"m\"\nmodel_url = \"http://127.0.0.1:9/v1\"\n\
             allow_http = true\n{extra}",
            run.display(),
            ws.display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

/// A temp dir, and the run and workspace roots under it.
fn roots(prefix: &str) -> (tempfile::TempDir, String, String) {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap();
    let run = dir.path().join("run").display().to_string();
    let ws = dir.path().join("ws").display().to_string();
    (dir, run, ws)
}

#[test]
fn explain_shows_the_runtime() {
    let (dir, run, ws) = roots("rte-");
    let out = explain(None, &run, &ws);
    assert!(
        out.contains("runtime       the engine's default (runc: the guest shares the host kernel)"),
        "{out}"
    );
    assert!(
        out.contains("broker peer   only the worker uid may connect (SO_PEERCRED)"),
        "{out}"
    );
    let path = config_file(dir.path(), "runtime = \"runsc\"\npeer_uid_check = false\n");
    let out = explain(Some(&path), &run, &ws);
    assert!(
        out.contains(
            "runtime       runsc (gVisor: a user-space kernel between the guest and the host)"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "broker peer   uid check OFF (peer_uid_check = false): only the per-turn 0700 run \
             dir keeps other local users away"
        ),
        "{out}"
    );
}

#[test]
fn explain_shows_whether_turns_are_warm() {
    let (dir, run, ws) = roots("rtw-");
    // On by default, removed after the channel's idle timeout.
    let out = explain(None, &run, &ws);
    assert!(
        out.contains(
            "warm turns    on: each channel's next container is started after its turn, up to 8 \
             in all, removed after the channel's idle timeout unused; it reaches no broker \
             before its turn"
        ),
        "{out}"
    );
    let ttl = config_file(dir.path(), "[warm]\nmax = 3\nttl_secs = 30\n");
    let out = explain(Some(&ttl), &run, &ws);
    assert!(
        out.contains("up to 3 in all, removed after 30 s unused"),
        "{out}"
    );
    for off in ["[warm]\nenabled = false\n", "[warm]\nmax = 0\n"] {
        let path = config_file(dir.path(), off);
        let out = explain(Some(&path), &run, &ws);
        assert!(
            out.contains("warm turns    off (every turn creates and starts its container)"),
            "{off}: {out}"
        );
    }
}
