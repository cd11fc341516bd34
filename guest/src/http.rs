//! A minimal blocking HTTP/1.1 client over a unix socket: the guest's only way out.
//!
//! One request per connection (`Connection: close`), a deadline for the whole exchange
//! (socket timeouts set from the time left before every read and write), a cap on the
//! response head and body, and both `Content-Length` and `Transfer-Encoding: chunked`
//! bodies. The broker is trusted more than the model, but its answers are still parsed
//! defensively: a malformed response is an error, never a panic or an unbounded read.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The largest response head (status line and headers) read.
const MAX_HEAD: usize = 64 * 1024;

/// Why an HTTP exchange failed.
#[derive(Debug)]
pub enum HttpError {
    /// The socket could not be reached.
    Connect(io::Error),
    /// The deadline passed before the exchange finished.
    Timeout,
    /// Reading or writing failed.
    Io(io::Error),
    /// The response was not well-formed HTTP/1.1.
    Malformed(&'static str),
    /// The response body was larger than allowed.
    TooLarge(usize),
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HttpError::Connect(e) => write!(f, "cannot reach the broker: {e}"),
            HttpError::Timeout => f.write_str("the broker did not answer in time"),
            HttpError::Io(e) => write!(f, "broker connection failed: {e}"),
            HttpError::Malformed(what) => write!(f, "malformed broker response: {what}"),
            HttpError::TooLarge(max) => {
                write!(f, "broker response larger than {max} bytes")
            }
        }
    }
}

impl std::error::Error for HttpError {}

/// A response: its status and its (de-chunked) body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// A client for one unix-socket HTTP server.
#[derive(Debug, Clone)]
pub struct UnixHttpClient {
    socket: PathBuf,
    max_body: usize,
}

impl UnixHttpClient {
    /// A client for the server listening on `socket`, reading at most `max_body` body bytes.
    pub fn new(socket: impl Into<PathBuf>, max_body: usize) -> Self {
        Self {
            socket: socket.into(),
            max_body,
        }
    }

    /// Sends `POST path` with a JSON body and reads the whole response within `timeout`.
    pub fn post_json(
        &self,
        path: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<Response, HttpError> {
        if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(HttpError::Malformed("invalid request path"));
        }
        let deadline = Instant::now() + timeout;
        let stream = UnixStream::connect(&self.socket).map_err(HttpError::Connect)?;
        let mut conn = Deadlined { stream, deadline };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n\
             Accept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let sent = conn
            .write_all(head.as_bytes())
            .and_then(|()| conn.write_all(body))
            .and_then(|()| conn.flush());
        match sent {
            Ok(()) => read_response(conn, self.max_body),
            // The server may answer (413, 400 …) and close before reading the whole body.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                ) =>
            {
                read_response(conn, self.max_body).map_err(|_| io_error(e))
            }
            Err(e) => Err(io_error(e)),
        }
    }
}

/// A stream whose every read and write gets the time left before the deadline.
struct Deadlined {
    stream: UnixStream,
    deadline: Instant,
}

impl Deadlined {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
        } else {
            Ok(left)
        }
    }
}

