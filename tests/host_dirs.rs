//! Issue 21 (must-have 6): the roots and the channel directories stay private after startup.
//! Against the real Docker engine, the runtime running as the non-root service user.
//!
//! - An existing channel directory open to others (or of another owner) is refused, not
//!   mounted: a directory some other user could have prepared, or can read.
//! - A workspace root replaced after startup is never mounted: the channel directory is
//!   made and opened relative to the root's descriptor held since startup, and the path
//!   given to the engine is checked to name that directory just before the container is
//!   created.

use std::os::unix::fs::PermissionsExt;

use roundtable_sandbox::testing::*;
use roundtable_sandbox::{Sandbox, TurnFailure};

const WRITE: &str = r#"cat >/dev/null; echo guest-secret > /workspace/guest-file || exit 3; printf '{"ok":true,"text":"wrote"}'"#;

#[tokio::test(flavor = "multi_thread")]
async fn an_existing_channel_dir_open_to_others_is_refused() {
    let env = Env::new();
    let sandbox = Sandbox::new(env.sh_config(WRITE)).await.unwrap();
    let ws = env.workspace_of("#open");
    std::fs::create_dir(&ws).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o755)).unwrap();
    let outcome = sandbox.run_turn_outcome(request("#open", "hi")).await;
    let uid = nix::unistd::getuid().as_raw();
    assert_eq!(
        outcome.reply.error.as_deref(),
        Some(
            format!(
                "workspace {} must be a directory of the service user (uid {uid}) with no group or other permission bits: found uid {uid}, mode 755",
                ws.display()
            )
            .as_str()
        ),
        "{outcome:?}"
    );
    assert_eq!(outcome.failure, Some(TurnFailure::Internal));
    assert!(!ws.join("guest-file").exists(), "never mounted");
    // The same directory made private is served (the check is about the mode only).
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o700)).unwrap();
    let outcome = sandbox.run_turn_outcome(request("#open", "hi")).await;
    assert!(outcome.reply.ok, "{outcome:?}");
    assert_eq!(
        std::fs::read_to_string(ws.join("guest-file")).unwrap(),
        "guest-secret\n"
    );
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workspace_root_replaced_after_startup_is_never_mounted() {
    let env = Env::new();
    let sandbox = Sandbox::new(env.sh_config(WRITE)).await.unwrap();
    // Someone who can write the root's parent moves the root away and puts their own
    // directory in its place (here the service user does it: the startup check refuses a
    // root whose parent another user could write).
    let held = env.dir.path().join("ws-held");
    std::fs::rename(&env.workspace_root, &held).unwrap();
    std::fs::create_dir(&env.workspace_root).unwrap();
    std::fs::set_permissions(&env.workspace_root, std::fs::Permissions::from_mode(0o700)).unwrap();
    // With the channel's directory already there (its name is the channel's sha256).
    let ws = env.workspace_of("#swap");
    std::fs::create_dir(&ws).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o700)).unwrap();
    let outcome = sandbox.run_turn_outcome(request("#swap", "hi")).await;
    assert_eq!(
        outcome.reply.error.as_deref(),
        Some(
            format!(
                "workspace {} no longer names the directory made for the turn (the workspace root was moved or replaced)",
                ws.display()
            )
            .as_str()
        ),
        "{outcome:?}"
    );
    assert_eq!(outcome.failure, Some(TurnFailure::Internal));
    // Nothing was made or written in the planted root; the channel's directory was made
    // in the held one (and never mounted).
    assert_eq!(std::fs::read_dir(&env.workspace_root).unwrap().count(), 1);
    assert!(
        !ws.join("guest-file").exists(),
        "the guest wrote into the planted directory"
    );
    let real = held.join(roundtable_sandbox::turn::channel_segment("#swap"));
    assert!(real.is_dir());
    assert!(!real.join("guest-file").exists());
    assert_no_leftovers(&sandbox).await;
}
