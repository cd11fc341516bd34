//! Web requests through the operator's egress routes (issue 45): the `fetch` tool, offered
//! to the model only when the turn has routes, and `roundtable-guest fetch`, the same for
//! programs run with `sh` (the image has no curl).
//!
//! The guest has no network: a request is `{METHOD} /v1/egress/{route}/{target}?{query}` on
//! the broker's socket ([`roundtable_sandbox_protocol::egress`]); the broker checks it
//! against the route, sends it and answers with the upstream's status, headers and body,
//! or refuses it: `403` with a [`Denial`] and the header [`DENIED_HEADER`], or one of its
//! caps (`413`, `429`, `502`, `503`, `504` with `{"error": …}`).
//!
//! For the model, a body becomes text here, in the guest (never on the host): HTML reduced
//! to readable text ([`crate::html`]: `html2text` in a child process under limits; scripts
//! and styles dropped, entities decoded, links as numbered references), text and JSON passed as they are, binary bodies summarised (type,
//! size, first bytes in hex); control characters other than newline and tab are escaped
//! (`\u{1b}`), and the text is cut at a cap with a note saying where. A refusal is a tool
//! error naming the route, the rule and the reason, so the model tells it from the site's
//! own `403` and does not retry it blindly.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Map, Value};

use roundtable_sandbox_protocol::egress::{
    self, Denial, RouteForm, RouteSpec, BROKER_HEADER, DENIED_HEADER,
};
use roundtable_sandbox_protocol::{builtin_tools, ErrorBody};

use crate::chat::ToolDef;
use crate::html::HtmlConverter;
use crate::http::{encode_segment, HttpError, Request, ResponseHead, UnixHttpClient};

/// The most bytes of body text the tool shows the model (lowered to fit the turn's cap of
/// a tool result, [`text_cap`]).
pub const TEXT_CAP: usize = 64 * 1024;
/// The most body bytes the tool reads; the rest is left unread (the connection closed).
pub const READ_CAP: usize = 2 * 1024 * 1024;
/// The most body bytes `roundtable-guest fetch --text` reads.
pub const TEXT_READ_CAP: usize = 16 * 1024 * 1024;
/// The largest body `roundtable-guest fetch` copies to stdout (the broker's largest
/// per-route cap; the route's own is usually far lower).
pub const MAX_BODY: usize = 256 * 1024 * 1024;
/// The largest request body `--data-file` sends (the broker's largest per-route cap).
pub const MAX_REQUEST: usize = 16 * 1024 * 1024;
/// The bytes of a binary body shown, in hex.
const HEX_BYTES: usize = 32;
/// The longest route description, error text or echoed target shown.
const MAX_SHOWN: usize = 300;
/// The most routes listed in the tool's description.
const MAX_ROUTES_LISTED: usize = 32;
/// The default deadline of `roundtable-guest fetch` (the `sh` tool's longest timeout).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest deadline `roundtable-guest fetch --max-time` takes.
const MAX_COMMAND_TIMEOUT: u64 = 600;
/// The response headers the tool shows (the denial header too, when present).
const SHOWN_HEADERS: [&str; 4] = [
    "content-type",
    "content-length",
    "content-encoding",
    "location",
];

/// What the guest names the target with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A whole URL (`https://host/path?query`), for a route of host patterns.
    Url(String),
    /// A path under the route's upstream (`/a/b?query`), for a route with a fixed upstream.
    Path(String),
}

impl Target {
    fn text(&self) -> &str {
        match self {
            Target::Url(s) | Target::Path(s) => s,
        }
    }
}

/// One request, from the tool's arguments or the subcommand's options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchRequest {
    /// The route's name.
    pub route: String,
    /// The method, upper-cased.
    pub method: String,
    /// The URL or the path.
    pub target: Target,
    /// Query parameters added to the target's own.
    pub query: Vec<(String, String)>,
    /// Request headers.
    pub headers: Vec<(String, String)>,
    /// The request body.
    pub body: Vec<u8>,
}

