//! HTML reduced to readable text for the model, in the guest (never on the host), and in a
//! child process of the guest under limits.
//!
//! `html2text` (html5ever's HTML5 parser) drops scripts and styles, decodes entities and
//! lists links as numbered references. Its tree builder is not linear on hostile markup:
//! measured here (release build), 20,000 distinct open `<b x=…>` followed by 20,000 short
//! paragraphs (about 300 KiB) took 18 s and the memory of 400 million reconstructed
//! elements; 20,000 nested `<ul><li>` 10 s; 20,000 nested `<div>` 1.9 s, quadratic. A page
//! must not cost the turn its time or its memory, so the conversion runs in a child:
//! `roundtable-guest --html-to-text SECS` (this same program, under the same seccomp
//! layer, which it inherits), with `RLIMIT_CPU` at SECS and `RLIMIT_AS` at
//! [`CHILD_MEMORY`], killed by the parent at a wall-clock deadline. When it fails the
//! caller shows the page's HTML as it came (cleaned and capped like any text).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The argument that runs the child (`roundtable-guest --html-to-text SECS`).
pub const CHILD_ARG: &str = "--html-to-text";
/// The child's CPU time.
pub const CHILD_CPU_SECS: u64 = 10;
/// The child's address space (`RLIMIT_AS`).
pub const CHILD_MEMORY: u64 = 512 * 1024 * 1024;
/// The wall-clock time the parent gives the child (CPU time aside: a throttled container
/// runs slower than its CPU time).
const CHILD_DEADLINE: Duration = Duration::from_secs(30);
/// The most HTML the child reads.
pub const MAX_HTML: usize = 16 * 1024 * 1024;
/// The most text the parent reads back.
const MAX_TEXT: usize = 32 * 1024 * 1024;
/// The columns the text is wrapped at.
const WRAP: usize = 100;

/// An HTML page as readable text: scripts and styles dropped, entities decoded, links as
/// numbered references listed at the end. In this process, without limits: the child's
/// work, and the unit tests'.
pub fn html_to_text(html: &[u8]) -> Result<String, String> {
    let html = String::from_utf8_lossy(html);
    html2text::config::plain()
        .allow_width_overflow()
        .string_from_read(html.as_bytes(), WRAP)
        .map_err(|e| format!("the page could not be laid out: {e}"))
}

/// Where HTML becomes text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HtmlConverter {
    /// In this process (the unit tests).
    #[cfg(test)]
    InProcess,
    /// In a child: `PROGRAM --html-to-text SECS`, HTML on its stdin, text on its stdout.
    Child(PathBuf),
}

impl HtmlConverter {
    /// This program, run as the child (in the container: `/roundtable-guest`).
    pub fn this_program() -> Self {
        HtmlConverter::Child(
            std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/roundtable-guest")),
        )
    }

    /// The page as text, or why it could not be made.
    pub fn convert(&self, html: &[u8]) -> Result<String, String> {
        match self {
            #[cfg(test)]
            HtmlConverter::InProcess => html_to_text(html),
            HtmlConverter::Child(program) => {
                in_child(program, html, CHILD_CPU_SECS, CHILD_DEADLINE)
            }
        }
    }
}

