//! The agent loop: model ↔ tool calls until the model answers with text or the step
//! limit is reached.
//!
//! The loop is generic over a [`Model`] and a [`Tools`] so the unit tests can script both.
//! It works on a copy of the session and hands back the new session only on success: a
//! model error leaves the caller's session (and so the file) untouched. Everything the
//! model sends back is hostile: malformed tool-call arguments, unknown tools, duplicate
//! ids and oversized results become error results or capped text, never a crash.

use std::collections::HashSet;

use serde_json::{Map, Value};

use roundtable_sandbox_protocol::Usage;

use crate::chat::{cap_text, ChatRequest, FunctionCall, Message, ToolCall, ToolDef};
use crate::compact;
use crate::model::{Meter, Model, ModelError};
use crate::session::Session;

/// The most tool calls run for one model step; further calls in the same step are dropped.
const MAX_CALLS_PER_STEP: usize = 16;
/// The reply when the model ends the turn with neither text nor tool calls.
pub const NO_ANSWER: &str = "(no answer)";
/// The longest tool name or call id kept.
const MAX_ID: usize = 128;

/// The tools the model may call.
pub trait Tools {
    /// The tools on offer, as the model sees them.
    fn definitions(&self) -> Vec<ToolDef>;
    /// Runs one tool: `Ok(content)` or `Err(error shown to the model)`.
    fn call(&mut self, name: &str, args: &Map<String, Value>) -> Result<String, String>;
}

/// Why a turn failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentError {
    /// A model call of the conversation failed.
    Model(ModelError),
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentError::Model(e) => write!(f, "the model call failed: {e}"),
        }
    }
}

impl std::error::Error for AgentError {}

/// The loop's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentLimits {
    /// The most model calls of the conversation in one turn (compaction not counted).
    pub max_steps: u32,
    /// The session's compaction budget in estimated tokens.
    pub budget: u64,
    /// The most bytes of one tool result kept.
    pub tool_result_cap: usize,
}

impl AgentLimits {
    /// Limits for a turn: `max_steps` (clamped to 1..=100) and a budget (at least 256).
    pub fn new(max_steps: u32, budget: u64) -> Self {
        let budget = budget.max(256);
        Self {
            max_steps: max_steps.clamp(1, 100),
            budget,
            tool_result_cap: usize::try_from(budget)
                .unwrap_or(usize::MAX)
                .clamp(512, 32 * 1024),
        }
    }
}

/// A finished turn: the answer, the session to save, and what it used.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub text: String,
    pub session: Session,
    pub usage: Usage,
}

/// Builds the request: system prompt, the summary (if any), then the history.
pub fn build_request(system: &str, session: &Session, tools: &[ToolDef]) -> ChatRequest {
    let mut messages = Vec::with_capacity(session.messages.len() + 2);
    messages.push(Message::System {
        content: system.to_string(),
    });
    if let Some(summary) = &session.summary {
        messages.push(compact::summary_message(summary));
    }
    messages.extend(session.messages.iter().cloned());
    ChatRequest {
        messages,
        tools: tools.to_vec(),
    }
}

