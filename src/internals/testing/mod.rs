//! Test support shipped with the library behind the `testing` feature (as youki ships
//! `TestHelperSyscall`): one recording fake container driver for actor and runtime logic,
//! and one test environment for tests against the real Docker engine.
//!
//! - [`FakeDriver`]: runs no container; records every run and removal, and is scripted by
//!   the turn's text or configured at construction (instant replies, runs handed to the
//!   test, a real driver wrapped with a panic mid-run, a backend relaying the broker's
//!   streams). A fake is fine for actor logic only: tests of the sandbox itself run real
//!   containers.
//! - [`Env`]: private roots under `/tmp`, a [`Config`](crate::Config) for the project's
//!   guest image, the leftover checks run after every turn, and polling helpers.
//! - [`BrokerTurn`]: a broker driven alone ([`broker_policy`], [`start_broker`]) and one
//!   turn's listener on a socket in a private temp dir.
//! - [`FnTool`]: a host tool made of a function, for the tests' small tools.
//! - [`DockerDriverExt`]: the Docker driver's engine client and pending removals, which are
//!   not the embedding API (an engine type stays inside the driver).
//!
//! ```ignore
//! // Cargo.toml: [dev-dependencies] roundtable-sandbox = { path = "..", features = ["testing"] }
//! use roundtable_sandbox::internals::testing::{Env, FakeDriver};
//! let env = Env::new();
//! let driver = FakeDriver::new();
//! let mut config = env.config();
//! config.driver = Some(driver.clone());
//! ```

mod env;
mod fake;
mod lone_broker;
mod tool;

pub use env::{
    assert_no_leftovers, assert_no_leftovers_in, containers_labelled, eventually, image,
    labelled_containers, labelled_containers_of, one_turn, request, require_non_root,
    run_root_entries, runtime, speaker, under_gvisor, Env, NamedTool, PROMPTLY,
};
pub use fake::{FakeDriver, HandedRun, Record, Run, RunEnd, WhoAmI};
pub use lone_broker::{broker_policy, start_broker, BrokerTurn};
pub use tool::FnTool;

mod events;
pub use events::Recorder;

/// What tests ask of the Docker driver beyond the embedding API.
pub trait DockerDriverExt {
    /// The engine's client (connected and version-negotiated on first use).
    fn client(
        &self,
    ) -> impl std::future::Future<Output = Result<&bollard::Docker, crate::DriverError>> + Send;
    /// The containers whose removal failed and is still to be retried.
    fn pending_removals(&self) -> Vec<String>;
}

impl DockerDriverExt for crate::DockerDriver {
    fn client(
        &self,
    ) -> impl std::future::Future<Output = Result<&bollard::Docker, crate::DriverError>> + Send
    {
        crate::DockerDriver::engine(self)
    }

    fn pending_removals(&self) -> Vec<String> {
        crate::DockerDriver::removals_to_retry(self)
    }
}
