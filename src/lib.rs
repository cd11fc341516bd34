//! roundtable-sandbox: every guest turn in a sealed, short-lived container, with a
//! host-side credential broker as its only door out.
//!
//! This crate is the core (no actix): it trusts the operator's configuration and nothing
//! else. [`Sandbox`] ties its parts together; the actor layer (`roundtable-sandbox-actors`)
//! drives it.
//!
//! # The public surface
//!
//! Without any feature, a bot author gets:
//! - at the crate root, the embedding API: [`Sandbox`] and [`SandboxError`]; running a
//!   turn: [`Sandbox::admit`] then [`Sandbox::run`] (the one way; the actor layer uses it),
//!   or [`Sandbox::run_turn`] (the one convenience, admit then run); a turn's types
//!   ([`TurnRequest`], [`AdmittedTurn`], [`TurnOutcome`], [`Reply`], [`TurnFailure`],
//!   [`TurnPhase`], [`TurnError`], [`PreparedTurn`], [`ChannelId`]); the configuration
//!   ([`Config`], [`ConfigBuilder`], [`ResolvedConfig`], [`ConfigError`] and every
//!   section's type: [`Limits`], [`WarmSettings`], [`BrokerLimits`],
//!   [`ModelRequestPolicy`], [`CompactionModel`], [`McpServer`] and its parts,
//!   [`BudgetSettings`], [`AuditSettings`]); what the broker holds for the guest
//!   ([`ApiKey`] and its [`ApiKeyProvider`], [`HostTool`] and its [`ToolCallContext`]);
//!   the budgets' book and store ([`BudgetBook`], [`BudgetStore`]); the audit trail's
//!   [`AuditStats`];
//! - [`events`]: the one event seam, and the one hook: an [`Observer`] of every [`Event`],
//!   set on the [`Config`];
//! - [`driver`]: the backend-neutral [`ContainerDriver`] trait and its types, for a second
//!   backend, and the Docker driver's handle ([`DockerDriver`]: no engine type, bollard's
//!   stay inside it);
//! - [`display`]: guest- and model-made text made safe to show a person.
//!
//! Feature `cli` (the project's programs: the CLI and the example bots) adds `settings`
//! (config file, flags and defaults), `offline` (an embedded offline model, loopback only)
//! and `operator` (what `doctor`, `explain`, `sweep` and `image build` use: the config
//! layer's rules, the free-space probes, the image build, the budgets' SQLite store).
//!
//! Everything else is in one module hidden from the documentation, `internals` (no
//! stability promise): the runtime's parts, `pub` so that this workspace's tests, the
//! bench and the fuzz targets can drive each alone; with the `testing` feature it also
//! holds `internals::testing` (the recording fake driver, the test environment, a broker
//! driven alone, the Docker driver's engine-level hooks). `testing` is never enabled by a
//! build of the CLI or the bots (`test-support`, which enables it, is not a default
//! member; `scripts/test.sh` checks). CI lints the library crates without it with
//! `-W unnameable_types -W unreachable_pub`: every type the public API takes or returns
//! can be named, and no `pub` item is unreachable.
//!
//! The parts, by trust boundary (see `internals`): `config` (the operator's settings,
//! validated once, [`Config::resolve`]); `broker` (the per-turn HTTP server on a unix
//! socket that holds the key and the allow-listed host and MCP tools: guest requests are
//! hostile, and so is every answer from outside); `driver` (guest output is hostile);
//! `turn` (one turn's lifecycle and teardown); `budgets` (the host's usage accounting and
//! the `[budgets]` limits, durable in SQLite); `audit` (the audit trail, one JSON line per
//! turn); `quota` (the workspace size cap, measured by descriptor only, and the free-space
//! floor); `sweep` (removal of what a crashed runtime left behind); `warm` (prepared
//! containers for the channels' next turns); `lock` (one runtime per root).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[doc(hidden)]
pub mod internals;
pub(crate) use internals::{audit, broker, budgets, config, lock, quota, sweep, turn, warm};

mod channel;
pub mod display;
pub mod driver;
pub mod events;
#[cfg(feature = "cli")]
pub mod offline;
#[cfg(feature = "cli")]
pub mod operator;
#[cfg(feature = "cli")]
pub mod settings;

use std::sync::{Arc, Mutex, MutexGuard};

use turn::resources::LiveTurns;

