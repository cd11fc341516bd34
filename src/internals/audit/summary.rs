//! A summary of an audit trail (`roundtable-sandbox audit FILE`): turns and failures by
//! kind, p50/p95 of the turns' durations by launch type, the top speakers and channels by
//! tokens, the budget refusals. A line that is not an audit line (malformed, or the last
//! line cut short) is counted and named by its number, never fatal.
//!
//! The file is read as hostile: every string from it is shown through
//! [`crate::display::escape`] (a speaker id is guest-chosen text).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::BufRead;

use super::Line;
use crate::display::escape;

/// How many speakers and channels are listed.
pub const TOP: usize = 5;
/// How many unreadable lines are named (all are counted).
pub const NAMED: usize = 10;

/// What a trail holds (see the [module](self)).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct AuditSummary {
    /// Audit lines read.
    pub turns: u64,
    /// Turns by outcome (`ok` or the failure kind).
    pub outcomes: BTreeMap<String, u64>,
    /// Total durations (ms) by launch type (`warm`, `cold`, `none`).
    pub durations: BTreeMap<String, Vec<f64>>,
    /// Tokens and turns by speaker id.
    pub speakers: HashMap<String, (u64, u64)>,
    /// Tokens and turns by channel hash.
    pub channels: HashMap<String, (u64, u64)>,
    /// Refusals by budget.
    pub budgets: BTreeMap<String, u64>,
    /// Lines that are not audit lines: their numbers (from 1) and why.
    pub unreadable: Vec<(u64, Unreadable)>,
}

/// Why a line is not an audit line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// Not JSON, or not an audit line's JSON.
    Malformed,
    /// The last line, without its line break, and not whole.
    Truncated,
    /// Not UTF-8 text.
    NotText,
}

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unreadable::Malformed => "malformed",
            Unreadable::Truncated => "truncated",
            Unreadable::NotText => "not text",
        })
    }
}

/// Reads a trail; only an I/O error of the reader is an error.
pub fn summarize(mut reader: impl BufRead) -> std::io::Result<AuditSummary> {
    let mut s = AuditSummary::default();
    let mut buf = Vec::new();
    let mut number = 0u64;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf)? == 0 {
            break;
        }
        number += 1;
        let whole = buf.last() == Some(&b'\n');
        let Ok(text) = std::str::from_utf8(&buf) else {
            s.unreadable.push((number, Unreadable::NotText));
            continue;
        };
        let text = text.trim_end_matches(['\n', '\r']);
        if text.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Line>(text) {
            Ok(line) => s.add(line),
            Err(_) if !whole => s.unreadable.push((number, Unreadable::Truncated)),
            Err(_) => s.unreadable.push((number, Unreadable::Malformed)),
        }
    }
    Ok(s)
}

impl AuditSummary {
    fn add(&mut self, line: Line) {
        self.turns += 1;
        *self.outcomes.entry(line.outcome).or_default() += 1;
        self.durations
            .entry(line.launch)
            .or_default()
            .push(line.duration_ms.total);
        let tokens = line
            .usage
            .prompt_tokens
            .saturating_add(line.usage.completion_tokens);
        for (key, map) in [
            (line.speaker, &mut self.speakers),
            (line.channel, &mut self.channels),
        ] {
            let entry = map.entry(key.unwrap_or_else(|| "-".into())).or_default();
            entry.0 = entry.0.saturating_add(tokens);
            entry.1 += 1;
        }
        if let Some(b) = line.budget {
            *self.budgets.entry(b.name).or_default() += 1;
        }
    }
}

/// The nearest-rank percentile `p` (0 < p ≤ 1) of `sorted`.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The `n` largest by tokens (then turns, then name).
fn top(map: &HashMap<String, (u64, u64)>, n: usize) -> Vec<(&String, &(u64, u64))> {
    let mut all: Vec<_> = map.iter().collect();
    all.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    all.truncate(n);
    all
}

