//! Issue 21 (must-have 6): the roots and the channel directories stay private after startup.
//! Against the real Docker engine, the runtime running as the non-root service user.
//!
//! - An existing channel directory open to others, or of another owner (`nobody`'s, made by
//!   root through a throwaway root container before the runtime starts), is refused, not
//!   mounted: a directory some other user could have prepared, or can read.
//! - A workspace root replaced after startup is never mounted: the channel directory is
//!   made and opened relative to the root's descriptor held since startup, and the path
//!   given to the engine is checked to name that directory just before the container is
//!   created.

use std::os::unix::fs::PermissionsExt;

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::{Sandbox, TurnFailure};

const WRITE: &str = r#"cat >/dev/null; echo guest-secret > /workspace/guest-file || exit 3; printf '{"ok":true,"text":"wrote"}'"#;

#[tokio::test(flavor = "multi_thread")]
async fn an_existing_channel_dir_open_to_others_is_refused() {
    let env = Env::new();
    let sandbox = Sandbox::new(env.sh_config(WRITE)).await.unwrap();
    let ws = env.workspace_of("#open");
    std::fs::create_dir(&ws).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o755)).unwrap();
    let outcome = sandbox.run_turn(request("#open", "hi")).await;
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
    let outcome = sandbox.run_turn(request("#open", "hi")).await;
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
    let outcome = sandbox.run_turn(request("#swap", "hi")).await;
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
    let real = held.join(roundtable_sandbox::internals::turn::channel_segment(
        "#swap",
    ));
    assert!(real.is_dir());
    assert!(!real.join("guest-file").exists());
    assert_no_leftovers(&sandbox).await;
}

/// Runs `script` as root in a throwaway container of the guest image with `dir` at `/w`
/// (the test runs as the service user: root's hand here is the engine's). No network,
/// removed when done, labelled so a sweep of this test's leftovers can find it.
fn as_root_in(dir: &std::path::Path, script: &str) -> String {
    let out = std::process::Command::new("docker")
        .args([
            "run",
            "--rm",
            "--network",
            "none",
            "--label",
            "roundtable-sandbox.test=host_dirs",
            "--user",
            "0:0",
            "--entrypoint",
            "/bin/sh",
            "-v",
        ])
        .arg(format!("{}:/w", dir.display()))
        .args([&image(), "-c", script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// An existing channel directory owned by another user (`nobody`, made by root before the
/// runtime starts, with a planted file) is refused with a clear error, whatever its mode:
/// no container mounts it, no guest reads the planted file, nothing in it is written or
/// changed (its owner, mode, times and file stay as they were).
#[tokio::test(flavor = "multi_thread")]
async fn an_existing_channel_dir_of_another_user_is_refused() {
    use std::os::unix::fs::MetadataExt;
    const READ: &str = r#"cat >/dev/null; notes=$(cat /workspace/notes 2>&1); echo x > /workspace/guest-file; printf '{"ok":true,"text":"%s"}' "$notes""#;
    let env = Env::new();
    std::fs::create_dir(&env.workspace_root).unwrap();
    std::fs::set_permissions(&env.workspace_root, std::fs::Permissions::from_mode(0o700)).unwrap();
    let uid = nix::unistd::getuid().as_raw();
    // The test's temp dir is the service user's to remove: root takes back what it made,
    // the test failing or not.
    struct TakeBack<'a>(&'a std::path::Path);
    impl Drop for TakeBack<'_> {
        fn drop(&mut self) {
            as_root_in(self.0, "rm -rf /w/*");
        }
    }
    let _take_back = TakeBack(&env.workspace_root);
    for (channel, mode) in [("#nobody-open", "755"), ("#nobody-private", "700")] {
        let ws = env.workspace_of(channel);
        let seg = ws.file_name().unwrap().to_str().unwrap().to_owned();
        as_root_in(
            &env.workspace_root,
            &format!(
                "mkdir /w/{seg} && echo planted-by-nobody > /w/{seg}/notes && chown -R 65534:65534 /w/{seg} && chmod {mode} /w/{seg} && chmod 644 /w/{seg}/notes"
            ),
        );
    }
    let before: Vec<_> = ["#nobody-open", "#nobody-private"]
        .iter()
        .map(|c| std::fs::symlink_metadata(env.workspace_of(c)).unwrap())
        .collect();
    let sandbox = Sandbox::new(env.sh_config(READ)).await.unwrap();
    for ((channel, mode), was) in [("#nobody-open", 0o755), ("#nobody-private", 0o700)]
        .into_iter()
        .zip(&before)
    {
        let ws = env.workspace_of(channel);
        let outcome = sandbox.run_turn(request(channel, "hi")).await;
        assert_eq!(
            outcome.reply.error.as_deref(),
            Some(
                format!(
                    "workspace {} must be a directory of the service user (uid {uid}) with no group or other permission bits: found uid 65534, mode {mode:o}",
                    ws.display()
                )
                .as_str()
            ),
            "{outcome:?}"
        );
        assert_eq!(outcome.failure, Some(TurnFailure::Internal));
        assert_eq!(outcome.reply.text, None, "no guest ran: {outcome:?}");
        let now = std::fs::symlink_metadata(&ws).unwrap();
        assert_eq!(
            (
                now.uid(),
                now.mode(),
                now.mtime(),
                now.mtime_nsec(),
                now.ctime(),
                now.ctime_nsec()
            ),
            (
                was.uid(),
                was.mode(),
                was.mtime(),
                was.mtime_nsec(),
                was.ctime(),
                was.ctime_nsec()
            ),
            "{channel}: the dir was changed"
        );
    }
    // Root's view: only the planted file, as it was.
    let seen = as_root_in(
        &env.workspace_root,
        "for d in /w/*; do ls -A \"$d\"; cat \"$d/notes\"; stat -c '%u %a' \"$d/notes\"; done",
    );
    assert_eq!(
        seen,
        "notes\nplanted-by-nobody\n65534 644\nnotes\nplanted-by-nobody\n65534 644\n"
    );
    assert_no_leftovers(&sandbox).await;
}
