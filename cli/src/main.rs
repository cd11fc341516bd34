//! `roundtable-sandbox`: the operator's command-line tool.
//!
//! - `doctor`: checks what a runtime needs (not root, Docker reachable, the image present,
//!   private roots, a short enough socket path), each with a fix hint; exits 1 on a failure;
//! - `explain`: the effective policy (mounts, limits, tools, MCP allow-lists, the model
//!   endpoint's host), never the key;
//! - `turn`: one turn for a channel from the command line;
//! - `sweep`: removes this runtime's leftover containers and run dirs;
//! - `image build`: builds the guest image FROM scratch from the static guest and busybox.

#![forbid(unsafe_code)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use roundtable_sandbox::broker::{ApiKey, McpTransport};
use roundtable_sandbox::config::{Config, MAX_SOCKET_PATH, SOCKET_SUFFIX};
use roundtable_sandbox::driver::DockerOptions;
use roundtable_sandbox::image::{self, ImageSource};
use roundtable_sandbox::settings::{Settings, FLAGS_HELP};
use roundtable_sandbox::{DockerDriver, Sandbox, Speaker, TurnRequest};

const USAGE: &str = "usage: roundtable-sandbox <command> [flags]

commands:
  doctor                 check this host; each failure has a hint; exit 1 on any failure
  explain                show the effective policy (never the key)
  turn [--channel C] [--speaker NAME] [--reset] TEXT...
                         run one turn and print the reply as JSON
  sweep                  remove leftover containers and run dirs of this runtime
  image build [--guest PATH] [--busybox PATH] [--tag TAG]
                         build the guest image FROM scratch

flags:
";

#[tokio::main]
async fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    match run().await {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "roundtable-sandbox: {}",
                roundtable_sandbox::error_chain(e.as_ref())
            );
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<ExitCode> {
    let mut args = std::env::args().skip(1);
    let Some(command) = args.next() else {
        eprintln!("{USAGE}{FLAGS_HELP}");
        return Ok(ExitCode::from(2));
    };
    let mut settings = Settings::default();
    let mut rest = Vec::new();
    let mut args = args.peekable();
    let mut iter = std::iter::from_fn(|| args.next());
    while let Some(arg) = iter.next() {
        if !settings
            .take_flag(&arg, &mut iter)
            .map_err(anyhow::Error::msg)?
        {
            rest.push(arg);
        }
    }
    match command.as_str() {
        "doctor" => doctor(&settings).await,
        "explain" => explain(&settings).await,
        "turn" => turn(&settings, rest).await,
        "sweep" => sweep(&settings).await,
        "image" => image_cmd(rest).await,
        "help" | "--help" | "-h" => {
            println!("{USAGE}{FLAGS_HELP}");
            Ok(ExitCode::SUCCESS)
        }
        other => bail!("unknown command {other:?} (try `roundtable-sandbox help`)"),
    }
}

/// One doctor line.
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

fn fail(name: &'static str, detail: impl Into<String>, hint: impl Into<String>) -> Check {
    Check {
        ok: false,
        name,
        detail: detail.into(),
        hint: Some(hint.into()),
    }
}

