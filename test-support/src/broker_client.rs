//! A guest-side HTTP/1.1 client for the broker's unix socket, for tests.
//!
//! [`post`] sends one request and reads the whole answer; [`post_stream`] returns the
//! answer's body to be read frame by frame; [`ErrorBody`]-style bodies are parsed by
//! [`post_json`].

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// An answer read whole.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `error` of an `{"error": ...}` body.
    pub fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error in {}", self.text()))
            .to_owned()
    }
}

/// Sends one request on a fresh connection; returns the status and the body, unread.
pub async fn send(
    socket: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> std::io::Result<(u16, hyper::HeaderMap, Incoming)> {
    let stream = UnixStream::connect(socket).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "broker");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let resp = sender
        .send_request(req)
        .await
        .map_err(std::io::Error::other)?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    Ok((status, headers, resp.into_body()))
}

/// `POST path` with `body`, read whole.
pub async fn post(
    socket: &Path,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> std::io::Result<Answer> {
    let (status, headers, body) = send(socket, "POST", path, headers, body).await?;
    let body = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// `POST path` with a JSON body, read whole.
pub async fn post_json(socket: &Path, path: &str, body: &serde_json::Value) -> Answer {
    post(
        socket,
        path,
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await
    .expect("broker request")
}

/// `POST path` with a JSON body; returns the status, the headers and the body, unread.
pub async fn post_stream(
    socket: &Path,
    path: &str,
    body: &serde_json::Value,
) -> (u16, hyper::HeaderMap, Incoming) {
    send(
        socket,
        "POST",
        path,
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await
    .expect("broker request")
}

/// The rest of a streamed body, every data frame to its end.
pub async fn read_rest(body: &mut Incoming) -> Vec<u8> {
    let mut all = Vec::new();
    while let Some(chunk) = next_chunk(body).await {
        all.extend_from_slice(&chunk);
    }
    all
}

/// The next data frame of a streamed body (`None` at its end).
pub async fn next_chunk(body: &mut Incoming) -> Option<Bytes> {
    loop {
        let frame = body.frame().await?.expect("body frame");
        if let Ok(data) = frame.into_data() {
            return Some(data);
        }
    }
}

/// `method path` with `headers` and `body`, read whole.
pub async fn request(
    socket: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    let (status, headers, body) = send(socket, method, path, headers, body)
        .await
        .expect("broker request");
    let body = body.collect().await.expect("read the answer").to_bytes();
    Answer {
        status,
        headers,
        body,
    }
}
