//! The audit trail: as `explain` shows it, as `doctor` checks its file, and `audit FILE`,
//! its summary.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use roundtable_sandbox::Config;

use crate::check::{creatable_check, fail, pass, Check};

/// `explain`'s line for the audit trail.
pub(crate) fn explain(config: &Config) {
    match &config.audit.path {
        None => println!("audit         off"),
        Some(f) => println!(
            "audit         one JSON line per turn appended to {}; guest text: {}; never a key",
            f.display(),
            if config.audit.include_text {
                "the speaker id, the message and the reply (include_text = true)"
            } else {
                "the speaker id only (include_text = false)"
            }
        ),
    }
}

/// `doctor`'s line for the audit file, when one is set.
pub(crate) fn doctor(config: &Config) -> Option<Check> {
    config.audit.path.as_deref().map(audit_file_check)
}

/// The audit file: an existing one must open for appending as the runtime opens it (by
/// this user, the service user); a missing one needs a directory this user may create in.
/// Nothing is written or created.
fn audit_file_check(file: &Path) -> Check {
    const NAME: &str = "audit file";
    if !file.exists() {
        return creatable_check(NAME, file);
    }
    match std::fs::OpenOptions::new().append(true).open(file) {
        Ok(_) => pass(
            NAME,
            format!("{} is writable (appended to)", file.display()),
        ),
        Err(e) => fail(
            NAME,
            format!("{} cannot be opened for appending: {e}", file.display()),
            "give the service user write permission on it (or name another file)",
        ),
    }
}

/// `audit FILE`: the trail's summary (its strings escaped for the terminal).
pub(crate) fn audit_summary(file: &Path) -> Result<ExitCode> {
    let reader =
        std::fs::File::open(file).with_context(|| format!("open audit file {}", file.display()))?;
    let summary = roundtable_sandbox::operator::summarize_audit(std::io::BufReader::new(reader))
        .with_context(|| format!("read audit file {}", file.display()))?;
    print!("{summary}");
    Ok(ExitCode::SUCCESS)
}
