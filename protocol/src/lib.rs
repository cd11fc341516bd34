//! Wire types shared by the host runtime and the guest program.
//!
//! This crate is the whole contract across the container boundary:
//! - [`Turn`]: what the host writes, as one JSON document, on the guest's stdin;
//! - [`Reply`]: what the guest prints on its stdout, as one framed JSON document: one
//!   line, newline-terminated ([`Reply::frame`], [`REPLY_FRAME_END`]), the guest's last act
//!   (after its session is saved); the host answers the moment the frame is complete;
//! - the broker's HTTP surface ([`paths`], [`ToolCallResult`], [`ErrorBody`]) that the
//!   guest reaches through the unix socket mounted at [`BROKER_SOCKET`];
//! - [`chat`]: the chat messages the guest stores and sends;
//! - [`compaction`]: the compaction request and reply (`POST /v1/compact`) and the one
//!   definition of the summary rules, used by the guest and by the host's compactor;
//! - [`text`]: the text caps and cleaning both sides apply;
//! - [`parse_reply`] ([`frame`]): the strict parse of a reply the host applies, with its
//!   [`ReplyError`] and the [`GUEST_ERROR_PREFIX`] a guest's own failure carries;
//! - [`held`]: the one line the guest prints when the host asks it, inside a sandbox, for
//!   the files the turn's processes hold open after deleting them (`--held-files`).
//!
//! Nothing here holds a secret or a host path: a [`Turn`] is safe to show to the guest.
//! Every type denies unknown fields, because the other side of this boundary is hostile.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use serde::{Deserialize, Serialize};

pub use frame::{parse_reply, ReplyError, GUEST_ERROR_PREFIX};

pub mod chat;
pub mod compaction;
pub mod egress;
pub mod frame;
pub mod held;
pub mod text;

/// Where the turn's run dir (holding only `broker.sock`) is mounted, read-only.
pub const RUN_MOUNT: &str = "/run/roundtable";
/// The broker's socket inside the container.
pub const BROKER_SOCKET: &str = "/run/roundtable/broker.sock";
/// Where the channel's workspace is mounted, read-write.
pub const WORKSPACE_MOUNT: &str = "/workspace";
/// The default number of model steps in one turn.
pub const DEFAULT_MAX_STEPS: u32 = 16;

/// The person who wrote the message, as admitted by the host with that message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Speaker {
    /// The chat platform's id of the person.
    pub id: String,
    /// Their display name.
    pub name: String,
}

/// A tool the guest may call: its name, description and JSON-schema parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    /// The tool's name (unique among the turn's tools).
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// Its parameters as a JSON schema.
    pub parameters: serde_json::Value,
}

/// The allow-listed tools of one MCP server, with the schemas pinned by the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerSpec {
    /// The server's name, as the operator configured it.
    pub server: String,
    /// Its allow-listed tools.
    pub tools: Vec<ToolSpec>,
}

/// One turn, written by the host on the guest's stdin. Never the key, never a host path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Turn {
    /// The guest's message.
    pub text: String,
    /// Who wrote it.
    pub speaker: Speaker,
    /// The model's name (the broker holds its url and key).
    pub model: String,
    /// The system prompt.
    pub prompt: String,
    /// The time zone the guest shows times in (an IANA name).
    pub time_zone: String,
    /// Start a fresh session (the channel's history is dropped).
    pub reset: bool,
    /// The host tools the guest may call through the broker.
    pub tools: Vec<ToolSpec>,
    /// The MCP servers' allow-listed tools.
    pub mcp: Vec<McpServerSpec>,
    /// The web routes the broker serves for this turn (none: no `fetch` tool).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<egress::RouteSpec>,
    /// Model steps in this turn; `None`: [`DEFAULT_MAX_STEPS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u32>,
    /// The session's compaction budget in estimated tokens; `None` lets the guest choose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_budget: Option<u64>,
}

/// What a turn used, **as the guest claims it**: written by the guest, so a hostile or
/// broken guest can put anything here (an outside review saw the upstream get 18 calls
/// while a reply said 2). The host counts for itself (`TurnOutcome::usage` in the core,
/// from the upstream's own answers); budgets and accounting never read this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Usage {
    /// Model calls made.
    #[serde(default)]
    pub model_calls: u32,
    /// Tool calls made.
    #[serde(default)]
    pub tool_calls: u32,
    /// Prompt tokens, as the model reported them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// Completion tokens, as the model reported them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
}

/// What ends a reply's frame on the guest's stdout (see [`Reply::frame`]).
pub const REPLY_FRAME_END: u8 = b'\n';

