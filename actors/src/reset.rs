//! A channel's pending reset (the `#fresh` map entry of pi-roundtable-sandbox 0.7.18, the
//! TypeScript package this ports), in message order.
//!
//! The TypeScript package snapshots the generation when `runTurn` is called, so `runTurn(); startFresh()`
//! leaves the reset for the next turn. Here a message can wait in a mailbox or a channel's
//! queue before it is admitted, so a snapshot at admission would let a reset sent *after*
//! a message reach that message. Instead the supervisor **stamps** each message when it
//! receives it (in mailbox order, the same order as [`StartFresh`](crate::StartFresh)) with
//! the number of resets requested so far: the message runs with `reset = true` exactly when
//! a reset that arrived before it has not been consumed yet, and its successful turn
//! consumes only those resets, never one that arrived after it.

use std::sync::{Arc, Mutex, PoisonError};

/// The reset state of one channel, shared by the supervisor (which keeps it across actor
/// restarts and retirements and stamps messages with it), the channel actor (which decides
/// a turn's `reset` flag at admission) and the turn (which consumes the resets from its
/// reply callback, before teardown).
#[derive(Debug, Clone, Default)]
pub(crate) struct ResetGeneration(Arc<Mutex<State>>);

#[derive(Debug, Default)]
struct State {
    /// Resets requested so far (never decreases): each message is stamped with it.
    requested: u64,
    /// The highest stamp of a successful turn: the resets up to it are consumed.
    consumed: u64,
    /// `requested` when the channel last had no reset pending; the reported generation
    /// counts from it (as the TypeScript map entry counts from its creation).
    base: u64,
}

/// The resets requested before a message arrived (taken when the supervisor receives it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp(u64);

impl ResetGeneration {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `startFresh`: one more reset, for the messages that arrive from now on. Returns the
    /// pending generation.
    pub(crate) fn request(&self) -> u64 {
        let mut s = self.state();
        s.requested += 1;
        s.requested - s.base
    }

    /// The stamp of a message arriving now.
    pub(crate) fn stamp(&self) -> Stamp {
        Stamp(self.state().requested)
    }

    /// At admission: whether the message starts a fresh session (a reset that arrived
    /// before it is still pending).
    pub(crate) fn resets(&self, stamp: Stamp) -> bool {
        stamp.0 > self.state().consumed
    }

    /// After a successful reply: consumes the resets that arrived before the turn's
    /// message; a reset that arrived after it stays pending. Returns whether it consumed.
    pub(crate) fn consume(&self, stamp: Stamp) -> bool {
        let mut s = self.state();
        if stamp.0 <= s.consumed {
            return false;
        }
        s.consumed = stamp.0;
        if s.consumed == s.requested {
            s.base = s.requested;
        }
        true
    }

    /// The pending generation: resets requested since the channel last had none pending,
    /// 0 when none is pending.
    pub(crate) fn pending(&self) -> u64 {
        let s = self.state();
        if s.requested > s.consumed {
            s.requested - s.base
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_successful_turn_consumes_only_the_resets_before_its_message() {
        let g = ResetGeneration::default();
        assert_eq!(g.pending(), 0);
        let before = g.stamp();
        assert!(!g.resets(before));
        assert!(!g.consume(before), "nothing to consume");
        assert_eq!(g.request(), 1);
        let first = g.stamp();
        assert!(g.resets(first));
        // A reset requested while the turn runs.
        assert_eq!(g.request(), 2);
        assert!(g.consume(first));
        assert_eq!(g.pending(), 2, "the newer reset stays pending");
        let next = g.stamp();
        assert!(g.resets(next));
        assert!(g.consume(next));
        assert_eq!(g.pending(), 0);
        assert!(!g.resets(next), "consumed");
    }

    #[test]
    fn message_reset_message_in_order() {
        let g = ResetGeneration::default();
        let m1 = g.stamp();
        g.request();
        let m2 = g.stamp();
        // Both are admitted later, in order.
        assert!(!g.resets(m1));
        assert!(!g.consume(m1));
        assert_eq!(g.pending(), 1, "the reset waits for the message after it");
        assert!(g.resets(m2));
        assert!(g.consume(m2));
        assert_eq!(g.pending(), 0);
    }

    #[test]
    fn a_failed_turn_consumes_nothing_and_an_older_stamp_never_undoes_a_newer() {
        let g = ResetGeneration::default();
        g.request();
        let (a, b) = (g.stamp(), g.stamp());
        assert!(g.resets(a));
        // `a` fails: nothing consumed; `b` still resets and consumes.
        assert!(g.resets(b));
        assert!(g.consume(b));
        assert!(!g.consume(a), "older stamp");
        assert_eq!(g.pending(), 0);
    }
}
