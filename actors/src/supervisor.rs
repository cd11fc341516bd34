//! The [`SandboxSupervisor`]: the bot's entry point.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use roundtable_sandbox::SweepReport;
use roundtable_sandbox::{Sandbox, TurnOutcome};
use tokio::sync::watch;

use crate::channel::ChannelActor;
use crate::control::PhaseRoutes;
use crate::internal::{
    ChannelIdle, ChannelRestartedNotice, Enqueue, QueryStatus, Retire, ShutdownChannel,
    SupervisorLink,
};
use crate::reset::ResetGeneration;
use crate::shared::Shared;
use crate::{
    ChannelState, ChannelStatus, GuestMessage, SandboxActorError, Shutdown, ShutdownReport,
    StartFresh, Status, StatusReport, Stop, SupervisorOptions, Totals, Withdraw, WithdrawReport,
};

/// The sandbox's supervisor: one per process, the address a bot sends its messages to.
///
/// Started by [`SandboxSupervisor::start`], which validates the whole configuration first.
/// Spawns one `ChannelActor` per channel on its first [`GuestMessage`] (under
/// [`actix::Supervisor`], restarted after a panic), keeps every channel's pending reset
/// generation (so a restart or a retirement never loses it), retires idle channel actors
/// (and stops their channel-scoped MCP sessions), and answers [`StartFresh`], [`Stop`], [`Status`] and [`Shutdown`].
pub struct SandboxSupervisor {
    shared: Arc<Shared>,
    channels: HashMap<String, ChannelEntry>,
    /// Pending reset generations, by channel. Shared with the live channel actor; kept
    /// here when it is restarted or retired (an entry at 0 goes with its actor).
    resets: HashMap<String, ResetGeneration>,
    next_actor: u64,
    restarts: u64,
    retired: u64,
    shutdown: Option<watch::Receiver<Option<ShutdownReport>>>,
}

impl std::fmt::Debug for SandboxSupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxSupervisor")
            .field("channels", &self.channels.len())
            .field("pending_resets", &self.resets.len())
            .field("shutting_down", &self.shutdown.is_some())
            .finish_non_exhaustive()
    }
}

struct ChannelEntry {
    addr: Addr<ChannelActor>,
    actor_id: u64,
    /// Guest messages forwarded to this actor (see `ChannelIdle`).
    forwarded: u64,
}

impl SandboxSupervisor {
    /// Validates the actor options and the core configuration (a bad one is an error and
    /// nothing is started), prepares the broker, runs the orphan sweep (unless disabled; its
    /// failures are logged, not fatal: the daemon may come up later), then starts the
    /// supervisor on the current arbiter. Call it inside an actix `System`.
    pub async fn start(config: SupervisorOptions) -> Result<Addr<Self>, SandboxActorError> {
        Ok(Self::start_with_sweep(config).await?.0)
    }

    /// [`SandboxSupervisor::start`], also returning what the sweep removed.
    pub async fn start_with_sweep(
        config: SupervisorOptions,
    ) -> Result<(Addr<Self>, SweepReport), SandboxActorError> {
        config.validate()?;
        let mut core = config.config.clone();
        // The layer's view of the one observer: each running turn's phases go to its
        // channel's state; every event still reaches the bot's observer.
        let phases = PhaseRoutes::default();
        core.observer = Some(phases.observer(core.observer.take()));
        let sandbox = Sandbox::new(core).await?;
        let report = if config.sweep_on_start {
            sandbox.sweep().await
        } else {
            SweepReport::default()
        };
        for error in &report.errors {
            tracing::warn!(%error, "startup sweep");
        }
        tracing::info!(
            instance = %sandbox.config().instance,
            swept_containers = report.containers.len(),
            swept_run_dirs = report.run_dirs.len(),
            max_containers = config.max_containers,
            queue_limit = config.queue_limit,
            "sandbox supervisor starting"
        );
        let shared = Arc::new(Shared::new(sandbox, &config, phases));
        let supervisor = Self {
            shared,
            channels: HashMap::new(),
            resets: HashMap::new(),
            next_actor: 0,
            restarts: 0,
            retired: 0,
            shutdown: None,
        };
        // An unbounded mailbox: `send` never parks, so the messages of one sender are
        // handled in the order they were sent, and a `StartFresh` sent between two
        // `GuestMessage`s is stamped between them (see `reset`). Each handler is quick.
        let addr = SandboxSupervisor::create(|ctx| {
            ctx.set_mailbox_capacity(0);
            supervisor
        });
        Ok((addr, report))
    }

