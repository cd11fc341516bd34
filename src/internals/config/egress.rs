//! The `[[egress]]` sections: the web routes the broker serves a turn ([`EgressRoute`]), in
//! one of two forms (a fixed `upstream` the guest gives a path under, or `hosts` patterns
//! the guest gives a whole URL for), each with its rules (methods, path globs, query and
//! header matchers, `deny` rules that win), its mode (`enforce`, the default, or `audit`),
//! its credential ([`KeyRef`], placed as [`CredentialPlacement`] says), its caps
//! ([`EgressLimits`]), its redirects, and the private ranges it may reach
//! (`allow_private`). No route: no egress. Every rule is checked here, once, at startup.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::Deserialize;

use super::{valid_tool_name, KeyRef, PolicyError};

/// One egress route.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressRoute {
    /// Its name: the path segment after `/v1/egress/` (`[a-z0-9_-]{1,64}`).
    pub name: String,
    /// What it is for, as the model is told.
    #[serde(default)]
    pub description: String,
    /// A fixed upstream, `https://host[:port][/base]`: the guest gives a path under it.
    #[serde(default)]
    pub upstream: Option<String>,
    /// Host patterns (exact names, `*.domain`, or `*` for any public host): the guest gives
    /// the whole URL.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// The ports a guest may name on a route of host patterns (default: 443 alone; a fixed
    /// upstream names its own).
    #[serde(default)]
    pub ports: Vec<u16>,
    /// The methods allowed (default `GET` and `HEAD`).
    #[serde(default = "default_methods")]
    pub methods: Vec<String>,
    /// Path globs the request's path must match (`*`: one segment's characters, `**`: a
    /// whole segment matching any run of segments, none included, one per glob); default:
    /// any path.
    #[serde(default)]
    pub paths: Vec<String>,
    /// When set, every query parameter must be named here and its value match the glob.
    #[serde(default)]
    pub query: Option<BTreeMap<String, String>>,
    /// Headers the guest may send beyond the safe ones (`accept`, `accept-language`,
    /// `content-type`, `if-none-match`, `if-modified-since`, `range` but on a route with a
    /// credential, whose echo asked for in pieces would pass the redaction), each value matching
    /// its glob; any other header of the guest's is dropped (`authorization`, `cookie` and
    /// `proxy-*` always). A header the broker sets or frames the request with
    /// (`content-length`, `transfer-encoding`, `accept-encoding`, `user-agent`, …) cannot be
    /// named.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Rules that refuse what they match, whatever else allows it.
    #[serde(default)]
    pub deny: Vec<DenyRule>,
    /// `enforce` (the default) or `audit` (allowed, logged as would-be denied; the address
    /// rules are enforced either way).
    #[serde(default)]
    pub mode: EgressMode,
    /// The operator's credential, added at the boundary (never seen by the guest).
    #[serde(default)]
    pub credential: Option<KeyRef>,
    /// Where the credential goes (default a bearer token).
    #[serde(default)]
    pub credential_as: CredentialPlacement,
    /// Private or loopback ranges this route may reach (`["127.0.0.2/32"]`); `doctor` flags
    /// it. Nothing private is reachable otherwise.
    #[serde(default)]
    pub allow_private: Vec<String>,
    /// Hosts given as IP literals (in any form) are refused unless this is set.
    #[serde(default)]
    pub allow_ip_literals: bool,
    /// `..` segments, encoded slashes, empty segments (`//`) and `;` in the path are
    /// refused unless this is set.
    #[serde(default)]
    pub allow_unusual_paths: bool,
    /// A PEM file of CA certificates this route trusts beside the usual web roots (a
    /// private deployment, the tests).
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// `none` (the default: a 3xx is the guest's answer) or `same_route` (followed, each
    /// hop checked as a new request of this route, at most 5).
    #[serde(default)]
    pub redirects: Redirects,
    /// Response headers removed before the guest sees them, besides `set-cookie` and
    /// `set-cookie2`, which are always removed (default: `set-cookie`).
    #[serde(default = "default_strip")]
    pub strip_response_headers: Vec<String>,
    /// The caps.
    #[serde(default)]
    pub limits: EgressLimits,
}

/// A rule that refuses what it matches; an unset part matches anything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenyRule {
    /// Methods it matches.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Path globs it matches.
    #[serde(default)]
    pub paths: Vec<String>,
    /// Host patterns it matches.
    #[serde(default)]
    pub hosts: Vec<String>,
}

