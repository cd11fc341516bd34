//! A channel's name on the host: [`ChannelId`], the key a bot gave and its hash, computed
//! once. The hash names the channel's workspace directory and MCP sessions; cut to 16 hex
//! digits ([`ChannelId::short`], the one place it is cut) it names the channel in container
//! names and labels, logs and events. A leaf module: the turn, the broker and the actor
//! layer all use it.

use std::sync::Arc;

use sha2::Digest;

/// A channel: the bot's key (any string) and `hex(sha256(key))`, its segment on the host.
/// Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ChannelId(Arc<Inner>);

#[derive(PartialEq, Eq, Hash)]
struct Inner {
    key: String,
    segment: String,
    /// The first [`SHORT`] hex digits of `segment`, shared: every event of the channel
    /// carries it without an allocation.
    short: Arc<str>,
}

/// How many hex digits of the segment name the channel in labels, names, logs and events.
const SHORT: usize = 16;

impl ChannelId {
    /// The channel of `key` (hashed here, once).
    pub fn new(key: &str) -> Self {
        let segment = hex::encode(sha2::Sha256::digest(key.as_bytes()));
        let short = Arc::from(&segment[..SHORT]);
        Self(Arc::new(Inner {
            key: key.to_owned(),
            segment,
            short,
        }))
    }

    /// The bot's key for the channel.
    pub fn key(&self) -> &str {
        &self.0.key
    }

    /// `hex(sha256(key))`: the channel's workspace directory and MCP session key.
    pub fn segment(&self) -> &str {
        &self.0.segment
    }

    /// The first 16 hex digits of [`segment`](Self::segment): the channel in container
    /// names, labels, logs and events.
    pub fn short(&self) -> &str {
        &self.0.short
    }

    /// [`short`](Self::short), shared (what an [`Event`](crate::events::Event) carries).
    pub fn short_shared(&self) -> Arc<str> {
        self.0.short.clone()
    }
}

impl From<&str> for ChannelId {
    fn from(key: &str) -> Self {
        Self::new(key)
    }
}

impl From<String> for ChannelId {
    fn from(key: String) -> Self {
        Self::new(&key)
    }
}

impl From<&ChannelId> for ChannelId {
    fn from(id: &ChannelId) -> Self {
        id.clone()
    }
}

impl std::fmt::Debug for ChannelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key may be a guest-visible name: logs carry the hash.
        write!(f, "ChannelId({})", self.short())
    }
}

/// `hex(sha256(channel))`: the channel's workspace segment (see [`ChannelId::segment`]).
pub fn channel_segment(channel: &str) -> String {
    ChannelId::new(channel).segment().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_hash_cut_in_one_place() {
        let id = ChannelId::new("#a");
        assert_eq!(id.segment().len(), 64);
        assert_eq!(id.short(), &id.segment()[..16]);
        assert_eq!(id.key(), "#a");
        assert_eq!(channel_segment("#a"), id.segment());
        assert_ne!(ChannelId::new("#b"), id);
    }
}
