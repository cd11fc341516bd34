//! The `[budgets]` section ([`BudgetSettings`]) and the rule of the files the runtime keeps
//! for the operator (the budgets' state file, the audit trail: [`operator_file`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The `[budgets]` section: every budget is optional (none set: nothing is refused, the
/// usage is still counted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSettings {
    /// The SQLite file the counters live in (absolute; outside both roots). Required when
    /// a budget is set.
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// Tokens (prompt + completion) one speaker may use per day, across channels.
    #[serde(default)]
    pub speaker_tokens_per_day: Option<u64>,
    /// Tokens one channel may use per day.
    #[serde(default)]
    pub channel_tokens_per_day: Option<u64>,
    /// Tokens the whole bot may use per day.
    #[serde(default)]
    pub bot_tokens_per_day: Option<u64>,
    /// Turns one speaker may start per minute (a sliding minute).
    #[serde(default)]
    pub speaker_turns_per_minute: Option<u32>,
}

impl BudgetSettings {
    /// Whether any budget is set.
    pub fn any(&self) -> bool {
        self.speaker_tokens_per_day.is_some()
            || self.channel_tokens_per_day.is_some()
            || self.bot_tokens_per_day.is_some()
            || self.speaker_turns_per_minute.is_some()
    }

    /// The rules, without side effects; the message names the key.
    pub(crate) fn validate(&self, roots: [&Path; 2]) -> Result<(), String> {
        for (name, value) in [
            ("speaker_tokens_per_day", self.speaker_tokens_per_day),
            ("channel_tokens_per_day", self.channel_tokens_per_day),
            ("bot_tokens_per_day", self.bot_tokens_per_day),
        ] {
            if let Some(n) = value {
                if !(1..=1_000_000_000_000).contains(&n) {
                    return Err(format!("{name} must be 1 to 1000000000000, got {n}"));
                }
            }
        }
        if let Some(n) = self.speaker_turns_per_minute {
            if !(1..=10_000).contains(&n) {
                return Err(format!(
                    "speaker_turns_per_minute must be 1 to 10000, got {n}"
                ));
            }
        }
        match &self.state_file {
            None if self.any() => {
                return Err("state_file is required when a budget is set".into());
            }
            None => {}
            Some(path) => operator_file("state_file", path, roots)?,
        }
        Ok(())
    }
}

/// The rules of a file the runtime keeps for the operator (the budgets' state file, the
/// audit trail), `key` naming the setting in the message: an absolute path that names a
/// file, outside both roots (the workspaces are the guests' and the run root is the
/// turns': a file there could be edited by a guest or swept).
pub(crate) fn operator_file(key: &str, path: &Path, roots: [&Path; 2]) -> Result<(), String> {
    if !path.is_absolute() {
        return Err(format!(
            "{key} must be an absolute path, got {}",
            path.display()
        ));
    }
    if roots.iter().any(|r| path.starts_with(r)) {
        return Err(format!(
            "{key} must be outside run_root and workspace_root, got {}",
            path.display()
        ));
    }
    if path.file_name().is_none() {
        return Err(format!("{key} must name a file, got {}", path.display()));
    }
    Ok(())
}
