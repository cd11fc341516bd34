//! An IRC bot on actix: each IRC channel is a sandbox channel, each nick the speaker.
//!
//! ```text
//! irc-bot --server 127.0.0.1:6667 --nick sandbox --join '#general,#dev' [settings flags]
//! ```
//!
//! In a joined channel, a message addressed to the bot (`sandbox: write me a haiku`) becomes
//! a [`GuestMessage`] for the channel `irc:#general` from the speaker `nick`; the reply is
//! posted back to the channel, addressed to that nick. `!reset` starts the channel's next
//! turn with a fresh session; `!stop` stops its running turn.
//!
//! Replies are model output, so they are hostile: control characters are removed, each
//! line is posted as its own `PRIVMSG` (no line can smuggle an IRC command) and long
//! replies are cut.

#![forbid(unsafe_code)]

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use roundtable_sandbox::settings::{Settings, SETTINGS_NOTE};
use roundtable_sandbox_actors::{
    GuestMessage, SandboxSupervisor, Shutdown, Speaker, StartFresh, Stop, SupervisorOptions,
    TurnFailure,
};
use roundtable_sandbox_examples::{print_completions, RollDice};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// An IRC bot: each IRC channel is a sandbox channel, each nick the speaker. A message
/// addressed to the bot (`sandbox: write me a haiku`) runs as a sealed turn; `!reset` and
/// `!stop` reset or stop the channel's turn.
#[derive(Debug, Parser)]
#[command(name = "irc-bot", version, after_help = SETTINGS_NOTE)]
struct Cli {
    /// The IRC server
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:6667")]
    server: String,
    /// The bot's nick
    #[arg(long, default_value = "sandbox")]
    nick: String,
    /// The channels to join, comma-separated
    #[arg(
        long,
        value_name = "#a,#b",
        value_delimiter = ',',
        default_value = "#general"
    )]
    join: Vec<String>,
    #[command(flatten)]
    settings: Settings,
    /// Print a completion script for SHELL and exit
    #[arg(long, value_name = "SHELL", value_enum)]
    completions: Option<clap_complete::Shell>,
}

/// Longest text of one posted line (IRC lines are at most 512 bytes with the prefix).
const LINE_BYTES: usize = 380;
/// Most lines of one reply.
const MAX_LINES: usize = 6;

#[actix::main]
async fn main() -> std::process::ExitCode {
    // Before any secret is read: no other process of this user may read this one's memory
    // or environment (the key is read from OPENAI_API_KEY or a file).
    if let Err(e) = roundtable_sandbox::make_process_private() {
        eprintln!("error: make the process private (not dumpable): {e}");
        return std::process::ExitCode::FAILURE;
    }
    // Usage errors print clap's message and exit 2; `--help` and `--version` exit 0.
    let cli = Cli::parse();
    if let Some(shell) = cli.completions {
        return print_completions::<Cli>(shell);
    }
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            roundtable_sandbox_examples::print_error("irc-bot", &e);
            std::process::ExitCode::from(2)
        }
    }
}

/// A parsed IRC line: prefix nick, command, params (the trailing one included).
#[derive(Debug, PartialEq)]
struct IrcLine {
    nick: Option<String>,
    command: String,
    params: Vec<String>,
}

fn parse_line(line: &str) -> Option<IrcLine> {
    let line = line.trim_end_matches(['\r', '\n']);
    let (prefix, rest) = match line.strip_prefix(':') {
        Some(r) => {
            let (p, rest) = r.split_once(' ')?;
            (Some(p), rest)
        }
        None => (None, line),
    };
    let (head, trailing) = match rest.split_once(" :") {
        Some((h, t)) => (h, Some(t)),
        None => (rest, None),
    };
    let mut words = head.split(' ').filter(|w| !w.is_empty());
    let command = words.next()?.to_ascii_uppercase();
    let mut params: Vec<String> = words.map(str::to_owned).collect();
    if let Some(t) = trailing {
        params.push(t.to_owned());
    }
    Some(IrcLine {
        nick: prefix.map(|p| p.split('!').next().unwrap_or(p).to_owned()),
        command,
        params,
    })
}

/// The lines to post for a reply: control characters removed, split on newlines and at
/// `LINE_BYTES` (on a char boundary), at most `MAX_LINES`.
fn reply_lines(to: &str, text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for raw in text.lines() {
        let clean: String = raw
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let mut rest = clean.trim();
        while !rest.is_empty() {
            let mut cut = rest.len().min(LINE_BYTES);
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            lines.push(rest[..cut].to_owned());
            rest = rest[cut..].trim_start();
        }
    }
    if lines.is_empty() {
        lines.push("(no answer)".into());
    }
    if lines.len() > MAX_LINES {
        lines.truncate(MAX_LINES);
        lines[MAX_LINES - 1].push_str(" …(cut)");
    }
    lines[0] = format!("{to}: {}", lines[0]);
    lines
}

