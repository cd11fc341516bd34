//! Helpers shared by the unit tests: a temporary directory removed on drop, a stub broker.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// A fresh directory under the system temp dir, removed (best effort) on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates a new, empty, uniquely named directory.
    pub fn new() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            std::env::temp_dir().join(format!("rt-guest-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        Self(path.canonicalize().unwrap())
    }

    /// The directory's (canonical) path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A stub of the broker on a unix socket: serves one canned answer per connection, in
/// order, and records each request (its head and body, as text).
#[derive(Debug)]
pub struct StubBroker {
    socket: PathBuf,
    server: Option<std::thread::JoinHandle<Vec<String>>>,
    _dir: TempDir,
}

impl StubBroker {
    /// Starts serving `answers` (whole HTTP responses), one connection each.
    pub fn start(answers: Vec<Vec<u8>>) -> Self {
        use std::io::{BufRead, BufReader, Read, Write};
        let dir = TempDir::new();
        let socket = dir.path().join("broker.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let server = std::thread::spawn(move || {
            let mut requests = Vec::new();
            for answer in answers {
                let (stream, _) = listener.accept().unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request = Vec::new();
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    request.extend_from_slice(line.as_bytes());
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                request.extend_from_slice(&body);
                requests.push(String::from_utf8_lossy(&request).into_owned());
                // The client may stop reading early (a cap): a failed write is its choice.
                let mut stream = stream;
                let _ = stream.write_all(&answer);
            }
            requests
        });
        Self {
            socket,
            server: Some(server),
            _dir: dir,
        }
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Waits for every answer to be served and returns the requests received.
    pub fn requests(mut self) -> Vec<String> {
        self.server.take().unwrap().join().unwrap()
    }
}

/// A whole HTTP response with a `Content-Length`.
pub fn answer(status: u16, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} X\r\n");
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}
