//! The `[broker]` section: the broker's per-turn caps ([`BrokerLimits`]).

use std::time::Duration;

use serde::Deserialize;

use super::PolicyError;

/// Per-turn caps of the broker.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerLimits {
    /// Largest request body the guest may send (`413` past it).
    pub max_request_bytes: usize,
    /// Largest model or tool response relayed to the guest (a streamed answer is cut off
    /// past it with an error event; a whole one gets `502`).
    pub max_response_bytes: usize,
    /// Model calls per turn (`429` past it).
    pub max_model_calls: u32,
    /// Host plus MCP tool calls per turn (`429` past it).
    pub max_tool_calls: u32,
    /// Compactions (`POST /v1/compact`) per turn (`429` past it; the guest then builds the
    /// plain summary itself). Each of their upstream calls also counts as a model call.
    pub max_compactions: u32,
    /// Deadline of one call (`504` past it); for a streamed answer, the time to the
    /// response head and the longest gap between two chunks.
    #[serde(with = "secs")]
    pub call_timeout: Duration,
    /// Calls (model, compaction, host tool, MCP) being served at once in a turn, from reading the
    /// request to the end of the answer (`429` past it).
    pub max_calls_in_flight: usize,
    /// Open connections of a turn; one more is answered `503` and closed.
    pub max_connections: usize,
}

impl Default for BrokerLimits {
    fn default() -> Self {
        Self {
            max_request_bytes: 1 << 20,
            max_response_bytes: 4 << 20,
            max_model_calls: 32,
            max_tool_calls: 64,
            max_compactions: 4,
            call_timeout: Duration::from_secs(60),
            max_calls_in_flight: 4,
            max_connections: 16,
        }
    }
}

impl BrokerLimits {
    pub(crate) fn validate(&self) -> Result<(), PolicyError> {
        let err = |m: &str| Err(PolicyError::InvalidLimits(m.to_owned()));
        if !(1024..=256 << 20).contains(&self.max_request_bytes) {
            return err("max_request_bytes must be 1 KiB to 256 MiB");
        }
        if !(1024..=1 << 30).contains(&self.max_response_bytes) {
            return err("max_response_bytes must be 1 KiB to 1 GiB");
        }
        if !(1..=10_000).contains(&self.max_model_calls) {
            return err("max_model_calls must be 1 to 10000");
        }
        if !(1..=10_000).contains(&self.max_tool_calls) {
            return err("max_tool_calls must be 1 to 10000");
        }
        if !(1..=1000).contains(&self.max_compactions) {
            return err("max_compactions must be 1 to 1000");
        }
        if self.call_timeout < Duration::from_millis(100)
            || self.call_timeout > Duration::from_secs(3600)
        {
            return err("call_timeout must be 0.1 s to 3600 s");
        }
        if !(1..=256).contains(&self.max_calls_in_flight) {
            return err("max_calls_in_flight must be 1 to 256");
        }
        if !(1..=1024).contains(&self.max_connections) {
            return err("max_connections must be 1 to 1024");
        }
        if self.max_connections < self.max_calls_in_flight {
            return err("max_connections must be at least max_calls_in_flight");
        }
        Ok(())
    }
}

mod secs {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(|_| {
            serde::de::Error::custom("call_timeout must be a positive number of seconds")
        })
    }
}
