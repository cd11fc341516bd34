//! The host's reading of a reply: the strict parse both sides of the wire agree on (the
//! guest prints a [`Reply`] that passes it; the host's driver spots a complete frame with it
//! and the turn judges the run with it).

use crate::Reply;

/// What every failure reported by the guest itself starts with (see [`parse_reply`]).
pub const GUEST_ERROR_PREFIX: &str = "the guest reported an error: ";

/// Why the guest's stdout is not a reply (see [`parse_reply`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplyError {
    /// The output passed its cap.
    OutputTooLarge {
        /// The cap.
        cap: usize,
    },
    /// The output is not one JSON reply.
    MalformedOutput {
        /// Why.
        reason: String,
    },
}

impl std::fmt::Display for ReplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyError::OutputTooLarge { cap } => write!(f, "guest output exceeds {cap} bytes"),
            ReplyError::MalformedOutput { reason } => {
                write!(f, "guest output is not a valid reply: {reason}")
            }
        }
    }
}

impl std::error::Error for ReplyError {}

/// Strictly parses the guest's stdout: exactly one [`Reply`] JSON document (whitespace
/// around it allowed), no unknown field, a consistent shape, at most `cap` bytes. A failed
/// reply's error is prefixed with [`GUEST_ERROR_PREFIX`].
pub fn parse_reply(stdout: &[u8], cap: usize) -> Result<Reply, ReplyError> {
    if stdout.len() > cap {
        return Err(ReplyError::OutputTooLarge { cap });
    }
    if stdout.iter().all(u8::is_ascii_whitespace) {
        return Err(ReplyError::MalformedOutput {
            reason: "no output".into(),
        });
    }
    let mut reply: Reply =
        serde_json::from_slice(stdout).map_err(|e| ReplyError::MalformedOutput {
            reason: e.to_string(),
        })?;
    reply
        .check_shape()
        .map_err(|reason| ReplyError::MalformedOutput {
            reason: reason.into(),
        })?;
    // A failure the guest reports is marked as the guest's: it can never pass for one of
    // the host's own errors (a timeout, a stop, an out-of-memory kill).
    if let Some(error) = reply.error.take() {
        reply.error = Some(format!("{GUEST_ERROR_PREFIX}{error}"));
    }
    Ok(reply)
}
