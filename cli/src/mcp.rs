//! The MCP servers: how each runs, its scope and allow-list, as `explain` shows them and
//! as `doctor` checks them (unconfined servers fail; a container's image must be present).

use roundtable_sandbox::{Config, McpScope, McpTransport};

use crate::check::{fail, pass, Check};
use crate::host::Engine;
use crate::{host_of, show};

/// `explain`'s lines for the MCP servers, each with a warning when it runs unconfined.
pub(crate) fn explain(config: &Config) {
    let (uid, gid) = config.worker_identity();
    if config.mcp.is_empty() {
        println!("mcp           (none)");
    }
    for m in &config.mcp {
        let how = match &m.transport {
            McpTransport::Stdio { command, .. } if m.unconfined() => format!(
                "stdio `{command}` UNCONFINED on the host (confine = \"host\": user {uid}:{gid} with its groups, its files, its network)"
            ),
            McpTransport::Stdio { command, .. } => {
                let ml = &m.limits;
                format!(
                    "stdio `{command}` in a container of {} per session (user {uid}:{gid}, no other group, network {}, read-only root, memory {} MiB, {} cpus, {} pids, only its data dir {}/{}/{}/<sha256(channel)> -> /data, quota {} MiB / {} entries)",
                    m.image.as_deref().unwrap_or("?"),
                    if m.network { "ON (network = true)" } else { "none" },
                    ml.memory_mb,
                    ml.cpus,
                    ml.pids,
                    show(&config.workspace_root),
                    roundtable_sandbox::operator::MCP_DATA_DIR,
                    m.name,
                    ml.data_mb,
                    ml.data_files
                )
            }
            McpTransport::Http { url, .. } => format!("http {}", host_of(url)),
        };
        let scope = match m.scope() {
            McpScope::Channel => format!(
                "one session per channel (at most {}, least recently used stopped first)",
                m.session_cap()
            ),
            McpScope::Shared => {
                "one session shared by every channel (cross-channel; its calls one at a time, in turn across channels)".into()
            }
        };
        println!(
            "mcp           {}: {how}; {scope}; allow-list: {}",
            m.name,
            m.tools.join(", ")
        );
        if m.unconfined() {
            println!(
                "WARNING       mcp {} runs unconfined on the host: whatever a guest makes it do, it does with the service user's rights",
                m.name
            );
        }
        if m.in_container() && m.network {
            println!(
                "WARNING       mcp {} has the engine's default network (network = true): a guest can make it reach the host's bridge address, the other containers there and a cloud metadata service, which egress routes refuse",
                m.name
            );
        }
        if m.scope() == McpScope::Shared {
            shared_mcp_warning(m, config.broker_limits.call_timeout);
        }
    }
}

/// The two hazards of a shared MCP server (issue 43): its data is every channel's, and so
/// is its availability.
fn shared_mcp_warning(m: &roundtable_sandbox::McpServer, call_timeout: std::time::Duration) {
    let timeout = match m.transport {
        McpTransport::Stdio { .. } => {
            "a call that times out stops the session for every channel (the calls waiting run on a restarted one; what the server kept only in memory is lost)"
        }
        McpTransport::Http { .. } => {
            "a call that times out is cancelled and the session kept (the calls behind it wait for whatever the remote still does for it)"
        }
    };
    println!(
        "WARNING       mcp {} is shared by every channel: whatever it keeps, every channel can read; its calls run one at a time, in turn across channels, so one channel's slow call delays the others' (each call up to {:?}), and {timeout}; scope = \"channel\" gives each channel its own session",
        m.name, call_timeout
    );
}

/// `doctor`'s lines for the MCP servers.
pub(crate) async fn doctor(config: &Config, engine: &Engine) -> Vec<Check> {
    let (driver, docker_ok) = (&engine.driver, engine.reachable);
    let mut checks = Vec::new();
    for m in &config.mcp {
        if m.unconfined() {
            checks.push(fail(
                "mcp",
                format!(
                    "{} runs UNCONFINED on the host (confine = \"host\"): the service user's rights, groups (docker) and files",
                    m.name
                ),
                "run it in its own container: remove confine and set image (scripts/build-mcp-image.sh)",
            ));
        } else if let Some(image) = m.image.as_deref().filter(|_| m.in_container()) {
            checks.push(if !docker_ok {
                fail(
                    "mcp",
                    format!(
                        "{}: image {image} not checked, Docker is unreachable",
                        m.name
                    ),
                    "fix the docker check first",
                )
            } else {
                match driver.image_present(image).await {
                    Ok(true) => pass(
                        "mcp",
                        format!("{}: in a container of {image} (present)", m.name),
                    ),
                    Ok(false) => fail(
                        "mcp",
                        format!("{}: image {image} is missing", m.name),
                        "build it: scripts/build-mcp-image.sh",
                    ),
                    Err(e) => fail("mcp", e.to_string(), "fix the docker check first"),
                }
            });
        }
    }
    checks
}
