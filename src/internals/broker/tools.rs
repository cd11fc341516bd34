//! Host tools: `POST /v1/tools/{name}`.
//!
//! - [`HostTool`]: the trait a bot author implements for a host tool, and the
//!   [`ToolCallContext`] its handler is given;
//! - [`compile_schema`]: a tool's JSON schema, compiled at setup (no remote `$ref` is ever
//!   fetched: the validator is built without its HTTP and file resolvers);
//! - [`check_args`]: validation before any handler runs; the `400` message names the
//!   failing property (its JSON pointer) and never echoes the guest's value;
//! - [`HostTools::call`]: the handler runs with the channel, speaker and a cancellation
//!   that fires when the turn ends or the call's deadline passes; a panic or an error
//!   becomes a readable `{"ok":false}`, the key is redacted from any result.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use hyper::StatusCode;
use roundtable_sandbox_protocol::ToolCallResult;
use tokio_util::sync::CancellationToken;

use super::http::{error_response, failure, json_response, refuse, Response};
use super::{BoxFuture, Broker, BrokerError, TurnContext};
use crate::config::PolicyError;
use crate::events::Refusal;
use crate::Speaker;
use secrecy::SecretString;

/// What a host tool's handler is told about the call.
#[derive(Debug, Clone)]
pub struct ToolCallContext {
    /// The channel the turn runs in.
    pub channel: String,
    /// Who wrote the turn's message.
    pub speaker: Speaker,
    /// Fired when the turn ends: a long call should stop.
    pub cancel: CancellationToken,
}

/// A host tool that a bot author exposes to the guest.
pub trait HostTool: Send + Sync {
    /// The tool's name: 1 to 64 of `a-z`, `0-9`, `_`, `-`.
    fn name(&self) -> &str;
    /// What the model is told the tool does.
    fn description(&self) -> &str;
    /// The JSON schema of the arguments object.
    fn parameters(&self) -> serde_json::Value;
    /// Runs the tool with validated arguments; an `Err` reaches the guest as a readable
    /// error (`{"ok":false,"error":...}`), so it must not carry host internals.
    fn call(
        &self,
        args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>>;
    /// The credentials this tool holds (an API key of the service it calls): each is
    /// redacted from every tool, MCP and model result the guest is sent. Default: none.
    fn secrets(&self) -> Vec<SecretString> {
        Vec::new()
    }
}

/// Compiles a tool's argument schema.
pub(crate) fn compile_schema(
    tool: &str,
    schema: &serde_json::Value,
) -> Result<Arc<jsonschema::Validator>, PolicyError> {
    jsonschema::options()
        // A `pattern` with lookaround or backreferences backtracks: each match held to
        // [`PATTERN_BACKTRACK_LIMIT`] steps, not fancy-regex's million (an MCP server's
        // `^(a|aa)*(?!b)c` took ~45 ms a match: a guest's 20,000 strings, minutes).
        .with_pattern_options(
            jsonschema::PatternOptions::fancy_regex().backtrack_limit(PATTERN_BACKTRACK_LIMIT),
        )
        .build(schema)
        .map(Arc::new)
        .map_err(|e| PolicyError::InvalidToolSchema {
            tool: tool.to_owned(),
            error: e.to_string(),
        })
}

/// The backtracking steps one `pattern` match of a tool's schema may take.
pub(crate) const PATTERN_BACKTRACK_LIMIT: usize = 10_000;

/// [`check_args`] on a blocking thread (the arguments and the schema are the guest's and a
/// server's: their cost is never a runtime thread's); the arguments back on success.
pub(crate) async fn check_args_off_thread(
    validator: &Arc<jsonschema::Validator>,
    args: serde_json::Value,
) -> Result<serde_json::Value, String> {
    let validator = validator.clone();
    super::bounded::off_thread(move || check_args(&validator, &args).map(|()| args)).await
}

/// Validates arguments; the error names the failing property.
pub(crate) fn check_args(
    validator: &jsonschema::Validator,
    args: &serde_json::Value,
) -> Result<(), String> {
    match validator.validate(args) {
        Ok(()) => Ok(()),
        Err(e) => {
            let message: String = e.masked().to_string().chars().take(300).collect();
            let at = e.instance_path().as_str();
            Err(if at.is_empty() {
                format!("invalid arguments: {message}")
            } else {
                format!("invalid arguments at {at}: {message}")
            })
        }
    }
}

/// The most of a tool's (or an MCP server's) error text shown to the guest.
pub(crate) const MAX_ERROR_CHARS: usize = 4096;

/// A tool result for the guest: `ok` with content (capped, every declared secret of the
/// policy redacted) or a readable error (cut after redaction, so no piece of one shows).
pub(crate) fn tool_result(result: Result<String, String>, broker: &Broker) -> Response {
    let secrets = broker.secrets();
    let cap = broker.policy.limits.max_response_bytes;
    let body = match result {
        Ok(content) if content.len() > cap => ToolCallResult {
            ok: false,
            content: None,
            error: Some(format!("tool result too large (limit {cap} bytes)")),
        },
        Ok(content) => ToolCallResult {
            ok: true,
            content: Some(secrets.redact(&content)),
            error: None,
        },
        Err(error) => ToolCallResult {
            ok: false,
            content: None,
            error: Some(secrets.redact_cut(&error, MAX_ERROR_CHARS)),
        },
    };
    json_response(StatusCode::OK, &body)
}

/// The configured host tools with their compiled schemas.
pub(crate) struct HostTools {
    tools: BTreeMap<String, (Arc<dyn HostTool>, Arc<jsonschema::Validator>)>,
}

impl HostTools {
    pub(crate) fn new(tools: &[Arc<dyn HostTool>]) -> Result<Self, BrokerError> {
        let mut map = BTreeMap::new();
        for tool in tools {
            let validator = compile_schema(tool.name(), &tool.parameters())?;
            map.insert(tool.name().to_owned(), (tool.clone(), validator));
        }
        Ok(Self { tools: map })
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.tools.contains_key(name)
    }

