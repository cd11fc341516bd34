//! Judging a run: what a container did, mapped to a reply once for every backend.

use roundtable_sandbox_protocol::Reply;

use roundtable_sandbox_protocol::{parse_reply, ReplyError};

use super::outcome::TurnError;
use crate::driver::{ContainerDriver, ContainerSpec, RunOutcome};

/// Judges what a container did, the same for every backend. A run handed over at its
/// reply's frame ([`RunOutcome::reply_ready`]) is that reply: the guest has answered, and
/// what the container does after (its exit status, an OOM kill, a flood, a hang) does
/// not change the answer. Otherwise, at the run's end: an OOM kill, then the output
/// cap, then `128+SIGXFSZ` (the file-size limit), then any non-zero exit, and only then
/// the strict parse of stdout.
pub fn judge(outcome: &RunOutcome, spec: &ContainerSpec) -> Result<Reply, TurnError> {
    if outcome.reply_ready {
        return Ok(parse_reply(&outcome.stdout, spec.output_cap)?);
    }
    if outcome.oom_killed {
        return Err(TurnError::OutOfMemory {
            limit_mb: spec.memory_mb,
        });
    }
    if outcome.stdout_overflow {
        return Err(ReplyError::OutputTooLarge {
            cap: spec.output_cap,
        }
        .into());
    }
    if outcome.exit_code == 128 + libc::SIGXFSZ as i64 {
        return Err(TurnError::FileTooLarge {
            limit_mb: spec.file_size_mb,
        });
    }
    if outcome.exit_code != 0 {
        return Err(TurnError::Exit {
            code: outcome.exit_code,
        });
    }
    Ok(parse_reply(&outcome.stdout, spec.output_cap)?)
}

