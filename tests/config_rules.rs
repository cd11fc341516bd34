//! Every configuration rule, each rejected with its exact message, before any side effect
//! that matters (no container, no broker). Runs as the non-root service user.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::{ApiKey, Config, McpTransport};

fn err(config: &Config) -> String {
    config.resolve().unwrap_err().to_string()
}

#[test]
fn each_rule_has_its_message() {
    let env = Env::new();
    let base = env.config();

    let mut c = base.clone();
    c.model = "  ".into();
    assert_eq!(err(&c), "model is required");

    let mut c = base.clone();
    c.time_zone = Some("Mars/Olympus".into());
    assert_eq!(err(&c), "invalid time zone: \"Mars/Olympus\"");

    for bad in [Duration::from_millis(999), Duration::from_secs(601)] {
        let mut c = base.clone();
        c.turn_timeout = Some(bad);
        assert_eq!(
            err(&c),
            format!("turn_timeout must be 1 s to 600 s, got {bad:?}")
        );
    }

    let mut c = base.clone();
    c.image = "Not An Image".into();
    assert_eq!(err(&c), "invalid image reference: \"Not An Image\"");

    let mut c = base.clone();
    c.limits.memory_mb = 8;
    assert_eq!(err(&c), "limits.memory_mb must be 16 to 1048576, got 8");
    let mut c = base.clone();
    c.limits.cpus = -1.0;
    assert_eq!(
        err(&c),
        "limits.cpus must be above 0 and at most 1024, got -1"
    );
    let mut c = base.clone();
    c.limits.pids = 4;
    assert_eq!(err(&c), "limits.pids must be 8 to 65536, got 4");

    let me = nix::unistd::getuid().as_raw();
    let mut c = base.clone();
    c.uid = Some(0);
    assert_eq!(
        err(&c),
        "run the host as a non-root user; worker uid/gid must match it"
    );
    let mut c = base.clone();
    c.uid = Some(me + 1);
    assert_eq!(
        err(&c),
        "run the host as a non-root user; worker uid/gid must match it"
    );
    let mut c = base.clone();
    c.gid = Some(0);
    assert_eq!(
        err(&c),
        "run the host as a non-root user; worker uid/gid must match it"
    );

    let mut c = base.clone();
    c.model_url = "http://127.0.0.1:9/v1".into();
    c.allow_http = false;
    assert_eq!(
        err(&c),
        "model_url must use https (set allow_http only for offline tests): http://127.0.0.1:9/v1"
    );

    // allow_http admits plain HTTP to loopback only, for the model and for MCP servers.
    for url in [
        "http://api.example.com/v1",
        "http://10.1.2.3:8080/v1",
        "http://[::2]/v1",
    ] {
        let mut c = base.clone();
        c.model_url = url.into();
        c.allow_http = true;
        assert_eq!(
            err(&c),
            format!("model_url uses http to a host that is not loopback (allow_http covers only 127.0.0.0/8, ::1 and localhost): {url}")
        );
    }
    let mut c = base.clone();
    c.allow_http = true;
    let transport = roundtable_sandbox::internals::config::McpTransport::Http {
        url: "http://mcp.example.com/mcp".into(),
        headers: Default::default(),
    };
    c.mcp = vec![roundtable_sandbox::McpServer::new(
        "remote",
        transport,
        &["t"],
    )];
    assert_eq!(
        err(&c),
        "MCP server remote: url uses http to a host that is not loopback (allow_http covers only 127.0.0.0/8, ::1 and localhost): http://mcp.example.com/mcp"
    );

    // The per-turn compaction cap (checked with the other broker limits, before any side
    // effect).
    let mut c = base.clone();
    c.broker_limits.max_compactions = 0;
    assert_eq!(
        err(&c),
        "invalid broker limits: max_compactions must be 1 to 1000"
    );

    // The model request allow-list and token cap.
    let mut c = base.clone();
    c.model_request.max_tokens = 0;
    assert_eq!(
        err(&c),
        "invalid model_request: max_tokens must be 1 to 10000000, got 0"
    );
    for (field, msg) in [
        (
            "model",
            "model cannot be an extra field: the configured model is always sent",
        ),
        ("messages", "field messages is already allowed"),
        (
            "a b",
            "invalid field name \"a b\" in extra_fields: use 1 to 64 of A-Z, a-z, 0-9, _, - and .",
        ),
    ] {
        let mut c = base.clone();
        c.model_request.extra_fields = vec![field.into()];
        assert_eq!(err(&c), format!("invalid model_request: {msg}"));
    }

    let mut c = base.clone();
    c.run_root = PathBuf::from("relative/run");
    assert_eq!(
        err(&c),
        "sandbox roots must be absolute dedicated directories: relative/run"
    );
    let mut c = base.clone();
    c.workspace_root = PathBuf::from("/");
    assert_eq!(
        err(&c),
        "sandbox roots must be absolute dedicated directories: /"
    );

    // A host tool may not take a built-in tool's name: the guest would offer the model
    // two tools of one name, and one of them would never run.
    for builtin in roundtable_sandbox::protocol::builtin_tools::ALL {
        let mut c = base.clone();
        c.tools.push(Arc::new(NamedTool(builtin)));
        assert_eq!(
            err(&c),
            format!(
                "host tool \"{builtin}\" has the name of a built-in guest \
                 tool (built-ins: read, write, edit, list, sh, fetch)"
            )
        );
    }
    // Nothing was created by the failed pure checks above.
    assert!(!env.run_root.exists() && !env.workspace_root.exists());
    let mut c = base.clone();
    c.time_zone = Some("Europe/Berlin".into());
    // A name that only starts like a built-in's is fine.
    c.tools.push(Arc::new(NamedTool("sh2")));
    assert_eq!(c.resolve().unwrap().time_zone, "Europe/Berlin");
}

