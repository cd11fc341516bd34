//! A shared MCP session's calls, one at a time, handed out fairly across channels
//! (issue 43: one channel's slow query held a shared session while another channel's
//! trivial call waited behind it, and the first call's timeout stopped the session for
//! both).
//!
//! A `scope = "shared"` server has one session for every channel. The broker runs its
//! calls **one at a time** and decides their order itself, instead of sending them all and
//! leaving the order to the server (many MCP servers, `mcp-server-sqlite` among them, serve
//! one request at a time, first come first served, so one channel's queue of calls held
//! every other channel's):
//!
//! - each channel's calls are served in the order they came (FIFO);
//! - across channels, round-robin: when a call ends, the next is the first waiting call of
//!   the channel first in the ring of channels with calls waiting; a channel just served
//!   goes to the back of the ring. So a channel with many calls waiting cannot starve
//!   another: between two calls of one channel, every other channel with a call waiting
//!   gets one;
//! - a call's wait is not its own time: its `call_timeout` starts once it holds the
//!   session. The wait is bounded by the fair order (at most one call of each other
//!   channel with calls waiting, each held to `call_timeout`) and by its turn (the turn's
//!   end or deadline, or the guest dropping the call, takes it out of the queue).
//!
//! **A call that does not finish** (its timeout, its turn's end, its connection dropped)
//! stops a stdio session, so that none of its work outlives it. The calls waiting behind
//! it were never sent: the session is stopped before the next call is handed it, and that
//! call restarts the session (a new process or container on the same data) and runs there,
//! its own `call_timeout` starting then. No call is sent twice and none is charged the dead
//! session; what the server kept only in memory is lost with the restart, as with any
//! restart. An http session is the remote's: the call that did not finish is cancelled
//! (`notifications/cancelled`) and the next call goes to the same session.
//!
//! [`FairQueue::busy`] is the hook for pausing a session (issue 43, item 4): a shared
//! session must not be paused while it is not zero, that is while a call waits for it or
//! runs, or any turn that called it is still running; [`FairQueue::try_idle`] takes the
//! session for the pause only then, and calls that come meanwhile wait for it in order.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// The calls of one shared session: who holds it, and who waits, by channel.
#[derive(Default)]
pub(crate) struct FairQueue {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    /// Ids of calls (each waiter's, and each holder's).
    next_id: u64,
    /// The call holding the session: its id and channel.
    holder: Option<(u64, String)>,
    /// Each channel with calls waiting: their ids in arrival order.
    lines: HashMap<String, VecDeque<u64>>,
    /// The channels with calls waiting, in the order they are served.
    ring: VecDeque<String>,
    /// How each waiting call is told that it holds the session.
    wake: HashMap<u64, oneshot::Sender<()>>,
    /// The turns that called the session (their stop tokens, one per call; the ended ones
    /// are pruned as they are seen).
    turns: Vec<CancellationToken>,
}

impl Inner {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The session is free: handed to the next call in the fair order, if any waits.
    /// `ended` is the channel of the call that just ended.
    fn release(&mut self, ended: &str) {
        self.holder = None;
        // The channel just served goes behind every other channel that waits (its line may
        // have been made while it held the session, ahead of channels that came later).
        if let Some(at) = self.ring.iter().position(|c| c == ended) {
            let channel = self.ring.remove(at).expect("a position in the ring");
            self.ring.push_back(channel);
        }
        let Some(channel) = self.ring.pop_front() else {
            return;
        };
        let line = self.lines.get_mut(&channel).expect("a channel in the ring");
        let id = line
            .pop_front()
            .expect("a channel in the ring has a call waiting");
        if line.is_empty() {
            self.lines.remove(&channel);
        } else {
            // Served: behind every other channel that waits.
            self.ring.push_back(channel.clone());
        }
        self.holder = Some((id, channel));
        let wake = self
            .wake
            .remove(&id)
            .expect("every waiting call can be woken");
        // The receiver is dropped only under this lock, after its call left the queue.
        let _ = wake.send(());
    }

    /// Takes a waiting call out of the queue (its future was dropped); false if it was
    /// not waiting (it was handed the session meanwhile).
    fn leave(&mut self, id: u64, channel: &str) -> bool {
        if self.wake.remove(&id).is_none() {
            return false;
        }
        if let Some(line) = self.lines.get_mut(channel) {
            line.retain(|w| *w != id);
            if line.is_empty() {
                self.lines.remove(channel);
                self.ring.retain(|c| c != channel);
            }
        }
        true
    }

    fn prune_turns(&mut self) {
        self.turns.retain(|t| !t.is_cancelled());
    }
}

impl FairQueue {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Held only for a few map operations; a poisoned lock holds valid data.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the session in the fair order, as a call of `channel` (its hash). Dropping
    /// the future takes the call out of the queue (or hands the session on, if it was
    /// handed it meanwhile).
    pub(crate) async fn acquire(&self, channel: &str) -> Permit {
        let (id, rx) = {
            let mut inner = self.lock();
            let id = inner.id();
            if inner.holder.is_none() && inner.ring.is_empty() {
                inner.holder = Some((id, channel.to_owned()));
                return self.permit(id, channel);
            }
            let line = inner.lines.entry(channel.to_owned()).or_default();
            line.push_back(id);
            if line.len() == 1 {
                inner.ring.push_back(channel.to_owned());
            }
            let (tx, rx) = oneshot::channel();
            inner.wake.insert(id, tx);
            (id, rx)
        };
        let mut waiting = Waiting {
            queue: self,
            id,
            channel,
            armed: true,
        };
        // The sender is only dropped once it has sent (the queue lives as long as `self`).
        let _ = rx.await;
        waiting.armed = false;
        self.permit(id, channel)
    }

