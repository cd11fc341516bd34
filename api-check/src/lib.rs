//! A crate that uses only the public API of `roundtable-sandbox` and its actor layer, built
//! without their `testing` feature, as a bot author's crate is: every type the embedding
//! API takes or returns must be nameable here. CI checks it alone
//! (`cargo check -p roundtable-sandbox-api-check`).

use std::sync::Arc;

use roundtable_sandbox::events::{Event, EventKind, Observer};
use roundtable_sandbox::{
    ApiKey, ApiKeyProvider, AuditStats, BoxFuture, Config, HostTool, Sandbox, ToolCallContext,
    TurnFailure, TurnOutcome, TurnRequest,
};
use roundtable_sandbox_actors::{GuestMessage, SandboxSupervisor, SupervisorOptions};
use secrecy::SecretString;

/// A key provider of the bot's own (a vault, a refreshing token).
#[derive(Debug)]
pub struct VaultKey;

impl ApiKeyProvider for VaultKey {
    fn key(&self) -> BoxFuture<'_, Result<SecretString, String>> {
        Box::pin(async { Ok(SecretString::from("sk-from-the-vault".to_owned())) })
    }
}

/// A host tool of the bot's own.
#[derive(Debug)]
pub struct Clock;

impl HostTool for Clock {
    fn name(&self) -> &str {
        "clock"
    }
    fn description(&self) -> &str {
        "The host's time"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn call(
        &self,
        _args: serde_json::Value,
        _ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async { Ok("now".to_owned()) })
    }
}

/// A configuration with the provider, the tool and the one observer hook.
pub fn config(run_root: &str, workspace_root: &str, seen: Observer) -> Config {
    Config::builder(run_root, workspace_root)
        .model("https://api.example.invalid/v1", "gpt")
        .api_key(ApiKey::from_provider(VaultKey))
        .tool(Arc::new(Clock))
        .observer(seen)
        .build()
}

/// One turn through the core, admitted then run; and the audit trail's stats.
pub async fn one_turn(
    sandbox: &Sandbox,
    request: TurnRequest,
) -> (TurnOutcome, Option<AuditStats>) {
    let turn = sandbox.admit(request);
    let outcome = sandbox.run(turn, None, |_| {}).await;
    (outcome, sandbox.audit_stats())
}

/// Whether an event ends a turn that failed for want of memory.
pub fn out_of_memory(event: &Event) -> bool {
    matches!(
        event.kind,
        EventKind::Ended {
            failure: Some(TurnFailure::OutOfMemory),
            ..
        }
    )
}

/// The actor layer's options and a message, named.
pub fn actor_layer(config: Config) -> (SupervisorOptions, GuestMessage) {
    let speaker = roundtable_sandbox::Speaker {
        id: "42".into(),
        name: "ann".into(),
    };
    let _start = SandboxSupervisor::start;
    (
        SupervisorOptions::new(config),
        GuestMessage::new("chat:#general", speaker, "hello"),
    )
}
