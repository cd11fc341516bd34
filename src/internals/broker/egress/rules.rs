//! An egress request checked against its route, without any I/O (the same check `roundtable-
//! sandbox egress check` answers with): the target parsed from the raw path (the host as the
//! guest wrote it: no URL parser has normalised `2130706434` into `127.0.0.2` yet), then, in
//! order, the controls that hold whatever the route says (scheme, userinfo, IP literals in
//! any form, `..` segments and encoded slashes), then the route's rules (its hosts, the
//! method, the path globs, the query and header matchers) and its `deny` rules, which win.

use crate::config::{EgressMode, EgressRoute};

/// Where a request goes, once parsed and allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// The host as written (a name, lower-cased; never an IP literal unless the route
    /// allows them).
    pub(crate) host: String,
    /// The port (443 unless given).
    pub(crate) port: u16,
    /// The path, starting with `/`, as sent upstream.
    pub(crate) path: String,
    /// The query, as the guest sent it.
    pub(crate) query: Option<String>,
}

impl Target {
    /// The path with every query value blanked, for the audit trail.
    pub(crate) fn audit_path(&self) -> String {
        match &self.query {
            None => self.path.clone(),
            Some(q) => {
                let names: Vec<&str> = q
                    .split('&')
                    .map(|pair| pair.split('=').next().unwrap_or(""))
                    .collect();
                format!("{}?{}", self.path, names.join("=&") + "=")
            }
        }
    }
}

/// Why a request is refused: the rule and a sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refused {
    pub(crate) rule: String,
    pub(crate) reason: String,
}

fn refused(rule: &str, reason: impl Into<String>) -> Refused {
    Refused {
        rule: rule.to_owned(),
        reason: reason.into(),
    }
}

/// The verdict on a request: where it goes, and the rule that would refuse it if the route
/// is in `audit` mode (sent all the same, logged as would-be denied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Allowed {
    pub(crate) target: Target,
    pub(crate) audit_denied: Option<Refused>,
}

/// Checks one request: `target` is what follows `/v1/egress/{route}/` in the raw path.
/// The controls before the route's rules refuse in every mode; the route's rules refuse in
/// `enforce` mode and are reported in `audit` mode.
pub(crate) fn check(
    route: &EgressRoute,
    method: &str,
    target: &str,
    query: Option<&str>,
    headers: &[(String, String)],
) -> Result<Allowed, Refused> {
    let target = parse(route, target, query)?;
    // Where it goes holds in every mode: in `audit` mode a route's hosts and ports were
    // reported only, so a credential route sent its credential to any host a guest named.
    where_to(route, &target)?;
    within_base(route, &target)?;
    let verdict = route_rules(route, method, &target, headers);
    match (verdict, route.mode) {
        (Ok(()), _) => Ok(Allowed {
            target,
            audit_denied: None,
        }),
        (Err(r), EgressMode::Audit) => Ok(Allowed {
            target,
            audit_denied: Some(r),
        }),
        (Err(r), EgressMode::Enforce) => Err(r),
    }
}

/// What `roundtable-sandbox egress check` answers: the verdict of a route's rules on one
/// request, without resolving or sending anything.
#[cfg(feature = "cli")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressVerdict {
    /// Allowed: where it would go (`host:port/path?query`), and in `audit` mode the rule
    /// that would refuse it in `enforce` mode, with its reason.
    Allowed {
        /// `host:port` and the path (and query) as sent upstream.
        target: String,
        /// In `audit` mode, the rule that would have refused it and why.
        audit_denied: Option<(String, String)>,
    },
    /// Refused by `rule`, for `reason` (the same rule and reason a guest would get).
    Denied {
        /// The rule.
        rule: String,
        /// Why.
        reason: String,
    },
}

/// The verdict of `route` on `method url`, as the broker would give it before resolving the
/// host. `url` is a whole URL for a route of host patterns, a path (with its query) under
/// the base for a route with a fixed upstream (or a whole URL under that base). The
/// address rules (what the host resolves to) are checked only when a request is sent.
#[cfg(feature = "cli")]
pub fn verdict(route: &EgressRoute, method: &str, url: &str) -> EgressVerdict {
    let denied = |r: Refused| EgressVerdict::Denied {
        rule: r.rule,
        reason: r.reason,
    };
    let (raw, query) = match &route.upstream {
        Some(base) => {
            let rest = url.strip_prefix(base.trim_end_matches('/')).unwrap_or(url);
            let rest = rest.split('#').next().unwrap_or("");
            match rest.split_once('?') {
                Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
                None => (rest.to_owned(), None),
            }
        }
        None => match roundtable_sandbox_protocol::egress::url_target(url) {
            Some(t) => t,
            None => {
                return denied(refused(
                    "url",
                    format!(
                    "{url:?} is not scheme://host/path (routes of host patterns take whole URLs)"
                ),
                ))
            }
        },
    };
    match check(
        route,
        &method.to_ascii_uppercase(),
        &raw,
        query.as_deref(),
        &[],
    ) {
        Ok(a) => EgressVerdict::Allowed {
            target: format!(
                "{}:{}{}{}",
                a.target.host,
                a.target.port,
                a.target.path,
                a.target.query.map(|q| format!("?{q}")).unwrap_or_default()
            ),
            audit_denied: a.audit_denied.map(|r| (r.rule, r.reason)),
        },
        Err(r) => denied(r),
    }
}

