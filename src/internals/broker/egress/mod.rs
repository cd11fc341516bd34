//! Web requests through the broker: `{METHOD} /v1/egress/{route}/{target}` (issue 45).
//!
//! The guest has no network; this route is its one way to the web, and the broker guards
//! it. In order, each step a control with its own test:
//! 1. the route ([`Egress`]: the operator's `[[egress]]`, compiled at start: its credential
//!    read, its TLS roots, its private ranges) and the request checked without I/O
//!    ([`rules::check`]: the target parsed from the raw path, scheme, userinfo, IP
//!    literals, `..` and encoded slashes, then the route's rules and its `deny` rules);
//! 2. the turn's caps for the route (requests, bytes out, bytes in) and the calls-in-flight
//!    permit every broker call holds; the body read within the route's cap;
//! 3. the host resolved by the broker, every address checked ([`net::denied`], unless the
//!    route's `allow_private` names its range), the connection made to the address checked;
//! 4. the request written by the broker: the guest's `authorization`, `cookie`, `proxy-*`
//!    and every header not allowed dropped, its own `user-agent`, `accept-encoding:
//!    identity`, the credential placed as the route says;
//! 5. the answer read within the route's cap (nothing decompressed on the host), redirects
//!    not followed unless the route says `same_route` (each hop checked from step 1 again),
//!    hop-by-hop and the route's stripped headers removed, every declared secret (the
//!    credential among them) redacted from its headers and body;
//! 6. one [`EgressCall`] event per request (the audit line's, the metrics').
//!
//! A refusal by a rule is `403` with a [`Denial`] body and the [`DENIED_HEADER`] naming the
//! rule; a cap is `413`/`429`/`504` as on the other routes.

mod net;
pub(crate) mod rules;
pub(super) mod used;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::Incoming as IncomingBody;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, StatusCode};
use roundtable_sandbox_protocol::egress::{
    Denial, RouteForm, RouteSpec, BROKER_HEADER, DENIED, DENIED_HEADER,
};
use secrecy::{ExposeSecret, SecretString};

use super::http::{full, holding, refuse, Response, Turn};
use super::BrokerError;
use crate::budgets::EgressCharge;
use crate::config::{Cidr, CredentialPlacement, EgressRoute, Redirects};
use crate::events::{BrokerEvent, EgressCall, EgressDecision, Refusal};

/// The `user-agent` of every egress request.
const USER_AGENT: &str = concat!("roundtable-sandbox-egress/", env!("CARGO_PKG_VERSION"));
/// Redirect hops followed at most (`redirects = "same_route"`).
const MAX_HOPS: usize = 5;
/// Request headers forwarded from the guest whatever the route says.
const SAFE_HEADERS: &[&str] = &[
    "accept",
    "accept-language",
    "content-type",
    "if-none-match",
    "if-modified-since",
    "range",
];
/// Response headers never passed on (hop-by-hop, and what the broker sets itself).
const HOP_HEADERS: &[&str] = &[
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authenticate",
    "proxy-connection",
    "content-length",
];

/// An answer that ends a request before its exchange (a refusal, a cap).
type Halt = Box<Response>;

/// The broker's egress routes.
pub(crate) struct Egress {
    routes: BTreeMap<String, Compiled>,
    resolver: Option<net::Resolver>,
    /// The container engine's own networks: never reachable unless a route names them.
    engine: Vec<Cidr>,
}

/// A route ready to serve.
struct Compiled {
    config: EgressRoute,
    credential: Option<SecretString>,
    tls: Arc<rustls::ClientConfig>,
    private: Vec<Cidr>,
    /// The upstream's path as it starts every request's (escapes of unreserved characters
    /// decoded, as in every target's path; no `/` at the end; empty for a route of host
    /// patterns).
    base_path: String,
}

