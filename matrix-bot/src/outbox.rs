//! What waits to be posted, and when it may leave: rooms served in turn, each room's queue
//! bounded, each guest's output within a budget, the whole paced under the homeserver's
//! rate limits (as the IRC bot's outbox, with events for lines).
//!
//! - **Pacing** ([`Pacer`]): at most `--send-burst` events at once, then one per
//!   `--send-interval-ms`. The homeserver has its own limit (Synapse's `rc_message`: by
//!   default 0.2 events a second after a burst of 10); past it the server answers 429 with
//!   `retry_after_ms`, which the sender waits out before it sends the same event again (same
//!   transaction id: never twice). Every event leaves, late.
//! - **Fairness**: rooms take turns, one event each ([`Outbox::pop`]), so a room flooded with
//!   questions delays another room's answer by at most one event.
//! - **Bounds**: a room's queue holds at most `--room-outbox` events and each guest (sender,
//!   by user id) gets at most `--guest-messages` events per `--guest-window-secs`; past
//!   either, events are dropped and the room is told once per guest and window
//!   (`output truncated, N message(s) dropped (…)`).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::Value;

/// One event waiting to be sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing {
    /// The room.
    pub room: String,
    /// The event's content (`m.room.message`), its relation included.
    pub content: Value,
    /// On the last event of a reply: for whom, and when the reply was ready (logged when it
    /// leaves).
    pub done: Option<(String, Instant)>,
}

/// The sending side's rule: a burst, then one event per interval (a token bucket).
#[derive(Debug)]
pub struct Pacer {
    timer: Instant,
    span: Duration,
    interval: Duration,
}

impl Pacer {
    /// At most `burst` events at once, then one per `interval`.
    pub fn new(burst: u32, interval: Duration, now: Instant) -> Self {
        Self {
            timer: now,
            span: interval * burst.saturating_sub(1),
            interval,
        }
    }

    /// When the next event may leave.
    pub fn ready_at(&self, now: Instant) -> Instant {
        let timer = self.timer.max(now);
        if timer <= now + self.span {
            now
        } else {
            timer - self.span
        }
    }

    /// An event left at `now`.
    pub fn sent(&mut self, now: Instant) {
        self.timer = self.timer.max(now) + self.interval;
    }

    /// The server said to wait until `until`: nothing leaves before, and the burst is spent.
    pub fn hold_until(&mut self, until: Instant) {
        self.timer = self.timer.max(until + self.span);
    }
}

/// A guest's output in the current window.
#[derive(Debug)]
struct Budget {
    since: Instant,
    used: u64,
    noticed: bool,
}

/// What [`Outbox::post`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Posted {
    /// Events queued (the notice not counted).
    pub queued: usize,
    /// Events dropped.
    pub dropped: usize,
    /// Whether a notice of the drop was queued.
    pub noticed: bool,
    /// The room's queue length after it.
    pub depth: usize,
}

/// The bounds of an [`Outbox`].
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Most events waiting in one room (and one notice of a drop past them).
    pub room_cap: usize,
    /// Most events for one guest per window.
    pub guest_events: u64,
    /// The window.
    pub window: Duration,
}

/// Every room's waiting events, served in turn.
#[derive(Debug)]
pub struct Outbox {
    /// Rooms in the order they are served; a room is dropped when its queue empties.
    rooms: VecDeque<(String, VecDeque<Outgoing>)>,
    bounds: Bounds,
    guests: HashMap<String, Budget>,
}

/// Makes the notice of a drop: `(dropped, why)` → content.
pub type NoticeFn<'a> = &'a dyn Fn(usize, &str) -> Value;

impl Outbox {
    /// An empty outbox.
    pub fn new(bounds: Bounds) -> Self {
        Self {
            rooms: VecDeque::new(),
            bounds,
            guests: HashMap::new(),
        }
    }

