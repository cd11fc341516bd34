//! The `[warm]` section: prepared containers for the channels' next turns (what they do:
//! [`crate::warm`]).

use std::time::Duration;

use serde::Deserialize;

/// The `[warm]` settings: prepared containers for the channels' next turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmSettings {
    /// Prepare each channel's next container in the background (default true; `false` is
    /// the one setting that turns warm turns off).
    pub enabled: bool,
    /// Prepared containers at most, across channels (0 to 256; 0 turns them off; default 8).
    /// They count against memory, not against running turns.
    pub max: usize,
    /// A prepared container waiting this long is removed (1 s to 24 h; `None`: the actor
    /// layer's channel idle timeout).
    pub ttl_secs: Option<u64>,
}

impl Default for WarmSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            max: 8,
            ttl_secs: None,
        }
    }
}

impl WarmSettings {
    /// Checks the ranges; the error says which setting and why.
    pub fn validate(&self) -> Result<(), String> {
        if self.max > 256 {
            return Err(format!("warm.max must be 0 to 256, got {}", self.max));
        }
        if let Some(ttl) = self.ttl_secs {
            if !(1..=86_400).contains(&ttl) {
                return Err(format!("warm.ttl_secs must be 1 to 86400, got {ttl}"));
            }
        }
        Ok(())
    }

    /// Whether prepared containers are made at all.
    pub fn on(&self) -> bool {
        self.enabled && self.max > 0
    }

    /// The TTL, if set.
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl_secs.map(Duration::from_secs)
    }
}
