//! The reply is known the moment the guest writes it: stdout's first line, when it is a
//! whole valid reply (its frame, `Reply::frame`), is the turn's answer at once; the
//! container's exit, kill and removal come after, in the teardown. Each hostile output
//! below has one answer (docs/design.md, "The reply's frame"), checked with the real
//! container on the cold path and in a prepared container, and nothing is left behind
//! (containers by label, run dirs).

use roundtable_sandbox::internals::testing::DockerDriverExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::{ApiKey, Config, Reply, Sandbox};
use roundtable_sandbox_test_support::hostile;
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use tokio_util::sync::CancellationToken;

/// The turn's deadline in these tests: what a guest that never exits would cost if its
/// reply were not taken at its frame (the hang cases fail with this timeout then).
const DEADLINE: Duration = Duration::from_secs(30);

/// Runs one turn of `script` (busybox sh in the hostile image, under the guest's layer)
/// cold, then one in a container prepared for it; checks that nothing is left after each
/// and that both answered the same; returns the answer.
async fn answer(env: &Env, script: &str, tune: impl Fn(&mut Config)) -> Reply {
    let mut config = hostile::sh_config(env, &format!("cat >/dev/null; {script}"));
    config.turn_timeout = Some(DEADLINE);
    tune(&mut config);
    let sandbox = Sandbox::new(config).await.unwrap();
    let cold = sandbox.run_turn(request("#frame", "x")).await.reply;
    assert_no_leftovers(&sandbox).await;
    let prepared = sandbox
        .prepare_turn("#frame", CancellationToken::new())
        .await
        .unwrap()
        .expect("warm turns are on by default");
    let warm = sandbox
        .run(
            sandbox.admit(request("#frame", "x")),
            Some(prepared),
            |_| {},
        )
        .await;
    assert_no_leftovers(&sandbox).await;
    assert_eq!(
        cold, warm.reply,
        "{script}: cold and warm answered differently"
    );
    cold
}

fn text(reply: &Reply) -> &str {
    reply
        .text
        .as_deref()
        .unwrap_or_else(|| panic!("no reply text: {reply:?}"))
}

fn error(reply: &Reply) -> &str {
    assert!(!reply.ok, "{reply:?}");
    reply.error.as_deref().unwrap_or_default()
}

const REPLY: &str = r#"echo '{"ok":true,"text":"answered"}'"#;

/// After a valid reply, nothing the container does changes the answer or delays it: the
/// guest hangs (ignoring signals), fork-bombs, exits non-zero, has a child killed for
/// memory; each would be a timeout (the hangs) or its own error (the exits) if the turn
/// waited for the exit.
#[tokio::test(flavor = "multi_thread")]
async fn after_a_reply_the_container_changes_nothing() {
    let env = Env::new();
    let cases = [
        "trap '' TERM INT HUP; while :; do :; done",
        "setsid sleep 1000 & sleep 1000",
        "b() { b | b & }; b; sleep 1000",
        "exit 7",
        "kill -9 $$",
        // The subshell takes the memory (the OOM killer's pick), then the guest hangs.
        "(x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}); sleep 1000",
    ];
    for then in cases {
        let reply = answer(&env, &format!("{REPLY}; {then}"), |c| {
            c.limits.memory_mb = 64;
            c.limits.pids = 32;
        })
        .await;
        assert_eq!(text(&reply), "answered", "{then}: {reply:?}");
    }
}

/// A reply then a flood: on stdout (far past the output cap, which counts only up to the
/// frame) or on stderr, forever; the reply stands.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_then_a_flood_stands() {
    let env = Env::new();
    for then in ["yes", "yes >&2", "yes >&2 & yes"] {
        let reply = answer(&env, &format!("{REPLY}; {then}"), |c| {
            c.limits.output_kb = 4
        })
        .await;
        assert_eq!(text(&reply), "answered", "{then}: {reply:?}");
    }
    // In the same write as the reply.
    let reply = answer(
        &env,
        r#"{ echo '{"ok":true,"text":"answered"}'; head -c 100000 /dev/zero; } | cat; sleep 1000"#,
        |c| c.limits.output_kb = 4,
    )
    .await;
    assert_eq!(text(&reply), "answered", "{reply:?}");
}