/// The guest's answer, printed as one JSON document on stdout.
///
/// On the wire: `{"ok":true,"text":"…","usage":{…}}` or `{"ok":false,"error":"…"}`, framed
/// ([`Reply::frame`]): the JSON on one line, then [`REPLY_FRAME_END`]. Stdout's first line,
/// when it is a whole valid reply, *is* the reply: the host answers with it at once and no
/// longer reads the guest's output nor waits for its exit (whatever the exit status, a kill,
/// or what the guest prints after it). Without that first line (a reply with no newline, or
/// a first line that is not a reply), the host judges the run at its end as before: the exit
/// status, then all of stdout as exactly one document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    /// Whether the turn succeeded.
    pub ok: bool,
    /// The answer (when `ok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Why it failed (when not `ok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What the turn used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl Reply {
    /// A successful reply.
    pub fn text(text: impl Into<String>, usage: Usage) -> Self {
        Self {
            ok: true,
            text: Some(text.into()),
            error: None,
            usage: Some(usage),
        }
    }

    /// A failed reply.
    pub fn error(error: impl Into<String>) -> Self {
        Self {
            ok: false,
            text: None,
            error: Some(error.into()),
            usage: None,
        }
    }

    /// The reply's frame on stdout: its compact JSON (which never holds a raw newline: one
    /// in a string is escaped) and [`REPLY_FRAME_END`].
    pub fn frame(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec(self)
            .unwrap_or_else(|_| br#"{"ok":false,"error":"cannot encode the reply"}"#.to_vec());
        out.push(REPLY_FRAME_END);
        out
    }

    /// Checks the shape a well-formed reply must have: `ok` with `text`, or not `ok` with `error`.
    pub fn check_shape(&self) -> Result<(), &'static str> {
        match (self.ok, &self.text, &self.error) {
            (true, Some(_), None) => Ok(()),
            (true, _, _) => Err("an ok reply must carry text and no error"),
            (false, None, Some(_)) => Ok(()),
            (false, _, _) => Err("a failed reply must carry an error and no text"),
        }
    }
}

/// The broker's HTTP paths, relative to the unix socket.
pub mod paths {
    /// OpenAI-compatible chat completions, forwarded to the configured model.
    pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
    /// `POST /v1/tools/{name}` with the arguments object as the body.
    pub const TOOLS_PREFIX: &str = "/v1/tools/";
    /// `POST /v1/mcp/{server}/{tool}` with the arguments object as the body.
    pub const MCP_PREFIX: &str = "/v1/mcp/";
    /// `POST /v1/compact` with a [`crate::compaction::CompactRequest`]; `200` with a
    /// [`crate::compaction::CompactReply`].
    pub const COMPACT: &str = "/v1/compact";
    /// `{METHOD} /v1/egress/{route}/{target}`: a web request through an operator's route
    /// (see [`crate::egress`]).
    pub const EGRESS_PREFIX: &str = "/v1/egress/";
}

/// The guest's built-in tools, by name: defined once here for the guest (which runs
/// them), the host's broker policy (a host tool may not take one of these names) and the
/// embedded offline model (which calls them).
pub mod builtin_tools {
    /// Read a workspace file.
    pub const READ: &str = "read";
    /// Create or overwrite a workspace file.
    pub const WRITE: &str = "write";
    /// Replace one occurrence of a text in a workspace file.
    pub const EDIT: &str = "edit";
    /// List a workspace directory.
    pub const LIST: &str = "list";
    /// Run a shell command in the workspace.
    pub const SH: &str = "sh";
    /// A web request through one of the operator's egress routes (offered only when the
    /// turn has routes).
    pub const FETCH: &str = "fetch";
    /// Every built-in, in the order the guest offers them.
    pub const ALL: [&str; 6] = [READ, WRITE, EDIT, LIST, SH, FETCH];
}

/// The broker's answer to a host or MCP tool call (HTTP 200).
///
/// `ok: false` means the tool ran and failed; its `error` is readable and carries no host
/// internals. Requests the broker refuses get a 4xx status with an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallResult {
    /// Whether the tool succeeded.
    pub ok: bool,
    /// Its output (when `ok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Why it failed (when not `ok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The body of every 4xx/5xx answer from the broker: `{"error":"…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// What was refused, readable by the guest.
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_round_trips_in_camel_case() {
        let turn = Turn {
            text: "hi".into(),
            speaker: Speaker {
                id: "1".into(),
                name: "ann".into(),
            },
            model: "m".into(),
            prompt: "p".into(),
            time_zone: "UTC".into(),
            reset: true,
            tools: vec![],
            mcp: vec![],
            egress: vec![],
            max_steps: None,
            session_budget: None,
        };
        let json = serde_json::to_string(&turn).unwrap();
        assert!(json.contains("\"timeZone\":\"UTC\""), "{json}");
        assert_eq!(serde_json::from_str::<Turn>(&json).unwrap(), turn);
    }

    #[test]
    fn reply_rejects_unknown_fields_and_bad_shapes() {
        assert!(serde_json::from_str::<Reply>(r#"{"ok":true,"text":"x","host":1}"#).is_err());
        let r: Reply = serde_json::from_str(r#"{"ok":true,"error":"x"}"#).unwrap();
        assert_eq!(
            r.check_shape(),
            Err("an ok reply must carry text and no error")
        );
        let r: Reply = serde_json::from_str(r#"{"ok":false,"error":"x"}"#).unwrap();
        assert_eq!(r.check_shape(), Ok(()));
    }

    /// A frame is one line: a newline in the text is escaped, the frame's end is its only one.
    #[test]
    fn a_reply_frame_is_one_line() {
        let frame = Reply::text("two\nlines", Usage::default()).frame();
        assert_eq!(frame.iter().filter(|b| **b == REPLY_FRAME_END).count(), 1);
        assert_eq!(frame.last(), Some(&REPLY_FRAME_END));
        assert_eq!(
            String::from_utf8(frame).unwrap(),
            "{\"ok\":true,\"text\":\"two\\nlines\",\"usage\":{\"modelCalls\":0,\"toolCalls\":0}}\n"
        );
    }
}