    fn permit(&self, id: u64, channel: &str) -> Permit {
        Permit {
            inner: self.inner.clone(),
            id,
            channel: channel.to_owned(),
        }
    }

    /// Counts `turn` (its stop token) as using the session until it ends.
    pub(crate) fn used_by(&self, turn: &CancellationToken) {
        let mut inner = self.lock();
        inner.prune_turns();
        inner.turns.push(turn.clone());
    }

    /// Not zero while the session is in use: a call holds it or waits for it, or a turn
    /// that called it is still running. The pause code (issue 43, item 4) must not pause
    /// a shared session until it is zero.
    pub(crate) fn busy(&self) -> usize {
        let mut inner = self.lock();
        inner.prune_turns();
        usize::from(inner.holder.is_some()) + inner.wake.len() + inner.turns.len()
    }

    /// The session, held for a pause (or any other work on an idle session), when
    /// [`FairQueue::busy`] is zero; calls that come meanwhile wait for the permit in order.
    #[allow(dead_code)] // the hook of the pause code (issue 43, item 4)
    pub(crate) fn try_idle(&self) -> Option<Permit> {
        let mut inner = self.lock();
        inner.prune_turns();
        if inner.holder.is_some() || !inner.ring.is_empty() || !inner.turns.is_empty() {
            return None;
        }
        let id = inner.id();
        inner.holder = Some((id, String::new()));
        drop(inner);
        Some(self.permit(id, ""))
    }

    /// Whether a call (or a pause) holds the session.
    #[cfg(feature = "testing")]
    pub(crate) fn held(&self) -> bool {
        self.lock().holder.is_some()
    }

    /// Calls waiting for the session (not the one holding it).
    pub(crate) fn waiting(&self) -> usize {
        self.lock().wake.len()
    }
}

/// A call waiting in the queue; dropped while armed (the call's future dropped), it leaves
/// the queue, or hands the session on if it was handed it meanwhile.
struct Waiting<'a> {
    queue: &'a FairQueue,
    id: u64,
    channel: &'a str,
    armed: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut inner = self.queue.lock();
        if !inner.leave(self.id, self.channel)
            && inner.holder.as_ref().is_some_and(|(id, _)| *id == self.id)
        {
            inner.release(self.channel);
        }
    }
}

/// The session, held by one call; dropped, it goes to the next call in the fair order.
pub(crate) struct Permit {
    inner: Arc<Mutex<Inner>>,
    id: u64,
    channel: String,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.holder.as_ref().is_some_and(|(id, _)| *id == self.id) {
            inner.release(&self.channel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polls `f` once: whether it is ready.
    fn ready<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::pin::Pin::new(f).poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    #[test]
    fn a_channel_with_many_calls_waiting_does_not_starve_another() {
        let q = FairQueue::default();
        let mut a1 = Box::pin(q.acquire("a"));
        let a1 = ready(&mut a1).expect("the session was free");
        let mut waiting: Vec<(&str, _)> = ["a2", "a3", "a4", "b1", "c1", "b2"]
            .into_iter()
            .map(|name| (name, Box::pin(q.acquire(&name[..1]))))
            .collect();
        for (_, w) in &mut waiting {
            assert!(ready(w).is_none());
        }
        assert_eq!(q.waiting(), 6);
        let mut order = vec![];
        let mut held = Some(a1);
        while let Some(permit) = held.take() {
            drop(permit);
            for (name, w) in &mut waiting {
                if let Some(p) = ready(w) {
                    order.push(*name);
                    held = Some(p);
                }
            }
            waiting.retain(|(n, _)| !order.contains(n));
        }
        assert_eq!(order, ["b1", "c1", "a2", "b2", "a3", "a4"]);
        assert_eq!(q.busy(), 0);
    }

    #[test]
    fn a_dropped_waiter_leaves_the_queue_or_hands_the_session_on() {
        let q = FairQueue::default();
        let mut first = Box::pin(q.acquire("a"));
        let first = ready(&mut first).unwrap();
        let mut gone = Box::pin(q.acquire("b"));
        let mut next = Box::pin(q.acquire("c"));
        assert!(ready(&mut gone).is_none() && ready(&mut next).is_none());
        drop(first);
        // `gone` was handed the session but dropped before it saw it: it goes on to `next`.
        drop(gone);
        let next = ready(&mut next).expect("handed on");
        assert_eq!(q.busy(), 1);
        assert!(q.try_idle().is_none());
        drop(next);
        assert_eq!(q.busy(), 0);
        let idle = q.try_idle().expect("nothing uses it");
        let mut after = Box::pin(q.acquire("a"));
        assert!(ready(&mut after).is_none(), "waits for the pause");
        drop(idle);
        assert!(ready(&mut after).is_some());
    }

    #[test]
    fn a_running_turn_that_called_it_keeps_it_busy() {
        let q = FairQueue::default();
        let turn = CancellationToken::new();
        q.used_by(&turn);
        assert_eq!(q.busy(), 1);
        assert!(q.try_idle().is_none());
        turn.cancel();
        assert_eq!(q.busy(), 0);
        assert!(q.try_idle().is_some());
    }
}