impl Egress {
    /// Compiles the routes (each credential read, each CA file loaded) and the resolver
    /// (`nameserver`: a name server to ask instead of the system's; the tests'); `engine`
    /// are the engine's own networks.
    pub(crate) fn new(
        routes: &[EgressRoute],
        nameserver: Option<SocketAddr>,
        engine: Vec<Cidr>,
    ) -> Result<Self, BrokerError> {
        let mut compiled = BTreeMap::new();
        for route in routes {
            let credential = match &route.credential {
                None => None,
                Some(key) => Some(
                    key.read(&format!("egress {}: credential", route.name))
                        .map_err(|e| BrokerError::Egress(crate::one_line(&e)))?,
                ),
            };
            let tls = net::tls_config(route.ca_file.as_deref())
                .map_err(|e| BrokerError::Egress(format!("egress {}: {e}", route.name)))?;
            compiled.insert(
                route.name.clone(),
                Compiled {
                    private: route.private_ranges(),
                    base_path: route
                        .upstream
                        .as_deref()
                        .and_then(|u| reqwest::Url::parse(u).ok())
                        .map(|u| rules::unreserved_decoded(u.path().trim_end_matches('/')))
                        .unwrap_or_default(),
                    config: route.clone(),
                    credential,
                    tls,
                },
            );
        }
        let resolver = match routes.is_empty() {
            true => None,
            false => Some(net::Resolver::new(nameserver).map_err(BrokerError::Egress)?),
        };
        Ok(Self {
            routes: compiled,
            resolver,
            engine,
        })
    }

    /// The routes as a turn is told of them.
    pub(crate) fn specs(&self) -> Vec<RouteSpec> {
        self.routes
            .values()
            .map(|r| RouteSpec {
                name: r.config.name.clone(),
                form: match &r.config.upstream {
                    Some(base) => RouteForm::Upstream {
                        base: base.replace("{credential}", "…"),
                    },
                    None => RouteForm::Hosts {
                        hosts: r.config.hosts.clone(),
                    },
                },
                methods: r.config.methods.clone(),
                description: r.config.description.clone(),
            })
            .collect()
    }

    /// The routes' credentials, redacted from whatever the guest is sent: each as it is and
    /// in every form the broker sends it in (percent-encoded in a query or path, with
    /// upper- or lower-case hex; Base64 in Basic auth), and each of those with its `/`
    /// written `\/` as a JSON encoder may (PHP's does), so an upstream that echoes the
    /// request it got (a header dump, an error page, a JSON debug answer) shows the guest
    /// none of them.
    pub(crate) fn secrets(&self) -> impl Iterator<Item = String> + '_ {
        use base64::Engine;
        self.routes
            .values()
            .filter_map(|r| r.credential.as_ref())
            .flat_map(|c| {
                let raw = c.expose_secret();
                let encoded = url_encode(raw);
                let lower = percent_encoded(raw, true);
                let basic = base64::engine::general_purpose::STANDARD.encode(raw);
                let mut forms = vec![raw.to_owned(), encoded, lower, basic];
                let escaped: Vec<String> = forms
                    .iter()
                    .filter(|f| f.contains('/'))
                    .map(|f| f.replace('/', "\\/"))
                    .collect();
                forms.extend(escaped);
                forms
            })
    }
}

/// Serves one egress request; `rest` is the raw path after `/v1/egress/`.
pub(super) async fn handle(turn: &Turn, req: Request<IncomingBody>, rest: &str) -> Response {
    let started = Instant::now();
    let (name, target) = rest.split_once('/').unwrap_or((rest, ""));
    let Some(route) = turn.broker.egress.routes.get(name) else {
        return super::http::error_response(
            StatusCode::NOT_FOUND,
            &format!(
                "unknown egress route: {}",
                name.chars().take(64).collect::<String>()
            ),
        );
    };
    let mut call = Call::new(route, req.method().as_str(), started);
    let answer = serve(turn, route, req, target, &mut call).await;
    call.latency = started.elapsed();
    // A refusal (by a rule, or `429`: a cap, the budgets, the upstream's own) is paced past
    // the turn's first few: a guest retrying at once costs the host little.
    let refused = call.event.decision == EgressDecision::Denied
        || answer.status() == StatusCode::TOO_MANY_REQUESTS;
    match call.charge.take() {
        Some(charge) => charge.settle(call.bytes_out, call.bytes_in),
        None => {
            if let Some(account) = &turn.ctx.account {
                account.count_egress(call.bytes_out, call.bytes_in);
            }
        }
    }
    if let Some(events) = &turn.ctx.events {
        events.broker(BrokerEvent::Egress(Box::new(call.event())));
    }
    if refused {
        super::http::pace_refusal(&turn.stop, &turn.egress_refusals).await;
    }
    answer
}

/// One request's facts as they are learnt, for its event.
struct Call {
    event: EgressCall,
    latency: Duration,
    bytes_out: u64,
    bytes_in: u64,
    /// Its worst case held on the egress budgets, once it passed their check.
    charge: Option<EgressCharge>,
}

