//! Issue 21 (must-have 2): the model key cannot be read by another process of the service
//! user. A runtime (a real [`Sandbox`], its key read from `OPENAI_API_KEY` as the config
//! file names it) runs in a child process of this test binary; while its turn runs in a
//! real container, this process (the same uid) tries what an MCP server with a file-reading
//! tool, or any other program of the service user, could: read `/proc/<pid>/environ` and
//! `/proc/<pid>/mem` (at an address from `/proc/<pid>/maps` when that is readable), list
//! `/proc/<pid>/fd`, `ptrace`-attach. Each is refused. The runtime's own environment no
//! longer holds the key once read, no process it spawns inherits it, and none of its
//! descendants' environments holds it.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::{Config, Sandbox};

const KEY: &str = "sk-host-process-test-5f0c2a9e71d84b36";
/// Set in the child: it is the runtime.
const CHILD: &str = "ROUNDTABLE_TEST_RUNTIME_CHILD";
const TEST: &str = "the_runtime_is_closed_to_its_own_uid_while_a_turn_runs";

/// The turn: marks that it runs, waits for the test's go, answers.
const SCRIPT: &str = r#"cat >/dev/null; : > /workspace/started; i=0; while [ ! -e /workspace/done ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; printf '{"ok":true,"text":"done"}'"#;

#[test]
fn the_runtime_is_closed_to_its_own_uid_while_a_turn_runs() {
    if std::env::var_os(CHILD).is_some() {
        return runtime();
    }
    require_non_root();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("OPENAI_API_KEY", KEY)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;

    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ws = loop {
        let line = lines
            .next()
            .expect("the runtime child ended before its turn")
            .unwrap();
        // (libtest's "test … " may precede it on the line)
        if let Some((_, ws)) = line.split_once("@@workspace ") {
            break PathBuf::from(ws);
        }
    };
    // A failing assertion below lets the turn end (its teardown removes its container).
    let _release = Release(ws.join("done"));
    let started = Instant::now();
    while !ws.join("started").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the turn never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let proc = PathBuf::from(format!("/proc/{pid}"));
    let environ = std::fs::read(proc.join("environ"));
    assert!(
        matches!(&environ, Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied),
        "environ: {:?}",
        environ.map(|b| contains(&b, KEY))
    );
    // The memory: at a readable address of the maps when they can be read, else at the
    // start (the open itself is what must fail).
    let address = std::fs::read_to_string(proc.join("maps"))
        .ok()
        .and_then(|maps| readable_address(&maps));
    let mem = std::fs::File::open(proc.join("mem")).and_then(|mut f| {
        f.seek(SeekFrom::Start(address.unwrap_or(0)))?;
        let mut buf = [0u8; 64];
        f.read(&mut buf)
    });
    assert!(
        matches!(&mem, Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied),
        "mem at {address:?}: {mem:?}"
    );
    let fds = std::fs::read_dir(proc.join("fd")).map(|d| d.count());
    assert!(
        matches!(&fds, Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied),
        "fd: {fds:?}"
    );
    let attached = nix::sys::ptrace::attach(nix::unistd::Pid::from_raw(pid));
    if attached.is_ok() {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        let _ = nix::sys::ptrace::detach(nix::unistd::Pid::from_raw(pid), None);
    }
    assert_eq!(attached, Err(nix::errno::Errno::EPERM), "ptrace attach");
    // No descendant of the runtime holds the key in its environment.
    for d in descendants(pid) {
        if let Ok(env) = std::fs::read(format!("/proc/{d}/environ")) {
            assert!(!contains(&env, KEY), "descendant {d} inherited the key");
        }
    }

    std::fs::write(ws.join("done"), "").unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "runtime child: {status:?}\n{}",
        rest.join("\n")
    );
    assert!(
        rest.iter().any(|l| l.contains("@@replied ok")),
        "{}",
        rest.join("\n")
    );
}

/// Writes the turn's go file when dropped.
struct Release(PathBuf);

impl Drop for Release {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, "");
    }
}

/// The runtime: a config file naming `OPENAI_API_KEY`, a real sandbox, one turn.
fn runtime() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let env = Env::new();
        let file = env.dir.path().join("config.toml");
        std::fs::write(
            &file,
            format!(
                "image = {:?}\nrun_root = {:?}\nworkspace_root = {:?}\nmodel = \"m\"\n\
                 model_url = \"http://127.0.0.1:9/v1\"\nallow_http = true\napi_key_env = \"OPENAI_API_KEY\"\n\
                 [limits]\ndisk_floor_mb = 0\ndisk_floor_percent = 0\n",
                image(),
                env.run_root,
                env.workspace_root
            ),
        )
        .unwrap();
        let mut config = Config::from_toml_file(&file).unwrap();
        assert!(
            std::env::var_os("OPENAI_API_KEY").is_none(),
            "the key is dropped from the environment once read"
        );
        config.command = Some(vec!["/bin/sh".into(), "-c".into(), SCRIPT.into()]);
        config.runtime = runtime_name();
        if under_gvisor() {
            config.peer_uid_check = false;
        }
        let sandbox = Sandbox::new(config).await.unwrap();
        // A process the runtime starts inherits no key.
        let out = Command::new("/bin/sh")
            .args(["-c", "cat /proc/self/environ"])
            .output()
            .unwrap();
        assert!(out.status.success());
        assert!(!contains(&out.stdout, KEY), "a child inherited the key");
        println!("@@workspace {}", env.workspace_of("#host").display());
        let reply = sandbox.run_turn(request("#host", "hi")).await.reply;
        assert!(reply.ok, "{reply:?}");
        println!("@@replied ok");
        sandbox.shutdown().await;
    });
}

fn runtime_name() -> Option<String> {
    roundtable_sandbox::internals::testing::runtime()
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// The start of the first readable private mapping in a maps text.
fn readable_address(maps: &str) -> Option<u64> {
    maps.lines().find_map(|l| {
        let mut parts = l.split_whitespace();
        let range = parts.next()?;
        let perms = parts.next()?;
        perms
            .starts_with('r')
            .then(|| u64::from_str_radix(range.split('-').next()?, 16).ok())
            .flatten()
    })
}

/// Every process whose parent chain leads to `pid`.
fn descendants(pid: i32) -> Vec<i32> {
    let parent = |p: i32| -> Option<i32> {
        let stat =
            std::fs::read_to_string(Path::new("/proc").join(p.to_string()).join("stat")).ok()?;
        let after = stat.rsplit_once(')')?.1;
        after.split_whitespace().nth(1)?.parse().ok()
    };
    let all: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    all.into_iter()
        .filter(|&p| {
            let mut at = p;
            for _ in 0..64 {
                match parent(at) {
                    Some(pp) if pp == pid => return true,
                    Some(pp) if pp > 1 => at = pp,
                    _ => return false,
                }
            }
            false
        })
        .collect()
}
