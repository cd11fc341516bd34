//! The stub MCP server of `tests/support/mcp_stub.py` as a broker configuration.

use std::path::Path;

use roundtable_sandbox::broker::{McpServerConfig, McpTransport};

/// The stub server (no dependencies but python3), its files in `dir`, `tools` allow-listed.
pub fn stub_server(dir: &Path, tools: &[&str]) -> McpServerConfig {
    McpServerConfig {
        name: "stub".into(),
        transport: McpTransport::Stdio {
            command: "python3".into(),
            args: vec![Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/support/mcp_stub.py")
                .display()
                .to_string()],
            env: [("STUB_DIR".to_owned(), dir.display().to_string())].into(),
        },
        tools: tools.iter().map(|s| s.to_string()).collect(),
    }
}
