//! The policy checked at setup.

use super::*;

#[tokio::test]
async fn the_policy_is_checked_at_setup() {
    let err = |p: BrokerPolicy| validate_policy(&p).unwrap_err().to_string();
    let mut p = policy("http://api.example.com/v1");
    p.allow_http = false;
    assert_eq!(
        err(p),
        "model_url must use https (set allow_http only for offline tests): http://api.example.com/v1"
    );
    assert_eq!(
        err(policy("ftp://api.example.com/v1")),
        "invalid model_url: ftp://api.example.com/v1"
    );
    assert!(validate_policy(&policy("https://api.example.com/v1")).is_ok());

    use roundtable_sandbox::internals::testing::NamedTool as Named;
    let mut p = policy("https://api.example.com/v1");
    p.tools = vec![Arc::new(Named("Bad Name"))];
    assert_eq!(
        err(p.clone()),
        r#"invalid tool name "Bad Name": use 1 to 64 of a-z, 0-9, _ and -"#
    );
    p.tools = vec![Arc::new(Named("a")), Arc::new(Named("a"))];
    assert_eq!(err(p.clone()), "duplicate tool name: a");
    p.tools = vec![Arc::new(Named("sh"))];
    assert_eq!(
        err(p.clone()),
        r#"host tool "sh" has the name of a built-in guest tool (built-ins: read, write, edit, list, sh, fetch)"#
    );
    p.tools = vec![Arc::new(Named("bad-schema"))];
    assert!(err(p.clone()).starts_with("invalid JSON schema for tool bad-schema: "));

    let mut p = policy("https://api.example.com/v1");
    p.mcp = vec![McpServer {
        image: Some("roundtable-sandbox-mcp:latest".into()),
        ..McpServer::new("time", stdio("mcp-server-time", &[]), &[])
    }];
    assert_eq!(
        err(p.clone()),
        "MCP server time: the tool allow-list is empty"
    );
    p.mcp[0].tools = vec!["get time".into()];
    assert_eq!(
        err(p.clone()),
        r#"MCP server time: invalid tool name "get time" in the allow-list: use 1 to 64 of A-Z, a-z, 0-9, _ and -"#
    );
    p.mcp[0].tools = vec!["get_current_time".into()];
    p.mcp.push(p.mcp[0].clone());
    assert_eq!(err(p.clone()), "MCP server time: configured twice");
    p.mcp.pop();
    // A stdio server runs in a container unless told otherwise: it needs an image.
    p.mcp[0].image = None;
    assert_eq!(
        err(p.clone()),
        r#"MCP server time: a stdio server runs in its own container: set image (scripts/build-mcp-image.sh builds roundtable-sandbox-mcp:latest), or confine = "host" to run it unconfined on the host"#
    );
    p.mcp[0].image = Some("bad image".into());
    assert_eq!(
        err(p.clone()),
        r#"MCP server time: invalid image "bad image""#
    );
    p.mcp[0].image = Some("roundtable-sandbox-mcp:latest".into());
    p.mcp[0].limits.memory_mb = 8;
    assert_eq!(
        err(p.clone()),
        "MCP server time: limits out of range (memory_mb 16 to 65536, cpus above 0 to 64, pids 8 to 4096, tmpfs_mb 1 to 4096, data_mb 1 to 1048576, data_files 16 to 10000000): McpLimits { memory_mb: 8, cpus: 0.5, pids: 64, tmpfs_mb: 16, data_mb: 64, data_files: 10000 }"
    );
    p.mcp[0].limits = Default::default();
    p.mcp[0].confine = roundtable_sandbox::internals::config::McpConfine::Host;
    assert_eq!(
        err(p.clone()),
        r#"MCP server time: image is set but confine = "host" runs the server on the host"#
    );
    p.mcp[0].image = None;
    p.mcp[0].network = true;
    assert_eq!(
        err(p.clone()),
        r#"MCP server time: network and limits apply only to confine = "container""#
    );
    p.mcp[0].network = false;
    p.mcp[0].confine = Default::default();
    assert_eq!(
        err(p.clone()),
        r#"MCP server time: a stdio server runs in its own container: set image (scripts/build-mcp-image.sh builds roundtable-sandbox-mcp:latest), or confine = "host" to run it unconfined on the host"#
    );
    p.mcp[0].transport = McpTransport::Http {
        url: "http://mcp.example.com/mcp".into(),
        headers: Default::default(),
    };
    p.allow_http = false;
    assert_eq!(
        err(p.clone()),
        "MCP server time: url must use https (set allow_http only for offline tests): http://mcp.example.com/mcp"
    );
    // Each limit out of range, alone.
    type Set = fn(&mut BrokerLimits);
    let limits: [(Set, &str); 6] = [
        (
            |l| l.max_model_calls = 0,
            "invalid broker limits: max_model_calls must be 1 to 10000",
        ),
        (
            |l| l.max_compactions = 0,
            "invalid broker limits: max_compactions must be 1 to 1000",
        ),
        (
            |l| l.max_compactions = 1001,
            "invalid broker limits: max_compactions must be 1 to 1000",
        ),
        (
            |l| l.max_calls_in_flight = 0,
            "invalid broker limits: max_calls_in_flight must be 1 to 256",
        ),
        (
            |l| l.max_connections = 2000,
            "invalid broker limits: max_connections must be 1 to 1024",
        ),
        (
            |l| l.max_connections = 2,
            "invalid broker limits: max_connections must be at least max_calls_in_flight",
        ),
    ];
    for (set, expected) in limits {
        let mut p = policy("https://api.example.com/v1");
        set(&mut p.limits);
        assert_eq!(err(p), expected);
    }
    // The TOML form of the limits refuses a negative deadline instead of panicking.
    let parsed: Result<BrokerLimits, _> = toml::from_str("call_timeout = -1.0");
    assert!(parsed.is_err());
    let parsed: BrokerLimits = toml::from_str("call_timeout = 2.5\nmax_tool_calls = 3").unwrap();
    assert_eq!(parsed.call_timeout, Duration::from_millis(2500));
    assert_eq!(parsed.max_compactions, 4, "the default");
    assert_eq!(parsed.max_tool_calls, 3);
    assert!(matches!(
        Broker::new(policy("http://127.0.0.1:9/v1"))
            .await
            .map(|_| ()),
        Ok(())
    ));
    let _ = BrokerError::ApiKey(String::new());
}
