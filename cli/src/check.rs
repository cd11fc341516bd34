//! A `doctor` line ([`Check`]: passed, passed with a warning, failed with its fix) and the
//! checks more than one section makes; each section's module makes its own lines, `doctor`
//! runs them in order and reports.

use std::path::Path;

/// One doctor line: passed, failed (with a fix), or passed with a warning and its fix.
pub(crate) struct Check {
    pub(crate) ok: bool,
    pub(crate) name: &'static str,
    pub(crate) detail: String,
    pub(crate) hint: Option<String>,
}

pub(crate) fn pass(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        ok: true,
        name,
        detail: detail.into(),
        hint: None,
    }
}

/// A check that passes with a warning: something the operator chose that weakens a
/// control (shown, not counted as a failure).
pub(crate) fn warn(
    name: &'static str,
    detail: impl Into<String>,
    hint: impl Into<String>,
) -> Check {
    Check {
        ok: true,
        name,
        detail: detail.into(),
        hint: Some(hint.into()),
    }
}

pub(crate) fn fail(
    name: &'static str,
    detail: impl Into<String>,
    hint: impl Into<String>,
) -> Check {
    Check {
        ok: false,
        name,
        detail: detail.into(),
        hint: Some(hint.into()),
    }
}

/// A file the runtime creates at startup: its directory must let this user create it.
pub(crate) fn creatable_check(name: &'static str, file: &Path) -> Check {
    let dir = file.parent().unwrap_or(Path::new("/"));
    match nix::unistd::access(
        dir,
        nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK,
    ) {
        Ok(()) => pass(
            name,
            format!("{} will be created at startup", file.display()),
        ),
        Err(e) => fail(
            name,
            format!(
                "{} cannot be created in {}: {e}",
                file.display(),
                dir.display()
            ),
            "create the directory for the service user, outside run_root and workspace_root",
        ),
    }
}
