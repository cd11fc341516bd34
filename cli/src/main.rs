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

mod egress;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory, Parser, Subcommand};
use roundtable_sandbox::operator::{self, is_private_dir, Floor, ImageSource, MAX_SOCKET_PATH};
use roundtable_sandbox::settings::{Settings, SETTINGS_NOTE};
use roundtable_sandbox::{ApiKey, Config, ConfigError, McpScope, McpTransport};
use roundtable_sandbox::{ContainerDriver, DockerDriver, Sandbox, Speaker, TurnRequest};

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
        Command::Doctor => doctor(settings, &cli.metrics).await,
        Command::Explain => explain(settings, &cli.metrics).await,
        Command::Turn(args) => turn(settings, args).await,
        Command::Sweep => sweep(settings).await,
        Command::Audit { file } => audit_summary(&file),
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

/// One doctor line: passed, failed (with a fix), or passed with a warning and its fix.
struct Check {
    ok: bool,
    name: &'static str,
    detail: String,
    hint: Option<String>,
}

fn pass(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        ok: true,
        name,
        detail: detail.into(),
        hint: None,
    }
}

/// A check that passes with a warning: something the operator chose that weakens a
/// control (shown, not counted as a failure).
fn warn(name: &'static str, detail: impl Into<String>, hint: impl Into<String>) -> Check {
    Check {
        ok: true,
        name,
        detail: detail.into(),
        hint: Some(hint.into()),
    }
}

fn fail(name: &'static str, detail: impl Into<String>, hint: impl Into<String>) -> Check {
    Check {
        ok: false,
        name,
        detail: detail.into(),
        hint: Some(hint.into()),
    }
}

fn check_root(name: &'static str, path: &Path, uid: u32) -> Check {
    // What lies above the root: the runtime's own startup check.
    if let Err(e) = roundtable_sandbox::operator::check_root_ancestors(path, uid) {
        let hint = match &e {
            ConfigError::RootAncestorWritable { ancestor, .. } => format!(
                "chmod go-w {} (or choose a root whose every parent only root or this user can write)",
                ancestor.display()
            ),
            ConfigError::RootAncestorOwner { .. } => {
                "choose a root whose every parent is owned by root or this user".to_owned()
            }
            _ => "choose a directory this user can create".to_owned(),
        };
        return fail(name, format!("{:#}", anyhow::Error::from(e)), hint);
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => pass(
            name,
            format!("{} will be created 0700 at startup", path.display()),
        ),
        Err(e) => fail(
            name,
            format!("{}: {e}", path.display()),
            "choose a directory this user can create",
        ),
        Ok(_) => {
            let meta = match std::fs::metadata(path) {
                Ok(m) => m,
                Err(e) => {
                    return fail(
                        name,
                        format!("{}: {e}", path.display()),
                        "fix or remove the dangling link",
                    )
                }
            };
            // The runtime's own rule (`is_private_dir`); the lines below say which part
            // of it fails.
            if !meta.is_dir() {
                fail(
                    name,
                    format!("{} is not a directory", path.display()),
                    "point it at a dedicated directory",
                )
            } else if is_private_dir(meta.uid(), meta.mode(), uid) {
                pass(name, format!("{} (owner {uid}, mode 700)", path.display()))
            } else if meta.uid() != uid {
                fail(
                    name,
                    format!(
                        "{} is owned by uid {}, not {uid}",
                        path.display(),
                        meta.uid()
                    ),
                    format!("chown {uid} {}", path.display()),
                )
            } else {
                fail(
                    name,
                    format!(
                        "{} has mode {:o}; group and others must have no access",
                        path.display(),
                        meta.mode() & 0o7777
                    ),
                    format!("chmod 700 {}", path.display()),
                )
            }
        }
    }
}

