//! The runtime's parts that are not the embedding API: `pub` so that this workspace's tests,
//! the bench and the fuzz targets can drive each alone, hidden from the documentation, and
//! with no stability promise. What a bot author needs of them is re-exported at the crate
//! root; what the project's own programs need, in `operator` (feature `cli`).
//!
//! `config` (the operator's settings, one module per section, validated once), `broker`
//! (the per-turn HTTP server on a unix socket that holds the key and the allow-listed host
//! and MCP tools: guest requests are hostile), `turn` (one turn's lifecycle and teardown),
//! `budgets` (the host's usage accounting and the `[budgets]` limits, durable in SQLite or a shared PostgreSQL),
//! `audit` (the audit trail, one JSON line per turn, and its summary), `quota` (the
//! workspace size cap, measured by descriptor only, and the free-space floor), `sweep`
//! (removal of what a crashed runtime left behind), `warm` (prepared containers for the
//! channels' next turns), `lock` (one runtime per root), `image` (the guest image, built
//! FROM scratch from two static binaries; feature `cli` or `testing`), and `testing`
//! (feature `testing`: the recording fake driver, the test environment, a broker driven
//! alone, and the engine-level hooks this workspace's tests use).

/// The Docker driver's engine-level parts (the create body, the runtimes' sizing), beside
/// its handle at [`crate::DockerDriver`].
pub mod docker {
    pub use crate::driver::docker::*;
}

pub mod audit;
pub mod broker;
pub mod budgets;
pub mod config;
#[cfg(any(feature = "cli", feature = "testing"))]
pub mod image;
pub mod lock;
pub mod quota;
pub mod sweep;
#[cfg(feature = "testing")]
pub mod testing;
pub mod turn;
pub mod warm;
