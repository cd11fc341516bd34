//! The Matrix bot end to end: a real Synapse homeserver (from PyPI, `scripts/synapse-venv.sh`)
//! on loopback with SQLite, users registered with its shared secret, the bot as a normal
//! user, and the actor layer, the broker, the embedded offline model and the guest in
//! sealed containers. Runs as the service user.

#[path = "../../examples/tests/common/mod.rs"]
mod common;
#[path = "common/synapse.rs"]
mod synapse;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{floor_config, floor_config_with, scratch};
use serde_json::{json, Value};
use synapse::{wait_until_or, Proc, Synapse, User};

/// The bot's stderr lines, each with the moment the test read it.
type Said = std::sync::Arc<std::sync::Mutex<Vec<(Instant, String)>>>;

const BOT_PASSWORD: &str = "bot-password-not-a-flag";

struct Bot {
    proc: Proc,
    said: Said,
    echo: Option<std::thread::JoinHandle<()>>,
}

/// A bot left running by a failed test is stopped as a bot is (SIGTERM: it shuts its
/// runtime down, removing its containers) before it is killed: a failed test leaves no
/// container either.
impl Drop for Bot {
    fn drop(&mut self) {
        if !matches!(self.proc.0.try_wait(), Ok(None)) {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.proc.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && matches!(self.proc.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A private file holding `text` (the service user's, 0600).
fn private_file(path: &Path, text: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.to_owned()
}

/// Starts the bot as `@bot:localhost` (password from a file, session in `d/session.json`);
/// returns it once its first sync is read.
fn start_bot(d: &Path, hs: &Synapse, extra: &[&str]) -> Bot {
    start_bot_configured(d, hs, &floor_config(d), extra)
}

/// [`start_bot`] with the sandbox's config file `config`.
/// Logs in with the password from a file, unless `extra` gives an access token file.
fn start_bot_configured(d: &Path, hs: &Synapse, config: &Path, extra: &[&str]) -> Bot {
    let mut login = Vec::new();
    if !extra.contains(&"--access-token-file") {
        let password = private_file(&d.join("bot-password"), &format!("{BOT_PASSWORD}\n"));
        login.push("--password-file".into());
        login.push(password.into_os_string());
    }
    let mut bot = Command::new(env!("CARGO_BIN_EXE_matrix-bot"))
        .args(["--homeserver", &hs.url, "--user", "@bot:localhost"])
        .args(login)
        .arg("--session-file")
        .arg(d.join("session.json"))
        .arg("--run-root")
        .arg(d.join("run"))
        .arg("--workspace-root")
        .arg(d.join("ws"))
        .arg("--offline")
        .arg("--config")
        .arg(config)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = bot.stderr.take().unwrap();
    let said = Said::default();
    let echo = std::thread::spawn({
        let said = said.clone();
        move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("bot: {line}");
                said.lock().unwrap().push((Instant::now(), line));
            }
        }
    });
    let bot = Bot {
        proc: Proc(bot),
        said,
        echo: Some(echo),
    };
    bot.wait_for("first sync done", 0);
    bot
}

impl Bot {
    fn lines(&self) -> Vec<String> {
        self.said
            .lock()
            .unwrap()
            .iter()
            .map(|(_, l)| l.clone())
            .collect()
    }

    fn len(&self) -> usize {
        self.said.lock().unwrap().len()
    }

    /// Waits for a line containing `needle` past the first `skip`; its index and when.
    fn wait_for(&self, needle: &str, skip: usize) -> (usize, Instant) {
        let mut found = None;
        wait_until_or(
            &format!("the bot to say {needle:?}"),
            || {
                found = self
                    .said
                    .lock()
                    .unwrap()
                    .iter()
                    .enumerate()
                    .skip(skip)
                    .find(|(_, (_, l))| l.contains(needle))
                    .map(|(i, (at, _))| (i, *at));
                found.is_some()
            },
            || format!("it said {:?}", self.lines()),
        );
        found.unwrap()
    }

    /// Stops the bot with SIGTERM: it shuts its runtime down and exits 0, leaving no
    /// container or turn dir.
    fn stop(mut self, d: &Path) -> Vec<String> {
        let pid = nix::unistd::Pid::from_raw(self.proc.0.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = self.proc.0.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "the bot did not exit on SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(echo) = self.echo.take() {
            echo.join().unwrap();
        }
        let said = self.lines();
        assert!(status.success(), "the bot exited with {status}: {said:?}");
        assert!(
            said.iter().any(|l| l.starts_with("matrix-bot: shut down")),
            "{said:?}"
        );
        assert_eq!(containers_of(d), Vec::<String>::new(), "containers left");
        let run: Vec<String> = std::fs::read_dir(d.join("run"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("turn-"))
            .collect();
        assert_eq!(run, Vec::<String>::new(), "turn dirs left");
        said
    }
}

/// The containers (any state) of the bot's own runtime (by its instance label).
fn containers_of(dir: &Path) -> Vec<String> {
    let label = format!("label=roundtable-sandbox={}", common::instance_of(dir));
    let ids = Command::new("docker")
        .args(["ps", "-aq", "--filter", &label])
        .output()
        .unwrap();
    assert!(ids.status.success(), "docker ps: {ids:?}");
    String::from_utf8_lossy(&ids.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

const BOT: &str = "@bot:localhost";

/// Whether a file named `name` is anywhere under `dir` (the workspaces).
fn holds_file(dir: &Path, name: &str) -> bool {
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_name() == name {
                return true;
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    false
}

/// The bot's events in `room` as `user` sees them.
fn bot_events(hs: &Synapse, user: &User, room: &str) -> Vec<Value> {
    hs.messages(user, room)
        .into_iter()
        .filter(|e| e["sender"] == BOT && e["type"] == "m.room.message")
        .collect()
}

/// The id of the event an event answers.
fn answers(e: &Value) -> Option<&str> {
    e["content"]["m.relates_to"]["m.in_reply_to"]["event_id"].as_str()
}

/// Waits for the bot's answer to `question` in `room` as `user` sees it (its first event).
fn answer_to(hs: &Synapse, user: &User, room: &str, question: &str) -> Value {
    let mut found = None;
    wait_until_or(
        &format!("the bot's answer to {question}"),
        || {
            found = bot_events(hs, user, room)
                .into_iter()
                .find(|e| answers(e) == Some(question));
            found.is_some()
        },
        || format!("{:#?}", hs.messages(user, room)),
    );
    found.unwrap()
}

fn body(e: &Value) -> &str {
    e["content"]["body"].as_str().unwrap_or_default()
}

/// Asks `question` as `user` and returns the answer's body, checking it is a reply (m.text)
/// that mentions the asker.
fn ask(hs: &Synapse, user: &User, room: &str, question: &str) -> (String, String) {
    let id = hs.say(user, room, question);
    let answer = answer_to(hs, user, room, &id);
    assert_eq!(answer["content"]["msgtype"], "m.text", "{answer}");
    assert_eq!(
        answer["content"]["m.mentions"]["user_ids"],
        json!([user.id]),
        "{answer}"
    );
    (id, body(&answer).to_owned())
}

/// Sends a command as `user` and returns the bot's notice in answer.
fn command(hs: &Synapse, user: &User, room: &str, text: &str) -> String {
    let id = hs.say(user, room, text);
    let answer = answer_to(hs, user, room, &id);
    assert_eq!(answer["content"]["msgtype"], "m.notice", "{answer}");
    body(&answer).to_owned()
}

/// Waits until the bot is joined to `room` (as `user` sees it).
fn wait_joined(hs: &Synapse, user: &User, room: &str) {
    wait_until_or(
        "the bot to join",
        || hs.membership(user, room, BOT) == "join",
        String::new,
    );
}

/// Issue 46: two users in two rooms, each answered as a reply; `!reset` gives a fresh
/// session, `!stop` is for moderators, `!status` tells the room's turn; a reply carrying
/// HTML, Markdown links and control characters reaches the other user sanitized; edits and
/// the bot's own events are never answered; an encrypted room is told once and not served;
/// a restart keeps the device and each room's session and answers no old message (nor one
/// sent while it was down); an invite from a server not on the allow-list is refused; a
/// room the bot is kicked from is left for good; no container is left.
#[test]
fn two_rooms_reset_sanitized_replies_restart_invites_and_kicks() {
    let dir = scratch("rtm-");
    let d = dir.path();
    // A generous message limit for everyone (the bot is a normal user: no override).
    let hs = synapse::start(d, (50.0, 200));
    let admin = hs.register("admin", "admin-pass", true);
    hs.register("bot", BOT_PASSWORD, false);
    let alice = hs.register("alice", "alice-pass", false);
    let bob = hs.register("bob", "bob-pass", false);
    let carol = hs.register("carol", "carol-pass", false);
    // The prefix is the start of every offline-model reply: without the check that the bot
    // ignores its own events, it would answer its own replies for ever.
    let bot = start_bot(d, &hs, &["--prefix", "[offline demo model]"]);
    // Its devices: the registration's and the bot's own login.
    let first_device = hs.devices(&admin, BOT);
    assert_eq!(first_device.len(), 2);
    let logged_in = bot
        .lines()
        .iter()
        .find_map(|l| {
            l.split("(device ")
                .nth(1)?
                .split(')')
                .next()
                .map(str::to_owned)
        })
        .unwrap();
    assert!(first_device.contains(&logged_in), "{first_device:?}");

    let room_a = hs.create_room(&alice, &[BOT, &bob.id], false);
    hs.join(&bob, &room_a);
    let room_b = hs.create_room(&bob, &[BOT], false);
    wait_joined(&hs, &alice, &room_a);
    wait_joined(&hs, &bob, &room_b);

    // A turn in each room, each answered as a reply to its question.
    let (_, a1) = ask(&hs, &alice, &room_a, "bot: hello there");
    assert!(a1.contains("read it back (alice: hello there)"), "{a1}");
    assert!(a1.contains("holds 0 earlier message(s)"), "{a1}");
    assert!(a1.contains("roll_dice answered: alice rolled a d"), "{a1}");
    // Bob mentions the bot (m.mentions), as a client does for a pill.
    let q = hs.send(
        &bob,
        &room_b,
        json!({"msgtype": "m.text", "body": "Bot, what about me?", "m.mentions": {"user_ids": [BOT]}}),
    );
    let b1 = body(&answer_to(&hs, &bob, &room_b, &q)).to_owned();
    assert!(b1.contains("read it back (bob: what about me?)"), "{b1}");
    assert!(b1.contains("holds 0 earlier message(s)"), "{b1}");
    let (_, a2) = ask(&hs, &alice, &room_a, "bot: and again");
    assert!(a2.contains("holds 1 earlier message(s)"), "{a2}");

    // The room's turn: reset by anyone, stop by moderators, status.
    let n = command(&hs, &alice, &room_a, "!reset");
    assert_eq!(
        n,
        "reset: the next turn in this room starts a fresh session"
    );
    let n = command(&hs, &bob, &room_a, "!status");
    assert_eq!(
        n,
        "status: no turn is running, 0 message(s) queued; the next turn starts a fresh session"
    );
    let n = command(&hs, &bob, &room_a, "!stop");
    assert_eq!(
        n,
        "stop: only members with power level 50 or more (moderators) may stop a turn"
    );
    let n = command(&hs, &alice, &room_a, "!stop");
    assert_eq!(n, "stop: nothing was running");
    let (_, a3) = ask(&hs, &alice, &room_a, "bot: after the reset");
    assert!(a3.contains("holds 0 earlier message(s)"), "{a3}");
    // Room B's session was not reset.
    let (_, b2) = ask(&hs, &bob, &room_b, "bot: still here");
    assert!(b2.contains("holds 1 earlier message(s)"), "{b2}");

    // A reply carrying HTML, Markdown links, an image and control characters (OSC 52 to the
    // clipboard, BEL, a bidi override, CR LF, C1 CSI), as Bob receives it.
    let hostile = r"bot: run: printf 'bob, @bob:localhost, @room: <b>bold</b> <script>alert(1)</script> [click](javascript:alert(1)) [docs](https://evil.example/x) ![img](https://evil.example/i.png) <a href=https://evil.example/y>y</a>\n\033]52;c;aGk=\007 \342\200\256evil\r\nnext\302\233\n\n```js\nalert(2)\n```\n\n| a | b |\n|:-:|--:|\n| c | d |\n'";
    let q = hs.say(&alice, &room_a, hostile);
    let seen = answer_to(&hs, &bob, &room_a, &q);
    // The model named Bob (his display name and his user id) and the room: nobody but the
    // asker is pinged (the bot's events carry `m.mentions`, so the body's names are not
    // looked for). Alice, whom the answer mentions, is.
    let highlighted = |user: &User| -> Vec<Value> {
        hs.call(
            "GET",
            "/_matrix/client/v3/notifications?only=highlight&limit=100",
            Some(&user.token),
            None,
        )["notifications"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n["event"]["event_id"] == seen["event_id"])
            .collect()
    };
    assert!(seen["content"]["body"]
        .as_str()
        .unwrap()
        .contains("bob, @bob:localhost, @room"));
    assert_eq!(highlighted(&bob), Vec::<Value>::new());
    assert_eq!(highlighted(&alice).len(), 1);
    let c = &seen["content"];
    let (plain, html) = (
        c["body"].as_str().unwrap(),
        c["formatted_body"].as_str().unwrap(),
    );
    assert_eq!(c["format"], "org.matrix.custom.html");
    for s in [plain, html] {
        assert!(
            !s.chars()
                .any(|ch| ch != '\n' && roundtable_sandbox::display::is_escaped(ch)),
            "a control character reached the client: {s:?}"
        );
    }
    assert!(plain.contains(r"\u{1b}]52;c;aGk=\u{7}"), "{plain}");
    // CR LF is a line break; the rest is shown.
    assert!(plain.contains("\\u{202e}evil\nnext\\u{9b}"), "{plain}");
    // The model's HTML is text; links show their address; only http(s) links.
    assert!(html.contains("&lt;b&gt;bold&lt;/b&gt;"), "{html}");
    assert!(
        html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{html}"
    );
    assert!(html.contains("click (javascript:alert(1))"), "{html}");
    assert!(
        html.contains("docs (<a href=\"https://evil.example/x\">https://evil.example/x</a>)"),
        "{html}"
    );
    assert!(
        html.contains("img (<a href=\"https://evil.example/i.png\">"),
        "{html}"
    );
    assert!(
        html.contains("&lt;a href=https://evil.example/y&gt;y&lt;/a&gt;"),
        "{html}"
    );
    assert!(html.contains(r"\u{1b}]52;c;aGk=\u{7}"), "{html}");
    // Markdown's own markup passes the sanitizer's list: the code block and the table stay,
    // their class and style attributes do not.
    assert!(
        html.contains("<pre><code>alert(2)\n</code></pre>"),
        "{html}"
    );
    assert!(html.contains("<th>a</th>"), "{html}");
    let lower = html.to_lowercase();
    for bad in [
        "<script",
        "<img",
        "javascript:alert(1)\"",
        "<b>",
        "onerror",
        "href=\"javascript",
        "class=",
        "style=",
    ] {
        assert!(!lower.contains(bad), "{bad} in {html}");
    }

    // An encrypted room: told once, not served. An edit of a question and the encrypted
    // room's question start no turn (the bot logs each turn it starts).
    let room_e = hs.create_room(&alice, &[BOT], true);
    wait_joined(&hs, &alice, &room_e);
    wait_until_or(
        "the encrypted room's notice",
        || !bot_events(&hs, &alice, &room_e).is_empty(),
        String::new,
    );
    let told = bot_events(&hs, &alice, &room_e);
    assert_eq!(told.len(), 1, "{told:#?}");
    assert_eq!(told[0]["content"]["msgtype"], "m.notice");
    assert!(
        body(&told[0]).starts_with("This bot does not serve end-to-end-encrypted rooms"),
        "{told:#?}"
    );
    let before = bot.len();
    hs.say(&alice, &room_e, "bot: are you there?");
    hs.send(
        &alice,
        &room_a,
        json!({
            "msgtype": "m.text", "body": "* bot: an edited question",
            "m.mentions": {"user_ids": [BOT]},
            "m.new_content": {"msgtype": "m.text", "body": "bot: an edited question"},
            "m.relates_to": {"rel_type": "m.replace", "event_id": q}
        }),
    );
    // Anything sent after them is read after them: once its turn started, theirs would have.
    let (_, b3) = ask(&hs, &bob, &room_b, "bot: a barrier");
    assert!(b3.contains("holds 2 earlier message(s)"), "{b3}");
    let turns: Vec<String> = bot.lines()[before..]
        .iter()
        .filter(|l| l.contains(": a turn for "))
        .cloned()
        .collect();
    assert_eq!(turns.len(), 1, "{turns:?}");
    assert!(turns[0].contains(&room_b), "{turns:?}");
    // The bot never answered itself (its replies start with its prefix).
    assert!(!bot
        .lines()
        .iter()
        .any(|l| l.contains("a turn for @bot:localhost")));

    // Restart: stopped, a message sent while it is down, started again with another
    // allow-list. Its device is kept; no old message is answered.
    let said = bot.stop(d);
    assert!(!said.iter().any(|l| l.contains("a turn for @bot:localhost")));
    let away = hs.say(&alice, &room_a, "bot: while you were away");
    let before_restart: Vec<usize> = [&room_a, &room_b, &room_e]
        .iter()
        .map(|r| bot_events(&hs, &alice_or_bob(&alice, &bob, r, &room_b), r).len())
        .collect();
    let bot = start_bot(d, &hs, &["--invite-from", "other.test,@carol:localhost"]);
    assert!(
        bot.lines()
            .iter()
            .any(|l| l.contains("restored the session of @bot:localhost")),
        "{:?}",
        bot.lines()
    );
    // No new device: the same login, restored.
    assert_eq!(hs.devices(&admin, BOT), first_device);
    assert!(bot
        .lines()
        .iter()
        .any(|l| l.contains(&format!("(device {logged_in})"))));
    let (q_a, a4) = ask(&hs, &alice, &room_a, "bot: after the restart");
    // Room A's session went on (hello, sanitize: 0 and 1 after the reset; this is the third).
    assert!(a4.contains("holds 2 earlier message(s)"), "{a4}");
    let (q_b, b4) = ask(&hs, &bob, &room_b, "bot: after the restart too");
    assert!(b4.contains("holds 3 earlier message(s)"), "{b4}");
    let rooms = [&room_a, &room_b, &room_e];
    for (i, room) in rooms.iter().enumerate() {
        let viewer = alice_or_bob(&alice, &bob, room, &room_b);
        let after: Vec<Value> = bot_events(&hs, &viewer, room)
            .into_iter()
            .skip(before_restart[i])
            .collect();
        let answered: Vec<&str> = after.iter().filter_map(answers).collect();
        let expected: Vec<&str> = match i {
            0 => vec![q_a.as_str()],
            1 => vec![q_b.as_str()],
            _ => vec![],
        };
        assert_eq!(answered, expected, "{after:#?}");
    }
    assert!(!bot
        .lines()
        .iter()
        .any(|l| l.contains(": a turn for ") && l.contains(&room_e)));
    let _ = away;

    // Invites: from a server not on the allow-list (localhost, now that it is other.test and
    // carol) refused; from carol, taken.
    let room_f = hs.create_room(&alice, &[BOT], false);
    bot.wait_for(
        &format!("{room_f}: refused an invite from @alice:localhost (not on --invite-from)"),
        0,
    );
    wait_until_or(
        "the invite to be declined",
        || hs.membership(&alice, &room_f, BOT) == "leave",
        String::new,
    );
    // Carol's room has history before the bot is invited: the join's sync carries it, and
    // it is not answered (it is after the bot's start: only the join's place in the
    // timeline tells).
    let room_g = hs.create_room(&carol, &[], false);
    let history = hs.say(&carol, &room_g, "bot: said before you came");
    hs.invite(&carol, &room_g, BOT);
    wait_joined(&hs, &carol, &room_g);
    let (q_g, g1) = ask(&hs, &carol, &room_g, "bot: hi from carol");
    assert!(g1.contains("read it back (carol: hi from carol)"), "{g1}");
    assert!(g1.contains("holds 0 earlier message(s)"), "{g1}");
    let answered: Vec<String> = bot_events(&hs, &carol, &room_g)
        .iter()
        .filter_map(|e| answers(e).map(str::to_owned))
        .collect();
    assert_eq!(answered, [q_g], "{history} was answered");
    assert_eq!(hs.membership(&alice, &room_f, BOT), "leave");
    // While a turn runs, the bot is shown typing.
    let mut since = hs.sync_token(&carol);
    let slow = hs.say(&carol, &room_g, "bot: run: sleep 4");
    let bot_id = BOT.to_owned();
    wait_until_or(
        "the bot to be typing",
        || {
            hs.typing_since(&carol, &room_g, &mut since)
                .is_some_and(|t| t.contains(&bot_id))
        },
        String::new,
    );
    answer_to(&hs, &carol, &room_g, &slow);
    wait_until_or(
        "the bot to stop typing",
        || {
            hs.typing_since(&carol, &room_g, &mut since)
                .is_some_and(|t| !t.contains(&bot_id))
        },
        String::new,
    );

    // Kicked from room A while a turn runs there and another waits behind it: left for
    // good, the running turn stopped, the waiting one given up (it never runs), neither
    // answered, nothing answered there again.
    let ws = d.join("ws");
    let before = bot.len();
    hs.say(
        &alice,
        &room_a,
        "bot: run: touch running-a; sleep 8; touch slept-a",
    );
    wait_until_or(
        "the long turn to start",
        || holds_file(&ws, "running-a"),
        String::new,
    );
    let (asked, _) = bot.wait_for("a turn for @alice", before);
    hs.say(&alice, &room_a, "bot: run: touch queued-a");
    bot.wait_for("a turn for @alice", asked);
    hs.kick(&alice, &room_a, BOT, "enough");
    bot.wait_for(
        &format!("{room_a}: kicked by @alice:localhost (enough): left the room for good"),
        0,
    );
    let before = bot.len();
    hs.say(&alice, &room_a, "bot: are you still there?");
    let (_, b5) = ask(&hs, &bob, &room_b, "bot: another barrier");
    assert!(b5.contains("read it back"), "{b5}");
    // (Not stopped, the running turn would have written `slept-a` 8 s after it started,
    // and the waiting one `queued-a` after it: 12 s is past both on an idle machine. With
    // the stop, neither is ever written, however long the wait.)
    std::thread::sleep(Duration::from_secs(12));
    assert!(
        !holds_file(&ws, "slept-a"),
        "the running turn was not stopped"
    );
    assert!(!holds_file(&ws, "queued-a"), "the waiting turn ran");
    assert_eq!(hs.membership(&alice, &room_a, BOT), "leave");
    assert!(!bot.lines()[before..]
        .iter()
        .any(|l| l.contains(&room_a) && l.contains("a turn for")));

    // The session's token revoked (its device logged out, as by an admin or the user's
    // other client): the bot logs in again with its password, and the new session serves:
    // the question asked meanwhile is answered once (its answer waits for the new session;
    // it was dropped, and every later one, until a restart), and the next one too.
    let session: Value =
        serde_json::from_slice(&std::fs::read(d.join("session.json")).unwrap()).unwrap();
    let old_token = session["access_token"].as_str().unwrap().to_owned();
    let before = bot.len();
    hs.call(
        "POST",
        "/_matrix/client/v3/logout",
        Some(&old_token),
        Some(&json!({})),
    );
    let (q_gap, gap) = ask(&hs, &bob, &room_b, "bot: asked while logged out");
    assert!(gap.contains("read it back"), "{gap}");
    bot.wait_for("logged in as @bot:localhost", before);
    let (_, after) = ask(&hs, &bob, &room_b, "bot: asked after logging in again");
    assert!(after.contains("read it back"), "{after}");
    let answered = bot_events(&hs, &bob, &room_b)
        .iter()
        .filter(|e| answers(e) == Some(q_gap.as_str()))
        .count();
    assert_eq!(answered, 1, "the question asked meanwhile answered once");
    // Nothing of before is served again (the new session's first sync was the server's
    // cached snapshot of the start, and the syncs after it replayed everything since).
    let again: Vec<String> = bot.lines()[before..]
        .iter()
        .filter(|l| {
            ["a turn for @alice", "a turn for @carol", "invite", "kicked"]
                .iter()
                .any(|w| l.contains(w))
        })
        .cloned()
        .collect();
    assert_eq!(
        again,
        Vec::<String>::new(),
        "served again after logging in again"
    );

    // The session file: the service user's alone.
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(d.join("session.json")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    let said = bot.stop(d);
    // The bot's password never reached its output.
    assert!(!said.iter().any(|l| l.contains(BOT_PASSWORD)));
}

/// Alice sees every room but `room_b` (Bob's).
fn alice_or_bob(alice: &User, bob: &User, room: &str, room_b: &str) -> User {
    if room == room_b {
        bob.clone()
    } else {
        alice.clone()
    }
}

/// Issue 46: a flooding user (their own Synapse limit lifted by the admin API) fills one
/// room's outbox while another user asks once in another room: that answer is posted
/// before the flood's queue drains (rooms are served in turn: the order is asserted, not a
/// time); the full outbox is told with a notice. The bot is a normal user under a tight
/// server limit (one event per 4 s after a burst of 3) and sends faster than it allows:
/// the server's 429s are waited out and every reply is delivered, late. Then the
/// homeserver is killed and started again: the bot's sync is retried and it answers.
#[test]
fn a_flood_delays_no_other_room_and_a_rate_limited_bot_delivers_every_reply() {
    let dir = scratch("rtn-");
    let d = dir.path();
    let hs = synapse::start(d, (0.25, 3));
    let admin = hs.register("admin", "admin-pass", true);
    hs.register("bot", BOT_PASSWORD, false);
    let flooder = hs.register("flooder", "flooder-pass", false);
    let asker = hs.register("asker", "asker-pass", false);
    hs.unlimit(&admin, &flooder);
    let bot = start_bot(
        d,
        &hs,
        &[
            "--send-burst",
            "10",
            "--send-interval-ms",
            "50",
            "--guest-messages",
            "100",
            "--room-outbox",
            "8",
        ],
    );
    let flood_room = hs.create_room(&flooder, &[BOT], false);
    let ask_room = hs.create_room(&asker, &[BOT], false);
    wait_joined(&hs, &flooder, &flood_room);
    wait_joined(&hs, &asker, &ask_room);

    // Ten questions at once, each answer two events (a long output).
    let flood: Vec<String> = (0..10)
        .map(|i| hs.say(&flooder, &flood_room, &format!("bot: run: seq {i} 6000")))
        .collect();
    // The flood's outbox is full (8 events: 32 s of sending at the server's pace), however
    // slow the machine: its first drop is logged, with the notice (within the cap when the
    // last reply found one place, else in the one place past it: `outbox 8` or `9`).
    bot.wait_for(
        "event(s) for @flooder:localhost (notice posted); outbox ",
        0,
    );
    let skip = bot.len();
    let asked_at = Instant::now();
    let question = hs.say(&asker, &ask_room, "bot: a short question");
    let answer = answer_to(&hs, &asker, &ask_room, &question);
    let seen_ms = asked_at.elapsed().as_millis();
    assert!(body(&answer).contains("read it back (asker: a short question)"));
    let (line, _) = bot.wait_for("reply for @asker:localhost posted in ", skip);
    let posted_ms: u64 = bot.lines()[line]
        .split("posted in ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    eprintln!("the asker's answer: posted {posted_ms} ms after it was ready, seen {seen_ms} ms after the question");

    // The order: the flood's events went on after the asker's answer (it did not wait for
    // the flood's queue to drain).
    let answer_ts = answer["origin_server_ts"].as_u64().unwrap();
    wait_until_or(
        "a flood event after the answer",
        || {
            bot_events(&hs, &flooder, &flood_room)
                .iter()
                .any(|e| e["origin_server_ts"].as_u64().unwrap() > answer_ts)
        },
        || format!("{:?}", bot.lines()),
    );
    let flood_events = bot_events(&hs, &flooder, &flood_room);
    let before_answer = flood_events
        .iter()
        .filter(|e| e["origin_server_ts"].as_u64().unwrap() < answer_ts)
        .count();
    assert!(before_answer >= 1, "{flood_events:#?}");
    // The flooder's output is capped with one notice; the room's outbox stayed bounded.
    wait_until_or(
        "the flooder's notice",
        || {
            bot_events(&hs, &flooder, &flood_room)
                .iter()
                .any(|e| body(e).starts_with("output truncated, "))
        },
        || format!("{:?}", bot.lines()),
    );
    let notices: Vec<Value> = bot_events(&hs, &flooder, &flood_room)
        .into_iter()
        .filter(|e| body(e).starts_with("output truncated, "))
        .collect();
    assert_eq!(notices.len(), 1, "{notices:#?}");
    assert_eq!(notices[0]["content"]["msgtype"], "m.notice");
    assert!(
        body(&notices[0]).ends_with("(this room's outbox is full)"),
        "{notices:#?}"
    );
    let depths: Vec<usize> = bot
        .lines()
        .iter()
        .filter_map(|l| l.split("; outbox ").nth(1)?.trim().parse().ok())
        .collect();
    // The cap, and one notice past it.
    assert!(depths.iter().all(|&n| n <= 9), "{depths:?}");
    // A long answer is cut into several events, each a reply to its question.
    assert!(
        flood.iter().any(|q| flood_events
            .iter()
            .filter(|e| answers(e) == Some(q.as_str()) && e["content"]["msgtype"] == "m.text")
            .count()
            >= 2),
        "{flood_events:#?}"
    );
    // Every flood event answers one of the flood's questions.
    assert!(flood_events
        .iter()
        .all(|e| answers(e).is_some_and(|a| flood.iter().any(|q| q == a))));

    // Rate-limited: the bot sends faster than the server lets it; every answer arrives.
    let questions: Vec<String> = (0..4)
        .map(|i| hs.say(&asker, &ask_room, &format!("bot: question {i}")))
        .collect();
    for (i, q) in questions.iter().enumerate() {
        let a = answer_to(&hs, &asker, &ask_room, q);
        assert!(
            body(&a).contains(&format!("read it back (asker: question {i})")),
            "{a}"
        );
    }
    let waited: Vec<String> = bot
        .lines()
        .into_iter()
        .filter(|l| l.contains("rate-limited by the homeserver (429): sending again in "))
        .collect();
    assert!(!waited.is_empty(), "the server never limited the bot");
    eprintln!("the bot waited out {} 429(s)", waited.len());

    // The homeserver goes away and comes back: the bot's sync fails, is retried with
    // backoff, and the bot answers again (its session and the sandbox untouched).
    let skip = bot.len();
    let relaunch = hs.kill();
    bot.wait_for("sync failed", skip);
    bot.wait_for("retrying in 2 s", skip);
    let hs = relaunch();
    let again = hs.say(&asker, &ask_room, "bot: are you back");
    let a = answer_to(&hs, &asker, &ask_room, &again);
    assert!(
        body(&a).contains("read it back (asker: are you back)"),
        "{a}"
    );
    assert!(!bot.lines().iter().any(|l| l.contains("shut down")));
    // Nothing answered twice (a resend keeps its transaction id).
    let mut replied: Vec<&str> = Vec::new();
    let asked_events = bot_events(&hs, &asker, &ask_room);
    for e in &asked_events {
        if let Some(a) = answers(e) {
            assert!(
                !replied.contains(&a),
                "{a} answered twice: {asked_events:#?}"
            );
            replied.push(a);
        }
    }
    bot.stop(d);
}

/// Issue 46: the per-speaker limits count the sender's user id, which they cannot change:
/// with `speaker_turns_per_minute = 2`, a user's third question is refused, and a new
/// display name gets no fresh limits (nor a fresh output budget: `--guest-messages 4`);
/// another user has limits of their own. `--metrics`,
/// `[budgets]` and `[audit]` work as for the other bots: the audit trail and the state file
/// hold the user id, never the display name; no metric label holds a room or a user.
#[test]
fn limits_key_on_the_user_id_not_the_display_name() {
    let dir = scratch("rtl-");
    let d = dir.path();
    let hs = synapse::start(d, (50.0, 200));
    hs.register("bot", BOT_PASSWORD, false);
    let dave = hs.register("dave", "dave-pass", false);
    let erin = hs.register("erin", "erin-pass", false);
    let state = d.join("budgets.sqlite");
    let audit = d.join("audit.jsonl");
    let config = floor_config_with(
        d,
        &format!(
            "[budgets]\nstate_file = \"{}\"\nspeaker_turns_per_minute = 2\n[audit]\npath = \"{}\"\n",
            state.display(),
            audit.display()
        ),
    );
    // The bot logs in with an access token this time (from a file), as an operator who
    // made one elsewhere would.
    let login = hs.call(
        "POST",
        "/_matrix/client/v3/login",
        None,
        Some(
            &json!({"type": "m.login.password", "password": BOT_PASSWORD,
                     "identifier": {"type": "m.id.user", "user": "bot"}}),
        ),
    );
    let token = private_file(
        &d.join("bot-token"),
        login["access_token"].as_str().unwrap(),
    );
    let token = token.to_str().unwrap();
    let flags = [
        "--metrics",
        "127.0.0.1:0",
        "--access-token-file",
        token,
        "--guest-messages",
        "4",
        "--max-rooms",
        "1",
    ];
    let bot = start_bot_configured(d, &hs, &config, &flags);
    let device = login["device_id"].as_str().unwrap();
    assert!(
        bot.lines().iter().any(|l| l.contains(&format!(
            "logged in as @bot:localhost with an access token (device {device})"
        ))),
        "{:?}",
        bot.lines()
    );
    let metrics = {
        let (i, _) = bot.wait_for("matrix-bot: metrics at http://", 0);
        let line = bot.lines()[i].clone();
        let rest = line.split_once("http://").unwrap().1.to_owned();
        rest.strip_suffix("/metrics").unwrap_or(&rest).to_owned()
    };
    let room = hs.create_room(&dave, &[BOT, &erin.id], false);
    hs.join(&erin, &room);
    wait_joined(&hs, &dave, &room);
    set_name(&hs, &dave, &room, "Dave Original");
    for text in ["first", "second"] {
        let (_, a) = ask(&hs, &dave, &room, &format!("bot: {text}"));
        assert!(
            a.contains(&format!("read it back (Dave Original: {text})")),
            "{a}"
        );
    }
    let refused = "error: budget speaker_turns_per_minute exceeded: this speaker has started 2 turns in the last minute; try again in ";
    let third = hs.say(&dave, &room, "bot: third");
    let n = answer_to(&hs, &dave, &room, &third);
    assert_eq!(n["content"]["msgtype"], "m.notice");
    assert!(body(&n).starts_with(refused), "{n}");
    // A new display name: the same sender, no fresh limits.
    set_name(&hs, &dave, &room, "Dave Renamed");
    let q = hs.say(&dave, &room, "bot: as Dave Renamed");
    let n = answer_to(&hs, &dave, &room, &q);
    assert!(body(&n).starts_with(refused), "a new name got a turn: {n}");
    // The bot's own output budget (--guest-messages 4) counts the user id too: Dave's
    // fifth event in the window is dropped, with a notice, whatever his name.
    set_name(&hs, &dave, &room, "Someone Else");
    let q = hs.say(&dave, &room, "bot: as Someone Else");
    let n = answer_to(&hs, &dave, &room, &q);
    assert_eq!(n["content"]["msgtype"], "m.notice");
    assert_eq!(
        body(&n),
        "output truncated, 1 message(s) dropped (at most 4 message(s) per 60 s for each guest)"
    );
    // Another user: limits of their own.
    let (_, a) = ask(&hs, &erin, &room, "bot: my turn");
    assert!(a.contains("read it back (erin: my turn)"), "{a}");

    // No label names a room or a user.
    let body = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&metrics).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    assert!(body.contains("roundtable_turns_total"), "{body}");
    assert!(
        !body.contains("localhost") && !body.contains(&room) && !body.contains("Dave"),
        "{body}"
    );
    // `--max-rooms 1`: in Dave's room already, the bot refuses Erin's invite (an allowed
    // inviter: its own server), and is not in her room.
    let second = hs.create_room(&erin, &[BOT], false);
    bot.wait_for(
        &format!(
            "{second}: refused an invite from @erin:localhost (already in 1 room(s): --max-rooms)"
        ),
        0,
    );
    wait_until_or(
        "the invite to be declined",
        || hs.membership(&erin, &second, BOT) == "leave",
        String::new,
    );
    bot.stop(d);

    // The audit trail: a line per turn and refusal, each with the user id as the speaker.
    let trail = std::fs::read_to_string(&audit).unwrap();
    let mut speakers: Vec<String> = trail
        .lines()
        .map(|l| {
            let line: Value = serde_json::from_str(l).unwrap();
            line["speaker"].as_str().unwrap().to_owned()
        })
        .collect();
    speakers.sort();
    assert_eq!(
        speakers,
        [
            "@dave:localhost",
            "@dave:localhost",
            "@dave:localhost",
            "@dave:localhost",
            "@dave:localhost",
            "@erin:localhost"
        ],
        "{trail}"
    );
    assert!(!trail.contains("Dave"), "{trail}");
    // The state file counts the user id.
    let mut kept = Vec::new();
    for f in ["budgets.sqlite", "budgets.sqlite-wal"] {
        kept.extend(std::fs::read(d.join(f)).unwrap_or_default());
    }
    let holds = |needle: &str| kept.windows(needle.len()).any(|w| w == needle.as_bytes());
    assert!(holds("@dave:localhost"), "no user id counted");
    assert!(!holds("Dave"));

    // `--max-rooms` holds at a start too: an invite that came while the bot was down is
    // weighed against the room it is in (the first sync's invites were weighed against
    // none, and taken).
    let third = hs.create_room(&erin, &[BOT], false);
    let bot = start_bot_configured(d, &hs, &config, &flags);
    bot.wait_for(
        &format!(
            "{third}: refused an invite from @erin:localhost (already in 1 room(s): --max-rooms)"
        ),
        0,
    );
    wait_until_or(
        "the invite to be declined",
        || hs.membership(&erin, &third, BOT) == "leave",
        String::new,
    );
    bot.stop(d);
}

/// Sets `user`'s display name and waits until `room`'s member event carries it.
fn set_name(hs: &Synapse, user: &User, room: &str, name: &str) {
    hs.call(
        "PUT",
        &format!(
            "/_matrix/client/v3/profile/{}/displayname",
            synapse::enc(&user.id)
        ),
        Some(&user.token),
        Some(&json!({ "displayname": name })),
    );
    wait_until_or(
        "the new display name in the room",
        || {
            hs.call(
                "GET",
                &format!(
                    "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
                    synapse::enc(room),
                    synapse::enc(&user.id)
                ),
                Some(&user.token),
                None,
            )["displayname"]
                == name
        },
        String::new,
    );
}
