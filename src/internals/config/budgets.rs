//! The `[budgets]` section ([`BudgetSettings`]) and the rule of the files the runtime keeps
//! for the operator (the budgets' state file, the audit trail: [`operator_file`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::keys::KeyRef;

/// The default `[budgets] namespace`.
pub(crate) const DEFAULT_NAMESPACE: &str = "default";
/// The default `[budgets] max_staleness_secs`.
pub(crate) const DEFAULT_MAX_STALENESS_SECS: u64 = 10;
/// The default `[budgets] statement_timeout_ms`.
pub(crate) const DEFAULT_STATEMENT_TIMEOUT_MS: u64 = 2000;

/// `[budgets] store`: where a shared store's URL comes from, never the URL itself (it may
/// hold a password): `{ env = "VAR" }` or `{ file = "/run/secrets/budgets-url" }`, read as
/// the model's key is ([`KeyRef`]). A plain string is refused (without echoing it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSource {
    /// The URL's source.
    Ref(KeyRef),
    /// A URL written in the config file itself: refused by validation.
    Literal,
}

impl<'de> Deserialize<'de> for StoreSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Literal(#[allow(dead_code)] String),
            Ref(KeyRef),
        }
        // The literal's text is dropped here: no error or log can show it.
        Ok(match Raw::deserialize(d)? {
            Raw::Literal(_) => StoreSource::Literal,
            Raw::Ref(r) => StoreSource::Ref(r),
        })
    }
}

impl StoreSource {
    /// Where the URL comes from, for `explain` and messages (never the URL).
    pub fn describe(&self) -> String {
        match self {
            StoreSource::Ref(KeyRef { env: Some(v), .. }) => format!("environment variable {v}"),
            StoreSource::Ref(KeyRef { file: Some(f), .. }) => format!("file {}", f.display()),
            _ => "nowhere valid".into(),
        }
    }
}

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
    /// Egress bytes (sent and read through `[[egress]]` routes) one speaker may use per
    /// day, across channels.
    #[serde(default)]
    pub speaker_egress_bytes_per_day: Option<u64>,
    /// Egress bytes one channel may use per day.
    #[serde(default)]
    pub channel_egress_bytes_per_day: Option<u64>,
    /// A PostgreSQL database shared by the processes of one bot (`postgres://…`), its URL
    /// read from an environment variable or a file. With it, `state_file` is this
    /// process's local journal of the charges not yet in the database.
    #[serde(default)]
    pub store: Option<StoreSource>,
    /// With `store`: the bot's name in the database (one database can serve several bots;
    /// each namespace its own counters and settings). Default `default`.
    #[serde(default)]
    pub namespace: Option<String>,
    /// With `store`: how old this process's view of the others' spend may get (the
    /// database not reached) before new turns are refused, and the model calls and egress
    /// requests of running turns that a set budget counts. Default 10 s.
    #[serde(default)]
    pub max_staleness_secs: Option<u64>,
    /// With `store`: past `max_staleness_secs`, admit turns on this process's own counts
    /// instead of refusing them (each process then spends on its own view: `explain`
    /// flags it). Default false: fail closed.
    #[serde(default)]
    pub fail_open: bool,
    /// With `store`: the database's statement timeout for this process's statements
    /// (a slow database is a failed reconcile, retried). Default 2000 ms.
    #[serde(default)]
    pub statement_timeout_ms: Option<u64>,
}

impl BudgetSettings {
    /// Whether any budget is set.
    pub fn any(&self) -> bool {
        self.speaker_tokens_per_day.is_some()
            || self.channel_tokens_per_day.is_some()
            || self.bot_tokens_per_day.is_some()
            || self.speaker_turns_per_minute.is_some()
            || self.speaker_egress_bytes_per_day.is_some()
            || self.channel_egress_bytes_per_day.is_some()
    }

    /// The namespace in the shared store.
    pub fn effective_namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)
    }

    /// How old the view of the shared store may get.
    pub fn effective_max_staleness(&self) -> std::time::Duration {
        std::time::Duration::from_secs(
            self.max_staleness_secs
                .unwrap_or(DEFAULT_MAX_STALENESS_SECS),
        )
    }

    /// The shared store's statement timeout.
    pub fn effective_statement_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(
            self.statement_timeout_ms
                .unwrap_or(DEFAULT_STATEMENT_TIMEOUT_MS),
        )
    }

    /// The rules of the shared store's keys, without side effects.
    fn validate_store(&self) -> Result<(), String> {
        let Some(store) = &self.store else {
            for (key, set) in [
                ("namespace", self.namespace.is_some()),
                ("max_staleness_secs", self.max_staleness_secs.is_some()),
                ("fail_open", self.fail_open),
                ("statement_timeout_ms", self.statement_timeout_ms.is_some()),
            ] {
                if set {
                    return Err(format!("{key} needs store (a shared PostgreSQL store)"));
                }
            }
            return Ok(());
        };
        match store {
            StoreSource::Literal => {
                return Err(
                    "store must name where its URL comes from, not hold it (it may \
                            hold a password): store = { env = \"VAR\" } or store = { file = \
                            \"/path\" }"
                        .into(),
                )
            }
            StoreSource::Ref(r) if r.env.is_some() == r.file.is_some() => {
                return Err("store: set one of env or file".into())
            }
            StoreSource::Ref(_) => {}
        }
        if self.state_file.is_none() {
            return Err(
                "state_file is required with store (this process's local journal of \
                        the charges not yet in the database)"
                    .into(),
            );
        }
        let ns = self.effective_namespace();
        if ns.is_empty()
            || ns.len() > 64
            || !ns
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(format!(
                "namespace must be 1 to 64 of A-Z, a-z, 0-9, '-', '_', '.', got {ns:?}"
            ));
        }
        if let Some(n) = self.max_staleness_secs {
            if !(1..=86_400).contains(&n) {
                return Err(format!("max_staleness_secs must be 1 to 86400, got {n}"));
            }
        }
        if let Some(n) = self.statement_timeout_ms {
            if !(10..=60_000).contains(&n) {
                return Err(format!("statement_timeout_ms must be 10 to 60000, got {n}"));
            }
        }
        Ok(())
    }

    /// The rules, without side effects; the message names the key.
    pub(crate) fn validate(&self, roots: [&Path; 2]) -> Result<(), String> {
        for (name, value) in [
            ("speaker_tokens_per_day", self.speaker_tokens_per_day),
            ("channel_tokens_per_day", self.channel_tokens_per_day),
            ("bot_tokens_per_day", self.bot_tokens_per_day),
            (
                "speaker_egress_bytes_per_day",
                self.speaker_egress_bytes_per_day,
            ),
            (
                "channel_egress_bytes_per_day",
                self.channel_egress_bytes_per_day,
            ),
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
        self.validate_store()
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
