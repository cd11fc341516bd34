//! `roundtable-sandbox turn` prints the guest's reply as JSON: every control a terminal
//! obeys is escaped, C1 controls, DEL and bidi controls too (issue 21: JSON escapes only
//! C0). A real turn: the embedded offline model, the guest in its sealed container; runs
//! as the service user.

use std::process::Command;

mod common;

#[test]
fn turn_prints_guest_made_controls_escaped_and_the_json_stays_the_same() {
    assert_ne!(
        nix::unistd::getuid().as_raw(),
        0,
        "run through scripts/test.sh"
    );
    let (dir, config) = common::config_in("rtc-", "floor.toml", |_| {
        "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"/unused/run\"\n\
         workspace_root = \"/unused/ws\"\nmodel = \"offline\"\nmodel_url = \"http://127.0.0.1:9/v1\"\n\
         [limits]\ndisk_floor_mb = 0\ndisk_floor_percent = 0\n"
            .to_owned()
    });
    let out = Command::new(env!("CARGO_BIN_EXE_roundtable-sandbox"))
        .arg("--config")
        .arg(&config)
        .arg("--run-root")
        .arg(dir.path().join("run"))
        .arg("--workspace-root")
        .arg(dir.path().join("ws"))
        .arg("--offline")
        .args(["turn", "--channel", "#t", "--speaker", "ann", "--"])
        .arg(r"run: printf '\033]0;owned\007\302\23331m\302\2350;t\302\234\177\342\200\256\342\201\246end'")
        .env_remove("OPENAI_API_KEY")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let raw: Vec<char> = stdout
        .chars()
        .filter(|&c| c != '\n' && roundtable_sandbox::display::is_escaped(c))
        .collect();
    assert_eq!(raw, Vec::<char>::new(), "{stdout}");
    let reply: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let text = reply["text"].as_str().unwrap();
    // The same reply, decoded: the guest's bytes are all there.
    assert!(
        text.contains("\u{1b}]0;owned\u{7}\u{9b}31m\u{9d}0;t\u{9c}\u{7f}\u{202e}\u{2066}end"),
        "{text:?}"
    );
    assert!(
        stdout.contains(r"\u001b]0;owned\u0007\u009b31m\u009d0;t\u009c\u007f\u202e\u2066end"),
        "{stdout}"
    );
}
