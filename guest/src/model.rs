//! The model seam shared by the agent loop and the compaction: the [`Model`] trait (chat
//! completions and the host's compactor), its [`ModelError`], and the [`Meter`] that counts
//! what a turn used.

use roundtable_sandbox_protocol::compaction::{CompactReply, CompactRequest};
use roundtable_sandbox_protocol::Usage;

use crate::chat::{ChatRequest, ModelReply};

/// A chat-completions model, and the host's compactor behind it.
pub trait Model {
    /// Answers one request.
    fn complete(&mut self, request: &ChatRequest) -> Result<ModelReply, ModelError>;
    /// Summarises the older part of the conversation (the broker's `POST /v1/compact`).
    fn compact(&mut self, request: &CompactRequest) -> Result<CompactReply, ModelError>;
}

/// Why a model call failed (readable, already capped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelError(pub String);

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ModelError {}

/// What a turn used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meter {
    model_calls: u32,
    tool_calls: u32,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

impl Meter {
    /// Counts one model call and the tokens it reported.
    pub fn model_call(&mut self, reply: Option<&ModelReply>) {
        self.model_calls += 1;
        if let Some(reply) = reply {
            if let Some(n) = reply.prompt_tokens {
                self.prompt_tokens = Some(self.prompt_tokens.unwrap_or(0).saturating_add(n));
            }
            if let Some(n) = reply.completion_tokens {
                self.completion_tokens =
                    Some(self.completion_tokens.unwrap_or(0).saturating_add(n));
            }
        }
    }

    /// Counts one tool call.
    pub fn tool_call(&mut self) {
        self.tool_calls += 1;
    }

    /// Adds what another party (the host's compactor) reports it used.
    pub fn add(&mut self, usage: &Usage) {
        self.model_calls = self.model_calls.saturating_add(usage.model_calls);
        if let Some(n) = usage.prompt_tokens {
            self.prompt_tokens = Some(self.prompt_tokens.unwrap_or(0).saturating_add(n));
        }
        if let Some(n) = usage.completion_tokens {
            self.completion_tokens = Some(self.completion_tokens.unwrap_or(0).saturating_add(n));
        }
    }

    /// The usage for the reply.
    pub fn usage(&self) -> Usage {
        Usage {
            model_calls: self.model_calls,
            tool_calls: self.tool_calls,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
        }
    }
}
