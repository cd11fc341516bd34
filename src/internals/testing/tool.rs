//! A host tool made of a function, for the tests' small tools (an echo, a tool that never
//! answers, one that says who called).

use std::future::Future;

use secrecy::SecretString;

use crate::broker::BoxFuture;
use crate::{HostTool, ToolCallContext};

type Call = dyn Fn(serde_json::Value, ToolCallContext) -> BoxFuture<'static, Result<String, String>>
    + Send
    + Sync;

/// A host tool whose call is a function of the arguments and the call's context. Its
/// parameter schema is `{"type": "object"}` unless [`FnTool::with_parameters`] sets
/// another; it holds no secret unless [`FnTool::with_secret`] adds one.
///
/// ```ignore
/// let echo = FnTool::new("echo", "echoes", |args, _| async move { Ok(args.to_string()) });
/// ```
pub struct FnTool {
    name: &'static str,
    description: &'static str,
    parameters: serde_json::Value,
    secrets: Vec<SecretString>,
    call: Box<Call>,
}

impl FnTool {
    /// A tool `name`, described as `description`, whose calls `call` answers.
    pub fn new<F, Fut>(name: &'static str, description: &'static str, call: F) -> Self
    where
        F: Fn(serde_json::Value, ToolCallContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<String, String>> + Send + 'static,
    {
        Self {
            name,
            description,
            parameters: serde_json::json!({"type": "object"}),
            secrets: Vec::new(),
            call: Box::new(move |args, ctx| Box::pin(call(args, ctx))),
        }
    }

    /// The same tool with the parameter schema `schema`.
    pub fn with_parameters(mut self, schema: serde_json::Value) -> Self {
        self.parameters = schema;
        self
    }

    /// The same tool holding the credential `secret` (redacted from every result).
    pub fn with_secret(mut self, secret: &str) -> Self {
        self.secrets.push(SecretString::from(secret));
        self
    }
}

impl std::fmt::Debug for FnTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FnTool({:?})", self.name)
    }
}

impl HostTool for FnTool {
    fn name(&self) -> &str {
        self.name
    }
    fn description(&self) -> &str {
        self.description
    }
    fn parameters(&self) -> serde_json::Value {
        self.parameters.clone()
    }
    fn call(
        &self,
        args: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        (self.call)(args, ctx)
    }
    fn secrets(&self) -> Vec<SecretString> {
        self.secrets.clone()
    }
}
