//! The IRC bot end to end: a real IRC server (Debian's ngircd) on loopback, the bot, and a
//! real IRC client (Debian's `ii`, driven through its files), with the actor layer, the
//! broker, the embedded offline model and the guest in sealed containers. Runs as the
//! service user.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{floor_config, scratch};

/// Kills its child when dropped (each a specific pid we started).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_until(what: &str, ok: impl FnMut() -> bool) {
    wait_until_or(what, ok, String::new)
}

fn wait_until_or(what: &str, mut ok: impl FnMut() -> bool, context: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}; {}", context());
}

fn tool(name: &str) -> &str {
    for dir in ["/usr/sbin", "/usr/bin"] {
        if Path::new(dir).join(name).exists() {
            return name;
        }
    }
    panic!("{name} is not installed: run scripts/setup.sh (it installs ngircd and ii)");
}

/// One of ii's input FIFOs, held open for the whole test: a writer that closes between
/// lines races with ii reopening the FIFO and can lose a line.
struct Fifo(std::fs::File);

impl Fifo {
    fn open(path: &Path) -> Self {
        Self(std::fs::OpenOptions::new().write(true).open(path).unwrap())
    }

    /// Writes `line` and its newline in one `write` (atomic below PIPE_BUF): ii reads its
    /// FIFO non-blocking, byte by byte, and takes a read that comes up short before the
    /// newline for the writer's end, dropping the part it read. `writeln!` on a `File` may
    /// issue two writes (the text, then the newline), and on a busy machine ii runs between
    /// them: the line was lost.
    fn say(&mut self, line: &str) {
        let bytes = format!("{line}\n");
        assert!(bytes.len() <= 512, "a FIFO line must fit one atomic write");
        assert_eq!(self.0.write(bytes.as_bytes()).unwrap(), bytes.len());
    }
}