/// Free space of the filesystem holding `path` (or its nearest existing parent) against
/// the floor.
fn floor_check(name: &'static str, path: &Path, floor: &Floor) -> Check {
    let mut at = path;
    while !at.exists() {
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    match operator::free_space(at) {
        Err(e) => fail(
            name,
            format!("{}: free space unknown: {e}", path.display()),
            "make the directory reachable by this user",
        ),
        Ok((free, total)) => {
            let min = floor.bytes_of(total);
            let fs = operator::filesystem_type(at).unwrap_or_else(|_| "unknown type".into());
            let detail = format!(
                "{} ({fs}): {} MiB free of {} MiB; floor {} MiB",
                path.display(),
                free >> 20,
                total >> 20,
                min.div_ceil(1 << 20)
            );
            if free < min {
                fail(
                    name,
                    format!("{detail}: below the floor, turns are refused"),
                    "free space on that filesystem, or lower limits.disk_floor_mb / limits.disk_floor_percent",
                )
            } else {
                pass(name, detail)
            }
        }
    }
}

fn user_check(uid: u32, gid: u32) -> Check {
    if uid == 0 {
        fail(
            "user",
            "running as root: the runtime refuses root",
            "run as the non-root service user (scripts/setup.sh creates `roundtable` in the docker group): \
             setpriv --reuid=roundtable --regid=roundtable --init-groups roundtable-sandbox …",
        )
    } else {
        pass("user", format!("uid {uid}, gid {gid}"))
    }
}

/// The configured runtime must be one the engine lists in its info's `Runtimes`.
fn runtime_check(
    wanted: Option<&str>,
    listed: Result<(Vec<String>, String), roundtable_sandbox::DriverError>,
) -> Check {
    let (names, default) = match listed {
        Ok(l) => l,
        Err(e) => return fail("runtime", e.to_string(), "fix the docker check first"),
    };
    match wanted {
        None => pass("runtime", format!("the engine's default ({default})")),
        Some(r) if names.iter().any(|n| n == r) => {
            pass("runtime", format!("{r}, listed by the engine"))
        }
        Some(r) => fail(
            "runtime",
            format!(
                "{r} is not listed by the engine (it lists {})",
                names.join(", ")
            ),
            if r == roundtable_sandbox::operator::GVISOR_RUNTIME {
                "run scripts/setup.sh --gvisor as root (installs runsc, adds it to \
                 /etc/docker/daemon.json, reloads the engine with SIGHUP)"
            } else {
                "add it to \"runtimes\" in /etc/docker/daemon.json and reload the engine \
                 (kill -HUP $(cat /var/run/docker.pid))"
            },
        ),
    }
}

fn driver_for(config: &Config) -> DockerDriver {
    let mut options = config.docker_options();
    options.call_timeout = std::time::Duration::from_secs(5);
    DockerDriver::new(options)
}

async fn doctor(
    settings: &Settings,
    metrics: &roundtable_sandbox_metrics::MetricsArgs,
) -> Result<ExitCode> {
    let (config, _offline) = settings.build().await.context("read the configuration")?;
    let uid = nix::unistd::getuid().as_raw();
    let mut checks = Vec::new();
    checks.push(user_check(uid, nix::unistd::getgid().as_raw()));
    // Every violation of the runtime's own rules (the startup validation in its
    // every-violation mode; startup stops at the first), one line each, none when the
    // configuration passes. What lies above a root is shown on the root's own line.
    for violation in roundtable_sandbox::operator::violations(&config) {
        if matches!(
            violation,
            ConfigError::RootAncestorOwner { .. }
                | ConfigError::RootAncestorWritable { .. }
                | ConfigError::InspectRoot { .. }
        ) {
            continue;
        }
        checks.push(fail(
            "config",
            format!("{:#}", anyhow::Error::from(violation)),
            "change the setting it names: the runtime refuses this configuration at startup",
        ));
    }
    let driver = driver_for(&config);
    let docker_ok = match driver.version().await {
        Ok(v) => {
            checks.push(pass("docker", format!("reachable, Docker {v}")));
            true
        }
        Err(e) => {
            checks.push(fail(
                "docker",
                e.to_string(),
                "start the daemon (service docker start) and let this user use its socket \
                 (usermod -aG docker USER, then log in again)",
            ));
            false
        }
    };
    checks.push(if !docker_ok {
        fail(
            "image",
            format!("{}: not checked, Docker is unreachable", config.image),
            "fix the docker check first",
        )
    } else {
        match driver.image_present(&config.image).await {
            Ok(true) => pass("image", format!("{} present", config.image)),
            Ok(false) => fail(
                "image",
                format!("{} is missing", config.image),
                "build it: scripts/build-image.sh (or roundtable-sandbox image build)",
            ),
            Err(e) => fail("image", e.to_string(), "fix the docker check first"),
        }
    });
    checks.push(if !docker_ok {
        fail(
            "runtime",
            "not checked, Docker is unreachable".to_owned(),
            "fix the docker check first",
        )
    } else {
        runtime_check(config.runtime.as_deref(), driver.runtimes().await)
    });
    checks.push(check_root("run_root", &config.run_root, uid));
    checks.push(check_root("workspace_root", &config.workspace_root, uid));
    let floor = config.limits.disk_floor();
    checks.push(floor_check(
        "workspace disk",
        &config.workspace_root,
        &floor,
    ));
    checks.push(if !docker_ok {
        fail(
            "engine disk",
            "not checked, Docker is unreachable",
            "fix the docker check first",
        )
    } else {
        match driver.data_root().await {
            Ok(Some(root)) => floor_check("engine disk", &root, &floor),
            Ok(None) => pass("engine disk", "the engine reports no data root"),
            Err(e) => fail("engine disk", e.to_string(), "fix the docker check first"),
        }
    });
    match (&config.budgets.state_file, &config.budgets.store) {
        (Some(_), Some(_)) => checks.push(shared_store_check(
            &config.budgets,
            config.effective_time_zone(),
        )),
        (Some(file), None) => checks.push(state_file_check(file, config.effective_time_zone())),
        _ => {}
    }
    if let Some(check) = metrics_check(metrics) {
        checks.push(check);
    }
    if let Some(file) = &config.audit.path {
        checks.push(audit_file_check(file));
    }
    for m in &config.mcp {
        if m.unconfined() {
            checks.push(fail(
                "mcp",
                format!(
                    "{} runs UNCONFINED on the host (confine = \"host\"): the service user's rights, groups (docker) and files",
                    m.name
                ),
                "run it in its own container: remove confine and set image (scripts/build-mcp-image.sh)",
            ));
        } else if let Some(image) = m.image.as_deref().filter(|_| m.in_container()) {
            checks.push(if !docker_ok {
                fail(
                    "mcp",
                    format!(
                        "{}: image {image} not checked, Docker is unreachable",
                        m.name
                    ),
                    "fix the docker check first",
                )
            } else {
                match driver.image_present(image).await {
                    Ok(true) => pass(
                        "mcp",
                        format!("{}: in a container of {image} (present)", m.name),
                    ),
                    Ok(false) => fail(
                        "mcp",
                        format!("{}: image {image} is missing", m.name),
                        "build it: scripts/build-mcp-image.sh",
                    ),
                    Err(e) => fail("mcp", e.to_string(), "fix the docker check first"),
                }
            });
        }
    }
    checks.push(
        match roundtable_sandbox::operator::check_socket_path(&config.run_root) {
            Err(e) => fail(
                "socket path",
                e.to_string(),
                "choose a shorter run_root, e.g. /run/roundtable or /srv/rt/run",
            ),
            Ok(len) => pass("socket path", format!("{len} of {MAX_SOCKET_PATH} bytes")),
        },
    );
    checks.extend(egress::doctor(&config));
    let failed = checks.iter().filter(|c| !c.ok).count();
    for c in &checks {
        println!(
            "{} {:<15} {}",
            match (c.ok, &c.hint) {
                (false, _) => "FAIL",
                (true, Some(_)) => "WARN",
                (true, None) => "ok  ",
            },
            c.name,
            c.detail
        );
        if let Some(hint) = &c.hint {
            println!("     {:<15} fix: {hint}", "");
        }
    }
    if failed == 0 {
        println!("all {} checks passed", checks.len());
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{failed} of {} checks failed", checks.len());
        Ok(ExitCode::from(1))
    }
}

/// The budgets' state file: an existing one must open and load as a start loads it (a
/// database, undamaged, not locked, today's counters and the last minute's turns readable);
/// values a start would clamp fail the check with the start's own warning; a missing one
/// needs a directory to be made in.
fn state_file_check(file: &Path, time_zone: &str) -> Check {
    const NAME: &str = "state file";
    if !file.exists() {
        return creatable_check(NAME, file);
    }
    match roundtable_sandbox::operator::check_state_file(file, time_zone) {
        Ok(c) if c.warnings.is_empty() => pass(
            NAME,
            format!(
                "{} opens and loads (SQLite, WAL, checked; today's {} counter(s), {} turn(s) of the last minute)",
                file.display(),
                c.counters,
                c.turns
            ),
        ),
        Ok(c) => fail(
            NAME,
            c.warnings.join("; "),
            "a start goes on with these values clamped; to clear them now, stop the bot and \
             fix or delete those rows with sqlite3",
        ),
        Err(e) => fail(
            NAME,
            e.to_string(),
            "stop the other process holding it, or move a damaged file aside (its counters are lost)",
        ),
    }
}

/// The budgets' shared store: connects, checks the schema and the namespace's settings
/// (never changing them) and loads today's counters as a start does; never shows its URL.
fn shared_store_check(budgets: &roundtable_sandbox::BudgetSettings, time_zone: &str) -> Check {
    const NAME: &str = "budget store";
    match roundtable_sandbox::operator::check_shared_store(budgets, time_zone) {
        Ok(c) if c.warnings.is_empty() => pass(
            NAME,
            format!(
                "PostgreSQL, namespace {:?}: connects, schema current, settings agree; today's {} \
                 counter(s), {} turn(s) of the last minute",
                budgets.effective_namespace(),
                c.counters,
                c.turns
            ),
        ),
        Ok(c) => fail(
            NAME,
            c.warnings.join("; "),
            "a start goes on with these values clamped",
        ),
        Err(e) => fail(
            NAME,
            e.to_string(),
            "start the database, fix the URL's source, or give every process of the namespace \
             the same limits and time_zone",
        ),
    }
}

/// The metrics address (`--metrics`): loopback unless allowed otherwise, and bindable now.
fn metrics_check(args: &roundtable_sandbox_metrics::MetricsArgs) -> Option<Check> {
    const NAME: &str = "metrics";
    let addr = match args.address() {
        Ok(addr) => addr?,
        Err(e) => {
            return Some(fail(
                NAME,
                e.to_string(),
                "serve metrics on 127.0.0.1 (and scrape there), or allow it explicitly",
            ))
        }
    };
    Some(match roundtable_sandbox_metrics::bindable(addr) {
        Ok(()) => pass(NAME, format!("http://{addr}/metrics can be served")),
        Err(e) => fail(
            NAME,
            format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            ),
            "choose a free port (another process holds it, or the address is not this host's)",
        ),
    })
}