#[test]
fn roots_must_be_private_separate_and_short() {
    let env = Env::new();
    let base = env.config();

    // An existing root with group/other bits is refused, not silently fixed.
    let open = env.dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = base.clone();
    c.run_root = open.clone();
    assert_eq!(
        err(&c),
        format!(
            "sandbox roots must be private directories owned by the service user: {}",
            open.display()
        )
    );

    // A file is not a directory.
    let file = env.dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let mut c = base.clone();
    c.workspace_root = file.clone();
    assert!(err(&c).starts_with(&format!("create sandbox root {}", file.display())));

    // Equal or nested roots.
    let mut c = base.clone();
    c.workspace_root = c.run_root.clone();
    let run = env.dir.path().join("run");
    assert_eq!(
        err(&c),
        format!(
            "sandbox roots must be separate: {} and {}",
            run.display(),
            run.display()
        )
    );
    let mut c = base.clone();
    c.workspace_root = env.run_root.join("ws");
    assert!(err(&c).starts_with("sandbox roots must be separate: "));

    // A symlinked root is canonicalised before the check.
    let link = env.dir.path().join("link");
    std::os::unix::fs::symlink(&env.run_root, &link).unwrap();
    let mut c = base.clone();
    c.workspace_root = link;
    assert!(err(&c).starts_with("sandbox roots must be separate: "));

    // The socket path must fit.
    let long = env.dir.path().join("r".repeat(80));
    let mut c = base.clone();
    c.run_root = long.clone();
    assert_eq!(
        err(&c),
        format!(
            "broker socket path too long: {} leaves no room for /turn-XXXXXX/broker.sock in 100 bytes",
            long.display()
        )
    );

    // Created roots are 0700 and canonical.
    let ok = base.resolve().unwrap();
    for root in [&ok.run_root, &ok.workspace_root] {
        assert_eq!(
            std::fs::metadata(root).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert_eq!(root, &std::fs::canonicalize(root).unwrap());
    }
}

#[test]
fn toml_file_loads_and_rejects_unknown_keys() {
    let env = Env::new();
    let path = env.dir.path().join("sandbox.toml");
    std::fs::write(
        &path,
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\nworkspace_root = \"{}\"\n\
             model = \"m\"\nmodel_url = \"https://models.invalid/v1\"\ntime_zone = \"Asia/Tokyo\"\n\
             [limits]\nmemory_mb = 256\npids = 64\n",
            env.run_root.display(),
            env.workspace_root.display()
        ),
    )
    .unwrap();
    let config = Config::from_toml_file(&path).unwrap();
    assert_eq!(config.limits.memory_mb, 256);
    assert_eq!(config.model_request.max_tokens, 16_384, "the default cap");
    assert!(config.model_request.extra_fields.is_empty());
    assert!(matches!(config.api_key, ApiKey::None));
    let resolved = config.resolve().unwrap();
    assert_eq!(resolved.time_zone, "Asia/Tokyo");

    // The model request allow-list extended, the token cap and the per-turn caps set.
    let text = std::fs::read_to_string(&path).unwrap()
        + "[broker]\nmax_calls_in_flight = 2\nmax_connections = 8\nmax_compactions = 2\n\
           [model_request]\nmax_tokens = 2048\nextra_fields = [\"reasoning_effort\"]\n";
    std::fs::write(&path, text).unwrap();
    let config = Config::from_toml_file(&path).unwrap();
    assert_eq!(config.model_request.max_tokens, 2048);
    assert_eq!(config.model_request.extra_fields, ["reasoning_effort"]);
    assert_eq!(config.broker_limits.max_calls_in_flight, 2);
    assert_eq!(config.broker_limits.max_connections, 8);
    assert_eq!(config.broker_limits.max_compactions, 2);
    config.resolve().unwrap();

    std::fs::write(&path, "image = \"x\"\nimgae = \"y\"\n").unwrap();
    let e = Config::from_toml_file(&path).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "config file {}: imgae: unknown field `imgae`",
            path.display()
        )),
        "{e}"
    );
    assert!(e.ends_with("(at line 2, column 1)"), "{e}");
}

