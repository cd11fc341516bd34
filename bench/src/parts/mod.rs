//! The bench's parts, one module each, in the order they run. Each prints its figures and
//! returns them typed (the JSON results are their serialisation); `--only` picks them.
//!
//! | `--only`      | part | module |
//! |---------------|------|--------|
//! | `turn`        | 1. a trivial turn on each path (+ 1c. prepared containers' memory) | [`turn`], [`memory`] |
//! | `gvisor`      | 1b. runc vs gVisor | [`gvisor`] |
//! | `concurrency` | 2. N channels at once | [`concurrency`] |
//! | `throughput`  | 2b. warm channels back to back vs bare lifecycles | [`throughput`] |
//! | `ablation`    | 2c. the sealed container's options, one taken away at a time | [`ablation`] |
//! | `soak`        | 2d. one runtime for a long time | [`soak`] |
//! | `broker`      | 3. a model call through the broker vs direct | [`broker`] |
//! | `memory`      | 4. RSS per idle channel | [`memory`] |
//! | `accounting`  | 7. accounting, budgets and audit on vs off | [`accounting`] |
//! | `observed`    | 8. metrics too (+ 8b. idle channels' memory) | [`accounting`], [`memory`] |
//! | `store`       | 11. the budgets' PostgreSQL store vs the SQLite file | [`store`] |
//! | `egress`      | 12. an egress GET through the broker vs direct (no Docker) | [`egress`] |
//!
//! And outside `--only`: `roundtable-bench hostile` ([`hostile`]) and `--broker-side`
//! ([`broker_side`]).

use roundtable_sandbox::{DockerDriver, Sandbox};

use crate::harness::{broker::Model, lifecycle::Roots};
use crate::Options;

pub mod ablation;
pub mod accounting;
pub mod broker;
pub mod broker_side;
pub mod concurrency;
pub mod egress;
pub mod gvisor;
pub mod hostile;
pub mod memory;
pub mod soak;
pub mod store;
pub mod throughput;
pub mod turn;

/// What every Docker part runs against: the options, the engine, the bench's run roots,
/// the scripted model, the cold runtime and the turn every bare path sends.
pub struct Bench<'a> {
    pub o: &'a Options,
    pub driver: &'a DockerDriver,
    pub docker: &'a bollard::Docker,
    pub roots: &'a Roots,
    pub model: &'a Model,
    pub sandbox: &'a Sandbox,
    pub stdin: &'a [u8],
}