/// A file the runtime creates at startup: its directory must let this user create it.
fn creatable_check(name: &'static str, file: &Path) -> Check {
    let dir = file.parent().unwrap_or(Path::new("/"));
    match nix::unistd::access(
        dir,
        nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK,
    ) {
        Ok(()) => pass(
            name,
            format!("{} will be created at startup", file.display()),
        ),
        Err(e) => fail(
            name,
            format!(
                "{} cannot be created in {}: {e}",
                file.display(),
                dir.display()
            ),
            "create the directory for the service user, outside run_root and workspace_root",
        ),
    }
}

/// The audit file: an existing one must open for appending as the runtime opens it (by
/// this user, the service user); a missing one needs a directory this user may create in.
/// Nothing is written or created.
fn audit_file_check(file: &Path) -> Check {
    const NAME: &str = "audit file";
    if !file.exists() {
        return creatable_check(NAME, file);
    }
    match std::fs::OpenOptions::new().append(true).open(file) {
        Ok(_) => pass(
            NAME,
            format!("{} is writable (appended to)", file.display()),
        ),
        Err(e) => fail(
            NAME,
            format!("{} cannot be opened for appending: {e}", file.display()),
            "give the service user write permission on it (or name another file)",
        ),
    }
}

/// `audit FILE`: the trail's summary (its strings escaped for the terminal).
fn audit_summary(file: &Path) -> Result<ExitCode> {
    let reader =
        std::fs::File::open(file).with_context(|| format!("open audit file {}", file.display()))?;
    let summary = roundtable_sandbox::operator::summarize_audit(std::io::BufReader::new(reader))
        .with_context(|| format!("read audit file {}", file.display()))?;
    print!("{summary}");
    Ok(ExitCode::SUCCESS)
}

