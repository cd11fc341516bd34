//! What a turn's events name: where it is ([`TurnPhase`]) and why it did not succeed
//! ([`TurnFailure`]). A leaf: the event seam and the turn both take them from here.

/// Where a turn is; reported to an optional observer (progress display, tests). New phases
/// may come: match with a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TurnPhase {
    /// Creating the workspace and run dir, checking quota and floor.
    Preparing,
    /// The broker listens on the turn's socket.
    BrokerListening,
    /// The container runs.
    ContainerRunning,
    /// The broker forwards a model call (reported at each call).
    ModelCall,
    /// The broker runs a host or MCP tool (reported at each call).
    ToolCall,
    /// The reply is known.
    Replied,
    /// The container, listener and run dir are being removed.
    TearingDown,
    /// Everything is removed.
    Done,
}

/// Why a turn did not give the guest's own successful answer: what a bot matches on to
/// answer each case its own way (the reply's `error` text stays for display).
///
/// The core reports the kinds a turn can end with; the actor layer adds its own refusals
/// (`Busy`, `ShuttingDown`, `ChannelRestarted`). Those three are produced by the actor
/// layer alone, but they are kinds of this one enum rather than of an actor-layer type of
/// their own: a bot matches one type for every answer it posts (a turn's outcome and a
/// refusal alike, see the actor layer's `SandboxActorError::failure`), and a second enum
/// would make it match two. New kinds may come: match with a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TurnFailure {
    /// The turn's timeout passed (counted from admission).
    Timeout,
    /// The timeout passed while the turn waited for a container slot; it never started.
    SlotTimeout,
    /// The turn was stopped (a `Stop`, or the caller's token).
    Stopped,
    /// The memory limit killed the guest.
    OutOfMemory,
    /// The workspace is (or grew) over its quota, or a file passed it (`RLIMIT_FSIZE`).
    OverQuota,
    /// A guarded filesystem is below its free-space floor (or cannot be measured).
    DiskFloor,
    /// The guest itself reported a failure (the reply's error carries
    /// [`GUEST_ERROR_PREFIX`](super::GUEST_ERROR_PREFIX)).
    GuestError,
    /// The guest's stdout was not a valid reply, or exceeded the output cap.
    MalformedOutput,
    /// The guest exited non-zero without a reply.
    GuestExit,
    /// The container engine cannot be reached.
    EngineUnavailable,
    /// The sandbox image is missing.
    ImageMissing,
    /// The engine refused or failed a call, or the host could not prepare the turn (its
    /// workspace, run dir or broker).
    Internal,
    /// The actor layer: the channel's queue is full.
    Busy,
    /// The actor layer: the supervisor is shutting down.
    ShuttingDown,
    /// The actor layer: the channel's worker failed and was restarted mid-turn.
    ChannelRestarted,
    /// A budget (`[budgets]`: the speaker's, the channel's or the bot's tokens per day, the
    /// speaker's turns per minute) refused the turn before it started, or a model call of
    /// it (the guest then reported the broker's `429`).
    BudgetExceeded,
}