fn check_root(name: &'static str, path: &Path, uid: u32) -> Check {
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
            if !meta.is_dir() {
                fail(
                    name,
                    format!("{} is not a directory", path.display()),
                    "point it at a dedicated directory",
                )
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
            } else if meta.mode() & 0o077 != 0 {
                fail(
                    name,
                    format!(
                        "{} has mode {:o}; group and others must have no access",
                        path.display(),
                        meta.mode() & 0o7777
                    ),
                    format!("chmod 700 {}", path.display()),
                )
            } else {
                pass(name, format!("{} (owner {uid}, mode 700)", path.display()))
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

fn driver_for(config: &Config) -> DockerDriver {
    let mut options = DockerOptions::default();
    if let Some(host) = &config.docker_host {
        options.host = host.clone();
    }
    options.call_timeout = std::time::Duration::from_secs(5);
    DockerDriver::new(options)
}

async fn doctor(settings: &Settings) -> Result<ExitCode> {
    let (config, _offline) = settings.build().await.context("read the configuration")?;
    let uid = nix::unistd::getuid().as_raw();
    let mut checks = Vec::new();
    checks.push(user_check(uid, nix::unistd::getgid().as_raw()));
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
    checks.push(check_root("run_root", &config.run_root, uid));
    checks.push(check_root("workspace_root", &config.workspace_root, uid));
    let len = config.run_root.as_os_str().len() + SOCKET_SUFFIX.len();
    checks.push(if len > MAX_SOCKET_PATH {
        fail(
            "socket path",
            format!(
                "{}{SOCKET_SUFFIX} is {len} bytes, over {MAX_SOCKET_PATH}",
                config.run_root.display()
            ),
            "choose a shorter run_root, e.g. /run/roundtable or /srv/rt/run",
        )
    } else {
        pass("socket path", format!("{len} of {MAX_SOCKET_PATH} bytes"))
    });
    let failed = checks.iter().filter(|c| !c.ok).count();
    for c in &checks {
        println!(
            "{} {:<15} {}",
            if c.ok { "ok  " } else { "FAIL" },
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

fn host_of(url: &str) -> String {
    let after = url.split_once("://").map_or(url, |(_, r)| r);
    let host = after.split(['/', '?', '#']).next().unwrap_or_default();
    host.rsplit_once('@').map_or(host, |(_, h)| h).to_owned()
}

async fn explain(settings: &Settings) -> Result<ExitCode> {
    let (config, offline) = settings.build().await.context("read the configuration")?;
    let show = |p: &PathBuf| {
        std::fs::canonicalize(p)
            .unwrap_or_else(|_| p.clone())
            .display()
            .to_string()
    };
    let l = &config.limits;
    let b = &config.broker_limits;
    let uid = config.uid.unwrap_or_else(|| nix::unistd::getuid().as_raw());
    let gid = config.gid.unwrap_or_else(|| nix::unistd::getgid().as_raw());
    println!("image         {}", config.image);
    println!(
        "container     user {uid}:{gid}, network none, read-only root, all capabilities dropped, \
         no-new-privileges, init process"
    );
    println!(
        "limits        memory {} MiB (no swap), {} cpus, {} pids, /tmp tmpfs {} MiB, reply {} KiB",
        l.memory_mb, l.cpus, l.pids, l.tmpfs_mb, l.output_kb
    );
    println!(
        "mounts        {}/turn-XXXXXX -> /run/roundtable (read-only, holds only broker.sock)",
        show(&config.run_root)
    );
    println!(
        "              {}/<sha256(channel)> -> /workspace (read-write; the root itself is never mounted)",
        show(&config.workspace_root)
    );
    println!(
        "turn timeout  {} s",
        config
            .turn_timeout
            .unwrap_or(roundtable_sandbox::config::DEFAULT_TURN_TIMEOUT)
            .as_secs_f64()
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
    println!(
        "broker caps   request {} KiB, response {} KiB, {} model calls, {} tool calls, {:?} per call",
        b.max_request_bytes / 1024,
        b.max_response_bytes / 1024,
        b.max_model_calls,
        b.max_tool_calls,
        b.call_timeout
    );
    println!(
        "broker peer   {}",
        if config.peer_uid_check {
            "only the worker uid may connect (SO_PEERCRED)"
        } else {
            "uid check OFF (peer_uid_check = false)"
        }
    );
    if config.tools.is_empty() {
        println!("host tools    (none)");
    }
    for t in &config.tools {
        println!("host tool     {}: {}", t.name(), t.description());
    }
    if config.mcp.is_empty() {
        println!("mcp           (none)");
    }
    for m in &config.mcp {
        let how = match &m.transport {
            McpTransport::Stdio { command, .. } => format!("stdio `{command}`"),
            McpTransport::Http { url, .. } => format!("http {}", host_of(url)),
        };
        println!(
            "mcp           {}: {how}; allow-list: {}",
            m.name,
            m.tools.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn turn(settings: &Settings, rest: Vec<String>) -> Result<ExitCode> {
    let mut channel = "#cli".to_owned();
    let mut speaker = Speaker {
        id: "operator".into(),
        name: "operator".into(),
    };
    let mut reset = false;
    let mut words = Vec::new();
    let mut it = rest.into_iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--channel" => channel = it.next().context("--channel needs a value")?,
            "--speaker" => {
                let name = it.next().context("--speaker needs a value")?;
                speaker = Speaker {
                    id: name.clone(),
                    name,
                };
            }
            "--reset" => reset = true,
            flag if flag.starts_with("--") => bail!("unknown flag {flag}"),
            _ => words.push(arg),
        }
    }
    if words.is_empty() {
        bail!("turn needs the message text");
    }
    let (config, _offline) = settings.build().await.context("read the configuration")?;
    let sandbox = Sandbox::new(config).await?;
    let reply = sandbox
        .run_turn(TurnRequest {
            channel,
            speaker,
            text: words.join(" "),
            reset,
            stop: tokio_util::sync::CancellationToken::new(),
        })
        .await;
    sandbox.shutdown().await;
    println!("{}", serde_json::to_string_pretty(&reply)?);
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

async fn image_cmd(rest: Vec<String>) -> Result<ExitCode> {
    let mut it = rest.into_iter();
    if it.next().as_deref() != Some("build") {
        bail!("usage: roundtable-sandbox image build [--guest PATH] [--busybox PATH] [--tag TAG]");
    }
    let mut source = ImageSource {
        guest: "target/x86_64-unknown-linux-gnu/release/roundtable-guest".into(),
        busybox: "/bin/busybox".into(),
    };
    let mut tag = roundtable_sandbox::settings::DEFAULT_IMAGE.to_owned();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--guest" => source.guest = it.next().context("--guest needs a value")?.into(),
            "--busybox" => source.busybox = it.next().context("--busybox needs a value")?.into(),
            "--tag" => tag = it.next().context("--tag needs a value")?,
            other => bail!("unknown argument {other:?}"),
        }
    }
    let driver = DockerDriver::default();
    let id = image::build(&driver, &source, &tag).await?;
    println!("built {tag} ({id})");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_detected_with_a_hint() {
        let c = user_check(0, 0);
        assert!(!c.ok);
        assert_eq!(c.detail, "running as root: the runtime refuses root");
        assert!(c.hint.unwrap().contains("setpriv --reuid=roundtable"));
        assert!(user_check(999, 995).ok);
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