impl Call {
    fn new(route: &Compiled, method: &str, _started: Instant) -> Self {
        Self {
            event: EgressCall {
                route: route.config.name.clone(),
                method: method.chars().take(16).collect(),
                host: String::new(),
                path: String::new(),
                status: 0,
                bytes_out: 0,
                bytes_in: 0,
                latency: Duration::ZERO,
                decision: EgressDecision::Allowed,
                rule: None,
                address: None,
            },
            latency: Duration::ZERO,
            bytes_out: 0,
            bytes_in: 0,
            charge: None,
        }
    }

    fn event(mut self) -> EgressCall {
        self.event.latency = self.latency;
        self.event.bytes_out = self.bytes_out;
        self.event.bytes_in = self.bytes_in;
        self.event
    }

    /// A refusal by a rule: `403`, the [`Denial`] body, the header naming the rule.
    fn deny(&mut self, route: &str, rule: &str, reason: &str) -> Response {
        self.event.decision = EgressDecision::Denied;
        self.event.rule = Some(rule.to_owned());
        let denial = Denial {
            error: DENIED.into(),
            route: route.to_owned(),
            rule: rule.to_owned(),
            reason: reason.to_owned(),
        };
        let mut response = super::http::json_response(StatusCode::FORBIDDEN, &denial);
        if let Ok(v) = HeaderValue::from_str(rule) {
            response.headers_mut().insert(DENIED_HEADER, v);
        }
        response
            .headers_mut()
            .insert(BROKER_HEADER, HeaderValue::from_static("1"));
        response
    }
}

/// The request, step by step (see the module).
async fn serve(
    turn: &Turn,
    route: &Compiled,
    req: Request<IncomingBody>,
    target: &str,
    call: &mut Call,
) -> Response {
    let cfg = &route.config;
    let method = req.method().clone();
    let query = req.uri().query().map(str::to_owned);
    let Some(guest_headers) = guest_headers(req.headers(), cfg.limits.max_header_bytes) else {
        return refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::RequestBytes,
            &format!(
                "request headers too large (limit {} bytes)",
                cfg.limits.max_header_bytes
            ),
        );
    };
    let allowed = match rules::check(
        cfg,
        method.as_str(),
        target,
        query.as_deref(),
        &guest_headers,
    ) {
        Ok(a) => a,
        Err(r) => return call.deny(&cfg.name, &r.rule, &r.reason),
    };
    if let Some(would) = &allowed.audit_denied {
        call.event.decision = EgressDecision::AuditDenied;
        call.event.rule = Some(would.rule.clone());
        tracing::warn!(route = %cfg.name, rule = %would.rule, "egress request sent in audit mode past a rule that would refuse it");
    }
    call.event.host = allowed.target.host.clone();
    call.event.path = allowed.target.audit_path();
    let Ok(permit) = turn.in_flight.clone().try_acquire_owned() else {
        return refuse(
            StatusCode::TOO_MANY_REQUESTS,
            Refusal::CallsInFlight,
            "too many calls in flight in this turn",
        );
    };
    let body = match read_body(req, cfg.limits.max_request_bytes, cfg.limits.timeout_ms).await {
        Ok(b) => b,
        Err(response) => return *response,
    };
    let header_bytes = forwarded_bytes(cfg, &guest_headers);
    let out = sent_bytes(target, query.as_deref(), &body, header_bytes);
    if let Err(response) = count(turn, cfg, out) {
        return *response;
    }
    if let Some(account) = &turn.ctx.account {
        match account.hold_egress(worst_case(cfg, out)) {
            Ok(charge) => call.charge = Some(charge),
            Err(r) => {
                call.event.decision = EgressDecision::Denied;
                call.event.rule = Some(r.budget.key().to_owned());
                return refuse(
                    StatusCode::TOO_MANY_REQUESTS,
                    Refusal::Budget(r.budget),
                    &r.to_string(),
                );
            }
        }
    }
    call.bytes_out = out;
    let ctx = Exchange {
        turn,
        route,
        method,
        headers: guest_headers,
        header_bytes,
        body,
    };
    let answer = ctx.run(allowed.target, call).await;
    holding(answer, permit)
}

