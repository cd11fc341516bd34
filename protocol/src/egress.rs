//! Web requests through the broker: the egress routes a turn may use and the wire form of
//! a request and of a refusal.
//!
//! The guest has no network. It asks the broker over its unix socket:
//! `{METHOD} /v1/egress/{route}/{target}?{query}` with its headers and body, where
//! `{target}` is, for a route with a fixed upstream ([`RouteForm::Upstream`]), the path
//! under the route's base (`/v1/egress/weather/forecast/today`), and for a route of host
//! patterns ([`RouteForm::Hosts`]), `{scheme}/{host}[:{port}]/{path}`
//! (`/v1/egress/web/https/en.wikipedia.org/wiki/Rust`). The broker checks the request
//! against the route, resolves the host itself, checks every address, connects to the
//! address it checked over TLS, adds the operator's credential, and answers with the
//! upstream's status, its headers (some stripped) and its body (capped). A refusal by a
//! rule is `403` with a [`Denial`] body and the header [`DENIED_HEADER`] naming the rule,
//! so an agent can tell it from the upstream's own `403`.

use serde::{Deserialize, Serialize};

/// The header on a refusal of the broker's egress rules (its value: the rule).
pub const DENIED_HEADER: &str = "x-roundtable-egress-denied";
/// The `error` of a [`Denial`].
pub const DENIED: &str = "egress_denied";

/// An egress route as the guest is told of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// The route's name (the path segment after `/v1/egress/`).
    pub name: String,
    /// What the guest gives: a path under a fixed upstream, or a whole URL.
    pub form: RouteForm,
    /// The methods it allows.
    pub methods: Vec<String>,
    /// What the operator says it is for (for the model).
    #[serde(default)]
    pub description: String,
}

/// How a route names its target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum RouteForm {
    /// A fixed upstream: the guest gives a path under `base` (shown without credentials).
    Upstream {
        /// `https://host[:port][/base]`.
        base: String,
    },
    /// Host patterns: the guest gives the whole URL (`https://host/path`), its host one of
    /// `hosts` (exact names, `*.domain`, or `*` for any public host).
    Hosts {
        /// The patterns.
        hosts: Vec<String>,
    },
}

/// The body of a refusal by an egress rule (`403`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Denial {
    /// Always [`DENIED`].
    pub error: String,
    /// The route.
    pub route: String,
    /// The rule that refused (`method`, `path`, `host`, `deny[0]`, `address`, `ip_literal`,
    /// `userinfo`, `dot_segment`, `encoded_slash`, `query`, `header`, `scheme`, …).
    pub rule: String,
    /// Why, for a person and a model.
    pub reason: String,
}

/// The path of a request through `route` to `target` (see the [module](self)).
pub fn request_path(route: &str, target: &str) -> String {
    format!(
        "{}{route}/{}",
        crate::paths::EGRESS_PREFIX,
        target.trim_start_matches('/')
    )
}

/// The `{target}` of a whole URL for a route of host patterns: `https://h:1/p?q` ->
/// (`https/h:1/p`, `q`). `None` when it is not `scheme://authority/...`.
pub fn url_target(url: &str) -> Option<(String, Option<String>)> {
    let (scheme, rest) = url.split_once("://")?;
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q.to_owned())),
        None => (rest, None),
    };
    let rest = rest.split('#').next().unwrap_or("");
    if scheme.is_empty() || rest.is_empty() {
        return None;
    }
    Some((format!("{scheme}/{rest}"), query))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_of_urls() {
        assert_eq!(
            url_target("https://en.wikipedia.org/wiki/Rust?x=1#top"),
            Some(("https/en.wikipedia.org/wiki/Rust".into(), Some("x=1".into())))
        );
        assert_eq!(
            url_target("https://h:8443"),
            Some(("https/h:8443".into(), None))
        );
        assert_eq!(url_target("no-scheme"), None);
        assert_eq!(request_path("web", "https/h/p"), "/v1/egress/web/https/h/p");
    }
}