/// Runs the child on `html`: its text, or why not (killed, failed, too slow).
pub fn in_child(
    program: &std::path::Path,
    html: &[u8],
    cpu_secs: u64,
    deadline: Duration,
) -> Result<String, String> {
    let mut child = Command::new(program)
        .arg(CHILD_ARG)
        .arg(cpu_secs.to_string())
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start the converter: {e}"))?;
    // Both pipes on their own threads: neither side can block the other.
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("the converter has no pipes".into());
    };
    let input = html[..html.len().min(MAX_HTML)].to_vec();
    std::thread::spawn(move || {
        // A child that stops reading (it failed) closes the pipe: nothing to do then.
        let _ = stdin.write_all(&input);
    });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = Vec::new();
        let read = stdout.take(MAX_TEXT as u64 + 1).read_to_end(&mut out);
        let _ = tx.send(read.map(|_| out));
    });
    let end = Instant::now() + deadline;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= end => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "the converter took longer than {:.1} s and was stopped",
                    deadline.as_secs_f64()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(format!("waiting for the converter failed: {e}")),
        }
    };
    if !status.success() {
        return Err(match std::os::unix::process::ExitStatusExt::signal(&status) {
            Some(signal) => format!(
                "the converter was stopped by signal {signal} (its limits: {cpu_secs} s of CPU, {} MiB)",
                CHILD_MEMORY >> 20
            ),
            None => "the converter failed".to_owned(),
        });
    }
    let out = rx
        .recv_timeout(Duration::from_secs(2))
        .map_err(|_| "the converter's output did not end".to_owned())?
        .map_err(|e| format!("cannot read the converter's output: {e}"))?;
    if out.len() > MAX_TEXT {
        return Err("the converter's output is too large".into());
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `roundtable-guest --html-to-text SECS`: sets its limits, reads HTML on stdin, writes the
/// text on stdout; returns the exit status.
pub fn child_main(args: &[String]) -> i32 {
    use nix::sys::resource::{setrlimit, Resource};
    let secs = match args.first().and_then(|s| s.parse::<u64>().ok()) {
        Some(secs @ 1..=600) => secs,
        _ => {
            eprintln!("roundtable-guest {CHILD_ARG}: give the CPU seconds (1 to 600)");
            return 2;
        }
    };
    // Past the soft CPU limit the kernel sends SIGXCPU, which ends the process.
    if let Err(e) = setrlimit(Resource::RLIMIT_CPU, secs, secs + 1)
        .and_then(|()| setrlimit(Resource::RLIMIT_AS, CHILD_MEMORY, CHILD_MEMORY))
    {
        eprintln!("roundtable-guest {CHILD_ARG}: cannot set its limits: {e}");
        return 1;
    }
    let mut html = Vec::new();
    if let Err(e) = std::io::stdin()
        .lock()
        .take(MAX_HTML as u64)
        .read_to_end(&mut html)
    {
        eprintln!("roundtable-guest {CHILD_ARG}: cannot read the page: {e}");
        return 1;
    }
    match html_to_text(&html) {
        Ok(text) => {
            let mut stdout = std::io::stdout().lock();
            match stdout
                .write_all(text.as_bytes())
                .and_then(|()| stdout.flush())
            {
                Ok(()) => 0,
                Err(_) => 1,
            }
        }
        Err(e) => {
            eprintln!("roundtable-guest {CHILD_ARG}: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;

    /// A stand-in converter: a shell script run as the child would be.
    fn script(dir: &TempDir, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.path().join("converter");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn the_child_is_given_the_page_and_its_limits_and_its_text_is_read() {
        let dir = TempDir::new();
        let echo = script(&dir, r#"echo "args: $1 $2"; cat"#);
        let page = "<p>x</p>".repeat(100_000);
        let out = in_child(&echo, page.as_bytes(), 7, Duration::from_secs(60)).unwrap();
        assert_eq!(out, format!("args: {CHILD_ARG} 7\n{page}"));
    }

    #[test]
    fn a_child_that_hangs_fails_or_reads_nothing_is_an_error_in_bounded_time() {
        let dir = TempDir::new();
        let start = Instant::now();
        let hung = script(&dir, "exec sleep 30");
        let err = in_child(&hung, b"<p>x</p>", 1, Duration::from_millis(300)).unwrap_err();
        assert_eq!(err, "the converter took longer than 0.3 s and was stopped");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        // It reads nothing and fails: the writer's broken pipe stops no one.
        let failing = script(&dir, "exit 3");
        let big = vec![b'a'; 4 << 20];
        let err = in_child(&failing, &big, 1, Duration::from_secs(60)).unwrap_err();
        assert_eq!(err, "the converter failed");
        let killed = script(&dir, "kill -XCPU $$");
        let err = in_child(&killed, b"", 1, Duration::from_secs(60)).unwrap_err();
        assert_eq!(
            err,
            "the converter was stopped by signal 24 (its limits: 1 s of CPU, 512 MiB)"
        );
        let missing = dir.path().join("missing");
        assert!(in_child(&missing, b"", 1, Duration::from_secs(1))
            .unwrap_err()
            .starts_with("cannot start the converter: "));
    }

    #[test]
    fn ordinary_hostile_markup_is_reduced_in_process_quickly() {
        // What stays linear: deep inline nesting, nested tables, many attributes, a huge
        // attribute, broken markup. (The superlinear cases are the child's, see the
        // module's text and guest/tests/html_child.rs.)
        let pages = [
            "<span>".repeat(20_000) + "deep",
            "<table><tr><td>".repeat(2_000) + "cell",
            format!(
                "<div{}>many</div>",
                (0..20_000).map(|i| format!(" a{i}=1")).collect::<String>()
            ),
            format!("<a href=\"{}\">huge</a><p unclosed", "h".repeat(1 << 20)),
        ];
        for page in pages {
            let start = Instant::now();
            let text = html_to_text(page.as_bytes()).unwrap();
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "{:?}",
                start.elapsed()
            );
            assert!(
                ["deep", "cell", "many", "huge"]
                    .iter()
                    .any(|w| text.contains(w)),
                "{text}"
            );
        }
    }
}