impl FetchRequest {
    /// The request path on the broker's socket. `form` is the route's, when known (the
    /// tool knows the turn's routes; the subcommand tells a URL from a path by `://`).
    pub fn broker_path(&self, form: Option<&RouteForm>) -> Result<String, String> {
        if self.route.is_empty() {
            return Err("the route is empty".into());
        }
        let route = encode_segment(&self.route);
        let (target, own_query) = match (&self.target, form) {
            (Target::Url(url), Some(RouteForm::Upstream { base })) => {
                // A whole URL under the route's own base is its path.
                match strip_base(url, base) {
                    Some(path) => split_path(path),
                    None => {
                        return Err(format!(
                            "route {} takes a path under {}, not a whole URL",
                            self.route,
                            shown(base)
                        ))
                    }
                }
            }
            (Target::Url(url), _) => {
                let url = url.trim();
                let without_fragment = url.split('#').next().unwrap_or("");
                let host = without_fragment
                    .split_once("://")
                    .map_or("", |(_, rest)| rest.split(['/', '?']).next().unwrap_or(""));
                match egress::url_target(without_fragment) {
                    Some((target, query)) if !host.is_empty() => (target, query),
                    _ => {
                        return Err(format!(
                            "{} is not a whole URL: give scheme://host/path",
                            shown(url)
                        ))
                    }
                }
            }
            (Target::Path(_), Some(RouteForm::Hosts { .. })) => {
                return Err(format!(
                    "route {} takes a whole URL (https://host/path), not a path",
                    self.route
                ))
            }
            (Target::Path(path), _) => split_path(path),
        };
        let mut query: Vec<String> = own_query
            .filter(|q| !q.is_empty())
            .map(|q| encode(&q, true))
            .into_iter()
            .collect();
        for (name, value) in &self.query {
            query.push(format!(
                "{}={}",
                encode_component(name),
                encode_component(value)
            ));
        }
        let target = match &self.target {
            // `scheme/authority/path`: an IPv6 literal's brackets stay as they are (the
            // broker decides whether a route may name an address at all).
            Target::Url(_) if !matches!(form, Some(RouteForm::Upstream { .. })) => {
                let mut parts = target.splitn(3, '/');
                let scheme = encode(parts.next().unwrap_or(""), false);
                let authority: String = parts
                    .next()
                    .unwrap_or("")
                    .split_inclusive(['[', ']'])
                    .map(|piece| match piece.strip_suffix(['[', ']']) {
                        Some(stem) => encode(stem, false) + &piece[stem.len()..],
                        None => encode(piece, false),
                    })
                    .collect();
                match parts.next() {
                    Some(path) => format!("{scheme}/{authority}/{}", encode(path, false)),
                    None => format!("{scheme}/{authority}"),
                }
            }
            _ => encode(&target, false),
        };
        let mut path = egress::request_path(&route, &target);
        if !query.is_empty() {
            path.push('?');
            path.push_str(&query.join("&"));
        }
        Ok(path)
    }
}

/// The path of `url` under `base` (`https://h/v1` + `https://h/v1/a` -> `/a`).
fn strip_base<'a>(url: &'a str, base: &str) -> Option<&'a str> {
    let base = base.trim_end_matches('/');
    let head = url.get(..base.len())?;
    if !head.eq_ignore_ascii_case(base) {
        return None;
    }
    let rest = &url[base.len()..];
    (rest.is_empty() || rest.starts_with(['/', '?', '#'])).then_some(rest)
}

/// A path with its query (`/a?b#c` -> (`/a`, `b`)); the fragment is dropped.
fn split_path(path: &str) -> (String, Option<String>) {
    let path = path.trim().split('#').next().unwrap_or("");
    match path.split_once('?') {
        Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
        None => (path.to_owned(), None),
    }
}

