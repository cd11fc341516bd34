//! The orphan sweep: what a crashed runtime left behind.
//!
//! Removes every container labelled with this runtime instance and every `turn-` dir
//! under `run_root` (a live runtime has none at startup). Workspaces are kept: they are the
//! channels' data. Run it once at startup, before the first turn.

use crate::driver::DriverError;
use crate::Sandbox;

/// What a sweep removed, and what it could not.
#[derive(Debug, Default, Clone)]
pub struct SweepReport {
    pub containers: Vec<String>,
    pub run_dirs: Vec<std::path::PathBuf>,
    pub errors: Vec<String>,
}

/// Sweeps this instance's leftovers; every error is collected, none stops the sweep.
pub async fn sweep(sandbox: &Sandbox) -> SweepReport {
    let mut report = SweepReport::default();
    let config = sandbox.config();
    match sandbox.driver().sweep(&config.instance).await {
        Ok(names) => report.containers = names,
        Err(e @ DriverError::DaemonUnreachable { .. }) => report.errors.push(e.to_string()),
        Err(e) => report.errors.push(format!("sweep containers: {e}")),
    }
    match std::fs::read_dir(&config.run_root) {
        Ok(entries) => {
            for entry in entries.flatten() {
                let name = entry.file_name();
                if !name.to_string_lossy().starts_with("turn-") {
                    continue;
                }
                let path = entry.path();
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
    if !report.containers.is_empty() || !report.run_dirs.is_empty() {
        tracing::info!(
            containers = report.containers.len(),
            run_dirs = report.run_dirs.len(),
            "swept leftovers of an earlier run"
        );
    }
    report
}
