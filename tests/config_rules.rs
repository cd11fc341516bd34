//! Every configuration rule, each rejected with its exact message, before any side effect
//! that matters (no container, no broker). Runs as the non-root service user.

#[path = "support/sandbox.rs"]
mod sandbox_support;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use roundtable_sandbox::{ApiKey, Config};
use sandbox_support::*;

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
        "invalid broker policy: model_url must use https (set allow_http only for offline tests): http://127.0.0.1:9/v1"
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
            format!("invalid broker policy: model_url uses http to a host that is not loopback (allow_http covers only 127.0.0.0/8, ::1 and localhost): {url}")
        );
    }
    let mut c = base.clone();
    c.allow_http = true;
    c.mcp = vec![roundtable_sandbox::McpServerConfig {
        name: "remote".into(),
        transport: roundtable_sandbox::broker::McpTransport::Http {
            url: "http://mcp.example.com/mcp".into(),
            headers: Default::default(),
        },
        tools: vec!["t".into()],
        scope: None,
        max_sessions: None,
    }];
    assert_eq!(
        err(&c),
        "invalid broker policy: MCP server remote: url uses http to a host that is not loopback (allow_http covers only 127.0.0.0/8, ::1 and localhost): http://mcp.example.com/mcp"
    );

    // The model request allow-list and token cap.
    let mut c = base.clone();
    c.model_request.max_tokens = 0;
    assert_eq!(
        err(&c),
        "invalid broker policy: invalid model_request: max_tokens must be 1 to 10000000, got 0"
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
        assert_eq!(
            err(&c),
            format!("invalid broker policy: invalid model_request: {msg}")
        );
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
                "invalid broker policy: host tool \"{builtin}\" has the name of a built-in guest \
                 tool (built-ins: read, write, edit, list, sh)"
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
        + "[broker]\nmax_calls_in_flight = 2\nmax_connections = 8\n\
           [model_request]\nmax_tokens = 2048\nextra_fields = [\"reasoning_effort\"]\n";
    std::fs::write(&path, text).unwrap();
    let config = Config::from_toml_file(&path).unwrap();
    assert_eq!(config.model_request.max_tokens, 2048);
    assert_eq!(config.model_request.extra_fields, ["reasoning_effort"]);
    assert_eq!(config.broker_limits.max_calls_in_flight, 2);
    assert_eq!(config.broker_limits.max_connections, 8);
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

    let stdio = "transport = \"stdio\"\ncommand = \"srv\"\n";
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
        "config file <string>: mcp[0].scope: unknown variant `global`, expected `channel` or `shared` (at line 11, column 9)"
    );
    let prefix = "invalid broker policy: MCP server db: ";
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
}