/// Runs one turn: appends the (already attributed) user message to a copy of `session`,
/// loops model ↔ tools, and returns the answer with the new session.
pub fn run_turn<M: Model, T: Tools>(
    model: &mut M,
    tools: &mut T,
    config: &AgentLimits,
    session: &Session,
    system: &str,
    user: String,
) -> Result<Outcome, AgentError> {
    let mut session = session.clone();
    let mut meter = Meter::default();
    let defs = tools.definitions();
    session.messages.push(Message::User { content: user });
    for step in 0..config.max_steps {
        let mut request = build_request(system, &session, &defs);
        let tokens = request.estimate_tokens();
        if tokens > config.budget {
            let overhead = build_request(system, &Session::default(), &defs).estimate_tokens();
            if compact::compact(
                model,
                &mut meter,
                &mut session,
                config.budget,
                overhead,
                tokens,
            ) {
                request = build_request(system, &session, &defs);
            }
        }
        let reply = match model.complete(&request) {
            Ok(reply) => reply,
            Err(e) => return Err(AgentError::Model(e)),
        };
        meter.model_call(Some(&reply));
        if reply.tool_calls.is_empty() {
            let text = reply
                .content
                .filter(|c| !c.trim().is_empty())
                .unwrap_or_else(|| NO_ANSWER.to_string());
            session.messages.push(Message::Assistant {
                content: Some(text.clone()),
                tool_calls: Vec::new(),
            });
            return Ok(Outcome {
                text,
                session,
                usage: meter.usage(),
            });
        }
        let calls = normalize_calls(reply.tool_calls, step);
        session.messages.push(Message::Assistant {
            content: reply.content.filter(|c| !c.trim().is_empty()),
            tool_calls: calls.clone(),
        });
        for call in calls {
            meter.tool_call();
            let content = match parse_arguments(&call.function.arguments) {
                Ok(args) => match tools.call(&call.function.name, &args) {
                    Ok(content) => content,
                    Err(error) => format!("error: {error}"),
                },
                Err(error) => format!("error: {error}"),
            };
            session.messages.push(Message::Tool {
                tool_call_id: call.id,
                content: cap_text(&content, config.tool_result_cap),
            });
        }
    }
    let text = format!(
        "I stopped after {} steps without a final answer; ask me to continue.",
        config.max_steps
    );
    session.messages.push(Message::Assistant {
        content: Some(text.clone()),
        tool_calls: Vec::new(),
    });
    Ok(Outcome {
        text,
        session,
        usage: meter.usage(),
    })
}

/// Caps the number of calls, gives every call a unique, sane id and caps its name.
fn normalize_calls(calls: Vec<ToolCall>, step: u32) -> Vec<ToolCall> {
    if calls.len() > MAX_CALLS_PER_STEP {
        eprintln!(
            "roundtable-guest: the model made {} tool calls in one step; running the first {MAX_CALLS_PER_STEP}",
            calls.len()
        );
    }
    let mut seen = HashSet::new();
    calls
        .into_iter()
        .take(MAX_CALLS_PER_STEP)
        .enumerate()
        .map(|(i, call)| {
            let sane = !call.id.is_empty()
                && call.id.len() <= MAX_ID
                && call
                    .id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            let id = if sane && seen.insert(call.id.clone()) {
                call.id
            } else {
                let id = format!("call_{step}_{i}");
                seen.insert(id.clone());
                id
            };
            let mut name = call.function.name;
            if name.len() > MAX_ID {
                name = cap_text(&name, MAX_ID);
            }
            ToolCall {
                id,
                kind: "function".into(),
                function: FunctionCall {
                    name,
                    arguments: call.function.arguments,
                },
            }
        })
        .collect()
}

