//! What a turn has used of each egress route (requests, bytes each way): the per-turn
//! caps' counts, held by the turn's state (the broker's `http::Turn`).

use std::collections::HashMap;
use std::sync::Mutex;

/// What a turn has used of each route.
#[derive(Default)]
pub(crate) struct TurnEgress(Mutex<HashMap<String, Used>>);

#[derive(Default, Clone, Copy)]
pub(super) struct Used {
    pub(super) requests: u32,
    pub(super) bytes_in: u64,
    pub(super) bytes_out: u64,
}

impl TurnEgress {
    pub(super) fn with<T>(&self, route: &str, f: impl FnOnce(&mut Used) -> T) -> T {
        let mut used = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(used.entry(route.to_owned()).or_default())
    }
}
