//! Compaction on the guest's side: when the conversation outgrows its token budget, the
//! older part is handed to the broker's compactor (`POST /v1/compact`) and only the recent
//! messages stay verbatim.
//!
//! The summary rules of pi-roundtable-sandbox 0.7.18 (its core's, from pi-roundtable
//! 0.7.16: the previous summary once, a rule-keeping goal, a reload list) are defined once,
//! in `roundtable_sandbox_protocol::compaction`; the host builds the summary request from
//! them and runs it through its configured summarizer or the main model,
//! falling back to the plain summary itself (and logging each fallback). Only when the
//! broker cannot be asked at all (unreachable, refused, a malformed answer) does the guest
//! build the same plain summary here; the reason goes to stderr with the tokens before.

pub use roundtable_sandbox_protocol::compaction::SUMMARY_HEADER;
use roundtable_sandbox_protocol::compaction::{
    plain_summary, CompactRequest, CompactSource, SummaryLimits,
};

use crate::chat::{cap_text, Message};
use crate::model::{Meter, Model};
use crate::session::Session;

/// The summary as it is placed in a request, just after the system prompt.
pub fn summary_message(summary: &str) -> Message {
    Message::User {
        content: format!("{SUMMARY_HEADER}\n\n{summary}"),
    }
}

/// A message's size in estimated tokens.
fn tokens(message: &Message) -> u64 {
    (serde_json::to_string(message).map_or(0, |s| s.len()) as u64).div_ceil(4)
}

/// Compacts `session` so a request fits in `budget` tokens, given the `overhead` of the
/// system prompt and tool definitions. Returns whether anything was compacted.
pub fn compact<M: Model>(
    model: &mut M,
    meter: &mut Meter,
    session: &mut Session,
    budget: u64,
    overhead: u64,
    tokens_before: u64,
) -> bool {
    let limits = SummaryLimits::for_budget(budget);
    let header = (SUMMARY_HEADER.len() as u64).div_ceil(4) + 16;
    let room = budget.saturating_sub(overhead + limits.tokens + header);
    let split = split_point(&session.messages, room / 2);
    if split == 0 {
        return false;
    }
    let request = CompactRequest::new(
        session.summary.as_deref(),
        &session.messages[..split],
        tokens_before,
        budget,
    );
    let summary = match model.compact(&request) {
        Ok(reply) if !reply.summary.trim().is_empty() => {
            meter.add(&reply.usage);
            if reply.source == CompactSource::Plain {
                log(&format!(
                    "the broker fell back to a plain summary (tokensBefore {tokens_before})"
                ));
            }
            cap_text(reply.summary.trim(), limits.bytes)
        }
        outcome => {
            let reason = match outcome {
                Err(e) => {
                    meter.model_call(None);
                    e.to_string()
                }
                Ok(reply) => {
                    meter.add(&reply.usage);
                    "the broker's summary was empty".to_string()
                }
            };
            log(&format!(
                "compaction fell back to a plain summary: {reason} (tokensBefore {tokens_before})"
            ));
            plain_summary(&request)
        }
    };
    session.messages.drain(..split);
    session.summary = Some(summary);
    session.compactions = session.compactions.saturating_add(1);
    true
}

fn log(message: &str) {
    eprintln!("roundtable-guest: {message}");
}