/// The target of `raw`: for an upstream route, a path under its base; for a route of host
/// patterns, `scheme/host[:port]/path`. The controls that hold in every mode run here.
fn parse(route: &EgressRoute, raw: &str, query: Option<&str>) -> Result<Target, Refused> {
    let (host, port, path) = match &route.upstream {
        Some(base) => {
            let url = reqwest::Url::parse(base)
                .map_err(|_| refused("upstream", "the route's upstream is invalid"))?;
            let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
            let port = url.port().unwrap_or(443);
            let base = unreserved_decoded(url.path().trim_end_matches('/'));
            (
                host,
                port,
                format!("{base}/{}", raw.trim_start_matches('/')),
            )
        }
        None => {
            let (scheme, rest) = raw
                .split_once('/')
                .ok_or_else(|| refused("target", "give the URL as scheme/host/path"))?;
            if scheme != "https" {
                return Err(refused(
                    "scheme",
                    format!("only https is allowed, not {scheme:?}"),
                ));
            }
            let (authority, path) = match rest.split_once('/') {
                Some((a, p)) => (a, format!("/{p}")),
                None => (rest, "/".to_owned()),
            };
            let (host, port) = authority_parts(authority)?;
            (host, port, path)
        }
    };
    // What is matched is what is sent: `/%61dmin` is `/admin` to the upstream, so to the
    // route's globs and deny rules too.
    let path = unreserved_decoded(&path);
    if !route.allow_ip_literals && ip_literal(&host) {
        return Err(refused(
            "ip_literal",
            format!("the host {host:?} is an IP address; give a name"),
        ));
    }
    if !route.allow_unusual_paths {
        unusual_path(&path)?;
    }
    Ok(Target {
        host,
        port,
        path,
        query: query.map(str::to_owned),
    })
}

/// The host and port of an authority (`host[:port]`); userinfo is refused in every mode.
fn authority_parts(authority: &str) -> Result<(String, u16), Refused> {
    if authority.contains('@') {
        return Err(refused(
            "userinfo",
            "a user or password in the URL is not allowed",
        ));
    }
    if authority.contains('%') || authority.contains('\\') {
        return Err(refused("host", "the host holds an escape or a backslash"));
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (v6, after) = rest
            .split_once(']')
            .ok_or_else(|| refused("host", "an unclosed [ in the host"))?;
        (format!("[{v6}]"), after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (authority.to_owned(), None),
        }
    };
    let port = match port {
        None => 443,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| refused("port", format!("invalid port {p:?}")))?,
    };
    if host.is_empty() {
        return Err(refused("host", "the URL has no host"));
    }
    Ok((host.to_ascii_lowercase(), port))
}

/// Whether `host` is an IP address in any form a resolver or URL parser reads as one: IPv6
/// in brackets (IPv4-mapped included), dotted IPv4 with parts in decimal, octal (`0177`) or
/// hex (`0x7f`), fewer parts (`127.1`, `2130706434`), or a name whose last label is a
/// number (which URL parsers take for IPv4).
pub(crate) fn ip_literal(host: &str) -> bool {
    if host.starts_with('[') || host.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let trimmed = host.trim_end_matches('.');
    let parts: Vec<&str> = trimmed.split('.').collect();
    let number = |p: &str| {
        let p = p.to_ascii_lowercase();
        if let Some(hex) = p.strip_prefix("0x") {
            hex.is_empty() || hex.bytes().all(|b| b.is_ascii_hexdigit())
        } else {
            !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())
        }
    };
    parts.last().is_some_and(|last| number(last))
}