/// Whether the guest's header `name` is sent upstream: a safe one or one the route names.
fn forwarded(cfg: &EgressRoute, name: &str) -> bool {
    // On a route with a credential, no `range`: an echoed credential asked for in pieces
    // (`bytes=40-45`, then `46-51`…) would pass the redaction, which sees whole strings.
    if cfg.credential.is_some() && (name == "range" || name == "if-range") {
        return false;
    }
    SAFE_HEADERS.contains(&name) || cfg.headers.keys().any(|h| h.eq_ignore_ascii_case(name))
}

/// The bytes of the guest's headers that are sent upstream (name, value, `: ` and CR LF
/// each): they carry data out as a body does, so they count against the bytes out.
fn forwarded_bytes(cfg: &EgressRoute, headers: &[(String, String)]) -> u64 {
    headers
        .iter()
        .filter(|(name, _)| forwarded(cfg, name))
        .map(|(name, value)| (name.len() + value.len() + 4) as u64)
        .sum()
}

/// What one request (or one redirect hop) sends out: its path, query, body and the guest's
/// forwarded headers, bytes.
fn sent_bytes(path: &str, query: Option<&str>, body: &[u8], header_bytes: u64) -> u64 {
    (path.len() + query.map_or(0, str::len) + body.len()) as u64 + header_bytes
}

/// The guest's headers as (lower-case name, value) pairs; `None` past `cap` bytes.
fn guest_headers(headers: &HeaderMap, cap: usize) -> Option<Vec<(String, String)>> {
    let mut size = 0;
    let mut out = Vec::new();
    for (name, value) in headers {
        size += name.as_str().len() + value.len() + 4;
        if size > cap {
            return None;
        }
        if let Ok(v) = value.to_str() {
            out.push((name.as_str().to_owned(), v.to_owned()));
        }
    }
    Some(out)
}

async fn read_body(req: Request<IncomingBody>, cap: usize, timeout_ms: u64) -> Result<Bytes, Halt> {
    let body = super::bounded::read_request(req.into_body(), cap);
    let refused = match tokio::time::timeout(Duration::from_millis(timeout_ms), body).await {
        Ok(Ok(b)) => return Ok(Bytes::from(b)),
        Err(_) => refuse(
            StatusCode::REQUEST_TIMEOUT,
            Refusal::BodyTimeout,
            "request body not received in time",
        ),
        Ok(Err(super::bounded::RequestBody::TooLarge)) => refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::RequestBytes,
            &format!("request body too large (limit {cap} bytes)"),
        ),
        Ok(Err(_)) => refuse(
            StatusCode::BAD_REQUEST,
            Refusal::Malformed,
            "request body unreadable",
        ),
    };
    Err(Box::new(refused))
}

/// What a request may send and read at most, its redirects' hops included: what the egress
/// budgets hold while it runs.
fn worst_case(cfg: &EgressRoute, out: u64) -> u64 {
    let hops = match cfg.redirects {
        Redirects::None => 1,
        Redirects::SameRoute => MAX_HOPS as u64 + 1,
    };
    let answer = (cfg.limits.max_response_bytes + net::MAX_HEAD_BYTES) as u64;
    hops.saturating_mul(out.saturating_add(answer))
}

/// Counts a request of the turn on the route (`out` bytes sent): `429` past its requests
/// or its bytes out, or once its bytes in are spent.
fn count(turn: &Turn, cfg: &EgressRoute, out: u64) -> Result<(), Halt> {
    let l = &cfg.limits;
    let verdict = turn.egress.with(&cfg.name, |used| {
        if used.requests >= l.max_requests_per_turn {
            return Err(format!(
                "too many egress requests on route {} in this turn (limit {})",
                cfg.name, l.max_requests_per_turn
            ));
        }
        if used.bytes_out.saturating_add(out) > l.max_bytes_out_per_turn {
            return Err(format!(
                "route {} has sent its bytes for this turn (limit {})",
                cfg.name, l.max_bytes_out_per_turn
            ));
        }
        if used.bytes_in >= l.max_bytes_in_per_turn {
            return Err(format!(
                "route {} has read its bytes for this turn (limit {})",
                cfg.name, l.max_bytes_in_per_turn
            ));
        }
        used.requests += 1;
        used.bytes_out += out;
        Ok(())
    });
    verdict.map_err(|msg| {
        Box::new(refuse(
            StatusCode::TOO_MANY_REQUESTS,
            Refusal::EgressCaps,
            &msg,
        ))
    })
}

