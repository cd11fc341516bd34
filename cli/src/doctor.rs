//! `doctor`: what a runtime needs, one line per check with a fix hint, section by section
//! (each section's checks are in its module); exits 1 on a failure.

use std::process::ExitCode;

use anyhow::{Context, Result};
use roundtable_sandbox::settings::Settings;
use roundtable_sandbox::{Config, ConfigError};

use crate::check::{fail, Check};
use crate::{audit, budgets, egress, host, mcp, metrics};

/// Runs every section's checks, in order, and prints them with the count of failures.
pub(crate) async fn doctor(
    settings: &Settings,
    metrics_args: &roundtable_sandbox_metrics::MetricsArgs,
) -> Result<ExitCode> {
    let (config, _offline) = settings.build().await.context("read the configuration")?;
    let uid = nix::unistd::getuid().as_raw();
    let mut checks = vec![host::user_check(uid, nix::unistd::getgid().as_raw())];
    checks.extend(config_checks(&config));
    let engine = host::Engine::probe(&config, &mut checks).await;
    checks.extend(host::doctor(&config, &engine, uid).await);
    checks.extend(budgets::doctor(&config));
    checks.extend(metrics::doctor(metrics_args));
    checks.extend(audit::doctor(&config));
    checks.extend(mcp::doctor(&config, &engine).await);
    checks.push(host::socket_check(&config));
    checks.extend(egress::doctor(&config));
    Ok(report(&checks))
}

/// Every violation of the runtime's own rules (the startup validation in its
/// every-violation mode; startup stops at the first), one line each, none when the
/// configuration passes. What lies above a root is shown on the root's own line.
fn config_checks(config: &Config) -> Vec<Check> {
    roundtable_sandbox::operator::violations(config)
        .into_iter()
        .filter(|violation| {
            !matches!(
                violation,
                ConfigError::RootAncestorOwner { .. }
                    | ConfigError::RootAncestorWritable { .. }
                    | ConfigError::InspectRoot { .. }
            )
        })
        .map(|violation| {
            fail(
                "config",
                format!("{:#}", anyhow::Error::from(violation)),
                "change the setting it names: the runtime refuses this configuration at startup",
            )
        })
        .collect()
}

/// Prints the checks, each with its fix, then the count; exit 1 when one failed.
fn report(checks: &[Check]) -> ExitCode {
    let failed = checks.iter().filter(|c| !c.ok).count();
    for c in checks {
        println!(
            "{} {:<15} {}",
            match (c.ok, &c.hint) {
                (false, _) => "FAIL",
                (true, Some(_)) => "WARN",
                (true, None) => "ok  ",
            },
            c.name,
            c.detail
        );
        if let Some(hint) = &c.hint {
            println!("     {:<15} fix: {hint}", "");
        }
    }
    if failed == 0 {
        println!("all {} checks passed", checks.len());
        ExitCode::SUCCESS
    } else {
        println!("{failed} of {} checks failed", checks.len());
        ExitCode::from(1)
    }
}