/// `path` with each percent-escape of an unreserved character (a letter, a digit, `-`,
/// `.`, `_`, `~`) decoded, as RFC 3986 makes them equivalent: a server reads `/%61dmin` as
/// `/admin`, which a deny rule of `/admin/**` must see. Other escapes stay, in upper case.
pub(crate) fn unreserved_decoded(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = (bytes[i] == b'%'
            && i + 2 < bytes.len()
            && bytes[i + 1].is_ascii_hexdigit()
            && bytes[i + 2].is_ascii_hexdigit())
        .then(|| u8::from_str_radix(&path[i + 1..i + 3], 16).ok())
        .flatten();
        match escape {
            Some(b) if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => {
                out.push(b as char);
                i += 3;
            }
            Some(_) => {
                out.push('%');
                out.push_str(&path[i + 1..i + 3].to_ascii_uppercase());
                i += 3;
            }
            None => {
                let ch = path[i..].chars().next().unwrap_or_default();
                out.push(ch);
                i += ch.len_utf8().max(1);
            }
        }
    }
    out
}

/// Refuses `..` segments (raw or encoded), encoded slashes or backslashes, empty segments
/// (`//`, which servers that merge slashes read as one) and `;` (a path parameter, which
/// some servers strip before routing): each lets a path pass a glob as one thing and reach
/// the upstream as another.
fn unusual_path(path: &str) -> Result<(), Refused> {
    // As written and as decoded again (`%252e` is `%2e` to a server that decodes twice).
    let mut view = path.to_ascii_lowercase();
    for _ in 0..4 {
        unusual_once(path, &view)?;
        let again = view.replace("%25", "%");
        if again == view {
            return Ok(());
        }
        view = again;
    }
    Err(refused(
        "encoded_slash",
        "a path encoded more than four times over is not allowed",
    ))
}

/// [`unusual_path`] of one view (`lower`) of `path`.
fn unusual_once(path: &str, lower: &str) -> Result<(), Refused> {
    if lower.contains("%2f") || lower.contains("%5c") || path.contains('\\') {
        return Err(refused(
            "encoded_slash",
            "an encoded slash or a backslash in the path is not allowed",
        ));
    }
    let decoded = lower.replace("%2e", ".");
    if decoded.split('/').any(|seg| seg == ".." || seg == ".") {
        return Err(refused(
            "dot_segment",
            "a . or .. segment in the path is not allowed",
        ));
    }
    if path.contains("//") {
        return Err(refused(
            "empty_segment",
            "an empty segment (//) in the path is not allowed",
        ));
    }
    if lower.contains(';') || lower.contains("%3b") {
        return Err(refused(
            "path_parameter",
            "a ; (a path parameter) in the path is not allowed",
        ));
    }
    Ok(())
}

/// A route's hosts and ports (a host-pattern route's; an upstream's are its own).
fn where_to(route: &EgressRoute, target: &Target) -> Result<(), Refused> {
    if route.upstream.is_none() && !route.hosts.iter().any(|p| host_matches(p, &target.host)) {
        return Err(refused(
            "host",
            format!("{} is not one of this route's hosts", target.host),
        ));
    }
    // A deny rule naming only hosts says where no request goes: held in every mode, as the
    // route's own hosts are (in `audit` mode a credential route sent its credential to a
    // host such a rule excluded).
    for (i, rule) in route.deny.iter().enumerate() {
        if !rule.hosts.is_empty()
            && rule.methods.is_empty()
            && rule.paths.is_empty()
            && rule.hosts.iter().any(|p| host_matches(p, &target.host))
        {
            return Err(refused(
                &format!("deny[{i}]"),
                "a deny rule of this route matches",
            ));
        }
    }
    let ports: &[u16] = match route.ports.is_empty() {
        true => &[443],
        false => &route.ports,
    };
    if route.upstream.is_none() && !ports.contains(&target.port) {
        let allowed: Vec<String> = ports.iter().map(u16::to_string).collect();
        return Err(refused(
            "port",
            format!(
                "port {} is not allowed (allowed: {})",
                target.port,
                allowed.join(", ")
            ),
        ));
    }
    Ok(())
}

