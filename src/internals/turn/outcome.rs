//! How a turn ends: its errors ([`TurnError`], [`ReplyError`]), their kinds
//! ([`TurnFailure`]) and the outcome a caller gets ([`TurnOutcome`]).

use roundtable_sandbox_protocol::ReplyError;
use std::path::PathBuf;
use std::time::Duration;

use roundtable_sandbox_protocol::Reply;

use super::kinds::TurnFailure;
use crate::driver::DriverError;

/// Errors of a turn, before it is turned into an `{ok:false}` reply.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The turn's timeout passed.
    #[error("turn timed out after {0:?}")]
    Timeout(Duration),
    /// The turn's timeout passed while it waited for a container slot (the actor layer's
    /// global cap); it never started.
    #[error("turn timed out after {timeout:?} waiting for a container slot (all {slots} in use)")]
    SlotTimeout {
        /// The turn's timeout.
        timeout: Duration,
        /// The container slots.
        slots: usize,
    },
    /// The caller stopped the turn.
    #[error("turn stopped")]
    Stopped,
    /// The channel's workspace could not be created.
    #[error("create workspace {path}")]
    CreateWorkspace {
        /// The workspace.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The channel's existing workspace is not a private directory of the service user.
    #[error("workspace {path} must be a directory of the service user (uid {uid}) with no group or other permission bits: found uid {owner}, mode {mode:o}")]
    WorkspaceNotPrivate {
        /// The workspace.
        path: PathBuf,
        /// The service user.
        uid: u32,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
    },
    /// The workspace's path no longer names the directory the turn made and holds: the
    /// workspace root (or the directory) was moved or replaced since.
    #[error("workspace {path} no longer names the directory made for the turn (the workspace root was moved or replaced)")]
    WorkspaceReplaced {
        /// The workspace.
        path: PathBuf,
    },
    /// The turn's run dir could not be created.
    #[error("create run dir under {path}")]
    CreateRunDir {
        /// The run root.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The turn's socket path is too long.
    #[error("broker socket path too long: {0}")]
    SocketPathTooLong(PathBuf),
    /// The broker could not listen.
    #[error("start broker")]
    Broker(#[from] crate::broker::BrokerError),
    /// The driver failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The workspace is over its quota or a filesystem below its floor.
    #[error(transparent)]
    Quota(#[from] crate::quota::QuotaError),
    /// The engine reports that the memory limit killed the guest.
    #[error("guest killed: out of memory (limit {limit_mb} MiB)")]
    OutOfMemory {
        /// The memory limit.
        limit_mb: u64,
    },
    /// The guest died of `SIGXFSZ` (its init exits `128+SIGXFSZ`): `RLIMIT_FSIZE` was hit.
    #[error("guest killed: a file grew past the workspace quota ({limit_mb} MiB)")]
    FileTooLarge {
        /// The workspace quota.
        limit_mb: u64,
    },
    /// The container exited non-zero (137 under the init process: `SIGKILL`).
    #[error("guest exited with code {code}")]
    Exit {
        /// The exit code.
        code: i64,
    },
    /// The guest's output is not a reply.
    #[error(transparent)]
    Reply(#[from] ReplyError),
    /// A budget (`[budgets]`) refused the turn before it started.
    #[error(transparent)]
    Budget(#[from] crate::budgets::BudgetRefusal),
}

impl TurnError {
    /// The kind of failure, for an embedder that answers each differently.
    pub fn failure(&self) -> TurnFailure {
        use crate::quota::QuotaError;
        match self {
            TurnError::Timeout(_) => TurnFailure::Timeout,
            TurnError::SlotTimeout { .. } => TurnFailure::SlotTimeout,
            TurnError::Stopped | TurnError::Driver(DriverError::Cancelled) => TurnFailure::Stopped,
            TurnError::OutOfMemory { .. } => TurnFailure::OutOfMemory,
            TurnError::FileTooLarge { .. }
            | TurnError::Quota(QuotaError::Exceeded { .. } | QuotaError::Measure(_)) => {
                TurnFailure::OverQuota
            }
            TurnError::Quota(_) => TurnFailure::DiskFloor,
            TurnError::Exit { .. } => TurnFailure::GuestExit,
            TurnError::Reply(_) => TurnFailure::MalformedOutput,
            TurnError::Budget(_) => TurnFailure::BudgetExceeded,
            TurnError::Driver(DriverError::DaemonUnreachable { .. }) => {
                TurnFailure::EngineUnavailable
            }
            TurnError::Driver(DriverError::ImageMissing { .. }) => TurnFailure::ImageMissing,
            TurnError::Driver(_)
            | TurnError::CreateWorkspace { .. }
            | TurnError::WorkspaceNotPrivate { .. }
            | TurnError::WorkspaceReplaced { .. }
            | TurnError::CreateRunDir { .. }
            | TurnError::SocketPathTooLong(_)
            | TurnError::Broker(_) => TurnFailure::Internal,
        }
    }
}

/// One turn's end: the wire [`Reply`] (as the guest or the host wrote it) and, when it is
/// not a success, the typed reason. Dereferences to the reply.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnOutcome {
    /// The reply, as the guest or the host wrote it.
    pub reply: Reply,
    /// `None` exactly when `reply.ok`.
    pub failure: Option<TurnFailure>,
    /// What the turn used, counted by the host from the upstream's answers (see
    /// [`crate::budgets::HostUsage`]). `reply.usage` is the guest's own claim: budgets
    /// and accounting never read it.
    pub usage: crate::budgets::HostUsage,
}

impl TurnOutcome {
    /// The outcome of a turn that failed with `error` (its reply carries the message).
    pub fn failed(error: &TurnError) -> Self {
        Self {
            reply: Reply::error(crate::one_line(error)),
            failure: Some(error.failure()),
            usage: Default::default(),
        }
    }

    /// The outcome of a reply the guest wrote (a guest-reported failure is `GuestError`).
    pub fn from_guest(reply: Reply) -> Self {
        let failure = (!reply.ok).then_some(TurnFailure::GuestError);
        Self {
            reply,
            failure,
            usage: Default::default(),
        }
    }

    /// The wire reply.
    pub fn into_reply(self) -> Reply {
        self.reply
    }
}

impl std::ops::Deref for TurnOutcome {
    type Target = Reply;
    fn deref(&self) -> &Reply {
        &self.reply
    }
}

impl From<TurnOutcome> for Reply {
    fn from(o: TurnOutcome) -> Reply {
        o.reply
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::turn::parse_reply;

    #[test]
    fn a_guest_failure_is_typed_as_the_guests() {
        let guest = parse_reply(br#"{"ok":false,"error":"turn timed out after 1s"}"#, 100).unwrap();
        let o = TurnOutcome::from_guest(guest);
        assert_eq!(o.failure, Some(TurnFailure::GuestError));
        assert_eq!(
            o.error.as_deref(),
            Some("the guest reported an error: turn timed out after 1s")
        );
        let o = TurnOutcome::failed(&TurnError::Timeout(Duration::from_secs(1)));
        assert_eq!(o.failure, Some(TurnFailure::Timeout));
        assert_eq!(o.error.as_deref(), Some("turn timed out after 1s"));
        let ok = TurnOutcome::from_guest(Reply::text("hi", Default::default()));
        assert_eq!(ok.failure, None);
    }
}
