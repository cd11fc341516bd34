//! What the MCP client writes and the typed shapes it reads (JSON-RPC 2.0, MCP
//! 2025-06-18). A message from a server is read in one pass, off the async threads,
//! through the bounded reader ([`crate::broker::bounded`]): its values counted first, then
//! its envelope (`id`, `method`, `result`, `error`; `params` and every other field
//! skipped unread), then its `result` into the shape the request expects. Only what the
//! broker forwards is kept: a tool result's text blocks (other blocks, and structured
//! content when there is no text, as their JSON text, never as a tree) and whether it is an
//! error; the listed tools' names, descriptions and input schemas (the one tree built,
//! pinned at startup); the negotiated protocol version. `_meta`, annotations, output
//! schemas, notifications' params are never built.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::broker::bounded::{self, Caps, ReadError};

/// The protocol version the client asks for.
pub(crate) const PROTOCOL_VERSION: &str = "2025-06-18";
/// The versions it accepts in a server's answer.
const KNOWN_VERSIONS: &[&str] = &["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];
/// The JSON-RPC error code of a method the client does not serve.
const METHOD_NOT_FOUND: i64 = -32601;

/// A request's bytes, newline-terminated (stdio's framing; HTTP sends them as the body).
pub(crate) fn request(id: u64, method: &str, params: &serde_json::Value) -> Vec<u8> {
    line(&serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
}

/// A notification's bytes.
pub(crate) fn notification(method: &str, params: &serde_json::Value) -> Vec<u8> {
    line(&serde_json::json!({"jsonrpc": "2.0", "method": method, "params": params}))
}

/// The longest request id of a server's that is answered (its JSON text, in bytes).
const MAX_ID: usize = 128;

/// The answer to a server's request: `{}` to a `ping`, "method not found" to anything
/// else (the client declares no capability: no sampling, roots or elicitation). `None`
/// for an id that is no JSON-RPC id (a string or a number) or is longer than [`MAX_ID`]:
/// not answered (any JSON was built into a tree here, on a runtime thread, and sent back,
/// up to the message cap).
pub(crate) fn answer(id: &RawValue, method: &str) -> Option<Vec<u8>> {
    let id = id.get();
    let valid = id.len() <= MAX_ID
        && (id.starts_with('"')
            || id.starts_with('-')
            || id.starts_with(|c: char| c.is_ascii_digit()));
    if !valid {
        return None;
    }
    // The id's own JSON text (checked by the parse that read it), echoed as it came.
    let mut out = if method == "ping" {
        format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{}}}}"#)
    } else {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":{METHOD_NOT_FOUND},"message":"method not found"}}}}"#
        )
    }
    .into_bytes();
    out.push(b'\n');
    Some(out)
}

/// The `initialize` request's params.
pub(crate) fn initialize_params() -> serde_json::Value {
    serde_json::json!({
        "protocolVersion": PROTOCOL_VERSION,
        "capabilities": {},
        "clientInfo": {"name": "roundtable-sandbox", "version": env!("CARGO_PKG_VERSION")},
    })
}

fn line(value: &serde_json::Value) -> Vec<u8> {
    let mut out = serde_json::to_vec(value).expect("serialisable");
    out.push(b'\n');
    out
}

/// What a request's answer is read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// `initialize`: the protocol version.
    Initialize,
    /// `tools/list`: one page of tools.
    Tools,
    /// `tools/call`: the tool's result.
    Call,
}

/// A request's answer, typed.
#[derive(Debug)]
pub(crate) enum Payload {
    /// The protocol version the server chose.
    Initialized(String),
    /// One page of tools.
    Tools(ToolPage),
    /// A tool's result.
    Called(CallResult),
}

/// One page of `tools/list`.
#[derive(Debug, Deserialize)]
pub(crate) struct ToolPage {
    /// The tools of the page.
    pub(crate) tools: Vec<Tool>,
    /// The cursor of the next page.
    #[serde(default, rename = "nextCursor")]
    pub(crate) next_cursor: Option<String>,
}

