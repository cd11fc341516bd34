//! The chat messages of the OpenAI-compatible chat-completions shapes, as the guest stores
//! and sends them and as a compaction request carries them to the broker.

use serde::{Deserialize, Serialize};

/// One chat message. The system message is never stored; it is rebuilt every turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase", deny_unknown_fields)]
pub enum Message {
    /// The system prompt (only in requests).
    System { content: String },
    /// A guest's message, attributed "name: text" by the guest program.
    User { content: String },
    /// The model's answer: text, tool calls, or both.
    Assistant {
        #[serde(default)]
        content: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
    },
    /// The result of one tool call.
    Tool {
        tool_call_id: String,
        content: String,
    },
}

/// A tool call made by the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The function part of a tool call: the name and the arguments as a JSON string.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}