// The embedding API: what a bot author uses (see the crate's documentation).
pub use audit::{AuditError, AuditSettings, AuditStats};
pub use broker::{BoxFuture, BrokerError, HostTool, ToolCallContext};
pub use budgets::{
    Budget, BudgetBook, BudgetRefusal, BudgetStore, CounterKey, HostUsage, PostgresStore,
    SharedView, StoreError,
};
pub use channel::ChannelId;
pub use config::{
    ApiKey, ApiKeyProvider, BrokerLimits, BudgetSettings, BudgetStoreOpener, Cidr, CompactionModel,
    Config, ConfigBuilder, ConfigError, CredentialPlacement, DenyRule, EgressLimits, EgressMode,
    EgressRoute, KeyRef, Limits, McpConfine, McpLimits, McpScope, McpServer, McpTransport,
    ModelRequestPolicy, PolicyError, ProvidedKey, Redirects, ResolvedConfig, StoreSource,
    WarmSettings, DEFAULT_IMAGE, DEFAULT_PROMPT, DEFAULT_TURN_TIMEOUT,
};
pub use driver::{ContainerDriver, DockerDriver, DockerOptions, DriverError, RunOutcome};
pub use events::{Event, EventKind, Observer};
pub use lock::LockError;
pub use quota::QuotaError;
pub use roundtable_sandbox_protocol as protocol;
pub use roundtable_sandbox_protocol::{Reply, Speaker, Usage};
pub use sweep::SweepReport;
pub use turn::{AdmittedTurn, TurnError, TurnFailure, TurnOutcome, TurnPhase, TurnRequest};
pub use warm::PreparedTurn;

/// A configured runtime: the resolved configuration, the broker and the driver.
/// Cheap to clone; share one per process.
#[derive(Debug, Clone)]
pub struct Sandbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: ResolvedConfig,
    broker: Arc<broker::Broker>,
    driver: Arc<dyn ContainerDriver>,
    /// The turns in flight: the sweep never touches them.
    live: Arc<Mutex<LiveTurns>>,
    /// The prepared containers' permits (`warm.max`).
    warm: warm::WarmPool,
    /// Where every event goes (see [`events`]).
    events: Arc<events::EventHub>,
    /// The audit trail (`[audit] path`), which the event hub feeds.
    audit: Option<Arc<audit::AuditTrail>>,
    /// The run root's and the workspace root's locks (and directory descriptors), held for
    /// the runtime's life.
    locks: [lock::RootLock; 2],
    /// The budgets' counters and their state file (`[budgets] state_file`).
    budgets: Option<Arc<budgets::BudgetBook>>,
}

