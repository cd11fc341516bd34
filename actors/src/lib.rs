//! roundtable-sandbox-actors: the actix face of roundtable-sandbox for chat bots.
//!
//! A bot turns each incoming channel message into a [`GuestMessage`] for the
//! [`SandboxSupervisor`] and posts the response: a [`TurnOutcome`] (the wire [`Reply`] and,
//! when it failed, a typed [`TurnFailure`]) or a [`SandboxActorError`] refusal (whose
//! [`SandboxActorError::failure`] is typed the same way). The layer has three kinds of actor:
//!
//! - [`SandboxSupervisor`] (one per process): validates the whole configuration before it
//!   starts anything ([`SandboxSupervisor::start`]), sweeps what a crashed runtime left
//!   behind, spawns one `ChannelActor` per channel on its first message, restarts a
//!   channel actor that panicked, retires idle ones, and keeps every channel's **pending
//!   reset generation** so neither a restart nor a retirement loses it. It answers
//!   [`GuestMessage`], [`StartFresh`], [`Stop`], [`Withdraw`], [`Status`] and [`Shutdown`],
//!   in the order they were sent (its mailbox is unbounded: `send` never parks).
//! - `ChannelActor` (one per live channel, internal): serializes the channel's turns in arrival
//!   order behind a bounded queue (past it: [`SandboxActorError::Busy`] at once), decides
//!   a turn's reset flag when it admits it, stops the active turn on [`Stop`], and on
//!   [`Withdraw`] stops it and drops its queue.
//! - `TurnActor` (one per turn, short-lived, internal): owns the turn's future — run dir, broker
//!   listener and container, through [`roundtable_sandbox::Sandbox::run`] — waits for a slot
//!   under the global container cap (a FIFO semaphore, so channels are served fairly; the
//!   wait counts against the turn timeout, which runs from admission),
//!   answers the caller and reports to its channel **before** teardown, and makes sure
//!   teardown runs on every path, panics included.
//!
//! Reset generation (the 0.7.18 semantics, in message order): [`StartFresh`] counts one
//! more reset for the channel; the supervisor stamps each [`GuestMessage`] with the count
//! when it receives it, so a reset applies to exactly the messages sent after it (`message,
//! StartFresh, message`: `reset` false, then true, also when the first waits in the queue).
//! A turn runs with `reset = true` if a reset before its message is still pending, and a
//! *successful* reply consumes only those resets (from the reply callback, before
//! teardown). A reset requested while a turn starts or runs is kept for the next message; a
//! failed turn consumes nothing.
//!
//! Panics: actix does not restart a supervised actor when a handler panics, so every
//! `ChannelActor` handler runs under `catch_unwind`; a caught panic aborts the turn in
//! flight (its caller gets [`SandboxActorError::ChannelRestarted`], its container is
//! removed) and stops the actor, which actix's [`actix::Supervisor`] then restarts with
//! its queue and the channel's reset generation intact. A turn's own work runs in a
//! spawned task whose panic is observed as a `JoinError` and answered with
//! [`SandboxActorError::TurnPanicked`]; the core's drop guards tear the turn down.
//!
//! Everything runs on the current actix arbiter: start the supervisor inside an actix
//! `System` (e.g. `#[actix::main]`).
//!
//! ```no_run
//! use roundtable_sandbox::{ApiKey, Config, Speaker};
//! use roundtable_sandbox_actors::{
//!     GuestMessage, SandboxSupervisor, Shutdown, SupervisorOptions, TurnFailure,
//! };
//!
//! #[actix::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // First thing: no other process of the service user may read this one's memory or
//!     // environment (process-wide; the sandbox's start does it too, but the key is read
//!     // before). Then the key, and out of the environment so no child inherits it.
//!     roundtable_sandbox::make_process_private()?;
//!     let key = std::env::var("OPENAI_API_KEY")?;
//!     std::env::remove_var("OPENAI_API_KEY");
//!     let config = Config::builder("/srv/roundtable/run", "/srv/roundtable/ws")
//!         .model("https://api.openai.com/v1", "gpt-4o-mini")
//!         .api_key(ApiKey::from_static(key))
//!         .build();
//!     let mut options = SupervisorOptions::new(config);
//!     options.max_containers = 2;
//!     // An invalid configuration is an error here, before anything starts.
//!     let sandbox = SandboxSupervisor::start(options).await?;
//!
//!     let speaker = Speaker { id: "42".into(), name: "ann".into() };
//!     let answer = sandbox
//!         .send(GuestMessage::new("#general", speaker, "What time is it?"))
//!         .await?;
//!     // Each kind of failure can get its own answer; the reply's text stays for display.
//!     match answer {
//!         Ok(outcome) if outcome.reply.ok => println!("{}", outcome.reply.text.unwrap_or_default()),
//!         Ok(outcome) => match outcome.failure {
//!             Some(TurnFailure::Timeout) => println!("(that took too long; try something smaller)"),
//!             Some(TurnFailure::OverQuota) => println!("(the channel's workspace is full)"),
//!             _ => println!("(turn failed: {})", outcome.reply.error.unwrap_or_default()),
//!         },
//!         Err(refused) if refused.failure() == TurnFailure::Busy => println!("(busy, later)"),
//!         Err(refused) => println!("({refused})"),
//!     }
//!     sandbox.send(Shutdown).await?;
//!     Ok(())
//! }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod channel;
mod control;
mod error;
mod internal;
mod messages;
mod options;
mod reset;
mod shared;
mod supervisor;
#[cfg(feature = "testing")]
pub mod testing;
mod turn;

pub use error::SandboxActorError;
#[cfg(feature = "testing")]
pub use messages::InjectPanic;
pub use messages::{
    ChannelState, ChannelStatus, GuestMessage, Shutdown, ShutdownReport, StartFresh, Status,
    StatusReport, Stop, Totals, Withdraw, WithdrawReport,
};
pub use options::SupervisorOptions;
/// What an embedder needs of the core to configure the runtime and read a turn's answer.
pub use roundtable_sandbox::{
    ApiKey, Config, HostTool, Limits, Reply, Speaker, ToolCallContext, TurnFailure, TurnOutcome,
    TurnPhase,
};
pub use supervisor::SandboxSupervisor;