impl Read for Deadlined {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Write for Deadlined {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

fn io_error(e: io::Error) -> HttpError {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => HttpError::Timeout,
        _ => HttpError::Io(e),
    }
}

/// Reads one CRLF- (or LF-) terminated line, counting it against the head budget.
fn read_line<R: BufRead>(reader: &mut R, budget: &mut usize) -> Result<String, HttpError> {
    let mut line = Vec::new();
    let limit = (*budget as u64).saturating_add(1);
    let n = reader
        .by_ref()
        .take(limit)
        .read_until(b'\n', &mut line)
        .map_err(io_error)?;
    if n == 0 {
        return Err(HttpError::Malformed("connection closed early"));
    }
    if n > *budget || !line.ends_with(b"\n") {
        return Err(if n > *budget {
            HttpError::Malformed("response head too large")
        } else {
            HttpError::Malformed("connection closed early")
        });
    }
    *budget -= n;
    line.pop();
    if line.ends_with(b"\r") {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| HttpError::Malformed("non-utf8 response head"))
}

/// Parses a response from `reader`: status line, headers, then the body.
pub fn read_response<R: Read>(reader: R, max_body: usize) -> Result<Response, HttpError> {
    let mut reader = BufReader::new(reader);
    loop {
        let mut budget = MAX_HEAD;
        let status_line = read_line(&mut reader, &mut budget)?;
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or("");
        if !version.starts_with("HTTP/1.") {
            return Err(HttpError::Malformed("not an http/1 status line"));
        }
        let status: u16 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .filter(|s| (100..600).contains(s))
            .ok_or(HttpError::Malformed("bad status code"))?;
        let mut content_length: Option<usize> = None;
        let mut chunked = false;
        loop {
            let line = read_line(&mut reader, &mut budget)?;
            if line.is_empty() {
                break;
            }
            let (name, value) = line
                .split_once(':')
                .ok_or(HttpError::Malformed("bad header line"))?;
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                let n: usize = value
                    .parse()
                    .map_err(|_| HttpError::Malformed("bad content-length"))?;
                if content_length.is_some_and(|m| m != n) {
                    return Err(HttpError::Malformed("conflicting content-length"));
                }
                content_length = Some(n);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value
                    .rsplit(',')
                    .next()
                    .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
                if !chunked {
                    return Err(HttpError::Malformed("unsupported transfer-encoding"));
                }
            }
        }
        if (100..200).contains(&status) {
            // An interim answer (such as 100 Continue): the real one follows.
            continue;
        }
        let body = if chunked {
            read_chunked(&mut reader, max_body)?
        } else if let Some(n) = content_length {
            if n > max_body {
                return Err(HttpError::TooLarge(max_body));
            }
            let mut body = vec![0; n];
            reader.read_exact(&mut body).map_err(|e| {
                if e.kind() == io::ErrorKind::UnexpectedEof {
                    HttpError::Malformed("body shorter than content-length")
                } else {
                    io_error(e)
                }
            })?;
            body
        } else {
            let mut body = Vec::new();
            reader
                .by_ref()
                .take(max_body as u64 + 1)
                .read_to_end(&mut body)
                .map_err(io_error)?;
            if body.len() > max_body {
                return Err(HttpError::TooLarge(max_body));
            }
            body
        };
        return Ok(Response { status, body });
    }
}

fn read_chunked<R: BufRead>(reader: &mut R, max_body: usize) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    loop {
        let mut budget = 1024;
        let line = read_line(reader, &mut budget)?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| HttpError::Malformed("bad chunk size"))?;
        if size == 0 {
            // Trailers, up to the empty line.
            let mut budget = MAX_HEAD;
            while !read_line(reader, &mut budget)?.is_empty() {}
            return Ok(body);
        }
        if size > max_body.saturating_sub(body.len()) {
            return Err(HttpError::TooLarge(max_body));
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                HttpError::Malformed("chunk shorter than its size")
            } else {
                io_error(e)
            }
        })?;
        let mut budget = 2;
        if !read_line(reader, &mut budget)?.is_empty() {
            return Err(HttpError::Malformed("missing chunk terminator"));
        }
    }
}

