//! The broker as the agent sees it: a [`Model`] (chat completions and the host's
//! compactor) and a [`Remote`] (host and MCP tools), all over the unix-socket HTTP client.
//!
//! Model answers are parsed leniently (providers add fields; `arguments` may arrive as an
//! object; `content` may be a list of parts) but never trusted: anything unexpected is a
//! readable [`ModelError`]. Error texts are cleaned of control characters and capped.

use std::time::Duration;

use serde_json::{Map, Value};

use roundtable_sandbox_protocol::compaction::{CompactReply, CompactRequest};
use roundtable_sandbox_protocol::{paths, ErrorBody, ToolCallResult};

use crate::chat::{cap_text, ChatRequest, FunctionCall, ModelReply, ToolCall};
use crate::http::{Response, UnixHttpClient};
use crate::model::{Model, ModelError};
use crate::toolbox::Remote;

/// The longest error text passed on.
const MAX_ERROR: usize = 300;

/// The broker's socket client with the deadlines to use.
#[derive(Debug, Clone)]
pub struct Broker {
    client: UnixHttpClient,
    model: String,
    model_timeout: Duration,
    tool_timeout: Duration,
}

impl Broker {
    /// A broker client; `model` is sent as the request's model (the broker forces its own).
    pub fn new(
        client: UnixHttpClient,
        model: String,
        model_timeout: Duration,
        tool_timeout: Duration,
    ) -> Self {
        Self {
            client,
            model,
            model_timeout,
            tool_timeout,
        }
    }
}

/// A readable, single-line, capped version of a hostile text.
fn clean(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let flat = flat.trim();
    if flat.len() > MAX_ERROR {
        let mut end = MAX_ERROR;
        while !flat.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &flat[..end])
    } else {
        flat.to_string()
    }
}

/// The error text of a non-2xx answer: `{"error":"…"}`, `{"error":{"message":"…"}}`, or none.
/// A failed exchange and its cause on one line (the model or the tool result shows it).
fn http_text(error: &crate::http::HttpError) -> String {
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

fn error_text(response: &Response) -> String {
    let detail = serde_json::from_slice::<ErrorBody>(&response.body)
        .map(|b| b.error)
        .or_else(|_| {
            serde_json::from_slice::<Value>(&response.body).map(|v| {
                v.pointer("/error/message")
                    .or_else(|| v.get("error"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            })
        })
        .unwrap_or_default();
    let detail = clean(&detail);
    if detail.is_empty() {
        format!("broker answered {}", response.status)
    } else {
        format!("broker answered {}: {detail}", response.status)
    }
}

impl Model for Broker {
    fn complete(&mut self, request: &ChatRequest) -> Result<ModelReply, ModelError> {
        let body = serde_json::to_vec(&request.to_wire(&self.model))
            .map_err(|e| ModelError(format!("cannot encode the request: {e}")))?;
        let response = self
            .client
            .post_json(paths::CHAT_COMPLETIONS, &body, self.model_timeout)
            .map_err(|e| ModelError(http_text(&e)))?;
        if !(200..300).contains(&response.status) {
            return Err(ModelError(error_text(&response)));
        }
        parse_completion(&response.body)
    }

    fn compact(&mut self, request: &CompactRequest) -> Result<CompactReply, ModelError> {
        let body = serde_json::to_vec(request)
            .map_err(|e| ModelError(format!("cannot encode the compaction request: {e}")))?;
        let response = self
            .client
            .post_json(paths::COMPACT, &body, self.model_timeout)
            .map_err(|e| ModelError(http_text(&e)))?;
        if response.status != 200 {
            return Err(ModelError(error_text(&response)));
        }
        serde_json::from_slice(&response.body).map_err(|e| {
            ModelError(clean(&format!(
                "malformed compaction answer from the broker: {e}"
            )))
        })
    }
}

/// Parses an OpenAI-style non-streaming chat completion.
pub fn parse_completion(body: &[u8]) -> Result<ModelReply, ModelError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ModelError(format!("the model answer is not json: {e}")))?;
    let message = value
        .pointer("/choices/0/message")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError("the model answer has no message".into()))?;
    let content = match message.get("content") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
        ),
        Some(_) => return Err(ModelError("the model answer's content is malformed".into())),
    };
    let mut tool_calls = Vec::new();
    if let Some(calls) = message.get("tool_calls").filter(|v| !v.is_null()) {
        let calls = calls
            .as_array()
            .ok_or_else(|| ModelError("the model answer's tool calls are malformed".into()))?;
        for call in calls {
            let function = call.get("function");
            let name = function
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let arguments = match function.and_then(|f| f.get("arguments")) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            let id = call
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            tool_calls.push(ToolCall {
                id,
                kind: "function".into(),
                function: FunctionCall { name, arguments },
            });
        }
    }
    let usage = value.get("usage");
    let tokens = |key: &str| usage.and_then(|u| u.get(key)).and_then(Value::as_u64);
    Ok(ModelReply {
        content,
        tool_calls,
        prompt_tokens: tokens("prompt_tokens"),
        completion_tokens: tokens("completion_tokens"),
    })
}

