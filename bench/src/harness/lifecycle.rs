//! One trivial turn on each path: the whole runtime, the driver alone, the bare Docker API
//! lifecycle, and the docker CLI.
//!
//! Every path runs the same image with the same entrypoint override (a busybox `sh -c`
//! script that reads the turn and answers at once, no model call) and the same stdin (the
//! turn JSON the runtime would send). Each returns when the reply is known (`reply`) and
//! when the container is gone (`total`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig};
use bollard::query_parameters::{
    AttachContainerOptions, CreateContainerOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder, WaitContainerOptions,
};
use bollard::Docker;
use futures_util::StreamExt;
use roundtable_sandbox::driver::ContainerSpec;
use roundtable_sandbox::protocol::{Speaker, Turn};
use roundtable_sandbox::{ApiKey, Config, ContainerDriver, DockerDriver, Sandbox};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// The guest of a trivial turn: read the turn, answer at once.
pub const SCRIPT: &str = r#"cat >/dev/null; echo '{"ok":true,"text":"hi"}'"#;
/// Label on every container the baselines create (swept before and after a run).
pub const BENCH_LABEL: &str = "roundtable-bench";

/// Times of one turn.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Until the reply is known (what a guest waits for).
    pub reply: Duration,
    /// Until the container is removed.
    pub total: Duration,
    /// The bare lifecycle's steps (create, attach, start, run until exit and output
    /// end, remove), each from its start to the next's.
    pub steps: Option<[(&'static str, Duration); 5]>,
}

/// The entrypoint override shared by every path.
pub fn command() -> Vec<String> {
    vec!["/bin/sh".into(), "-c".into(), SCRIPT.into()]
}

/// The stdin of every path: the turn JSON the runtime sends for a one-word message.
pub fn turn_stdin() -> Vec<u8> {
    let turn = Turn {
        text: "hello".into(),
        speaker: speaker(),
        model: "bench-model".into(),
        prompt: roundtable_sandbox::internals::config::DEFAULT_PROMPT.into(),
        time_zone: "UTC".into(),
        reset: false,
        tools: Vec::new(),
        mcp: Vec::new(),
        egress: Vec::new(),
        max_steps: None,
        session_budget: None,
    };
    serde_json::to_vec(&turn).expect("a turn serialises")
}

fn speaker() -> Speaker {
    Speaker {
        id: "u1".into(),
        name: "ann".into(),
    }
}

/// Private roots for the runtime (0700, owned by the running user).
#[derive(Debug)]
pub struct Roots {
    _dir: tempfile::TempDir,
    pub run_root: PathBuf,
    pub workspace_root: PathBuf,
    /// The roots of the actor layer's runtime.
    pub actors_run_root: PathBuf,
    pub actors_workspace_root: PathBuf,
    /// The roots of the runtime with prepared containers (`runtime_warm`).
    pub warm_run_root: PathBuf,
    pub warm_workspace_root: PathBuf,
    /// A fixed run dir and workspace for the driver-only path.
    pub fixed_run: PathBuf,
    pub fixed_ws: PathBuf,
}

/// Where the bench makes its dirs (run and workspace roots, the budgets' state files):
/// `ROUNDTABLE_BENCH_DIR`, default `/tmp`. A tmpfs there shows what their filesystem costs.
pub fn bench_dir() -> PathBuf {
    std::env::var_os("ROUNDTABLE_BENCH_DIR").map_or_else(|| "/tmp".into(), PathBuf::from)
}

impl Roots {
    /// In [`bench_dir`].
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("rtb-")
            .tempdir_in(bench_dir())
            .context("make the bench dir")?;
        let run_root = dir.path().join("run");
        let workspace_root = dir.path().join("ws");
        let actors_run_root = dir.path().join("arun");
        let actors_workspace_root = dir.path().join("aws");
        let warm_run_root = dir.path().join("wrun");
        let warm_workspace_root = dir.path().join("wws");
        let fixed_run = dir.path().join("fixed-run");
        let fixed_ws = dir.path().join("fixed-ws");
        for d in [&fixed_run, &fixed_ws] {
            std::fs::create_dir(d)?;
        }
        Ok(Self {
            _dir: dir,
            run_root,
            workspace_root,
            actors_run_root,
            actors_workspace_root,
            warm_run_root,
            warm_workspace_root,
            fixed_run,
            fixed_ws,
        })
    }
}