/// Percent-encodes what may not stand in a request target as it is (spaces, controls,
/// non-ASCII, `"<>\^`{|}`, a `%` not followed by two hex digits); everything else, `%XX`
/// escapes included, is left for the broker to judge (it refuses `%2F` and `..` itself).
fn encode(text: &str, query: bool) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    for (i, &b) in bytes.iter().enumerate() {
        let escape_ok = b == b'%'
            && bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
            && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit);
        let keep = b.is_ascii_alphanumeric()
            || b"-._~!$&'()*+,;=:@/".contains(&b)
            || (query && b == b'?')
            || escape_ok;
        if keep {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encodes a query name or value: all but the unreserved characters.
fn encode_component(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A text from outside (an operator's description, a URL, an error) on one line, capped.
fn shown(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let flat = flat.trim();
    match flat.char_indices().nth(MAX_SHOWN) {
        Some((end, _)) => format!("{}…", &flat[..end]),
        None => flat.to_owned(),
    }
}

/// The cap of body text for a turn whose tool results are cut at `result_cap` bytes: the
/// fetch cuts first, so its own note (where, and how to get the rest) is what the model
/// sees.
pub fn text_cap(result_cap: usize) -> usize {
    TEXT_CAP.min(result_cap.saturating_sub(1024)).max(256)
}

/// How a refusal by the broker reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// One of the route's rules refused the request (`403` with [`DENIED_HEADER`] and
    /// [`BROKER_HEADER`]).
    Denied(Denial),
    /// One of the broker's caps or failures (`{"error": …}` with `413`, `429`, `502`,
    /// `503` or `504`, and [`BROKER_HEADER`]).
    Broker {
        /// The status.
        status: u16,
        /// The broker's error text.
        error: String,
    },
}

impl Refusal {
    /// Reads a refusal from an answer's head and (the first bytes of) its body.
    pub fn of(route: &str, head: &ResponseHead, body: &[u8]) -> Option<Refusal> {
        // Only an answer the broker wrote carries its mark (it removes the mark and the
        // denial header from a site's answers): anything else is the site's.
        head.header(BROKER_HEADER)?;
        if head.status == 403 {
            let rule = head.header(DENIED_HEADER)?;
            let denial = serde_json::from_slice::<Denial>(body).unwrap_or_else(|_| Denial {
                error: egress::DENIED.into(),
                route: route.into(),
                rule: rule.into(),
                reason: String::new(),
            });
            return Some(Refusal::Denied(Denial {
                error: denial.error,
                route: shown(&denial.route),
                rule: shown(&denial.rule),
                reason: shown(&denial.reason),
            }));
        }
        if [413, 429, 502, 503, 504].contains(&head.status) {
            let body = serde_json::from_slice::<ErrorBody>(body).ok()?;
            return Some(Refusal::Broker {
                status: head.status,
                error: shown(&body.error),
            });
        }
        None
    }

    /// The refusal for the model or a person: what refused, why, and that a retry of the
    /// same request gets the same answer.
    pub fn explain(&self) -> String {
        match self {
            Refusal::Denied(d) => {
                let reason = if d.reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", d.reason)
                };
                format!(
                    "refused by the sandbox's egress rules, not by the site: route {}, rule {}{reason}. \
                     The same request will be refused again: change it (another method, path or route) \
                     or say that it is not allowed",
                    d.route, d.rule
                )
            }
            Refusal::Broker { status, error } => {
                format!("the broker answered {status}: {error} (a limit or failure of the broker, not the site's answer)")
            }
        }
    }
}

/// A sink that keeps the first `cap` bytes of a body and refuses the rest (the copy stops).
struct FirstBytes {
    kept: Vec<u8>,
    cap: usize,
    full: bool,
}

impl FirstBytes {
    fn new(cap: usize) -> Self {
        Self {
            kept: Vec::new(),
            cap,
            full: false,
        }
    }
}

impl Write for FirstBytes {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = self.cap - self.kept.len();
        if room == 0 && !buf.is_empty() {
            self.full = true;
            return Err(std::io::Error::other("cap reached"));
        }
        let n = buf.len().min(room);
        self.kept.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A failed exchange and its cause on one line.
fn http_text(error: &HttpError) -> String {
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

/// A body read (at most some bytes of it): the bytes and whether more were left unread.
struct Body {
    bytes: Vec<u8>,
    cut: bool,
}

/// Sends `request` and reads its head and the first `cap` bytes of its body.
fn exchange(
    client: &UnixHttpClient,
    request: &FetchRequest,
    form: Option<&RouteForm>,
    timeout: Duration,
    cap: usize,
) -> Result<(ResponseHead, Body), String> {
    let path = request.broker_path(form)?;
    let wire = Request {
        method: &request.method,
        path: &path,
        headers: &request.headers,
        body: &request.body,
    };
    let exchange = client.request(&wire, timeout).map_err(|e| http_text(&e))?;
    let head = exchange.head().clone();
    let mut sink = FirstBytes::new(cap);
    match exchange.copy_body(&mut sink, MAX_BODY) {
        Ok(_) => {}
        Err(HttpError::Sink(_)) if sink.full => {}
        Err(HttpError::TooLarge(_)) => sink.full = true,
        Err(e) => return Err(http_text(&e)),
    }
    Ok((
        head,
        Body {
            bytes: sink.kept,
            cut: sink.full,
        },
    ))
}

/// What a body is, for showing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An HTML page: reduced to text.
    Html,
    /// Text (JSON, XML, plain …): shown as it is.
    Text,
    /// Anything else: summarised.
    Binary,
}

/// The media type of a `Content-Type` value, lower-cased, without parameters.
fn media_type(content_type: Option<&str>) -> String {
    content_type
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// Whether the first bytes of a body read as text: UTF-8 (a sequence cut at the end
/// aside) with no NUL.
fn looks_like_text(body: &[u8]) -> bool {
    let head = &body[..body.len().min(8192)];
    if head.contains(&0) {
        return false;
    }
    match std::str::from_utf8(head) {
        Ok(_) => true,
        Err(e) => e.error_len().is_none(),
    }
}

/// Whether a text body starts like an HTML document.
fn looks_like_html(body: &[u8]) -> bool {
    let start = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(body.len());
    let head =
        String::from_utf8_lossy(&body[start..body.len().min(start + 64)]).to_ascii_lowercase();
    head.starts_with("<!doctype html") || head.starts_with("<html")
}

/// What a body is, from its declared type and encoding and, when they say little, its
/// first bytes.
pub fn kind(head: &ResponseHead, body: &[u8]) -> Kind {
    if head
        .header("content-encoding")
        .is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"))
    {
        return Kind::Binary;
    }
    let media = media_type(head.header("content-type"));
    let text = looks_like_text(body);
    match media.as_str() {
        "text/html" | "application/xhtml+xml" if text => Kind::Html,
        m if m.starts_with("text/")
            || m.ends_with("+json")
            || m.ends_with("+xml")
            || [
                "application/json",
                "application/xml",
                "application/javascript",
                "application/ecmascript",
                "application/x-www-form-urlencoded",
                "application/yaml",
                "application/x-yaml",
                "application/toml",
                "application/x-ndjson",
                "application/graphql",
                "application/sql",
                "application/csv",
            ]
            .contains(&m) =>
        {
            if text {
                Kind::Text
            } else {
                Kind::Binary
            }
        }
        m if ["image/", "audio/", "video/", "font/"]
            .iter()
            .any(|p| m.starts_with(p)) =>
        {
            Kind::Binary
        }
        _ if !text => Kind::Binary,
        _ if looks_like_html(body) => Kind::Html,
        _ => Kind::Text,
    }
}

/// Escapes every control character but newline and tab as `\u{hex}` (C0, DEL, C1); a
/// carriage return before a newline is dropped, one alone becomes a newline.
pub fn clean_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' | '\t' => out.push(c),
            '\r' => {
                if chars.peek() != Some(&'\n') {
                    out.push('\n');
                }
            }
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// The body as text (HTML reduced by `html`, or shown as it came with the reason when it
/// cannot be), cleaned; `None` for a binary body.
pub fn body_text(head: &ResponseHead, body: &[u8], html: &HtmlConverter) -> Option<(Kind, String)> {
    match kind(head, body) {
        Kind::Binary => None,
        Kind::Html => match html.convert(body) {
            Ok(text) => Some((Kind::Html, clean_text(&text))),
            Err(why) => Some((
                Kind::Text,
                format!(
                    "[the page was not reduced to text ({}); its HTML as it came:]\n{}",
                    shown(&why),
                    clean_text(&String::from_utf8_lossy(body))
                ),
            )),
        },
        Kind::Text => Some((Kind::Text, clean_text(&String::from_utf8_lossy(body)))),
    }
}

/// `text` cut to at most `cap` bytes on a character boundary, and whether it was cut.
fn cut(text: &str, cap: usize) -> (&str, bool) {
    if text.len() <= cap {
        return (text, false);
    }
    let mut end = cap;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (&text[..end], true)
}

/// A binary body's summary: type, size, first bytes in hex.
fn binary_summary(head: &ResponseHead, body: &Body) -> String {
    let media = match media_type(head.header("content-type")) {
        m if m.is_empty() => "no content-type".to_owned(),
        m => shown(&m),
    };
    let encoding = head
        .header("content-encoding")
        .map(|e| format!(", content-encoding {} (not decoded)", shown(e)))
        .unwrap_or_default();
    let size = match head.content_length() {
        Some(n) => format!("{n} bytes"),
        None if body.cut => format!("more than {} bytes", body.bytes.len()),
        None => format!("{} bytes", body.bytes.len()),
    };
    let hex: Vec<String> = body
        .bytes
        .iter()
        .take(HEX_BYTES)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "binary ({media}{encoding}, {size}), not shown; first {} bytes: {}",
        hex.len(),
        hex.join(" ")
    )
}

/// The `fetch` tool over the turn's routes.
#[derive(Debug, Clone)]
pub struct Fetcher {
    client: UnixHttpClient,
    routes: Vec<RouteSpec>,
    timeout: Duration,
    text_cap: usize,
    html: HtmlConverter,
}

impl Fetcher {
    /// The tool over `routes` through the broker at `socket`; `None` without routes (no
    /// tool is offered then).
    pub fn new(
        socket: &Path,
        routes: &[RouteSpec],
        timeout: Duration,
        text_cap: usize,
        html: HtmlConverter,
    ) -> Option<Self> {
        (!routes.is_empty()).then(|| Self {
            client: UnixHttpClient::new(socket, READ_CAP),
            routes: routes.to_vec(),
            timeout,
            text_cap,
            html,
        })
    }

    /// The tool as the model sees it: its description lists the routes.
    pub fn definition(&self) -> ToolDef {
        let mut description = format!(
            "Make an HTTP request through one of the operator's egress routes (the sandbox has no \
             other network). The broker checks each request against the route's rules and may \
             refuse it; a refusal says which rule. Returns the status, a few headers and the body \
             as text: HTML reduced to readable text (links listed at the end), text and JSON as \
             they are, at most {} KiB; binary bodies summarised. Programs run with sh can do the \
             same: `/roundtable-guest fetch ROUTE URL-or-PATH > file` (curl-like; --help).\nRoutes:",
            self.text_cap / 1024
        );
        for route in self.routes.iter().take(MAX_ROUTES_LISTED) {
            let (takes, what) = match &route.form {
                RouteForm::Upstream { base } => ("path", format!("a path under {}", shown(base))),
                RouteForm::Hosts { hosts } => (
                    "url",
                    format!(
                        "a whole URL on {}",
                        shown(
                            &hosts
                                .iter()
                                .take(20)
                                .cloned()
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    ),
                ),
            };
            let methods = if route.methods.is_empty() {
                "GET, HEAD".to_owned()
            } else {
                shown(&route.methods.join(", "))
            };
            description.push_str(&format!(
                "\n- {}: give `{takes}`, {what}; methods {methods}",
                shown(&route.name)
            ));
            if !route.description.trim().is_empty() {
                description.push_str(&format!(". {}", shown(&route.description)));
            }
        }
        if self.routes.len() > MAX_ROUTES_LISTED {
            description.push_str(&format!(
                "\n- and {} more",
                self.routes.len() - MAX_ROUTES_LISTED
            ));
        }
        let names: Vec<&str> = self.routes.iter().map(|r| r.name.as_str()).collect();
        ToolDef {
            name: builtin_tools::FETCH.into(),
            description,
            parameters: json!({"type":"object","properties":{
                "route":{"type":"string","enum":names,"description":"the route (see the list above)"},
                "method":{"type":"string","description":"the HTTP method (default GET)"},
                "url":{"type":"string","description":"for a route of hosts: the whole URL, https://host/path?query"},
                "path":{"type":"string","description":"for a route with a fixed upstream: the path under it, /a/b?query"},
                "query":{"type":"object","additionalProperties":{"type":["string","number","boolean"]},
                    "description":"query parameters added to the URL or path (encoded here)"},
                "headers":{"type":"object","additionalProperties":{"type":"string"},
                    "description":"request headers (credentials are added by the broker, never here)"},
                "body":{"type":"string","description":"the request body; Content-Type defaults to application/json when it is JSON, else text/plain"}},
                "required":["route"],"additionalProperties":false}),
        }
    }

    /// Runs one call: the answer as text, or the error (a refusal among them) for the model.
    pub fn call(&self, args: &Map<String, Value>) -> Result<String, String> {
        let request = tool_request(args)?;
        let route = self
            .routes
            .iter()
            .find(|r| r.name == request.route)
            .ok_or_else(|| {
                let names: Vec<String> = self.routes.iter().map(|r| shown(&r.name)).collect();
                format!(
                    "there is no route {}; the routes are: {}",
                    shown(&request.route),
                    names.join(", ")
                )
            })?;
        let (head, body) = exchange(
            &self.client,
            &request,
            Some(&route.form),
            self.timeout,
            READ_CAP,
        )?;
        if let Some(refusal) = Refusal::of(&request.route, &head, &body.bytes) {
            let mut text = refusal.explain();
            if matches!(refusal, Refusal::Denied(_)) && !route.methods.is_empty() {
                text.push_str(&format!(
                    ". Route {} allows {}",
                    shown(&route.name),
                    shown(&route.methods.join(", "))
                ));
            }
            return Err(text);
        }
        Ok(self.show(&request, &head, &body))
    }

    /// The answer for the model: status, selected headers, the body as text.
    fn show(&self, request: &FetchRequest, head: &ResponseHead, body: &Body) -> String {
        let mut out = format!(
            "status {} ({} {} via route {})\n",
            head.status,
            request.method,
            shown(request.target.text()),
            shown(&request.route)
        );
        for name in SHOWN_HEADERS.iter().chain([&DENIED_HEADER]) {
            if let Some(value) = head.header(name) {
                out.push_str(&format!("{name}: {}\n", shown(value)));
            }
        }
        if (300..400).contains(&head.status) && head.header("location").is_some() {
            out.push_str("(a redirect: not followed; fetch the location if a route allows it)\n");
        }
        let command = |what: &str| {
            format!(
                "run in sh: /roundtable-guest fetch{what} {} '{}' > FILE",
                shown(&request.route),
                command_target(request).replace('\'', "'\\''")
            )
        };
        if body.bytes.is_empty() {
            out.push_str("(no body)\n");
            return out;
        }
        let Some((kind, text)) = body_text(head, &body.bytes, &self.html) else {
            out.push_str(&format!(
                "body: {}; to save it, {}\n",
                binary_summary(head, body),
                command("")
            ));
            return out;
        };
        let label = match kind {
            Kind::Html => "HTML reduced to text",
            _ => "text",
        };
        out.push_str(&format!("body ({label}):\n"));
        let (shown_text, text_cut) = cut(&text, self.text_cap);
        out.push_str(shown_text);
        if !out.ends_with('\n') {
            out.push('\n');
        }
        if text_cut || body.cut {
            let read = if body.cut {
                format!(
                    "; only the first {} KiB of the body were read",
                    body.bytes.len() / 1024
                )
            } else {
                String::new()
            };
            let what = if kind == Kind::Html { " --text" } else { "" };
            out.push_str(&format!(
                "[cut at {} of {} bytes of text{read}; for all of it, {}, then read FILE]\n",
                shown_text.len(),
                text.len(),
                command(what)
            ));
        }
        out
    }
}

/// The target as `roundtable-guest fetch` takes it: the query parameters in it, no
/// fragment, on one line.
fn command_target(request: &FetchRequest) -> String {
    let target = request.target.text().trim();
    let mut target: String = target
        .split('#')
        .next()
        .unwrap_or("")
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    for (i, (name, value)) in request.query.iter().enumerate() {
        let sep = if i == 0 && !target.contains('?') {
            '?'
        } else {
            '&'
        };
        target.push_str(&format!(
            "{sep}{}={}",
            encode_component(name),
            encode_component(value)
        ));
    }
    target
}

/// The tool's arguments as a request.
fn tool_request(args: &Map<String, Value>) -> Result<FetchRequest, String> {
    const KNOWN: [&str; 7] = ["route", "method", "url", "path", "query", "headers", "body"];
    if let Some(key) = args.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(format!(
            "invalid arguments: unknown argument '{}'",
            shown(key)
        ));
    }
    let string = |key: &str| -> Result<Option<&str>, String> {
        match args.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(format!("invalid arguments: {key} must be a string")),
        }
    };
    let route = string("route")?.ok_or("invalid arguments: route is required")?;
    let method = string("method")?
        .unwrap_or("GET")
        .trim()
        .to_ascii_uppercase();
    let target = match (string("url")?, string("path")?) {
        (Some(url), None) => Target::Url(url.to_owned()),
        (None, Some(path)) => Target::Path(path.to_owned()),
        (Some(_), Some(_)) => return Err("invalid arguments: give url or path, not both".into()),
        (None, None) => {
            return Err("invalid arguments: give url (a route of hosts) or path (a route with a fixed upstream)".into())
        }
    };
    let pairs = |key: &str, scalars: bool| -> Result<Vec<(String, String)>, String> {
        match args.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Object(map)) => map
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k.clone(), s.clone())),
                    Value::Number(_) | Value::Bool(_) if scalars => Ok((k.clone(), v.to_string())),
                    _ => Err(format!(
                        "invalid arguments: {key}.{} must be a string",
                        shown(k)
                    )),
                })
                .collect(),
            Some(_) => Err(format!("invalid arguments: {key} must be an object")),
        }
    };
    let query = pairs("query", true)?;
    let mut headers = pairs("headers", false)?;
    let body = string("body")?.unwrap_or("").as_bytes().to_vec();
    if !body.is_empty()
        && !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
    {
        let json =
            serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.is_object() || v.is_array());
        let content_type = if json {
            "application/json"
        } else {
            "text/plain; charset=utf-8"
        };
        headers.push(("Content-Type".into(), content_type.into()));
    }
    Ok(FetchRequest {
        route: route.to_owned(),
        method,
        target,
        query,
        headers,
        body,
    })
}