fn host_of(url: &str) -> String {
    let after = url.split_once("://").map_or(url, |(_, r)| r);
    let host = after.split(['/', '?', '#']).next().unwrap_or_default();
    host.rsplit_once('@').map_or(host, |(_, h)| h).to_owned()
}

async fn explain(
    settings: &Settings,
    metrics: &roundtable_sandbox_metrics::MetricsArgs,
) -> Result<ExitCode> {
    let (config, offline) = settings.build().await.context("read the configuration")?;
    let show = |p: &PathBuf| {
        std::fs::canonicalize(p)
            .unwrap_or_else(|_| p.clone())
            .display()
            .to_string()
    };
    let l = &config.limits;
    let b = &config.broker_limits;
    let (uid, gid) = config.worker_identity();
    println!("image         {}", config.image);
    println!(
        "runtime       {}",
        match config.runtime.as_deref() {
            None => "the engine's default (runc: the guest shares the host kernel)".to_owned(),
            Some(r) if r == roundtable_sandbox::operator::GVISOR_RUNTIME => {
                format!("{r} (gVisor: a user-space kernel between the guest and the host)")
            }
            Some(r) => r.to_owned(),
        }
    );
    println!(
        "container     user {uid}:{gid}, network none, read-only root, all capabilities dropped, \
         no-new-privileges, init process"
    );
    println!(
        "limits        memory {} MiB (no swap), {} cpus, {} pids, /tmp tmpfs {} MiB, reply {} KiB",
        l.memory_mb, l.cpus, l.pids, l.tmpfs_mb, l.output_kb
    );
    println!(
        "disk          workspace quota {} MiB / {} entries per channel; free-space floor max({} MiB, {} %) on the workspaces' and the engine's filesystems",
        l.workspace_mb, l.workspace_files, l.disk_floor_mb, l.disk_floor_percent
    );
    println!(
        "mounts        {}/turn-XXXXXX -> /run/roundtable (read-only, holds only broker.sock)",
        show(&config.run_root)
    );
    println!(
        "              {}/<sha256(channel)> -> /workspace (read-write; the root itself is never mounted)",
        show(&config.workspace_root)
    );
    let w = &config.warm;
    match (w.on(), w.ttl()) {
        (false, _) => println!("warm turns    off (every turn creates and starts its container)"),
        (true, ttl) => println!(
            "warm turns    on: each channel's next container is started after its turn, up to {} in all, \
             removed after {} unused; it reaches no broker before its turn",
            w.max,
            ttl.map_or("the channel's idle timeout".to_owned(), |t| format!("{} s", t.as_secs()))
        ),
    }
    let bg = &config.budgets;
    let limit = |v: Option<u64>, what: &str| v.map(|n| format!("{n} {what}"));
    let set: Vec<String> = [
        limit(bg.speaker_tokens_per_day, "tokens per speaker per day"),
        limit(bg.channel_tokens_per_day, "tokens per channel per day"),
        limit(bg.bot_tokens_per_day, "tokens per day for the bot"),
        limit(
            bg.speaker_turns_per_minute.map(u64::from),
            "turns per speaker per minute",
        ),
        limit(
            bg.speaker_egress_bytes_per_day,
            "egress bytes per speaker per day",
        ),
        limit(
            bg.channel_egress_bytes_per_day,
            "egress bytes per channel per day",
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    let zone = config.effective_time_zone();
    match (&bg.state_file, set.is_empty()) {
        (None, _) => println!(
            "budgets       none; each turn's usage (tokens from the upstream's own counts) is logged, not kept"
        ),
        (Some(f), true) => println!(
            "budgets       none; usage kept in {} (SQLite, WAL)",
            f.display()
        ),
        (Some(f), false) => println!(
            "budgets       {}; days start at 00:00 {zone}; a turn past one is refused before its container, \
             a model call past one gets 429; counters in {}",
            set.join(", "),
            match bg.store {
                None => format!("{} (SQLite, WAL)", f.display()),
                Some(_) => "the shared store (below)".to_owned(),
            }
        ),
    }
    if let Some(source) = &bg.store {
        println!(
            "budget store  PostgreSQL, namespace {:?}, its URL from {} (never shown); shared by \
             every process of the namespace (their limits and time_zone must agree); {} is this \
             process's journal; reconciled every 100 ms; a view older than {} s refuses new turns",
            bg.effective_namespace(),
            source.describe(),
            bg.state_file
                .as_ref()
                .map_or_else(|| "(no state_file)".into(), |f| f.display().to_string()),
            bg.effective_max_staleness().as_secs()
        );
        if bg.fail_open {
            println!(
                "WARNING       budgets.fail_open = true: with the database unreachable past {} s, \
                 turns are admitted on this process's own counts (each process may then spend \
                 a whole budget on its own)",
                bg.effective_max_staleness().as_secs()
            );
        }
    }
    match &config.audit.path {
        None => println!("audit         off"),
        Some(f) => println!(
            "audit         one JSON line per turn appended to {}; guest text: {}; never a key",
            f.display(),
            if config.audit.include_text {
                "the speaker id, the message and the reply (include_text = true)"
            } else {
                "the speaker id only (include_text = false)"
            }
        ),
    }
    println!(
        "metrics       {}",
        match metrics.address() {
            Ok(None) => "off (the bots serve Prometheus metrics with --metrics ADDR)".to_owned(),
            Ok(Some(addr)) => format!(
                "http://{addr}/metrics (Prometheus; {}; labels never name a channel, a speaker or guest text)",
                if addr.ip().is_loopback() { "loopback only" } else { "REACHABLE beyond this host" }
            ),
            Err(e) => format!("refused: {e}"),
        }
    );
    println!(
        "turn timeout  {} s",
        config.effective_turn_timeout().as_secs_f64()
    );
    let key = match &config.api_key {
        ApiKey::None => "none",
        ApiKey::Static(_) => "set (held by the broker only)",
        ApiKey::Provider(_) => "from a provider (held by the broker only)",
    };
    println!(
        "model         {} at {} ({}{}), key: {key}",
        config.model,
        host_of(&config.model_url),
        config.model_url.split("://").next().unwrap_or("?"),
        if offline.is_some() {
            ", embedded offline model"
        } else {
            ""
        }
    );
    match &config.compaction {
        None => println!(
            "compaction    through the main model (no [compaction] section); fallback: plain summary"
        ),
        Some(c) => {
            let key = match &c.api_key {
                ApiKey::None => format!(
                    "MISSING ({}), so compaction falls back to the main model",
                    c.key_source
                ),
                ApiKey::Static(_) => {
                    format!("set from {} (held by the broker only)", c.key_source)
                }
                ApiKey::Provider(_) => "from a provider (held by the broker only)".to_owned(),
            };
            println!(
                "compaction    summarizer {} at {} ({}), timeout {} s, key: {key}; fallback: main model, then plain summary",
                c.model,
                host_of(&c.url),
                c.url.split("://").next().unwrap_or("?"),
                c.timeout.as_secs_f64()
            );
        }
    }
    println!(
        "broker caps   request {} KiB, response {} KiB, {} model calls, {} tool calls, {} compactions, {:?} per call",
        b.max_request_bytes / 1024,
        b.max_response_bytes / 1024,
        b.max_model_calls,
        b.max_tool_calls,
        b.max_compactions,
        b.call_timeout
    );
    println!(
        "broker turn   {} calls in flight, {} connections",
        b.max_calls_in_flight, b.max_connections
    );
    let fields: Vec<&str> = config.model_request.allowed_fields().collect();
    println!(
        "model fields  {} (anything else: 400); model forced; max_tokens capped at {} (set when absent)",
        fields.join(", "),
        config.model_request.max_tokens
    );
    println!(
        "broker peer   {}",
        if config.peer_uid_check {
            "only the worker uid may connect (SO_PEERCRED)"
        } else {
            "uid check OFF (peer_uid_check = false): only the per-turn 0700 run dir keeps \
             other local users away"
        }
    );
    if config.tools.is_empty() {
        println!("host tools    (none)");
    }
    for t in &config.tools {
        println!("host tool     {}: {}", t.name(), t.description());
    }
    egress::explain(&config);
    if config.mcp.is_empty() {
        println!("mcp           (none)");
    }
    for m in &config.mcp {
        let how = match &m.transport {
            McpTransport::Stdio { command, .. } if m.unconfined() => format!(
                "stdio `{command}` UNCONFINED on the host (confine = \"host\": user {uid}:{gid} with its groups, its files, its network)"
            ),
            McpTransport::Stdio { command, .. } => {
                let ml = &m.limits;
                format!(
                    "stdio `{command}` in a container of {} per session (user {uid}:{gid}, no other group, network {}, read-only root, memory {} MiB, {} cpus, {} pids, only its data dir {}/{}/{}/<sha256(channel)> -> /data, quota {} MiB / {} entries)",
                    m.image.as_deref().unwrap_or("?"),
                    if m.network { "ON (network = true)" } else { "none" },
                    ml.memory_mb,
                    ml.cpus,
                    ml.pids,
                    show(&config.workspace_root),
                    roundtable_sandbox::operator::MCP_DATA_DIR,
                    m.name,
                    ml.data_mb,
                    ml.data_files
                )
            }
            McpTransport::Http { url, .. } => format!("http {}", host_of(url)),
        };
        let scope = match m.scope() {
            McpScope::Channel => format!(
                "one session per channel (at most {}, least recently used stopped first)",
                m.session_cap()
            ),
            McpScope::Shared => {
                "one session shared by every channel (cross-channel; its calls one at a time, in turn across channels)".into()
            }
        };
        println!(
            "mcp           {}: {how}; {scope}; allow-list: {}",
            m.name,
            m.tools.join(", ")
        );
        if m.unconfined() {
            println!(
                "WARNING       mcp {} runs unconfined on the host: whatever a guest makes it do, it does with the service user's rights",
                m.name
            );
        }
        if m.scope() == McpScope::Shared {
            shared_mcp_warning(m, b.call_timeout);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The two hazards of a shared MCP server (issue 43): its data is every channel's, and so
/// is its availability.
fn shared_mcp_warning(m: &roundtable_sandbox::McpServer, call_timeout: std::time::Duration) {
    let timeout = match m.transport {
        McpTransport::Stdio { .. } => {
            "a call that times out stops the session for every channel (the calls waiting run on a restarted one; what the server kept only in memory is lost)"
        }
        McpTransport::Http { .. } => {
            "a call that times out is cancelled and the session kept (the calls behind it wait for whatever the remote still does for it)"
        }
    };
    println!(
        "WARNING       mcp {} is shared by every channel: whatever it keeps, every channel can read; its calls run one at a time, in turn across channels, so one channel's slow call delays the others' (each call up to {:?}), and {timeout}; scope = \"channel\" gives each channel its own session",
        m.name, call_timeout
    );
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
    fn root_is_detected_with_a_hint() {
        let c = user_check(0, 0);
        assert!(!c.ok);
        assert_eq!(c.detail, "running as root: the runtime refuses root");
        assert!(c.hint.unwrap().contains("setpriv --reuid=roundtable"));
        assert!(user_check(999, 995).ok);
    }

    #[test]
    fn runtime_check_names_the_fix() {
        let listed = || {
            Ok((
                vec!["runc".to_owned(), "runsc".to_owned()],
                "runc".to_owned(),
            ))
        };
        let c = runtime_check(None, listed());
        assert!(c.ok);
        assert_eq!(c.detail, "the engine's default (runc)");
        let c = runtime_check(Some("runsc"), listed());
        assert!(c.ok);
        assert_eq!(c.detail, "runsc, listed by the engine");
        let c = runtime_check(Some("runsc"), Ok((vec!["runc".into()], "runc".into())));
        assert!(!c.ok);
        assert_eq!(
            c.detail,
            "runsc is not listed by the engine (it lists runc)"
        );
        assert_eq!(
            c.hint.as_deref(),
            Some(
                "run scripts/setup.sh --gvisor as root (installs runsc, adds it to \
                 /etc/docker/daemon.json, reloads the engine with SIGHUP)"
            )
        );
        let c = runtime_check(Some("kata"), listed());
        assert!(!c.ok);
        assert!(c.hint.unwrap().starts_with("add it to \"runtimes\""));
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