    pub(crate) async fn call(
        &self,
        name: &str,
        args: serde_json::Map<String, serde_json::Value>,
        ctx: &TurnContext,
        stop: &CancellationToken,
        broker: &Broker,
    ) -> Response {
        let Some((tool, validator)) = self.tools.get(name) else {
            return error_response(StatusCode::NOT_FOUND, &format!("unknown tool: {name}"));
        };
        let args = match check_args_off_thread(validator, serde_json::Value::Object(args)).await {
            Ok(args) => args,
            Err(msg) => return refuse(StatusCode::BAD_REQUEST, Refusal::ToolArguments, &msg),
        };
        let cancel = stop.child_token();
        // Cancels the handler's token however this call ends (deadline, turn stop, drop).
        let _guard = cancel.clone().drop_guard();
        let call_ctx = ToolCallContext {
            channel: ctx.channel.key().to_owned(),
            speaker: ctx.speaker.clone(),
            cancel: cancel.clone(),
        };
        let timeout = broker.policy.limits.call_timeout;
        let call = AssertUnwindSafe(tool.call(args, call_ctx)).catch_unwind();
        let outcome = tokio::select! {
            r = tokio::time::timeout(timeout, call) => r,
            _ = stop.cancelled() => {
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "turn cancelled");
            }
        };
        match outcome {
            Err(_) => {
                tracing::info!(tool = name, "host tool timed out");
                failure(
                    StatusCode::GATEWAY_TIMEOUT,
                    &format!("tool call timed out after {timeout:?}"),
                )
            }
            Ok(Err(_panic)) => {
                tracing::warn!(tool = name, "host tool panicked");
                tool_result(Err("the tool failed".into()), broker)
            }
            Ok(Ok(result)) => tool_result(result, broker),
        }
    }
}