/// The route's own rules: the method, the paths, the query and the headers; then its
/// `deny` rules.
fn route_rules(
    route: &EgressRoute,
    method: &str,
    target: &Target,
    headers: &[(String, String)],
) -> Result<(), Refused> {
    if !route.methods.iter().any(|m| m == method) {
        return Err(refused(
            "method",
            format!(
                "{method} is not allowed (allowed: {})",
                route.methods.join(", ")
            ),
        ));
    }
    let rel = relative_path(route, &target.path);
    // A glob allows the path as written and as its dot segments resolve (with
    // `allow_unusual_paths`, `/public/../admin` is `/admin` to the upstream), and there as
    // the most lenient server reads it too (`\` a `/`, escapes decoded again, `...` a
    // parent, `;` parameters dropped), its case kept (a trailing slash either way).
    let resolved = dots_resolved(rel);
    let lenient = route
        .allow_unusual_paths
        .then(|| lenient_relative_as(route, &target.path, false))
        .flatten();
    let allows = |g: &str| {
        glob(g, rel)
            && glob(g, &resolved)
            && lenient
                .as_deref()
                .is_none_or(|l| glob(g, l) || glob(g, &format!("{l}/")))
    };
    if !route.paths.is_empty() && !route.paths.iter().any(|g| allows(g)) {
        return Err(refused(
            "path",
            format!("{rel} matches none of this route's paths"),
        ));
    }
    if let Some(allowed) = &route.query {
        // `;` separates parameters too for some servers: `q=x;admin=1` is two of them.
        for pair in target
            .query
            .iter()
            .flat_map(|q| q.split(['&', ';']))
            .filter(|p| !p.is_empty())
        {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let ok = allowed.get(name).is_some_and(|g| glob_text(g, value));
            if !ok {
                return Err(refused(
                    "query",
                    format!("the query parameter {name:?} is not allowed with that value"),
                ));
            }
        }
    }
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if let Some((_, g)) = route
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(&lower))
        {
            if !glob_text(g, value) {
                return Err(refused(
                    "header",
                    format!("the header {lower} is not allowed with that value"),
                ));
            }
        }
    }
    // A deny rule's paths match the path as written and as a lenient server reads it
    // ([`lenient_view`]): in any case, decoded again, its dot segments resolved, without a
    // trailing slash and without a segment's trailing dots and spaces. (An allow glob
    // matches as written and resolved: a miss there only refuses.)
    if route.deny.is_empty() {
        return Ok(());
    }
    let folded = rel.to_ascii_lowercase();
    // Of the whole path, then the base taken off (`../v1/internal` under `/v1` resolves to
    // `/v1/internal`: taken off first, the base hid it); [`within_base`] refused one that
    // leaves the base.
    let Some(lenient) = lenient_relative(route, &target.path) else {
        // (Refused before by [`within_base`].)
        return Err(refused(
            "base",
            "the path leaves the route's base as a server reads it",
        ));
    };
    for (i, rule) in route.deny.iter().enumerate() {
        // A rule naming GET covers HEAD, which servers answer with the GET handler.
        let methods = rule.methods.is_empty()
            || rule
                .methods
                .iter()
                .any(|m| m == method || (method == "HEAD" && m == "GET"));
        let paths = rule.paths.is_empty()
            || rule.paths.iter().any(|g| {
                let g = g.to_ascii_lowercase();
                glob(&g, &folded) || glob(&g, &lenient)
            });
        let hosts =
            rule.hosts.is_empty() || rule.hosts.iter().any(|p| host_matches(p, &target.host));
        if methods && paths && hosts {
            return Err(refused(
                &format!("deny[{i}]"),
                "a deny rule of this route matches",
            ));
        }
    }
    Ok(())
}

/// A path as the most lenient server reads it, for the deny rules and, with
/// `allow_unusual_paths`, the allow globs too (it may name a path no server serves: a rule
/// checked in it refuses more, never less): percent-decoded until nothing changes (a proxy
/// and an application each decode once), `\` and `//` as `/`, the dot segments resolved,
/// each segment's path parameters (`;…`) and trailing dots and spaces dropped (IIS reads
/// `/admin./` and `/admin%20/` as `/admin/`), no trailing slash (`/admin/` is `/admin` to
/// Express and Rails); lowercase with `fold` (for the deny rules), its case kept without
/// (for the allow globs, which name paths in the case the upstream serves them).
fn lenient_view(path: &str, fold: bool) -> String {
    let mut text = path.to_owned();
    for _ in 0..4 {
        let decoded = percent_encoding::percent_decode_str(&text)
            .decode_utf8_lossy()
            .into_owned();
        if decoded == text {
            break;
        }
        text = decoded;
    }
    // Folded as a server that ignores case in Unicode may (`ı` and `ſ` are `i` and `s`
    // to Java's `equalsIgnoreCase`).
    let text = if fold {
        text.to_uppercase().to_lowercase()
    } else {
        text
    };
    let text = text.replace('\\', "/");
    let mut resolved: Vec<&str> = Vec::new();
    for segment in text.split('/') {
        // `/admin;x/` is `/admin/` to servlet containers and Spring, and `..;x` is `..`.
        let segment = segment.split(';').next().unwrap_or_default();
        // `.` is this segment, `..` (and IIS's `...`) the parent.
        if !segment.is_empty() && segment.chars().all(|c| c == '.') {
            if segment.len() >= 2 {
                resolved.pop();
            }
            continue;
        }
        let segment = segment.trim_end_matches(['.', ' ']);
        if !segment.is_empty() {
            resolved.push(segment);
        }
    }
    format!("/{}", resolved.join("/"))
}

