//! A turn's warn lines, rate-limited (the compactor's refusals and fallbacks, the
//! server's connection limit): one line per reason per [`WARN_WINDOW`], the lines left out
//! counted, told on the next line of that reason and, for those not told yet, once when
//! the turn ends. A leaf below the routes that use it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one reason's warn line is not repeated in a turn.
pub(super) const WARN_WINDOW: Duration = Duration::from_secs(10);
/// The most reasons a turn tracks apart; any further one shares one entry.
const MAX_WARN_REASONS: usize = 32;

/// A turn's compaction warn lines, rate-limited: one line per reason per [`WARN_WINDOW`];
/// the lines left out are counted, told on the next line of that reason and, for those
/// not told yet, once when the turn ends.
pub(super) struct Warnings {
    pub(super) channel: String,
    seen: Mutex<HashMap<String, (Instant, u64)>>,
}

impl Warnings {
    pub(super) fn new(channel: &crate::ChannelId) -> Self {
        Self {
            channel: channel.short().to_owned(),
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line of `kind` and `reason` is logged now: `Some(lines left out since the
    /// last one)`, or `None` (counted).
    pub(super) fn admit(&self, kind: &str, reason: &str) -> Option<u64> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut key = format!("{kind}: {reason}");
        if !seen.contains_key(&key) && seen.len() >= MAX_WARN_REASONS {
            key = format!("{kind}: (other reasons)");
        }
        let now = Instant::now();
        match seen.get_mut(&key) {
            Some((last, left_out)) if now.duration_since(*last) < WARN_WINDOW => {
                *left_out += 1;
                None
            }
            Some((last, left_out)) => {
                *last = now;
                Some(std::mem::take(left_out))
            }
            None => {
                seen.insert(key, (now, 0));
                Some(0)
            }
        }
    }

    /// A refused request, logged at warn (rate-limited).
    pub(super) fn refused(&self, reason: &str) {
        if let Some(suppressed) = self.admit("refused", reason) {
            tracing::warn!(
                channel = %self.channel,
                reason = %reason,
                suppressed,
                "compaction request refused; the guest falls back to the plain summary"
            );
        }
    }

    /// A failed step of the chain, logged at warn (rate-limited).
    pub(super) fn fell_back(&self, reason: &str, tokens_before: u64, fallback: &str) {
        if let Some(suppressed) = self.admit("fell back", reason) {
            tracing::warn!(
                channel = %self.channel,
                reason = %reason,
                tokens_before,
                fallback,
                suppressed,
                "compaction fell back"
            );
        }
    }
}

impl Drop for Warnings {
    fn drop(&mut self) {
        let seen = self.seen.get_mut().unwrap_or_else(|p| p.into_inner());
        for (reason, (_, left_out)) in seen.iter() {
            if *left_out > 0 {
                tracing::warn!(
                    channel = %self.channel,
                    reason = %reason,
                    suppressed = *left_out,
                    "compaction warn lines suppressed in this turn"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warn_lines_are_rate_limited_per_reason() {
        let w = Warnings::new(&"#c".into());
        assert_eq!(w.admit("refused", "a"), Some(0));
        assert_eq!(w.admit("refused", "a"), None);
        assert_eq!(w.admit("refused", "a"), None);
        assert_eq!(w.admit("refused", "b"), Some(0));
        assert_eq!(w.admit("fell back", "a"), Some(0));
        for i in 0..100 {
            w.admit("refused", &format!("r{i}"));
        }
        let seen = w.seen.lock().unwrap();
        assert!(seen.len() <= MAX_WARN_REASONS + 2, "{}", seen.len());
        assert_eq!(seen["refused: a"].1, 2);
    }
}