/// A listed tool: what is pinned of it.
#[derive(Debug, Deserialize)]
pub(crate) struct Tool {
    /// Its name.
    pub(crate) name: String,
    /// Its description.
    #[serde(default)]
    pub(crate) description: Option<String>,
    /// Its input schema, as its text: parsed into a tree only for a tool the server's
    /// `tools` allow, within [`SCHEMA_CAPS`] (every listed tool's tree was built: a page of
    /// `{"":0}` objects within the message's caps was ~21 MB, 16 pages a listing).
    #[serde(rename = "inputSchema")]
    pub(crate) input_schema: Box<serde_json::value::RawValue>,
}

/// The caps on an allowed tool's input schema (its bytes and JSON values): far above a
/// real tool's (a few hundred values), and a tree of a few MiB at most.
pub(crate) const SCHEMA_CAPS: Caps = Caps {
    bytes: 64 * 1024,
    values: 16_384,
};

impl ToolPage {
    /// The page's tools of `wanted` by name: (description, input schema); the others are
    /// dropped unread.
    pub(crate) fn into_map(
        self,
        wanted: &[String],
    ) -> Result<BTreeMap<String, (String, serde_json::Value)>, ReadError> {
        let mut out = BTreeMap::new();
        for t in self.tools {
            if !wanted.contains(&t.name) {
                continue;
            }
            let raw = t.input_schema.get();
            bounded::check(raw.as_bytes(), SCHEMA_CAPS)?;
            let schema: serde_json::Map<String, serde_json::Value> = serde_json::from_str(raw)
                .map_err(|e| bounded::shape("an input schema (an object)", &e))?;
            out.insert(
                t.name,
                (
                    t.description.unwrap_or_default(),
                    serde_json::Value::Object(schema),
                ),
            );
        }
        Ok(out)
    }
}

/// A tool's result as the broker forwards it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct CallResult {
    /// Its text: text blocks joined by newlines, other blocks as their JSON text; the
    /// structured content's JSON text when there is no block.
    pub(crate) text: String,
    /// The server marked it an error.
    pub(crate) is_error: bool,
}

/// The wire shape of a tool's result: blocks kept as raw JSON text until each is read.
#[derive(Deserialize)]
struct CallWire<'a> {
    #[serde(default, borrow)]
    content: Vec<&'a RawValue>,
    #[serde(default, rename = "structuredContent", borrow)]
    structured: Option<&'a RawValue>,
    #[serde(default, rename = "isError")]
    is_error: Option<bool>,
}

/// What is read of a content block to tell a text block.
#[derive(Deserialize)]
struct BlockHead<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct InitializeWire {
    #[serde(rename = "protocolVersion")]
    protocol_version: String,
}

/// A JSON-RPC error object: its code and message (its `data` skipped).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(crate) struct RpcError {
    /// The code.
    pub(crate) code: i64,
    /// The message.
    #[serde(default)]
    pub(crate) message: String,
}

/// The envelope of any message; `params` and unknown fields skipped unread.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(default, borrow)]
    id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    method: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    result: Option<&'a RawValue>,
    #[serde(default)]
    error: Option<RpcError>,
}

/// A message from a server, read.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// The answer to the client's request `id`.
    Answer {
        /// The request.
        id: u64,
        /// Its result or error (or why its result is not the shape expected).
        outcome: Result<Payload, AnswerError>,
    },
    /// A request of the server's (answered by [`answer`]).
    Request {
        /// Its id, as sent.
        id: Box<RawValue>,
        /// Its method.
        method: String,
    },
    /// A notification, or an answer to no request of the client's: dropped.
    Other,
}

/// Why an answer is not a result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AnswerError {
    /// The server answered with a JSON-RPC error.
    #[error("{}", .0.message)]
    Rpc(RpcError),
    /// The result is not the shape the request expects.
    #[error("its answer is {0}")]
    Shape(ReadError),
    /// The server chose a protocol version the client does not speak.
    #[error("it chose protocol version {0:?}, which this client does not speak")]
    Version(String),
}