/// [`lenient_view`] of the whole path, under an upstream's base the part after the base (the
/// base in the same view); `None` when it is not under the base.
fn lenient_relative(route: &EgressRoute, path: &str) -> Option<String> {
    lenient_relative_as(route, path, true)
}

/// [`lenient_relative`] in [`lenient_view`]'s `fold`.
fn lenient_relative_as(route: &EgressRoute, path: &str, fold: bool) -> Option<String> {
    let view = lenient_view(path, fold);
    let base = base_path(route)
        .map(|b| lenient_view(&b, fold))
        .filter(|b| b != "/");
    let Some(base) = base else {
        return Some(view);
    };
    match view.strip_prefix(base.as_str()) {
        Some("") => Some("/".to_owned()),
        Some(rest) if rest.starts_with('/') => Some(rest.to_owned()),
        _ => None,
    }
}

/// A path that leaves the upstream's base as the most lenient server reads it
/// (`../v2/x` under `/v1`) is refused in every mode, as a host outside the route is: it
/// would carry the route's credential to what the operator did not name.
fn within_base(route: &EgressRoute, target: &Target) -> Result<(), Refused> {
    match lenient_relative(route, &target.path) {
        Some(_) => Ok(()),
        None => Err(refused(
            "base",
            "the path leaves the route's base as a server reads it",
        )),
    }
}

/// `path` with its `.` and `..` segments resolved as RFC 3986 does (`..` at the root
/// stays there), nothing else changed.
fn dots_resolved(path: &str) -> String {
    if !path.split('/').any(|seg| seg == "." || seg == "..") {
        return path.to_owned();
    }
    let mut kept: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let last = segments.len() - 1;
    for (i, seg) in segments.into_iter().enumerate() {
        match seg {
            "." | ".." => {
                if seg == ".." {
                    kept.pop();
                }
                if i == last {
                    kept.push("");
                }
            }
            _ => kept.push(seg),
        }
    }
    format!("/{}", kept.join("/"))
}

/// The path of a route's upstream (its base), as configured.
fn base_path(route: &EgressRoute) -> Option<String> {
    let url = reqwest::Url::parse(route.upstream.as_deref()?).ok()?;
    Some(url.path().to_owned())
}

/// The path the route's globs see: under an upstream's base, the part after it.
fn relative_path<'a>(route: &EgressRoute, path: &'a str) -> &'a str {
    let base = base_path(route)
        .map(|b| unreserved_decoded(b.trim_end_matches('/')))
        .unwrap_or_default();
    match path.strip_prefix(base.as_str()) {
        Some(rest) if rest.starts_with('/') => rest,
        _ => path,
    }
}

/// A host pattern: `*` any host, `*.domain` a subdomain of it (not the domain itself),
/// otherwise the exact name (case-insensitive).
pub(crate) fn host_matches(pattern: &str, host: &str) -> bool {
    let host = host.trim_end_matches('.');
    if pattern == "*" {
        return true;
    }
    match pattern.strip_prefix("*.") {
        Some(domain) => {
            host.len() > domain.len() + 1 && {
                let (sub, dom) = host.split_at(host.len() - domain.len());
                sub.ends_with('.') && dom.eq_ignore_ascii_case(domain)
            }
        }
        None => host.eq_ignore_ascii_case(pattern),
    }
}

/// A path glob: `*` matches within one segment, `**` any run of segments (none included;
/// one per glob, checked at startup).
pub(crate) fn glob(pattern: &str, path: &str) -> bool {
    let (p, s): (Vec<&str>, Vec<&str>) = (pattern.split('/').collect(), path.split('/').collect());
    segments(&p, &s)
}

fn segments(p: &[&str], s: &[&str]) -> bool {
    match (p.first(), s.first()) {
        (None, None) => true,
        (Some(&"**"), _) => (0..=s.len()).any(|k| segments(&p[1..], &s[k..])),
        (Some(pp), Some(ss)) => glob_text(pp, ss) && segments(&p[1..], &s[1..]),
        _ => false,
    }
}