/// The runtime for trivial turns; `model_url` is where a guest's model calls would go.
pub async fn sandbox(image: &str, roots: &Roots, model_url: &str) -> Result<Sandbox> {
    let c = bench_config(&roots.run_root, &roots.workspace_root, image, model_url)
        .command(command())
        .instance(format!("bench-{}", std::process::id()))
        .build();
    Sandbox::new(c).await.context("start the runtime")
}

/// The configuration of a runtime with prepared containers on (`[warm]`, 64 at most), on
/// the warm roots, its instance named `{instance}-{pid}`.
fn warm_config(image: &str, roots: &Roots, model_url: &str, instance: &str) -> Config {
    bench_config(
        &roots.warm_run_root,
        &roots.warm_workspace_root,
        image,
        model_url,
    )
    .command(command())
    .instance(format!("{instance}-{}", std::process::id()))
    .warm(roundtable_sandbox::WarmSettings {
        enabled: true,
        max: 64,
        ttl_secs: None,
    })
    .build()
}

/// The runtime with prepared containers on (`[warm]`), on its own roots.
pub async fn warm_sandbox(image: &str, roots: &Roots, model_url: &str) -> Result<Sandbox> {
    let c = warm_config(image, roots, model_url, "bench-warm");
    Sandbox::new(c).await.context("start the warm runtime")
}

/// The warm runtime with accounting and every budget on (far from reached), its counters
/// in a state file beside its roots, the audit trail (`audit.jsonl` beside it), every event
/// sent to `observer` if given (the metrics adapter): the same turns as [`warm_sandbox`]
/// otherwise.
pub async fn observed_warm_sandbox(
    image: &str,
    roots: &Roots,
    model_url: &str,
    state_file: &Path,
    observer: Option<roundtable_sandbox::events::Observer>,
) -> Result<Sandbox> {
    let mut c = bench_config(
        &roots.warm_run_root,
        &roots.warm_workspace_root,
        image,
        model_url,
    )
    .command(command())
    .instance(format!(
        "bench-{}-{}",
        if observer.is_some() {
            "observed"
        } else {
            "budget"
        },
        std::process::id()
    ))
    .warm(roundtable_sandbox::WarmSettings {
        enabled: true,
        max: 64,
        ttl_secs: None,
    })
    .build();
    // `RTB_OBSERVED` (a comma list of `budgets`, `turns`, `audit`, `metrics`; all when unset): which
    // parts the *on* side has, to find which one a difference comes from.
    let parts =
        std::env::var("RTB_OBSERVED").unwrap_or_else(|_| "budgets,turns,audit,metrics".into());
    let has = |part: &str| parts.split(',').any(|p| p.trim() == part);
    if has("budgets") {
        c.budgets = roundtable_sandbox::BudgetSettings {
            state_file: Some(state_file.to_owned()),
            speaker_tokens_per_day: Some(1_000_000_000),
            channel_tokens_per_day: Some(1_000_000_000),
            bot_tokens_per_day: Some(1_000_000_000),
            // `budgets` alone: token budgets only (`turns` adds the speakers' turns per
            // minute, whose admissions the writer commits).
            speaker_turns_per_minute: has("turns").then_some(10_000),
            ..Default::default()
        };
    }
    // The audit trail beside the state file (issue 23 item 8: audit and accounting on).
    if has("audit") {
        c.audit = roundtable_sandbox::internals::audit::AuditSettings {
            path: Some(state_file.with_file_name("audit.jsonl")),
            include_text: false,
        };
    }
    c.observer = Some(match observer.filter(|_| has("metrics")) {
        Some(metrics) => {
            let phases = phase_recorder();
            Arc::new(move |event| {
                phases(event);
                metrics(event);
            })
        }
        None => phase_recorder(),
    });
    Sandbox::new(c)
        .await
        .context("start the budgeted warm runtime")
}

