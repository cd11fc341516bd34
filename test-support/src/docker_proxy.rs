//! A unix-socket proxy in front of the Docker daemon, for chaos tests: the runtime is
//! pointed at it (never at the real daemon, which other users share), and the test makes
//! the "daemon" go away mid-turn without touching the real one.
//!
//! Modes: [`Mode::Forward`] (a transparent byte pipe to `/var/run/docker.sock`),
//! [`Mode::Silent`] (connections stay open, nothing more passes either way: a hung
//! daemon), [`Mode::Closed`] (every connection is cut and new ones are closed at once: a
//! dead daemon). Switching back to `Forward` brings the "daemon" back for new connections.
//! [`DockerProxy::delay_starts`] makes the "daemon" slow to start containers (each
//! `POST …/start` request is held that long before it passes): a loaded engine.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    Forward = 0,
    Silent = 1,
    Closed = 2,
}

#[derive(Debug)]
pub struct DockerProxy {
    path: PathBuf,
    mode: Arc<AtomicU8>,
    /// How long each container start request is held (ms).
    start_delay: Arc<AtomicU64>,
    /// Cancelled (and replaced) to cut every open connection.
    cut: Arc<std::sync::Mutex<CancellationToken>>,
    task: tokio::task::JoinHandle<()>,
}

fn upstream() -> String {
    std::env::var("DOCKER_HOST")
        .ok()
        .and_then(|h| h.strip_prefix("unix://").map(str::to_owned))
        .unwrap_or_else(|| "/var/run/docker.sock".into())
}

impl DockerProxy {
    pub fn start(dir: &Path) -> Self {
        let path = dir.join("docker-proxy.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mode = Arc::new(AtomicU8::new(Mode::Forward as u8));
        let start_delay = Arc::new(AtomicU64::new(0));
        let cut = Arc::new(std::sync::Mutex::new(CancellationToken::new()));
        let (m, c, d) = (mode.clone(), cut.clone(), start_delay.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                // The mode is read and the token taken under the lock `set` holds, so a
                // connection accepted as the daemon dies is either refused or cut.
                let token = {
                    let cut = c.lock().unwrap();
                    if m.load(Ordering::SeqCst) == Mode::Closed as u8 {
                        drop(client);
                        continue;
                    }
                    cut.clone()
                };
                let (mode, delay) = (m.clone(), d.clone());
                tokio::spawn(async move {
                    let Ok(server) = UnixStream::connect(upstream()).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    // Each direction ends on its own (a half-close passes through, as
                    // the attach stream's stdin EOF must); a cut ends both.
                    tokio::select! {
                        _ = async { tokio::join!(pipe(cr, sw, mode.clone(), Some(delay)), pipe(sr, cw, mode, None)) } => {}
                        _ = token.cancelled() => {}
                    }
                });
            }
        });
        Self {
            path,
            mode,
            start_delay,
            cut,
            task,
        }
    }

    /// `unix://<path>` for `DockerOptions::host`.
    pub fn host(&self) -> String {
        format!("unix://{}", self.path.display())
    }

    /// Holds each container start request `delay` before it reaches the daemon.
    pub fn delay_starts(&self, delay: Duration) {
        self.start_delay
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn set(&self, mode: Mode) {
        let mut cut = self.cut.lock().unwrap();
        self.mode.store(mode as u8, Ordering::SeqCst);
        if mode == Mode::Closed {
            cut.cancel();
            *cut = CancellationToken::new();
        }
    }
}

impl Drop for DockerProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.lock().unwrap().cancel();
    }
}

/// Copies bytes while the mode is `Forward`; holds them while `Silent`; ends at `Closed`.
/// With `start_delay` (the client's direction), a read that begins a container start
/// request is held that long first.
async fn pipe(
    mut from: tokio::net::unix::OwnedReadHalf,
    mut to: tokio::net::unix::OwnedWriteHalf,
    mode: Arc<AtomicU8>,
    start_delay: Option<Arc<AtomicU64>>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        while mode.load(Ordering::SeqCst) == Mode::Silent as u8 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        while mode.load(Ordering::SeqCst) == Mode::Silent as u8 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(delay) = &start_delay {
            let ms = delay.load(Ordering::SeqCst);
            if ms > 0 && is_start_request(&buf[..n]) {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
        // A dead daemon passes nothing more, whatever a busy scheduler did with the cut.
        if mode.load(Ordering::SeqCst) == Mode::Closed as u8 {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Whether `bytes` begin an Engine API container start request (`POST …/containers/…/start`).
fn is_start_request(bytes: &[u8]) -> bool {
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    line.starts_with("POST ")
        && line.contains("/containers/")
        && line.split(' ').nth(1).is_some_and(|target| {
            target
                .split('?')
                .next()
                .is_some_and(|p| p.ends_with("/start"))
        })
}
