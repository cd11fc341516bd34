//! Egress routes as the operator sees them (issue 45): `explain` lists each route and
//! flags one in audit mode or reaching private ranges, `doctor` fails a route in audit mode
//! and warns about `allow_private`, and `egress check` gives a route's verdict and rule
//! without sending anything (the routes name hosts of `.invalid`, which never resolve).

mod common;

fn config() -> (tempfile::TempDir, std::path::PathBuf) {
    common::config_in("rtg-", "c.toml", |dir| {
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\nworkspace_root = \"{}\"\n\
             model = \"m\"\nmodel_url = \"https://example.invalid/v1\"\n\
             [limits]\ndisk_floor_mb = 0\ndisk_floor_percent = 0\n\
             [[egress]]\nname = \"wiki\"\nhosts = [\"*.wikipedia.invalid\"]\npaths = [\"/wiki/**\"]\n\
             [[egress.deny]]\npaths = [\"/wiki/Special:*\"]\n\
             [[egress]]\nname = \"api\"\nupstream = \"https://api.invalid/v2\"\nmethods = [\"GET\", \"POST\"]\n\
             credential = {{ env = \"RTG_API_TOKEN\" }}\ncredential_as = {{ header = {{ name = \"x-api-key\" }} }}\n\
             [[egress]]\nname = \"lab\"\nhosts = [\"lab.invalid\"]\nports = [443, 8443]\nmode = \"audit\"\nallow_private = [\"10.9.0.0/16\"]\n",
            dir.join("run").display(),
            dir.join("ws").display()
        )
    })
}

fn cli(args: &[&str], config: &std::path::Path) -> (i32, String, String) {
    common::outcome(
        common::command()
            .args(args)
            .arg("--config")
            .arg(config)
            .env("RTG_API_TOKEN", "tok-never-shown-31"),
    )
}

#[test]
fn egress_check_answers_allow_or_deny_with_the_rule() {
    let (_d, path) = config();
    let cases: &[(&[&str], i32, &str)] = &[
        (
            &["GET", "https://en.wikipedia.invalid/wiki/Rust?x=1#top"],
            0,
            "allow GET en.wikipedia.invalid:443/wiki/Rust?x=1 (route wiki; the address is checked when sent)\n",
        ),
        (
            &["POST", "https://en.wikipedia.invalid/wiki/Rust"],
            1,
            "deny rule method: ",
        ),
        (
            &["GET", "https://en.wikipedia.invalid/wiki/Special:Export"],
            1,
            "deny rule deny[0]: a deny rule of this route matches\n",
        ),
        (&["GET", "https://evil.invalid/wiki/x"], 1, "deny rule host: "),
        (
            &["GET", "https://en.wikipedia.invalid:8443/wiki/Rust"],
            1,
            "deny rule port: port 8443 is not allowed (allowed: 443)\n",
        ),
        (&["GET", "https://en.wikipedia.invalid/w/index.php"], 1, "deny rule path: "),
        (&["GET", "https://0x7f000001/wiki/x"], 1, "deny rule ip_literal: "),
        (&["GET", "https://a@en.wikipedia.invalid/wiki/x"], 1, "deny rule userinfo: "),
    ];
    for (args, code, start) in cases {
        let mut all = vec!["egress", "check", "wiki"];
        all.extend_from_slice(args);
        let (got, out, err) = cli(&all, &path);
        assert_eq!(got, *code, "{args:?}: {out}{err}");
        assert!(out.starts_with(start), "{args:?}: {out}");
    }
    // A fixed upstream takes a path under its base; the credential is never printed.
    let (code, out, _) = cli(&["egress", "check", "api", "post", "/items?q=1"], &path);
    assert_eq!(
        (code, out.as_str()),
        (0, "allow POST api.invalid:443/v2/items?q=1 (route api; the address is checked when sent)\n")
    );
    // Audit mode: allowed, with the rule that would deny it.
    let (code, out, _) = cli(
        &["egress", "check", "lab", "DELETE", "https://lab.invalid/x"],
        &path,
    );
    assert_eq!(code, 0);
    assert!(
        out.starts_with("allow DELETE lab.invalid:443/x (route lab in AUDIT mode; enforced, rule method would deny: "),
        "{out}"
    );
    // An unknown route is an error naming the routes.
    let (code, _, err) = cli(
        &["egress", "check", "nope", "GET", "https://x.invalid/"],
        &path,
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("no egress route \"nope\" (the routes: wiki, api, lab)"),
        "{err}"
    );
}

#[test]
fn explain_lists_the_routes_and_doctor_flags_audit_mode_and_private_ranges() {
    let (_d, path) = config();
    let (code, out, err) = cli(&["explain"], &path);
    assert_eq!(code, 0, "{out}{err}");
    let routes: Vec<&str> = out.lines().filter(|l| l.starts_with("egress ")).collect();
    assert_eq!(
        routes,
        [
            "egress        wiki: hosts *.wikipedia.invalid on port 443 (the guest gives a URL); GET, HEAD; paths /wiki/**; 1 deny rules; enforced; no credential; redirects not followed; per request 64 KiB out, 1024 KiB in, 20000 ms; per turn 32 requests, 8192 KiB in, 256 KiB out",
            "egress        api: upstream https://api.invalid/v2 (the guest gives a path); GET, POST; any path; enforced; credential from $RTG_API_TOKEN in header x-api-key (the guest never sees it); redirects not followed; per request 64 KiB out, 1024 KiB in, 20000 ms; per turn 32 requests, 8192 KiB in, 256 KiB out",
            "egress        lab: hosts lab.invalid on port 443, 8443 (the guest gives a URL); GET, HEAD; any path; AUDIT mode; no credential; redirects not followed; per request 64 KiB out, 1024 KiB in, 20000 ms; per turn 32 requests, 8192 KiB in, 256 KiB out",
        ],
        "{out}"
    );
    assert!(
        out.contains("WARNING       egress route lab is in AUDIT mode: its rules refuse nothing"),
        "{out}"
    );
    assert!(
        out.contains(
            "WARNING       egress route lab may reach private or loopback addresses: 10.9.0.0/16"
        ),
        "{out}"
    );
    assert!(!out.contains("tok-never-shown-31"));

    let (code, out, _) = cli(&["doctor"], &path);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("ok   egress          route wiki enforced"),
        "{out}"
    );
    assert!(
        out.contains("ok   egress          route api enforced"),
        "{out}"
    );
    assert!(
        out.contains("FAIL egress          egress route lab is in AUDIT mode"),
        "{out}"
    );
    assert!(out.contains("WARN egress          egress route lab may reach private or loopback addresses: 10.9.0.0/16"), "{out}");
    assert!(!out.contains("tok-never-shown-31"));
}
