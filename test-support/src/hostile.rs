//! Support for the security suite: the hostile image (scripts/build-hostile-image.sh, its
//! program in `tests/support/hostile_guest.rs`), configs that run it, and the parsing of
//! its findings.
//!
//! ```ignore
//! use roundtable_sandbox_test_support::hostile;
//! let config = hostile::config(&env, &["identity"]);
//! let findings = hostile::findings(&reply); // name -> result
//! ```

use std::collections::BTreeMap;

use std::sync::{Arc, Mutex};

use roundtable_sandbox::{Config, Reply, Speaker};

use roundtable_sandbox::internals::testing::{Env, FnTool};

/// The hostile image the test script builds.
pub fn image() -> String {
    std::env::var("ROUNDTABLE_HOSTILE_IMAGE")
        .unwrap_or_else(|_| "roundtable-sandbox-hostile:latest".into())
}

/// The real guest's launcher in the hostile image: `/roundtable-guest --exec PROGRAM …`
/// installs the guest's seccomp layer, then execs PROGRAM. In production every process of
/// a turn descends from the guest, so every attack runs under the same layer.
pub const UNDER_THE_GUEST: [&str; 2] = ["/roundtable-guest", "--exec"];

/// `command` run as the real guest would run it: under its seccomp layer.
pub fn under_the_guest(command: &[&str]) -> Vec<String> {
    UNDER_THE_GUEST
        .iter()
        .chain(command)
        .map(|s| s.to_string())
        .collect()
}

/// A config running the hostile program with `args`, under the guest's layer.
pub fn config(env: &Env, args: &[&str]) -> Config {
    let mut c = env.config();
    c.image = image();
    let mut command = vec!["/roundtable-hostile"];
    command.extend_from_slice(args);
    c.command = Some(under_the_guest(&command));
    c
}

/// A config running `sh -c script` in the hostile image (busybox, the setuid bait), under
/// the guest's layer.
pub fn sh_config(env: &Env, script: &str) -> Config {
    let mut c = env.config();
    c.image = image();
    c.command = Some(under_the_guest(&["/bin/sh", "-c", script]));
    c
}

/// The `name=result` findings of a hostile reply (entries separated by `;`).
pub fn findings(reply: &Reply) -> BTreeMap<String, String> {
    let text = reply
        .text
        .as_deref()
        .unwrap_or_else(|| panic!("the hostile guest did not reply: {reply:?}"));
    text.split(';')
        .filter_map(|e| e.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// What a [`whoami`] tool was called with: the channel, the speaker and the arguments of
/// each call.
pub type Calls = Arc<Mutex<Vec<(String, Speaker, serde_json::Value)>>>;

/// A host tool that answers with the channel and speaker it was called for, and the record
/// of every call (its arguments included).
pub fn whoami() -> (Arc<FnTool>, Calls) {
    let calls = Calls::default();
    let record = calls.clone();
    let tool = FnTool::new("whoami", "Tells who is asking", move |args, ctx| {
        let record = record.clone();
        async move {
            let answer = format!(
                "channel {} speaker {} {}",
                ctx.channel, ctx.speaker.id, ctx.speaker.name
            );
            record
                .lock()
                .unwrap()
                .push((ctx.channel, ctx.speaker, args));
            Ok(answer)
        }
    });
    (Arc::new(tool), calls)
}
