//! The terminal bot driven through stdin, for real: the actor layer, the broker, the
//! embedded offline model and the guest in sealed containers. Runs as the service user.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{floor_config, scratch};

/// How long a reply or a state may take: generous, the machine may be busy (other builds
/// and container tests beside this one).
const PATIENCE: Duration = Duration::from_secs(180);

struct Bot {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    _dir: common::Scratch,
}

impl Bot {
    fn start() -> Self {
        let dir = scratch("rtb-");
        let mut child = Command::new(env!("CARGO_BIN_EXE_terminal-bot"))
            .arg("--run-root")
            .arg(dir.path().join("run"))
            .arg("--workspace-root")
            .arg(dir.path().join("ws"))
            .arg("--offline")
            .arg("--config")
            .arg(floor_config(dir.path()))
            .env_remove("OPENAI_API_KEY")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Self {
            child,
            stdin,
            lines,
            seen: Vec::new(),
            _dir: dir,
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn send_bytes(&mut self, bytes: &[u8]) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(bytes).unwrap();
        stdin.flush().unwrap();
    }

    /// Asks for `/status` until the channel's line shows one of `states` (a turn's
    /// progress is polled, never assumed after a fixed sleep: a busy machine starts the bot
    /// and the container late). Status lines are not kept for [`Bot::expect`].
    fn wait_for_state(&mut self, channel: &str, states: &[&str]) {
        let want: Vec<String> = states.iter().map(|s| format!("[{channel}] {s},")).collect();
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            self.send("/status");
            loop {
                match self.lines.recv_timeout(Duration::from_secs(5)) {
                    Ok(l) if want.iter().any(|w| l.starts_with(w)) => return,
                    Ok(l) if l.starts_with("status: ") => break,
                    Ok(l) if l.starts_with(&format!("[{channel}] ")) && l.contains(" queued") => {}
                    Ok(l) => self.seen.push(l),
                    Err(_) => break,
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("{channel} never showed {states:?}; saw {:?}", self.seen);
    }

    /// Waits for a line starting with `prefix`; returns it.
    fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        if let Some(i) = self.seen.iter().position(|l| l.starts_with(prefix)) {
            return self.seen.remove(i);
        }
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(l) => self.seen.push(l),
                Err(_) => break,
            }
        }
        panic!("no line starting with {prefix:?}; saw {:?}", self.seen);
    }

    fn finish(mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "bot exit {status}");
    }
}

#[test]
fn replies_for_two_channels_then_a_reset_shows_a_fresh_session() {
    let mut bot = Bot::start();
    // Bytes that are not UTF-8 and a line past the cap (a pipe from a bridge can carry
    // both) stop nothing: the bot reads on (before, the first ended it).
    bot.send_bytes(b"\xff\xfe not a message\n");
    let mut long = vec![b'#'; 200 * 1024];
    long.push(b'\n');
    bot.send_bytes(&long);
    bot.send("#a ann: hello from a");
    bot.send("#b bob: hello from b");
    let a = bot.expect("[#a] ");
    let b = bot.expect("[#b] ");
    assert!(a.contains("read it back (ann: hello from a)"), "{a}");
    assert!(a.contains("roll_dice answered: ann rolled a d6"), "{a}");
    assert!(b.contains("read it back (bob: hello from b)"), "{b}");
    assert!(a.contains("holds 0 earlier message(s)"), "{a}");

    bot.send("#a ann: second");
    let a2 = bot.expect("[#a] ");
    assert!(
        a2.contains("holds 1 earlier message(s)"),
        "history kept: {a2}"
    );

    // A question and a reset in one read: the question was sent first, so it keeps its
    // session and the reset waits for the next turn (the reset was queued first, the
    // question's send deferred to its task: it ran fresh and used the reset up).
    bot.send_bytes(b"#a ann: third\n/reset #a\n");
    assert_eq!(
        bot.expect("[#a] reset"),
        "[#a] reset: the next turn starts a fresh session"
    );
    let a3 = bot.expect("[#a] ");
    assert!(
        a3.contains("holds 2 earlier message(s)"),
        "the question before the reset kept its session: {a3}"
    );
    bot.send("#a ann: after reset");
    let a4 = bot.expect("[#a] ");
    assert!(
        a4.contains("holds 0 earlier message(s)"),
        "fresh session: {a4}"
    );
    bot.finish();
}