/// Whether a route's rules refuse or only report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EgressMode {
    /// A request a rule refuses is refused (the default).
    #[default]
    Enforce,
    /// A request a rule would refuse is sent and logged as would-be denied (the address
    /// rules still refuse). Flagged by `explain` and `doctor`.
    Audit,
}

/// Where a route's credential goes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum CredentialPlacement {
    /// `Authorization: Bearer <credential>` (the default).
    #[default]
    Bearer,
    /// `Authorization: Basic base64(<credential>)`, the credential being `user:password`.
    Basic,
    /// A header of this name, its value `format` with `{}` replaced by the credential.
    Header {
        /// The header.
        name: String,
        /// Its value (default `{}`).
        #[serde(default = "default_format")]
        format: String,
    },
    /// A query parameter of this name.
    Query {
        /// The parameter.
        name: String,
    },
    /// The path segment `{credential}` in the upstream's base is replaced by it.
    PathSegment,
}

/// Whether redirects are followed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Redirects {
    /// Not followed: the 3xx is the guest's answer (the default).
    #[default]
    None,
    /// Followed within the route, each hop checked as a new request (at most 5 hops).
    SameRoute,
}

/// A route's caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressLimits {
    /// A request's body, bytes (`413` past it).
    pub max_request_bytes: usize,
    /// A request's headers (the guest's, forwarded), bytes.
    pub max_header_bytes: usize,
    /// A response's body as it arrives (identity encoding is asked; nothing is ever
    /// decompressed on the host), bytes (`502` past it).
    pub max_response_bytes: usize,
    /// Connecting (TCP and TLS), milliseconds.
    pub connect_timeout_ms: u64,
    /// The whole exchange, from the connection to the body's last byte, milliseconds.
    pub timeout_ms: u64,
    /// Requests per turn (`429` past it).
    pub max_requests_per_turn: u32,
    /// Response bytes per turn, heads and bodies (`429` once spent). (An answer's head is
    /// at most 64 KiB: past it the exchange fails with `502`.)
    pub max_bytes_in_per_turn: u64,
    /// Request bytes per turn (paths, queries, bodies and the guest's headers that are
    /// sent upstream; `429` once spent): what a route lets a guest carry out of its
    /// workspace.
    pub max_bytes_out_per_turn: u64,
}

impl Default for EgressLimits {
    fn default() -> Self {
        Self {
            max_request_bytes: 64 * 1024,
            max_header_bytes: 8 * 1024,
            max_response_bytes: 1 << 20,
            connect_timeout_ms: 5_000,
            timeout_ms: 20_000,
            max_requests_per_turn: 32,
            max_bytes_in_per_turn: 8 << 20,
            max_bytes_out_per_turn: 256 * 1024,
        }
    }
}

fn default_methods() -> Vec<String> {
    vec!["GET".into(), "HEAD".into()]
}

fn default_strip() -> Vec<String> {
    vec!["set-cookie".into()]
}

fn default_format() -> String {
    "{}".into()
}

/// The methods a route may allow.
const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

impl EgressRoute {
    /// A route of a fixed upstream with the defaults.
    pub fn upstream(name: impl Into<String>, upstream: impl Into<String>) -> Self {
        Self::with(name.into(), Some(upstream.into()), Vec::new())
    }

    /// A route of host patterns with the defaults.
    pub fn hosts(name: impl Into<String>, hosts: &[&str]) -> Self {
        Self::with(
            name.into(),
            None,
            hosts.iter().map(|h| (*h).to_owned()).collect(),
        )
    }

    fn with(name: String, upstream: Option<String>, hosts: Vec<String>) -> Self {
        Self {
            name,
            description: String::new(),
            upstream,
            hosts,
            ports: Vec::new(),
            methods: default_methods(),
            paths: Vec::new(),
            query: None,
            headers: BTreeMap::new(),
            deny: Vec::new(),
            mode: EgressMode::Enforce,
            credential: None,
            credential_as: CredentialPlacement::Bearer,
            allow_private: Vec::new(),
            allow_ip_literals: false,
            allow_unusual_paths: false,
            ca_file: None,
            redirects: Redirects::None,
            strip_response_headers: default_strip(),
            limits: EgressLimits::default(),
        }
    }

    /// The private ranges it may reach, parsed (checked at startup).
    pub(crate) fn private_ranges(&self) -> Vec<Cidr> {
        self.allow_private
            .iter()
            .filter_map(|c| Cidr::parse(c))
            .collect()
    }
}

/// An address range, `addr/len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// Its first address.
    pub addr: IpAddr,
    /// Its prefix length.
    pub len: u8,
}

