//! The fixed label values: every event's text or kind is mapped to one of a closed set
//! here, so no label can hold a channel, a speaker, a tool's name, guest text, or the
//! host's error text (whose words may quote what a guest made: a file name, a path).

use roundtable_sandbox::events::Refusal;
use roundtable_sandbox::Budget;
use roundtable_sandbox::{TurnFailure, TurnPhase};

/// A turn's outcome: `ok` or the failure kind in snake case.
pub fn outcome(failure: Option<TurnFailure>) -> &'static str {
    let Some(f) = failure else { return "ok" };
    match f {
        TurnFailure::Timeout => "timeout",
        TurnFailure::SlotTimeout => "slot_timeout",
        TurnFailure::Stopped => "stopped",
        TurnFailure::OutOfMemory => "out_of_memory",
        TurnFailure::OverQuota => "over_quota",
        TurnFailure::DiskFloor => "disk_floor",
        TurnFailure::GuestError => "guest_error",
        TurnFailure::MalformedOutput => "malformed_output",
        TurnFailure::GuestExit => "guest_exit",
        TurnFailure::EngineUnavailable => "engine_unavailable",
        TurnFailure::ImageMissing => "image_missing",
        TurnFailure::Internal => "internal",
        TurnFailure::Busy => "busy",
        TurnFailure::ShuttingDown => "shutting_down",
        TurnFailure::ChannelRestarted => "channel_restarted",
        TurnFailure::BudgetExceeded => "budget_exceeded",
        _ => "other",
    }
}

/// A phase's name.
pub fn phase(phase: TurnPhase) -> &'static str {
    match phase {
        TurnPhase::Preparing => "preparing",
        TurnPhase::BrokerListening => "broker_listening",
        TurnPhase::ContainerRunning => "container_running",
        TurnPhase::ModelCall => "model_call",
        TurnPhase::ToolCall => "tool_call",
        TurnPhase::Replied => "replied",
        TurnPhase::TearingDown => "tearing_down",
        TurnPhase::Done => "done",
        #[allow(unreachable_patterns)]
        _ => "other",
    }
}

/// Why a prepared container could not serve (the host's error text, mapped):
/// `workspace_moved`, `container_exited`, `container_gone`, `engine`, `other`.
pub fn fallback_reason(reason: &str) -> &'static str {
    let r = reason.to_ascii_lowercase();
    if r.contains("workspace directory was moved") {
        "workspace_moved"
    } else if r.contains("exited") || r.contains("not running") || r.contains("stopped") {
        "container_exited"
    } else if r.contains("no such container") || r.contains("not found") || r.contains("removed") {
        "container_gone"
    } else if r.contains("engine") || r.contains("docker") || r.contains("connect") {
        "engine"
    } else {
        "other"
    }
}

/// Why a prepared container was removed unused: `expired`, `reset`, `shutting_down`,
/// `not_needed`, `wrong_channel`, `dropped`, `other`.
pub fn discard_reason(reason: &str) -> &'static str {
    match reason {
        "expired" => "expired",
        "reset since prepared" => "reset",
        "shutting down" => "shutting_down",
        "not needed" => "not_needed",
        "prepared for another channel" => "wrong_channel",
        "dropped" => "dropped",
        _ => "other",
    }
}

/// The limit behind a broker refusal.
pub fn refusal(limit: Refusal) -> &'static str {
    match limit {
        Refusal::CallsInFlight => "calls_in_flight",
        Refusal::Connections => "connections",
        Refusal::RequestBytes => "request_bytes",
        Refusal::ModelCalls => "model_calls",
        Refusal::ToolCalls => "tool_calls",
        Refusal::ArgumentComplexity => "argument_complexity",
        Refusal::ModelField => "model_field",
        Refusal::ToolArguments => "tool_arguments",
        Refusal::UnknownRoute => "unknown_route",
        Refusal::Method => "method",
        Refusal::Malformed => "malformed",
        Refusal::BodyTimeout => "body_timeout",
        Refusal::PeerUid => "peer_uid",
        Refusal::McpSessions => "mcp_sessions",
        Refusal::McpQuota => "mcp_quota",
        Refusal::Cancelled => "cancelled",
        Refusal::Key => "key",
        Refusal::Compaction => "compaction",
        Refusal::Budget(_) => "budget",
        Refusal::HeadBytes => "head_bytes",
        Refusal::EgressCaps => "egress_caps",
        Refusal::Internal => "internal",
        _ => "other",
    }
}

/// A refusal's status: the broker's own statuses, anything else as 0 (none is expected).
pub fn refusal_status(status: u16) -> u16 {
    match status {
        400 | 403 | 404 | 405 | 408 | 413 | 429 | 500 | 502 | 503 | 507 => status,
        _ => 0,
    }
}

/// A model call's `error_type` (the GenAI conventions' attribute): `none` for a 2xx, the
/// status for the usual upstream failures, `other` for the rest (an upstream may answer any
/// status: the set stays closed).
pub fn error_type(status: u16) -> &'static str {
    match status {
        200..=299 => "none",
        400 => "400",
        401 => "401",
        403 => "403",
        404 => "404",
        408 => "408",
        413 => "413",
        429 => "429",
        500 => "500",
        502 => "502",
        503 => "503",
        504 => "504",
        _ => "other",
    }
}

/// A budget's key in `[budgets]`.
pub fn budget(budget: Budget) -> &'static str {
    budget.key()
}

/// An engine operation: the core's names are static, but only the known ones are labels.
pub fn engine_op(op: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        "create", "start", "remove", "inspect", "attach", "wait", "kill", "list", "version",
        "info", "top",
    ];
    match op {
        "inspect image" => "inspect_image",
        "list processes" => "list_processes",
        op => KNOWN.iter().find(|k| **k == op).copied().unwrap_or("other"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_text_maps_to_closed_sets() {
        assert_eq!(
            fallback_reason(
                "its workspace directory was moved or deleted since it was prepared (the turn's is another)"
            ),
            "workspace_moved"
        );
        assert_eq!(
            fallback_reason("the container has exited"),
            "container_exited"
        );
        assert_eq!(fallback_reason("#secret-channel ann: hi"), "other");
        assert_eq!(discard_reason("reset since prepared"), "reset");
        assert_eq!(discard_reason("#secret-channel"), "other");
        assert_eq!(error_type(418), "other");
        assert_eq!(error_type(201), "none");
        assert_eq!(refusal_status(418), 0);
        assert_eq!(engine_op("create"), "create");
        assert_eq!(engine_op("anything"), "other");
    }
}
