//! The chat messages of the OpenAI-compatible chat-completions shapes, as the guest stores
//! and sends them and as a compaction request carries them to the broker.

use serde::{Deserialize, Serialize};

/// One chat message. The system message is never stored; it is rebuilt every turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase", deny_unknown_fields)]
pub enum Message {
    /// The system prompt (only in requests).
    System {
        /// The prompt.
        content: String,
    },
    /// A guest's message, attributed "name: text" by the guest program.
    User {
        /// `name: text`.
        content: String,
    },
    /// The model's answer: text, tool calls, or both.
    Assistant {
        /// The answer's text, if any.
        #[serde(default)]
        content: Option<String>,
        /// The tools it calls, if any.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
    },
    /// The result of one tool call.
    Tool {
        /// The id of the call this answers.
        tool_call_id: String,
        /// The tool's output (or its error).
        content: String,
    },
}

/// A tool call made by the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    /// The call's id, echoed by the tool message that answers it.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// The function part of a tool call: the name and the arguments as a JSON string.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object as a string (as the model wrote it).
    pub arguments: String,
}