/// The subcommand's usage.
pub const USAGE: &str = "\
usage: roundtable-guest fetch [OPTIONS] ROUTE URL-or-PATH

A web request through one of the operator's egress routes (the sandbox has no other
network; the broker checks each request against the route's rules). A route of hosts takes
a whole URL (https://host/path?query), a route with a fixed upstream a path under it
(/a/b?query). The body goes to stdout as it came (use > FILE); the status goes to stderr.

options:
  -X, --request METHOD    the method (default GET, or POST with a body)
  -H, --header 'Name: v'  a request header (repeatable)
  -d, --data BODY         a request body (default Content-Type: application/x-www-form-urlencoded);
                          @PATH: the file's bytes (as --data-binary)
      --data-file PATH    the request body from a file (- for stdin), same default type
      --json BODY         a JSON body (Content-Type and Accept: application/json)
      --text              the body as text: HTML reduced to readable text, controls escaped;
                          a binary body is summarised
  -i, --include           the status and headers on stdout before the body
  -s, --silent            no status line on stderr (errors are still shown)
  -m, --max-time SECS     give up after SECS seconds (default 120, at most 600)
  -h, --help              this text

exit status: 0 the site answered below 400; 1 the request failed (broker unreachable,
timeout, malformed answer, body past 256 MiB, stdout closed); 2 bad usage; 3 refused by the
egress rules (route, rule and reason on stderr; the same request is refused again);
4 a limit or failure of the broker (413, 429, 502, 503, 504); 22 the site answered 400 or
more (its body is not written; its start is shown on stderr), as curl --fail.
";

/// Exit statuses of the subcommand.
mod exit {
    pub const OK: i32 = 0;
    pub const FAILED: i32 = 1;
    pub const USAGE: i32 = 2;
    pub const DENIED: i32 = 3;
    pub const BROKER: i32 = 4;
    pub const HTTP: i32 = 22;
}

/// The subcommand's options.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Options {
    request: FetchRequest,
    text: bool,
    include: bool,
    silent: bool,
    timeout: Duration,
}