/// Says `line` in the channel and waits until ii logs it as sent; says it again if ii did
/// not pick it up within 20 s (it should not happen now that a line is one write; a repeat
/// would reach the bot twice).
fn say_seen(chan: &mut Fifo, out: &Path, skip: usize, line: &str) {
    let echo = format!("<tester> {line}");
    for _ in 0..3 {
        chan.say(line);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let text = std::fs::read_to_string(out).unwrap_or_default();
            if text.lines().skip(skip).any(|l| l.ends_with(&echo)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    panic!(
        "ii never sent {line:?}; the channel log: {:?}",
        std::fs::read_to_string(out).unwrap_or_default()
    );
}

/// Waits for a line of the channel log containing `needle` after the first `skip` lines.
fn expect(out: &Path, skip: usize, needle: &str) -> (usize, String) {
    let mut found = None;
    wait_until_or(
        &format!("{needle:?} in {}", out.display()),
        || {
            let text = std::fs::read_to_string(out).unwrap_or_default();
            found = text
                .lines()
                .enumerate()
                .skip(skip)
                .find(|(_, l)| l.contains(needle))
                .map(|(i, l)| (i + 1, l.to_owned()));
            found.is_some()
        },
        || {
            format!(
                "the log: {:?}",
                std::fs::read_to_string(out).unwrap_or_default()
            )
        },
    );
    found.unwrap()
}

#[test]
fn the_irc_bot_answers_a_real_client_through_a_real_server() {
    let dir = scratch("rti-");
    let d = dir.path();
    let port = free_port();
    let conf = d.join("ngircd.conf");
    std::fs::write(
        &conf,
        format!(
            "[Global]\nName = irc.test\nInfo = roundtable test\nListen = 127.0.0.1\nPorts = {port}\n\
             PidFile = {}\nMotdPhrase = test\n[Limits]\nMaxNickLength = 30\n\
             [Options]\nPAM = no\nIdent = no\nDNS = no\n",
            d.join("ngircd.pid").display()
        ),
    )
    .unwrap();
    let _server = Proc(
        Command::new(tool("ngircd"))
            .args(["-n", "-f"])
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("ngircd to listen", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });

    let mut bot = Command::new(env!("CARGO_BIN_EXE_irc-bot"))
        .args([
            "--server",
            &format!("127.0.0.1:{port}"),
            "--nick",
            "sandbox",
            "--join",
            "#test",
        ])
        .arg("--run-root")
        .arg(d.join("run"))
        .arg("--workspace-root")
        .arg(d.join("ws"))
        .arg("--offline")
        .arg("--config")
        .arg(floor_config(d))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = bot.stderr.take().unwrap();
    let mut bot = Proc(bot);
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let line = lines.next().expect("bot exited").unwrap();
        if line.contains("registered; joining #test") {
            break;
        }
    }
    let said = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let echo = std::thread::spawn({
        let said = said.clone();
        move || {
            for line in lines.map_while(Result::ok) {
                eprintln!("bot: {line}");
                said.lock().unwrap().push(line);
            }
        }
    });

    let ii_dir = d.join("ii");
    let _client = Proc(
        Command::new(tool("ii"))
            .args([
                "-s",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-n",
                "tester",
                "-i",
            ])
            .arg(&ii_dir)
            .spawn()
            .unwrap(),
    );
    let server_in: PathBuf = ii_dir.join("127.0.0.1/in");
    wait_until("ii to connect", || server_in.exists());
    std::thread::sleep(Duration::from_millis(300));
    let mut server = Fifo::open(&server_in);
    server.say("/j #test");
    let chan_in = ii_dir.join("127.0.0.1/#test/in");
    let chan_out = ii_dir.join("127.0.0.1/#test/out");
    wait_until("ii to join #test", || chan_in.exists());
    let mut chan = Fifo::open(&chan_in);

    say_seen(&mut chan, &chan_out, 0, "sandbox: hello there");
    let (at, reply) = expect(&chan_out, 0, "<sandbox> tester: ");
    assert!(
        reply.contains("read it back (tester: hello there)"),
        "{reply}"
    );
    assert!(
        reply.contains("roll_dice answered: tester rolled a d6"),
        "{reply}"
    );
    assert!(reply.contains("holds 0 earlier message(s)"), "{reply}");

    say_seen(&mut chan, &chan_out, at, "sandbox: and again");
    let (at, reply) = expect(&chan_out, at, "<sandbox> tester: ");
    assert!(reply.contains("holds 1 earlier message(s)"), "{reply}");

    say_seen(&mut chan, &chan_out, at, "!reset");
    let (at, reply) = expect(&chan_out, at, "<sandbox> tester: reset");
    assert!(
        reply.ends_with("the next turn starts a fresh session"),
        "{reply}"
    );
    say_seen(&mut chan, &chan_out, at, "sandbox: after the reset");
    let (_, reply) = expect(&chan_out, at, "<sandbox> tester: ");
    assert!(reply.contains("holds 0 earlier message(s)"), "{reply}");

    // SIGTERM: the bot shuts its runtime down and exits 0, leaving no container, socket or
    // run dir (the reply is sent before a turn's teardown, so a bot killed right after
    // it could leave its last container to the next start's sweep).
    let pid = nix::unistd::Pid::from_raw(bot.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = bot.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the bot did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    echo.join().unwrap();
    let said = said.lock().unwrap().clone();
    assert!(status.success(), "the bot exited with {status}: {said:?}");
    assert!(
        said.iter().any(|l| l.starts_with("irc-bot: shut down")),
        "{said:?}"
    );
    assert_eq!(containers_of(d), Vec::<String>::new(), "containers left");
    let run = std::fs::read_dir(d.join("run"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("turn-"))
        .collect::<Vec<_>>();
    assert_eq!(run, Vec::<String>::new(), "turn dirs left");
}

/// The project's containers (any state) with a mount from under `dir`.
fn containers_of(dir: &Path) -> Vec<String> {
    let ids = Command::new("docker")
        .args(["ps", "-aq", "--filter", "label=roundtable-sandbox"])
        .output()
        .unwrap();
    assert!(ids.status.success(), "docker ps: {ids:?}");
    let mut mine = Vec::new();
    for id in String::from_utf8_lossy(&ids.stdout).split_whitespace() {
        let out = Command::new("docker")
            .args([
                "inspect",
                "--format",
                "{{range .Mounts}}{{.Source}} {{end}}",
                id,
            ])
            .output()
            .unwrap();
        // A container removed meanwhile (another test's) is not ours.
        if String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .any(|src| Path::new(src).starts_with(dir))
        {
            mine.push(id.to_owned());
        }
    }
    mine
}
