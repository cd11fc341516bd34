//! The guest program's subcommands that run no turn, as real processes (each installs the
//! guest's seccomp layer first, as in the container): `fetch`'s HTML converter
//! (`--html-to-text`), stopped by its CPU limit on a page html5ever is slow on, and
//! `fetch` itself (its stub-broker tests are the unit tests in `src/fetch/tests.rs`).

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const GUEST: &str = env!("CARGO_BIN_EXE_roundtable-guest");

fn run(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(GUEST)
        .args(args)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&stdin);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    out
}

#[test]
fn the_html_converter_reduces_a_page_and_its_cpu_limit_stops_a_hostile_one() {
    let out = run(
        &["--html-to-text", "5"],
        b"<title>t</title><style>p{}</style><p>Fish &amp; chips <a href=\"https://example.org/\">here</a></p><script>x()</script>",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "Fish & chips [here][1]\n\n[1]: https://example.org/\n"
    );

    // 20,000 distinct open formatting elements, then 20,000 paragraphs: each paragraph
    // rebuilds them all (18 s of CPU in a release build, and its memory).
    let n = 20_000;
    let mut page: String = (0..n).map(|i| format!("<b x={i}>")).collect();
    page.push_str(&"<p>t</p>".repeat(n));
    let start = Instant::now();
    let out = run(&["--html-to-text", "1"], page.as_bytes());
    assert_eq!(
        out.status.signal(),
        Some(24),
        "SIGXCPU expected: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );

    let out = run(&["--html-to-text"], b"");
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn the_fetch_subcommand_runs_as_a_process_under_its_layer() {
    let out = run(&["fetch", "--help"], b"");
    assert!(out.status.success());
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .starts_with("usage: roundtable-guest fetch [OPTIONS] ROUTE URL-or-PATH\n"));
    let out = run(&["fetch", "web"], b"");
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    // Outside a container the broker's socket is not there: the request fails cleanly
    // (and its stdout carries no reply frame, as a turn's would).
    if !std::path::Path::new(roundtable_sandbox_protocol::BROKER_SOCKET).exists() {
        let out = run(&["fetch", "web", "https://example.org/"], b"");
        assert_eq!(out.status.code(), Some(1));
        assert!(out.stdout.is_empty());
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with("roundtable-guest fetch: cannot reach the broker: "),
            "{err}"
        );
    }
}