/// Judges a run; when it did not answer (a non-zero exit, the output cap, output that is
/// not a reply), first asks the driver whether the memory limit killed a process of the
/// container, which then takes precedence as in [`judge`]. A guest that exits 0 with a reply
/// has answered, whatever befell its children (a tool's OOM kill is the tool's failure,
/// which the guest saw): its turn costs no engine call. A failure to ask is logged and
/// leaves the judgement as it is.
pub(super) async fn judge_run(
    mut run: RunOutcome,
    spec: &ContainerSpec,
    driver: &dyn ContainerDriver,
) -> Result<Reply, TurnError> {
    let judged = judge(&run, spec);
    if judged.is_ok() || run.oom_killed || run.reply_ready {
        return judged;
    }
    match driver.oom_killed(&spec.name).await {
        Ok(true) => {
            run.oom_killed = true;
            judge(&run, spec)
        }
        Ok(false) => judged,
        Err(e) => {
            tracing::warn!(container = %spec.name, error = %e, "ask whether an OOM kill ended the turn");
            judged
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::turn::TurnFailure;
    use std::collections::BTreeMap;

    #[test]
    fn parse_reply_is_strict() {
        assert_eq!(
            parse_reply(b" {\"ok\":true,\"text\":\"hi\"}\n", 100)
                .unwrap()
                .text
                .as_deref(),
            Some("hi")
        );
        let err = |b: &[u8]| parse_reply(b, 64).unwrap_err().to_string();
        assert_eq!(err(b""), "guest output is not a valid reply: no output");
        assert!(err(b"garbage").starts_with("guest output is not a valid reply: expected value"));
        assert!(err(b"{\"ok\":true,\"text\":\"a\"} trailing").contains("trailing characters"));
        assert!(err(b"{\"ok\":true,\"text\":\"a\",\"admin\":true}").contains("unknown field"));
        assert_eq!(
            err(b"{\"ok\":true}"),
            "guest output is not a valid reply: an ok reply must carry text and no error"
        );
        assert_eq!(err(&[b' '; 65]), "guest output exceeds 64 bytes");
        assert_eq!(
            parse_reply(b"{\"ok\":false,\"error\":\"turn stopped\"}", 100)
                .unwrap()
                .error
                .as_deref(),
            Some("the guest reported an error: turn stopped")
        );
    }

    fn spec() -> ContainerSpec {
        ContainerSpec {
            name: "c".into(),
            image: "i".into(),
            run_dir: "/r".into(),
            workspace_dir: "/w".into(),
            uid: 1,
            gid: 1,
            memory_mb: 256,
            cpus: 1.0,
            pids: 64,
            tmpfs_mb: 16,
            file_size_mb: 100,
            output_cap: 64,
            stderr_cap: 8,
            labels: BTreeMap::new(),
            command: None,
            runtime: None,
        }
    }

    /// The one mapping every backend's outcome goes through, in its order of precedence.
    #[test]
    fn a_run_outcome_is_judged_once_in_order() {
        let spec = spec();
        let run = |exit_code, oom_killed, stdout: &[u8], stdout_overflow| RunOutcome {
            exit_code,
            oom_killed,
            stdout: stdout.to_vec(),
            stdout_overflow,
            stderr_tail: Vec::new(),
            reply_ready: false,
        };
        let judged = |o: RunOutcome| judge(&o, &spec).map_err(|e| (e.failure(), e.to_string()));
        let ok = br#"{"ok":true,"text":"hi"}"#;
        assert_eq!(
            judged(run(0, false, ok, false)).unwrap().text.as_deref(),
            Some("hi")
        );
        assert_eq!(
            judged(run(137, true, ok, true)).unwrap_err(),
            (
                TurnFailure::OutOfMemory,
                "guest killed: out of memory (limit 256 MiB)".into()
            )
        );
        assert_eq!(
            judged(run(137, false, b"", true)).unwrap_err(),
            (
                TurnFailure::MalformedOutput,
                "guest output exceeds 64 bytes".into()
            )
        );
        assert_eq!(
            judged(run(128 + libc::SIGXFSZ as i64, false, ok, false)).unwrap_err(),
            (
                TurnFailure::OverQuota,
                "guest killed: a file grew past the workspace quota (100 MiB)".into()
            )
        );
        assert_eq!(
            judged(run(137, false, ok, false)).unwrap_err(),
            (TurnFailure::GuestExit, "guest exited with code 137".into())
        );
        assert_eq!(
            judged(run(0, false, b"nope", false)).unwrap_err().0,
            TurnFailure::MalformedOutput
        );
        let mut collector = crate::driver::OutputCollector::new(&spec);
        assert!(!collector.stdout(&[b'a'; 60]));
        assert!(collector.stdout(&[b'a'; 5]), "past the cap: kill");
        assert!(!collector.stdout(b"more"), "reported once");
        collector.stderr(b"0123456789");
        let o = collector.finish(3);
        assert!(o.stdout_overflow && o.stdout.is_empty());
        assert_eq!(o.stderr_tail, b"01234567");
        assert_eq!(o.exit_code, 3);
    }

    /// Stdout's first line, when it is a whole reply, is the answer at once: what comes
    /// after it is dropped, a run handed over at it is judged by it alone (an exit status or
    /// an OOM flag set later does not change it); a first line that is not a reply, or a
    /// reply with no newline, leaves the run to be judged at its end as before.
    #[test]
    fn the_first_line_when_a_reply_is_the_answer() {
        let spec = spec();
        let ok = br#"{"ok":true,"text":"hi"}"#;
        let collect = |chunks: &[&[u8]]| {
            let mut c = crate::driver::OutputCollector::new(&spec);
            let mut killed = false;
            for b in chunks {
                killed |= c.stdout(b);
            }
            (killed, c.reply_ready(), c)
        };
        // Split across many writes, one byte at a time, after blank lines.
        let mut framed = b"\n \n".to_vec();
        framed.extend_from_slice(ok);
        framed.push(b'\n');
        let bytes: Vec<[u8; 1]> = framed.iter().map(|b| [*b]).collect();
        let chunks: Vec<&[u8]> = bytes.iter().map(|b| &b[..]).collect();
        let (killed, ready, c) = collect(&chunks);
        assert!(!killed && ready);
        let mut o = c.finish_at_frame();
        assert_eq!(judge(&o, &spec).unwrap().text.as_deref(), Some("hi"));
        // Whatever the container did after its reply.
        o.exit_code = 137;
        o.oom_killed = true;
        assert_eq!(judge(&o, &spec).unwrap().text.as_deref(), Some("hi"));
        // Two replies, then a flood far past the cap in the same write: the first stands.
        let mut two = ok.to_vec();
        two.extend_from_slice(b"\n{\"ok\":true,\"text\":\"second\"}\n");
        two.extend_from_slice(&[b'y'; 1000]);
        let (killed, ready, c) = collect(&[&two]);
        assert!(!killed && ready);
        assert_eq!(c.finish_at_frame().stdout, [&ok[..], b"\n"].concat());
        // A first line that is not a reply: judged at the end, as one document (the cap
        // still counts all of stdout).
        let (killed, ready, _) = collect(&[b"y\n", &[b'y'; 70]]);
        assert!(killed && !ready);
        let (killed, ready, c) = collect(&[b"garbage\n", ok, b"\n"]);
        assert!(!killed && !ready);
        assert_eq!(
            judge(&c.finish(0), &spec).unwrap_err().to_string(),
            "guest output is not a valid reply: expected value at line 1 column 1"
        );
        // A partial frame, then the exit.
        let (_, ready, c) = collect(&[br#"{"ok":tr"#]);
        assert!(!ready);
        assert_eq!(
            judge(&c.finish(0), &spec).unwrap_err().to_string(),
            "guest output is not a valid reply: EOF while parsing a value at line 1 column 8"
        );
        // A frame a backend did not hand over (it waited for the exit): judged with the
        // exit, the fail-closed default.
        let (_, ready, c) = collect(&[ok, b"\n"]);
        assert!(ready);
        assert_eq!(
            judge(&c.finish(3), &spec).unwrap_err().to_string(),
            "guest exited with code 3"
        );
        // A reply with no newline: judged at the exit, as before.
        let (_, ready, c) = collect(&[ok]);
        assert!(!ready);
        assert_eq!(
            judge(&c.finish(0), &spec).unwrap().text.as_deref(),
            Some("hi")
        );
        // A reply line past the cap: the cap's error.
        let long = format!("{{\"ok\":true,\"text\":\"{}\"}}\n", "a".repeat(80));
        let (killed, ready, c) = collect(&[long.as_bytes()]);
        assert!(killed && !ready);
        assert_eq!(
            judge(&c.finish(137), &spec).unwrap_err().to_string(),
            "guest output exceeds 64 bytes"
        );
    }
}