impl Cidr {
    /// `addr/len`, or `None`.
    pub fn parse(text: &str) -> Option<Self> {
        let (addr, len) = text.split_once('/')?;
        let addr: IpAddr = addr.parse().ok()?;
        let len: u8 = len.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (len <= max).then_some(Self { addr, len })
    }

    /// Whether `ip` is in it.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// Every rule of the `[[egress]]` routes, without side effects.
pub(crate) fn validate(routes: &[EgressRoute]) -> Result<(), PolicyError> {
    let mut names = std::collections::BTreeSet::new();
    for route in routes {
        validate_one(route)?;
        if !names.insert(route.name.as_str()) {
            return Err(bad(route, "configured twice"));
        }
    }
    Ok(())
}

fn bad(route: &EgressRoute, reason: impl Into<String>) -> PolicyError {
    PolicyError::InvalidEgressRoute {
        route: route.name.clone(),
        reason: reason.into(),
    }
}

fn validate_one(route: &EgressRoute) -> Result<(), PolicyError> {
    if !valid_tool_name(&route.name) {
        return Err(bad(route, "invalid name: use 1 to 64 of a-z, 0-9, _ and -"));
    }
    match (&route.upstream, route.hosts.is_empty()) {
        (Some(_), false) | (None, true) => {
            return Err(bad(route, "set one of upstream or hosts"));
        }
        (Some(upstream), true) => {
            check_upstream(route, upstream)?;
            if !route.ports.is_empty() {
                return Err(bad(
                    route,
                    "ports is for routes of host patterns (an upstream names its port)",
                ));
            }
        }
        (None, false) => {
            if route.ports.contains(&0) {
                return Err(bad(route, "port 0 is not a port"));
            }
            for pattern in &route.hosts {
                if !valid_host_pattern(pattern) {
                    return Err(bad(
                        route,
                        format!("invalid host pattern {pattern:?}: use a name, *.domain or *"),
                    ));
                }
            }
        }
    }
    if route.methods.is_empty() {
        return Err(bad(route, "methods is empty"));
    }
    for method in route
        .methods
        .iter()
        .chain(route.deny.iter().flat_map(|d| &d.methods))
    {
        if !METHODS.contains(&method.as_str()) {
            return Err(bad(
                route,
                format!("unknown method {method:?} (use {})", METHODS.join(", ")),
            ));
        }
    }
    let globs = route
        .paths
        .iter()
        .chain(route.deny.iter().flat_map(|d| &d.paths));
    for glob in globs {
        if !glob.starts_with('/') {
            return Err(bad(route, format!("path glob {glob:?} must start with /")));
        }
        if glob.split('/').filter(|s| *s == "**").count() > 1 {
            return Err(bad(
                route,
                format!(
                    "path glob {glob:?} has more than one ** (one matches any run of segments)"
                ),
            ));
        }
        if glob.split('/').any(|s| s.contains("**") && s != "**") {
            return Err(bad(
                route,
                format!("path glob {glob:?}: ** must be a whole segment"),
            ));
        }
    }
    for pattern in route.deny.iter().flat_map(|d| &d.hosts) {
        if !valid_host_pattern(pattern) {
            return Err(bad(
                route,
                format!("invalid host pattern {pattern:?} in deny"),
            ));
        }
    }
    for name in route.headers.keys() {
        let lower = name.to_ascii_lowercase();
        if hyper::header::HeaderName::try_from(name.as_str()).is_err()
            || lower == "authorization"
            || lower == "cookie"
            || lower == "host"
            || lower.starts_with("proxy-")
        {
            return Err(bad(route, format!("header {name:?} cannot be allowed")));
        }
        if BROKER_SET_HEADERS.contains(&lower.as_str()) {
            return Err(bad(
                route,
                format!("header {name:?} cannot be allowed (the broker sets it)"),
            ));
        }
    }
    for cidr in &route.allow_private {
        if Cidr::parse(cidr).is_none() {
            return Err(bad(
                route,
                format!("allow_private {cidr:?} is not a range (addr/len)"),
            ));
        }
    }
    check_credential(route)?;
    check_limits(route)
}

fn check_upstream(route: &EgressRoute, upstream: &str) -> Result<(), PolicyError> {
    let url = reqwest::Url::parse(upstream)
        .map_err(|_| bad(route, format!("invalid upstream {upstream:?}")))?;
    if url.scheme() != "https" {
        return Err(bad(route, format!("upstream must use https: {upstream}")));
    }
    if url.host_str().is_none_or(str::is_empty)
        || !url.username().is_empty()
        || url.password().is_some()
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return Err(bad(
            route,
            format!(
                "upstream must be https://host[:port][/base], no credentials or query: {upstream}"
            ),
        ));
    }
    if matches!(route.credential_as, CredentialPlacement::PathSegment)
        && !upstream.contains("{credential}")
    {
        return Err(bad(
            route,
            "credential_as = \"path_segment\" needs {credential} in the upstream",
        ));
    }
    Ok(())
}

