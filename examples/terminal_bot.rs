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
//! printed as `[#channel] text` (or `[#channel] error: …`) as they arrive. On a terminal a
//! status line shows where each turn is; when stdout is not a terminal only plain lines are
//! printed. Without an API key the embedded offline model is used (see `--help`).

#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use roundtable_sandbox::settings::{Settings, FLAGS_HELP};
use roundtable_sandbox_actors::{
    GuestMessage, ProgressEvent, SandboxSupervisor, Shutdown, Speaker, StartFresh, Status, Stop,
    SupervisorConfig, TurnPhase, TurnProgress,
};
use roundtable_sandbox_examples::RollDice;
use tokio::io::AsyncBufReadExt;

const USAGE: &str = "usage: terminal-bot [flags]
Reads `#channel name: text` lines on stdin; `/reset #channel`, `/stop #channel`, `/status`.

flags:";

#[actix::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "terminal-bot: {}",
                roundtable_sandbox::error_chain(e.as_ref())
            );
            std::process::ExitCode::from(2)
        }
    }
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

fn describe(event: &ProgressEvent) -> Option<String> {
    Some(match event {
        ProgressEvent::Queued { ahead } => format!("queued behind {ahead} turn(s)"),
        ProgressEvent::WaitingForSlot => "waiting for a free container slot".into(),
        ProgressEvent::Phase(phase) => match phase {
            TurnPhase::Preparing => "preparing the workspace and broker".into(),
            TurnPhase::BrokerListening => "starting the sealed container".into(),
            TurnPhase::ContainerRunning => "the agent is working in its container".into(),
            TurnPhase::ModelCall => "the agent asked the model".into(),
            TurnPhase::ToolCall => "the agent called a host tool".into(),
            _ => return None,
        },
        _ => return None,
    })
}

async fn run() -> Result<()> {
    let mut settings = Settings::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--help" || arg == "-h" {
            println!("{USAGE}\n{FLAGS_HELP}");
            return Ok(());
        }
        if !settings
            .take_flag(&arg, &mut args)
            .map_err(anyhow::Error::msg)?
        {
            bail!("unknown argument {arg:?} (see --help)");
        }
    }
    let (mut config, offline) = settings.build().await.context("configuration")?;
    config.tools.push(Arc::new(RollDice));
    let tty = std::io::stdout().is_terminal();
    let mut supervisor = SupervisorConfig::new(config);
    if tty {
        supervisor.progress = Some(Arc::new(|p: &TurnProgress| {
            if let Some(what) = describe(&p.event) {
                eprint!("\r\x1b[2K  {} … {what}", p.channel);
            }
        }));
    }
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

    let mut pending = Vec::new();
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
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
                pending.push(actix::spawn(async move {
                    let answer = addr.send(GuestMessage::new(&channel, who, text)).await;
                    let line = match answer {
                        Ok(Ok(reply)) if reply.ok => reply.text.unwrap_or_default(),
                        Ok(Ok(reply)) => format!("error: {}", reply.error.unwrap_or_default()),
                        Ok(Err(e)) => format!("error: {e}"),
                        Err(e) => format!("error: {e}"),
                    };
                    if tty {
                        eprint!("\r\x1b[2K");
                    }
                    println!("[{channel}] {line}");
                }));
            }
            Ok(Line::Reset(channel)) => {
                sandbox
                    .send(StartFresh {
                        channel: channel.clone(),
                    })
                    .await?;
                println!("[{channel}] reset: the next turn starts a fresh session");
            }
            Ok(Line::Stop(channel)) => {
                let active = sandbox
                    .send(Stop {
                        channel: channel.clone(),
                    })
                    .await?;
                println!(
                    "[{channel}] stop: {}",
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
                        "[{}] {:?}, {} queued, pending reset {}",
                        c.channel, c.state, c.queued, c.pending_reset
                    );
                }
                println!(
                    "status: {} live channel(s), {} busy, {} queued",
                    report.totals.live_channels, report.totals.busy_channels, report.totals.queued
                );
            }
            Err(e) => eprintln!("terminal-bot: {e}"),
        }
    }
    for p in pending {
        let _ = p.await;
    }
    let report = sandbox.send(Shutdown).await?;
    eprintln!("terminal-bot: shut down ({report:?})");
    drop(offline);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
