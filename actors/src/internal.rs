//! The messages between the layer's own actors (never seen by a bot), and the links they
//! travel on: a channel reports to its supervisor, a turn to its channel, each through
//! recipients of these messages only, so no actor module knows the one above it.

use actix::prelude::*;
use roundtable_sandbox::TurnOutcome;

use crate::reset::Stamp;
use crate::{ChannelStatus, GuestMessage, SandboxActorError};

/// Where a channel actor reports to its supervisor.
#[derive(Clone)]
pub(crate) struct SupervisorLink {
    pub(crate) idle: Recipient<ChannelIdle>,
    pub(crate) restarted: Recipient<ChannelRestartedNotice>,
}

/// Where a turn actor reports to its channel.
#[derive(Clone)]
pub(crate) struct ChannelLink {
    pub(crate) replied: Recipient<TurnReplied>,
    pub(crate) done: Recipient<TurnDone>,
}

/// From an idle channel actor: retire me if nothing is on its way to me.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct ChannelIdle {
    pub(crate) channel: roundtable_sandbox::ChannelId,
    pub(crate) actor_id: u64,
    pub(crate) received: u64,
}

/// From a channel actor being restarted after a panic (counted for [`Status`]).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct ChannelRestartedNotice {
    pub(crate) channel: roundtable_sandbox::ChannelId,
}

/// From the turn actor, before teardown: the turn answered.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct TurnReplied {
    pub(crate) turn: u64,
    pub(crate) ok: bool,
}

/// From the turn actor, after teardown (or when it is dropped): the channel is free.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct TurnDone {
    pub(crate) turn: u64,
}

/// From the supervisor: a guest message, stamped with its place among the channel's
/// resets when the supervisor received it.
#[derive(Debug, Message)]
#[rtype(result = "Result<TurnOutcome, SandboxActorError>")]
pub(crate) struct Enqueue {
    pub(crate) message: GuestMessage,
    pub(crate) stamp: Stamp,
}

/// From the supervisor: the channel's status.
#[derive(Debug, Message)]
#[rtype(result = "ChannelStatus")]
pub(crate) struct QueryStatus;

/// From the supervisor: refuse the queue, stop the active turn, answer once torn down.
#[derive(Debug, Message)]
#[rtype(result = "ChannelShutdown")]
pub(crate) struct ShutdownChannel;

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ChannelShutdown {
    pub(crate) stopped: bool,
    pub(crate) refused: usize,
}

/// From the supervisor, which has dropped its address: stop if still idle.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Retire;