/// Headers the broker sets or frames the request with itself: a guest's would desync the
/// request an upstream reads (`transfer-encoding` beside the broker's own length) or undo
/// what the broker asks for (`accept-encoding: identity`, its `user-agent`).
const BROKER_SET_HEADERS: &[&str] = &[
    "accept-encoding",
    "connection",
    "content-length",
    "expect",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
];

fn check_credential(route: &EgressRoute) -> Result<(), PolicyError> {
    match (&route.credential, &route.credential_as) {
        (None, CredentialPlacement::Bearer) => Ok(()),
        (None, _) => Err(bad(route, "credential_as is set but no credential is")),
        // The credential goes to every host the route reaches: never to any host a guest
        // names.
        (Some(_), _) if route.hosts.iter().any(|h| h == "*") => Err(bad(
            route,
            "a credential on a route of any host (\"*\") would go wherever a guest points it: name the hosts",
        )),
        // Nor to any name a guest can register: a whole top-level domain (`*.com`). (A
        // multi-label public suffix, `*.co.uk` or a hosting provider's `*.example.app`, is
        // the operator's to avoid: see the README.)
        (Some(_), _) if route.hosts.iter().any(|h| {
            h.strip_prefix("*.")
                .is_some_and(|d| !d.trim_end_matches('.').contains('.'))
        }) =>
        {
            Err(bad(
                route,
                "a credential on a route of a whole top-level domain (\"*.tld\") would go to any host a guest registers there: name the hosts",
            ))
        }
        (Some(_), CredentialPlacement::PathSegment) if route.upstream.is_none() => Err(bad(
            route,
            "credential_as = \"path_segment\" needs an upstream",
        )),
        (Some(_), CredentialPlacement::Header { name, format }) => {
            if hyper::header::HeaderName::try_from(name.as_str()).is_err() {
                return Err(bad(route, format!("invalid credential header {name:?}")));
            }
            if !format.contains("{}") {
                return Err(bad(route, "the credential's format has no {}"));
            }
            Ok(())
        }
        (Some(_), CredentialPlacement::Query { name }) if name.is_empty() => {
            Err(bad(route, "the credential's query parameter has no name"))
        }
        (Some(_), _) => Ok(()),
    }
}

fn check_limits(route: &EgressRoute) -> Result<(), PolicyError> {
    let l = &route.limits;
    let ok = (1..=16 << 20).contains(&l.max_request_bytes)
        && (256..=64 * 1024).contains(&l.max_header_bytes)
        && (1024..=256 << 20).contains(&l.max_response_bytes)
        && (100..=60_000).contains(&l.connect_timeout_ms)
        && (100..=600_000).contains(&l.timeout_ms)
        && (1..=10_000).contains(&l.max_requests_per_turn)
        && l.max_bytes_in_per_turn >= 1024
        && l.max_bytes_out_per_turn >= 1;
    if ok {
        Ok(())
    } else {
        Err(bad(
            route,
            format!(
                "limits out of range (max_request_bytes 1 to 16 MiB, max_header_bytes 256 to 64 KiB, max_response_bytes 1 KiB to 256 MiB, connect_timeout_ms 100 to 60000, timeout_ms 100 to 600000, max_requests_per_turn 1 to 10000, max_bytes_in_per_turn at least 1024, max_bytes_out_per_turn at least 1): {l:?}"
            ),
        ))
    }
}

