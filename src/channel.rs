//! A channel's name on the host: the hash that names its workspace directory, its MCP
//! sessions and (cut to 16 hex digits) its container label. A leaf module: the turn and the
//! broker both use it.

use sha2::Digest;

/// `hex(sha256(channel))`: the channel's workspace segment.
pub fn channel_segment(channel: &str) -> String {
    hex::encode(sha2::Sha256::digest(channel.as_bytes()))
}
