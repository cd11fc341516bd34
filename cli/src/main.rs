//! `roundtable-sandbox`: the operator's command-line tool.
//!
//! - `doctor`: checks what a runtime needs (not root, Docker reachable, the image present,
//!   private roots, a short enough socket path), each with a fix hint; exits 1 on a failure;
//! - `explain`: the effective policy (mounts, limits, tools, MCP allow-lists, the model
//!   endpoint's host, the compaction settings), never a key;
//! - `turn`: one turn for a channel from the command line;
//! - `egress check`: one egress route's verdict on one request, nothing sent;
//! - `sweep`: removes this runtime's leftover containers and run dirs;
//! - `image build`: builds the guest image FROM scratch from the static guest and busybox.

#![forbid(unsafe_code)]

mod audit;
mod broker;
mod budgets;
mod check;
mod doctor;
mod egress;
mod host;
mod mcp;
mod metrics;
mod model;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory, Parser, Subcommand};
use roundtable_sandbox::operator::{self, ImageSource};
use roundtable_sandbox::settings::{Settings, SETTINGS_NOTE};
use roundtable_sandbox::{DockerDriver, Sandbox, Speaker, TurnRequest};

/// The operator's tool for roundtable-sandbox: sealed, short-lived containers for the
/// guests of chat channels.
#[derive(Debug, Parser)]
#[command(name = "roundtable-sandbox", version, after_help = SETTINGS_NOTE)]
struct Cli {
    #[command(flatten)]
    settings: Settings,
    /// The bots' metrics endpoint (`doctor` checks it, `explain` shows it).
    #[command(flatten)]
    metrics: roundtable_sandbox_metrics::MetricsArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check this host; each failure has a hint; exit 1 on any failure
    Doctor,
    /// Show the effective policy (never the key)
    Explain,
    /// Run one turn and print the reply as JSON; exit 1 if the turn failed
    Turn(TurnArgs),
    /// Remove leftover containers and run dirs of this runtime
    Sweep,
    /// Summarise an audit trail (`[audit] path`): turns and failures by kind, p50/p95 by
    /// launch type, the top speakers and channels by tokens, the budget refusals
    Audit {
        /// The audit file (one JSON line per turn)
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// The web routes: `egress check ROUTE METHOD URL`
    Egress {
        #[command(subcommand)]
        command: EgressCommand,
    },
    /// The guest image
    Image {
        #[command(subcommand)]
        command: ImageCommand,
    },
    /// Print a completion script for SHELL (e.g. `roundtable-sandbox completions bash > /etc/bash_completion.d/roundtable-sandbox`)
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Args)]
struct TurnArgs {
    /// The channel the turn belongs to
    #[arg(long, value_name = "C", default_value = "#cli")]
    channel: String,
    /// Who says the text
    #[arg(long, value_name = "NAME", default_value = "operator")]
    speaker: String,
    /// Start the channel's session fresh
    #[arg(long)]
    reset: bool,
    /// The message text (its words are joined with spaces)
    #[arg(required = true, value_name = "TEXT")]
    text: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum EgressCommand {
    /// Whether route ROUTE allows METHOD URL, and which rule refuses it: nothing is resolved
    /// or sent. Exit 0 allow, 1 deny
    Check {
        /// The route's name
        route: String,
        /// The method (GET, POST, ...)
        method: String,
        /// A whole URL (a route of host patterns), or a path under the route's upstream
        url: String,
    },
}

#[derive(Debug, Subcommand)]
enum ImageCommand {
    /// Build the guest image FROM scratch from the static guest and a static busybox
    Build {
        /// The static guest binary
        #[arg(
            long,
            value_name = "PATH",
            default_value = "target/x86_64-unknown-linux-gnu/release/roundtable-guest"
        )]
        guest: PathBuf,
        /// A static busybox
        #[arg(long, value_name = "PATH", default_value = "/bin/busybox")]
        busybox: PathBuf,
        /// The image tag
        #[arg(long, default_value = roundtable_sandbox::settings::DEFAULT_IMAGE)]
        tag: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    // Before any secret is read: no other process of this user may read this one's memory
    // or environment (the key is read from OPENAI_API_KEY or a file).
    if let Err(e) = roundtable_sandbox::make_process_private() {
        eprintln!("error: make the process private (not dumpable): {e}");
        return ExitCode::FAILURE;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    // Usage errors print clap's message and exit 2; `--help` and `--version` exit 0.
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            // An error may quote what a guest or the engine said: escaped.
            let shown = |m: &dyn std::fmt::Display| {
                roundtable_sandbox::display::escape(&m.to_string()).into_owned()
            };
            eprintln!("roundtable-sandbox: {}", shown(&e));
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {}", shown(cause));
            }
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    let settings = &cli.settings;
    match cli.command {
        Command::Doctor => doctor::doctor(settings, &cli.metrics).await,
        Command::Explain => explain(settings, &cli.metrics).await,
        Command::Turn(args) => turn(settings, args).await,
        Command::Sweep => sweep(settings).await,
        Command::Audit { file } => audit::audit_summary(&file),
        Command::Egress {
            command: EgressCommand::Check { route, method, url },
        } => {
            let (config, _) = settings.build().await.context("read the configuration")?;
            egress::check(&config, &route, &method, &url)
        }
        Command::Image {
            command:
                ImageCommand::Build {
                    guest,
                    busybox,
                    tag,
                },
        } => image_build(ImageSource { guest, busybox }, tag).await,
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "roundtable-sandbox",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A URL's host (and port), never its credentials, path or query.
fn host_of(url: &str) -> String {
    let after = url.split_once("://").map_or(url, |(_, r)| r);
    let host = after.split(['/', '?', '#']).next().unwrap_or_default();
    host.rsplit_once('@').map_or(host, |(_, h)| h).to_owned()
}

/// A path as `explain` shows it: resolved when it exists.
fn show(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .display()
        .to_string()
}

/// `explain`: the effective policy, section by section (each section's lines are in its
/// module), never a key.
async fn explain(
    settings: &Settings,
    metrics_args: &roundtable_sandbox_metrics::MetricsArgs,
) -> Result<ExitCode> {
    let (config, offline) = settings.build().await.context("read the configuration")?;
    host::explain(&config);
    budgets::explain(&config);
    audit::explain(&config);
    metrics::explain(metrics_args);
    model::explain(&config, offline.is_some());
    broker::explain(&config);
    egress::explain(&config);
    mcp::explain(&config);
    Ok(ExitCode::SUCCESS)
}

async fn turn(settings: &Settings, args: TurnArgs) -> Result<ExitCode> {
    let TurnArgs {
        channel,
        speaker,
        reset,
        text: words,
    } = args;
    let speaker = Speaker {
        id: speaker.clone(),
        name: speaker,
    };
    let (config, _offline) = settings.build().await.context("read the configuration")?;
    let sandbox = Sandbox::new(config).await?;
    let reply = sandbox
        .run_turn(TurnRequest {
            channel: channel.into(),
            speaker,
            text: words.join(" "),
            reset,
            stop: tokio_util::sync::CancellationToken::new(),
            admitted: None,
            limits_key: None,
        })
        .await
        .reply;
    sandbox.shutdown().await;
    // The reply is guest- and model-made: JSON escapes its C0 controls, `display::json`
    // the C1 ones, DEL and the bidi controls too (the same document, safe on a terminal).
    println!("{}", roundtable_sandbox::display::json(&reply)?);
    Ok(if reply.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn sweep(settings: &Settings) -> Result<ExitCode> {
    let (config, _offline) = settings.build().await.context("read the configuration")?;
    let sandbox = Sandbox::new(config).await?;
    let report = sandbox.sweep().await;
    sandbox.shutdown().await;
    println!(
        "removed {} container(s) and {} run dir(s)",
        report.containers.len(),
        report.run_dirs.len()
    );
    for e in &report.errors {
        println!("error: {e}");
    }
    Ok(if report.errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn image_build(source: ImageSource, tag: String) -> Result<ExitCode> {
    let driver = DockerDriver::default();
    let id = operator::build_image(&driver, &source, &tag).await?;
    println!("built {tag} ({id})");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("roundtable-sandbox").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn settings_flags_go_before_or_after_the_subcommand() {
        let before = parse(&["--run-root", "/r", "doctor"]).unwrap();
        let after = parse(&["doctor", "--run-root", "/r", "--offline"]).unwrap();
        assert_eq!(before.settings.run_root, Some(PathBuf::from("/r")));
        assert_eq!(after.settings.run_root, Some(PathBuf::from("/r")));
        assert!(after.settings.offline && !before.settings.offline);
        assert!(matches!(after.command, Command::Doctor));
    }

    #[test]
    fn turn_takes_its_flags_and_the_words() {
        let cli = parse(&["turn", "--channel", "#ops", "--reset", "hello", "there"]).unwrap();
        let Command::Turn(t) = cli.command else {
            panic!("{cli:?}")
        };
        assert_eq!(
            (t.channel.as_str(), t.speaker.as_str()),
            ("#ops", "operator")
        );
        assert!(t.reset);
        assert_eq!(t.text, ["hello", "there"]);
        // Words that look like flags go after `--`.
        let cli = parse(&["turn", "--", "--not-a-flag"]).unwrap();
        let Command::Turn(t) = cli.command else {
            panic!("{cli:?}")
        };
        assert_eq!(t.text, ["--not-a-flag"]);
    }

    #[test]
    fn usage_errors_are_clear() {
        let kind = |args: &[&str]| parse(args).unwrap_err().kind();
        assert_eq!(
            kind(&["turn"]),
            clap::error::ErrorKind::MissingRequiredArgument
        );
        assert_eq!(
            kind(&["turn", "--bogus", "x"]),
            clap::error::ErrorKind::UnknownArgument
        );
        assert_eq!(
            kind(&["frobnicate"]),
            clap::error::ErrorKind::InvalidSubcommand
        );
        assert_eq!(
            kind(&[]),
            clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        );
        assert_eq!(
            kind(&["doctor", "--run-root"]),
            clap::error::ErrorKind::InvalidValue
        );
        let e = parse(&["image", "build", "--tagg", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("unexpected argument '--tagg'"), "{e}");
        assert!(e.contains("tip: a similar argument exists: '--tag'"), "{e}");
    }

    #[test]
    fn completions_name_every_subcommand() {
        let mut out = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut Cli::command(),
            "roundtable-sandbox",
            &mut out,
        );
        let script = String::from_utf8(out).unwrap();
        for word in [
            "doctor",
            "explain",
            "turn",
            "sweep",
            "image",
            "--run-root",
            "--channel",
        ] {
            assert!(script.contains(word), "{word}");
        }
    }

    #[test]
    fn model_host_never_shows_credentials_or_path() {
        assert_eq!(
            host_of("https://user:pw@api.example.com:8443/v1?x=1"),
            "api.example.com:8443"
        );
        assert_eq!(host_of("http://127.0.0.1:9/v1"), "127.0.0.1:9");
    }
}