/// A text glob: `*` matches any run of characters.
pub(crate) fn glob_text(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(i) => rest = &rest[i + middle.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DenyRule;

    fn web() -> EgressRoute {
        EgressRoute::hosts("web", &["*"])
    }

    fn rule_of(route: &EgressRoute, method: &str, target: &str) -> Option<String> {
        check(route, method, target, None, &[])
            .err()
            .map(|r| r.rule)
    }

    #[test]
    fn ip_literals_in_every_form_are_refused() {
        for host in [
            "127.0.0.2",
            "2130706434",
            "0177.0.0.2",
            "0x7f000002",
            "0x7f.0.0.2",
            "127.1",
            "[::ffff:127.0.0.2]",
            "[::1]",
            "example.123",
        ] {
            assert_eq!(
                rule_of(&web(), "GET", &format!("https/{host}/x")).as_deref(),
                Some("ip_literal"),
                "{host}"
            );
        }
        for host in ["face.cafe", "en.wikipedia.org", "x0x.io"] {
            assert!(!ip_literal(host), "{host}");
        }
    }

    #[test]
    fn userinfo_dot_segments_and_encoded_slashes_are_refused() {
        let r = web();
        assert_eq!(
            rule_of(&r, "GET", "https/u:p@example.com/x").as_deref(),
            Some("userinfo")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/example.com/a/../b").as_deref(),
            Some("dot_segment")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/example.com/a/%2e%2E/b").as_deref(),
            Some("dot_segment")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/example.com/a%2Fb").as_deref(),
            Some("encoded_slash")
        );
        assert_eq!(
            rule_of(&r, "GET", "http/example.com/").as_deref(),
            Some("scheme")
        );
        let mut lax = web();
        lax.allow_unusual_paths = true;
        assert_eq!(rule_of(&lax, "GET", "https/example.com/a%2Fb"), None);
    }

    /// A path is matched as the upstream reads it: an escaped letter is the letter, and
    /// the shapes servers read as another path (`//`, `;`) are refused.
    #[test]
    fn a_deny_rule_sees_the_path_the_upstream_reads() {
        let mut r = EgressRoute::hosts("site", &["*"]);
        r.deny = vec![DenyRule {
            paths: vec!["/admin/**".into()],
            ..Default::default()
        }];
        for path in [
            "/admin/x",
            "/%61dmin/x",
            "/%61%64%6D%69%6e/x",
            "/adm%69n/x",
            "/ADMIN/x",
            "/%41dmin/x",
        ] {
            assert_eq!(
                rule_of(&r, "GET", &format!("https/example.com{path}")).as_deref(),
                Some("deny[0]"),
                "{path}"
            );
        }
        for (path, rule) in [
            ("//admin/x", "empty_segment"),
            ("/a//b", "empty_segment"),
            ("/admin;x/y", "path_parameter"),
            ("/admin%3bx/y", "path_parameter"),
        ] {
            assert_eq!(
                rule_of(&r, "GET", &format!("https/example.com{path}")).as_deref(),
                Some(rule),
                "{path}"
            );
        }
        // Forms a lenient server reads as the denied path: a trailing slash, a segment's
        // trailing dots and spaces (IIS), an escape escaped again.
        let mut exact = EgressRoute::hosts("site", &["*"]);
        exact.deny = vec![DenyRule {
            paths: vec!["/admin".into(), "/admin/**".into()],
            ..Default::default()
        }];
        for path in [
            "/admin/",
            "/admin./x",
            "/admin%20/x",
            "/admin%2e/x",
            "/%2561dmin/x",
        ] {
            assert_eq!(
                rule_of(&exact, "GET", &format!("https/example.com{path}")).as_deref(),
                Some("deny[0]"),
                "{path}"
            );
        }
        // With `allow_unusual_paths`, a path sent with its dot segments is denied as the
        // path they resolve to.
        let mut lax = exact.clone();
        lax.allow_unusual_paths = true;
        assert_eq!(
            rule_of(&lax, "GET", "https/example.com/x/../admin/y").as_deref(),
            Some("deny[0]")
        );
        assert_eq!(
            rule_of(&exact, "GET", "https/example.com/administrators"),
            None
        );
        // A rule naming GET covers HEAD (servers answer it with the GET handler).
        let mut get_only = EgressRoute::hosts("site", &["*"]);
        get_only.deny = vec![DenyRule {
            methods: vec!["GET".into()],
            paths: vec!["/private/**".into()],
            ..Default::default()
        }];
        assert_eq!(
            rule_of(&get_only, "HEAD", "https/example.com/private/x").as_deref(),
            Some("deny[0]")
        );
        // What is sent: unreserved escapes decoded, the others kept (upper case).
        let t = check(
            &r,
            "GET",
            "https/example.com/%7euser/a%20b%c3%a9/",
            None,
            &[],
        )
        .unwrap()
        .target;
        assert_eq!(t.path, "/~user/a%20b%C3%A9/");
        assert_eq!(unreserved_decoded("/%4"), "/%4");
        assert_eq!(unreserved_decoded("/%+1x/é%"), "/%+1x/é%");
    }

    #[test]
    fn a_query_allow_list_checks_every_parameter_however_separated() {
        let mut r = EgressRoute::hosts("search", &["*"]);
        r.query = Some([("q".to_owned(), "*".to_owned())].into());
        let verdict = |q: &str| {
            check(&r, "GET", "https/example.com/s", Some(q), &[])
                .err()
                .map(|r| r.rule)
        };
        assert_eq!(verdict("q=rust"), None);
        assert_eq!(verdict("q=a&q=b"), None);
        assert_eq!(verdict("q=x&admin=1").as_deref(), Some("query"));
        assert_eq!(verdict("q=x;admin=1").as_deref(), Some("query"));
        assert_eq!(verdict("%71=x").as_deref(), Some("query"));
    }

    #[test]
    fn route_rules_then_deny_rules_which_win() {
        let mut r = EgressRoute::hosts("wiki", &["*.wikipedia.org"]);
        r.paths = vec!["/wiki/*".into()];
        r.deny = vec![DenyRule {
            paths: vec!["/wiki/Secret*".into()],
            ..Default::default()
        }];
        assert_eq!(rule_of(&r, "GET", "https/en.wikipedia.org/wiki/Rust"), None);
        assert_eq!(
            rule_of(&r, "GET", "https/wikipedia.org/wiki/Rust").as_deref(),
            Some("host")
        );
        assert_eq!(
            rule_of(&r, "POST", "https/en.wikipedia.org/wiki/Rust").as_deref(),
            Some("method")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/en.wikipedia.org/w/index.php").as_deref(),
            Some("path")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/en.wikipedia.org/wiki/SecretPage").as_deref(),
            Some("deny[0]")
        );
        // Port 443 alone unless the route names others.
        assert_eq!(
            rule_of(&r, "GET", "https/en.wikipedia.org:8443/wiki/Rust").as_deref(),
            Some("port")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/en.wikipedia.org:443/wiki/Rust"),
            None
        );
        r.ports = vec![443, 8443];
        assert_eq!(
            rule_of(&r, "GET", "https/en.wikipedia.org:8443/wiki/Rust"),
            None
        );
        assert_eq!(
            check(&r, "GET", "https/en.wikipedia.org:22/wiki/Rust", None, &[])
                .unwrap_err()
                .reason,
            "port 22 is not allowed (allowed: 443, 8443)"
        );
        // Audit mode: sent, with the rule that would have refused it.
        r.mode = EgressMode::Audit;
        let allowed = check(&r, "POST", "https/en.wikipedia.org/wiki/Rust", None, &[]).unwrap();
        assert_eq!(allowed.audit_denied.unwrap().rule, "method");
        // ... but not the controls that hold in every mode: the address, and where it
        // goes (its hosts and ports: a credential went to any host a guest named).
        assert_eq!(
            rule_of(&r, "GET", "https/0x7f000002/wiki/x").as_deref(),
            Some("ip_literal")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/evil.example/wiki/x").as_deref(),
            Some("host")
        );
        assert_eq!(
            rule_of(&r, "GET", "https/en.wikipedia.org:22/wiki/x").as_deref(),
            Some("port")
        );
    }

    #[test]
    fn an_upstream_routes_path_is_under_its_base() {
        let mut r = EgressRoute::upstream("api", "https://api.example.com/v2");
        r.paths = vec!["/items/**".into()];
        let t = check(&r, "GET", "items/7/parts", Some("a=1&b=2"), &[])
            .unwrap()
            .target;
        assert_eq!(
            (t.host.as_str(), t.port, t.path.as_str()),
            ("api.example.com", 443, "/v2/items/7/parts")
        );
        assert_eq!(t.audit_path(), "/v2/items/7/parts?a=&b=");
        assert_eq!(rule_of(&r, "GET", "users").as_deref(), Some("path"));
    }

    /// The review's bypasses of round 7: each one's path is denied, or refused.
    #[test]
    fn deny_rules_hold_through_a_base_parameters_case_folding_and_audit_mode() {
        // A host-only deny rule holds in `audit` mode: where a request goes is never
        // relaxed (the route's credential went to the excluded host).
        let mut audit = EgressRoute::hosts("site", &["*.example.com"]);
        audit.mode = EgressMode::Audit;
        audit.deny = vec![DenyRule {
            hosts: vec!["uploads.example.com".into()],
            ..Default::default()
        }];
        assert_eq!(
            rule_of(&audit, "GET", "https/uploads.example.com/x").as_deref(),
            Some("deny[0]")
        );
        assert_eq!(rule_of(&audit, "GET", "https/www.example.com/x"), None);
        // Dot segments resolved across an upstream's base.
        let mut api = EgressRoute::upstream("api", "https://api.example.com/v1");
        api.allow_unusual_paths = true;
        api.deny = vec![DenyRule {
            paths: vec!["/internal/**".into()],
            ..Default::default()
        }];
        assert_eq!(
            rule_of(&api, "GET", "../v1/internal/x").as_deref(),
            Some("deny[0]")
        );
        assert_eq!(rule_of(&api, "GET", "../v2/x").as_deref(), Some("base"));
        assert_eq!(rule_of(&api, "GET", "public/x"), None);
        // Without deny rules, and in audit mode, the base holds all the same; the paths
        // allowed are matched as they resolve.
        let mut bare = EgressRoute::upstream("api", "https://api.example.com/v1");
        bare.allow_unusual_paths = true;
        bare.paths = vec!["/public/**".into()];
        assert_eq!(rule_of(&bare, "GET", "../v2/x").as_deref(), Some("base"));
        assert_eq!(
            rule_of(&bare, "GET", "public/../../admin").as_deref(),
            Some("base")
        );
        assert_eq!(
            rule_of(&bare, "GET", "public/../admin").as_deref(),
            Some("path")
        );
        assert_eq!(rule_of(&bare, "GET", "public/a/../b"), None);
        bare.mode = EgressMode::Audit;
        assert_eq!(rule_of(&bare, "GET", "../v2/x").as_deref(), Some("base"));
        let mut site = EgressRoute::hosts("site", &["*"]);
        site.allow_unusual_paths = true;
        site.paths = vec!["/public/**".into()];
        for path in [
            "/public/../../admin",
            "/public\\..\\admin",
            "/public/%252e%252e/admin",
            "/public/.../admin",
            "/public/..;x/admin",
        ] {
            assert_eq!(
                rule_of(&site, "GET", &format!("https/example.com{path}")).as_deref(),
                Some("path"),
                "{path}"
            );
        }
        for path in ["/public/", "/public/a/../b", "/public/A%20b", "/public/x;y"] {
            assert_eq!(
                rule_of(&site, "GET", &format!("https/example.com{path}")),
                None,
                "{path}"
            );
        }
        assert_eq!(dots_resolved("/a/b/../../../c/./"), "/c/");
        assert_eq!(dots_resolved("/a/.."), "/");
        assert_eq!(dots_resolved("/a/b"), "/a/b");
        // Path parameters, and Unicode case folding (`ı`, `ſ`).
        let mut lax = EgressRoute::hosts("site", &["*"]);
        lax.allow_unusual_paths = true;
        lax.deny = vec![DenyRule {
            paths: vec!["/admin/**".into(), "/settings/**".into()],
            ..Default::default()
        }];
        for path in [
            "/admin;x/y",
            "/admin%3bx/y",
            "/public/..;x/admin/y",
            "/adm%C4%B1n/x",
            "/%C5%BFettings/x",
        ] {
            assert_eq!(
                rule_of(&lax, "GET", &format!("https/example.com{path}")).as_deref(),
                Some("deny[0]"),
                "{path}"
            );
        }
        // Escapes escaped again are refused as the escapes they become.
        let mut public = EgressRoute::hosts("site", &["*"]);
        public.paths = vec!["/public/**".into()];
        for (path, rule) in [
            ("/public/%252e%252e/admin", "dot_segment"),
            ("/public/x%252f..%252f..%252fadmin", "encoded_slash"),
            ("/public/%25252e%25252e/admin", "dot_segment"),
        ] {
            assert_eq!(
                rule_of(&public, "GET", &format!("https/example.com{path}")).as_deref(),
                Some(rule),
                "{path}"
            );
        }
        assert_eq!(
            rule_of(&public, "GET", "https/example.com/public/100%25"),
            None
        );
    }

    #[test]
    fn globs() {
        assert!(glob("/a/*/c", "/a/b/c"));
        assert!(!glob("/a/*/c", "/a/b/x/c"));
        assert!(glob("/a/**", "/a/b/x/c"));
        // `**` inside a glob: any run of segments, then the rest of the glob.
        assert!(glob("/repos/**/issues", "/repos/x/y/issues"));
        assert!(glob("/repos/**/issues", "/repos/issues"));
        assert!(!glob("/repos/**/issues", "/repos/x/admin/delete"));
        assert!(!glob("/a/**/c", "/a/b/x"));
        assert!(glob_text("v*.json", "v12.json"));
        assert!(!glob_text("v*.json", "v12.txt"));
        assert!(host_matches("*.example.com", "a.b.example.com"));
        assert!(!host_matches("*.example.com", "example.com"));
        assert!(!host_matches("*.example.com", "evilexample.com"));
    }
}
