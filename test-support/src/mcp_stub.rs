//! The stub MCP server of `tests/support/mcp_stub.py` as a broker configuration.

use std::path::Path;

use roundtable_sandbox::internals::config::{McpConfine, McpServer, McpTransport};

/// The stub server (no dependencies but python3), its files in `dir`, `tools` allow-listed,
/// with the default scope (`channel` for stdio).
pub fn stub_server(dir: &Path, tools: &[&str]) -> McpServer {
    stub_server_with(dir, tools, &[])
}

/// The stub server with extra arguments (e.g. `{channel}`, which makes it write
/// `pid-<channel>` and read `description-<channel>` first).
pub fn stub_server_with(dir: &Path, tools: &[&str], extra: &[&str]) -> McpServer {
    let mut args = vec![Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/support/mcp_stub.py")
        .display()
        .to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut config = McpServer::new(
        "stub",
        McpTransport::Stdio {
            command: "python3".into(),
            args,
            env: [("STUB_DIR".to_owned(), dir.display().to_string())].into(),
        },
        tools,
    );
    // A host child: the tests that use it watch its host pid and files.
    config.confine = McpConfine::Host;
    config
}