/// Percent-encodes one path segment: everything but RFC 3986 `pchar` (unreserved,
/// sub-delims, `:` and `@`), so `/`, `%`, `?`, `#`, spaces and non-ASCII are encoded and
/// ordinary names pass unchanged (the broker matches raw path segments).
pub fn encode_segment(segment: &str) -> String {
    if segment == "." || segment == ".." {
        // Dot-segments would be path navigation to whoever normalises the path.
        return segment.replace('.', "%2E");
    }
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'_'
                    | b'.'
                    | b'~'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
                    | b':'
                    | b'@'
            )
        {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;
    use std::os::unix::net::UnixListener;
    use std::thread;

    /// Serves one connection: reads the request head and body, answers `canned`,
    /// and hands the raw request back.
    fn serve_once(canned: &'static [u8]) -> (PathBuf, thread::JoinHandle<Vec<u8>>, TempDir) {
        let dir = TempDir::new();
        let path = dir.path().join("broker.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let handle = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = Vec::new();
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
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
            let mut stream = stream;
            stream.write_all(canned).unwrap();
            request
        });
        (path, handle, dir)
    }

    #[test]
    fn content_length_response_over_a_real_socket() {
        let (path, server, _dir) = serve_once(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}",
        );
        let client = UnixHttpClient::new(&path, 1024);
        let response = client
            .post_json("/v1/tools/echo", br#"{"a":1}"#, Duration::from_secs(5))
            .unwrap();
        assert_eq!(response.status, 200);
        assert_eq!(response.body, br#"{"ok":true}"#);
        let request = String::from_utf8(server.join().unwrap()).unwrap();
        assert!(
            request.starts_with("POST /v1/tools/echo HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(request.contains("Host: broker\r\n"));
        assert!(request.contains("Content-Length: 7\r\n"));
        assert!(request.contains("Connection: close\r\n"));
        assert!(request.ends_with("\r\n\r\n{\"a\":1}"));
    }

    #[test]
    fn chunked_response_over_a_real_socket() {
        let (path, server, _dir) = serve_once(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\n{\"err\r\n9\r\nor\":\"no\"}\r\n0\r\nX-Trailer: 1\r\n\r\n",
        );
        let client = UnixHttpClient::new(&path, 1024);
        let response = client
            .post_json("/v1/chat/completions", b"{}", Duration::from_secs(5))
            .unwrap();
        assert_eq!(response.status, 400);
        assert_eq!(response.body, br#"{"error":"no"}"#);
        server.join().unwrap();
    }

    #[test]
    fn oversized_and_malformed_responses_are_errors() {
        let big = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n";
        assert!(matches!(
            read_response(&big[..], 10),
            Err(HttpError::TooLarge(10))
        ));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nff\r\n";
        assert!(matches!(
            read_response(&chunked[..], 10),
            Err(HttpError::TooLarge(10))
        ));
        let eof = b"HTTP/1.1 200 OK\r\n\r\n0123456789abcdef";
        assert!(matches!(
            read_response(&eof[..], 10),
            Err(HttpError::TooLarge(10))
        ));
        assert!(read_response(&b"garbage\r\n\r\n"[..], 10).is_err());
        assert!(read_response(&b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab"[..], 10).is_err());
        let ok = read_response(&b"HTTP/1.1 204 No Content\r\n\r\n"[..], 10).unwrap();
        assert_eq!(ok.status, 204);
        assert!(ok.body.is_empty());
    }

    #[test]
    fn an_early_answer_to_an_unread_body_is_still_read() {
        let dir = TempDir::new();
        let path = dir.path().join("early.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut head = [0u8; 64];
            let _ = stream.read(&mut head).unwrap();
            stream
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 24\r\n\r\n{\"error\":\"body too big\"}")
                .unwrap();
            drop(stream);
        });
        let client = UnixHttpClient::new(&path, 1024);
        let body = vec![b' '; 8 << 20];
        let response = client
            .post_json("/v1/tools/x", &body, Duration::from_secs(5))
            .unwrap();
        assert_eq!(response.status, 413);
        assert_eq!(response.body, br#"{"error":"body too big"}"#);
        server.join().unwrap();
    }

    #[test]
    fn a_silent_server_times_out() {
        let dir = TempDir::new();
        let path = dir.path().join("slow.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            thread::sleep(Duration::from_millis(600));
            drop(stream);
        });
        let client = UnixHttpClient::new(&path, 1024);
        let err = client
            .post_json("/v1/tools/x", b"{}", Duration::from_millis(200))
            .unwrap_err();
        assert!(matches!(err, HttpError::Timeout), "{err:?}");
        server.join().unwrap();
    }

    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(encode_segment("a b/../c"), "a%20b%2F..%2Fc");
        assert_eq!(encode_segment("get_weather-1.0"), "get_weather-1.0");
        assert_eq!(encode_segment("ns:tool@v2"), "ns:tool@v2");
        assert_eq!(encode_segment("a?b#c%d"), "a%3Fb%23c%25d");
        assert_eq!(encode_segment(".."), "%2E%2E");
    }
}