/// One request's exchange with the upstream (and its redirects' within the route).
struct Exchange<'a> {
    turn: &'a Turn,
    route: &'a Compiled,
    method: hyper::Method,
    headers: Vec<(String, String)>,
    /// The bytes of `headers` sent upstream (each hop sends them again).
    header_bytes: u64,
    body: Bytes,
}

impl Exchange<'_> {
    async fn run(&self, mut target: rules::Target, call: &mut Call) -> Response {
        let cfg = &self.route.config;
        // One deadline for the whole request, its redirects included.
        let deadline = Duration::from_millis(cfg.limits.timeout_ms);
        let until = tokio::time::Instant::now() + deadline;
        for hop in 0..=MAX_HOPS {
            if hop > 0 {
                // Each hop is a new request of the route: its caps too.
                let out = sent_bytes(
                    &target.path,
                    target.query.as_deref(),
                    &self.body,
                    self.header_bytes,
                );
                if let Err(response) = count(self.turn, cfg, out) {
                    return *response;
                }
                call.bytes_out += out;
            }
            let answer = tokio::time::timeout_at(until, self.once(&target, call)).await;
            let incoming = match answer {
                Err(_) => {
                    return super::http::failure(
                        StatusCode::GATEWAY_TIMEOUT,
                        &format!("egress request timed out after {deadline:?}"),
                    )
                }
                Ok(Err(response)) => return *response,
                Ok(Ok(incoming)) => incoming,
            };
            call.event.status = incoming.status.as_u16();
            let next = match cfg.redirects {
                Redirects::SameRoute if incoming.status.is_redirection() => {
                    self.redirect(&target, &incoming.headers)
                }
                _ => None,
            };
            match next {
                Some(Ok(hop)) => {
                    // A hop the rules would refuse, sent in audit mode: the request's
                    // decision (a redirect to a denied path was logged as allowed).
                    if let (Some(would), EgressDecision::Allowed) =
                        (&hop.audit_denied, &call.event.decision)
                    {
                        call.event.decision = EgressDecision::AuditDenied;
                        call.event.rule = Some(would.rule.clone());
                        tracing::warn!(route = %cfg.name, rule = %would.rule, "egress redirect followed in audit mode past a rule that would refuse it");
                    }
                    target = hop.target;
                    continue;
                }
                Some(Err(r)) => return call.deny(&cfg.name, &r.rule, &r.reason),
                // (The audit keeps the upstream's status, as its field says; the refusal
                // is logged.)
                None => {
                    return match self.refused_coding(&incoming) {
                        Some(refused) => refused,
                        None => self.answer(incoming).await,
                    }
                }
            }
        }
        call.deny(
            &cfg.name,
            "redirects",
            &format!("more than {MAX_HOPS} redirects"),
        )
    }

    /// The target of a redirect, checked as a new request of the route (`None`: no
    /// `location`, so the 3xx is the answer).
    fn redirect(
        &self,
        from: &rules::Target,
        headers: &HeaderMap,
    ) -> Option<Result<rules::Allowed, rules::Refused>> {
        let location = headers.get(hyper::header::LOCATION)?.to_str().ok()?;
        let base =
            reqwest::Url::parse(&format!("https://{}:{}{}", from.host, from.port, from.path))
                .ok()?;
        let next = base.join(location).ok()?;
        let cfg = &self.route.config;
        let raw = match &cfg.upstream {
            Some(upstream) => {
                let up = reqwest::Url::parse(upstream).ok()?;
                let path = rules::unreserved_decoded(next.path());
                // Under the base as the guest's paths are written, or as it was sent, with a
                // `path_segment` credential in it (an upstream's absolute `Location` names
                // its own path).
                let filled = self.filled_base();
                let under = path
                    .strip_prefix(self.route.base_path.as_str())
                    .or_else(|| path.strip_prefix(filled.as_deref()?))
                    .filter(|rest| rest.is_empty() || rest.starts_with('/'));
                let same = next.host_str() == up.host_str()
                    && next.port_or_known_default() == up.port_or_known_default();
                match under {
                    Some(rest) if same => rest.to_owned(),
                    _ => {
                        return Some(Err(rules::Refused {
                            rule: "redirect".into(),
                            reason: "a redirect out of the route's upstream is not followed".into(),
                        }))
                    }
                }
            }
            None => format!("{}/{}{}", next.scheme(), next.authority(), next.path()),
        };
        Some(rules::check(
            cfg,
            self.method.as_str(),
            &raw,
            next.query(),
            &self.headers,
        ))
    }

    /// One hop: resolve, check every address, connect to the checked one, send, read.
    async fn once(&self, target: &rules::Target, call: &mut Call) -> Result<net::Incoming, Halt> {
        let cfg = &self.route.config;
        let addr = self
            .address(target)
            .await
            .map_err(|(rule, reason)| call.deny(&cfg.name, rule, &reason))?;
        // The first hop's: the line names the request's host and path, and so its address.
        call.event.address.get_or_insert(addr.ip());
        let out = net::Outgoing {
            addr,
            host: target.host.clone(),
            method: self.method.clone(),
            path_and_query: self.path_and_query(target),
            headers: self.outgoing_headers(target),
            body: self.body.clone(),
        };
        let connect = Duration::from_millis(cfg.limits.connect_timeout_ms);
        // What is read counts as it arrives, the head as the body does (its size capped by
        // net::MAX_HEAD_BYTES), on the turn's counter that the route's other requests in
        // flight share: together they read no more than the turn's bytes in (and one frame).
        // A failed exchange counts what it read, for the turn and the budgets, and so does
        // one cut by the deadline (this future dropped: the call was counted as it read).
        let limit = cfg.limits.max_bytes_in_per_turn;
        let mut charge = |n: u64| {
            call.bytes_in = call.bytes_in.saturating_add(n);
            self.turn.egress.with(&cfg.name, |u| {
                u.bytes_in = u.bytes_in.saturating_add(n);
                u.bytes_in <= limit
            })
        };
        let cap = cfg.limits.max_response_bytes;
        net::exchange(out, self.route.tls.clone(), connect, cap, &mut charge)
            .await
            .map_err(|f| Box::new(failed(cfg, f)))
    }

    /// The address to connect to: the host resolved once, every address checked.
    async fn address(&self, target: &rules::Target) -> Result<SocketAddr, (&'static str, String)> {
        let broker = &self.turn.broker.egress;
        let host = target.host.trim_start_matches('[').trim_end_matches(']');
        let addresses = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => {
                let resolver = broker.resolver.as_ref().expect("routes have a resolver");
                resolver.lookup(host).await.map_err(|e| ("resolve", e))?
            }
        };
        if addresses.is_empty() {
            return Err(("resolve", format!("the name {host} has no address")));
        }
        for ip in &addresses {
            let private = self.route.private.iter().any(|c| c.contains(*ip));
            if let (false, Some(why)) = (private, net::denied(*ip, &broker.engine)) {
                return Err((
                    "address",
                    // (The address itself stays on the host: a guest would map the
                    // operator's network with it.)
                    format!("{host} resolves to {why}, which no route may reach unless it names the range in allow_private"),
                ));
            }
        }
        Ok(SocketAddr::new(addresses[0], target.port))
    }

    /// The upstream's base path with a `path_segment` credential in it, as it is sent;
    /// `None` for any other placement.
    fn filled_base(&self) -> Option<String> {
        match (&self.route.credential, &self.route.config.credential_as) {
            (Some(c), CredentialPlacement::PathSegment) => Some(
                self.route
                    .base_path
                    .replace("%7Bcredential%7D", "{credential}")
                    .replace("{credential}", &url_encode(c.expose_secret())),
            ),
            _ => None,
        }
    }

    fn path_and_query(&self, target: &rules::Target) -> String {
        let path = match self.filled_base() {
            Some(filled) => {
                // Only the upstream's own `{credential}` (its base, which starts the path) is
                // replaced: one the guest writes in its part of the path stays as written,
                // or a guest would put the key wherever an upstream shows or keeps a path.
                let base = self.route.base_path.as_str();
                let rest = target.path.strip_prefix(base).unwrap_or(&target.path);
                format!("{filled}{rest}")
            }
            None => target.path.clone(),
        };
        let mut query = target.query.clone().unwrap_or_default();
        if let (Some(c), CredentialPlacement::Query { name }) =
            (&self.route.credential, &self.route.config.credential_as)
        {
            // The guest's own parameter of that name goes, as its `Authorization` does: an
            // upstream that reads the first of two would otherwise take the guest's.
            query = without_parameter(&query, name);
            if !query.is_empty() {
                query.push('&');
            }
            query.push_str(&format!(
                "{}={}",
                url_encode(name),
                url_encode(c.expose_secret())
            ));
        }
        match query.is_empty() {
            true => path,
            false => format!("{path}?{query}"),
        }
    }

    /// The headers sent: the safe ones and the route's allowed ones of the guest's, the
    /// broker's own, the credential.
    fn outgoing_headers(&self, target: &rules::Target) -> HeaderMap {
        let cfg = &self.route.config;
        let mut out = HeaderMap::new();
        for (name, value) in &self.headers {
            if !forwarded(cfg, name) {
                continue;
            }
            if let (Ok(n), Ok(v)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::from_str(value),
            ) {
                out.append(n, v);
            }
        }
        let host = match target.port {
            443 => target.host.clone(),
            port => format!("{}:{port}", target.host),
        };
        if let Ok(v) = HeaderValue::from_str(&host) {
            out.insert(hyper::header::HOST, v);
        }
        out.insert(
            hyper::header::USER_AGENT,
            HeaderValue::from_static(USER_AGENT),
        );
        out.insert(
            hyper::header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        if let Some((name, mut value)) = self.credential_header() {
            value.set_sensitive(true);
            out.insert(name, value);
        }
        out
    }

    fn credential_header(&self) -> Option<(HeaderName, HeaderValue)> {
        let c = self.route.credential.as_ref()?.expose_secret();
        let (name, value) = match &self.route.config.credential_as {
            CredentialPlacement::Bearer => (hyper::header::AUTHORIZATION, format!("Bearer {c}")),
            CredentialPlacement::Basic => {
                use base64::Engine;
                let encoded = base64::engine::general_purpose::STANDARD.encode(c);
                (hyper::header::AUTHORIZATION, format!("Basic {encoded}"))
            }
            CredentialPlacement::Header { name, format } => (
                HeaderName::try_from(name.as_str()).ok()?,
                format.replace("{}", c),
            ),
            _ => return None,
        };
        Some((name, HeaderValue::from_str(&value).ok()?))
    }

    /// The refusal of an answer in a coding, on a route with a credential. The redaction
    /// reads the body as it came: in a coding the broker did not ask for (it asks for
    /// identity), the credential echoed by the upstream would pass unseen. A route without
    /// one has nothing of the operator's to echo: its answer is the guest's as sent
    /// (nothing is inflated on the host).
    fn refused_coding(&self, incoming: &net::Incoming) -> Option<Response> {
        let cfg = &self.route.config;
        self.route.credential.as_ref()?;
        // (An empty body, a `HEAD`'s or a `304`'s, hides nothing.)
        if incoming.body.is_empty() {
            return None;
        }
        // A content coding, or a transfer coding but `chunked` (hyper takes that one off;
        // `gzip, chunked` reached the guest gzipped, its header removed as hop-by-hop).
        let codings = |name: hyper::header::HeaderName, except: &'static str| {
            incoming
                .headers
                .get_all(name)
                .iter()
                .flat_map(|v| {
                    String::from_utf8_lossy(v.as_bytes())
                        .split(',')
                        .map(|c| c.trim().to_ascii_lowercase())
                        .collect::<Vec<_>>()
                })
                .find(move |c| !c.is_empty() && c != "identity" && c != except)
        };
        let coding = codings(hyper::header::CONTENT_ENCODING, "identity")
            .or_else(|| codings(hyper::header::TRANSFER_ENCODING, "chunked"))?;
        tracing::info!(route = %cfg.name, "egress answer in a coding refused on a route with a credential");
        Some(super::http::failure(
            StatusCode::BAD_GATEWAY,
            &format!(
                "the upstream answered in {coding:.32} although the broker asked for identity; a route with a credential takes no coded answer (its echo could not be redacted)"
            ),
        ))
    }

    /// The guest's answer: the upstream's status, its headers less the hop-by-hop and the
    /// stripped ones, secrets redacted from headers and body (the body, up to the route's
    /// `max_response_bytes`, on a blocking thread).
    async fn answer(&self, incoming: net::Incoming) -> Response {
        let cfg = &self.route.config;
        let secrets = self.turn.broker.secrets();
        let mut response = hyper::Response::builder().status(incoming.status);
        for (name, value) in &incoming.headers {
            let n = name.as_str();
            if HOP_HEADERS.contains(&n)
                || cfg
                    .strip_response_headers
                    .iter()
                    .any(|s| s.eq_ignore_ascii_case(n))
                || n == DENIED_HEADER
                || n == BROKER_HEADER
                // Always, whatever the route's list says (a list of its own replaced the
                // default and let a session cookie for the operator's account through).
                || n == "set-cookie"
                || n == "set-cookie2"
            {
                continue;
            }
            let value = match value.to_str() {
                Ok(text) => {
                    let clean = secrets.redact(text);
                    HeaderValue::from_str(&clean).unwrap_or_else(|_| HeaderValue::from_static(""))
                }
                Err(_) => continue,
            };
            response = response.header(name, value);
        }
        let raw = incoming.body;
        let body =
            super::bounded::off_thread(move || secrets.redact_bytes(&raw).into_owned()).await;
        response.body(full(body)).unwrap_or_else(|_| {
            super::http::failure(
                StatusCode::BAD_GATEWAY,
                "the upstream's answer has an invalid header",
            )
        })
    }
}