impl fmt::Display for AuditSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failures: u64 = self
            .outcomes
            .iter()
            .filter(|(k, _)| k.as_str() != "ok")
            .map(|(_, n)| n)
            .sum();
        writeln!(f, "turns         {} ({failures} failed)", self.turns)?;
        if !self.unreadable.is_empty() {
            let named: Vec<String> = self
                .unreadable
                .iter()
                .take(NAMED)
                .map(|(n, why)| format!("line {n} {why}"))
                .collect();
            let more = self.unreadable.len().saturating_sub(NAMED);
            writeln!(
                f,
                "unreadable    {} lines: {}{}",
                self.unreadable.len(),
                named.join(", "),
                if more > 0 {
                    format!(", and {more} more")
                } else {
                    String::new()
                }
            )?;
        }
        writeln!(f, "outcomes")?;
        for (kind, n) in &self.outcomes {
            writeln!(f, "  {:<22}{n:>6}", escape(kind))?;
        }
        writeln!(
            f,
            "duration ms   {:>6} {:>10} {:>10}",
            "turns", "p50", "p95"
        )?;
        for (launch, values) in &self.durations {
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            writeln!(
                f,
                "  {:<12}{:>6} {:>10.1} {:>10.1}",
                escape(launch),
                sorted.len(),
                percentile(&sorted, 0.5),
                percentile(&sorted, 0.95)
            )?;
        }
        for (title, map) in [
            ("top speakers by tokens", &self.speakers),
            ("top channels by tokens", &self.channels),
        ] {
            writeln!(f, "{title}")?;
            for (name, (tokens, turns)) in top(map, TOP) {
                writeln!(
                    f,
                    "  {:<22}{tokens:>10} tokens {turns:>6} turns",
                    escape(name)
                )?;
            }
        }
        writeln!(f, "budget refusals")?;
        if self.budgets.is_empty() {
            writeln!(f, "  none")?;
        }
        for (budget, n) in &self.budgets {
            writeln!(f, "  {:<22}{n:>6}", escape(budget))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trail_is_summarised_and_its_bad_lines_named() {
        let line = |turn: u32,
                    speaker: &str,
                    channel: &str,
                    launch: &str,
                    outcome: &str,
                    ms: f64,
                    tokens: u64,
                    budget: Option<&str>| {
            let budget = budget.map_or(String::new(), |b| {
                format!(r#","budget":{{"name":"{b}","limit":10,"message":"m"}}"#)
            });
            format!(
                r#"{{"v":1,"at":"2026-12-02T05:00:00.000Z","turn":{turn},"channel":"{channel}","speaker":"{speaker}","launch":"{launch}","outcome":"{outcome}"{budget},"duration_ms":{{"total":{ms}}},"usage":{{"prompt_tokens":{tokens},"completion_tokens":0,"model_calls":1,"tool_calls":0,"estimated":false}}}}"#
            )
        };
        let mut text = String::new();
        text += &line(1, "u1", "aaaa", "cold", "ok", 100.0, 600, None);
        text += "\n";
        text += &line(2, "u1", "aaaa", "warm", "ok", 10.0, 500, None);
        text += "\n";
        text += "{not json\n";
        text += &line(
            3,
            "evil\\u001b[2J\\u202e",
            "bbbb",
            "none",
            "budget_exceeded",
            1.0,
            0,
            Some("speaker_tokens_per_day"),
        );
        text += "\n\n";
        text += &line(4, "u2", "bbbb", "cold", "timeout", 300.0, 15, None);
        text += "\n";
        text += r#"{"v":1,"at":"2026-12"#;
        let s = summarize(text.as_bytes()).unwrap();
        assert_eq!(
            s.to_string(),
            "\
turns         4 (2 failed)
unreadable    2 lines: line 3 malformed, line 7 truncated
outcomes
  budget_exceeded            1
  ok                         2
  timeout                    1
duration ms    turns        p50        p95
  cold             2      100.0      300.0
  none             1        1.0        1.0
  warm             1       10.0       10.0
top speakers by tokens
  u1                          1100 tokens      2 turns
  u2                            15 tokens      1 turns
  evil\\u{1b}[2J\\u{202e}          0 tokens      1 turns
top channels by tokens
  aaaa                        1100 tokens      2 turns
  bbbb                          15 tokens      2 turns
budget refusals
  speaker_tokens_per_day     1
"
        );
    }
}
