//! The loopback HTTP/1.1 servers the test parts and the bench share: one accept loop, one
//! connection task each, and a request body read whole.

use std::convert::Infallible;
use std::future::Future;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

/// A request's body read whole (empty when the client went away mid-body).
pub async fn body(req: Request<Incoming>) -> Bytes {
    req.into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default()
}

/// Serves one HTTP/1.1 connection with `answer` until the client closes it.
pub async fn serve_connection<IO, F, Fut, B>(io: IO, answer: F)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Send + Clone + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let service = hyper::service::service_fn(move |req| {
        let answer = answer.clone();
        async move { Ok::<_, Infallible>(answer(req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await;
}

/// Accepts on `listener` until the task is aborted, each connection served by `answer` in
/// its own task (`TCP_NODELAY` set, as a web server sets it); aborting the task ends its
/// connections too.
pub fn serve<F, Fut, B>(listener: TcpListener, answer: F) -> tokio::task::JoinHandle<()>
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            while connections.try_join_next().is_some() {}
            let _ = stream.set_nodelay(true);
            connections.spawn(serve_connection(stream, answer.clone()));
        }
    })
}