/// A failed exchange as the guest's answer.
fn failed(cfg: &EgressRoute, f: net::Failure) -> Response {
    let (status, msg) = match f {
        net::Failure::Connect(e) => {
            tracing::info!(route = %cfg.name, error = %e, "egress connection failed");
            (
                StatusCode::BAD_GATEWAY,
                "the upstream is unreachable".to_owned(),
            )
        }
        net::Failure::Exchange(e) => {
            tracing::info!(route = %cfg.name, error = %e, "egress exchange failed");
            (
                StatusCode::BAD_GATEWAY,
                "the upstream's answer could not be read".to_owned(),
            )
        }
        net::Failure::HeadTooLarge => (
            StatusCode::BAD_GATEWAY,
            format!(
                "the upstream's answer has a head larger than {} bytes",
                net::MAX_HEAD_BYTES
            ),
        ),
        net::Failure::TooLarge(cap) => (
            StatusCode::BAD_GATEWAY,
            format!("the upstream's answer is larger than {cap} bytes"),
        ),
        net::Failure::TurnSpent => {
            let msg = format!(
                "route {} has read its bytes for this turn (limit {})",
                cfg.name, cfg.limits.max_bytes_in_per_turn
            );
            return refuse(StatusCode::TOO_MANY_REQUESTS, Refusal::EgressCaps, &msg);
        }
    };
    super::http::failure(status, &msg)
}

