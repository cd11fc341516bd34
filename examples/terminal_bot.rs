//! A terminal chat bot on actix: every line on stdin is a chat message.
//!
//! ```text
//! #general ann: write me a note      a guest message (channel, speaker, text)
//! /reset #general                    the channel's next turn starts a fresh session
//! /stop #general                     stop the channel's running turn
//! /status                            channels, queues, pending resets
//! ```
//!
//! Each message goes to the [`SandboxSupervisor`] as a [`GuestMessage`]; replies are
//! printed as they arrive, as `[#channel] > text` (or `[#channel] error: …`), each further
//! line of the reply as `[#channel] | text`. A reply is model output: every control
//! character in it is shown as an escape (`\u{1b}`, see `roundtable_sandbox::display`) and
//! none of its lines can pass for one of the bot's own (`[#channel] reset: …`). On a terminal a
//! status line shows where each turn is; when stdout is not a terminal only plain lines are
//! printed. Without an API key the embedded offline model is used (see `--help`).

#![forbid(unsafe_code)]

use std::io::{IsTerminal, Write};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use roundtable_sandbox::display;
use roundtable_sandbox::events::{Event, EventKind};
use roundtable_sandbox::settings::{Settings, SETTINGS_NOTE};
use roundtable_sandbox_actors::{
    ChannelState, GuestMessage, SandboxSupervisor, Shutdown, Speaker, StartFresh, Status, Stop,
    SupervisorOptions, TurnPhase,
};
use roundtable_sandbox_examples::{serve_metrics, BotArgs, RollDice};
use roundtable_sandbox_metrics::MetricsArgs;
use tokio::io::AsyncBufReadExt;

/// A terminal chat bot: each line on stdin is a chat message, run as a sealed turn.
///
/// Lines: `#channel name: text` (a message), `/reset #channel` (the next turn starts a
/// fresh session), `/stop #channel` (stop the running turn), `/status`.
#[derive(Debug, Parser)]
#[command(name = "terminal-bot", version, after_help = SETTINGS_NOTE)]
struct Cli {
    #[command(flatten)]
    bot: BotArgs,
}

#[actix::main]
async fn main() -> std::process::ExitCode {
    roundtable_sandbox_examples::bot_main(
        "terminal-bot",
        |cli: &Cli| cli.bot.completions,
        |cli: Cli| run(cli.bot.settings, cli.bot.metrics),
    )
    .await
}

/// One line of input.
#[derive(Debug, PartialEq)]
enum Line {
    Message {
        channel: String,
        speaker: String,
        text: String,
    },
    Reset(String),
    Stop(String),
    Status,
    Blank,
}

/// The longest line read (a guest's message is far shorter): a longer one is skipped, to
/// its end, with a note on stderr, and the lines after it are read as before.
const LINE_CAP: usize = 64 * 1024;

/// Stdin's lines, bounded: at most [`LINE_CAP`] bytes are held, and bytes that are not
/// UTF-8 are read as U+FFFD (a pipe from a chat bridge can carry both; neither stops the
/// bot). Cancel safe: a partial line stays in `buf` for the next call.
struct Lines<R> {
    reader: tokio::io::BufReader<R>,
    buf: Vec<u8>,
    skipping: bool,
}

impl<R: tokio::io::AsyncRead + Unpin> Lines<R> {
    fn new(read: R) -> Self {
        Self {
            reader: tokio::io::BufReader::new(read),
            buf: Vec::new(),
            skipping: false,
        }
    }

    async fn next_line(&mut self) -> std::io::Result<Option<String>> {
        use tokio::io::AsyncReadExt;
        loop {
            let room = (LINE_CAP - self.buf.len().min(LINE_CAP)) as u64;
            let read = (&mut self.reader)
                .take(room.max(1))
                .read_until(b'\n', &mut self.buf)
                .await?;
            let ended = self.buf.last() == Some(&b'\n');
            if read == 0 && self.buf.is_empty() {
                return Ok(None);
            }
            if !ended && read != 0 {
                if self.buf.len() >= LINE_CAP {
                    if !self.skipping {
                        eprintln!("terminal-bot: a line longer than {LINE_CAP} bytes was skipped");
                    }
                    self.buf.clear();
                    self.skipping = true;
                }
                continue;
            }
            let line = String::from_utf8_lossy(&self.buf).into_owned();
            self.buf.clear();
            if std::mem::take(&mut self.skipping) {
                continue;
            }
            return Ok(Some(line.trim_end_matches(['\n', '\r']).to_owned()));
        }
    }
}

