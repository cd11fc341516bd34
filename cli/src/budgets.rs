//! The budgets: their limits, the state file and the shared store, as `explain` shows
//! them and as `doctor` checks them.

use std::path::Path;

use roundtable_sandbox::Config;

use crate::check::{creatable_check, fail, pass, Check};

/// `explain`'s lines for the budgets: the limits set and where their counters are kept;
/// the shared store, with a warning when it fails open.
pub(crate) fn explain(config: &Config) {
    let bg = &config.budgets;
    let limit = |v: Option<u64>, what: &str| v.map(|n| format!("{n} {what}"));
    let set: Vec<String> = [
        limit(bg.speaker_tokens_per_day, "tokens per speaker per day"),
        limit(bg.channel_tokens_per_day, "tokens per channel per day"),
        limit(bg.bot_tokens_per_day, "tokens per day for the bot"),
        limit(
            bg.speaker_turns_per_minute.map(u64::from),
            "turns per speaker per minute",
        ),
        limit(
            bg.speaker_egress_bytes_per_day,
            "egress bytes per speaker per day",
        ),
        limit(
            bg.channel_egress_bytes_per_day,
            "egress bytes per channel per day",
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    let zone = config.effective_time_zone();
    match (&bg.state_file, set.is_empty()) {
        (None, _) => println!(
            "budgets       none; each turn's usage (tokens from the upstream's own counts) is logged, not kept"
        ),
        (Some(f), true) => println!(
            "budgets       none; usage kept in {} (SQLite, WAL)",
            f.display()
        ),
        (Some(f), false) => println!(
            "budgets       {}; days start at 00:00 {zone}; a turn past one is refused before its container, \
             a model call past one gets 429; counters in {}",
            set.join(", "),
            match bg.store {
                None => format!("{} (SQLite, WAL)", f.display()),
                Some(_) => "the shared store (below)".to_owned(),
            }
        ),
    }
    if let Some(source) = &bg.store {
        println!(
            "budget store  PostgreSQL, namespace {:?}, its URL from {} (never shown); shared by \
             every process of the namespace (their limits and time_zone must agree); {} is this \
             process's journal; reconciled every 100 ms; a view older than {} s refuses new turns, \
             model calls and egress requests",
            bg.effective_namespace(),
            source.describe(),
            bg.state_file
                .as_ref()
                .map_or_else(|| "(no state_file)".into(), |f| f.display().to_string()),
            bg.effective_max_staleness().as_secs()
        );
        if bg.fail_open {
            println!(
                "WARNING       budgets.fail_open = true: with the database unreachable past {} s, \
                 turns are admitted on this process's own counts (each process may then spend \
                 a whole budget on its own)",
                bg.effective_max_staleness().as_secs()
            );
        }
    }
}

/// `doctor`'s line for the budgets' counters: the shared store (with its journal) or the
/// state file, when either is set.
pub(crate) fn doctor(config: &Config) -> Option<Check> {
    match (&config.budgets.state_file, &config.budgets.store) {
        (Some(_), Some(_)) => Some(shared_store_check(
            &config.budgets,
            config.effective_time_zone(),
        )),
        (Some(file), None) => Some(state_file_check(file, config.effective_time_zone())),
        _ => None,
    }
}

/// The budgets' state file: an existing one must open and load as a start loads it (a
/// database, undamaged, not locked, today's counters and the last minute's turns readable);
/// values a start would clamp fail the check with the start's own warning; a missing one
/// needs a directory to be made in.
fn state_file_check(file: &Path, time_zone: &str) -> Check {
    const NAME: &str = "state file";
    if !file.exists() {
        return creatable_check(NAME, file);
    }
    match roundtable_sandbox::operator::check_state_file(file, time_zone) {
        Ok(c) if c.warnings.is_empty() => pass(
            NAME,
            format!(
                "{} opens and loads (SQLite, WAL, checked; today's {} counter(s), {} turn(s) of the last minute)",
                file.display(),
                c.counters,
                c.turns
            ),
        ),
        Ok(c) => fail(
            NAME,
            c.warnings.join("; "),
            "a start goes on with these values clamped; to clear them now, stop the bot and \
             fix or delete those rows with sqlite3",
        ),
        Err(e) => fail(
            NAME,
            e.to_string(),
            "stop the other process holding it, or move a damaged file aside (its counters are lost)",
        ),
    }
}

/// The budgets' shared store: connects, checks the schema and the namespace's settings
/// (never changing them) and loads today's counters as a start does; never shows its URL.
fn shared_store_check(budgets: &roundtable_sandbox::BudgetSettings, time_zone: &str) -> Check {
    const NAME: &str = "budget store";
    match roundtable_sandbox::operator::check_shared_store(budgets, time_zone) {
        Ok(c) if c.warnings.is_empty() => pass(
            NAME,
            format!(
                "PostgreSQL, namespace {:?}: connects, schema current, settings agree; today's {} \
                 counter(s), {} turn(s) of the last minute",
                budgets.effective_namespace(),
                c.counters,
                c.turns
            ),
        ),
        Ok(c) => fail(
            NAME,
            c.warnings.join("; "),
            "a start goes on with these values clamped",
        ),
        Err(e) => fail(
            NAME,
            e.to_string(),
            "start the database, fix the URL's source, or give every process of the namespace \
             the same limits and time_zone",
        ),
    }
}