/// Where the verbatim tail starts: as many recent messages as fit in `keep` tokens, moved
/// so the tail never starts with a tool result, and never dropping the last message (or
/// the tool calls it answers).
fn split_point(messages: &[Message], keep: u64) -> usize {
    let mut split = messages.len();
    let mut used = 0u64;
    while split > 0 {
        let t = tokens(&messages[split - 1]);
        if used + t > keep {
            break;
        }
        used += t;
        split -= 1;
    }
    while split < messages.len() && matches!(messages[split], Message::Tool { .. }) {
        split += 1;
    }
    // The tail keeps at least the last message, with the tool calls a tool result answers.
    let minimal = match messages.last() {
        None => 0,
        Some(Message::Tool { .. }) => messages
            .iter()
            .rposition(
                |m| matches!(m, Message::Assistant { tool_calls, .. } if !tool_calls.is_empty()),
            )
            .unwrap_or(0),
        Some(_) => messages.len() - 1,
    };
    split.min(minimal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::tests::{calls, text, EchoTools, ScriptedModel};
    use crate::agent::{run_turn, AgentLimits, Tools};
    use crate::model::ModelError;

    /// A turn of `session` with a token budget of `budget`, its system prompt `sys`.
    fn turn_within(
        model: &mut impl crate::model::Model,
        tools: &mut EchoTools,
        session: &Session,
        budget: u64,
        user: &str,
    ) -> crate::agent::Outcome {
        run_turn(
            model,
            tools,
            &AgentLimits::new(16, budget),
            session,
            "sys",
            user.into(),
        )
        .unwrap()
    }

    fn history() -> Session {
        let mut messages = Vec::new();
        messages.push(Message::User {
            content: "ann: RULE-ALPHA: always answer in French".into(),
        });
        messages.push(Message::Assistant {
            content: Some("d'accord".into()),
            tool_calls: vec![],
        });
        for i in 0..12 {
            messages.push(Message::User {
                content: format!("bob: please note item {i} {}", "lorem ipsum ".repeat(40)),
            });
            messages.push(Message::Assistant {
                content: None,
                tool_calls: vec![crate::chat::ToolCall {
                    id: format!("w{i}"),
                    kind: "function".into(),
                    function: crate::chat::FunctionCall {
                        name: "write".into(),
                        arguments: format!(r#"{{"path":"notes/item{i}.txt","content":"x"}}"#),
                    },
                }],
            });
            messages.push(Message::Tool {
                tool_call_id: format!("w{i}"),
                content: "wrote 1 bytes".into(),
            });
            messages.push(Message::Assistant {
                content: Some(format!("noted {i}")),
                tool_calls: vec![],
            });
        }
        Session {
            summary: Some(
                "PREVIOUS-SUMMARY-MARKER: ann set RULE-ALPHA.\n\nFiles to reload:\n- rules.md\n"
                    .into(),
            ),
            messages,
            ..Session::default()
        }
    }

    #[test]
    fn the_summary_request_follows_the_rules_and_the_next_request_fits() {
        let budget = 2000;
        let session = history();
        let mut model = ScriptedModel::new(vec![
            text("ann set RULE-ALPHA (answer in French). bob noted items 0-11.\n\nFiles to reload:\n- rules.md\n- notes/item11.txt"),
            text("c'est fait"),
        ]);
        let mut tools = EchoTools::default();
        let before =
            crate::agent::build_request("sys", &session, &tools.definitions()).estimate_tokens();
        assert!(before > budget);
        let out = turn_within(&mut model, &mut tools, &session, budget, "ann: and now?");
        assert_eq!(out.text, "c'est fait");
        assert_eq!(model.requests.len(), 2);
        let summary_request = serde_json::to_string(&model.requests[0].to_wire("m")).unwrap();
        assert_eq!(
            summary_request.matches("PREVIOUS-SUMMARY-MARKER").count(),
            1,
            "{summary_request}"
        );
        assert!(summary_request.contains("standing rule"));
        assert!(summary_request.contains("Files to reload:"));
        assert!(
            summary_request.contains("- notes/item"),
            "{summary_request}"
        );
        assert!(summary_request.contains("- rules.md"));
        assert!(model.requests[0].tools.is_empty());
        // The next model request carries the new summary (not the old one) and fits.
        let next = &model.requests[1];
        assert!(
            next.estimate_tokens() <= budget,
            "{} > {budget}",
            next.estimate_tokens()
        );
        let next_json = serde_json::to_string(&next.to_wire("m")).unwrap();
        assert!(!next_json.contains("PREVIOUS-SUMMARY-MARKER"));
        assert!(next_json.contains("bob noted items 0-11"));
        assert!(next_json.contains("ann: and now?"));
        assert_eq!(out.session.compactions, 1);
        assert_eq!(out.usage.model_calls, 2);
        crate::chat::validate_history(&out.session.messages).unwrap();
        // Recent messages stay verbatim.
        assert!(out.session.messages.len() < session.messages.len());
        let tail = &session.messages[session.messages.len() - 2..];
        assert!(out.session.messages.windows(2).any(|w| w == tail));
    }

    #[test]
    fn a_failed_summary_falls_back_to_a_plain_summary() {
        let budget = 2000;
        let session = history();
        let mut model = ScriptedModel::new(vec![
            Err(ModelError(
                "broker answered 429: too many model calls".into(),
            )),
            text("ok"),
        ]);
        let mut tools = EchoTools::default();
        let out = turn_within(&mut model, &mut tools, &session, budget, "ann: hi");
        assert_eq!(out.text, "ok");
        let summary = out.session.summary.as_deref().unwrap();
        assert!(summary.starts_with("Plain summary"), "{summary}");
        assert!(summary.contains("PREVIOUS-SUMMARY-MARKER"), "{summary}");
        assert!(
            summary.contains("Files to reload:\n- notes/item"),
            "{summary}"
        );
        assert!(summary.contains("- rules.md"), "{summary}");
        assert!(model.requests[1].estimate_tokens() <= budget);
        assert_eq!(out.usage.model_calls, 2);
    }

    /// A broker whose compaction route cannot be reached.
    struct NoCompactor(ScriptedModel);

    impl Model for NoCompactor {
        fn complete(
            &mut self,
            request: &crate::chat::ChatRequest,
        ) -> Result<crate::chat::ModelReply, ModelError> {
            self.0.complete(request)
        }

        fn compact(
            &mut self,
            _: &CompactRequest,
        ) -> Result<roundtable_sandbox_protocol::compaction::CompactReply, ModelError> {
            Err(ModelError(
                "broker answered 413: request body too large".into(),
            ))
        }
    }

    #[test]
    fn a_broker_that_cannot_compact_leaves_the_plain_summary_to_the_guest() {
        let budget = 2000;
        let session = history();
        let mut model = NoCompactor(ScriptedModel::new(vec![text("ok")]));
        let out = turn_within(
            &mut model,
            &mut EchoTools::default(),
            &session,
            budget,
            "ann: hi",
        );
        assert_eq!(out.text, "ok");
        let summary = out.session.summary.as_deref().unwrap();
        assert!(summary.starts_with("Plain summary"), "{summary}");
        assert!(summary.contains("PREVIOUS-SUMMARY-MARKER"), "{summary}");
        assert!(summary.contains("- rules.md"), "{summary}");
        // Only the answer went to the model; the failed compaction counts as a call.
        assert_eq!(model.0.requests.len(), 1);
        assert_eq!(out.usage.model_calls, 2);
        assert!(model.0.requests[0].estimate_tokens() <= budget);
    }

    #[test]
    fn the_split_never_orphans_tool_results() {
        let session = history();
        for keep in [0, 10, 50, 100, 300, 1000, 100_000] {
            let split = split_point(&session.messages, keep);
            let tail = &session.messages[split..];
            crate::chat::validate_history(tail).unwrap();
            assert!(split < session.messages.len());
        }
        let mut pending = history().messages;
        pending.push(Message::Assistant {
            content: None,
            tool_calls: vec![crate::chat::ToolCall {
                id: "z".into(),
                kind: "function".into(),
                function: crate::chat::FunctionCall {
                    name: "read".into(),
                    arguments: "{}".into(),
                },
            }],
        });
        pending.push(Message::Tool {
            tool_call_id: "z".into(),
            content: "x".repeat(10_000),
        });
        let split = split_point(&pending, 10);
        assert_eq!(split, pending.len() - 2);
    }

    #[test]
    fn tool_use_during_a_long_turn_triggers_compaction_too() {
        let budget = 1500;
        let mut model = ScriptedModel::new(vec![
            calls(&[("a", "echo", &format!(r#"{{"t":"{}"}}"#, "y".repeat(3000)))]),
            text("summary text"),
            text("final"),
        ]);
        let mut tools = EchoTools::default();
        let mut session = Session::default();
        for i in 0..4 {
            session.messages.push(Message::User {
                content: format!("ann: {i} {}", "q".repeat(300)),
            });
            session.messages.push(Message::Assistant {
                content: Some("a".repeat(300)),
                tool_calls: vec![],
            });
        }
        let out = run_turn(
            &mut model,
            &mut tools,
            &AgentLimits::new(16, budget),
            &session,
            "s",
            "ann: go".into(),
        )
        .unwrap();
        assert_eq!(out.text, "final");
        assert_eq!(out.session.compactions, 1);
        crate::chat::validate_history(&out.session.messages).unwrap();
    }
}
