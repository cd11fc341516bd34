use super::*;
use crate::testutil::{answer, StubBroker};

fn hosts_route(name: &str, hosts: &[&str]) -> RouteSpec {
    RouteSpec {
        name: name.into(),
        form: RouteForm::Hosts {
            hosts: hosts.iter().map(|h| (*h).to_owned()).collect(),
        },
        methods: vec!["GET".into(), "HEAD".into()],
        description: "Pages a guest links.".into(),
    }
}

fn upstream_route(name: &str, base: &str) -> RouteSpec {
    RouteSpec {
        name: name.into(),
        form: RouteForm::Upstream { base: base.into() },
        methods: vec!["GET".into(), "POST".into()],
        description: String::new(),
    }
}

fn routes() -> Vec<RouteSpec> {
    vec![
        hosts_route("web", &["example.org", "*.example.net"]),
        upstream_route("api", "https://api.example.com/v1"),
    ]
}

fn fetcher(broker: &StubBroker, text_cap: usize) -> Fetcher {
    Fetcher::new(
        broker.socket(),
        &routes(),
        Duration::from_secs(30),
        text_cap,
        HtmlConverter::InProcess,
    )
    .unwrap()
}

fn args(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

const PAGE: &str = r#"<!DOCTYPE html>
<html><head><title>Menu</title>
<style>body { color: red; } .secret { display: none }</style>
<script>alert("the script runs"); var token = "script-text";</script>
</head>
<body>
<h1>Fish &amp; Chips &mdash; caf&eacute; &#x201C;quoted&#x201D;</h1>
<p>Today: <a href="https://example.org/next">the next page</a> and
<a href="/relative">a relative one</a>.</p>
<noscript>enable scripts</noscript>
<script type="module">import("x"); more_script_text()</script>
<ul><li>one</li><li>two &lt;b&gt;</li></ul>
</body></html>"#;

#[test]
fn an_html_page_is_reduced_to_text_in_the_guest() {
    let broker = StubBroker::start(vec![answer(
        200,
        &[
            ("Content-Type", "text/html; charset=utf-8"),
            ("Set-Cookie", "ignored=1"),
        ],
        PAGE.as_bytes(),
    )]);
    let out = fetcher(&broker, TEXT_CAP)
        .call(&args(json!({
            "route": "web",
            "url": "https://example.org/menu today?lang=fr#top",
            "query": {"q": "fish & chips", "n": 2},
            "headers": {"Accept-Language": "fr"}
        })))
        .unwrap();
    let requests = broker.requests();
    assert!(
        requests[0].starts_with(
            "GET /v1/egress/web/https/example.org/menu%20today?lang=fr&n=2&q=fish%20%26%20chips HTTP/1.1\r\n"
        ),
        "{}",
        requests[0]
    );
    assert!(requests[0].contains("\r\nAccept-Language: fr\r\n"));
    assert!(
        out.starts_with("status 200 (GET https://example.org/menu today?lang=fr#top via route web)\ncontent-type: text/html; charset=utf-8\n"),
        "{out}"
    );
    assert!(!out.contains("ignored=1"), "{out}");
    assert!(out.contains("body (HTML reduced to text):\n"), "{out}");
    for present in [
        "Fish & Chips — café “quoted”",
        "the next page",
        "https://example.org/next",
        "/relative",
        "one",
        "two <b>",
    ] {
        assert!(out.contains(present), "{present:?} missing in {out}");
    }
    for absent in [
        "alert",
        "script-text",
        "more_script_text",
        "color: red",
        "display: none",
        "&amp;",
        "&eacute;",
        "<h1>",
        "<a href",
    ] {
        assert!(!out.contains(absent), "{absent:?} present in {out}");
    }
}

#[test]
fn json_is_passed_as_it_is_and_text_past_the_cap_is_cut_with_a_note() {
    let items: Vec<Value> = (0..3000)
        .map(|i| json!({"id": i, "name": format!("item {i}")}))
        .collect();
    let body = serde_json::to_vec(&json!({ "items": items })).unwrap();
    let broker = StubBroker::start(vec![
        answer(200, &[("Content-Type", "application/json")], &body),
        answer(
            200,
            &[("Content-Type", "application/json")],
            br#"{"ok":true}"#,
        ),
    ]);
    let fetch = fetcher(&broker, 1024);
    let out = fetch
        .call(&args(
            json!({"route":"api","path":"/items","query":{"page":2}}),
        ))
        .unwrap();
    let small = fetch
        .call(&args(json!({"route":"api","method":"post","url":"https://api.example.com/v1/items","body":"{\"name\":\"x\"}"})))
        .unwrap();
    let requests = broker.requests();
    assert!(
        requests[0].starts_with("GET /v1/egress/api/items?page=2 HTTP/1.1\r\n"),
        "{}",
        requests[0]
    );
    // A whole URL under the route's base is taken as its path; a JSON body gets its type.
    assert!(
        requests[1].starts_with("POST /v1/egress/api/items HTTP/1.1\r\n"),
        "{}",
        requests[1]
    );
    assert!(requests[1].contains("\r\nContent-Type: application/json\r\n"));
    assert!(requests[1].ends_with("\r\n\r\n{\"name\":\"x\"}"));

    assert!(
        out.contains("body (text):\n{\"items\":[{\"id\":0,\"name\":\"item 0\"}"),
        "{out}"
    );
    let note = format!(
        "[cut at 1024 of {} bytes of text; for all of it, run in sh: /roundtable-guest fetch api '/items?page=2' > FILE, then read FILE]\n",
        body.len()
    );
    assert!(out.ends_with(&note), "{out}");
    assert!(out.len() < 1024 + 600, "{}", out.len());
    assert!(small.ends_with("body (text):\n{\"ok\":true}\n"), "{small}");
}

#[test]
fn a_body_past_the_read_cap_is_read_in_part_and_said_so() {
    let body = "line of text\n".repeat(READ_CAP / 13 + 1000);
    let broker = StubBroker::start(vec![answer(
        200,
        &[("Content-Type", "text/plain")],
        body.as_bytes(),
    )]);
    let out = fetcher(&broker, 4096)
        .call(&args(
            json!({"route":"web","url":"https://example.org/big.txt"}),
        ))
        .unwrap();
    broker.requests();
    assert!(
        out.contains(&format!(
            "[cut at 4096 of {READ_CAP} bytes of text; only the first 2048 KiB of the body were read; for all of it, run in sh: /roundtable-guest fetch web 'https://example.org/big.txt' > FILE, then read FILE]"
        )),
        "{}",
        &out[out.len() - 400..]
    );
}

#[test]
fn binary_bodies_are_summarised_never_passed() {
    let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
    png.extend((0..=255u8).cycle().take(5000));
    let gzip = b"\x1f\x8b\x08\0\0\0\0\0\0\x03text".to_vec();
    let broker = StubBroker::start(vec![
        answer(200, &[("Content-Type", "image/png")], &png),
        answer(
            200,
            &[("Content-Type", "text/plain"), ("Content-Encoding", "gzip")],
            &gzip,
        ),
        answer(200, &[], b"\x7fELF\x02\x01\x01\0\0\0"),
        // No type, but text: shown.
        answer(
            200,
            &[("Content-Type", "application/octet-stream")],
            b"plain words",
        ),
    ]);
    let fetch = fetcher(&broker, TEXT_CAP);
    let call = |url: &str| fetch.call(&args(json!({"route":"web","url":url}))).unwrap();
    let image = call("https://example.org/a.png");
    let packed = call("https://example.org/a.txt");
    let elf = call("https://example.org/a.bin");
    let words = call("https://example.org/a.dat");
    broker.requests();
    assert!(
        image.contains(&format!(
            "body: binary (image/png, {} bytes), not shown; first 32 bytes: 89 50 4e 47 0d 0a 1a 0a 00 00 00 0d 49 48 44 52 00 01 02",
            png.len()
        )),
        "{image}"
    );
    assert!(
        image.contains(
            "to save it, run in sh: /roundtable-guest fetch web 'https://example.org/a.png' > FILE"
        ),
        "{image}"
    );
    assert!(
        packed.contains("body: binary (text/plain, content-encoding gzip (not decoded), 14 bytes)"),
        "{packed}"
    );
    assert!(elf.contains("body: binary (no content-type, 10 bytes), not shown; first 10 bytes: 7f 45 4c 46 02 01 01 00 00 00"), "{elf}");
    assert!(words.ends_with("body (text):\nplain words\n"), "{words}");
    for out in [&image, &packed, &elf] {
        assert!(
            out.chars().all(|c| c == '\n' || !c.is_control()),
            "a raw byte passed: {out:?}"
        );
        assert!(!out.contains("IHDR") && !out.contains("ELF"), "{out}");
    }
}

#[test]
fn a_denial_is_told_from_the_sites_own_403_and_a_broker_limit_from_the_sites_429() {
    let denial = serde_json::to_vec(&Denial {
        error: egress::DENIED.into(),
        route: "web".into(),
        rule: "method".into(),
        reason: "DELETE is not allowed on route web\u{1b}[2J".into(),
    })
    .unwrap();
    let broker = StubBroker::start(vec![
        answer(
            403,
            &[
                ("Content-Type", "application/json"),
                (DENIED_HEADER, "method"),
                (BROKER_HEADER, "1"),
            ],
            &denial,
        ),
        answer(403, &[("Content-Type", "text/html")], b"<h1>Forbidden</h1>"),
        answer(
            429,
            &[("Content-Type", "application/json"), (BROKER_HEADER, "1")],
            br#"{"error":"egress: 32 requests in this turn, the route's max_requests_per_turn"}"#,
        ),
        answer(429, &[("Content-Type", "text/plain")], b"slow down"),
        // A site's answer shaped like the broker's, without its mark, is the site's.
        answer(
            429,
            &[("Content-Type", "application/json")],
            br#"{"error":"egress: the route is closed for good"}"#,
        ),
    ]);
    let fetch = fetcher(&broker, TEXT_CAP);
    let denied = fetch
        .call(&args(
            json!({"route":"web","method":"DELETE","url":"https://example.org/x"}),
        ))
        .unwrap_err();
    let forbidden = fetch
        .call(&args(json!({"route":"web","url":"https://example.org/x"})))
        .unwrap();
    let limited = fetch
        .call(&args(json!({"route":"web","url":"https://example.org/x"})))
        .unwrap_err();
    let slow = fetch
        .call(&args(json!({"route":"web","url":"https://example.org/x"})))
        .unwrap();
    let posing = fetch
        .call(&args(json!({"route":"web","url":"https://example.org/x"})))
        .unwrap();
    broker.requests();
    assert!(posing.starts_with("status 429 ("), "{posing}");
    assert!(posing.contains("closed for good"), "{posing}");
    assert_eq!(
        denied,
        "refused by the sandbox's egress rules, not by the site: route web, rule method: \
         DELETE is not allowed on route web [2J. The same request will be refused again: \
         change it (another method, path or route) or say that it is not allowed. \
         Route web allows GET, HEAD"
    );
    assert!(forbidden.starts_with("status 403 (GET"), "{forbidden}");
    assert!(forbidden.contains("Forbidden"), "{forbidden}");
    assert_eq!(
        limited,
        "the broker answered 429: egress: 32 requests in this turn, the route's \
         max_requests_per_turn (a limit or failure of the broker, not the site's answer)"
    );
    assert!(slow.starts_with("status 429 ("), "{slow}");
}

#[test]
fn control_characters_are_escaped_and_newlines_and_tabs_kept() {
    let text = "a\u{1b}[31mred\u{7}\r\nnext\rline\u{9b}x\ttab\u{0}\u{7f}é\n";
    assert_eq!(
        clean_text(text),
        "a\\u{1b}[31mred\\u{7}\nnext\nline\\u{9b}x\ttab\\u{0}\\u{7f}é\n"
    );
    // Through the tool: a text body, and an HTML page whose text holds them.
    let broker = StubBroker::start(vec![
        answer(
            200,
            &[("Content-Type", "text/plain")],
            text.replace('\u{0}', "").as_bytes(),
        ),
        answer(
            200,
            &[("Content-Type", "text/html")],
            "<p>x\u{1b}]0;title\u{7}y &#x9b; &#27;z</p>".as_bytes(),
        ),
    ]);
    let fetch = fetcher(&broker, TEXT_CAP);
    let plain = fetch
        .call(&args(json!({"route":"web","url":"https://example.org/t"})))
        .unwrap();
    let html = fetch
        .call(&args(json!({"route":"web","url":"https://example.org/h"})))
        .unwrap();
    broker.requests();
    for out in [&plain, &html] {
        assert!(
            out.chars()
                .all(|c| c == '\n' || c == '\t' || !c.is_control()),
            "{out:?}"
        );
    }
    assert!(
        plain.contains("a\\u{1b}[31mred\\u{7}\nnext\nline\\u{9b}x\ttab"),
        "{plain}"
    );
    // html5ever drops the raw controls and maps the C1 reference as browsers do.
    assert!(html.contains("x]0;titley › z"), "{html}");
}

#[test]
fn targets_become_broker_paths_and_bad_ones_are_refused_here() {
    let request = |target: Target| FetchRequest {
        route: "web".into(),
        method: "GET".into(),
        target,
        query: Vec::new(),
        headers: Vec::new(),
        body: Vec::new(),
    };
    let url = |u: &str| request(Target::Url(u.into()));
    let path = |p: &str| request(Target::Path(p.into()));
    let hosts = RouteForm::Hosts {
        hosts: vec!["*".into()],
    };
    let upstream = RouteForm::Upstream {
        base: "https://api.example.com/v1/".into(),
    };
    let cases: [(FetchRequest, Option<&RouteForm>, Result<&str, &str>); 13] = [
        (
            url("https://h.example:8443/a/b?c=d&e"),
            Some(&hosts),
            Ok("/v1/egress/web/https/h.example:8443/a/b?c=d&e"),
        ),
        (
            url("https://[::1]:8443/a[b]"),
            None,
            Ok("/v1/egress/web/https/[::1]:8443/a%5Bb%5D"),
        ),
        (
            url("https://h.example"),
            None,
            Ok("/v1/egress/web/https/h.example"),
        ),
        (
            url("https://h.example/ünï cødé/x\"y"),
            None,
            Ok("/v1/egress/web/https/h.example/%C3%BCn%C3%AF%20c%C3%B8d%C3%A9/x%22y"),
        ),
        // Left for the broker to judge (and refuse): encoded slashes, dot segments.
        (
            url("https://h.example/a%2Fb/../c?x=%zz"),
            None,
            Ok("/v1/egress/web/https/h.example/a%2Fb/../c?x=%25zz"),
        ),
        (
            url("h.example/a"),
            Some(&hosts),
            Err("h.example/a is not a whole URL: give scheme://host/path"),
        ),
        (
            url("https:///a"),
            Some(&hosts),
            Err("https:///a is not a whole URL: give scheme://host/path"),
        ),
        (
            path("/a"),
            Some(&hosts),
            Err("route web takes a whole URL (https://host/path), not a path"),
        ),
        (
            path("/forecast/today?days=2#x"),
            Some(&upstream),
            Ok("/v1/egress/web/forecast/today?days=2"),
        ),
        (path("forecast"), None, Ok("/v1/egress/web/forecast")),
        (
            url("https://API.example.com/v1/items?x=1"),
            Some(&upstream),
            Ok("/v1/egress/web/items?x=1"),
        ),
        (
            url("https://api.example.com/v10/items"),
            Some(&upstream),
            Err("route web takes a path under https://api.example.com/v1/, not a whole URL"),
        ),
        (
            url("https://other.example/v1/items"),
            Some(&upstream),
            Err("route web takes a path under https://api.example.com/v1/, not a whole URL"),
        ),
    ];
    for (request, form, expected) in cases {
        let got = request.broker_path(form);
        let expected = expected.map(str::to_owned).map_err(str::to_owned);
        assert_eq!(got, expected, "{request:?}");
    }
    let mut with_query = path("/s");
    with_query.query = vec![
        ("q".into(), "a b&c=d/é".into()),
        ("k y".into(), String::new()),
    ];
    assert_eq!(
        with_query.broker_path(None).unwrap(),
        "/v1/egress/web/s?q=a%20b%26c%3Dd%2F%C3%A9&k%20y="
    );
    let mut odd_route = path("/s");
    odd_route.route = "a/b".into();
    assert_eq!(odd_route.broker_path(None).unwrap(), "/v1/egress/a%2Fb/s");
}

#[test]
fn bad_arguments_are_refused_before_anything_is_sent() {
    let broker = StubBroker::start(Vec::new());
    let fetch = fetcher(&broker, TEXT_CAP);
    let refused = |v: Value| fetch.call(&args(v)).unwrap_err();
    assert_eq!(
        refused(json!({"route":"ftp","url":"https://example.org"})),
        "there is no route ftp; the routes are: web, api"
    );
    assert_eq!(
        refused(json!({"route":"web"})),
        "invalid arguments: give url (a route of hosts) or path (a route with a fixed upstream)"
    );
    assert_eq!(
        refused(json!({"route":"web","url":"https://a","path":"/b"})),
        "invalid arguments: give url or path, not both"
    );
    assert_eq!(
        refused(json!({"route":"web","url":"https://a","timeout":3})),
        "invalid arguments: unknown argument 'timeout'"
    );
    assert_eq!(
        refused(json!({"route":"web","url":"https://a","headers":{"X":1}})),
        "invalid arguments: headers.X must be a string"
    );
    assert_eq!(
        refused(json!({"route":"web","url":"https://a","headers":{"Host":"evil.example"}})),
        "invalid request: header Host is set by the client itself"
    );
    assert_eq!(
        refused(json!({"route":"web","url":"https://a","headers":{"X-A":"1\r\nX-B: 2"}})),
        "invalid request: the value of header X-A has a control character"
    );
    assert_eq!(
        refused(json!({"route":"web","method":"GET /x","url":"https://a"})),
        "invalid request: the method is not an http token"
    );
    assert!(broker.requests().is_empty());
}

#[test]
fn the_tool_is_described_with_the_turns_routes() {
    let none = Fetcher::new(
        Path::new("/nowhere"),
        &[],
        Duration::from_secs(1),
        TEXT_CAP,
        HtmlConverter::InProcess,
    );
    assert!(none.is_none());
    let def = Fetcher::new(
        Path::new("/nowhere"),
        &routes(),
        Duration::from_secs(1),
        31 * 1024,
        HtmlConverter::InProcess,
    )
    .unwrap()
    .definition();
    assert_eq!(def.name, "fetch");
    assert!(
        def.description.contains("at most 31 KiB"),
        "{}",
        def.description
    );
    assert!(
        def.description.ends_with(
            "Routes:\n- web: give `url`, a whole URL on example.org, *.example.net; methods GET, HEAD. Pages a guest links.\n\
             - api: give `path`, a path under https://api.example.com/v1; methods GET, POST"
        ),
        "{}",
        def.description
    );
    assert_eq!(
        def.parameters["properties"]["route"]["enum"],
        json!(["web", "api"])
    );
    assert_eq!(def.parameters["required"], json!(["route"]));
    assert_eq!(def.parameters["additionalProperties"], json!(false));
    assert_eq!(text_cap(32 * 1024), 31 * 1024);
    assert_eq!(text_cap(1 << 20), TEXT_CAP);
    assert_eq!(text_cap(512), 256);
}

/// Runs the subcommand: (exit status, stdout, stderr).
fn run(socket: &Path, args: &[&str]) -> (i32, Vec<u8>, String) {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut files = |path: &str| match path {
        "body.txt" => Ok(b"a=1&b=2".to_vec()),
        other => Err(format!("cannot read {other}: not found")),
    };
    let code = command(
        &args,
        socket,
        &HtmlConverter::InProcess,
        &mut files,
        &mut out,
        &mut err,
    );
    (code, out, String::from_utf8(err).unwrap())
}

#[test]
fn the_subcommand_writes_the_raw_body_and_its_status_like_curl() {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend((0..=255u8).cycle().take(300_000));
    let broker = StubBroker::start(vec![
        answer(200, &[("Content-Type", "image/png")], &png),
        answer(200, &[("Content-Type", "text/html")], PAGE.as_bytes()),
        answer(
            201,
            &[
                ("Content-Type", "application/json"),
                ("Location", "/v1/items/7"),
            ],
            b"{}",
        ),
        answer(200, &[("Content-Type", "application/json")], b"[]"),
        answer(302, &[("Location", "https://example.org/elsewhere")], b""),
        answer(204, &[], b""),
    ]);
    let socket = broker.socket().to_path_buf();
    let raw = run(&socket, &["web", "https://example.org/a.png"]);
    let text = run(
        &socket,
        &["--text", "-s", "web", "https://example.org/menu"],
    );
    let posted = run(
        &socket,
        &[
            "-X",
            "put",
            "-H",
            "X-Trace: 7",
            "--data-file",
            "body.txt",
            "api",
            "/items?x=1",
        ],
    );
    let json = run(&socket, &["-i", "--json", "{\"a\":1}", "api", "/items"]);
    let moved = run(&socket, &["web", "https://example.org/old"]);
    let curlish = run(&socket, &["-d", "@body.txt", "api", "/items"]);
    let requests = broker.requests();

    assert_eq!(raw.0, 0, "{}", raw.2);
    assert_eq!(raw.1, png, "the body must be written as it came");
    assert_eq!(
        raw.2,
        format!(
            "roundtable-guest fetch: 200 (image/png, {} bytes)\n",
            png.len()
        )
    );
    assert!(requests[0].starts_with("GET /v1/egress/web/https/example.org/a.png HTTP/1.1\r\n"));

    assert_eq!((text.0, text.2.as_str()), (0, ""));
    let text = String::from_utf8(text.1).unwrap();
    assert!(
        text.contains("Fish & Chips") && !text.contains("alert"),
        "{text}"
    );

    assert_eq!(posted.0, 0, "{}", posted.2);
    assert!(posted
        .2
        .contains("201 (application/json, 2 bytes); location /v1/items/7 (not followed)"));
    assert!(
        requests[2].starts_with("PUT /v1/egress/api/items?x=1 HTTP/1.1\r\n"),
        "{}",
        requests[2]
    );
    assert!(requests[2].contains("\r\nX-Trace: 7\r\n"));
    assert!(requests[2].contains("\r\nContent-Type: application/x-www-form-urlencoded\r\n"));
    assert!(requests[2].ends_with("\r\n\r\na=1&b=2"));

    assert_eq!(json.0, 0);
    assert!(
        requests[3].starts_with("POST /v1/egress/api/items HTTP/1.1\r\n"),
        "{}",
        requests[3]
    );
    assert!(
        requests[3].contains("\r\nContent-Type: application/json\r\nAccept: application/json\r\n")
    );
    assert_eq!(
        String::from_utf8(json.1).unwrap(),
        "HTTP/1.1 200\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n[]"
    );

    assert_eq!(curlish.0, 0, "{}", curlish.2);
    assert!(
        requests[5].starts_with("POST /v1/egress/api/items HTTP/1.1\r\n"),
        "{}",
        requests[5]
    );
    assert!(requests[5].ends_with("\r\n\r\na=1&b=2"), "{}", requests[5]);

    assert_eq!(moved.0, 0);
    assert!(moved.1.is_empty());
    assert!(
        moved.2.contains(
            "302 (no content-type, 0 bytes); location https://example.org/elsewhere (not followed)"
        ),
        "{}",
        moved.2
    );
}

#[test]
fn the_subcommand_fails_on_a_denial_a_broker_limit_and_an_http_error() {
    let denial = serde_json::to_vec(&Denial {
        error: egress::DENIED.into(),
        route: "web".into(),
        rule: "host".into(),
        reason: "evil.example matches none of the route's hosts".into(),
    })
    .unwrap();
    let broker = StubBroker::start(vec![
        answer(
            403,
            &[(DENIED_HEADER, "host"), (BROKER_HEADER, "1")],
            &denial,
        ),
        answer(
            504,
            &[(BROKER_HEADER, "1")],
            br#"{"error":"egress: the upstream did not answer within 20 s"}"#,
        ),
        answer(404, &[("Content-Type", "text/plain")], b"Not here\x1b[2J"),
        answer(500, &[("Content-Type", "image/png")], b"\x89PNG\0"),
    ]);
    let socket = broker.socket().to_path_buf();
    let denied = run(&socket, &["web", "https://evil.example/"]);
    let timeout = run(&socket, &["web", "https://example.org/slow"]);
    let missing = run(&socket, &["web", "https://example.org/gone"]);
    let failed = run(&socket, &["web", "https://example.org/bad"]);
    broker.requests();
    assert_eq!(denied.0, 3);
    assert!(denied.1.is_empty());
    assert_eq!(
        denied.2,
        "roundtable-guest fetch: refused by the sandbox's egress rules, not by the site: route web, \
         rule host: evil.example matches none of the route's hosts. The same request will be refused \
         again: change it (another method, path or route) or say that it is not allowed\n"
    );
    assert_eq!(timeout.0, 4);
    assert!(timeout
        .2
        .contains("the broker answered 504: egress: the upstream did not answer within 20 s"));
    assert_eq!(missing.0, 22);
    assert!(missing.1.is_empty());
    assert_eq!(
        missing.2,
        "roundtable-guest fetch: the site answered 404: Not here [2J\n"
    );
    assert_eq!(failed.0, 22);
    assert_eq!(failed.2, "roundtable-guest fetch: the site answered 500\n");
}

#[test]
fn the_subcommands_usage_errors_and_an_absent_broker() {
    let nowhere = Path::new("/nonexistent/broker.sock");
    for (args, message) in [
        (
            &[][..],
            "give a route and a URL or path (0 arguments given)",
        ),
        (
            &["web"][..],
            "give a route and a URL or path (1 arguments given)",
        ),
        (
            &["--frobnicate", "web", "https://a"][..],
            "unknown option --frobnicate",
        ),
        (&["-X"][..], "-X needs a method"),
        (
            &["-H", "no colon", "web", "https://a"][..],
            "header \"no colon\" is not 'Name: value'",
        ),
        (
            &["-m", "0", "web", "https://a"][..],
            "--max-time takes 1 to 600 seconds",
        ),
        (
            &["--data-file", "missing", "web", "https://a"][..],
            "cannot read missing: not found",
        ),
        (
            &["-H", "Host: evil", "web", "https://a"][..],
            "header Host is set by the client itself",
        ),
        (&["web", "h.example/x"][..], ""),
    ] {
        let (code, out, err) = run(nowhere, args);
        if message.is_empty() {
            // A path for the route: sent, and the broker is not there.
            assert_eq!(code, 1, "{args:?}: {err}");
            assert!(
                err.starts_with("roundtable-guest fetch: cannot reach the broker: "),
                "{err}"
            );
            continue;
        }
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty());
        assert!(
            err.starts_with(&format!("roundtable-guest fetch: {message}\n")),
            "{args:?}: {err}"
        );
    }
    let (code, out, _) = run(nowhere, &["--help"]);
    assert_eq!(code, 0);
    assert_eq!(String::from_utf8(out).unwrap(), USAGE);
}

#[test]
fn the_subcommand_works_under_the_guests_seccomp_layer() {
    let broker = StubBroker::start(vec![answer(
        200,
        &[("Content-Type", "text/plain")],
        b"hello",
    )]);
    let socket = broker.socket().to_path_buf();
    // The layer binds the thread that installs it (and its children), as `main` does for
    // the whole process before running the subcommand.
    let (code, out, err) = std::thread::spawn(move || {
        crate::seccomp::install().unwrap();
        run(&socket, &["web", "https://example.org/"])
    })
    .join()
    .unwrap();
    broker.requests();
    assert_eq!((code, out.as_slice()), (0, &b"hello"[..]), "{err}");
}
