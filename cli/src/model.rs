//! The turn's deadline, its model and the compaction summarizer, as `explain` shows them
//! (never a key).

use roundtable_sandbox::{ApiKey, Config};

use crate::host_of;

/// `explain`'s lines for the model: the turn timeout, the model endpoint's host and its
/// key's source, the compaction chain.
pub(crate) fn explain(config: &Config, offline: bool) {
    println!(
        "turn timeout  {} s",
        config.effective_turn_timeout().as_secs_f64()
    );
    let key = match &config.api_key {
        ApiKey::None => "none",
        ApiKey::Static(_) => "set (held by the broker only)",
        ApiKey::Provider(_) => "from a provider (held by the broker only)",
    };
    println!(
        "model         {} at {} ({}{}), key: {key}",
        config.model,
        host_of(&config.model_url),
        config.model_url.split("://").next().unwrap_or("?"),
        if offline {
            ", embedded offline model"
        } else {
            ""
        }
    );
    match &config.compaction {
        None => println!(
            "compaction    through the main model (no [compaction] section); fallback: plain summary"
        ),
        Some(c) => {
            let key = match &c.api_key {
                ApiKey::None => format!(
                    "MISSING ({}), so compaction falls back to the main model",
                    c.key_source
                ),
                ApiKey::Static(_) => {
                    format!("set from {} (held by the broker only)", c.key_source)
                }
                ApiKey::Provider(_) => "from a provider (held by the broker only)".to_owned(),
            };
            println!(
                "compaction    summarizer {} at {} ({}), timeout {} s, key: {key}; fallback: main model, then plain summary",
                c.model,
                host_of(&c.url),
                c.url.split("://").next().unwrap_or("?"),
                c.timeout.as_secs_f64()
            );
        }
    }
}