/// A warm runtime with every budget set (far from reached, turns per minute too), its
/// counters in the SQLite `state_file` or, with `store_url_file`, in the PostgreSQL store
/// whose URL that file holds (`state_file` its journal). The `store` part's sides.
pub async fn budget_store_sandbox(
    image: &str,
    roots: &Roots,
    model_url: &str,
    state_file: &Path,
    store_url_file: Option<&Path>,
    namespace: &str,
) -> Result<Sandbox> {
    let mut c = warm_config(image, roots, model_url, &format!("bench-store-{namespace}"));
    c.budgets = roundtable_sandbox::BudgetSettings {
        state_file: Some(state_file.to_owned()),
        speaker_tokens_per_day: Some(1_000_000_000),
        channel_tokens_per_day: Some(1_000_000_000),
        bot_tokens_per_day: Some(1_000_000_000),
        speaker_turns_per_minute: Some(10_000),
        store: store_url_file.map(|f| {
            roundtable_sandbox::StoreSource::Ref(roundtable_sandbox::KeyRef {
                env: None,
                file: Some(f.to_owned()),
            })
        }),
        namespace: store_url_file.map(|_| namespace.to_owned()),
        ..Default::default()
    };
    c.observer = Some(phase_recorder());
    Sandbox::new(c)
        .await
        .context("start the budget store's warm runtime")
}

/// The settings every runtime of the bench shares: the image, a model endpoint (plain HTTP
/// allowed), a key that never reaches the container, a 120 s turn timeout.
pub fn bench_config(
    run_root: &Path,
    workspace_root: &Path,
    image: &str,
    model_url: &str,
) -> roundtable_sandbox::internals::config::ConfigBuilder {
    Config::builder(run_root, workspace_root)
        .image(image)
        .model(model_url, "bench-model")
        .api_key(ApiKey::from_static("sk-bench-never-in-the-container"))
        .allow_http(true)
        .turn_timeout(Duration::from_secs(120))
        .observer(phase_recorder())
}

/// Prepares the channel's next container (what a channel does after its turn, in the
/// background; untimed here).
pub async fn prepare(sandbox: &Sandbox, channel: &str) -> Result<roundtable_sandbox::PreparedTurn> {
    sandbox
        .prepare_turn(channel, CancellationToken::new())
        .await?
        .context("no container prepared (warm off or warm.max reached)")
}

/// A trivial turn through the whole runtime in a container prepared before the message
/// (`run_turn_prepared`): quota check, broker bound, turn written, reply, teardown.
pub async fn warm_turn(
    sandbox: &Sandbox,
    channel: &str,
) -> Result<(Timing, Vec<(String, Duration)>)> {
    let prepared = prepare(sandbox, channel).await?;
    timed_turn(sandbox, channel, Some(prepared), "warm").await
}

/// A trivial turn through the whole runtime (`run_turn`: dirs, broker, container,
/// reply, teardown). `reply` is when the turn's reply callback fires.
pub async fn runtime_turn(sandbox: &Sandbox, channel: &str) -> Result<Timing> {
    Ok(runtime_turn_profiled(sandbox, channel).await?.0)
}

/// [`runtime_turn`], with the time at which each phase began (the turn's observer).
pub async fn runtime_turn_profiled(
    sandbox: &Sandbox,
    channel: &str,
) -> Result<(Timing, Vec<(String, Duration)>)> {
    timed_turn(sandbox, channel, None, "runtime").await
}

/// The turn being timed: its number, its start and each phase's time since, written by
/// [`phase_recorder`] (every bench runtime's observer, from [`bench_config`]).
type Timed = Option<(u64, Instant, Vec<(String, Duration)>)>;
static TIMING: Mutex<Timed> = Mutex::new(None);

fn timing() -> std::sync::MutexGuard<'static, Timed> {
    TIMING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The observer that records the timed turn's phases (see [`timed_turn`]).
pub fn phase_recorder() -> roundtable_sandbox::events::Observer {
    Arc::new(|event: &roundtable_sandbox::events::Event| {
        if let roundtable_sandbox::events::EventKind::Phase(phase) = event.kind {
            if let Some((turn, t0, seen)) = &mut *timing() {
                if event.turn == Some(*turn) {
                    seen.push((format!("{phase:?}"), t0.elapsed()));
                }
            }
        }
    })
}