/// Errors of starting a runtime.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The configuration breaks a rule (the cause names it).
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// A root's lock could not be taken.
    #[error(transparent)]
    Lock(#[from] lock::LockError),
    /// The broker could not be prepared (an MCP server did not start, say).
    #[error("start broker")]
    Broker(#[from] broker::BrokerError),
    /// The process could not be made private ([`make_process_private`]).
    #[error("make the runtime's process private (not dumpable)")]
    ProcessPrivate(#[source] std::io::Error),
    /// The budgets' state file could not be opened: not a database, damaged, or locked by
    /// another process (never reset: the message names the file).
    #[error(transparent)]
    Budgets(#[from] budgets::StoreError),
    /// The audit file (`[audit] path`) could not be opened for appending.
    #[error(transparent)]
    Audit(#[from] audit::AuditError),
}

/// Closes this process to the other processes of its own user: not dumpable
/// (`prctl(PR_SET_DUMPABLE, 0)`), so `/proc/<pid>/environ`, `mem`, `maps` and `fd` belong
/// to root and a same-uid `ptrace` attach is refused (the owner's processes no longer
/// pass the kernel's ptrace access check without `CAP_SYS_PTRACE`); no core dump is
/// written either. **Process-wide** and for the process's life (an `execve` of a child
/// resets it for the child only).
///
/// [`Sandbox::new`] calls it before anything else, and reading a key from the environment
/// or a file ([`Config::from_toml_file`], the `cli` settings) calls it before the key is
/// read; a program that holds a secret before either (its own key handling) should call
/// it first thing in `main`. Idempotent.
pub fn make_process_private() -> std::io::Result<()> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(std::io::Error::from)
}

/// Removes `var` from the process's environment once its secret is read: no child started
/// afterwards (a host tool's process, an MCP server, a hook) inherits it, and libc's
/// `getenv` no longer finds it. (`/proc/<pid>/environ` shows the environment the process
/// was started with whatever is removed: [`make_process_private`] is what closes it.)
pub(crate) fn forget_env_secret(var: &str) {
    std::env::remove_var(var);
}

impl Sandbox {
    /// Validates the configuration, takes the locks of both roots (a second runtime on
    /// either root fails here with [`lock::LockError::InUse`]; see [`lock`]) and prepares
    /// the broker (MCP servers are started and their allow-listed tools pinned). Starts
    /// no container.
    ///
    /// First of all it makes the whole process private to its own user
    /// ([`make_process_private`]: process-wide, for the process's life), so no other
    /// process of the service user can read the key from its memory or environment.
    pub async fn new(config: Config) -> Result<Self, SandboxError> {
        make_process_private().map_err(SandboxError::ProcessPrivate)?;
        let resolved = config.resolve()?;
        let locks = [
            lock::RootLock::acquire(&resolved.run_root)?,
            lock::RootLock::acquire(&resolved.workspace_root)?,
        ];
        // Before the broker (no MCP server started for a runtime that cannot count).
        let budgets = match config.budget_store.as_ref() {
            Some(open) => Some(budgets::BudgetBook::with_store(
                &resolved.budgets,
                &resolved.time_zone,
                open()?,
                Arc::new(chrono::Utc::now),
            )?),
            None => budgets::BudgetBook::open(&resolved.budgets, &resolved.time_zone)?,
        };
        let audit = match &resolved.audit.path {
            Some(path) => Some(audit::AuditTrail::open(path, resolved.audit.include_text)?),
            None => None,
        };
        let mut policy = resolved.broker.clone();
        if !policy.egress.is_empty() && config.driver.is_none() {
            // The engine's own networks join the egress deny set (best effort: a Docker
            // engine that cannot be asked now has its default bridge in 172.16/12 anyway).
            match DockerDriver::new(resolved.docker.clone())
                .network_subnets()
                .await
            {
                Ok(subnets) => {
                    policy.engine_networks = subnets
                        .iter()
                        .filter_map(|s| config::Cidr::parse(s))
                        .collect()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "list the engine's networks for the egress deny set")
                }
            }
        }
        // A backend of the embedder's runs the MCP sessions too (or refuses them: its trait's
        // defaults fail closed).
        if let (Some(engine), Some(driver)) = (policy.mcp_engine.as_mut(), &config.driver) {
            engine.driver = Some(driver.clone());
        }
        let broker = broker::Broker::start(policy).await?;
        let events = Arc::new(events::EventHub::new(
            config.observer.clone(),
            audit.clone().map(|a| a as Arc<dyn events::EventSink>),
        ));
        if let Some(book) = &budgets {
            book.observe(events.clone());
        }
        let driver: Arc<dyn ContainerDriver> = match config.driver {
            Some(d) => d,
            None => {
                Arc::new(DockerDriver::new(resolved.docker.clone()).with_events(events.clone()))
            }
        };
        let warm = resolved.warm;
        Ok(Self {
            inner: Arc::new(Inner {
                config: resolved,
                broker: Arc::new(broker),
                driver,
                live: Default::default(),
                warm: warm::WarmPool::new(&warm),
                events,
                audit,
                locks,
                budgets,
            }),
        })
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ResolvedConfig {
        &self.inner.config
    }

    /// The broker.
    pub(crate) fn broker(&self) -> &Arc<broker::Broker> {
        &self.inner.broker
    }

    /// The budgets' book (`None`: no state file and no store configured).
    pub fn budgets(&self) -> Option<&Arc<budgets::BudgetBook>> {
        self.inner.budgets.as_ref()
    }

    /// What the audit trail has done since startup (`None`: no `[audit] path`).
    pub fn audit_stats(&self) -> Option<audit::AuditStats> {
        self.inner.audit.as_ref().map(|a| a.stats())
    }

    /// Waits until every turn ended so far is in the audit file (or counted failed), up
    /// to `within`; `false` if it did not happen in time. No audit trail: `true`.
    pub async fn flush_audit(&self, within: std::time::Duration) -> bool {
        let Some(audit) = self.inner.audit.clone() else {
            return true;
        };
        tokio::task::spawn_blocking(move || audit.flush(within))
            .await
            .unwrap_or(false)
    }

    /// The container driver.
    pub fn driver(&self) -> &Arc<dyn ContainerDriver> {
        &self.inner.driver
    }

    /// Where the runtime's events go.
    pub(crate) fn audit(&self) -> Option<&Arc<audit::AuditTrail>> {
        self.inner.audit.as_ref()
    }

    pub(crate) fn events(&self) -> &Arc<events::EventHub> {
        &self.inner.events
    }

    /// Sends one event of the runtime's (the actor layer's own: a queued message, a wait
    /// for a slot, a refusal's end).
    pub fn emit(&self, turn: Option<u64>, channel: Option<&ChannelId>, kind: events::EventKind) {
        self.inner.events.emit(turn, channel, kind);
    }

    /// The workspace root's lock, with its directory held since startup.
    pub(crate) fn workspace_root_lock(&self) -> &lock::RootLock {
        &self.inner.locks[1]
    }

    /// The turns in flight (the turn runner registers them, the sweep skips them).
    pub(crate) fn live_turns(&self) -> MutexGuard<'_, LiveTurns> {
        self.inner.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn live_turns_shared(&self) -> Arc<Mutex<LiveTurns>> {
        self.inner.live.clone()
    }

    /// Admits a turn: its deadline is [`TurnRequest::admitted`] (default: now) plus the turn
    /// timeout, fixed here; the turn gets its runtime-wide number (see
    /// [`AdmittedTurn::number`]). Then [`Sandbox::run`] it.
    pub fn admit(&self, request: TurnRequest) -> AdmittedTurn {
        turn::admit(self, request)
    }

    /// Runs a turn [`admit`](Sandbox::admit)ted: in the container `prepared` for its
    /// channel, if given (see [`PreparedTurn`]: the same checks, broker and teardown as a
    /// cold turn, without the container's create and start; one that cannot serve is
    /// removed and the turn starts cold, the reason logged), else cold. `on_reply` sees the
    /// outcome before any teardown; the same outcome is returned after it. Never panics on
    /// a failing part: every failure is a [`TurnOutcome`] with its [`TurnFailure`].
    pub async fn run(
        &self,
        turn: AdmittedTurn,
        prepared: Option<PreparedTurn>,
        on_reply: impl FnOnce(&TurnOutcome),
    ) -> TurnOutcome {
        turn::run(self, turn, prepared, on_reply).await
    }

    /// The one convenience: admits `request` and runs it cold ([`Sandbox::admit`], then
    /// [`Sandbox::run`]).
    pub async fn run_turn(&self, request: TurnRequest) -> TurnOutcome {
        self.run(self.admit(request), None, |_| {}).await
    }

    /// Prepares the channel's next turn's container (warm turns): `Ok(None)` when they are
    /// off or `warm.max` containers are already prepared. `cancel` abandons the
    /// preparation: what was made is removed (after the engine's calls end) and the result
    /// is `Err` with [`DriverError::Cancelled`].
    pub async fn prepare_turn(
        &self,
        channel: impl Into<ChannelId>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<Option<PreparedTurn>, TurnError> {
        warm::prepare(self, channel.into(), cancel).await
    }

    /// Whether this runtime prepares containers (`[warm]` on and a driver that can).
    pub fn warm_enabled(&self) -> bool {
        self.inner.warm.max() > 0 && self.driver().prepares()
    }

    /// Turns served by a prepared container, and turns whose prepared container could not
    /// serve them (they started cold), since start: a count of the
    /// [`events::WarmEvent`]s `Adopted` and `FellBack`.
    pub fn warm_counts(&self) -> (u64, u64) {
        self.events().warm_counts()
    }

    /// Prepared containers alive now (waiting, or being prepared or removed).
    pub fn prepared_containers(&self) -> usize {
        self.inner.warm.alive()
    }

    /// Waits until no prepared container is left (each one removed or adopted), or `limit`.
    pub async fn prepared_drained(&self, limit: std::time::Duration) -> bool {
        warm::drained(&self.inner.warm, limit).await
    }

    /// Removes this instance's leftover containers and stale run dirs (see [`sweep`]); the
    /// turns in flight are never touched.
    pub async fn sweep(&self) -> sweep::SweepReport {
        sweep::sweep(self).await
    }

    /// Stops the channel's MCP sessions (see `Broker::release_channel`): taken out at
    /// once, closed by the returned future.
    pub fn release_channel(&self, channel: impl Into<ChannelId>) -> broker::BoxFuture<'static, ()> {
        self.inner.broker.release_channel(channel)
    }

    /// Ends the runtime-long parts (MCP children).
    pub async fn shutdown(&self) {
        self.inner.broker.shutdown().await;
        // The audit lines of the turns ended so far.
        self.flush_audit(std::time::Duration::from_secs(5)).await;
    }
}

/// An error and its causes on one line, `error: cause: cause`, for a reply's text (each
/// layer's message leaves out its cause, so each appears once).
pub(crate) fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        next = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_line_shows_each_cause_once() {
        let io = std::io::Error::other("disk on fire");
        let e = crate::SandboxError::Config(crate::ConfigError::ReadFile {
            path: "/etc/x.toml".into(),
            source: io,
        });
        assert_eq!(e.to_string(), "invalid configuration");
        assert_eq!(
            super::one_line(&e),
            "invalid configuration: read config file /etc/x.toml: disk on fire"
        );
    }
}
