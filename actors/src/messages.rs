//! The messages a bot sends to the [`SandboxSupervisor`](crate::SandboxSupervisor) and
//! what they are answered with.

use std::time::Duration;

use actix::Message;
use roundtable_sandbox::{Speaker, TurnOutcome, TurnPhase};

use crate::SandboxActorError;

/// A guest's message in a channel. Answered, when the turn is over, with the turn's reply
/// (`Ok`, which may be `ok: false` for a timeout, a stop or a guest error) or with a
/// refusal of the layer (`Err`: busy, shutting down, an internal failure).
#[derive(Debug, Message)]
#[rtype(result = "Result<TurnOutcome, SandboxActorError>")]
pub struct GuestMessage {
    /// The channel key (any string; it is hashed before it names anything on disk).
    pub channel: String,
    /// Who wrote it, as the bot admitted them; the turn and its tool calls carry it.
    pub speaker: Speaker,
    /// The message's text.
    pub text: String,
    /// What the per-speaker budgets count this message's turn under instead of
    /// `speaker.id` (see [`roundtable_sandbox::TurnRequest::limits_key`]): set it when the
    /// speaker id is something the sender can change at will (an IRC nick). Never shown to
    /// the model, the guest or the audit trail. `None` (the default): the speaker's id.
    pub limits_key: Option<String>,
}

impl GuestMessage {
    /// A message of `speaker` in `channel`.
    pub fn new(channel: impl Into<String>, speaker: Speaker, text: impl Into<String>) -> Self {
        Self {
            channel: channel.into(),
            speaker,
            text: text.into(),
            limits_key: None,
        }
    }

    /// Counts this message's turn under `key` in the per-speaker budgets instead of the
    /// speaker's id ([`GuestMessage::limits_key`]).
    pub fn with_limits_key(mut self, key: impl Into<String>) -> Self {
        self.limits_key = Some(key.into());
        self
    }
}

/// Requests a fresh session for the channel: the next message sent after this one starts
/// it (messages sent before it, even if still queued, do not). Increments the pending reset
/// generation. Needs no channel actor; kept across restarts and retirement.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct StartFresh {
    /// The channel to reset.
    pub channel: String,
}

/// Stops the channel's active turn (its container is killed). Answered with whether a
/// turn was active (admitted and not yet answered). Queued messages stay queued.
#[derive(Debug, Clone, Message)]
#[rtype(result = "bool")]
pub struct Stop {
    /// The channel whose turn stops.
    pub channel: String,
}

/// The bot no longer serves a channel (kicked or banned from it, or the room turned
/// end-to-end encryption on): its active turn stops as by [`Stop`], every message still
/// queued there is answered [`SandboxActorError::Withdrawn`](crate::SandboxActorError::Withdrawn)
/// and never runs, and no container is prepared for it. A later message for the channel
/// is served as usual (the bot decides whether to send one).
#[derive(Debug, Clone, Message)]
#[rtype(result = "WithdrawReport")]
pub struct Withdraw {
    /// The channel the bot withdraws from.
    pub channel: String,
}

/// What [`Withdraw`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WithdrawReport {
    /// A turn was active (admitted and not yet answered) and was stopped.
    pub stopped: bool,
    /// The queued messages answered `Withdrawn` (their callers still waiting).
    pub dropped: usize,
}

/// Stops admitting, answers every queued message [`SandboxActorError::ShuttingDown`],
/// stops every active turn, and resolves once all of them have torn down and the broker's
/// long-lived parts (MCP servers) have ended. Idempotent: a second `Shutdown` waits for
/// the same end and gets the same report.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "ShutdownReport")]
pub struct Shutdown;

/// What [`Shutdown`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Turns that were active (running or waiting for a slot) and were stopped.
    pub stopped_turns: usize,
    /// Queued messages answered with [`SandboxActorError::ShuttingDown`].
    pub refused_queued: usize,
}

/// Asks for every channel's state and the totals.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "StatusReport")]
pub struct Status;

/// Where a channel is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelState {
    /// No turn (the actor may even be retired).
    Idle,
    /// A turn is admitted and waits for a container slot (the global cap).
    WaitingForSlot,
    /// A turn is in this phase.
    Running(TurnPhase),
    /// The active turn was stopped and is tearing down.
    Stopping,
}

impl ChannelState {
    /// Whether a turn occupies the channel.
    pub fn is_busy(&self) -> bool {
        !matches!(self, ChannelState::Idle)
    }
}

/// One channel in a [`StatusReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelStatus {
    /// The channel's key.
    pub channel: String,
    /// What it is doing.
    pub state: ChannelState,
    /// Messages waiting behind the active turn.
    pub queued: usize,
    /// The pending reset generation (0: none): resets requested since none was pending.
    /// While it is above 0, the next message sent after the latest reset starts a fresh
    /// session (messages queued before that reset do not).
    pub pending_reset: u64,
    /// Whether a channel actor is alive (false: retired, only a pending reset is kept).
    pub live: bool,
    /// How often this channel's actor was restarted after a panic.
    pub restarts: u32,
    /// Turns this actor has finished (since it was spawned).
    pub turns_done: u64,
    /// How long the active turn has been admitted.
    pub active_for: Option<Duration>,
    /// Whether a container prepared for the channel's next turn waits in its slot (warm
    /// turns; a container still being prepared is not counted).
    pub prepared: bool,
}

/// Answer to [`Status`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusReport {
    /// Channels with a live actor or a pending reset, sorted by key.
    pub channels: Vec<ChannelStatus>,
    /// Counters since start.
    pub totals: Totals,
}

/// Totals of a [`StatusReport`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Live channel actors.
    pub live_channels: usize,
    /// Channels with an active turn.
    pub busy_channels: usize,
    /// Messages queued across channels.
    pub queued: usize,
    /// Channels with a pending reset.
    pub pending_resets: usize,
    /// Container slots in use (at most `max_containers`).
    pub containers_in_use: usize,
    /// The global container cap.
    pub max_containers: usize,
    /// Admitted turns waiting for a container slot.
    pub waiting_for_slot: usize,
    /// Prepared containers (waiting for their channel's next turn, or being prepared or
    /// removed; at most `warm.max`).
    pub prepared: usize,
    /// Channel actor restarts after panics, since start.
    pub restarts: u64,
    /// Channel actors retired for idleness, since start.
    pub retired: u64,
    /// Whether a `Shutdown` was received.
    pub shutting_down: bool,
}

/// Test hook (the `testing` feature): makes the channel's actor panic inside a handler, to
/// exercise the restart. Answered with whether the channel had a live actor to receive it.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Message)]
#[rtype(result = "bool")]
pub struct InjectPanic {
    /// The channel whose actor panics.
    pub channel: String,
}
