//! The IRC bot end to end: a real IRC server (Debian's ngircd) on loopback, the bot, and a
//! real IRC client (Debian's `ii`, driven through its files), with the actor layer, the
//! broker, the embedded offline model and the guest in sealed containers. Runs as the
//! service user.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{floor_config, floor_config_with, scratch};

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
    panic!("{name} is not installed: run scripts/setup.sh --tests (it installs ngircd and ii)");
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
    // ii logs what it sent as `<nick> line`.
    let echo = format!("> {line}");
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

/// ngIRCd on loopback, as Debian ships it (its own flood rules: a client's commands are
/// throttled past 3 per second or 256 bytes per second, and a client whose unread input
/// passes its 2 KiB read buffer is disconnected).
/// ngIRCd listening on `listen` (a comma-separated list of addresses), with more lines for
/// its `[Options]` (and the sections after).
fn start_server_with(d: &Path, port: u16, listen: &str, options: &str) -> Proc {
    let conf = d.join("ngircd.conf");
    std::fs::write(
        &conf,
        format!(
            "[Global]\nName = irc.test\nInfo = roundtable test\nListen = {listen}\nPorts = {port}\n\
             PidFile = {}\nMotdPhrase = test\n[Limits]\nMaxNickLength = 30\n\
             [Options]\nPAM = no\nIdent = no\nDNS = no\n{options}",
            d.join("ngircd.pid").display()
        ),
    )
    .unwrap();
    let server = Proc(
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
    server
}

/// The bot's stderr lines, each with the moment the test read it.
type Said = std::sync::Arc<std::sync::Mutex<Vec<(Instant, String)>>>;

/// The lines said so far, without their times.
/// [`start_server_with`] on loopback, with a server operator (`op`, password `op-pass`)
/// who may set a channel's modes (to make a client a channel operator).
fn start_server_with_an_operator(d: &Path, port: u16) -> Proc {
    start_server_with(
        d,
        port,
        "127.0.0.1",
        "OperCanUseMode = yes\n[Operator]\nName = op\nPassword = op-pass\n",
    )
}

fn lines_of(said: &Said) -> Vec<String> {
    said.lock()
        .unwrap()
        .iter()
        .map(|(_, l)| l.clone())
        .collect()
}

/// Starts the bot joined to `channels`; returns it once it has registered, with its stderr
/// lines as they come.
fn start_bot(d: &Path, port: u16, channels: &str) -> (Proc, Said, std::thread::JoinHandle<()>) {
    start_bot_with(d, port, channels, &[])
}

/// [`start_bot`] with more arguments for the bot.
fn start_bot_with(
    d: &Path,
    port: u16,
    channels: &str,
    extra: &[&str],
) -> (Proc, Said, std::thread::JoinHandle<()>) {
    start_bot_configured(d, port, channels, &floor_config(d), extra)
}

/// [`start_bot_with`] with the configuration file `config`.
fn start_bot_configured(
    d: &Path,
    port: u16,
    channels: &str,
    config: &Path,
    extra: &[&str],
) -> (Proc, Said, std::thread::JoinHandle<()>) {
    let mut bot = Command::new(env!("CARGO_BIN_EXE_irc-bot"))
        .args([
            "--server",
            &format!("127.0.0.1:{port}"),
            "--nick",
            "sandbox",
            "--join",
            channels,
        ])
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
    let bot = Proc(bot);
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
    wait_for_said(&said, "registered; joining", 0);
    (bot, said, echo)
}

/// Waits for the bot to say a line containing `needle` (past its first `skip` lines);
/// returns its index and when it was read.
fn wait_for_said(said: &Said, needle: &str, skip: usize) -> (usize, Instant) {
    let mut found = None;
    wait_until_or(
        &format!("the bot to say {needle:?}"),
        || {
            found = said
                .lock()
                .unwrap()
                .iter()
                .enumerate()
                .skip(skip)
                .find(|(_, (_, l))| l.contains(needle))
                .map(|(i, (at, _))| (i, *at));
            found.is_some()
        },
        || format!("it said {:?}", said.lock().unwrap()),
    );
    found.unwrap()
}

/// A real IRC client (`ii`) connected as `nick` and joined to `channel`: its input FIFOs
/// (the channel's and the server's) and its logs.
struct Client {
    _proc: Proc,
    chan: Fifo,
    out: PathBuf,
    server: Fifo,
    server_out: PathBuf,
}

fn start_client(d: &Path, port: u16, nick: &str, channel: &str) -> Client {
    start_client_at(d, "127.0.0.1", port, nick, channel)
}

/// [`start_client`], connecting to the server at `host` (so from that address).
fn start_client_at(d: &Path, host: &str, port: u16, nick: &str, channel: &str) -> Client {
    let ii_dir = d.join(format!("ii-{nick}"));
    let proc = Proc(
        Command::new(tool("ii"))
            .args(["-s", host, "-p", &port.to_string(), "-n", nick, "-i"])
            .arg(&ii_dir)
            .spawn()
            .unwrap(),
    );
    let server_in: PathBuf = ii_dir.join(format!("{host}/in"));
    wait_until("ii to connect", || server_in.exists());
    std::thread::sleep(Duration::from_millis(300));
    let mut server = Fifo::open(&server_in);
    server.say(&format!("/j {channel}"));
    let chan_in = ii_dir.join(format!("{host}/{channel}/in"));
    let out = ii_dir.join(format!("{host}/{channel}/out"));
    wait_until("ii to join", || chan_in.exists());
    // ii keeps the FIFO of a channel it has left: a reconnected client starts on a clean log.
    let chan = Fifo::open(&chan_in);
    Client {
        _proc: proc,
        chan,
        out,
        server,
        server_out: ii_dir.join(format!("{host}/out")),
    }
}

/// The number of lines in a channel log.
fn log_len(out: &Path) -> usize {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .count()
}

/// Stops the bot with SIGTERM: it shuts its runtime down and exits 0, leaving no
/// container, socket or run dir (the reply is sent before a turn's teardown, so a bot
/// killed right after it could leave its last container to the next start's sweep).
fn stop_bot(mut bot: Proc, said: &Said, echo: std::thread::JoinHandle<()>, d: &Path) {
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
    let said = lines_of(said);
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

#[test]
fn the_irc_bot_answers_a_real_client_through_a_real_server() {
    let dir = scratch("rti-");
    let d = dir.path();
    let port = free_port();
    let _server = start_server_with_an_operator(d, port);
    // (Room for this test's lines in one minute: the output budget has a test of its own.)
    let (bot, said, echo) = start_bot_with(
        d,
        port,
        "#test",
        &[
            "--metrics",
            "127.0.0.1:0",
            "--guest-lines",
            "40",
            "--reset-by",
            "ops",
        ],
    );
    let metrics = metrics_addr(&said);
    let Client {
        _proc: _client,
        mut chan,
        out: chan_out,
        server: mut to_server,
        ..
    } = start_client(d, port, "tester", "#test");

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

    // `!stop` (by default) and `!reset` (with `--reset-by ops`): the channel's operators
    // alone. The bot joined first: it is the only one, and tester is refused. The bot's
    // own lines start with `* `, a reply's lines with the nick they answer: no line of a
    // reply can pass for one of the bot's.
    say_seen(&mut chan, &chan_out, at, "!reset");
    let (at, reply) = expect(&chan_out, at, "<sandbox> * tester: reset");
    assert!(
        reply.ends_with("reset: only the channel's operators may reset its session"),
        "{reply}"
    );
    say_seen(&mut chan, &chan_out, at, "!stop");
    let (at, reply) = expect(&chan_out, at, "<sandbox> * tester: stop");
    assert!(
        reply.ends_with("stop: only the channel's operators may stop a turn"),
        "{reply}"
    );
    // Made a channel operator (by a server operator's MODE), tester resets the session
    // and stops a running turn.
    to_server.say("/OPER op op-pass");
    to_server.say("/MODE #test +o tester");
    let (at, _) = expect(&chan_out, at, "+o tester");
    say_seen(&mut chan, &chan_out, at, "!reset");
    let (at, reply) = expect(&chan_out, at, "<sandbox> * tester: reset");
    assert!(
        reply.ends_with("reset: the next turn starts a fresh session"),
        "{reply}"
    );
    say_seen(&mut chan, &chan_out, at, "sandbox: after the reset");
    let (at, reply) = expect(&chan_out, at, "<sandbox> tester: ");
    assert!(reply.contains("holds 0 earlier message(s)"), "{reply}");
    say_seen(
        &mut chan,
        &chan_out,
        at,
        "sandbox: run: touch stop-me; sleep 60",
    );
    wait_until("the long turn to start", || {
        files_under(&d.join("ws"))
            .iter()
            .any(|(p, _)| p.ends_with("stop-me"))
    });
    say_seen(&mut chan, &chan_out, at, "!stop");
    let (_, reply) = expect(&chan_out, at, "<sandbox> * tester: stop");
    assert!(
        reply.ends_with("stop: the running turn was stopped"),
        "{reply}"
    );
    let (at, reply) = expect(&chan_out, at, "<sandbox> tester: error: ");
    assert!(reply.contains("stop"), "{reply}");

    // The reply carries controls the guest printed: IRC formatting (C0), a CTCP ACTION, a
    // carriage return and line feed before a forged IRC command, a C1 CSI. They are shown,
    // never obeyed; the forged command is the text of a reply line, after the nick.
    say_seen(
        &mut chan,
        &chan_out,
        at,
        r"sandbox: run: printf '\002bold\0034red\001ACTION waves\001\r\nQUIT :bye\302\233'",
    );
    expect(&chan_out, at, "holds 1 earlier message(s)");
    let log = std::fs::read_to_string(&chan_out).unwrap();
    assert!(
        log.contains(r"\u{2}bold\u{3}4red\u{1}ACTION waves\u{1}"),
        "{log}"
    );
    assert!(log.contains(r"<sandbox> tester: QUIT :bye\u{9b}"), "{log}");
    assert!(
        !log.chars()
            .any(|c| c != '\n' && roundtable_sandbox::display::is_escaped(c)),
        "{log:?}"
    );

    // `--metrics`: the bot's endpoint counts the five turns it served, four answered and one
    // stopped (the reset is no turn), with no channel or nick in any label.
    let body = std::cell::RefCell::new(String::new());
    wait_until_or(
        "the metrics to count five turns",
        || {
            *body.borrow_mut() = scrape(&metrics);
            metric_sum(&body.borrow(), "roundtable_turns_total{") == 5.0
        },
        || body.borrow().clone(),
    );
    let body = body.into_inner();
    assert_eq!(
        metric_sum(&body, "roundtable_turns_total{outcome=\"ok\""),
        4.0,
        "{body}"
    );
    assert!(
        !body.contains("#test") && !body.contains("tester"),
        "{body}"
    );

    stop_bot(bot, &said, echo, d);
}

/// A reply names the channel's other members (a guest had the model repeat the nick list):
/// it highlights none of them (a zero-width space after a nick's first character), only
/// the guest it answers. A channel operator kicks the bot while a turn runs and another
/// waits behind it: the running one is stopped, the waiting one dropped (never run), no
/// container is left for the channel, and the bot does not join again until the operator
/// invites it back.
#[test]
fn a_kick_stops_the_channels_turns_and_the_bot_stays_out_until_invited() {
    let dir = scratch("rtq-");
    let d = dir.path();
    let port = free_port();
    let _server = start_server_with_an_operator(d, port);
    let (bot, said, echo) = start_bot_with(
        d,
        port,
        "#test",
        &["--metrics", "127.0.0.1:0", "--guest-lines", "40"],
    );
    let metrics = metrics_addr(&said);
    let mut tester = start_client(d, port, "tester", "#test");
    let _bystander = start_client(d, port, "Bystander", "#test");
    let (at, _) = expect(&tester.out, 0, "Bystander(");

    say_seen(
        &mut tester.chan,
        &tester.out,
        at,
        "sandbox: say hi to bystander, [Tester] and sandbox",
    );
    let (at, reply) = expect(&tester.out, at, "<sandbox> tester: ");
    assert!(
        reply.contains("read it back (tester: say hi to b\u{200b}ystander, [Tester] and sandbox)"),
        "{reply:?}"
    );

    // tester, made a channel operator, kicks the bot while a turn runs and one waits.
    tester.server.say("/OPER op op-pass");
    tester.server.say("/MODE #test +o tester");
    let (at, _) = expect(&tester.out, at, "+o tester");
    say_seen(
        &mut tester.chan,
        &tester.out,
        at,
        "sandbox: run: touch kicked-while-running; sleep 60",
    );
    wait_until("the long turn to start", || {
        files_under(&d.join("ws"))
            .iter()
            .any(|(p, _)| p.ends_with("kicked-while-running"))
    });
    say_seen(
        &mut tester.chan,
        &tester.out,
        at,
        "sandbox: run: touch queued-before-the-kick",
    );
    wait_until_or(
        "the second message to wait behind the first",
        || metric_sum(&scrape(&metrics), "roundtable_queue_depth ") == 1.0,
        || scrape(&metrics),
    );
    let skip = said.lock().unwrap().len();
    tester.server.say("/KICK #test sandbox :enough");
    let (at, _) = expect(&tester.out, at, "kicked sandbox");
    let (line, _) = wait_for_said(&said, "irc-bot: #test: kicked by tester (enough)", skip);
    let kicked = said.lock().unwrap()[line].1.clone();
    assert!(
        kicked.ends_with(
            "its running turn stopped, 1 queued message(s) and 0 queued line(s) dropped; not joining again until invited"
        ),
        "{kicked}"
    );
    // Both turns end stopped; the waiting one never ran.
    let body = std::cell::RefCell::new(String::new());
    wait_until_or(
        "two turns to end stopped",
        || {
            *body.borrow_mut() = scrape(&metrics);
            metric_sum(&body.borrow(), "roundtable_turns_total{") == 3.0
        },
        || body.borrow().clone(),
    );
    assert_eq!(
        metric_sum(&body.borrow(), "roundtable_turns_total{outcome=\"stopped\""),
        2.0,
        "{}",
        body.borrow()
    );
    assert!(!files_under(&d.join("ws"))
        .iter()
        .any(|(p, _)| p.ends_with("queued-before-the-kick")));
    // Withdrawn: the queue is empty, and no container is kept or prepared for the channel
    // (stopping its turn prepared the next one's).
    assert_eq!(
        metric_sum(&body.borrow(), "roundtable_queue_depth "),
        0.0,
        "{}",
        body.borrow()
    );
    wait_until("no container left for the channel", || {
        containers_of(d).is_empty()
    });
    // Out of the channel, and not back by itself (it used to join again at once).
    std::thread::sleep(Duration::from_secs(2));
    let log = std::fs::read_to_string(&tester.out).unwrap();
    assert!(
        !log.lines().skip(at).any(|l| l.contains("sandbox(")),
        "{log}"
    );
    // Invited back, it joins and answers.
    tester.server.say("/INVITE sandbox #test");
    let (at, _) = expect(&tester.out, at, "sandbox(");
    say_seen(&mut tester.chan, &tester.out, at, "sandbox: back again");
    let (_, reply) = expect(&tester.out, at, "<sandbox> tester: ");
    assert!(
        reply.contains("read it back (tester: back again)"),
        "{reply}"
    );

    stop_bot(bot, &said, echo, d);
}

/// Every file under `dir`, read whole (a workspace: the guest's session and notes).
fn files_under(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                dirs.push(path);
            } else if meta.is_file() {
                let bytes = std::fs::read(&path).unwrap();
                out.push((path, bytes));
            }
        }
    }
    out
}

