//! Test support for the real parts the test suites share (dev-only, never published):
//!
//! - [`model`]: a scripted OpenAI-compatible model server on loopback;
//! - [`postgres`]: a real PostgreSQL server on loopback in a private data directory;
//! - [`broker_client`]: a guest-side HTTP/1.1 client for a turn's broker socket;
//! - [`mcp_process`]: the MCP servers' venv, and their pids as the tests watch them;
//! - [`mcp_stub`]: the stub MCP server of `tests/support/mcp_stub.py` as a configuration;
//! - [`docker_proxy`]: a unix-socket proxy in front of the Docker daemon (chaos tests);
//! - [`egress`]: a test CA, an HTTPS upstream and a DNS server on loopback (egress tests);
//! - [`http`]: the loopback HTTP/1.1 accept loop and body read the servers here share;
//! - [`captured_logs`]: a `tracing` writer that keeps what it is given;
//! - [`process`]: readings of the test process itself (its memory);
//! - [`hostile`]: the hostile image (`scripts/build-hostile-image.sh`) and its findings;
//! - [`warm_switch`]: the runtime with its turns through prepared containers when
//!   `ROUNDTABLE_WARM=1` (the security suite runs both ways).
//!
//! The test environment itself (private roots, the guest image's config, the leftover
//! checks) and the fake driver are the library's, behind its `testing` feature:
//! [`roundtable_sandbox::internals::testing`], re-exported here as [`sandbox`].

#![forbid(unsafe_code)]

pub mod broker_client;
pub mod captured_logs;
pub mod docker_proxy;
pub mod egress;
pub mod hostile;
pub mod http;
pub mod mcp_process;
pub mod mcp_stub;
pub mod model;
pub mod postgres;
pub mod process;
pub mod warm_switch;

pub use roundtable_sandbox::internals::testing as sandbox;