/// Two replies: the first is the answer.
#[tokio::test(flavor = "multi_thread")]
async fn of_two_replies_the_first_is_the_answer() {
    let env = Env::new();
    let reply = answer(
        &env,
        r#"echo '{"ok":true,"text":"first"}'; echo '{"ok":false,"error":"second"}'; sleep 1000"#,
        |_| {},
    )
    .await;
    assert_eq!(text(&reply), "first");
}

/// A reply written in pieces (separate writes, so separate attach frames), then a hang:
/// it is known when its newline arrives.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_split_across_many_writes_is_known_at_its_newline() {
    let env = Env::new();
    let script = r#"for p in '{"o' 'k":tr' 'ue,"te' 'xt":"sp' 'lit"' '}'; do printf '%s' "$p"; sleep 0.05; done; printf '\n'; sleep 1000"#;
    let reply = answer(&env, script, |_| {}).await;
    assert_eq!(text(&reply), "split", "{reply:?}");
    // Blank lines before it are not its first line.
    let reply = answer(
        &env,
        r#"printf '\n  \n'; sleep 0.05; echo '{"ok":true,"text":"late"}'; sleep 1000"#,
        |_| {},
    )
    .await;
    assert_eq!(text(&reply), "late", "{reply:?}");
}

/// Garbage before a reply: stdout's first line is not a reply, so there is no frame; the
/// run is judged at its end as before (all of stdout as one document: malformed). A guest
/// that then hangs is ended by the deadline, never later.
#[tokio::test(flavor = "multi_thread")]
async fn garbage_before_a_reply_is_malformed_output() {
    let env = Env::new();
    let reply = answer(
        &env,
        r#"echo 'HOST: all is fine'; echo '{"ok":true,"text":"late"}'"#,
        |_| {},
    )
    .await;
    assert_eq!(
        error(&reply),
        "guest output is not a valid reply: expected value at line 1 column 1"
    );
    // On the reply's own line.
    let reply = answer(&env, r#"echo 'x{"ok":true,"text":"late"}'"#, |_| {}).await;
    assert_eq!(
        error(&reply),
        "guest output is not a valid reply: expected value at line 1 column 1"
    );
    let reply = answer(
        &env,
        r#"echo garbage; echo '{"ok":true,"text":"late"}'; sleep 1000"#,
        |c| c.turn_timeout = Some(Duration::from_secs(3)),
    )
    .await;
    assert_eq!(error(&reply), "turn timed out after 3s");
}

/// A partial frame then the exit: judged at the exit, as before (the exit's failure, else
/// malformed output); a whole reply with no newline is still the old contract's reply.
#[tokio::test(flavor = "multi_thread")]
async fn a_partial_frame_then_exit_is_judged_at_the_exit() {
    let env = Env::new();
    let reply = answer(&env, r#"printf '{"ok":tr'"#, |_| {}).await;
    assert_eq!(
        error(&reply),
        "guest output is not a valid reply: EOF while parsing a value at line 1 column 8"
    );
    let reply = answer(&env, r#"printf '{"ok":tr'; exit 3"#, |_| {}).await;
    assert_eq!(error(&reply), "guest exited with code 3");
    let reply = answer(&env, r#"printf '{"ok":true,"text":"old"}'"#, |_| {}).await;
    assert_eq!(text(&reply), "old");
}

/// A reply whose line passes the output cap is the cap's error (the container is killed
/// at the cap, as before).
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_past_the_output_cap_is_the_caps_error() {
    let env = Env::new();
    let reply = answer(
        &env,
        r#"printf '{"ok":true,"text":"'; head -c 5000 /dev/zero | tr '\0' a; echo '"}'; sleep 1000"#,
        |c| c.limits.output_kb = 4,
    )
    .await;
    assert_eq!(error(&reply), "guest output exceeds 4096 bytes");
}

/// The real guest saves the session before it prints its reply: at the reply (the
/// callback runs before the teardown, which kills and removes the container right after,
/// without waiting for its exit) the session file already holds the turn, and the
/// channel's next turn sees it.
#[tokio::test(flavor = "multi_thread")]
async fn the_next_turn_sees_the_session_of_a_turn_killed_right_after_its_reply() {
    let env = Env::new();
    let model = ScriptedModel::start(vec![Step::text("noted: the otter")]).await;
    let mut config = env.config();
    config.model_url = model.url();
    config.allow_http = true;
    config.api_key = ApiKey::from_static("sk-frame-never-inside");
    config.turn_timeout = Some(Duration::from_secs(60));
    let sandbox = Sandbox::new(config).await.unwrap();
    let session = env.workspace_of("#saved").join(".roundtable/session.json");
    let at_reply = Arc::new(Mutex::new(None));
    let seen = at_reply.clone();
    let (path, sb) = (session.clone(), sandbox.clone());
    let turn = sandbox.admit(request("#saved", "remember the otter"));
    let outcome = sandbox
        .run(turn, None, move |o| {
            let saved = std::fs::read_to_string(&path).unwrap_or_default();
            *seen.lock().unwrap() = Some((o.reply.clone(), saved, sb.config().instance.clone()));
        })
        .await;
    assert_eq!(outcome.reply.text.as_deref(), Some("noted: the otter"));
    let (reply, saved, _) = at_reply.lock().unwrap().take().unwrap();
    assert_eq!(reply, outcome.reply);
    assert!(
        saved.contains("remember the otter") && saved.contains("noted: the otter"),
        "the session at the reply: {saved:?}"
    );
    assert_no_leftovers(&sandbox).await;

    model.push(Step::text("you said: the otter"));
    let reply = sandbox
        .run_turn(request("#saved", "what did I say?"))
        .await
        .reply;
    assert_eq!(
        reply.text.as_deref(),
        Some("you said: the otter"),
        "{reply:?}"
    );
    let second = model.requests()[1].json().to_string();
    assert!(second.contains("remember the otter"), "{second}");
    assert_no_leftovers(&sandbox).await;
}

/// A guest that exits on its own just after its reply (the real guest's way: its last act
/// is the reply) is not killed: the teardown gives it a moment (the driver's
/// `EXIT_GRACE`, 250 ms: the engine reported a bare container's exit 57–119 ms after
/// its output at load 10–34) before the engine's forced removal, which costs more than the
/// removal of an exited container (bench part 1: teardown 69–71 ms with the kill, 52 ms
/// without). The engine's own events tell: no `kill` of this runtime's containers, cold
/// or warm.
#[tokio::test(flavor = "multi_thread")]
async fn a_guest_that_exits_just_after_its_reply_is_not_killed() {
    use futures_util::StreamExt as _;
    let env = Env::new();
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 1;
    let reply = answer(&env, REPLY, |_| {}).await;
    assert_eq!(text(&reply), "answered");
    let instance = env.instance().await;
    let until = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 1;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let driver = roundtable_sandbox::DockerDriver::default();
    let docker = driver.client().await.unwrap();
    let filters = std::collections::HashMap::from([
        ("type".to_owned(), vec!["container".to_owned()]),
        (
            "label".to_owned(),
            vec![format!(
                "{}={instance}",
                roundtable_sandbox::driver::LABEL_RUNTIME
            )],
        ),
    ]);
    let events: Vec<String> = docker
        .events(Some(bollard::query_parameters::EventsOptions {
            since: Some(since.to_string()),
            until: Some(until.to_string()),
            filters: Some(filters),
        }))
        .filter_map(|e| async move { e.ok().and_then(|e| e.action) })
        .collect()
        .await;
    assert_eq!(
        events.iter().filter(|a| a.as_str() == "destroy").count(),
        2,
        "a cold and a warm container: {events:?}"
    );
    assert!(!events.iter().any(|a| a == "kill"), "{events:?}");
}
