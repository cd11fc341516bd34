//! Example bots embedding roundtable-sandbox, and what they share.
//!
//! - `terminal_bot.rs`: reads `#channel name: text` lines on stdin (and `/reset #channel`,
//!   `/stop #channel`, `/status`), sends each as an actor message, prints the replies;
//! - `irc_bot.rs`: each IRC channel is a sandbox channel, each nick the speaker;
//! - [`RollDice`]: a host tool both bots offer to the guest agent;
//! - [`BotArgs`]: the end of their command lines (settings, metrics, completions);
//! - [`bot_main`]: their `main` (private process, command line, completions, errors);
//! - [`print_completions`]: their `--completions SHELL`;
//! - [`write_private_temp`], [`sync_parent`]: a private file written whole, then moved
//!   into place (the IRC bot's limits key, the Matrix bot's session);
//! - [`stop_signal`]: SIGINT or SIGTERM, on which both shut their runtime down cleanly;
//! - [`serve_metrics`]: their `--metrics ADDR` (Prometheus, `roundtable-sandbox-metrics`).
//!
//! The README's embedding example is compiled here as a doctest.

#![forbid(unsafe_code)]

use roundtable_sandbox::display;
use roundtable_sandbox::BoxFuture;
use roundtable_sandbox::{HostTool, ToolCallContext};

/// A host tool: rolls a die with the given number of sides. Runs on the host; the guest
/// only sees its name, description and schema, and its result.
#[derive(Debug, Default)]
pub struct RollDice;

impl HostTool for RollDice {
    fn name(&self) -> &str {
        "roll_dice"
    }

    fn description(&self) -> &str {
        "Roll a fair die on the host and return the result."
    }

    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 1000}},
            "required": ["sides"],
            "additionalProperties": false
        })
    }

    fn call(
        &self,
        args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let sides = args["sides"].as_u64().ok_or("sides must be an integer")?;
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_err(|e| e.to_string())?
                .subsec_nanos() as u64;
            Ok(format!(
                "{} rolled a d{sides}: {}",
                ctx.speaker.name,
                nanos % sides + 1
            ))
        })
    }
}

/// Prints the completion script of the command line `C` for `shell` on stdout (the bots'
/// `--completions SHELL`).
pub fn print_completions<C: clap::CommandFactory>(
    shell: clap_complete::Shell,
) -> std::process::ExitCode {
    let mut command = C::command();
    let name = command.get_name().to_owned();
    clap_complete::generate(shell, &mut command, name, &mut std::io::stdout());
    std::process::ExitCode::SUCCESS
}

/// What every bot's command line ends with: the runtime's settings, the metrics endpoint's
/// flags and `--completions` (`#[command(flatten)]` it last).
#[derive(Debug, clap::Args)]
pub struct BotArgs {
    #[command(flatten)]
    pub settings: roundtable_sandbox::settings::Settings,
    #[command(flatten)]
    pub metrics: roundtable_sandbox_metrics::MetricsArgs,
    /// Print a completion script for SHELL and exit
    #[arg(long, value_name = "SHELL", value_enum)]
    pub completions: Option<clap_complete::Shell>,
}

/// A bot's `main`: the process made private before any secret is read (no other process
/// of its user may read its memory or environment: the key, a password), the command line
/// parsed (usage errors print clap's message and exit 2; `--help` and `--version` exit 0),
/// `--completions SHELL` printed when `completions` finds it, else `run`, whose error is
/// printed escaped as `program: …` with its causes, exit 2.
pub async fn bot_main<C, F, Fut>(
    program: &str,
    completions: fn(&C) -> Option<clap_complete::Shell>,
    run: F,
) -> std::process::ExitCode
where
    C: clap::Parser,
    F: FnOnce(C) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    if let Err(e) = roundtable_sandbox::make_process_private() {
        eprintln!("error: make the process private (not dumpable): {e}");
        return std::process::ExitCode::FAILURE;
    }
    let cli = C::parse();
    if let Some(shell) = completions(&cli) {
        return print_completions::<C>(shell);
    }
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            print_error(program, &e);
            std::process::ExitCode::from(2)
        }
    }
}

/// Writes `bytes` to a new temporary file beside `path` (`.NAME.tmp-PID`, mode 0600, never
/// through a link) and syncs it; returns its path, for the caller to rename or link into
/// place (then [`sync_parent`]). On an error nothing is left behind.
pub fn write_private_temp(
    path: &std::path::Path,
    bytes: &[u8],
) -> std::io::Result<std::path::PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(std::path::Path::new("/"));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        });
    match written {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Syncs the directory that holds `path` (after a rename or link into it).
pub fn sync_parent(path: &std::path::Path) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(std::path::Path::new("/"));
    std::fs::File::open(dir).and_then(|d| d.sync_all())
}

/// Resolves on the first SIGINT or SIGTERM: a bot then leaves its read loop and sends the
/// supervisor `Shutdown`, which stops the running turns and removes every container, socket
/// and run dir before the process exits (a SIGKILL leaves them to the next start's sweep).
pub async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // No signal handler could be installed: never resolve (the default actions remain).
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Starts the metrics endpoint when `--metrics` asked for it and installs its observer on
/// the supervisor's options; prints where it listens. Keep the server: dropping it stops it.
pub fn serve_metrics(
    program: &str,
    args: &roundtable_sandbox_metrics::MetricsArgs,
    supervisor: &mut roundtable_sandbox_actors::SupervisorOptions,
) -> anyhow::Result<Option<roundtable_sandbox_metrics::MetricsServer>> {
    let Some((metrics, server)) = args.start()? else {
        return Ok(None);
    };
    supervisor.config.observer = Some(chain(supervisor.config.observer.take(), metrics.observer()));
    eprintln!(
        "{program}: metrics at http://{}/metrics",
        server.local_addr()
    );
    Ok(Some(server))
}

/// One observer made of two: `first` (if any), then `then`, each sees every event (the
/// runtime takes one observer: a bot that shows progress and serves metrics chains them).
pub fn chain(
    first: Option<roundtable_sandbox::events::Observer>,
    then: roundtable_sandbox::events::Observer,
) -> roundtable_sandbox::events::Observer {
    match first {
        None => then,
        Some(first) => std::sync::Arc::new(move |event| {
            first(event);
            then(event);
        }),
    }
}

/// Prints a bot's fatal error on stderr: its message, then each cause on a line of its own.
pub fn print_error(program: &str, error: &anyhow::Error) {
    // An error may quote what a guest, the server or the engine said: escaped.
    let shown = |m: &dyn std::fmt::Display| display::escape(&m.to_string()).into_owned();
    eprintln!("{program}: {}", shown(error));
    for cause in error.chain().skip(1) {
        eprintln!("  caused by: {}", shown(cause));
    }
}

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