    /// The channel's live actor, spawned if it has none (first message, retired, or died
    /// beyond a restart).
    fn channel(&mut self, key: &str, ctx: &mut Context<Self>) -> &mut ChannelEntry {
        let dead = self
            .channels
            .get(key)
            .is_some_and(|entry| !entry.addr.connected());
        if dead {
            tracing::error!("a channel actor died beyond restart; spawning a new one");
            self.restarts += 1;
            self.channels.remove(key);
        }
        if !self.channels.contains_key(key) {
            self.next_actor += 1;
            let actor_id = self.next_actor;
            let reset = self.resets.entry(key.to_owned()).or_default().clone();
            let addr = ctx.address();
            let supervisor = SupervisorLink {
                idle: addr.clone().recipient(),
                restarted: addr.recipient(),
            };
            let (shared, owned_key) = (self.shared.clone(), key.to_owned());
            let addr = actix::Supervisor::start(move |_| {
                ChannelActor::new(
                    roundtable_sandbox::ChannelId::new(&owned_key),
                    shared,
                    reset,
                    supervisor,
                    actor_id,
                )
            });
            self.channels.insert(
                key.to_owned(),
                ChannelEntry {
                    addr,
                    actor_id,
                    forwarded: 0,
                },
            );
        }
        self.channels.get_mut(key).expect("inserted above")
    }
}

impl Actor for SandboxSupervisor {
    type Context = Context<Self>;
}

impl Handler<GuestMessage> for SandboxSupervisor {
    type Result = ResponseFuture<Result<TurnOutcome, SandboxActorError>>;

    fn handle(&mut self, message: GuestMessage, ctx: &mut Self::Context) -> Self::Result {
        if self.shutdown.is_some() {
            let channel = roundtable_sandbox::ChannelId::new(&message.channel);
            self.shared.sandbox.emit(
                None,
                Some(&channel),
                roundtable_sandbox::events::EventKind::Facts(Box::new(
                    roundtable_sandbox::events::TurnFacts::refused(
                        &message.speaker.id,
                        &message.text,
                        roundtable_sandbox::events::TurnRecord::ended_early(
                            roundtable_sandbox::TurnFailure::ShuttingDown,
                            None,
                        ),
                    ),
                )),
            );
            self.shared.sandbox.emit(
                None,
                Some(&channel),
                roundtable_sandbox::events::EventKind::Ended {
                    failure: Some(roundtable_sandbox::TurnFailure::ShuttingDown),
                    warm: false,
                },
            );
            return Box::pin(std::future::ready(Err(SandboxActorError::ShuttingDown)));
        }
        // The message's place among the channel's resets, in mailbox order (see `reset`).
        let stamp = self
            .resets
            .entry(message.channel.clone())
            .or_default()
            .stamp();
        let entry = self.channel(&message.channel, ctx);
        entry.forwarded += 1;
        let answer = entry.addr.send(Enqueue { message, stamp });
        Box::pin(async move { answer.await? })
    }
}

impl Handler<StartFresh> for SandboxSupervisor {
    type Result = ();

    fn handle(&mut self, msg: StartFresh, _: &mut Self::Context) {
        // Applies to the messages received after this one (they are stamped after it).
        let generation = self.resets.entry(msg.channel).or_default().request();
        tracing::info!(generation, "fresh session requested");
    }
}

impl Handler<Stop> for SandboxSupervisor {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, msg: Stop, _: &mut Self::Context) -> Self::Result {
        match self.channels.get(&msg.channel) {
            Some(entry) => {
                let answer = entry.addr.send(msg);
                Box::pin(async move { answer.await.unwrap_or(false) })
            }
            None => Box::pin(std::future::ready(false)),
        }
    }
}

impl Handler<Withdraw> for SandboxSupervisor {
    type Result = ResponseFuture<WithdrawReport>;

    fn handle(&mut self, msg: Withdraw, _: &mut Self::Context) -> Self::Result {
        match self.channels.get(&msg.channel) {
            Some(entry) => {
                let answer = entry.addr.send(msg);
                Box::pin(async move { answer.await.unwrap_or_default() })
            }
            None => Box::pin(std::future::ready(WithdrawReport::default())),
        }
    }
}

#[cfg(feature = "testing")]
impl Handler<crate::messages::InjectPanic> for SandboxSupervisor {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, msg: crate::messages::InjectPanic, _: &mut Self::Context) -> Self::Result {
        match self.channels.get(&msg.channel) {
            Some(entry) => {
                let answer = entry.addr.send(msg);
                Box::pin(async move { answer.await.unwrap_or(false) })
            }
            None => Box::pin(std::future::ready(false)),
        }
    }
}

impl Handler<ChannelIdle> for SandboxSupervisor {
    type Result = ();

