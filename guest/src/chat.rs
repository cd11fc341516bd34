//! The chat messages the guest keeps and sends: OpenAI-compatible chat-completions shapes.
//!
//! The same [`Message`] type is the wire format toward the broker and the stored format
//! of the session, so a session file can be checked strictly on load ([`validate_history`]).

use serde_json::Value;

pub use roundtable_sandbox_protocol::chat::{FunctionCall, Message, ToolCall};
pub use roundtable_sandbox_protocol::text::cap_text;

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    pub parameters: Value,
}

impl ToolDef {
    /// The OpenAI `tools` entry for this tool.
    pub fn to_wire(&self) -> Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }
}

/// One request to the model: the whole conversation and the tools on offer.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub tools: Vec<ToolDef>,
}

impl ChatRequest {
    /// The request body without the model name (the broker forces the model anyway).
    pub fn to_wire(&self, model: &str) -> Value {
        let mut body = serde_json::json!({
            "model": model,
            "messages": self.messages,
            "stream": false,
        });
        if !self.tools.is_empty() {
            body["tools"] = Value::Array(self.tools.iter().map(ToolDef::to_wire).collect());
            body["tool_choice"] = Value::String("auto".into());
        }
        body
    }

    /// A rough token estimate of the request: its JSON size in bytes over four.
    pub fn estimate_tokens(&self) -> u64 {
        let size = serde_json::to_string(&self.to_wire("")).map_or(0, |s| s.len());
        (size as u64).div_ceil(4)
    }
}

/// What the model answered to one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelReply {
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// Why a history is not a well-formed conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryError(pub String);

impl std::fmt::Display for HistoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks that a stored history can be sent as it is: no system messages, every tool
/// result answers a call of the assistant message just before it, and every call is
/// answered exactly once.
pub fn validate_history(messages: &[Message]) -> Result<(), HistoryError> {
    let mut pending: Vec<&str> = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        match message {
            Message::System { .. } => {
                return Err(HistoryError(format!("message {i} is a system message")));
            }
            Message::Tool { tool_call_id, .. } => {
                let Some(pos) = pending.iter().position(|id| id == tool_call_id) else {
                    return Err(HistoryError(format!(
                        "message {i} answers no pending tool call"
                    )));
                };
                pending.remove(pos);
            }
            Message::User { .. } | Message::Assistant { .. } => {
                if !pending.is_empty() {
                    return Err(HistoryError(format!(
                        "message {i} comes before every tool call was answered"
                    )));
                }
                if let Message::Assistant { tool_calls, .. } = message {
                    for call in tool_calls {
                        if pending.contains(&call.id.as_str()) {
                            return Err(HistoryError(format!(
                                "message {i} repeats a tool call id"
                            )));
                        }
                        pending.push(&call.id);
                    }
                }
            }
        }
    }
    if pending.is_empty() {
        Ok(())
    } else {
        Err(HistoryError(
            "the last tool calls were never answered".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "read".into(),
                arguments: "{}".into(),
            },
        }
    }

    #[test]
    fn messages_use_openai_shapes() {
        let m = Message::Assistant {
            content: None,
            tool_calls: vec![call("c1")],
        };
        let json = serde_json::to_value(&m).unwrap();
        assert_eq!(json["role"], "assistant");
        assert!(json["content"].is_null());
        assert_eq!(json["tool_calls"][0]["type"], "function");
        let back: Message = serde_json::from_value(json).unwrap();
        assert_eq!(back, m);
        assert!(serde_json::from_str::<Message>(r#"{"role":"user","content":"x","x":1}"#).is_err());
    }

    #[test]
    fn history_validation_catches_broken_sequences() {
        let ok = vec![
            Message::User {
                content: "a: hi".into(),
            },
            Message::Assistant {
                content: None,
                tool_calls: vec![call("c1"), call("c2")],
            },
            Message::Tool {
                tool_call_id: "c2".into(),
                content: "x".into(),
            },
            Message::Tool {
                tool_call_id: "c1".into(),
                content: "y".into(),
            },
        ];
        assert!(validate_history(&ok).is_ok());
        assert!(validate_history(&ok[..3]).is_err());
        assert!(validate_history(&ok[2..]).is_err());
        let sys = vec![Message::System {
            content: "x".into(),
        }];
        assert!(validate_history(&sys).is_err());
    }
}