fn parse(line: &str) -> Result<Line, String> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(Line::Blank);
    }
    let channel_arg = |rest: &str| {
        let c = rest.trim();
        if c.starts_with('#') && !c.contains(char::is_whitespace) {
            Ok(c.to_owned())
        } else {
            Err(format!("expected a #channel, got {c:?}"))
        }
    };
    if let Some(rest) = line.strip_prefix("/reset") {
        return channel_arg(rest).map(Line::Reset);
    }
    if let Some(rest) = line.strip_prefix("/stop") {
        return channel_arg(rest).map(Line::Stop);
    }
    if line == "/status" {
        return Ok(Line::Status);
    }
    let Some((channel, rest)) = line.split_once(char::is_whitespace) else {
        return Err("expected `#channel name: text`".into());
    };
    let Some((speaker, text)) = rest.split_once(':') else {
        return Err("expected `#channel name: text`".into());
    };
    let (speaker, text) = (speaker.trim(), text.trim());
    if !channel.starts_with('#') || speaker.is_empty() || text.is_empty() {
        return Err("expected `#channel name: text`".into());
    }
    Ok(Line::Message {
        channel: channel.to_owned(),
        speaker: speaker.to_owned(),
        text: text.to_owned(),
    })
}

/// How the first line of an answer starts (after `[#channel] `).
const REPLY: &str = "> ";
/// How the first line of an error starts.
const ERROR: &str = "error: ";
/// How every further line of an answer or an error starts: the bot's own lines never do.
const CONTINUED: &str = "| ";

/// The lines printed for an answer (or an error): every line of the text escaped
/// ([`display`]) and prefixed with the channel, the first with `mark`, the others with
/// [`CONTINUED`], so no line of a guest's or a model's text can pass for one of the bot's
/// own (`[#ops] reset: …`).
fn reply_lines(channel: &str, mark: &str, text: &str) -> String {
    let channel = display::escape(channel);
    let mut out = String::new();
    for (i, line) in display::lines(text).iter().enumerate() {
        let mark = if i == 0 { mark } else { CONTINUED };
        out.push_str(&format!("[{channel}] {mark}{line}\n"));
    }
    out
}

/// The reply tasks still due: each message's task is kept until it ends, pruned at every
/// new one (a bot fed by a chat bridge for days holds only the answers still to come, not
/// one handle per line it ever read), and awaited at the end.
#[derive(Debug, Default)]
struct Pending(Vec<tokio::task::JoinHandle<()>>);

impl Pending {
    /// Keeps `task`, dropping the handles of the tasks that have ended.
    fn push(&mut self, task: tokio::task::JoinHandle<()>) {
        self.0.retain(|t| !t.is_finished());
        self.0.push(task);
    }

    /// Waits for every task kept.
    async fn wait(&mut self) {
        for t in self.0.drain(..) {
            let _ = t.await;
        }
    }
}

fn phase_text(phase: TurnPhase) -> Option<&'static str> {
    Some(match phase {
        TurnPhase::Preparing => "preparing the workspace and broker",
        TurnPhase::BrokerListening => "starting the sealed container",
        TurnPhase::ContainerRunning => "the agent is working in its container",
        TurnPhase::ModelCall => "the agent asked the model",
        TurnPhase::ToolCall => "the agent called a host tool",
        TurnPhase::Replied => "the agent replied",
        TurnPhase::TearingDown => "removing the container",
        _ => return None,
    })
}

/// A message's progress as a person reads it, from its channel's events (a channel runs
/// one turn at a time).
fn describe(event: &EventKind) -> Option<String> {
    Some(match event {
        EventKind::Queued { depth } => format!("queued behind {depth} turn(s)"),
        EventKind::WaitingForSlot => "waiting for a free container slot".into(),
        EventKind::Phase(phase) => match phase {
            TurnPhase::Replied | TurnPhase::TearingDown | TurnPhase::Done => return None,
            phase => phase_text(*phase)?.into(),
        },
        _ => return None,
    })
}

/// The channels this bot has sent messages to, by the short hash events name them by.
type Channels = Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>;

/// A channel's state as a person reads it.
fn state_text(state: ChannelState) -> String {
    match state {
        ChannelState::Idle => "idle".into(),
        ChannelState::WaitingForSlot => "waiting for a free container slot".into(),
        ChannelState::Running(phase) => phase_text(phase).unwrap_or("finishing").into(),
        ChannelState::Stopping => "stopping".into(),
    }
}

