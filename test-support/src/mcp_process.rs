//! The MCP servers' venv and their processes as the tests watch them: a server started
//! behind `sh -c 'echo $$ > FILE; exec SERVER'` leaves its pid in FILE.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use roundtable_sandbox::internals::config::{McpConfine, McpServer, McpTransport};

/// The venv `scripts/mcp-venv.sh` makes (`$ROUNDTABLE_MCP_VENV`, else `<repo>/.venv-mcp`).
pub fn venv() -> PathBuf {
    std::env::var_os("ROUNDTABLE_MCP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-mcp"))
}

/// The venv's `bin/<name>`; panics, saying how to make the venv, when it is missing.
pub fn venv_bin(name: &str) -> PathBuf {
    let bin = venv().join("bin").join(name);
    assert!(
        bin.exists(),
        "{} is missing: run scripts/mcp-venv.sh (or set ROUNDTABLE_MCP_VENV to a venv with {name})",
        bin.display()
    );
    bin
}

/// `mcp-server-sqlite` (PyPI) as the MCP server `sqlite` with `tools` allowed, behind `sh`,
/// which writes the server's pid to `dir/pid-<db>` first; its database is `dir/<db>.db`.
/// `db` may hold `{channel}`.
pub fn sqlite_server(dir: &Path, db: &str, tools: &[&str]) -> McpServer {
    let mut config = McpServer::new(
        "sqlite",
        McpTransport::Stdio {
            command: "sh".into(),
            args: vec![
                "-c".into(),
                r#"echo $$ > "$0"; exec "$@""#.into(),
                dir.join(format!("pid-{db}")).display().to_string(),
                venv_bin("mcp-server-sqlite").display().to_string(),
                "--db-path".into(),
                dir.join(format!("{db}.db")).display().to_string(),
            ],
            env: Default::default(),
        },
        tools,
    );
    // A host child: the tests that use it watch its host pid (sessions stopped, reaped).
    config.confine = McpConfine::Host;
    config
}

/// The MCP servers' image (`scripts/build-mcp-image.sh`; `$ROUNDTABLE_MCP_IMAGE`).
pub fn mcp_image() -> String {
    std::env::var("ROUNDTABLE_MCP_IMAGE").unwrap_or_else(|_| "roundtable-sandbox-mcp:latest".into())
}

/// `mcp-server-sqlite` as the MCP server `sqlite`, each session in its own container of
/// [`mcp_image`] (the default confinement), its database `/data/db.sqlite` (its own data
/// dir), `tools` allowed.
pub fn sqlite_container(tools: &[&str]) -> McpServer {
    let mut config = McpServer::new(
        "sqlite",
        McpTransport::Stdio {
            command: "mcp-server-sqlite".into(),
            args: vec!["--db-path".into(), "/data/db.sqlite".into()],
            env: Default::default(),
        },
        tools,
    );
    config.image = Some(mcp_image());
    config
}

/// The pid a server's `sh` wrapper wrote to `file`.
pub fn read_pid(file: &Path) -> i32 {
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Whether `pid` still exists (a zombie counts: it has not been reaped).
pub fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Waits until `pid` is gone (reaped); panics after 20 s.
pub async fn wait_gone(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive(pid) {
        assert!(
            Instant::now() < deadline,
            "process {pid} is still there (zombie?)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
