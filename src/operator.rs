//! What the project's own programs (the `roundtable-sandbox` CLI's `doctor`, `explain`,
//! `sweep`, `image build` and `audit`) use beyond a bot's API: the config layer's rules as
//! `doctor` runs them, the free-space and filesystem probes, the guest image's build, the
//! budgets' SQLite store and the audit trail's summary. Feature `cli` only; a bot author
//! needs none of it (the crate root has the embedding API).

pub use crate::audit::summary::{summarize as summarize_audit, AuditSummary};
pub use crate::budgets::{check_shared_store, check_state_file, SqliteStore, StateFileCheck};
pub use crate::config::{
    check_root_ancestors, check_socket_path, is_private_dir, violations, GVISOR_RUNTIME,
    MAX_SOCKET_PATH, MCP_DATA_DIR,
};
pub use crate::internals::broker::egress::rules::{verdict as egress_verdict, EgressVerdict};
pub use crate::internals::image::{build as build_image, ImageError, ImageSource};
pub use crate::quota::{filesystem_type, free_space, Floor};