/// What the command line asks.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Parsed {
    Run(Box<Options>),
    Help,
}

/// Parses the subcommand's arguments (those after `fetch`). `read_file` reads a
/// `--data-file` (`-`: stdin).
fn parse(
    args: &[String],
    read_file: &mut dyn FnMut(&str) -> Result<Vec<u8>, String>,
) -> Result<Parsed, String> {
    let mut method: Option<String> = None;
    let mut headers: Vec<(String, String)> = Vec::new();
    let mut body: Option<(Vec<u8>, &str)> = None;
    let mut json = false;
    let (mut text, mut include, mut silent) = (false, false, false);
    let mut timeout = COMMAND_TIMEOUT;
    let mut positional: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        i += 1;
        if arg == "--" {
            positional.extend(args[i..].iter().map(String::as_str));
            break;
        }
        if !arg.starts_with('-') || arg == "-" {
            positional.push(arg);
            continue;
        }
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if arg.starts_with("--") => (n, Some(v.to_owned())),
            _ => (arg, None),
        };
        let mut value = |what: &str| -> Result<String, String> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            let v = args
                .get(i)
                .cloned()
                .ok_or_else(|| format!("{name} needs {what}"))?;
            i += 1;
            Ok(v)
        };
        match name {
            "-X" | "--request" => method = Some(value("a method")?.trim().to_ascii_uppercase()),
            "-H" | "--header" => {
                let header = value("a header")?;
                let (n, v) = header
                    .split_once(':')
                    .ok_or_else(|| format!("header {:?} is not 'Name: value'", shown(&header)))?;
                headers.push((n.trim().to_owned(), v.trim().to_owned()));
            }
            "-d" | "--data" | "--data-binary" => {
                // As curl: `@PATH` is the body of a file (sent as it is).
                let data = value("a body")?;
                let bytes = match data.strip_prefix('@') {
                    Some(path) => read_file(path)?,
                    None => data.into_bytes(),
                };
                body = Some((bytes, "application/x-www-form-urlencoded"));
            }
            "--data-file" => {
                let path = value("a path")?;
                body = Some((read_file(&path)?, "application/x-www-form-urlencoded"));
            }
            "--json" => {
                body = Some((value("a body")?.into_bytes(), "application/json"));
                json = true;
            }
            "--text" => text = true,
            "-i" | "--include" => include = true,
            "-s" | "--silent" => silent = true,
            "-m" | "--max-time" => {
                let secs = value("seconds")?;
                let secs: u64 = secs
                    .trim()
                    .parse()
                    .ok()
                    .filter(|s| (1..=MAX_COMMAND_TIMEOUT).contains(s))
                    .ok_or_else(|| {
                        format!("--max-time takes 1 to {MAX_COMMAND_TIMEOUT} seconds")
                    })?;
                timeout = Duration::from_secs(secs);
            }
            "-h" | "--help" => return Ok(Parsed::Help),
            other => return Err(format!("unknown option {}", shown(other))),
        }
    }
    let [route, target] = positional[..] else {
        return Err(format!(
            "give a route and a URL or path ({} arguments given)",
            positional.len()
        ));
    };
    let has = |headers: &[(String, String)], name: &str| {
        headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name))
    };
    let body = match body {
        Some((bytes, content_type)) => {
            if !has(&headers, "content-type") {
                headers.push(("Content-Type".into(), content_type.into()));
            }
            if json && !has(&headers, "accept") {
                headers.push(("Accept".into(), "application/json".into()));
            }
            bytes
        }
        None => Vec::new(),
    };
    let method = method.unwrap_or_else(|| if body.is_empty() { "GET" } else { "POST" }.into());
    let target = if target.contains("://") {
        Target::Url(target.to_owned())
    } else {
        Target::Path(target.to_owned())
    };
    Ok(Parsed::Run(Box::new(Options {
        request: FetchRequest {
            route: route.to_owned(),
            method,
            target,
            query: Vec::new(),
            headers,
            body,
        },
        text,
        include,
        silent,
        timeout,
    })))
}