/// Reads one message from a server (blocking: the caller is off the async threads, see
/// [`read`]). `expect` tells what the client's request `id` expects, `None` when it is no
/// request in flight. Past `caps` the message is refused unread.
pub(crate) fn read_now(
    bytes: &[u8],
    caps: Caps,
    expect: impl FnOnce(u64) -> Option<Expect>,
) -> Result<Incoming, ReadError> {
    bounded::check(bytes, caps)?;
    let envelope: Envelope<'_> =
        serde_json::from_slice(bytes).map_err(|e| bounded::shape("a JSON-RPC message", &e))?;
    let Some(id) = envelope.id else {
        return Ok(Incoming::Other);
    };
    if let Some(method) = envelope.method {
        return Ok(Incoming::Request {
            id: id.to_owned(),
            method: method.chars().take(64).collect(),
        });
    }
    let Some(id) = serde_json::from_str::<u64>(id.get()).ok() else {
        return Ok(Incoming::Other);
    };
    let Some(kind) = expect(id) else {
        return Ok(Incoming::Other);
    };
    let outcome = match (envelope.error, envelope.result) {
        (Some(e), _) => Err(AnswerError::Rpc(e)),
        (None, None) => Err(AnswerError::Shape(ReadError::Shape {
            what: "a JSON-RPC answer",
            detail: "it has neither a result nor an error".into(),
        })),
        (None, Some(result)) => typed(result.get().as_bytes(), kind),
    };
    Ok(Incoming::Answer { id, outcome })
}

/// [`read_now`] on a blocking thread, where the bytes are dropped too.
pub(crate) async fn read(
    bytes: Vec<u8>,
    caps: Caps,
    expect: impl FnOnce(u64) -> Option<Expect> + Send + 'static,
) -> Result<Incoming, ReadError> {
    bounded::off_thread(move || read_now(&bytes, caps, expect)).await
}

