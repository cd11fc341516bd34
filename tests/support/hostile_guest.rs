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
    let chat = r#"{"model":"gpt-evil","messages":[{"role":"user","content":"hi"}],"base_url":"http://evil.example/v1","api_key":"sk-guest"}"#;
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