/// Parses a tool call's arguments: a JSON object (an empty string counts as `{}`).
fn parse_arguments(raw: &str) -> Result<Map<String, Value>, String> {
    if raw.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("the tool arguments must be a json object".into()),
        Err(e) => Err(format!("the tool arguments are not valid json: {e}")),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::chat::ModelReply;
    use roundtable_sandbox_protocol::compaction::{CompactReply, CompactRequest};
    use std::collections::VecDeque;

    /// A model that answers from a script and records every request.
    #[derive(Debug, Default)]
    pub(crate) struct ScriptedModel {
        pub replies: VecDeque<Result<ModelReply, ModelError>>,
        pub requests: Vec<ChatRequest>,
    }

    impl ScriptedModel {
        pub fn new(replies: Vec<Result<ModelReply, ModelError>>) -> Self {
            Self {
                replies: replies.into(),
                requests: Vec::new(),
            }
        }
    }

    impl Model for ScriptedModel {
        fn complete(&mut self, request: &ChatRequest) -> Result<ModelReply, ModelError> {
            self.requests.push(request.clone());
            self.replies
                .pop_front()
                .unwrap_or_else(|| Err(ModelError("script exhausted".into())))
        }

        fn compact(&mut self, request: &CompactRequest) -> Result<CompactReply, ModelError> {
            host_compact(self, request)
        }
    }

    /// What the host's compactor does without a summarizer (see src/broker/compact.rs),
    /// with `model` as the main model: the summary request, else the plain summary.
    pub(crate) fn host_compact<M: Model>(
        model: &mut M,
        request: &CompactRequest,
    ) -> Result<CompactReply, ModelError> {
        use roundtable_sandbox_protocol::compaction::{
            finish_summary, plain_summary, summary_messages, CompactSource,
        };
        let chat = ChatRequest {
            messages: summary_messages(request),
            tools: Vec::new(),
        };
        let outcome = model.complete(&chat);
        let mut usage = Usage {
            model_calls: 1,
            ..Usage::default()
        };
        if let Ok(reply) = &outcome {
            usage.prompt_tokens = reply.prompt_tokens;
            usage.completion_tokens = reply.completion_tokens;
        }
        let summary = outcome
            .ok()
            .and_then(|r| finish_summary(request, r.content.as_deref().unwrap_or("")));
        Ok(match summary {
            Some(summary) => CompactReply {
                summary,
                source: CompactSource::Model,
                usage,
            },
            None => CompactReply {
                summary: plain_summary(request),
                source: CompactSource::Plain,
                usage,
            },
        })
    }

    /// Tools that echo their arguments and record the calls.
    #[derive(Debug, Default)]
    pub(crate) struct EchoTools {
        pub calls: Vec<(String, Map<String, Value>)>,
    }

    impl Tools for EchoTools {
        fn definitions(&self) -> Vec<ToolDef> {
            vec![ToolDef {
                name: "echo".into(),
                description: "echo".into(),
                parameters: serde_json::json!({"type":"object"}),
            }]
        }

        fn call(&mut self, name: &str, args: &Map<String, Value>) -> Result<String, String> {
            self.calls.push((name.to_string(), args.clone()));
            match name {
                "echo" => Ok(format!("echo {}", Value::Object(args.clone()))),
                _ => Err(format!("unknown tool '{name}'")),
            }
        }
    }

    pub(crate) fn text(s: &str) -> Result<ModelReply, ModelError> {
        Ok(ModelReply {
            content: Some(s.into()),
            prompt_tokens: Some(10),
            completion_tokens: Some(2),
            ..ModelReply::default()
        })
    }

    pub(crate) fn calls(list: &[(&str, &str, &str)]) -> Result<ModelReply, ModelError> {
        Ok(ModelReply {
            content: None,
            tool_calls: list
                .iter()
                .map(|(id, name, args)| ToolCall {
                    id: (*id).into(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: (*name).into(),
                        arguments: (*args).into(),
                    },
                })
                .collect(),
            prompt_tokens: Some(5),
            completion_tokens: None,
        })
    }

    fn config() -> AgentLimits {
        AgentLimits::new(16, 1_000_000)
    }

    /// A turn of a fresh session with the default limits, its system prompt `sys`.
    fn first_turn(
        model: &mut ScriptedModel,
        tools: &mut EchoTools,
        user: &str,
    ) -> Result<Outcome, AgentError> {
        run_turn(
            model,
            tools,
            &config(),
            &Session::default(),
            "sys",
            user.into(),
        )
    }

    #[test]
    fn tool_call_then_result_then_final_answer() {
        let mut model =
            ScriptedModel::new(vec![calls(&[("c1", "echo", r#"{"x":1}"#)]), text("done")]);
        let mut tools = EchoTools::default();
        let out = first_turn(&mut model, &mut tools, "ann: hi").unwrap();
        assert_eq!(out.text, "done");
        assert_eq!(tools.calls.len(), 1);
        assert_eq!(tools.calls[0].0, "echo");
        assert_eq!(
            out.usage,
            Usage {
                model_calls: 2,
                tool_calls: 1,
                prompt_tokens: Some(15),
                completion_tokens: Some(2)
            }
        );
        // The second request carries the call and its result after the user message.
        let second = &model.requests[1].messages;
        assert_eq!(
            second[0],
            Message::System {
                content: "sys".into()
            }
        );
        assert_eq!(
            second[1],
            Message::User {
                content: "ann: hi".into()
            }
        );
        assert!(
            matches!(&second[2], Message::Assistant { tool_calls, .. } if tool_calls[0].id == "c1")
        );
        assert_eq!(
            second[3],
            Message::Tool {
                tool_call_id: "c1".into(),
                content: r#"echo {"x":1}"#.into()
            }
        );
        assert_eq!(model.requests[0].tools[0].name, "echo");
        assert_eq!(out.session.messages.len(), 4);
        crate::chat::validate_history(&out.session.messages).unwrap();
    }

    #[test]
    fn the_step_limit_ends_the_turn() {
        let looping: Vec<_> = (0..10)
            .map(|i| calls(&[(&format!("c{i}"), "echo", "{}")]))
            .collect();
        let mut model = ScriptedModel::new(looping);
        let mut tools = EchoTools::default();
        let out = run_turn(
            &mut model,
            &mut tools,
            &AgentLimits::new(3, 1_000_000),
            &Session::default(),
            "sys",
            "ann: loop".into(),
        )
        .unwrap();
        assert_eq!(model.requests.len(), 3);
        assert_eq!(tools.calls.len(), 3);
        assert!(out.text.contains("stopped after 3 steps"), "{}", out.text);
        assert_eq!(out.usage.model_calls, 3);
        crate::chat::validate_history(&out.session.messages).unwrap();
    }

    #[test]
    fn malformed_arguments_are_fed_back_as_error_results() {
        let mut model = ScriptedModel::new(vec![
            calls(&[
                ("c1", "echo", "{not json"),
                ("c2", "echo", "[1,2]"),
                ("c3", "nope", "{}"),
                ("c3", "echo", ""),
            ]),
            text("sorry"),
        ]);
        let mut tools = EchoTools::default();
        let out = first_turn(&mut model, &mut tools, "ann: x").unwrap();
        assert_eq!(out.text, "sorry");
        let results: Vec<&str> = out
            .session
            .messages
            .iter()
            .filter_map(|m| match m {
                Message::Tool { content, .. } => Some(content.as_str()),
                _ => None,
            })
            .collect();
        assert!(
            results[0].starts_with("error: the tool arguments are not valid json"),
            "{}",
            results[0]
        );
        assert_eq!(
            results[1],
            "error: the tool arguments must be a json object"
        );
        assert_eq!(results[2], "error: unknown tool 'nope'");
        assert_eq!(results[3], "echo {}");
        // The duplicate id was replaced, so the history stays sendable.
        crate::chat::validate_history(&out.session.messages).unwrap();
        assert_eq!(tools.calls.len(), 2);
        assert_eq!(out.usage.tool_calls, 4);
    }

    #[test]
    fn a_model_error_returns_an_error_and_no_session() {
        let before = Session {
            messages: vec![
                Message::User {
                    content: "ann: old".into(),
                },
                Message::Assistant {
                    content: Some("ok".into()),
                    tool_calls: vec![],
                },
            ],
            ..Session::default()
        };
        let mut model = ScriptedModel::new(vec![
            calls(&[("c1", "echo", "{}")]),
            Err(ModelError("broker answered 502: upstream down".into())),
        ]);
        let mut tools = EchoTools::default();
        let err = run_turn(
            &mut model,
            &mut tools,
            &config(),
            &before,
            "sys",
            "ann: new".into(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the model call failed: broker answered 502: upstream down"
        );
        // The first request carried the earlier history.
        assert_eq!(model.requests[0].messages.len(), 4);
    }

    #[test]
    fn an_empty_answer_becomes_no_answer() {
        let mut model = ScriptedModel::new(vec![text("  ")]);
        let out = run_turn(
            &mut model,
            &mut EchoTools::default(),
            &config(),
            &Session::default(),
            "s",
            "a: b".into(),
        )
        .unwrap();
        assert_eq!(out.text, NO_ANSWER);
    }

    #[test]
    fn tool_results_are_capped() {
        struct Big;
        impl Tools for Big {
            fn definitions(&self) -> Vec<ToolDef> {
                Vec::new()
            }
            fn call(&mut self, _: &str, _: &Map<String, Value>) -> Result<String, String> {
                Ok("z".repeat(1 << 20))
            }
        }
        let mut model = ScriptedModel::new(vec![calls(&[("c1", "big", "{}")]), text("ok")]);
        let cfg = config();
        let out = run_turn(
            &mut model,
            &mut Big,
            &cfg,
            &Session::default(),
            "s",
            "a: b".into(),
        )
        .unwrap();
        let Message::Tool { content, .. } = &out.session.messages[2] else {
            panic!()
        };
        assert!(content.len() < cfg.tool_result_cap + 100);
    }
}
