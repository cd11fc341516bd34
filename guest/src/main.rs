//! `roundtable-guest`: the program that runs one turn inside the sealed container.
//!
//! It reads one [`Turn`] JSON from stdin, runs the agent against the broker socket, and
//! prints exactly one [`Reply`] JSON on stdout, exiting 0 (also for `{ok:false,error}`).
//! Logs go to stderr. `roundtable-guest --version` prints the version and exits.

#![forbid(unsafe_code)]

mod agent;
mod broker;
mod chat;
mod compact;
mod confine;
mod prompt;
mod runner;
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
    let reply = match std::panic::catch_unwind(|| {
        read_turn().map(|turn| runner::run(&turn, &runner::Config::container()))
    }) {
        Ok(Ok(reply)) => reply,
        Ok(Err(error)) => Reply::error(error),
        Err(_) => Reply::error("the guest failed unexpectedly"),
    };
    let mut out = serde_json::to_vec(&reply)
        .unwrap_or_else(|_| br#"{"ok":false,"error":"cannot encode the reply"}"#.to_vec());
    out.push(b'\n');
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
