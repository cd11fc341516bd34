//! The one error type of the actor layer.

use roundtable_sandbox::{TurnFailure, TurnOutcome};

/// Everything the actor layer can refuse or fail with. Each message is meant to be shown
/// as it is (to the operator for the start-up errors, to the guest for the others).
///
/// A turn that ran and failed (timeout, stop, guest error…) is not an error here: it is an
/// `Ok` [`TurnOutcome`] whose reply has `ok: false` and whose `failure` says why.
#[derive(Debug, thiserror::Error)]
pub enum SandboxActorError {
    /// An option of the actor layer is out of range (checked before anything starts).
    #[error("invalid actor options: {field} {reason}")]
    InvalidOptions {
        /// The option.
        field: &'static str,
        /// Its range and the refused value.
        reason: String,
    },
    /// The core refused the configuration or could not prepare the broker; nothing started.
    #[error("cannot start the sandbox")]
    Start(#[from] roundtable_sandbox::SandboxError),
    /// The channel's queue is full.
    #[error(
        "this channel is busy: a turn is running and {waiting} message(s) are already waiting \
         (the limit); try again when it has answered"
    )]
    Busy {
        /// The messages already waiting.
        waiting: usize,
    },
    /// Too many messages wait across all channels (`max_waiting`).
    #[error(
        "the bot is busy: {waiting} message(s) are already waiting across its channels (the \
         limit); try again in a while"
    )]
    Overloaded {
        /// The messages already waiting, across all channels.
        waiting: usize,
    },
    /// The supervisor is shutting down (or has shut down) and admits nothing.
    #[error("the sandbox is shutting down; this message was not processed")]
    ShuttingDown,
    /// The bot withdrew from the channel ([`Withdraw`](crate::Withdraw)) while this message
    /// waited there: it never ran.
    #[error("the bot stopped serving this channel; this message was not processed")]
    Withdrawn,
    /// The channel's actor failed with an internal error and was restarted; the turn in
    /// flight was stopped and its container removed.
    #[error(
        "the channel's worker failed with an internal error and was restarted; this turn was \
         stopped and its container removed; send the message again"
    )]
    ChannelRestarted,
    /// The turn's own task panicked; its run dir, listener and container are cleaned up by
    /// the core's drop guards.
    #[error("the turn failed with an internal error ({message}); its resources were cleaned up")]
    TurnPanicked {
        /// The panic's message.
        message: String,
    },
    /// The turn ended without delivering a reply (an internal error; never expected).
    #[error("the turn ended without a reply (internal error)")]
    TurnLost,
    /// The channel's actor could not be reached.
    #[error("the channel's worker is unavailable")]
    ChannelUnavailable(#[from] actix::MailboxError),
}

impl SandboxActorError {
    /// The error as an `{ok:false}` reply, for a bot that posts every answer the same way.
    pub fn to_reply(&self) -> roundtable_sandbox::Reply {
        roundtable_sandbox::Reply::error(self.to_string())
    }

    /// The kind of failure, typed as a turn's ([`TurnFailure`]): `Busy` (`Overloaded` too),
    /// `ShuttingDown` and `ChannelRestarted` are their own kinds, `Withdrawn` is `Stopped`;
    /// the others are `Internal`.
    pub fn failure(&self) -> TurnFailure {
        match self {
            SandboxActorError::Busy { .. } | SandboxActorError::Overloaded { .. } => {
                TurnFailure::Busy
            }
            SandboxActorError::ShuttingDown => TurnFailure::ShuttingDown,
            SandboxActorError::Withdrawn => TurnFailure::Stopped,
            SandboxActorError::ChannelRestarted => TurnFailure::ChannelRestarted,
            SandboxActorError::InvalidOptions { .. }
            | SandboxActorError::Start(_)
            | SandboxActorError::TurnPanicked { .. }
            | SandboxActorError::TurnLost
            | SandboxActorError::ChannelUnavailable(_) => TurnFailure::Internal,
        }
    }

    /// The error as a turn's outcome (its reply and its kind), for a bot that answers every
    /// message the same way.
    pub fn to_outcome(&self) -> TurnOutcome {
        TurnOutcome {
            reply: self.to_reply(),
            failure: Some(self.failure()),
            usage: Default::default(),
        }
    }
}

/// Why the layer itself ended a turn (not the guest, not the user's [`Stop`](crate::Stop)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AbortReason {
    ShuttingDown,
    ChannelRestarted,
}

impl AbortReason {
    pub(crate) fn into_error(self) -> SandboxActorError {
        match self {
            AbortReason::ShuttingDown => SandboxActorError::ShuttingDown,
            AbortReason::ChannelRestarted => SandboxActorError::ChannelRestarted,
        }
    }
}