/// Reads a `--data-file`: a file, or stdin for `-`, at most [`MAX_REQUEST`] bytes.
pub fn read_data_file(path: &str) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    let limit = MAX_REQUEST as u64 + 1;
    let read = if path == "-" {
        std::io::stdin().lock().take(limit).read_to_end(&mut bytes)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(limit).read_to_end(&mut bytes))
    };
    read.map_err(|e| format!("cannot read {}: {e}", shown(path)))?;
    if bytes.len() > MAX_REQUEST {
        return Err(format!(
            "{} is larger than {MAX_REQUEST} bytes",
            shown(path)
        ));
    }
    Ok(bytes)
}

/// `roundtable-guest fetch …`: runs the request through the broker at `socket`, the body
/// to `stdout`, the status and any refusal to `stderr`; returns the exit status.
pub fn command(
    args: &[String],
    socket: &Path,
    html: &HtmlConverter,
    read_file: &mut dyn FnMut(&str) -> Result<Vec<u8>, String>,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let options = match parse(args, read_file) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Help) => {
            return match stdout.write_all(USAGE.as_bytes()) {
                Ok(()) => exit::OK,
                Err(_) => exit::FAILED,
            }
        }
        Err(error) => {
            let _ = writeln!(stderr, "roundtable-guest fetch: {error}\n\n{USAGE}");
            return exit::USAGE;
        }
    };
    let (code, message) = run_command(&options, socket, html, stdout);
    if let Some(message) = message {
        let _ = writeln!(stderr, "roundtable-guest fetch: {message}");
    }
    code
}