async fn run(settings: Settings, metrics: MetricsArgs) -> Result<()> {
    let (mut config, offline) = settings.build().await.context("configuration")?;
    config.tools.push(Arc::new(RollDice));
    let tty = std::io::stdout().is_terminal();
    let mut supervisor = SupervisorOptions::new(config);
    let channels = Channels::default();
    if tty {
        let names = channels.clone();
        supervisor.config.observer = Some(Arc::new(move |event: &Event| {
            let Some(what) = describe(&event.kind) else {
                return;
            };
            let name = event
                .channel
                .as_deref()
                .and_then(|short| names.lock().unwrap().get(short).cloned());
            if let Some(name) = name {
                eprint!("\r\x1b[2K  {} … {what}", display::escape(&name));
            }
        }));
    }
    // Kept to the end of the run: dropping it stops the endpoint.
    let _metrics = serve_metrics("terminal-bot", &metrics, &mut supervisor)?;
    let (sandbox, swept) = SandboxSupervisor::start_with_sweep(supervisor).await?;
    eprintln!(
        "terminal-bot: ready ({}; removed {} leftover container(s)). Type `#general ann: hello`.",
        if offline.is_some() {
            "embedded offline model"
        } else {
            "configured model"
        },
        swept.containers.len()
    );

    let mut pending = Pending::default();
    let mut lines = Lines::new(tokio::io::stdin());
    let stop = roundtable_sandbox_examples::stop_signal();
    tokio::pin!(stop);
    let mut signalled = false;
    loop {
        let line = tokio::select! {
            line = lines.next_line() => match line.context("read stdin")? {
                Some(line) => line,
                None => break,
            },
            () = &mut stop => {
                eprintln!("terminal-bot: stopping on a signal");
                signalled = true;
                break;
            }
        };
        match parse(&line) {
            Ok(Line::Blank) => {}
            Ok(Line::Message {
                channel,
                speaker,
                text,
            }) => {
                let addr = sandbox.clone();
                let who = Speaker {
                    id: speaker.clone(),
                    name: speaker,
                };
                let short = roundtable_sandbox::ChannelId::new(&channel)
                    .short()
                    .to_owned();
                channels.lock().unwrap().insert(short, channel.clone());
                // Queued now, not when the task first runs: a `/reset` read in the same
                // batch, sent inline after it, would otherwise be stamped first.
                let answer = addr.send(GuestMessage::new(&channel, who, text));
                pending.push(actix::spawn(async move {
                    let answer = answer.await;
                    let (mark, text) = match answer {
                        Ok(Ok(outcome)) if outcome.reply.ok => {
                            (REPLY, outcome.reply.text.unwrap_or_default())
                        }
                        Ok(Ok(outcome)) => (ERROR, outcome.reply.error.unwrap_or_default()),
                        Ok(Err(e)) => (ERROR, e.to_string()),
                        Err(e) => (ERROR, e.to_string()),
                    };
                    let shown = reply_lines(&channel, mark, &text);
                    let mut out = std::io::stdout().lock();
                    if tty {
                        eprint!("\r\x1b[2K");
                    }
                    // One write of the whole reply: another channel's lines never fall
                    // between its lines.
                    let _ = out.write_all(shown.as_bytes());
                    let _ = out.flush();
                }));
            }
            Ok(Line::Reset(channel)) => {
                sandbox
                    .send(StartFresh {
                        channel: channel.clone(),
                    })
                    .await?;
                println!(
                    "[{}] reset: the next turn starts a fresh session",
                    display::escape(&channel)
                );
            }
            Ok(Line::Stop(channel)) => {
                let active = sandbox
                    .send(Stop {
                        channel: channel.clone(),
                    })
                    .await?;
                println!(
                    "[{}] stop: {}",
                    display::escape(&channel),
                    if active {
                        "the running turn was stopped"
                    } else {
                        "nothing was running"
                    }
                );
            }
            Ok(Line::Status) => {
                let report = sandbox.send(Status).await?;
                for c in &report.channels {
                    println!(
                        "[{}] {}, {} queued{}",
                        display::escape(&c.channel),
                        state_text(c.state),
                        c.queued,
                        if c.pending_reset > 0 {
                            ", the next turn starts a fresh session"
                        } else {
                            ""
                        }
                    );
                }
                println!(
                    "status: {} live channel(s), {} busy, {} queued",
                    report.totals.live_channels, report.totals.busy_channels, report.totals.queued
                );
            }
            Err(e) => eprintln!("terminal-bot: {}", display::escape(&e)),
        }
    }
    // At the end of stdin the answers still due are awaited; on a signal the running turns
    // are stopped first (their waiters then print how they ended).
    if !signalled {
        pending.wait().await;
    }
    let report = sandbox.send(Shutdown).await?;
    pending.wait().await;
    eprintln!(
        "terminal-bot: shut down ({} running turn(s) stopped, {} queued message(s) refused)",
        report.stopped_turns, report.refused_queued
    );
    drop(offline);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[actix_rt::test]
    async fn stdin_lines_are_bounded_and_any_bytes_are_read() {
        let mut input = b"#a ann: caf\xe9\r\n".to_vec();
        input.extend(vec![b'x'; LINE_CAP * 2 + 7]);
        input.extend(b"\n#a ann: after\n\n#b bob: last");
        let mut lines = Lines::new(&input[..]);
        let mut got = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            got.push(line);
        }
        assert_eq!(
            got,
            ["#a ann: caf\u{fffd}", "#a ann: after", "", "#b bob: last"]
        );
        // A line of exactly the cap is read whole.
        let mut input = vec![b'y'; LINE_CAP - 1];
        input.push(b'\n');
        let mut lines = Lines::new(&input[..]);
        assert_eq!(
            lines.next_line().await.unwrap().unwrap().len(),
            LINE_CAP - 1
        );
        assert_eq!(lines.next_line().await.unwrap(), None);
    }

    /// A bot fed line after line keeps the handles of the answers still due, not one per
    /// line it ever read.
    #[actix_rt::test]
    async fn the_reply_tasks_that_ended_are_not_kept() {
        let mut pending = Pending::default();
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        pending.push(actix::spawn(async move {
            let _ = held.await;
        }));
        for _ in 0..1000 {
            pending.push(actix::spawn(async {}));
            tokio::task::yield_now().await;
        }
        // The task still due and the latest one (maybe not yet run).
        assert!(pending.0.len() <= 3, "{} kept", pending.0.len());
        assert!(!pending.0[0].is_finished());
        release.send(()).unwrap();
        pending.wait().await;
        assert!(pending.0.is_empty());
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["terminal-bot", "--offline", "--run-root", "/r"]).unwrap();
        assert!(cli.bot.settings.offline);
        let e = Cli::try_parse_from(["terminal-bot", "--ofline"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
        assert!(
            e.to_string()
                .contains("tip: a similar argument exists: '--offline'"),
            "{e}"
        );
    }

    #[test]
    fn metrics_are_served_on_loopback_unless_allowed() {
        let cli = Cli::try_parse_from(["terminal-bot"]).unwrap();
        assert_eq!(cli.bot.metrics.address().unwrap(), None);
        let cli = Cli::try_parse_from(["terminal-bot", "--metrics"]).unwrap();
        assert_eq!(
            cli.bot.metrics.address().unwrap(),
            Some("127.0.0.1:9464".parse().unwrap())
        );
        let cli = Cli::try_parse_from(["terminal-bot", "--metrics", "0.0.0.0:9464"]).unwrap();
        assert_eq!(
            cli.bot.metrics.address().unwrap_err().to_string(),
            "metrics address 0.0.0.0:9464 is not a loopback address (give --metrics-allow-remote to serve metrics beyond this host)"
        );
        let cli = Cli::try_parse_from([
            "terminal-bot",
            "--metrics",
            "0.0.0.0:9464",
            "--metrics-allow-remote",
        ])
        .unwrap();
        assert!(cli.bot.metrics.address().unwrap().is_some());
        let e = Cli::try_parse_from(["terminal-bot", "--metrics-allow-remote"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        let e = Cli::try_parse_from(["terminal-bot", "--metrics", "localhost"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
    }

    #[test]
    fn states_read_as_words() {
        assert_eq!(state_text(ChannelState::Idle), "idle");
        assert_eq!(
            state_text(ChannelState::Running(TurnPhase::ContainerRunning)),
            "the agent is working in its container"
        );
    }

    #[test]
    fn a_reply_line_cannot_pass_for_the_bots_own() {
        let shown = reply_lines(
            "#a",
            REPLY,
            "ok\n[#ops] reset: the next turn starts a fresh session\r\n\u{1b}[2K\r[#a] stop: x",
        );
        assert_eq!(
            shown,
            "[#a] > ok\n[#a] | [#ops] reset: the next turn starts a fresh session\n\
             [#a] | \\u{1b}[2K\\u{d}[#a] stop: x\n"
        );
        assert_eq!(reply_lines("#a\u{9b}", ERROR, ""), "[#a\\u{9b}] error: \n");
    }

    #[test]
    fn parses_lines() {
        assert_eq!(
            parse("#general ann: hello there"),
            Ok(Line::Message {
                channel: "#general".into(),
                speaker: "ann".into(),
                text: "hello there".into()
            })
        );
        assert_eq!(parse("/reset #a"), Ok(Line::Reset("#a".into())));
        assert_eq!(parse("/stop #a"), Ok(Line::Stop("#a".into())));
        assert_eq!(parse("/status"), Ok(Line::Status));
        assert_eq!(parse("  "), Ok(Line::Blank));
        assert!(parse("general ann: hi").is_err());
        assert!(parse("#general ann").is_err());
        assert!(parse("/reset general").is_err());
    }
}