    /// The events of one reply (or notice) for `guest` (a user id) in `room`, ready at
    /// `ready`: queued within the guest's budget and the room's cap, the rest dropped with
    /// one notice (`notice(dropped, why)`) per guest per window.
    pub fn post(
        &mut self,
        room: &str,
        guest: &str,
        contents: Vec<Value>,
        ready: Instant,
        notice: NoticeFn<'_>,
    ) -> Posted {
        let Bounds {
            room_cap,
            guest_events,
            window,
        } = self.bounds;
        self.guests
            .retain(|_, b| ready.saturating_duration_since(b.since) < window);
        let idx = match self.rooms.iter().position(|(r, _)| r == room) {
            Some(i) => i,
            None => {
                self.rooms.push_back((room.to_owned(), VecDeque::new()));
                self.rooms.len() - 1
            }
        };
        let queue = &mut self.rooms[idx].1;
        let budget = self.guests.entry(guest.to_owned()).or_insert(Budget {
            since: ready,
            used: 0,
            noticed: false,
        });
        let total = contents.len();
        let by_budget = guest_events.saturating_sub(budget.used) as usize;
        let room_left = room_cap.saturating_sub(queue.len());
        let mut take = total.min(by_budget).min(room_left);
        let mut told = None;
        // A drop is told once per guest per window, within the cap when there is room (the
        // notice takes the last place), else in the one place past it: a room filled exactly
        // to its cap is told too, and a room holds at most `room_cap + 1` events.
        if take < total && !budget.noticed && queue.len() <= room_cap {
            if take == room_left && take > 0 {
                take -= 1;
            }
            let why = if by_budget < total.min(room_left) {
                format!(
                    "at most {guest_events} message(s) per {} s for each guest",
                    window.as_secs()
                )
            } else {
                "this room's outbox is full".to_owned()
            };
            told = Some(notice(total - take, &why));
            budget.noticed = true;
        }
        budget.used += take as u64;
        let mut queued: Vec<Outgoing> = contents
            .into_iter()
            .take(take)
            .chain(told.clone())
            .map(|content| Outgoing {
                room: room.to_owned(),
                content,
                done: None,
            })
            .collect();
        if let Some(last) = queued.last_mut() {
            last.done = Some((guest.to_owned(), ready));
        }
        queue.extend(queued);
        let depth = queue.len();
        if depth == 0 {
            self.rooms.remove(idx);
        }
        Posted {
            queued: take,
            dropped: total - take,
            noticed: told.is_some(),
            depth,
        }
    }

    /// Whether an event waits.
    pub fn has_ready(&self) -> bool {
        !self.rooms.is_empty()
    }

    /// The next event to send: the first of the room whose turn it is; that room then goes
    /// to the back of the line.
    pub fn pop(&mut self) -> Option<Outgoing> {
        let (room, mut queue) = self.rooms.pop_front()?;
        let out = queue.pop_front();
        if !queue.is_empty() {
            self.rooms.push_back((room, queue));
        }
        out
    }

