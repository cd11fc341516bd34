//! A broker driven alone, as the broker tests drive it: a policy for a model on loopback,
//! the broker, and one turn's listener on a socket in a private temp dir.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::broker::{Broker, BrokerListener, BrokerPolicy, TurnContext};
use crate::config::BrokerLimits;
use crate::{ApiKey, Speaker};

/// What the broker enforces for a test: the model `configured-model` at `model_url` (plain
/// HTTP to loopback allowed) with the key `key`; no host tool, no MCP server, no separate
/// summarizer; the default limits and model request policy; the peer must be this
/// process's user, checked.
pub fn broker_policy(model_url: &str, key: &str) -> BrokerPolicy {
    BrokerPolicy {
        model: "configured-model".into(),
        model_url: model_url.into(),
        api_key: ApiKey::from_static(key.to_owned()),
        tools: vec![],
        mcp: vec![],
        allow_http: true,
        limits: BrokerLimits::default(),
        worker_uid: nix::unistd::getuid().as_raw(),
        peer_uid_check: true,
        model_request: Default::default(),
        compaction: None,
        mcp_engine: Some(mcp_engine()),
        egress: vec![],
        egress_nameserver: None,
        engine_networks: vec![],
    }
}

/// The prefix of a test's MCP data root in `/tmp`; the pid of the process that made it follows.
const DATA_ROOT_PREFIX: &str = "rtb-mcp-";

/// Removes the MCP data roots (`/tmp/rtb-mcp-<pid>-…`) of this user's test processes that
/// have ended (a root is kept while its process lives: its tests read it).
fn remove_ended_data_roots() {
    use std::os::unix::fs::MetadataExt;
    let uid = nix::unistd::getuid().as_raw();
    let Ok(entries) = std::fs::read_dir("/tmp") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(DATA_ROOT_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let ours =
            std::fs::symlink_metadata(entry.path()).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        if ours && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The engine for container-confined MCP sessions of a broker test: the default engine,
/// this process's uid:gid, `$ROUNDTABLE_RUNTIME` (e.g. `runsc`), no free-space floor, a
/// fresh instance name and a fresh private data root under `/tmp` (kept while this process
/// lives: a test reads it; removed by the first engine of a later test process).
pub fn mcp_engine() -> crate::broker::McpEngine {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(remove_ended_data_roots);
    let data_root = tempfile::Builder::new()
        .prefix(&format!("{DATA_ROOT_PREFIX}{}-", std::process::id()))
        .tempdir_in("/tmp")
        .unwrap()
        .keep();
    crate::broker::McpEngine {
        docker_host: crate::driver::DockerOptions::default().host,
        driver: None,
        guest_image: super::env::image(),
        instance: format!("rtb-test-{}", uuid::Uuid::new_v4().simple()),
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        data_root,
        runtime: std::env::var("ROUNDTABLE_RUNTIME")
            .ok()
            .filter(|r| !r.is_empty()),
        floor: crate::quota::Floor {
            min_bytes: 0,
            min_percent: 0,
        },
    }
}

/// The broker of `policy`; panics when the policy is refused.
pub async fn start_broker(policy: BrokerPolicy) -> Arc<Broker> {
    Arc::new(Broker::new(policy).await.unwrap())
}

/// One turn's broker listener, on `broker.sock` in a private temp dir under `/tmp` (never
/// in the repo; removed when dropped).
#[derive(Debug)]
pub struct BrokerTurn {
    _dir: tempfile::TempDir,
    /// The turn's socket.
    pub socket: PathBuf,
    /// The turn's cancellation (ends every call in flight).
    pub cancel: CancellationToken,
    /// The listener (taken by a test that stops it itself).
    pub listener: Option<BrokerListener>,
}

impl BrokerTurn {
    /// Listens for a turn of `speaker` in `channel`.
    pub async fn start(broker: &Arc<Broker>, channel: &str, speaker: Speaker) -> Self {
        Self::start_with(broker, channel, speaker, None, None).await
    }

    /// [`BrokerTurn::start`], the turn's events (turn number 1) going to `observer`.
    pub async fn start_observed(
        broker: &Arc<Broker>,
        channel: &str,
        speaker: Speaker,
        observer: Option<crate::events::Observer>,
    ) -> Self {
        Self::start_with(broker, channel, speaker, observer, None).await
    }

    /// [`BrokerTurn::start`], the turn's usage counted (and its budgets checked) by
    /// `account`.
    pub async fn start_counted(
        broker: &Arc<Broker>,
        channel: &str,
        speaker: Speaker,
        account: Option<Arc<crate::budgets::TurnAccount>>,
    ) -> Self {
        Self::start_with(broker, channel, speaker, None, account).await
    }

    /// [`BrokerTurn::start`], the turn's events (turn number 1) going to `observer` and its
    /// usage counted (and its budgets checked) by `account`.
    pub async fn start_with(
        broker: &Arc<Broker>,
        channel: &str,
        speaker: Speaker,
        observer: Option<crate::events::Observer>,
        account: Option<Arc<crate::budgets::TurnAccount>>,
    ) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("rtb-")
            .tempdir_in("/tmp")
            .unwrap();
        let socket = dir.path().join("broker.sock");
        let cancel = CancellationToken::new();
        let ctx = TurnContext {
            channel: channel.into(),
            speaker,
            cancel: cancel.clone(),
            account,
            events: observer.map(|o| {
                crate::events::TurnEvents::new(
                    Arc::new(crate::events::EventHub::new(Some(o), None)),
                    1,
                    channel.into(),
                )
            }),
        };
        let listener = broker.listen(&socket, ctx).await.unwrap();
        Self {
            _dir: dir,
            socket,
            cancel,
            listener: Some(listener),
        }
    }

    /// The turn's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}
