//! The broker: its caps, the model request's fields, the peer check and the host tools, as
//! `explain` shows them.

use roundtable_sandbox::Config;

/// `explain`'s lines for the broker.
pub(crate) fn explain(config: &Config) {
    let b = &config.broker_limits;
    println!(
        "broker caps   request {} KiB, response {} KiB, {} model calls, {} tool calls, {} compactions, {:?} per call",
        b.max_request_bytes / 1024,
        b.max_response_bytes / 1024,
        b.max_model_calls,
        b.max_tool_calls,
        b.max_compactions,
        b.call_timeout
    );
    println!(
        "broker turn   {} calls in flight, {} connections",
        b.max_calls_in_flight, b.max_connections
    );
    let fields: Vec<&str> = config.model_request.allowed_fields().collect();
    println!(
        "model fields  {} (anything else: 400); model forced; max_tokens capped at {} (set when absent)",
        fields.join(", "),
        config.model_request.max_tokens
    );
    println!(
        "broker peer   {}",
        if config.peer_uid_check {
            "only the worker uid may connect (SO_PEERCRED)"
        } else {
            "uid check OFF (peer_uid_check = false): only the per-turn 0700 run dir keeps \
             other local users away"
        }
    );
    if config.tools.is_empty() {
        println!("host tools    (none)");
    }
    for t in &config.tools {
        println!("host tool     {}: {}", t.name(), t.description());
    }
}