/// A result read as `kind` expects.
fn typed(result: &[u8], kind: Expect) -> Result<Payload, AnswerError> {
    let shape =
        |what: &'static str, e: serde_json::Error| AnswerError::Shape(bounded::shape(what, &e));
    match kind {
        Expect::Initialize => {
            let wire: InitializeWire =
                serde_json::from_slice(result).map_err(|e| shape("an initialize result", e))?;
            if !KNOWN_VERSIONS.contains(&wire.protocol_version.as_str()) {
                let shown: String = wire.protocol_version.chars().take(32).collect();
                return Err(AnswerError::Version(shown));
            }
            Ok(Payload::Initialized(wire.protocol_version))
        }
        Expect::Tools => serde_json::from_slice(result)
            .map(Payload::Tools)
            .map_err(|e| shape("a tool list", e)),
        Expect::Call => {
            let wire: CallWire<'_> =
                serde_json::from_slice(result).map_err(|e| shape("a tool result", e))?;
            let mut parts = Vec::with_capacity(wire.content.len());
            for block in wire.content {
                let head: BlockHead<'_> =
                    serde_json::from_str(block.get()).map_err(|e| shape("a content block", e))?;
                match head {
                    BlockHead {
                        kind,
                        text: Some(text),
                    } if kind == "text" => parts.push(text),
                    _ => parts.push(block.get().to_owned()),
                }
            }
            if parts.is_empty() {
                if let Some(s) = wire.structured {
                    parts.push(s.get().to_owned());
                }
            }
            Ok(Payload::Called(CallResult {
                text: parts.join("\n"),
                is_error: wire.is_error == Some(true),
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: Caps = Caps {
        bytes: 1 << 20,
        values: 1000,
    };

    fn answer_of(raw: &str, kind: Expect) -> Result<Payload, AnswerError> {
        match read_now(raw.as_bytes(), CAPS, |id| (id == 7).then_some(kind)).unwrap() {
            Incoming::Answer { id: 7, outcome } => outcome,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tool_result_keeps_only_what_is_forwarded() {
        let raw = r#"{"jsonrpc":"2.0","id":7,"result":{"_meta":{"x":[1,2,3]},
            "content":[{"type":"text","text":"a","annotations":{}},{"type":"image","data":"QQ==","mimeType":"image/png"},{"type":"text","text":"b"}],
            "structuredContent":{"ignored":"there is text"},"isError":false}}"#;
        let Payload::Called(r) = answer_of(raw, Expect::Call).unwrap() else {
            panic!()
        };
        assert_eq!(
            r.text,
            "a\n{\"type\":\"image\",\"data\":\"QQ==\",\"mimeType\":\"image/png\"}\nb"
        );
        assert!(!r.is_error);
        // Structured content only when there is no block.
        let raw = r#"{"id":7,"result":{"content":[],"structuredContent":{"n":1},"isError":true}}"#;
        let Payload::Called(r) = answer_of(raw, Expect::Call).unwrap() else {
            panic!()
        };
        assert_eq!((r.text.as_str(), r.is_error), ("{\"n\":1}", true));
    }

    #[test]
    fn errors_requests_and_notifications_are_told_apart() {
        let raw =
            r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"bad","data":{"big":[]}}}"#;
        assert_eq!(
            answer_of(raw, Expect::Call).unwrap_err(),
            AnswerError::Rpc(RpcError {
                code: -32602,
                message: "bad".into()
            })
        );
        let got = read_now(br#"{"id":"s1","method":"ping"}"#, CAPS, |_| None).unwrap();
        assert!(matches!(got, Incoming::Request { ref method, .. } if method == "ping"));
        let Incoming::Request { id, method } = got else {
            panic!()
        };
        assert_eq!(
            answer(&id, &method),
            Some(b"{\"jsonrpc\":\"2.0\",\"id\":\"s1\",\"result\":{}}\n".to_vec())
        );
        // A number is echoed; an id that is no JSON-RPC id (an array, an object, a long
        // string) is not answered (it was built into a tree and sent back).
        let asked = |raw: &str| {
            let Ok(Incoming::Request { id, method }) = read_now(raw.as_bytes(), CAPS, |_| None)
            else {
                panic!("{raw}")
            };
            answer(&id, &method)
        };
        assert_eq!(
            asked(r#"{"id":-12,"method":"roots/list"}"#),
            Some(
                br#"{"jsonrpc":"2.0","id":-12,"error":{"code":-32601,"message":"method not found"}}"#
                    .iter()
                    .copied()
                    .chain([b'\n'])
                    .collect()
            )
        );
        let long = format!(r#"{{"id":"{}","method":"ping"}}"#, "x".repeat(200));
        for raw in [
            r#"{"id":[1,2,3],"method":"ping"}"#,
            r#"{"id":{"a":1},"method":"ping"}"#,
            &long,
        ] {
            assert_eq!(asked(raw), None, "{raw}");
        }
        let note = br#"{"method":"notifications/message","params":{"data":[[[]]]}}"#;
        assert!(matches!(
            read_now(note, CAPS, |_| None),
            Ok(Incoming::Other)
        ));
        // An answer to no request in flight is dropped.
        let stray = br#"{"id":8,"result":{}}"#;
        assert!(matches!(
            read_now(stray, CAPS, |_| None),
            Ok(Incoming::Other)
        ));
    }

    #[test]
    fn a_message_past_its_caps_is_refused_unread() {
        let many = format!(
            r#"{{"id":7,"result":{{"_meta":[{}],"content":[]}}}}"#,
            vec!["{}"; 2000].join(",")
        );
        assert_eq!(
            read_now(many.as_bytes(), CAPS, |_| Some(Expect::Call)).unwrap_err(),
            ReadError::TooManyValues { cap: 1000 }
        );
        let small = Caps {
            bytes: 16,
            values: 1000,
        };
        assert_eq!(
            read_now(br#"{"id":7,"result":{"content":[]}}"#, small, |_| Some(
                Expect::Call
            ))
            .unwrap_err(),
            ReadError::TooLarge { cap: 16 }
        );
    }

    #[test]
    fn a_result_of_the_wrong_shape_or_version_fails_its_request() {
        let raw = r#"{"id":7,"result":{"content":"not a list"}}"#;
        assert!(matches!(
            answer_of(raw, Expect::Call),
            Err(AnswerError::Shape(_))
        ));
        let raw = r#"{"id":7,"result":{"protocolVersion":"1999-01-01"}}"#;
        assert_eq!(
            answer_of(raw, Expect::Initialize).unwrap_err(),
            AnswerError::Version("1999-01-01".into())
        );
        let raw = r#"{"id":7,"result":{"tools":[{"name":"t","inputSchema":{"type":"object"}}],"nextCursor":"c"}}"#;
        let Payload::Tools(page) = answer_of(raw, Expect::Tools).unwrap() else {
            panic!()
        };
        assert_eq!(page.next_cursor.as_deref(), Some("c"));
        assert_eq!(
            page.into_map(&["t".into()]).unwrap()["t"].1,
            serde_json::json!({"type": "object"})
        );
    }
}
