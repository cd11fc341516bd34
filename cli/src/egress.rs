//! The egress routes as `explain` lists them, and `egress check`: one route's verdict on
//! one request, without resolving or sending anything.

use std::process::ExitCode;

use anyhow::{bail, Result};
use roundtable_sandbox::operator::{egress_verdict, EgressVerdict};
use roundtable_sandbox::{Config, CredentialPlacement, EgressMode, EgressRoute, Redirects};

/// `explain`'s lines for the routes: one per route, then a warning per route in audit mode
/// or reaching private ranges.
pub(crate) fn explain(config: &Config) {
    if config.egress.is_empty() {
        println!("egress        (none: the guest reaches no web)");
        return;
    }
    if let Some(ns) = config.egress_nameserver {
        println!("egress dns    {ns} (egress_nameserver), no cache, one lookup per request");
    }
    for r in &config.egress {
        println!("egress        {}", describe(r));
        for line in warnings(r) {
            println!("WARNING       {line}");
        }
    }
}

/// `doctor`'s lines: a route in audit mode fails (its rules refuse nothing); a route that
/// reaches private addresses or IP literals, or posts anywhere, passes with a warning.
pub(crate) fn doctor(config: &Config) -> Vec<crate::check::Check> {
    let mut out = Vec::new();
    for r in &config.egress {
        let mut lines = warnings(r).into_iter();
        if r.mode == EgressMode::Audit {
            let line = lines.next().unwrap_or_default();
            out.push(crate::check::fail(
                "egress",
                line,
                "set mode = \"enforce\" once the audit entries show what the route needs",
            ));
        }
        for line in lines {
            out.push(crate::check::warn(
                "egress",
                line,
                "keep it only if the route needs it (a private deployment, the tests)",
            ));
        }
        if r.mode != EgressMode::Audit && warnings(r).is_empty() {
            out.push(crate::check::pass(
                "egress",
                format!("route {} enforced", r.name),
            ));
        }
    }
    out
}

/// The warnings `doctor` and `explain` give for `route` (the audit mode's first).
pub(crate) fn warnings(r: &EgressRoute) -> Vec<String> {
    let mut out = Vec::new();
    if r.mode == EgressMode::Audit {
        out.push(format!(
            "egress route {} is in AUDIT mode: its rules refuse nothing, a would-be denial is only logged (the address rules still hold)",
            r.name
        ));
    }
    if !r.allow_private.is_empty() {
        out.push(format!(
            "egress route {} may reach private or loopback addresses: {}",
            r.name,
            r.allow_private.join(", ")
        ));
    }
    if r.allow_ip_literals {
        out.push(format!(
            "egress route {} accepts hosts given as IP addresses (allow_ip_literals)",
            r.name
        ));
    }
    if r.hosts.iter().any(|h| h == "*") && r.methods.iter().any(|m| m != "GET" && m != "HEAD") {
        out.push(format!(
            "egress route {} reaches any public host with {}: a guest can send up to {} bytes per turn anywhere",
            r.name,
            r.methods.join(", "),
            r.limits.max_bytes_out_per_turn
        ));
    }
    out
}

fn describe(r: &EgressRoute) -> String {
    let target = match &r.upstream {
        Some(u) => format!("upstream {u} (the guest gives a path)"),
        None => {
            let ports: Vec<String> = match r.ports.is_empty() {
                true => vec!["443".into()],
                false => r.ports.iter().map(u16::to_string).collect(),
            };
            format!(
                "hosts {} on port {} (the guest gives a URL)",
                r.hosts.join(", "),
                ports.join(", ")
            )
        }
    };
    let paths = if r.paths.is_empty() {
        "any path".to_owned()
    } else {
        format!("paths {}", r.paths.join(", "))
    };
    let credential = match (&r.credential, &r.credential_as) {
        (None, _) => "no credential".to_owned(),
        (Some(k), how) => {
            let at = match how {
                CredentialPlacement::Bearer => "as a bearer token".to_owned(),
                CredentialPlacement::Basic => "as Basic auth".to_owned(),
                CredentialPlacement::Header { name, .. } => format!("in header {name}"),
                CredentialPlacement::Query { name } => format!("in query parameter {name}"),
                CredentialPlacement::PathSegment => "in the upstream's path".to_owned(),
            };
            format!(
                "credential from {} {at} (the guest never sees it)",
                source(k)
            )
        }
    };
    let l = &r.limits;
    format!(
        "{}: {target}; {}; {paths}{}; {}; {credential}; redirects {}; per request {} KiB out, {} KiB in, {} ms; per turn {} requests, {} KiB in, {} KiB out",
        r.name,
        r.methods.join(", "),
        if r.deny.is_empty() {
            String::new()
        } else {
            format!("; {} deny rules", r.deny.len())
        },
        match r.mode {
            EgressMode::Audit => "AUDIT mode",
            _ => "enforced",
        },
        match r.redirects {
            Redirects::SameRoute => "followed within the route",
            _ => "not followed",
        },
        l.max_request_bytes / 1024,
        l.max_response_bytes / 1024,
        l.timeout_ms,
        l.max_requests_per_turn,
        l.max_bytes_in_per_turn / 1024,
        l.max_bytes_out_per_turn / 1024,
    )
}

fn source(k: &roundtable_sandbox::KeyRef) -> String {
    match (&k.env, &k.file) {
        (Some(v), _) => format!("${v}"),
        (None, Some(f)) => f.display().to_string(),
        (None, None) => "nowhere".to_owned(),
    }
}

/// `egress check ROUTE METHOD URL`: `allow` (exit 0) or `deny` with the rule (exit 1).
pub(crate) fn check(config: &Config, route: &str, method: &str, url: &str) -> Result<ExitCode> {
    let Some(r) = config.egress.iter().find(|r| r.name == route) else {
        let names: Vec<&str> = config.egress.iter().map(|r| r.name.as_str()).collect();
        bail!(
            "no egress route {route:?} (the routes: {})",
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        );
    };
    Ok(match egress_verdict(r, method, url) {
        EgressVerdict::Allowed {
            target,
            audit_denied: None,
        } => {
            println!(
                "allow {} {target} (route {route}; the address is checked when sent)",
                method.to_ascii_uppercase()
            );
            ExitCode::SUCCESS
        }
        EgressVerdict::Allowed {
            target,
            audit_denied: Some((rule, reason)),
        } => {
            println!(
                "allow {} {target} (route {route} in AUDIT mode; enforced, rule {rule} would deny: {reason})",
                method.to_ascii_uppercase()
            );
            ExitCode::SUCCESS
        }
        EgressVerdict::Denied { rule, reason } => {
            println!("deny rule {rule}: {reason}");
            ExitCode::from(1)
        }
    })
}