/// `query` less every parameter named `name` however it is written (escaped, in another
/// case, separated by `&` or `;`); the rest as it was.
fn without_parameter(query: &str, name: &str) -> String {
    let kept: String = query
        .split_inclusive(['&', ';'])
        .filter(|piece| {
            let pair = piece.trim_end_matches(['&', ';']);
            let raw = pair.split_once('=').map_or(pair, |(n, _)| n);
            !percent_decoded(raw).eq_ignore_ascii_case(name.as_bytes())
        })
        .collect();
    kept.trim_end_matches(['&', ';']).to_owned()
}

/// Every escape of `text` decoded (and `+` read as a space, as a query's is).
fn percent_decoded(text: &str) -> Vec<u8> {
    percent_encoding::percent_decode_str(&text.replace('+', " ")).collect()
}

/// `text` percent-encoded for a path segment or a query value.
fn url_encode(text: &str) -> String {
    percent_encoded(text, false)
}

/// `text` percent-encoded, each escape's hex in upper case (what the broker sends) or in
/// lower case (what an upstream may echo).
fn percent_encoded(text: &str, lower_hex: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else if lower_hex {
            out.push_str(&format!("%{b:02x}"));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::without_parameter;

    #[test]
    fn the_guests_own_copies_of_the_credentials_parameter_go() {
        let cases = [
            ("", ""),
            ("q=1", "q=1"),
            ("api_key=mine", ""),
            ("q=1&api_key=mine&r=2", "q=1&r=2"),
            ("q=1;API_KEY=mine;r=2", "q=1;r=2"),
            ("%61pi%5Fkey=mine&q=1", "q=1"),
            ("q=1&api_key", "q=1"),
            ("api_keys=1&x_api_key=2", "api_keys=1&x_api_key=2"),
            ("%+f=1", "%+f=1"),
        ];
        for (query, kept) in cases {
            assert_eq!(without_parameter(query, "api_key"), kept, "{query}");
        }
    }
}