async fn run(cli: Cli) -> Result<()> {
    let Cli {
        server,
        nick,
        join,
        settings,
        ..
    } = cli;
    let (mut config, offline) = settings.build().await.context("configuration")?;
    config.tools.push(Arc::new(RollDice));
    let sandbox = SandboxSupervisor::start(SupervisorOptions::new(config)).await?;

    let stream = tokio::net::TcpStream::connect(&server)
        .await
        .with_context(|| format!("connect to {server}"))?;
    let (read, mut write) = stream.into_split();
    let (out, mut outbox) = mpsc::unbounded_channel::<String>();
    let writer = actix::spawn(async move {
        while let Some(line) = outbox.recv().await {
            if write
                .write_all(format!("{line}\r\n").as_bytes())
                .await
                .is_err()
            {
                break;
            }
        }
    });
    out.send(format!("NICK {nick}"))?;
    out.send(format!("USER {nick} 0 * :roundtable-sandbox bot"))?;
    eprintln!(
        "irc-bot: connecting to {server} as {nick} ({})",
        if offline.is_some() {
            "embedded offline model"
        } else {
            "configured model"
        }
    );

    let mut lines = tokio::io::BufReader::new(read).lines();
    let stop = roundtable_sandbox_examples::stop_signal();
    tokio::pin!(stop);
    loop {
        let line = tokio::select! {
            line = lines.next_line() => match line? {
                Some(line) => line,
                None => {
                    eprintln!("irc-bot: the server closed the connection");
                    break;
                }
            },
            () = &mut stop => {
                eprintln!("irc-bot: stopping on a signal");
                let _ = out.send("QUIT :shutting down".to_owned());
                break;
            }
        };
        let Some(msg) = parse_line(&line) else {
            continue;
        };
        match msg.command.as_str() {
            "PING" => out.send(format!(
                "PONG :{}",
                msg.params.last().cloned().unwrap_or_default()
            ))?,
            "001" => {
                out.send(format!("JOIN {}", join.join(",")))?;
                eprintln!("irc-bot: registered; joining {}", join.join(","));
            }
            "433" => bail!("nick {nick} is in use"),
            "PRIVMSG" if msg.params.len() == 2 && msg.params[0].starts_with('#') => {
                let (target, text) = (msg.params[0].clone(), msg.params[1].trim().to_owned());
                let Some(from) = msg.nick.clone() else {
                    continue;
                };
                let channel = format!("irc:{}", target.to_lowercase());
                if text == "!reset" {
                    sandbox.send(StartFresh { channel }).await?;
                    out.send(format!(
                        "PRIVMSG {target} :{from}: reset: the next turn starts a fresh session"
                    ))?;
                } else if text == "!stop" {
                    let active = sandbox.send(Stop { channel }).await?;
                    let what = if active {
                        "the running turn was stopped"
                    } else {
                        "nothing was running"
                    };
                    out.send(format!("PRIVMSG {target} :{from}: stop: {what}"))?;
                } else if let Some(asked) = text
                    .strip_prefix(&format!("{nick}:"))
                    .or_else(|| text.strip_prefix(&format!("{nick},")))
                {
                    let asked = asked.trim().to_owned();
                    if asked.is_empty() {
                        continue;
                    }
                    let (addr, out) = (sandbox.clone(), out.clone());
                    actix::spawn(async move {
                        let speaker = Speaker {
                            id: from.clone(),
                            name: from.clone(),
                        };
                        let answer = addr.send(GuestMessage::new(&channel, speaker, asked)).await;
                        let text = match answer {
                            Ok(Ok(o)) if o.reply.ok => o.reply.text.unwrap_or_default(),
                            // A full queue is not worth an error line on a public channel.
                            Ok(Err(e)) if e.failure() == TurnFailure::Busy => {
                                "busy with earlier messages; ask again in a moment".to_owned()
                            }
                            Ok(Ok(o)) => format!("error: {}", o.reply.error.unwrap_or_default()),
                            Ok(Err(e)) => format!("error: {e}"),
                            Err(e) => format!("error: {e}"),
                        };
                        for l in reply_lines(&from, &text) {
                            let _ = out.send(format!("PRIVMSG {target} :{l}"));
                        }
                    });
                }
            }
            _ => {}
        }
    }
    let report = sandbox.send(Shutdown).await;
    if let Ok(report) = report {
        eprintln!(
            "irc-bot: shut down ({} running turn(s) stopped, {} queued message(s) refused)",
            report.stopped_turns, report.refused_queued
        );
    }
    writer.abort();
    drop(offline);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["irc-bot", "--join", "#a,#b", "--nick", "n"]).unwrap();
        assert_eq!(cli.join, ["#a", "#b"]);
        assert_eq!(
            (cli.server.as_str(), cli.nick.as_str()),
            ("127.0.0.1:6667", "n")
        );
        let defaults = Cli::try_parse_from(["irc-bot"]).unwrap();
        assert_eq!(defaults.join, ["#general"]);
        let e = Cli::try_parse_from(["irc-bot", "--server"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    }

    #[test]
    fn parses_irc_lines() {
        assert_eq!(
            parse_line(":ann!u@h PRIVMSG #Gen :sandbox: hi: there\r\n"),
            Some(IrcLine {
                nick: Some("ann".into()),
                command: "PRIVMSG".into(),
                params: vec!["#Gen".into(), "sandbox: hi: there".into()],
            })
        );
        assert_eq!(parse_line("PING :abc").unwrap().params, vec!["abc"]);
        assert_eq!(
            parse_line(":srv 001 sandbox :Welcome").unwrap().command,
            "001"
        );
    }

    #[test]
    fn hostile_replies_cannot_smuggle_commands() {
        let lines = reply_lines("ann", "ok\r\nQUIT :bye\u{7}\nJOIN #x");
        assert_eq!(lines, vec!["ann: ok", "QUIT :bye", "JOIN #x"]);
        // Each is sent as `PRIVMSG #chan :<line>`: a whole line is text, never a command.
        assert!(lines.iter().all(|l| !l.contains('\r') && !l.contains('\n')));
        let long = "é".repeat(1000);
        let lines = reply_lines("ann", &long);
        assert!(lines.iter().all(|l| l.len() <= LINE_BYTES + 10));
        let many = "x\n".repeat(20);
        let lines = reply_lines("ann", &many);
        assert_eq!(lines.len(), MAX_LINES);
        assert!(lines[MAX_LINES - 1].ends_with("…(cut)"));
    }
}
