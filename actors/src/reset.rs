//! A channel's pending reset generation (the `#fresh` map entry of pi-roundtable-sandbox
//! 0.7.18, the TypeScript package this ports).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The pending reset generation of one channel, shared by the supervisor (which keeps it
/// across actor restarts and retirements), the channel actor (which snapshots it) and the
/// turn (which consumes it from its reply callback, before teardown).
#[derive(Debug, Clone, Default)]
pub(crate) struct ResetGeneration(Arc<AtomicU64>);

impl ResetGeneration {
    /// `start_fresh`: one more requested reset; returns the new generation.
    pub(crate) fn request(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The generation now (0: no reset pending). Taken when a turn is admitted.
    pub(crate) fn snapshot(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// After a successful reply: clears the pending reset only if it is still the
    /// generation the turn started with. Returns whether it cleared.
    pub(crate) fn consume(&self, snapshot: u64) -> bool {
        snapshot > 0
            && self
                .0
                .compare_exchange(snapshot, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_successful_turn_consumes_only_its_own_generation() {
        let g = ResetGeneration::default();
        assert_eq!(g.snapshot(), 0);
        assert!(!g.consume(0), "nothing to consume");
        g.request();
        let admitted = g.snapshot();
        assert_eq!(admitted, 1);
        // A reset requested while the turn runs.
        g.request();
        assert!(!g.consume(admitted), "the newer reset stays pending");
        assert_eq!(g.snapshot(), 2);
        let next = g.snapshot();
        assert!(g.consume(next));
        assert_eq!(g.snapshot(), 0);
    }
}