/// One trivial turn through the runtime (cold when `prepared` is `None`, which is what
/// `run_turn` does), timed from just before the call, with the time at which each phase
/// began. `what` names the path in the error of a failed turn.
pub async fn timed_turn(
    sandbox: &Sandbox,
    channel: &str,
    prepared: Option<roundtable_sandbox::PreparedTurn>,
    what: &str,
) -> Result<(Timing, Vec<(String, Duration)>)> {
    let request = roundtable_sandbox::TurnRequest {
        channel: channel.into(),
        speaker: speaker(),
        text: "hello".into(),
        reset: false,
        stop: CancellationToken::new(),
        admitted: None,
        limits_key: None,
    };
    let t0 = Instant::now();
    let turn = sandbox.admit(request);
    *timing() = Some((turn.number(), t0, Vec::with_capacity(8)));
    let mut reply_at = None;
    let outcome = sandbox
        .run(turn, prepared, |_| reply_at = Some(t0.elapsed()))
        .await;
    let total = t0.elapsed();
    let phases = timing().take().map(|(_, _, p)| p).unwrap_or_default();
    if !outcome.reply.ok {
        bail!("{what} turn failed: {:?}", outcome.reply.error);
    }
    Ok((
        Timing {
            reply: reply_at.unwrap_or(total),
            total,
            steps: None,
        },
        phases,
    ))
}

