//! `explain` shows the runtime every guest container runs under, and what replaces the
//! broker's peer-uid check when a runtime needs it off.

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

#[test]
fn explain_shows_the_runtime() {
    let dir = tempfile::Builder::new()
        .prefix("rte-")
        .tempdir_in("/tmp")
        .unwrap();
    let run = dir.path().join("run").display().to_string();
    let ws = dir.path().join("ws").display().to_string();
    let out = explain(None, &run, &ws);
    assert!(
        out.contains("runtime       the engine's default (runc: the guest shares the host kernel)"),
        "{out}"
    );
    assert!(
        out.contains("broker peer   only the worker uid may connect (SO_PEERCRED)"),
        "{out}"
    );
    let path = dir.path().join("gvisor.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{run}\"\n\
             workspace_root = \"{ws}\"\nmodel = \"m\"\nmodel_url = \"http://127.0.0.1:9/v1\"\n\
             allow_http = true\nruntime = \"runsc\"\npeer_uid_check = false\n"
        ),
    )
    .unwrap();
    let out = explain(Some(&path.display().to_string()), &run, &ws);
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
