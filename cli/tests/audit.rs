//! `audit FILE` summarises an audit trail (its exact output; bad lines named, never a
//! crash; a guest's speaker id escaped for the terminal); `explain` says where the audit
//! goes; `doctor` checks that the service user can append to it.

mod common;

use std::os::unix::fs::PermissionsExt;

fn cli(args: &[&str]) -> (i32, String, String) {
    common::outcome(common::command().args(args))
}

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("rta-")
        .tempdir_in("/tmp")
        .unwrap()
}

/// One line as the runtime writes it.
#[allow(clippy::too_many_arguments)]
fn line(
    turn: &str,
    channel: &str,
    speaker: &str,
    launch: &str,
    outcome: &str,
    total: f64,
    tokens: (u64, u64),
    budget: Option<&str>,
) -> String {
    let budget = budget.map_or(String::new(), |b| {
        format!(r#","budget":{{"name":"{b}","limit":1000,"message":"this speaker has used today's 1000 tokens; the budget resets at 00:00 UTC"}}"#)
    });
    format!(
        r#"{{"v":1,"at":"2026-12-02T05:00:00.000Z","turn":{turn},"channel":"{channel}","speaker":"{speaker}","launch":"{launch}","outcome":"{outcome}"{budget},"duration_ms":{{"total":{total}}},"model_calls":[],"tool_calls":[],"refusals":[],"usage":{{"prompt_tokens":{},"completion_tokens":{},"model_calls":1,"tool_calls":0,"estimated":false}},"bytes_in":5,"bytes_out":7,"workspace_bytes":4096}}"#,
        tokens.0, tokens.1
    ) + "\n"
}

#[test]
fn audit_summarises_a_trail_and_names_its_bad_lines() {
    let dir = tmp();
    let path = dir.path().join("audit.jsonl");
    let mut text = String::new();
    for (i, total) in [120.0, 180.0, 240.0, 900.0].iter().enumerate() {
        text += &line(
            &(i + 1).to_string(),
            "302d59c4f9e75750",
            "u1",
            "cold",
            "ok",
            *total,
            (100, 50),
            None,
        );
    }
    text += &line(
        "5",
        "302d59c4f9e75750",
        "u1",
        "warm",
        "ok",
        40.0,
        (10, 5),
        None,
    );
    text += &line(
        "6",
        "dd883973c3c017ed",
        "u2",
        "warm",
        "ok",
        60.0,
        (500, 500),
        None,
    );
    text += "this is not json\n";
    text += &line(
        "null",
        "dd883973c3c017ed",
        "u2",
        "none",
        "busy",
        0.0,
        (0, 0),
        None,
    );
    text += &line(
        "7",
        "3732c64f873466d5",
        "u1",
        "none",
        "budget_exceeded",
        2.0,
        (0, 0),
        Some("speaker_tokens_per_day"),
    );
    // A speaker id a guest chose: an OSC title escape, a clear screen and a bidi override.
    text += &line(
        "8",
        "3732c64f873466d5",
        r"\u001b]0;owned\u0007\u001b[2J\u202eevil",
        "cold",
        "timeout",
        3000.0,
        (1, 1),
        None,
    );
    text += "{\"v\":1,\"at\":\"2026-12-02T05:0";
    std::fs::write(&path, text).unwrap();
    let (code, out, err) = cli(&["audit", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        out,
        "\
turns         9 (3 failed)
unreadable    2 lines: line 7 malformed, line 11 truncated
outcomes
  budget_exceeded            1
  busy                       1
  ok                         6
  timeout                    1
duration ms    turns        p50        p95
  cold             5      240.0     3000.0
  none             2        0.0        2.0
  warm             2       40.0       60.0
top speakers by tokens
  u2                          1000 tokens      2 turns
  u1                           615 tokens      6 turns
  \\u{1b}]0;owned\\u{7}\\u{1b}[2J\\u{202e}evil         2 tokens      1 turns
top channels by tokens
  dd883973c3c017ed            1000 tokens      2 turns
  302d59c4f9e75750             615 tokens      5 turns
  3732c64f873466d5               2 tokens      2 turns
budget refusals
  speaker_tokens_per_day     1
"
    );
    assert!(!out.contains('\u{1b}') && !out.contains('\u{202e}'));
    // An empty trail, and a missing file (a clear error, exit 2).
    std::fs::write(&path, "").unwrap();
    let (code, out, _) = cli(&["audit", path.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "turns         0 (0 failed)\noutcomes\nduration ms    turns        p50        p95\n\
         top speakers by tokens\ntop channels by tokens\nbudget refusals\n  none\n"
    );
    let missing = dir.path().join("missing.jsonl");
    let (code, _, err) = cli(&["audit", missing.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert_eq!(
        err,
        format!(
            "roundtable-sandbox: open audit file {}\n  caused by: No such file or directory (os error 2)\n",
            missing.display()
        )
    );
}

fn config(dir: &std::path::Path, audit: &str) -> String {
    let path = dir.join("c.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\nworkspace_root = \"{}\"\n\
             model = \"m\"\nmodel_url = \"https://example.invalid/v1\"\n[limits]\ndisk_floor_mb = 0\n\
             disk_floor_percent = 0\n[audit]\n{audit}\n",
            dir.join("run").display(),
            dir.join("ws").display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

#[test]
fn explain_says_where_the_audit_goes_and_doctor_checks_it_is_writable() {
    let dir = tmp();
    let audit = dir.path().join("audit.jsonl");
    let c = config(dir.path(), &format!("path = \"{}\"", audit.display()));
    let (_, out, _) = cli(&["explain", "--config", &c]);
    assert!(
        out.contains(&format!(
            "audit         one JSON line per turn appended to {}; guest text: the speaker id only (include_text = false); never a key",
            audit.display()
        )),
        "{out}"
    );
    let (_, out, _) = cli(&["doctor", "--config", &c]);
    assert!(
        out.contains(&format!(
            "ok   audit file      {} will be created at startup",
            audit.display()
        )),
        "{out}"
    );
    assert!(!audit.exists(), "doctor made the audit file");
    std::fs::write(&audit, b"").unwrap();
    let (_, out, _) = cli(&["doctor", "--config", &c]);
    assert!(
        out.contains(&format!(
            "ok   audit file      {} is writable (appended to)",
            audit.display()
        )),
        "{out}"
    );
    std::fs::set_permissions(&audit, std::fs::Permissions::from_mode(0o400)).unwrap();
    let (code, out, _) = cli(&["doctor", "--config", &c]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "FAIL audit file      {} cannot be opened for appending: Permission denied (os error 13)",
            audit.display()
        )),
        "{out}"
    );
    assert_eq!(std::fs::read(&audit).unwrap(), b"");

    let c = config(
        dir.path(),
        &format!("path = \"{}\"\ninclude_text = true", audit.display()),
    );
    let (_, out, _) = cli(&["explain", "--config", &c]);
    assert!(
        out.contains("guest text: the speaker id, the message and the reply (include_text = true)"),
        "{out}"
    );
    let c = config(dir.path(), "include_txt = true");
    let (code, _, err) = cli(&["explain", "--config", &c]);
    assert_eq!(code, 2);
    assert!(
        err.contains("audit.include_txt: unknown field `include_txt`"),
        "{err}"
    );
    let c = config(dir.path(), "");
    let (_, out, _) = cli(&["explain", "--config", &c]);
    assert!(out.contains("audit         off\n"), "{out}");
}