impl Remote for Broker {
    fn call(&mut self, path: &str, args: &Map<String, Value>) -> Result<String, String> {
        let body =
            serde_json::to_vec(args).map_err(|e| format!("cannot encode the arguments: {e}"))?;
        let response = self
            .client
            .post_json(path, &body, self.tool_timeout)
            .map_err(|e| http_text(&e))?;
        if response.status != 200 {
            return Err(error_text(&response));
        }
        let result: ToolCallResult = serde_json::from_slice(&response.body)
            .map_err(|e| format!("malformed tool result from the broker: {e}"))?;
        if result.ok {
            Ok(result.content.unwrap_or_default())
        } else {
            Err(cap_text(
                result.error.as_deref().unwrap_or("the tool failed"),
                4096,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_parse_leniently() {
        let body = br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":null,
            "tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{\"path\":\"a\"}"}},
                          {"id":"c2","type":"function","function":{"name":"sh","arguments":{"command":"ls"}}}]},
            "finish_reason":"tool_calls"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#;
        let reply = parse_completion(body).unwrap();
        assert_eq!(reply.content, None);
        assert_eq!(reply.tool_calls.len(), 2);
        assert_eq!(reply.tool_calls[0].function.arguments, r#"{"path":"a"}"#);
        assert_eq!(
            reply.tool_calls[1].function.arguments,
            r#"{"command":"ls"}"#
        );
        assert_eq!(reply.prompt_tokens, Some(12));
        assert_eq!(reply.completion_tokens, Some(3));
        let parts = br#"{"choices":[{"message":{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}}]}"#;
        assert_eq!(
            parse_completion(parts).unwrap().content.as_deref(),
            Some("ab")
        );
        assert!(parse_completion(b"{}").is_err());
        assert!(parse_completion(b"nope").is_err());
    }

    #[test]
    fn error_bodies_become_clean_messages() {
        let r = Response {
            status: 429,
            body: br#"{"error":"too many\nmodel calls"}"#.to_vec(),
        };
        assert_eq!(error_text(&r), "broker answered 429: too many model calls");
        let r = Response {
            status: 502,
            body: br#"{"error":{"message":"upstream"}}"#.to_vec(),
        };
        assert_eq!(error_text(&r), "broker answered 502: upstream");
        let r = Response {
            status: 500,
            body: b"<html>".to_vec(),
        };
        assert_eq!(error_text(&r), "broker answered 500");
        let long = format!(r#"{{"error":"{}"}}"#, "x".repeat(1000));
        let r = Response {
            status: 400,
            body: long.into_bytes(),
        };
        assert!(error_text(&r).len() < MAX_ERROR + 40);
    }
}