    fn handle(&mut self, msg: ChannelIdle, _: &mut Self::Context) {
        if self.shutdown.is_some() {
            return;
        }
        let current = self
            .channels
            .get(msg.channel.key())
            .is_some_and(|entry| entry.actor_id == msg.actor_id && entry.forwarded == msg.received);
        if !current {
            // A message is on its way to it (it will go idle again later), or it was replaced.
            return;
        }
        if let Some(entry) = self.channels.remove(msg.channel.key()) {
            entry.addr.do_send(Retire);
        }
        // The channel's MCP sessions go with it: taken out of the pool now (before any later
        // message of the channel can start a turn), closed in the background.
        actix_rt::spawn(self.shared.sandbox.release_channel(&msg.channel));
        if self
            .resets
            .get(msg.channel.key())
            .is_some_and(|g| g.pending() == 0)
        {
            self.resets.remove(msg.channel.key());
        }
        self.retired += 1;
    }
}

impl Handler<ChannelRestartedNotice> for SandboxSupervisor {
    type Result = ();

    fn handle(&mut self, msg: ChannelRestartedNotice, _: &mut Self::Context) {
        self.restarts += 1;
        tracing::warn!(
            channel = msg.channel.short(),
            "channel actor restarted after a panic"
        );
    }
}

impl Handler<Status> for SandboxSupervisor {
    type Result = ResponseFuture<StatusReport>;

    fn handle(&mut self, _: Status, _: &mut Self::Context) -> Self::Result {
        let queries: Vec<_> = self
            .channels
            .iter()
            .map(|(key, entry)| (key.clone(), entry.addr.send(QueryStatus)))
            .collect();
        let retired: Vec<ChannelStatus> = self
            .resets
            .iter()
            .filter(|(key, g)| !self.channels.contains_key(*key) && g.pending() > 0)
            .map(|(key, g)| ChannelStatus {
                channel: key.clone(),
                state: ChannelState::Idle,
                queued: 0,
                pending_reset: g.pending(),
                live: false,
                restarts: 0,
                turns_done: 0,
                active_for: None,
                prepared: false,
            })
            .collect();
        let shared = self.shared.clone();
        let (restarts, retired_count) = (self.restarts, self.retired);
        let shutting_down = self.shutdown.is_some();
        Box::pin(async move {
            let mut channels = retired;
            for (key, query) in queries {
                match query.await {
                    Ok(status) => channels.push(status),
                    Err(_) => channels.push(ChannelStatus {
                        channel: key,
                        state: ChannelState::Idle,
                        queued: 0,
                        pending_reset: 0,
                        live: false,
                        restarts: 0,
                        turns_done: 0,
                        active_for: None,
                        prepared: false,
                    }),
                }
            }
            channels.sort_by(|a, b| a.channel.cmp(&b.channel));
            let totals = Totals {
                live_channels: channels.iter().filter(|c| c.live).count(),
                busy_channels: channels.iter().filter(|c| c.state.is_busy()).count(),
                queued: channels.iter().map(|c| c.queued).sum(),
                pending_resets: channels.iter().filter(|c| c.pending_reset > 0).count(),
                containers_in_use: shared.max_containers - shared.limiter.available_permits(),
                max_containers: shared.max_containers,
                waiting_for_slot: shared.waiting_for_slot(),
                prepared: shared.sandbox.prepared_containers(),
                restarts,
                retired: retired_count,
                shutting_down,
            };
            StatusReport { channels, totals }
        })
    }
}

impl Handler<Shutdown> for SandboxSupervisor {
    type Result = ResponseFuture<ShutdownReport>;

    fn handle(&mut self, _: Shutdown, _: &mut Self::Context) -> Self::Result {
        let mut done = match &self.shutdown {
            Some(done) => done.clone(),
            None => {
                tracing::info!(channels = self.channels.len(), "shutting down");
                let (tx, rx) = watch::channel(None);
                self.shutdown = Some(rx.clone());
                let channels: Vec<_> = self
                    .channels
                    .values()
                    .map(|entry| entry.addr.send(ShutdownChannel))
                    .collect();
                let sandbox = self.shared.sandbox.clone();
                actix_rt::spawn(async move {
                    let mut report = ShutdownReport::default();
                    for channel in channels {
                        if let Ok(c) = channel.await {
                            report.stopped_turns += usize::from(c.stopped);
                            report.refused_queued += c.refused;
                        }
                    }
                    // Every prepared container is removed before the report (the channels
                    // discarded theirs; one still being prepared is removed when it is ready).
                    if !sandbox.prepared_drained(Duration::from_secs(120)).await {
                        tracing::warn!(
                            left = sandbox.prepared_containers(),
                            "prepared containers not removed in time; the next startup sweep removes them"
                        );
                    }
                    sandbox.shutdown().await;
                    tracing::info!(
                        stopped_turns = report.stopped_turns,
                        refused_queued = report.refused_queued,
                        "shut down"
                    );
                    let _ = tx.send(Some(report));
                });
                rx
            }
        };
        Box::pin(async move {
            match done.wait_for(Option::is_some).await {
                Ok(report) => report.unwrap_or_default(),
                Err(_) => ShutdownReport::default(),
            }
        })
    }
}
