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
    _dir: tempfile::TempDir,
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

    bot.send("/reset #a");
    assert_eq!(
        bot.expect("[#a] reset"),
        "[#a] reset: the next turn starts a fresh session"
    );
    bot.send("#a ann: after reset");
    let a3 = bot.expect("[#a] ");
    assert!(
        a3.contains("holds 0 earlier message(s)"),
        "fresh session: {a3}"
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