/// The sealed container of the driver's turn (the runtime's limits, the bench's fixed dirs),
/// under a fresh name.
pub fn driver_spec(image: &str, roots: &Roots) -> ContainerSpec {
    ContainerSpec {
        name: format!(
            "rtbench-driver-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ),
        image: image.into(),
        run_dir: roots.fixed_run.clone(),
        workspace_dir: roots.fixed_ws.clone(),
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        memory_mb: 512,
        cpus: 1.0,
        pids: 128,
        tmpfs_mb: 64,
        file_size_mb: 1024,
        output_cap: 1 << 20,
        stderr_cap: 64 << 10,
        labels: BTreeMap::from([(BENCH_LABEL.to_owned(), "driver".to_owned())]),
        command: Some(command()),
        runtime: None,
    }
}

/// The sealed container's options, each taken away in turn (issue 24: where the engine's
/// time per sealed container goes): the variant's name and the body without it.
pub fn ablations(spec: &ContainerSpec) -> Vec<(&'static str, ContainerCreateBody)> {
    type Strip = fn(&mut ContainerCreateBody, &mut HostConfig);
    let strips: [(&'static str, Strip); 11] = [
        ("sealed (all options)", |_, _| {}),
        ("without init", |_, h| h.init = None),
        ("without the /tmp tmpfs", |_, h| h.tmpfs = None),
        ("without the two bind mounts", |_, h| h.mounts = None),
        ("without memory/cpu/pids limits", |_, h| {
            (h.memory, h.memory_swap, h.nano_cpus, h.pids_limit) = (None, None, None, None)
        }),
        ("without ulimits", |_, h| h.ulimits = None),
        ("without the read-only root", |_, h| {
            h.readonly_rootfs = None
        }),
        ("without cap drop and no-new-privileges", |_, h| {
            (h.cap_drop, h.security_opt) = (None, None)
        }),
        ("without ipc private and oom score", |_, h| {
            (h.ipc_mode, h.oom_score_adj) = (None, None)
        }),
        ("without the user and working dir", |b, _| {
            (b.user, b.working_dir) = (None, None)
        }),
        ("without all of them", |b, h| {
            let keep = HostConfig {
                network_mode: h.network_mode.take(),
                log_config: h.log_config.take(),
                runtime: h.runtime.take(),
                ..Default::default()
            };
            *h = keep;
            (b.user, b.working_dir, b.env) = (None, None, None);
        }),
    ];
    strips
        .into_iter()
        .map(|(what, strip)| {
            let mut body = roundtable_sandbox::internals::docker::create_body(spec);
            let mut host = body.host_config.take().unwrap_or_default();
            strip(&mut body, &mut host);
            body.host_config = Some(host);
            body.labels = Some(HashMap::from([(
                BENCH_LABEL.to_owned(),
                "ablation".to_owned(),
            )]));
            (what, body)
        })
        .collect()
}

/// The driver alone: the sealed container of a turn (same spec as the runtime's, with a
/// fixed run dir and workspace), run then removed; no broker, no dir creation.
pub async fn driver_turn(
    driver: &DockerDriver,
    image: &str,
    roots: &Roots,
    stdin: &[u8],
) -> Result<Timing> {
    let spec = driver_spec(image, roots);
    let t0 = Instant::now();
    // What the turn does with a run: the driver's outcome, judged into a reply.
    let reply = driver
        .run(&spec, stdin, CancellationToken::new())
        .await
        .map_err(anyhow::Error::from)
        .and_then(|o| {
            roundtable_sandbox::internals::turn::judge(&o, &spec).map_err(anyhow::Error::from)
        });
    let reply_at = t0.elapsed();
    driver.remove(&spec.name).await?;
    let total = t0.elapsed();
    let reply = reply?;
    if !reply.ok {
        bail!("driver turn failed: {:?}", reply.error);
    }
    Ok(Timing {
        reply: reply_at,
        total,
        steps: None,
    })
}

/// The bare lifecycle through the Docker API: create (the image, the entrypoint override,
/// stdin attached, no network), attach, start, write stdin, read the output and wait,
/// remove. No hardening options, no mounts, no broker, no dirs, no inspect.
///
/// `lean` (the baseline the targets use) sets the two options of the runtime's container
/// that make the daemon's work *smaller*: no network sandbox at all (`NetworkDisabled`;
/// `--network none` still builds one with a loopback) and no log driver (output goes
/// through attach only). Without them (`docker run`'s defaults) the lifecycle is slower.
pub async fn bare_turn(docker: &Docker, image: &str, stdin: &[u8], lean: bool) -> Result<Timing> {
    bare_turn_on(docker, image, stdin, lean, None).await
}

/// [`bare_turn`] (lean) under the engine's `runtime` (`runsc`: gVisor; `None`: its default).
pub async fn bare_turn_on(
    docker: &Docker,
    image: &str,
    stdin: &[u8],
    lean: bool,
    runtime: Option<&str>,
) -> Result<Timing> {
    let name = format!(
        "rtbench-bare-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let t0 = Instant::now();
    let body = ContainerCreateBody {
        image: Some(image.into()),
        entrypoint: Some(command()),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        open_stdin: Some(true),
        stdin_once: Some(true),
        labels: Some(HashMap::from([(BENCH_LABEL.to_owned(), "bare".to_owned())])),
        network_disabled: lean.then_some(true),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            log_config: lean.then(|| HostConfigLogConfig {
                typ: Some("none".into()),
                config: None,
            }),
            runtime: runtime.map(str::to_owned),
            ..Default::default()
        }),
        ..Default::default()
    };
    body_turn(docker, &name, body, stdin, t0).await
}

/// One lifecycle of a container made of `body` (named `name`): create, attach, start, write
/// stdin, read to the end and wait, remove; `t0` is when the turn began.
pub async fn body_turn(
    docker: &Docker,
    name: &str,
    body: ContainerCreateBody,
    stdin: &[u8],
    t0: Instant,
) -> Result<Timing> {
    let create = CreateContainerOptionsBuilder::new().name(name).build();
    docker.create_container(Some(create), body).await?;
    let created = t0.elapsed();
    let attach = AttachContainerOptions {
        stdin: true,
        stdout: true,
        stderr: true,
        stream: true,
        logs: false,
        detach_keys: None,
    };
    let io = docker.attach_container(name, Some(attach)).await?;
    let attached = t0.elapsed();
    let mut wait = docker.wait_container(name, None::<WaitContainerOptions>);
    docker.start_container(name, None).await?;
    let started = t0.elapsed();
    let bollard::container::AttachContainerResults {
        mut output,
        mut input,
    } = io;
    let write = async {
        input.write_all(stdin).await?;
        input.shutdown().await
    };
    let read = async {
        let mut out = Vec::new();
        while let Some(frame) = output.next().await {
            out.extend_from_slice(&frame?.into_bytes());
        }
        Ok::<_, bollard::errors::Error>(out)
    };
    let (w, out, status) = tokio::join!(write, read, wait.next());
    w?;
    let out = out?;
    let code = match status {
        Some(Ok(r)) => r.status_code,
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code,
        other => bail!("wait: {other:?}"),
    };
    let reply_at = t0.elapsed();
    let opts = RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build();
    docker.remove_container(name, Some(opts)).await?;
    let total = t0.elapsed();
    check_output(code, &out)?;
    Ok(Timing {
        reply: reply_at,
        total,
        steps: Some([
            ("create", created),
            ("attach", attached - created),
            ("start", started - attached),
            ("run_to_exit", reply_at - started),
            ("remove", total - reply_at),
        ]),
    })
}

/// The bare lifecycle with no stdio at all (create, start, wait, remove: no attach, no stdin;
/// the guest's answer goes nowhere): what the engine's lifecycle costs without the attach
/// stream, for the ablation part (a turn that fetched its input and sent its reply over the
/// broker's socket would need no attach).
pub async fn detached_turn(docker: &Docker, image: &str) -> Result<()> {
    let name = format!(
        "rtbench-detached-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    detached_body_turn(docker, &name, detached_body(image)).await
}

/// The sealed container of `body` with its stdio taken away (no stdin, no attach): what a
/// turn that fetched its input and sent its reply over the broker's socket would ask of
/// the engine (the ablation's "sealed without attach").
pub fn without_stdio(mut body: ContainerCreateBody) -> ContainerCreateBody {
    (body.attach_stdin, body.attach_stdout, body.attach_stderr) = (None, None, None);
    (body.open_stdin, body.stdin_once) = (None, None);
    body
}

/// The bare body with no stdio (for [`detached_turn`]).
fn detached_body(image: &str) -> ContainerCreateBody {
    ContainerCreateBody {
        image: Some(image.into()),
        entrypoint: Some(command()),
        labels: Some(HashMap::from([(
            BENCH_LABEL.to_owned(),
            "detached".to_owned(),
        )])),
        network_disabled: Some(true),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            log_config: Some(HostConfigLogConfig {
                typ: Some("none".into()),
                config: None,
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One lifecycle of a container made of `body` without stdio: create, start, wait, remove.
pub async fn detached_body_turn(
    docker: &Docker,
    name: &str,
    body: ContainerCreateBody,
) -> Result<()> {
    let create = CreateContainerOptionsBuilder::new().name(name).build();
    docker.create_container(Some(create), body).await?;
    let mut wait = docker.wait_container(name, None::<WaitContainerOptions>);
    docker.start_container(name, None).await?;
    let code = match wait.next().await {
        Some(Ok(r)) => r.status_code,
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code,
        other => bail!("wait: {other:?}"),
    };
    let opts = RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build();
    docker.remove_container(name, Some(opts)).await?;
    if code != 0 {
        bail!("the detached guest exited {code}");
    }
    Ok(())
}

/// `docker run --rm -i --network none` of the same image with the same stdin: the path of
/// the original TypeScript driver. The reply is known when the CLI exits (after removal).
pub async fn cli_turn(image: &str, stdin: &[u8]) -> Result<Timing> {
    let t0 = Instant::now();
    let mut child = tokio::process::Command::new("docker")
        .args(["run", "--rm", "-i", "--network", "none", "--label"])
        .arg(format!("{BENCH_LABEL}=cli"))
        .args(["--entrypoint", "/bin/sh", image, "-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("spawn docker")?;
    let mut input = child.stdin.take().expect("piped");
    let mut stdout = child.stdout.take().expect("piped");
    let write = async {
        input.write_all(stdin).await?;
        drop(input);
        Ok::<_, std::io::Error>(())
    };
    let read = async {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    };
    let (w, out) = tokio::join!(write, read);
    w?;
    let out = out?;
    let status = child.wait().await?;
    let total = t0.elapsed();
    check_output(i64::from(status.code().unwrap_or(-1)), &out)?;
    Ok(Timing {
        reply: total,
        total,
        steps: None,
    })
}

fn check_output(code: i64, out: &[u8]) -> Result<()> {
    let text = String::from_utf8_lossy(out);
    if code != 0 || !text.contains(r#""ok":true"#) {
        bail!("the guest answered {text:?} (exit {code})");
    }
    Ok(())
}

/// Removes every container a baseline left (an interrupted run).
pub async fn sweep_bench_containers(docker: &Docker) -> Result<usize> {
    let filters = HashMap::from([("label", vec![BENCH_LABEL.to_owned()])]);
    let opts = ListContainersOptionsBuilder::new()
        .all(true)
        .filters(&filters)
        .build();
    let found = docker.list_containers(Some(opts)).await?;
    let n = found.len();
    for c in found {
        if let Some(id) = c.id {
            let opts = RemoveContainerOptionsBuilder::new().force(true).build();
            let _ = docker.remove_container(&id, Some(opts)).await;
        }
    }
    Ok(n)
}

/// Whether the image is present (the bench needs scripts/build-image.sh first).
pub async fn require_image(docker: &Docker, image: &str) -> Result<()> {
    docker
        .inspect_image(image)
        .await
        .with_context(|| format!("image {image} not found: run scripts/build-image.sh"))?;
    Ok(())
}

/// Entries left under a directory (the runtime's run root must be empty between turns).
/// Turn dirs (and sockets) left in a run root; the runtime's lock file is not one.
pub fn entries(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("turn-"))
                .count()
        })
        .unwrap_or(0)
}
