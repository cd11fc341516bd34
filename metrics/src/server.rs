//! `GET /metrics` over HTTP/1 on a TCP listener, on a thread of its own.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

use crate::Metrics;

/// The content type of the OpenMetrics text `encode` writes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Scrapes served at once; more wait for the listener's backlog.
const MAX_CONNECTIONS: usize = 16;
/// A scraper has this long to send its request's head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the metrics endpoint's address and listener.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A non-loopback address without the explicit permission.
    #[error(
        "metrics address {0} is not a loopback address (give --metrics-allow-remote to serve metrics beyond this host)"
    )]
    NotLoopback(SocketAddr),
    /// The address could not be bound.
    #[error("bind the metrics address {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The server's thread or runtime could not start.
    #[error("start the metrics server")]
    Start(#[source] std::io::Error),
}

/// The address rule: a loopback address (`127.0.0.0/8`, `::1`) unless `allow_remote`.
pub fn check_address(addr: SocketAddr, allow_remote: bool) -> Result<(), MetricsError> {
    if addr.ip().is_loopback() || allow_remote {
        Ok(())
    } else {
        Err(MetricsError::NotLoopback(addr))
    }
}

/// Whether `addr` can be bound now (what `doctor` checks): bound and let go at once.
pub fn bindable(addr: SocketAddr) -> Result<(), MetricsError> {
    std::net::TcpListener::bind(addr)
        .map(drop)
        .map_err(|source| MetricsError::Bind { addr, source })
}

/// The running endpoint: stopped (its thread joined) when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (checked by [`check_address`]) and serves `metrics` there.
    pub fn start(
        addr: SocketAddr,
        allow_remote: bool,
        metrics: Arc<Metrics>,
    ) -> Result<Self, MetricsError> {
        check_address(addr, allow_remote)?;
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|source| MetricsError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| MetricsError::Bind { addr, source })?;
        listener
            .set_nonblocking(true)
            .map_err(MetricsError::Start)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(MetricsError::Start)?;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || runtime.block_on(serve(listener, metrics, stopped)))
            .map_err(MetricsError::Start)?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens (the port chosen when `:0` was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(listener: std::net::TcpListener, metrics: Arc<Metrics>, stop: CancellationToken) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "the metrics listener could not be used");
            return;
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let tasks = tokio_util::task::TaskTracker::new();
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s,
            _ = stop.cancelled() => break,
        };
        let Ok(slot) = slot else { break };
        let stream = tokio::select! {
            a = listener.accept() => match a {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => break,
        };
        let metrics = metrics.clone();
        let stop = stop.clone();
        tasks.spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req| {
                let metrics = metrics.clone();
                async move { Ok::<_, Infallible>(answer(&metrics, &req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "metrics connection ended");
                },
                _ = stop.cancelled() => {}
            }
        });
    }
    tasks.close();
    tasks.wait().await;
}

fn answer(metrics: &Metrics, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, text: &'static str| {
        Response::builder()
            .status(status)
            .header(CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from_static(text.as_bytes())))
            .expect("a valid response")
    };
    if req.uri().path() != "/metrics" {
        return reply(
            StatusCode::NOT_FOUND,
            "not found: the metrics are at /metrics\n",
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: use GET\n",
        );
        r.headers_mut()
            .insert(ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, OPENMETRICS)
        .body(Full::new(Bytes::from(metrics.encode())))
        .expect("a valid response")
}