fn holds(bytes: &[u8], needle: &str) -> bool {
    bytes.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Issue 43 item 6: the bot's per-speaker limits count the sender by a keyed hash of their
/// host, not the nick. With `speaker_turns_per_minute = 2`, a client's third message is
/// refused, and three `NICK` changes on the same connection get no more turns in that
/// minute (each new nick is refused, answered by its nick); a client on another host (the
/// server's `::1`) has limits of its own. The host (the cloak ngIRCd gives every client, a
/// marker here) reaches neither the guest (its workspace: the session the model saw) nor
/// the audit trail, the bot's stderr, the metrics or the state file; the nick does.
#[test]
fn a_nick_change_gets_no_fresh_limits_and_the_host_reaches_no_guest() {
    const CLOAK: &str = "rt-cloak-5e1d.test";
    let dir = scratch("rtk-");
    let d = dir.path();
    let port = free_port();
    let _server = start_server_with(d, port, BOTH, &format!("CloakHost = guest-%x.{CLOAK}\n"));
    let state = d.join("budgets.sqlite");
    let audit = d.join("audit.jsonl");
    let config = floor_config_with(
        d,
        &format!(
            "[budgets]\nstate_file = \"{}\"\nspeaker_turns_per_minute = 2\n\
             [audit]\npath = \"{}\"\ninclude_text = true\n",
            state.display(),
            audit.display()
        ),
    );
    let (bot, said, echo) =
        start_bot_configured(d, port, "#test", &config, &["--metrics", "127.0.0.1:0"]);
    let metrics = metrics_addr(&said);
    let key_file = d.join("budgets.sqlite.irc-limits-key");
    wait_for_said(
        &said,
        &format!(
            "irc-bot: per-sender limits keyed on the sender's host (HMAC-SHA256, key made in {})",
            key_file.display()
        ),
        0,
    );
    let mut tester = start_client(d, port, "tester", "#test");
    // The server gives the client the cloak as its host (its welcome names it): what the bot
    // sees in the prefix of each of its messages.
    wait_until("the cloaked host", || {
        std::fs::read_to_string(&tester.server_out).is_ok_and(|t| t.contains(CLOAK))
    });

    let mut at = 0;
    for text in ["first", "second"] {
        say_seen(
            &mut tester.chan,
            &tester.out,
            at,
            &format!("sandbox: {text}"),
        );
        let (next, reply) = expect(&tester.out, at, "<sandbox> tester: ");
        assert!(
            reply.contains(&format!("read it back (tester: {text})")),
            "{reply}"
        );
        at = next;
    }
    let refused = "error: budget speaker_turns_per_minute exceeded: this speaker has started 2 turns in the last minute; try again in ";
    say_seen(&mut tester.chan, &tester.out, at, "sandbox: third");
    let (next, reply) = expect(&tester.out, at, "<sandbox> tester: ");
    assert!(reply.contains(refused), "{reply}");
    at = next;
    // New nicks on the same connection: the same sender, no fresh limits.
    for nick in ["tester2", "tester3", "tester4"] {
        tester.server.say(&format!("/n {nick}"));
        wait_until(&format!("the nick {nick}"), || {
            std::fs::read_to_string(&tester.out).is_ok_and(|t| t.contains(nick))
                || std::fs::read_to_string(&tester.server_out).is_ok_and(|t| t.contains(nick))
        });
        say_seen(
            &mut tester.chan,
            &tester.out,
            at,
            &format!("sandbox: as {nick}"),
        );
        let (next, reply) = expect(&tester.out, at, &format!("<sandbox> {nick}: "));
        assert!(reply.contains(refused), "{nick} got a turn: {reply}");
        at = next;
    }
    // Another host: limits of its own.
    let mut other = start_client_at(d, OTHER_HOST, port, "other", "#test");
    let from = log_len(&other.out);
    say_seen(&mut other.chan, &other.out, from, "sandbox: my turn");
    let (_, reply) = expect(&other.out, from, "<sandbox> other: ");
    assert!(reply.contains("read it back (other: my turn)"), "{reply}");

    let scraped = scrape(&metrics);
    assert!(
        !scraped.contains(CLOAK) && !scraped.contains("irc-host:"),
        "{scraped}"
    );
    stop_bot(bot, &said, echo, d);

    // The audit trail: a line per turn (two run, four refused, the other host's), each with
    // the nick as its speaker, never the host nor its key.
    let trail = std::fs::read_to_string(&audit).unwrap();
    assert!(
        !trail.contains(CLOAK) && !trail.contains("irc-host:"),
        "{trail}"
    );
    let mut speakers: Vec<String> = trail
        .lines()
        .map(|l| {
            let line: serde_json::Value = serde_json::from_str(l).unwrap();
            line["speaker"].as_str().unwrap().to_owned()
        })
        .collect();
    speakers.sort();
    assert_eq!(
        speakers,
        ["other", "tester", "tester", "tester", "tester2", "tester3", "tester4"],
        "{trail}"
    );
    // The guest's workspace (its session: what the model saw of each turn) holds the nicks'
    // messages, never the host.
    let files = files_under(&d.join("ws"));
    assert!(
        files.iter().any(|(_, b)| holds(b, "tester: second")),
        "no session found under {}",
        d.join("ws").display()
    );
    for (path, bytes) in &files {
        assert!(!holds(bytes, CLOAK), "{} holds the host", path.display());
    }
    // The bot's own lines.
    let said = lines_of(&said);
    assert!(
        !said
            .iter()
            .any(|l| l.contains(CLOAK) || l.contains("irc-host:")),
        "{said:?}"
    );
    // The state file counts the sender's key: never the host, never a nick.
    let mut kept = Vec::new();
    for f in ["budgets.sqlite", "budgets.sqlite-wal"] {
        kept.extend(std::fs::read(d.join(f)).unwrap_or_default());
    }
    assert!(holds(&kept, "irc-host:"), "no key counted");
    assert!(!holds(&kept, CLOAK) && !holds(&kept, "tester"));
    // The secret: 32 bytes, the service user's alone.
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(&key_file).unwrap();
    assert_eq!(
        (meta.permissions().mode() & 0o7777, meta.len()),
        (0o600, 32)
    );
}

/// The address the bot said its metrics are served at.
fn metrics_addr(said: &Said) -> String {
    let (i, _) = wait_for_said(said, "irc-bot: metrics at http://", 0);
    let line = said.lock().unwrap()[i].1.clone();
    let rest = line.split_once("http://").unwrap().1;
    rest.strip_suffix("/metrics").unwrap_or(rest).to_owned()
}

/// A GET of `/metrics` at `addr`: the body.
fn scrape(addr: &str) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    body.to_owned()
}

