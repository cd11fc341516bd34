//! An event observer that records what it sees, for tests of the event seam.

use std::sync::{Arc, Mutex};

use crate::events::{BrokerEvent, Event, EventKind, Observer, Refusal};
use crate::turn::TurnFailure;
use crate::ChannelId;

/// Records every event of the runtime it observes (see [`Recorder::observer`]).
#[derive(Debug, Clone, Default)]
pub struct Recorder(Arc<Mutex<Vec<Event>>>);

impl Recorder {
    /// The observer to install (`Config::observer`, `SupervisorOptions::observer`).
    pub fn observer(&self) -> Observer {
        let seen = self.0.clone();
        Arc::new(move |e: &Event| seen.lock().unwrap().push(e.clone()))
    }

    /// Every event so far.
    pub fn all(&self) -> Vec<Event> {
        self.0.lock().unwrap().clone()
    }

    /// The events of `channel`.
    pub fn of(&self, channel: &str) -> Vec<Event> {
        let short = ChannelId::new(channel).short().to_owned();
        self.all()
            .into_iter()
            .filter(|e| e.channel.as_deref() == Some(short.as_str()))
            .collect()
    }

    /// The failures of the channel's `Ended` events.
    pub fn ends(&self, channel: &str) -> Vec<Option<TurnFailure>> {
        self.of(channel)
            .into_iter()
            .filter_map(|e| match e.kind {
                EventKind::Ended { failure, .. } => Some(failure),
                _ => None,
            })
            .collect()
    }

    /// The broker's events.
    pub fn broker(&self) -> Vec<BrokerEvent> {
        self.all()
            .into_iter()
            .filter_map(|e| match e.kind {
                EventKind::Broker(b) => Some(b),
                _ => None,
            })
            .collect()
    }

    /// The broker's refusals: status and limit.
    pub fn refusals(&self) -> Vec<(u16, Refusal)> {
        self.broker()
            .into_iter()
            .filter_map(|b| match b {
                BrokerEvent::Refused { status, limit } => Some((status, limit)),
                _ => None,
            })
            .collect()
    }
}
