//! `roundtable-guest`: the program that runs one turn inside the sealed container.
//!
//! It reads one [`Turn`] JSON from stdin, runs the agent against the broker socket, saves
//! the session (atomically, in the runner), and only then prints exactly one [`Reply`] on
//! stdout, framed ([`Reply::frame`]: one line, newline-terminated) and flushed, exiting 0
//! (also for `{ok:false,error}`). The frame is its last act: the host answers the moment it
//! is complete and removes the container without waiting for the exit, so nothing that
//! matters may happen after it.
//! Logs go to stderr. `roundtable-guest --version` prints the version and exits.
//!
//! Before anything else (before the turn is read) it installs its seccomp layer
//! ([`seccomp`]), which every process of the turn inherits; if that fails it replies with
//! the error and runs nothing. `roundtable-guest --exec PROGRAM [ARGS…]` installs the same
//! layer, then replaces itself with PROGRAM: every MCP session's container runs its
//! server's command so (the host mounts this static program read-only into any image, see
//! the broker's `mcp/container.rs`), and the test suite's hostile image runs its attacks
//! so, under the very code path the real turn runs under.
//! `roundtable-guest fetch [OPTIONS] ROUTE URL-or-PATH` runs no turn: it installs the same
//! layer (failing closed: nothing is sent without it), then sends one web request through
//! the broker's egress route, the body to stdout ([`fetch`]); programs run with `sh` use
//! it where they would use curl.
//! `roundtable-guest --html-to-text SECS` runs no turn: `fetch`'s HTML converter, run by
//! the guest as its own child under CPU and memory limits ([`html`]).
//! `roundtable-guest --held-files` runs no turn: it counts the workspace files the turn's
//! processes hold open after deleting them and prints one line ([`held`]); the host runs it
//! beside the turn where it cannot see the guest's descriptors itself (gVisor).

#![forbid(unsafe_code)]

mod agent;
mod broker;
mod chat;
mod compact;
mod confine;
mod fetch;
mod held;
mod html;
mod model;
mod prompt;
mod runner;
mod seccomp;
mod session;
#[cfg(test)]
mod testutil;
mod toolbox;
mod tools;

use std::io::{Read, Write};

use roundtable_sandbox_guest_http as http;
use roundtable_sandbox_protocol::{Reply, Turn};

/// The largest turn read from stdin.
const MAX_TURN: u64 = 4 * 1024 * 1024;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--version") {
        println!("roundtable-guest {}", env!("CARGO_PKG_VERSION"));
        return;
    }
    // The host's measurer (an engine exec beside the turn, under gVisor): no turn is run,
    // nothing of the guest is executed, so it needs no layer of its own.
    if std::env::args().nth(1).as_deref() == Some(roundtable_sandbox_protocol::held::HELD_FILES_ARG)
    {
        held::main();
    }
    if std::env::args_os().nth(1).is_some_and(|a| a == "fetch") {
        fetch_command();
    }
    // `fetch`'s HTML converter, a child of the guest (which it inherits the layer from).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == html::CHILD_ARG)
    {
        layered_or_exit("--html-to-text");
        let args: Vec<String> = std::env::args_os()
            .skip(2)
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        std::process::exit(html::child_main(&args));
    }
    // First of all for a turn: it never runs without the layer (fail closed).
    if let Err(error) = seccomp::install() {
        eprintln!("roundtable-guest: {error}");
        write_reply(&Reply::error(error.to_string()));
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("--exec") {
        exec_confined();
    }

    let reply = match std::panic::catch_unwind(|| {
        read_turn().map(|turn| runner::run(&turn, &runner::RunnerOptions::container()))
    }) {
        Ok(Ok(reply)) => reply,
        Ok(Err(error)) => Reply::error(error),
        Err(_) => Reply::error("the guest failed unexpectedly"),
    };
    write_reply(&reply);
}

/// Installs the layer for a subcommand that runs no turn (so prints no reply): without it,
/// says why on stderr and exits 1 (fail closed).
fn layered_or_exit(what: &str) {
    if let Err(error) = seccomp::install() {
        eprintln!("roundtable-guest {what}: {error}; nothing was run");
        std::process::exit(1);
    }
}

/// `fetch …`: one web request through the broker, under the layer (fail closed).
fn fetch_command() -> ! {
    layered_or_exit("fetch");
    let args: Vec<String> = std::env::args_os()
        .skip(2)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let options = runner::RunnerOptions::container();
    let mut stdout = std::io::BufWriter::with_capacity(64 * 1024, std::io::stdout().lock());
    let code = fetch::command(
        &args,
        &options.socket,
        &options.html,
        &mut fetch::read_data_file,
        &mut stdout,
        &mut std::io::stderr().lock(),
    );
    // `exit` runs no destructor: what is still buffered goes out first.
    if stdout.flush().is_err() && code == 0 {
        std::process::exit(1);
    }
    drop(stdout);
    std::process::exit(code);
}

/// `--exec PROGRAM [ARGS…]`: replaces this process (already under the layer) with PROGRAM;
/// returns only on failure, which it reports as the turn's error.
fn exec_confined() -> ! {
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os().skip(2);
    let error = match args.next() {
        Some(program) => {
            let e = std::process::Command::new(&program).args(args).exec();
            format!("cannot run {}: {e}", program.to_string_lossy())
        }
        None => "--exec needs a program".to_owned(),
    };
    write_reply(&Reply::error(error));
    std::process::exit(0);
}

/// Prints one reply's frame on stdout (the turn's last act); exits 1 if stdout is gone.
fn write_reply(reply: &Reply) {
    let out = reply.frame();
    let mut stdout = std::io::stdout().lock();
    if stdout
        .write_all(&out)
        .and_then(|()| stdout.flush())
        .is_err()
    {
        std::process::exit(1);
    }
}

/// Reads and parses the turn from stdin.
fn read_turn() -> Result<Turn, String> {
    let mut input = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_TURN + 1)
        .read_to_end(&mut input)
        .map_err(|e| format!("cannot read the turn: {e}"))?;
    if input.len() as u64 > MAX_TURN {
        return Err(format!("the turn is larger than {MAX_TURN} bytes"));
    }
    serde_json::from_slice(&input).map_err(|e| format!("invalid turn: {e}"))
}