/// `[[mcp]]` scopes: the defaults per transport, and each misuse refused with its message
/// (from TOML, before any server is started).
#[test]
fn mcp_scope_rules() {
    use roundtable_sandbox::McpScope;
    let env = Env::new();
    let head = format!(
        "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\nworkspace_root = \"{}\"\n\
         model = \"m\"\nmodel_url = \"https://models.invalid/v1\"\n",
        env.run_root.display(),
        env.workspace_root.display()
    );
    let parse = |mcp: &str| {
        Config::from_toml_str(&format!(
            "{head}[[mcp]]\nname = \"db\"\ntools = [\"q\"]\n{mcp}"
        ))
    };
    let rule = |mcp: &str| err(&parse(mcp).unwrap());

    let stdio =
        "transport = \"stdio\"\ncommand = \"srv\"\nimage = \"roundtable-sandbox-mcp:latest\"\n";
    let http = "transport = \"http\"\nurl = \"https://mcp.invalid/mcp\"\n";
    assert_eq!(parse(stdio).unwrap().mcp[0].scope(), McpScope::Channel);
    assert_eq!(parse(http).unwrap().mcp[0].scope(), McpScope::Shared);
    let c = parse(&format!(
        "{stdio}args = [\"--db-path\", \"/data/{{channel}}.db\"]\nenv = {{ DB = \"/data/{{channel}}\" }}\nmax_sessions = 4\n"
    ))
    .unwrap();
    assert_eq!(c.mcp[0].session_cap(), 4);
    c.resolve().unwrap();
    let c = parse(&format!("{stdio}scope = \"shared\"\n")).unwrap();
    assert_eq!(
        (c.mcp[0].scope(), c.mcp[0].session_cap()),
        (McpScope::Shared, 1)
    );
    c.resolve().unwrap();
    parse("transport = \"http\"\nurl = \"https://mcp.invalid/c/{channel}/mcp\"\nscope = \"channel\"\n")
        .unwrap()
        .resolve()
        .unwrap();

    // Unknown keys are still refused (the transport takes every key the server does not).
    let e = parse(&format!("{stdio}scoop = \"channel\"\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("config file <string>: mcp[0]: unknown field `scoop`"),
        "{e}"
    );
    let e = parse(&format!("{http}args = [\"x\"]\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("config file <string>: mcp[0]: unknown field `args`"),
        "{e}"
    );
    let e = parse(&format!("{stdio}scope = \"global\"\n"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "config file <string>: mcp[0].scope: unknown variant `global`, expected `channel` or `shared` (at line 12, column 9)"
    );
    let prefix = "MCP server db: ";
    assert_eq!(
        rule(&format!(
            "{stdio}scope = \"shared\"\nargs = [\"/data/{{channel}}.db\"]\n"
        )),
        format!(
            "{prefix}{{channel}} is used but scope is \"shared\" (one session for every channel)"
        )
    );
    assert_eq!(
        rule(&format!(
            "{stdio}scope = \"shared\"\nenv = {{ DB = \"{{channel}}\" }}\n"
        )),
        format!(
            "{prefix}{{channel}} is used but scope is \"shared\" (one session for every channel)"
        )
    );
    assert_eq!(
        rule("transport = \"http\"\nurl = \"https://mcp.invalid/{channel}\"\n"),
        format!(
            "{prefix}{{channel}} is used but scope is \"shared\" (one session for every channel)"
        )
    );
    assert_eq!(
        rule("transport = \"stdio\"\ncommand = \"/srv/{channel}\"\n"),
        format!("{prefix}{{channel}} can be used only in args and env values")
    );
    assert_eq!(
        rule("transport = \"stdio\"\ncommand = \"srv\"\nenv = { \"X_{channel}\" = \"1\" }\n"),
        format!("{prefix}{{channel}} can be used only in args and env values")
    );
    assert_eq!(
        rule("transport = \"http\"\nurl = \"https://mcp.invalid/mcp\"\nscope = \"channel\"\nheaders = { \"x-{channel}\" = \"1\" }\n"),
        format!("{prefix}{{channel}} can be used only in the url and header values")
    );
    assert_eq!(
        rule(&format!("{stdio}scope = \"shared\"\nmax_sessions = 4\n")),
        format!("{prefix}max_sessions applies only to scope = \"channel\"")
    );
    assert_eq!(
        rule(&format!("{http}max_sessions = 4\n")),
        format!("{prefix}max_sessions applies only to scope = \"channel\"")
    );
    for n in [0, 1025] {
        assert_eq!(
            rule(&format!("{stdio}max_sessions = {n}\n")),
            format!("{prefix}max_sessions must be 1 to 1024, got {n}")
        );
    }

    // Confinement: a container by default, which needs an image; `host` only when asked.
    let c = parse(&format!(
        "{stdio}network = true\nlimits = {{ memory_mb = 128, data_mb = 32 }}\n"
    ))
    .unwrap();
    assert!(c.mcp[0].in_container() && c.mcp[0].network);
    assert_eq!(
        (
            c.mcp[0].limits.memory_mb,
            c.mcp[0].limits.data_mb,
            c.mcp[0].limits.pids
        ),
        (128, 32, 64)
    );
    c.resolve().unwrap();
    assert_eq!(
        rule("transport = \"stdio\"\ncommand = \"srv\"\n"),
        format!("{prefix}a stdio server runs in its own container: set image (scripts/build-mcp-image.sh builds roundtable-sandbox-mcp:latest), or confine = \"host\" to run it unconfined on the host")
    );
    let c = parse("transport = \"stdio\"\ncommand = \"srv\"\nconfine = \"host\"\n").unwrap();
    assert!(c.mcp[0].unconfined());
    c.resolve().unwrap();
    assert_eq!(
        rule(&format!("{http}image = \"x:1\"\n")),
        format!("{prefix}confine, image, network and limits apply only to stdio servers")
    );
    assert_eq!(
        rule(&format!("{stdio}limits = {{ cpus = 0.0 }}\n")),
        format!("{prefix}limits out of range (memory_mb 16 to 65536, cpus above 0 to 64, pids 8 to 4096, tmpfs_mb 1 to 4096, data_mb 1 to 1048576, data_files 16 to 10000000): McpLimits {{ memory_mb: 256, cpus: 0.0, pids: 64, tmpfs_mb: 16, data_mb: 64, data_files: 10000 }}")
    );
    let e = parse(&format!("{stdio}limits = {{ memory = 1 }}\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `memory`"), "{e}");
    let e = parse(&format!("{stdio}confine = \"none\"\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown variant `none`, expected `container` or `host`"),
        "{e}"
    );
}

#[test]
fn the_boundaries_of_each_rule() {
    let env = Env::new();
    let base = env.config();

    // The turn timeout's bounds are accepted (in code and in a file).
    for ok in [Duration::from_secs(1), Duration::from_secs(600)] {
        let mut c = base.clone();
        c.turn_timeout = Some(ok);
        assert_eq!(c.resolve().unwrap().turn_timeout, ok);
    }
    for (secs, ok) in [("1", 1), ("600", 600), ("1.0", 1)] {
        let text = format!(
            "image = \"x\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\n\
             model_url = \"https://a\"\nturn_timeout_secs = {secs}\n"
        );
        let c = Config::from_toml_str(&text).unwrap();
        assert_eq!(c.turn_timeout, Some(Duration::from_secs(ok)));
    }

    // The process's own uid and gid are accepted; a gid that is not the process's is not.
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    let mut c = base.clone();
    (c.uid, c.gid) = (Some(uid), Some(gid));
    let resolved = c.resolve().unwrap();
    assert_eq!((resolved.uid, resolved.gid), (uid, gid));
    let mut c = base.clone();
    c.gid = Some(gid + 1);
    assert_eq!(
        err(&c),
        "run the host as a non-root user; worker uid/gid must match it"
    );

    // The run root inside the workspace root (the other direction is tested above).
    let mut c = base.clone();
    c.run_root = env.workspace_root.join("run");
    let ws = std::fs::canonicalize(&env.workspace_root).unwrap();
    assert_eq!(
        err(&c),
        format!(
            "sandbox roots must be separate: {} and {}",
            ws.join("run").display(),
            ws.display()
        )
    );

    // A private root owned by another user (only the owner is wrong).
    let theirs = ["/root", "/var/cache/ldconfig"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| {
                use std::os::unix::fs::MetadataExt;
                m.is_dir() && m.uid() != uid && m.mode() & 0o077 == 0
            })
        })
        .expect("a private directory of another user (/root, 0700) to test with");
    for field in ["run_root", "workspace_root"] {
        let mut c = base.clone();
        match field {
            "run_root" => c.run_root = theirs.clone(),
            _ => c.workspace_root = theirs.clone(),
        }
        assert_eq!(
            err(&c),
            format!(
                "sandbox roots must be private directories owned by the service user: {}",
                theirs.display()
            ),
            "{field}"
        );
    }
}

/// Time zones as `Intl.DateTimeFormat` takes them: `(given, resolvedOptions().timeZone)`,
/// `None` where it throws a RangeError. Answers of node v20.20.2 (ICU 78.2, tz 2025c).
const ZONES: &[(&str, Option<&str>)] = &[
    ("UTC", Some("UTC")),
    ("utc", Some("UTC")),
    ("Etc/UTC", Some("UTC")),
    ("EtC/uTc", Some("UTC")),
    ("GMT", Some("UTC")),
    ("Etc/GMT", Some("UTC")),
    ("Etc/GMT+0", Some("UTC")),
    ("Zulu", Some("UTC")),
    ("Europe/Berlin", Some("Europe/Berlin")),
    ("europe/berlin", Some("Europe/Berlin")),
    ("EUROPE/BERLIN", Some("Europe/Berlin")),
    ("Asia/Tokyo", Some("Asia/Tokyo")),
    ("Japan", Some("Asia/Tokyo")),
    ("US/Eastern", Some("America/New_York")),
    ("us/eastern", Some("America/New_York")),
    ("EST5EDT", Some("America/New_York")),
    ("Asia/Calcutta", Some("Asia/Calcutta")),
    ("asia/calcutta", Some("Asia/Calcutta")),
    ("Asia/Kolkata", Some("Asia/Calcutta")),
    ("IST", Some("Asia/Calcutta")),
    ("Europe/Kyiv", Some("Europe/Kiev")),
    ("America/Nuuk", Some("America/Godthab")),
    ("Pacific/Kanton", Some("Pacific/Enderbury")),
    ("America/Indiana/Indianapolis", Some("America/Indianapolis")),
    (
        "america/argentina/buenos_aires",
        Some("America/Buenos_Aires"),
    ),
    ("Europe/Belfast", Some("Europe/London")),
    ("EST", Some("America/Panama")),
    ("CET", Some("Europe/Brussels")),
    ("Etc/GMT+5", Some("Etc/GMT+5")),
    ("etc/gmt-14", Some("Etc/GMT-14")),
    ("Mars/Olympus", None),
    ("", None),
    (" UTC", None),
    ("Europe/Berlin ", None),
    ("Europe/Berlin\n", None),
    ("UTC\0", None),
    ("Europe//Berlin", None),
    ("+01:00", None),
    ("Z", None),
    ("Etc/GMT-15", None),
    ("Etc/GMT+13", None),
    ("etc/gmt+00", None),
    ("Factory", None),
    ("localtime", None),
    ("/etc/localtime", None),
    ("../../etc/passwd", None),
    ("Europe/\u{212a}iev", None),
    ("\u{130}ST", None),
];

#[test]
fn time_zones_are_read_as_intl_reads_them() {
    let env = Env::new();
    let base = env.config();
    for (given, expected) in ZONES {
        let mut c = base.clone();
        c.time_zone = Some((*given).to_owned());
        match expected {
            Some(canonical) => {
                assert_eq!(
                    roundtable_sandbox::internals::config::canonical_time_zone(given),
                    Some(*canonical),
                    "{given:?}"
                );
                assert_eq!(&c.resolve().unwrap().time_zone, canonical, "{given:?}");
            }
            None => {
                assert_eq!(
                    roundtable_sandbox::internals::config::canonical_time_zone(given),
                    None,
                    "{given:?}"
                );
                assert_eq!(err(&c), format!("invalid time zone: {given:?}"));
            }
        }
    }
    // Intl takes ICU's SystemV ids, which no tz database has: the guest could not show
    // them, so they are refused (a deliberate difference).
    let mut c = base.clone();
    c.time_zone = Some("systemv/ast4".into());
    assert_eq!(
        roundtable_sandbox::internals::config::canonical_time_zone("systemv/ast4"),
        Some("SystemV/AST4")
    );
    assert_eq!(
        err(&c),
        "time zone \"systemv/ast4\" resolves to SystemV/AST4, which the guest's tz database \
         does not have; use an IANA zone name"
    );
    // No time zone: UTC.
    assert_eq!(base.resolve().unwrap().time_zone, "UTC");
}

/// The table above and every name of the tz database (as given, lowercase and uppercase),
/// checked against node's own answers when node is installed.
#[test]
fn time_zones_match_node_where_node_is_installed() {
    let mut names: Vec<String> = ZONES.iter().map(|(n, _)| (*n).to_owned()).collect();
    for tz in chrono_tz::TZ_VARIANTS {
        let name = tz.name();
        names.extend([name.to_owned(), name.to_lowercase(), name.to_uppercase()]);
    }
    for legacy in [
        "ACT",
        "AET",
        "BST",
        "CST",
        "PST",
        "SystemV/AST4",
        "US/Pacific-New",
    ] {
        names.push(legacy.to_owned());
    }
    let script = "let s='';process.stdin.on('data',d=>s+=d).on('end',()=>{\
        console.log(JSON.stringify(JSON.parse(s).map(n=>{try{return new Intl.DateTimeFormat('en-US',{timeZone:n}).resolvedOptions().timeZone}catch(e){return null}})))})";
    let child = std::process::Command::new("node")
        .args(["-e", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("node is not installed: compared with the recorded answers only");
        return;
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&names).unwrap().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<Option<String>> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answers.len(), names.len());
    let mut differences = Vec::new();
    for (name, node) in names.iter().zip(&answers) {
        let ours = roundtable_sandbox::internals::config::canonical_time_zone(name);
        if ours != node.as_deref() {
            differences.push(format!("{name:?}: node {node:?}, ours {ours:?}"));
        }
    }
    assert!(
        differences.is_empty(),
        "{} names differ from node (regenerate with scripts/gen-time-zones.sh if node was \
         upgraded; ours come from {}):\n{}",
        differences.len(),
        roundtable_sandbox::internals::config::TIME_ZONE_SOURCE,
        differences.join("\n")
    );
    println!("{} names agree with node", names.len());
}

#[test]
fn runtime_names_and_the_gvisor_peer_check_rule() {
    let env = Env::new();
    let mut base = env.config();
    base.runtime = None;
    base.peer_uid_check = true;
    for bad in ["", "run c", "runsc;rm", "../runc", &"r".repeat(65)] {
        let mut c = base.clone();
        c.runtime = Some(bad.into());
        assert_eq!(
            err(&c),
            format!("invalid runtime name {bad:?}: use 1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-'")
        );
    }
    // gVisor hides the peer's uid: the operator must turn the check off explicitly.
    let mut c = base.clone();
    c.runtime = Some("runsc".into());
    assert_eq!(
        err(&c),
        "runtime runsc reports every broker peer as uid 0: set peer_uid_check = false \
         (the per-turn 0700 run dir is then the only door to the socket)"
    );
    // Refused before any side effect: the roots were not created.
    assert!(!env.run_root.exists() && !env.workspace_root.exists());
    c.peer_uid_check = false;
    let resolved = c.resolve().unwrap();
    assert_eq!(resolved.runtime.as_deref(), Some("runsc"));
    // Other runtimes keep the check (and accept it).
    let mut c = base.clone();
    c.runtime = Some("runc".into());
    assert!(c.peer_uid_check);
    assert_eq!(c.resolve().unwrap().runtime.as_deref(), Some("runc"));

    // In the file: `runtime` next to `peer_uid_check`; absent means the engine's default.
    let file = |extra: &str| {
        format!(
            "image = \"img\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\n\
             model_url = \"https://a\"\n{extra}"
        )
    };
    let c = Config::from_toml_str(&file("runtime = \"runsc\"\npeer_uid_check = false\n")).unwrap();
    assert_eq!(c.runtime.as_deref(), Some("runsc"));
    assert!(!c.peer_uid_check);
    assert_eq!(Config::from_toml_str(&file("")).unwrap().runtime, None);
}

#[test]
fn compaction_rules_have_their_messages() {
    use roundtable_sandbox::CompactionModel;
    let env = Env::new();
    let summarizer = |url: &str, allow_http: bool| CompactionModel {
        url: url.into(),
        model: "sum".into(),
        api_key: ApiKey::from_static("sk-sum"),
        key_source: "test".into(),
        timeout: CompactionModel::DEFAULT_TIMEOUT,
        allow_http,
    };
    let with = |s: CompactionModel| {
        let mut c = env.config();
        c.compaction = Some(s);
        c
    };
    assert_eq!(
        err(&with(summarizer("http://127.0.0.1:9/v1", false))),
        "compaction.url must use https (allow_http permits http to a loopback address only): http://127.0.0.1:9/v1"
    );
    for not_loopback in [
        "http://10.1.2.3/v1",
        "http://localhost.evil.example:9/v1",
        "http://sum.example.com/v1",
    ] {
        assert_eq!(
            err(&with(summarizer(not_loopback, true))),
            format!("compaction.url must use https (allow_http permits http to a loopback address only): {not_loopback}")
        );
    }
    for invalid in [
        "ftp://sum.example.com/v1",
        "sum.example.com",
        "https://u:p@sum.example.com/v1",
    ] {
        assert_eq!(
            err(&with(summarizer(invalid, true))),
            format!("invalid compaction.url: {invalid}")
        );
    }
    let mut s = summarizer("https://sum.example.com/v1", false);
    s.model = " ".into();
    assert_eq!(err(&with(s)), "compaction.model is required");
    for bad in [Duration::from_millis(999), Duration::from_secs(601)] {
        let mut s = summarizer("https://sum.example.com/v1", false);
        s.timeout = bad;
        assert_eq!(
            err(&with(s)),
            format!("compaction.timeout must be 1 s to 600 s, got {bad:?}")
        );
    }
    // Nothing was created by the failed checks; the good ones resolve.
    assert!(!env.run_root.exists() && !env.workspace_root.exists());
    with(summarizer("https://sum.example.com/v1", false))
        .resolve()
        .unwrap();
    with(summarizer("http://127.0.0.1:9/v1", true))
        .resolve()
        .unwrap();
    with(summarizer("http://[::1]:9/v1", true))
        .resolve()
        .unwrap();
}

#[test]
fn the_compaction_section_reads_its_key_from_the_environment_or_a_file_only() {
    let env = Env::new();
    let path = env.dir.path().join("sandbox.toml");
    let base = format!(
        "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\nworkspace_root = \"{}\"\n\
         model = \"m\"\nmodel_url = \"https://models.invalid/v1\"\n",
        env.run_root.display(),
        env.workspace_root.display()
    );
    let load = |section: &str| {
        std::fs::write(&path, format!("{base}[compaction]\n{section}")).unwrap();
        Config::from_toml_file(&path)
    };
    let url = "url = \"https://sum.invalid/v1\"\nmodel = \"sum\"\n";

    // The key itself is never a config key.
    let e = load(&format!("{url}api_key = \"sk-in-the-file\"\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!(
            "config file {}: compaction.api_key: unknown field `api_key`",
            path.display()
        )),
        "{e}"
    );
    assert_eq!(
        load(url).unwrap_err().to_string(),
        "compaction: set api_key_env or api_key_file"
    );
    assert_eq!(
        load(&format!(
            "{url}api_key_env = \"A\"\napi_key_file = \"/nonexistent\"\n"
        ))
        .unwrap_err()
        .to_string(),
        "compaction: set api_key_env or api_key_file, not both"
    );

    // A key from a file, with the deadline and loopback http.
    let key_file = env.dir.path().join("sum.key");
    std::fs::write(&key_file, "sk-sum-from-file\n").unwrap();
    let c = load(&format!(
        "url = \"http://127.0.0.1:9/v1\"\nmodel = \"sum\"\napi_key_file = \"{}\"\ntimeout_secs = 30\nallow_http = true\n",
        key_file.display()
    ))
    .unwrap();
    let s = c.compaction.clone().unwrap();
    assert!(matches!(s.api_key, ApiKey::Static(_)));
    assert_eq!(s.key_source, format!("file {}", key_file.display()));
    assert_eq!(s.timeout, Duration::from_secs(30));
    assert!(!format!("{c:?}").contains("sk-sum-from-file"));
    c.resolve().unwrap();

    // Read as the model's key is (issue 44): a variable that is not set, or an empty key
    // file, is a startup error, not a keyless summarizer.
    assert_eq!(
        load(&format!(
            "{url}api_key_env = \"RTS_TEST_SURELY_UNSET_SUMMARIZER_VAR\"\n"
        ))
        .unwrap_err()
        .to_string(),
        "read api key: environment variable RTS_TEST_SURELY_UNSET_SUMMARIZER_VAR is not set"
    );
    std::fs::write(&key_file, " \n").unwrap();
    assert_eq!(
        load(&format!("{url}api_key_file = \"{}\"\n", key_file.display()))
            .unwrap_err()
            .to_string(),
        format!("read api key file {}: it is empty", key_file.display())
    );

    std::env::set_var("RTS_TEST_SUMMARIZER_KEY_X", "sk-x");
    let e = load(&format!(
        "{url}api_key_env = \"RTS_TEST_SUMMARIZER_KEY_X\"\ntimeout_secs = 0\n"
    ))
    .unwrap()
    .resolve()
    .unwrap_err()
    .to_string();
    assert_eq!(e, "compaction.timeout must be 1 s to 600 s, got 0ns");
    let e = load(&format!("{url}api_key_env = \"X\"\nallow_http = \"yes\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("compaction.allow_http: invalid type"), "{e}");
}

/// Issue 21: a root is checked once, by path, but it is used for the runtime's life. Under
/// a directory another user can write (or owns), that user can swap the root after startup
/// (and read what the guests write): every directory above each root must be owned by root
/// or the service user and writable by no one else, unless it is sticky (`/tmp`).
#[test]
fn a_root_under_a_directory_another_user_can_write_is_refused() {
    let env = Env::new();
    let base = env.config();
    let shared = env.dir.path().join("shared");
    let nested = shared.join("deeper");
    std::fs::create_dir_all(&nested).unwrap();
    for (mode, shown) in [(0o777, "777"), (0o775, "775"), (0o757, "757")] {
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(mode)).unwrap();
        for field in ["run_root", "workspace_root"] {
            let mut c = base.clone();
            let root = nested.join(field);
            match field {
                "run_root" => c.run_root = root.clone(),
                _ => c.workspace_root = root.clone(),
            }
            assert_eq!(
                err(&c),
                format!(
                    "sandbox root {} lies under {}, which group or others can write (mode {shown}, not sticky): \
                     every directory above a root must be owned by root or the service user and writable by no one else unless sticky",
                    root.display(),
                    shared.display()
                ),
                "{field}"
            );
            assert!(!root.exists(), "refused before it is created");
        }
    }
    // Sticky and owned by the service user (as /tmp is sticky and root's): accepted.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let mut c = base.clone();
    c.run_root = nested.join("run");
    assert!(c.resolve().is_ok());
    // A root reached through a symlink is judged by where it leads.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let link = env.dir.path().join("via-link");
    std::os::unix::fs::symlink(&nested, &link).unwrap();
    let mut c = base.clone();
    c.workspace_root = link.join("ws");
    assert!(
        err(&c).contains(&format!(" lies under {}, which group", shared.display())),
        "{}",
        err(&c)
    );

    // A directory above the root owned by another user (who can rename what is in it).
    let uid = nix::unistd::getuid().as_raw();
    let theirs = ["/var/cache/man", "/etc/postgresql", "/var/mail"]
        .into_iter()
        .map(PathBuf::from)
        .find_map(|p| {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(&p).ok()?;
            (m.is_dir() && m.uid() != uid && m.uid() != 0 && m.mode() & 0o001 != 0)
                .then_some((p, m.uid()))
        })
        .expect("a directory of another user that others may enter, to test with");
    let mut c = base.clone();
    c.workspace_root = theirs.0.join("roundtable-ws");
    assert_eq!(
        err(&c),
        format!(
            "sandbox root {} lies under {}, which uid {} owns: every directory above a root must be \
             owned by root or the service user and writable by no one else unless sticky",
            c.workspace_root.display(),
            theirs.0.display(),
            theirs.1
        )
    );
}

/// `[budgets]`: every rule with its message, checked before the roots are made; the
/// section read from TOML with unknown keys refused.
#[test]
fn budget_rules_have_their_messages() {
    use roundtable_sandbox::BudgetSettings;
    let env = Env::new();
    let with = |b: BudgetSettings| {
        let mut c = env.config();
        c.budgets = b;
        c
    };
    let file = env.dir.path().join("budgets.sqlite");
    let set = |f: fn(&mut BudgetSettings)| {
        let mut b = BudgetSettings {
            state_file: Some(file.clone()),
            ..Default::default()
        };
        f(&mut b);
        b
    };
    assert_eq!(
        err(&with(BudgetSettings {
            speaker_tokens_per_day: Some(100),
            ..Default::default()
        })),
        "budgets.state_file is required when a budget is set"
    );
    assert_eq!(
        err(&with(set(|b| b.speaker_tokens_per_day = Some(0)))),
        "budgets.speaker_tokens_per_day must be 1 to 1000000000000, got 0"
    );
    assert_eq!(
        err(&with(set(|b| b.channel_tokens_per_day = Some(0)))),
        "budgets.channel_tokens_per_day must be 1 to 1000000000000, got 0"
    );
    assert_eq!(
        err(&with(set(
            |b| b.bot_tokens_per_day = Some(1_000_000_000_001)
        ))),
        "budgets.bot_tokens_per_day must be 1 to 1000000000000, got 1000000000001"
    );
    assert_eq!(
        err(&with(set(|b| b.speaker_turns_per_minute = Some(0)))),
        "budgets.speaker_turns_per_minute must be 1 to 10000, got 0"
    );
    assert_eq!(
        err(&with(set(|b| b.speaker_egress_bytes_per_day = Some(0)))),
        "budgets.speaker_egress_bytes_per_day must be 1 to 1000000000000, got 0"
    );
    assert_eq!(
        err(&with(set(|b| b.channel_egress_bytes_per_day = Some(0)))),
        "budgets.channel_egress_bytes_per_day must be 1 to 1000000000000, got 0"
    );
    assert_eq!(
        err(&with(set(|b| b.state_file = Some("state.sqlite".into())))),
        "budgets.state_file must be an absolute path, got state.sqlite"
    );
    // A state file in a workspace would be the guest's to edit.
    let inside = env.workspace_root.join("budgets.sqlite");
    let mut b = set(|_| {});
    b.state_file = Some(inside.clone());
    assert_eq!(
        err(&with(b)),
        format!(
            "budgets.state_file must be outside run_root and workspace_root, got {}",
            inside.display()
        )
    );
    // Refused before any side effect: the roots were not made.
    assert!(!env.workspace_root.exists() && !env.run_root.exists());
    // A custom store and a state file: one of the two.
    let mut c = with(set(|_| {}));
    c.budget_store = Some(std::sync::Arc::new(|| unreachable!()));
    assert_eq!(
        err(&c),
        "budgets.state_file and a custom budget store are both set; use one"
    );
    // A state file alone (accounting kept, nothing refused) is fine.
    with(set(|_| {})).resolve().unwrap();

    let toml = |extra: &str| {
        format!(
            "image = \"img\"\nrun_root = \"/r\"\nworkspace_root = \"/w\"\nmodel = \"m\"\n\
             model_url = \"https://a\"\n{extra}"
        )
    };
    let c = Config::from_toml_str(&toml(
        "[budgets]\nstate_file = \"/var/lib/rt/budgets.sqlite\"\nspeaker_tokens_per_day = 50000\n\
         channel_tokens_per_day = 200000\nbot_tokens_per_day = 1000000\nspeaker_turns_per_minute = 6\n",
    ))
    .unwrap();
    assert_eq!(c.budgets.speaker_tokens_per_day, Some(50_000));
    assert_eq!(c.budgets.speaker_turns_per_minute, Some(6));
    assert_eq!(
        c.budgets.state_file.as_deref(),
        Some(std::path::Path::new("/var/lib/rt/budgets.sqlite"))
    );
    let e = Config::from_toml_str(&toml("[budgets]\nspeaker_tokens_per_hour = 5\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("budgets.speaker_tokens_per_hour: unknown field `speaker_tokens_per_hour`"),
        "{e}"
    );
}

/// Issue 22 item 3: `doctor`'s view is the startup validation in its every-violation
/// mode, the same rules: a configuration with three violations gives all three, in the
/// rules' order, and creates nothing; startup stops at the first of them.
#[test]
fn every_violation_is_collected_for_doctor_and_startup_names_the_first() {
    let env = Env::new();
    let mut c = env.config();
    c.run_root = env.dir.path().join("never-made-run");
    c.workspace_root = env.dir.path().join("never-made-ws");
    c.image = "Not An Image".into();
    c.limits.memory_mb = 15;
    c.max_steps = Some(0);
    let found: Vec<String> = roundtable_sandbox::internals::config::violations(&c)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        found,
        [
            "invalid image reference: \"Not An Image\"",
            "limits.memory_mb must be 16 to 1048576, got 15",
            "max_steps must be 1 to 256, got 0",
        ]
    );
    assert!(!c.run_root.exists() && !c.workspace_root.exists());
    assert_eq!(err(&c), "invalid image reference: \"Not An Image\"");
    assert!(!c.run_root.exists() && !c.workspace_root.exists());
    // Every limit out of range, not only the first; a good configuration has none.
    c.limits.pids = 7;
    assert_eq!(
        roundtable_sandbox::internals::config::violations(&c).len(),
        4
    );
    assert!(roundtable_sandbox::internals::config::violations(&env.config()).is_empty());
}

#[test]
fn an_mcp_servers_secrets_are_read_as_the_model_key_is() {
    let env = Env::new();
    let path = env.dir.path().join("sandbox.toml");
    let base = format!(
        "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{}\"\nworkspace_root = \"{}\"\n\
         model = \"m\"\nmodel_url = \"https://models.invalid/v1\"\n",
        env.run_root.display(),
        env.workspace_root.display()
    );
    let load = |server: &str| {
        std::fs::write(
            &path,
            format!("{base}[[mcp]]\nname = \"s\"\ntools = [\"t\"]\n{server}"),
        )
        .unwrap();
        Config::from_toml_file(&path)
    };
    let stdio = "transport = \"stdio\"\ncommand = \"srv\"\nconfine = \"host\"\n";
    // From a variable (removed once read) and from a file, into the server's env.
    std::env::set_var("RTS_TEST_MCP_SECRET", "s3cret-from-env");
    let key_file = env.dir.path().join("mcp.key");
    std::fs::write(&key_file, "s3cret-from-file\n").unwrap();
    let c = load(&format!(
        "{stdio}[mcp.secret_env]\nA = {{ env = \"RTS_TEST_MCP_SECRET\" }}\nB = {{ file = \"{}\" }}\n",
        key_file.display()
    ))
    .unwrap();
    let McpTransport::Stdio { env: vars, .. } = &c.mcp[0].transport else {
        panic!()
    };
    assert_eq!(vars["A"], "s3cret-from-env");
    assert_eq!(vars["B"], "s3cret-from-file");
    assert!(
        std::env::var("RTS_TEST_MCP_SECRET").is_err(),
        "the variable is removed"
    );
    // Failing as the model's key does, naming the server and the variable.
    assert_eq!(
        load(&format!(
            "{stdio}[mcp.secret_env]\nA = {{ env = \"RTS_TEST_MCP_SURELY_UNSET\" }}\n"
        ))
        .unwrap_err()
        .to_string(),
        "read api key: environment variable RTS_TEST_MCP_SURELY_UNSET is not set"
    );
    std::fs::write(&key_file, "\n").unwrap();
    assert_eq!(
        load(&format!(
            "{stdio}[mcp.secret_env]\nA = {{ file = \"{}\" }}\n",
            key_file.display()
        ))
        .unwrap_err()
        .to_string(),
        format!("read api key file {}: it is empty", key_file.display())
    );
    assert_eq!(
        load(&format!("{stdio}[mcp.secret_env]\nA = {{}}\n"))
            .unwrap_err()
            .to_string(),
        "mcp s: secret_env A: set one of env or file"
    );
    assert_eq!(
        load(&format!(
            "{stdio}env = {{ A = \"plain\" }}\n[mcp.secret_env]\nA = {{ file = \"/etc/hostname\" }}\n"
        ))
        .unwrap_err()
        .to_string(),
        "MCP server s: A is in both env and secret_env"
    );
    assert_eq!(
        load("transport = \"http\"\nurl = \"https://mcp.invalid/\"\n[mcp.secret_env]\nA = { file = \"/etc/hostname\" }\n")
            .unwrap_err()
            .to_string(),
        "MCP server s: secret_env applies only to stdio servers"
    );
}
