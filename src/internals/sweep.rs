//! The orphan sweep: what a crashed runtime left behind.
//!
//! Removes every container labelled with this runtime instance whose run dir lies under
//! `run_root`, and every `turn-` dir under `run_root`, except those of this runtime's turns
//! in flight. No other runtime can have a turn under these roots: the runtime holds their
//! locks (see [`crate::lock`]); a container of another runtime that shares the instance
//! name (its run dir lies elsewhere) is left alone. Workspaces are kept: they are the
//! channels' data. Run it once at startup, before the first turn.

use crate::driver::{DriverError, SweepScope};
use crate::Sandbox;

/// What a sweep removed, and what it could not.
#[derive(Debug, Default, Clone)]
pub struct SweepReport {
    /// The containers removed.
    pub containers: Vec<String>,
    /// The run dirs removed.
    pub run_dirs: Vec<std::path::PathBuf>,
    /// What could not be removed, and why.
    pub errors: Vec<String>,
}

/// Sweeps this instance's leftovers; every error is collected, none stops the sweep.
pub async fn sweep(sandbox: &Sandbox) -> SweepReport {
    let mut report = SweepReport::default();
    let config = sandbox.config();
    let live = sandbox.live_turns_shared();
    let is_live = move |name: &str| {
        live.lock()
            .unwrap_or_else(|e| e.into_inner())
            .has_container(name)
    };
    let scope = SweepScope {
        instance: &config.instance,
        run_root: &config.run_root,
        live: &is_live,
    };
    match sandbox.driver().sweep(scope).await {
        Ok(names) => report.containers = names,
        Err(e @ DriverError::DaemonUnreachable { .. }) => report.errors.push(e.to_string()),
        Err(e) => report.errors.push(format!("sweep containers: {e}")),
    }
    // Held throughout: a turn creates and registers its run dir under this lock.
    let live = sandbox.live_turns();
    match std::fs::read_dir(&config.run_root) {
        Ok(entries) => {
            for entry in entries.flatten() {
                let name = entry.file_name();
                if !name.to_string_lossy().starts_with("turn-") {
                    continue;
                }
                let path = entry.path();
                if live.has_run_dir(&path) {
                    continue;
                }
                match std::fs::remove_dir_all(&path) {
                    Ok(()) => report.run_dirs.push(path),
                    Err(e) => report
                        .errors
                        .push(format!("remove stale run dir {}: {e}", path.display())),
                }
            }
        }
        Err(e) => report
            .errors
            .push(format!("read run root {}: {e}", config.run_root.display())),
    }
    drop(live);
    if !report.containers.is_empty() || !report.run_dirs.is_empty() {
        tracing::info!(
            containers = report.containers.len(),
            run_dirs = report.run_dirs.len(),
            "swept leftovers of an earlier run"
        );
    }
    report
}