/// The sum of the samples whose line starts with `prefix` (a metric's name and `{`, maybe
/// its first label).
fn metric_sum(body: &str, prefix: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// A message whose turn prints long lines (the offline model shows a `run:` command's whole
/// output): each reply is many long IRC lines. Padded to a long message.
fn flood_message(i: usize) -> String {
    let mut m = format!(
        "sandbox: run: for n in 1 2 3 4 5 6 7 8; do printf 'flood {i} line %s %0300d\\n' $n 0; done #"
    );
    while m.len() < 440 {
        m.push('x');
    }
    m
}

/// Both loopback addresses: clients on `127.0.0.1` and on [`OTHER_HOST`] are distinct
/// senders to the bot (its per-sender limits key on the host).
const BOTH: &str = "127.0.0.1,::1";
/// `::1` as ii must be given it: ii names the server in its `USER` line, where a leading `:`
/// would start the trailing parameter.
const OTHER_HOST: &str = "0::1";

/// Issue 21: one guest floods #a with 30 long messages (each a reply of many long lines)
/// while another guest asks once in #b. The bot paces its output under ngIRCd's flood rules
/// (the server never throttles it into a 34 s delay nor disconnects it), serves the two
/// channels in turn, so #b's answer is posted within 2 s of being ready, caps the flooding
/// guest's output with a notice (the asking guest connects from another address: guests on
/// one host share their output budget, issue 43), keeps its outbox bounded, and shows the reply's controls
/// escaped. Then ngIRCd is killed and started again: the bot reconnects, rejoins and answers.
#[test]
fn a_flooding_guest_delays_no_other_channel_and_the_bot_survives_a_server_restart() {
    let dir = scratch("rtf-");
    let d = dir.path();
    let port = free_port();
    let server = start_server_with(d, port, BOTH, "");
    let (bot, said, echo) = start_bot(d, port, "#a,#b");
    let Client {
        _proc: flooder_proc,
        chan: mut flooder_chan,
        out: flooder_out,
        server: flooder_server,
        server_out: flooder_server_out,
    } = start_client(d, port, "flooder", "#a");
    let mut asker = start_client_at(d, OTHER_HOST, port, "asker", "#b");

    // One a second, for 30 s: faster, ngIRCd's own flood rule would disconnect the flooding
    // client (its unread input past 2 KiB) and end the flood early.
    let flood = std::thread::spawn(move || {
        for i in 0..30 {
            flooder_chan.say(&flood_message(i));
            std::thread::sleep(Duration::from_secs(1));
        }
        flooder_chan
    });
    let flooder = Client {
        _proc: flooder_proc,
        chan: Fifo::open(&d.join("ii-flooder/127.0.0.1/#a/in")),
        out: flooder_out,
        server: flooder_server,
        server_out: flooder_server_out,
    };
    // The flood is under way: the bot is posting its first reply in #a (6 long lines, 9 s
    // of pacing) and more are coming.
    expect(&flooder.out, 0, "<sandbox> flooder: ");
    let skip_said = said.lock().unwrap().len();

    let asked_at = Instant::now();
    say_seen(&mut asker.chan, &asker.out, 0, "sandbox: a short question");
    let (_, answer) = expect(&asker.out, 0, "<sandbox> asker: ");
    let answered_at = Instant::now();
    eprintln!(
        "#b answered {} ms after it was asked",
        (answered_at - asked_at).as_millis()
    );
    let (_, ready_at) = wait_for_said(&said, "#b: reply for asker ready", skip_said);
    let (line, _) = wait_for_said(&said, "#b: reply for asker posted in ", skip_said);
    let posted_ms: u64 = said.lock().unwrap()[line]
        .1
        .split("posted in ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the bot says how long the reply waited");
    let seen_ms = answered_at.saturating_duration_since(ready_at).as_millis();
    eprintln!("#b: the bot posted its reply {posted_ms} ms after it was ready; ii showed it {seen_ms} ms after");
    // The bar of issue 21: 2 s from the reply (one line) being ready to its line on the wire,
    // measured by the bot; what the client saw includes ngIRCd's own penalty time and this
    // test's 50 ms polling, on a loaded machine: generous.
    assert!(
        posted_ms <= 2000,
        "#b waited {posted_ms} ms behind #a's flood"
    );
    assert!(
        seen_ms <= 5000,
        "#b's answer reached the client {seen_ms} ms after it was ready"
    );

    assert!(
        answer.contains("read it back (asker: a short question)"),
        "{answer}"
    );
    // #b went ahead of lines #a had queued before it: #a's reply goes on after #b's.
    expect(&flooder.out, log_len(&flooder.out), "<sandbox> flooder: ");
    let flood = flood.join().unwrap();

    // The flooding guest's output is capped, with one clear notice.
    let (_, notice) = expect(&flooder.out, 0, "<sandbox> * flooder: output truncated, ");
    assert!(notice.contains("line(s) dropped"), "{notice}");
    // The outbox stays bounded: what the bot says of its queues.
    let depths: Vec<usize> = said
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(_, l)| l.split("outbox ").nth(1)?.split('/').next()?.parse().ok())
        .collect();
    assert!(!depths.is_empty(), "the bot reported no drop");
    // The cap, and one notice past it.
    assert!(depths.iter().all(|&n| n <= 17), "{depths:?}");

    // ngIRCd never cut the bot off for flooding: paced, it stayed under the server's rules.
    assert!(
        !said
            .lock()
            .unwrap()
            .iter()
            .any(|(_, l)| l.contains("reconnecting in")),
        "the server closed the bot's link during the flood: {:?}",
        said.lock().unwrap()
    );

    // The server goes away and comes back: the bot reconnects (with backoff), rejoins and
    // answers; the sandbox and its channels were never touched.
    drop(flood);
    drop(flooder);
    drop(asker);
    drop(server);
    let skip = said.lock().unwrap().len();
    wait_for_said(&said, "reconnecting in", skip);
    let _server = start_server_with(d, port, BOTH, "");
    wait_for_said(&said, "registered; joining", skip);
    let mut again = start_client_at(d, OTHER_HOST, port, "again", "#b");
    let from = log_len(&again.out);
    say_seen(&mut again.chan, &again.out, from, "sandbox: are you back");
    let (_, reply) = expect(&again.out, from, "<sandbox> again: ");
    assert!(
        reply.contains("read it back (again: are you back)"),
        "{reply}"
    );
    // #b's session went on across the reconnect.
    assert!(reply.contains("holds 1 earlier message(s)"), "{reply}");

    stop_bot(bot, &said, echo, d);
}

/// The containers (any state) of the bot's own runtime: labelled with the instance its
/// config names (never the project-wide label, which other runtimes on the engine share).
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
