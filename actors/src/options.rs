//! The actor layer's own options, around the core's [`Config`].

use std::time::Duration;

use roundtable_sandbox::Config;

use crate::SandboxActorError;

/// What [`SandboxSupervisor::start`](crate::SandboxSupervisor::start) takes: the core's
/// configuration and the options of the actor layer. Every event of the runtime and of
/// this layer (a message queued, waiting for a slot, each phase, each end) goes to the
/// one observer, `config.observer` (see [`roundtable_sandbox::events`]).
#[derive(Clone)]
pub struct SupervisorOptions {
    /// The core configuration (validated by [`roundtable_sandbox::Sandbox::new`]).
    pub config: Config,
    /// Messages that may wait behind a channel's running turn; past it a message is
    /// answered [`SandboxActorError::Busy`] at once. 0 to 10 000; default 8.
    pub queue_limit: usize,
    /// Messages waiting across all channels at once (queued behind a channel's turn, or
    /// admitted and waiting for a container slot); past it a new message is answered
    /// [`SandboxActorError::Busy`] at once, whatever its channel (`queue_limit` bounds one
    /// channel; a flood spread over many channels, one message each, was bounded by none).
    /// 1 to 1 000 000; default 256.
    pub max_waiting: usize,
    /// Containers running turns at once across all channels; past it admitted turns wait
    /// for a slot, first come first served (so channels take turns). The containers
    /// prepared for channels' next turns (`config.warm.max`, default 8) are not counted:
    /// they wait, started, on their stdin, for their turn's slot. 1 to 1024; default 4.
    pub max_containers: usize,
    /// A channel actor idle this long is retired (its pending reset is kept by the
    /// supervisor). 10 ms to 24 h; default 10 min.
    pub idle_timeout: Duration,
    /// Run the orphan sweep at start (default true).
    pub sweep_on_start: bool,
}

impl std::fmt::Debug for SupervisorOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorOptions")
            .field("config", &self.config)
            .field("queue_limit", &self.queue_limit)
            .field("max_waiting", &self.max_waiting)
            .field("max_containers", &self.max_containers)
            .field("idle_timeout", &self.idle_timeout)
            .field("sweep_on_start", &self.sweep_on_start)
            .finish()
    }
}

impl SupervisorOptions {
    /// Default queue bound.
    pub const DEFAULT_QUEUE_LIMIT: usize = 8;
    /// Default bound on the messages waiting across all channels.
    pub const DEFAULT_MAX_WAITING: usize = 256;
    /// Default global container cap.
    pub const DEFAULT_MAX_CONTAINERS: usize = 4;
    /// Default idle time before a channel actor is retired.
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

    /// The actor options at their defaults around `config`.
    pub fn new(config: Config) -> Self {
        Self {
            config,
            queue_limit: Self::DEFAULT_QUEUE_LIMIT,
            max_waiting: Self::DEFAULT_MAX_WAITING,
            max_containers: Self::DEFAULT_MAX_CONTAINERS,
            idle_timeout: Self::DEFAULT_IDLE_TIMEOUT,
            sweep_on_start: true,
        }
    }

    /// Checks the actor options (the core checks its own config).
    pub fn validate(&self) -> Result<(), SandboxActorError> {
        let bad = |field, reason: String| Err(SandboxActorError::InvalidOptions { field, reason });
        if self.queue_limit > 10_000 {
            return bad(
                "queue_limit",
                format!("must be 0 to 10000, got {}", self.queue_limit),
            );
        }
        if !(1..=1_000_000).contains(&self.max_waiting) {
            return bad(
                "max_waiting",
                format!("must be 1 to 1000000, got {}", self.max_waiting),
            );
        }
        if !(1..=1024).contains(&self.max_containers) {
            return bad(
                "max_containers",
                format!("must be 1 to 1024, got {}", self.max_containers),
            );
        }
        if self.idle_timeout < Duration::from_millis(10)
            || self.idle_timeout > Duration::from_secs(86_400)
        {
            return bad(
                "idle_timeout",
                format!("must be 10 ms to 24 h, got {:?}", self.idle_timeout),
            );
        }
        Ok(())
    }
}