    /// Drops everything waiting for `room` (the bot left it); how many events.
    pub fn forget_room(&mut self, room: &str) -> usize {
        match self.rooms.iter().position(|(r, _)| r == room) {
            Some(i) => self.rooms.remove(i).map_or(0, |(_, q)| q.len()),
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bounds(room_cap: usize, guest_events: u64) -> Bounds {
        Bounds {
            room_cap,
            guest_events,
            window: Duration::from_secs(60),
        }
    }

    fn events(n: usize, what: &str) -> Vec<Value> {
        (0..n).map(|i| json!(format!("{what} {i}"))).collect()
    }

    fn notice(dropped: usize, why: &str) -> Value {
        json!(format!("dropped {dropped} ({why})"))
    }

    fn drain(o: &mut Outbox) -> Vec<String> {
        std::iter::from_fn(|| o.pop())
            .map(|e| e.content.as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn the_pacer_allows_a_burst_then_one_event_per_interval() {
        let t0 = Instant::now();
        let mut p = Pacer::new(3, Duration::from_millis(500), t0);
        for _ in 0..3 {
            assert_eq!(p.ready_at(t0), t0);
            p.sent(t0);
        }
        assert_eq!(p.ready_at(t0), t0 + Duration::from_millis(500));
        let later = t0 + Duration::from_secs(60);
        assert_eq!(p.ready_at(later), later);
        // A 429: nothing before the server's time, then one per interval.
        let mut p = Pacer::new(3, Duration::from_millis(500), t0);
        p.hold_until(t0 + Duration::from_secs(2));
        assert_eq!(p.ready_at(t0), t0 + Duration::from_secs(2));
        p.sent(t0 + Duration::from_secs(2));
        assert_eq!(p.ready_at(t0), t0 + Duration::from_millis(2500));
    }

    /// Fairness: a room with many events waiting delays another room's event by one.
    /// (Fails if rooms are served in the order their events came.)
    #[test]
    fn rooms_are_served_in_turn() {
        let mut o = Outbox::new(bounds(16, 100));
        let now = Instant::now();
        o.post("!a", "@flood:x", events(5, "a"), now, &notice);
        o.post("!b", "@ask:x", events(2, "b"), now, &notice);
        assert_eq!(
            drain(&mut o),
            ["a 0", "b 0", "a 1", "b 1", "a 2", "a 3", "a 4"]
        );
        assert!(!o.has_ready());
    }

    #[test]
    fn a_guest_past_its_budget_is_cut_with_one_notice_per_window() {
        let mut o = Outbox::new(bounds(100, 5));
        let now = Instant::now();
        let p = o.post("!a", "@ann:x", events(3, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed), (3, 0, false));
        let p = o.post("!a", "@ann:x", events(4, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed), (2, 2, true));
        let p = o.post("!a", "@ann:x", events(4, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed), (0, 4, false));
        assert_eq!(
            o.post("!b", "@bob:x", events(2, "b"), now, &notice).queued,
            2
        );
        let later = now + Duration::from_secs(61);
        let p = o.post("!a", "@ann:x", events(1, "a"), later, &notice);
        assert_eq!((p.queued, p.dropped), (1, 0));
        let sent = drain(&mut o);
        assert!(
            sent.contains(&"dropped 2 (at most 5 message(s) per 60 s for each guest)".to_owned()),
            "{sent:?}"
        );
    }

    #[test]
    fn a_rooms_queue_is_bounded() {
        let mut o = Outbox::new(bounds(4, 1000));
        let now = Instant::now();
        let p = o.post("!a", "@ann:x", events(10, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (3, 7, true, 4));
        // A room full to its cap: the next guest's drop is told in the one place past it,
        // and no later one (the room holds at most its cap and one notice).
        let p = o.post("!a", "@bob:x", events(3, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (0, 3, true, 5));
        let p = o.post("!a", "@cy:x", events(1, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (0, 1, false, 5));
        let sent = drain(&mut o);
        assert_eq!(
            sent[3..],
            [
                "dropped 7 (this room's outbox is full)",
                "dropped 3 (this room's outbox is full)"
            ]
        );
        o.post("!a", "@ann:x", events(2, "a"), now, &notice);
        assert_eq!(o.forget_room("!a"), 2);
        assert!(!o.has_ready());
    }

    /// The flood of the Matrix bot's end-to-end test, under a slow machine: replies of two
    /// events fill the room exactly to its cap before anything is sent; the guest's next
    /// reply is dropped and told (it was dropped untold before: no place left for the
    /// notice, and none ever came).
    #[test]
    fn a_room_filled_exactly_to_its_cap_still_tells_the_drop() {
        let mut o = Outbox::new(bounds(8, 100));
        let now = Instant::now();
        for _ in 0..4 {
            let p = o.post("!a", "@flood:x", events(2, "a"), now, &notice);
            assert_eq!((p.queued, p.dropped, p.noticed), (2, 0, false));
        }
        let p = o.post("!a", "@flood:x", events(2, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (0, 2, true, 9));
        let p = o.post("!a", "@flood:x", events(2, "a"), now, &notice);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (0, 2, false, 9));
        assert_eq!(
            drain(&mut o).last().unwrap(),
            "dropped 2 (this room's outbox is full)"
        );
    }

    #[test]
    fn the_last_event_of_a_post_carries_who_and_when() {
        let mut o = Outbox::new(bounds(10, 10));
        let now = Instant::now();
        o.post("!a", "@ann:x", events(2, "a"), now, &notice);
        assert_eq!(o.pop().unwrap().done, None);
        assert_eq!(o.pop().unwrap().done, Some(("@ann:x".to_owned(), now)));
    }
}