/// A host pattern: `*`, `*.domain` or a name of letters, digits, `-` and `.`.
pub(crate) fn valid_host_pattern(pattern: &str) -> bool {
    let name = pattern.strip_prefix("*.").unwrap_or(pattern);
    pattern == "*"
        || (!name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(route: EgressRoute) -> String {
        validate(&[route]).unwrap_err().to_string()
    }

    #[test]
    fn each_rule_has_its_message() {
        let mut r = EgressRoute::hosts("web", &["*.example.com"]);
        r.upstream = Some("https://a".into());
        assert_eq!(refusal(r), "egress route web: set one of upstream or hosts");
        assert_eq!(
            refusal(EgressRoute::upstream("api", "http://api.example.com")),
            "egress route api: upstream must use https: http://api.example.com"
        );
        assert_eq!(
            refusal(EgressRoute::upstream("api", "https://u:p@api.example.com")),
            "egress route api: upstream must be https://host[:port][/base], no credentials or query: https://u:p@api.example.com"
        );
        assert_eq!(
            refusal(EgressRoute::hosts("web", &["exa mple.com"])),
            "egress route web: invalid host pattern \"exa mple.com\": use a name, *.domain or *"
        );
        let mut r = EgressRoute::upstream("api", "https://api.example.com:8443");
        r.ports = vec![8443];
        assert_eq!(
            refusal(r),
            "egress route api: ports is for routes of host patterns (an upstream names its port)"
        );
        let mut r = EgressRoute::hosts("web", &["*"]);
        r.ports = vec![443, 0];
        assert_eq!(refusal(r), "egress route web: port 0 is not a port");
        let mut r = EgressRoute::hosts("web", &["*"]);
        r.methods = vec!["TRACE".into()];
        assert_eq!(
            refusal(r),
            "egress route web: unknown method \"TRACE\" (use GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS)"
        );
        let mut r = EgressRoute::hosts("web", &["*"]);
        r.allow_private = vec!["127.0.0.2".into()];
        assert_eq!(
            refusal(r),
            "egress route web: allow_private \"127.0.0.2\" is not a range (addr/len)"
        );
        let mut r = EgressRoute::hosts("web", &["*"]);
        r.headers.insert("Authorization".into(), "*".into());
        assert_eq!(
            refusal(r),
            "egress route web: header \"Authorization\" cannot be allowed"
        );
        for header in [
            "Transfer-Encoding",
            "content-length",
            "TE",
            "Accept-Encoding",
        ] {
            let mut r = EgressRoute::hosts("web", &["*"]);
            r.headers.insert(header.into(), "*".into());
            assert_eq!(
                refusal(r),
                format!(
                    "egress route web: header \"{header}\" cannot be allowed (the broker sets it)"
                )
            );
        }
        let mut r = EgressRoute::hosts("web", &["*"]);
        r.paths = vec!["/a/**/b/**".into()];
        assert_eq!(
            refusal(r),
            "egress route web: path glob \"/a/**/b/**\" has more than one ** (one matches any run of segments)"
        );
        let mut r = EgressRoute::hosts("web", &["*"]);
        r.paths = vec!["/a/x**".into()];
        assert_eq!(
            refusal(r),
            "egress route web: path glob \"/a/x**\": ** must be a whole segment"
        );
        let mut r = EgressRoute::hosts("web", &["*"]);
        r.credential_as = CredentialPlacement::Basic;
        assert_eq!(
            refusal(r),
            "egress route web: credential_as is set but no credential is"
        );
        let mut r = EgressRoute::hosts("web", &["*.example.com", "*"]);
        r.credential = Some(KeyRef {
            env: Some("TOKEN".into()),
            file: None,
        });
        assert_eq!(
            refusal(r),
            "egress route web: a credential on a route of any host (\"*\") would go wherever a guest points it: name the hosts"
        );
        for tld in ["*.com", "*.DEV"] {
            let mut r = EgressRoute::hosts("web", &["api.example.com", tld]);
            r.credential = Some(KeyRef {
                env: Some("TOKEN".into()),
                file: None,
            });
            assert_eq!(
                refusal(r),
                "egress route web: a credential on a route of a whole top-level domain (\"*.tld\") would go to any host a guest registers there: name the hosts"
            );
        }
        let mut r = EgressRoute::hosts("web", &["*.example.com"]);
        r.credential = Some(KeyRef {
            env: Some("TOKEN".into()),
            file: None,
        });
        assert!(validate(&[r]).is_ok());
        assert_eq!(
            validate(&[
                EgressRoute::hosts("web", &["*"]),
                EgressRoute::hosts("web", &["*"])
            ])
            .unwrap_err()
            .to_string(),
            "egress route web: configured twice"
        );
        validate(&[EgressRoute::hosts(
            "web",
            &["*", "*.wikipedia.org", "example.com"],
        )])
        .unwrap();
    }

    #[test]
    fn ranges_contain_what_they_say() {
        let c = Cidr::parse("127.0.0.2/32").unwrap();
        assert!(c.contains("127.0.0.2".parse().unwrap()));
        assert!(!c.contains("127.0.0.3".parse().unwrap()));
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains("10.200.1.1".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("fd00::/8")
            .unwrap()
            .contains("fd12::1".parse().unwrap()));
        assert!(Cidr::parse("1.2.3.4/33").is_none());
    }
}
