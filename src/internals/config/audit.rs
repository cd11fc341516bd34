//! The `[audit]` section ([`AuditSettings`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The `[audit]` section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditSettings {
    /// The file the lines are appended to (absolute; outside both roots; created `0600`
    /// if missing). `None`: no audit trail.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Add each turn's message and reply (guest text) to its line (default false).
    #[serde(default)]
    pub include_text: bool,
}

impl AuditSettings {
    /// The rules, without side effects; the message names the key.
    pub(crate) fn validate(&self, roots: [&Path; 2]) -> Result<(), String> {
        let Some(path) = &self.path else {
            if self.include_text {
                return Err("include_text is set but no path is".into());
            }
            return Ok(());
        };
        super::budgets::operator_file("path", path, roots)
    }
}