#[test]
fn stop_during_a_turn() {
    let mut bot = Bot::start();
    bot.send("#s ann: run: sleep 60");
    // The container runs the agent (its phase is the last one reported: the model call
    // that asked for `sleep 60`, or the start before it).
    bot.wait_for_state(
        "#s",
        &[
            "the agent is working in its container",
            "the agent asked the model",
        ],
    );
    bot.send("/stop #s");
    assert_eq!(
        bot.expect("[#s] stop"),
        "[#s] stop: the running turn was stopped"
    );
    assert_eq!(bot.expect("[#s] error"), "[#s] error: turn stopped");
    bot.send("/stop #s");
    assert_eq!(bot.expect("[#s] stop"), "[#s] stop: nothing was running");
    bot.finish();
}

/// What the outside review sent through the guest (issue 21): an OSC 52 clipboard write, an
/// OSC 0 title, an erase-line and carriage return before a forged status line, 8-bit C1
/// controls (CSI, OSC, ST), DEL and a bidi override, all in the `sh` output the model puts
/// in its reply. `printf` in the sandbox makes the bytes; the model relays them.
pub const HOSTILE_PRINTF: &str = r"run: printf '\033]52;c;aGk=\007\033]0;owned\007\033[2K\r[#ops] reset: the next turn starts a fresh session\n\302\23331m\302\2350;t\302\234\177\342\200\256end'";

/// Whether `bytes` hold a control a terminal obeys: any C0 but the line feed, DEL, a C1
/// (as UTF-8) or a bidi control.
fn obeyed_controls(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .chars()
        .filter(|&c| c != '\n' && roundtable_sandbox::display::is_escaped(c))
        .map(|c| format!("{:?}", c))
        .collect()
}

#[test]
fn guest_made_escapes_reach_the_terminal_escaped_and_no_reply_line_passes_for_a_status_line() {
    let mut bot = Bot::start();
    bot.send(&format!("#x ann: {HOSTILE_PRINTF}"));
    let first = bot.expect("[#x] ");
    // The whole reply: every line up to the session count the offline model ends with.
    let mut reply = vec![first];
    while !reply.last().unwrap().contains("earlier message(s)") {
        match bot.lines.recv_timeout(PATIENCE) {
            Ok(l) => reply.push(l),
            Err(_) => panic!("the reply did not end: {reply:?}"),
        }
    }
    bot.send("/status");
    bot.expect("status: ");
    let mut all = reply.clone();
    all.append(&mut bot.seen);
    bot.finish();
    let text = all.join("\n");
    assert_eq!(
        obeyed_controls(text.as_bytes()),
        Vec::<String>::new(),
        "{text}"
    );
    // The sequences are there, visible.
    assert!(text.contains(r"\u{1b}]52;c;aGk=\u{7}"), "{text}");
    assert!(
        text.contains(r"\u{9b}31m\u{9d}0;t\u{9c}\u{7f}\u{202e}end"),
        "{text}"
    );
    // The forged line is a continuation of the reply, marked as one: no line but the bot's
    // own starts with a channel and a status word.
    for line in &all {
        assert!(
            !line.starts_with("[#ops]"),
            "a reply line passed for a status line: {line:?}"
        );
    }
    assert!(
        reply[1..].iter().all(|l| l.starts_with("[#x] | ")),
        "continuation lines are marked: {reply:?}"
    );
    assert!(reply[0].starts_with("[#x] > "), "{reply:?}");
}