/// Runs the parsed command: its exit status and the line for stderr.
fn run_command(
    options: &Options,
    socket: &Path,
    html: &HtmlConverter,
    stdout: &mut dyn Write,
) -> (i32, Option<String>) {
    let request = &options.request;
    let client = UnixHttpClient::new(socket, MAX_BODY);
    let failed = |why: String| (exit::FAILED, Some(why));
    let path = match request.broker_path(None) {
        Ok(path) => path,
        Err(why) => return (exit::USAGE, Some(why)),
    };
    let wire = Request {
        method: &request.method,
        path: &path,
        headers: &request.headers,
        body: &request.body,
    };
    let exchange = match client.request(&wire, options.timeout) {
        Ok(exchange) => exchange,
        Err(HttpError::Request(why)) => return (exit::USAGE, Some(why)),
        Err(e) => return failed(http_text(&e)),
    };
    let head = exchange.head().clone();
    if head.status >= 400 {
        // A refusal or the site's error: its first bytes, for stderr.
        let mut sink = FirstBytes::new(64 * 1024);
        match exchange.copy_body(&mut sink, MAX_BODY) {
            Ok(_) | Err(HttpError::Sink(_) | HttpError::TooLarge(_)) => {}
            Err(e) => return failed(http_text(&e)),
        }
        return match Refusal::of(&request.route, &head, &sink.kept) {
            Some(refusal @ Refusal::Denied(_)) => (exit::DENIED, Some(refusal.explain())),
            Some(refusal) => (exit::BROKER, Some(refusal.explain())),
            None => {
                let start =
                    String::from_utf8_lossy(&sink.kept[..sink.kept.len().min(MAX_SHOWN * 4)])
                        .into_owned();
                let start = if sink.kept.is_empty() || !looks_like_text(&sink.kept) {
                    String::new()
                } else {
                    format!(": {}", shown(&start))
                };
                (
                    exit::HTTP,
                    Some(format!("the site answered {}{start}", head.status)),
                )
            }
        };
    }
    if options.include {
        let mut text = format!("HTTP/1.1 {}\r\n", head.status);
        for (name, value) in &head.headers {
            text.push_str(&format!("{name}: {value}\r\n"));
        }
        text.push_str("\r\n");
        if let Err(e) = stdout.write_all(text.as_bytes()) {
            return failed(format!("cannot write to stdout: {e}"));
        }
    }
    let size = if options.text {
        let mut sink = FirstBytes::new(TEXT_READ_CAP);
        match exchange.copy_body(&mut sink, MAX_BODY) {
            Ok(_) => {}
            Err(HttpError::Sink(_) | HttpError::TooLarge(_)) => sink.full = true,
            Err(e) => return failed(http_text(&e)),
        }
        let body = Body {
            cut: sink.full,
            bytes: sink.kept,
        };
        let text = match body_text(&head, &body.bytes, html) {
            Some((_, text)) => text,
            None => format!("[{}]\n", binary_summary(&head, &body)),
        };
        if let Err(e) = stdout.write_all(text.as_bytes()) {
            return failed(format!("cannot write to stdout: {e}"));
        }
        if body.cut {
            return failed(format!(
                "the body is longer than {} MiB: only its start was read and shown",
                TEXT_READ_CAP >> 20
            ));
        }
        body.bytes.len() as u64
    } else {
        match exchange.copy_body(stdout, MAX_BODY) {
            Ok(n) => n,
            Err(HttpError::Sink(e)) => return failed(format!("cannot write to stdout: {e}")),
            Err(e) => return failed(format!("the body was cut: {}", http_text(&e))),
        }
    };
    if let Err(e) = stdout.flush() {
        return failed(format!("cannot write to stdout: {e}"));
    }
    let mut line = format!(
        "{} ({}, {size} bytes)",
        head.status,
        shown(head.header("content-type").unwrap_or("no content-type"))
    );
    if let Some(location) = head.header("location") {
        line.push_str(&format!("; location {} (not followed)", shown(location)));
    }
    (exit::OK, (!options.silent).then_some(line))
}

#[cfg(test)]
mod tests;
