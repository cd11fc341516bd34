//! The guest's HTTP/1.1 client: blocking, one request per connection, over a unix socket
//! (the guest's only way out) or any other connected stream.
//!
//! No async runtime and no TLS, so the static guest stays small; `httparse` parses the
//! response head and the chunk sizes. Used by the guest (`guest/`), the benchmark (which
//! calls the broker the way the guest does) and the `http_response` fuzz target.
//!
//! One request per connection (`Connection: close`), a deadline for the whole exchange
//! (socket timeouts set from the time left before every read and write), a cap on the
//! response head and body, and both `Content-Length` and `Transfer-Encoding: chunked`
//! bodies. The broker is trusted more than the model, but its answers are still parsed
//! defensively: a malformed response is an error, never a panic or an unbounded read.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The largest response head (status line and headers) read.
pub const MAX_HEAD: usize = 64 * 1024;
/// The most header lines a response head may have.
pub const MAX_HEADERS: usize = 64;

/// Why an HTTP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The socket could not be reached.
    #[error("cannot reach the broker")]
    Connect(#[source] io::Error),
    /// The deadline passed before the exchange finished.
    #[error("the broker did not answer in time")]
    Timeout,
    /// Reading or writing failed.
    #[error("broker connection failed")]
    Io(#[source] io::Error),
    /// The response was not well-formed HTTP/1.1.
    #[error("malformed broker response: {0}")]
    Malformed(&'static str),
    /// The response body was larger than allowed.
    #[error("broker response larger than {0} bytes")]
    TooLarge(usize),
    /// The request was refused before anything was sent (a bad method or header).
    #[error("invalid request: {0}")]
    Request(String),
    /// The sink a body was copied to refused it ([`Exchange::copy_body`]).
    #[error("cannot write the response body")]
    Sink(#[source] io::Error),
}

/// A response: its status and its (de-chunked) body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status code.
    pub status: u16,
    /// The body, de-chunked.
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
        check_path(path)?;
        let deadline = Instant::now() + timeout;
        let stream = UnixStream::connect(&self.socket).map_err(HttpError::Connect)?;
        post(
            Deadlined { stream, deadline },
            path,
            "application/json",
            body,
            self.max_body,
        )
    }
}

impl UnixHttpClient {
    /// Sends `request` and reads the answer's head within `timeout`; the body stays on the
    /// connection for [`Exchange::copy_body`] (under the same deadline). The client's
    /// `max_body` is not applied here: the caller gives the body's cap when it copies it.
    pub fn request(
        &self,
        request: &Request<'_>,
        timeout: Duration,
    ) -> Result<Exchange<Deadlined>, HttpError> {
        request.check()?;
        let deadline = Instant::now() + timeout;
        let stream = UnixStream::connect(&self.socket).map_err(HttpError::Connect)?;
        send(Deadlined { stream, deadline }, request)
    }
}

/// Headers the client writes itself, or that would change how the exchange is framed: a
/// request that sets one is refused before anything is sent.
pub const RESERVED_HEADERS: [&str; 9] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
];

/// The longest method accepted.
const MAX_METHOD: usize = 32;

/// A request of any method, with headers of the caller's (see [`RESERVED_HEADERS`]).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The method (an HTTP token: `GET`, `POST`, …).
    pub method: &'a str,
    /// The request target: an origin-form path with its query (`/a/b?c=d`).
    pub path: &'a str,
    /// Header names and values, sent as given after the client's own.
    pub headers: &'a [(String, String)],
    /// The body (sent with a `Content-Length`; none for an empty body of `GET`, `HEAD`,
    /// `DELETE` and `OPTIONS`).
    pub body: &'a [u8],
}

/// An HTTP token character (RFC 9110 `tchar`).
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

impl Request<'_> {
    /// Refuses what cannot be sent as given: a method or header name that is no token, a
    /// header value with a control character (tab aside), a reserved header, a bad path.
    pub fn check(&self) -> Result<(), HttpError> {
        check_path(self.path)?;
        if self.method.is_empty()
            || self.method.len() > MAX_METHOD
            || !self.method.bytes().all(tchar)
        {
            return Err(HttpError::Request("the method is not an http token".into()));
        }
        for (name, value) in self.headers {
            if name.is_empty() || !name.bytes().all(tchar) {
                return Err(HttpError::Request(format!(
                    "header name {:?} is not an http token",
                    cut(name)
                )));
            }
            if RESERVED_HEADERS
                .iter()
                .any(|r| name.eq_ignore_ascii_case(r))
            {
                return Err(HttpError::Request(format!(
                    "header {name} is set by the client itself"
                )));
            }
            if value.bytes().any(|b| (b < b' ' && b != b'\t') || b == 0x7f) {
                return Err(HttpError::Request(format!(
                    "the value of header {name} has a control character"
                )));
            }
        }
        Ok(())
    }
}

/// A short, printable form of a rejected name.
fn cut(text: &str) -> String {
    text.chars().take(40).collect()
}

/// Sends `request` on a connected stream (`Connection: close`) and reads the answer's head
/// (interim answers skipped). The caller bounds the time, as for [`post`].
pub fn send<S: Read + Write>(mut conn: S, request: &Request<'_>) -> Result<Exchange<S>, HttpError> {
    request.check()?;
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n",
        request.method, request.path
    );
    let bodiless = ["GET", "HEAD", "DELETE", "OPTIONS"]
        .iter()
        .any(|m| request.method.eq_ignore_ascii_case(m));
    if !request.body.is_empty() || !bodiless {
        head.push_str(&format!("Content-Length: {}\r\n", request.body.len()));
    }
    for (name, value) in request.headers {
        head.push_str(&format!("{name}: {}\r\n", value.trim()));
    }
    head.push_str("\r\n");
    let sent = conn
        .write_all(head.as_bytes())
        .and_then(|()| conn.write_all(request.body))
        .and_then(|()| conn.flush());
    let mut reader = BufReader::new(conn);
    match sent {
        Ok(()) => read_final_head(&mut reader).map(|head| Exchange { head, reader }),
        // The server may answer (413, 400 …) and close before reading the whole body.
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) =>
        {
            read_final_head(&mut reader)
                .map(|head| Exchange { head, reader })
                .map_err(|_| io_error(e))
        }
        Err(e) => Err(io_error(e)),
    }
}

/// An answer whose head is read; its body is still on the connection.
#[derive(Debug)]
pub struct Exchange<R> {
    head: ResponseHead,
    reader: BufReader<R>,
}

impl<R: Read> Exchange<R> {
    /// The answer's status and headers.
    pub fn head(&self) -> &ResponseHead {
        &self.head
    }

    /// Copies the body (de-chunked) to `sink` and returns its length. A body past `max`
    /// bytes is refused with [`HttpError::TooLarge`] as soon as that is known (at its
    /// length header, at the chunk that passes it, or at byte `max + 1`), after what came
    /// before was copied. A sink that refuses a write stops the copy:
    /// [`HttpError::Sink`] with its error (a sink that holds only the first bytes of a
    /// body ends the exchange early so).
    pub fn copy_body(mut self, sink: &mut dyn Write, max: usize) -> Result<u64, HttpError> {
        copy_body(&mut self.reader, &self.head, sink, max)
    }
}

fn check_path(path: &str) -> Result<(), HttpError> {
    if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(HttpError::Malformed("invalid request path"));
    }
    Ok(())
}

/// Sends `POST path` with a JSON body on a connected stream (`Accept: accept`,
/// `Connection: close`) and reads the whole response. The caller bounds the time (socket
/// timeouts, or a stream like [`UnixHttpClient`]'s that enforces a deadline).
pub fn post<S: Read + Write>(
    mut conn: S,
    path: &str,
    accept: &str,
    body: &[u8],
    max_body: usize,
) -> Result<Response, HttpError> {
    check_path(path)?;
    if accept.bytes().any(|b| b < b' ' || b == 0x7f) {
        return Err(HttpError::Malformed("invalid accept header"));
    }
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n\
         Accept: {accept}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let sent = conn
        .write_all(head.as_bytes())
        .and_then(|()| conn.write_all(body))
        .and_then(|()| conn.flush());
    match sent {
        Ok(()) => read_response(conn, max_body),
        // The server may answer (413, 400 …) and close before reading the whole body.
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) =>
        {
            read_response(conn, max_body).map_err(|_| io_error(e))
        }
        Err(e) => Err(io_error(e)),
    }
}

/// A unix stream whose every read and write gets the time left before the deadline of its
/// exchange ([`UnixHttpClient::request`]).
#[derive(Debug)]
pub struct Deadlined {
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

/// Appends one LF-terminated line (its terminator included) to `out`, counting it against
/// the `budget`. Only framing: what the line says is for `httparse` to judge.
fn read_line<R: BufRead>(
    reader: &mut R,
    out: &mut Vec<u8>,
    budget: &mut usize,
) -> Result<(), HttpError> {
    let limit = (*budget as u64).saturating_add(1);
    let n = reader
        .by_ref()
        .take(limit)
        .read_until(b'\n', out)
        .map_err(io_error)?;
    if n > *budget {
        return Err(HttpError::Malformed("response head too large"));
    }
    if n == 0 || !out.ends_with(b"\n") {
        return Err(HttpError::Malformed("connection closed early"));
    }
    *budget -= n;
    Ok(())
}

/// A response head: the status, the headers and how the body is framed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// The HTTP status code.
    pub status: u16,
    /// The headers in their order, names as sent, values trimmed (bytes that are not
    /// UTF-8 replaced).
    pub headers: Vec<(String, String)>,
    content_length: Option<usize>,
    chunked: bool,
}

impl ResponseHead {
    /// The value of the first header named `name` (in any letter case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body's length, when the head gives it (not chunked).
    pub fn content_length(&self) -> Option<usize> {
        self.content_length.filter(|_| !self.chunked)
    }
}

/// Reads heads until a final (non-1xx) one.
fn read_final_head<R: BufRead>(reader: &mut R) -> Result<ResponseHead, HttpError> {
    loop {
        let head = read_head(reader)?;
        // An interim answer (such as 100 Continue): the real one follows.
        if !(100..200).contains(&head.status) {
            return Ok(head);
        }
    }
}

/// Reads one response head (status line and headers, up to the empty line) and parses it
/// with `httparse`.
fn read_head<R: BufRead>(reader: &mut R) -> Result<ResponseHead, HttpError> {
    let mut raw = Vec::new();
    let mut budget = MAX_HEAD;
    loop {
        let start = raw.len();
        read_line(reader, &mut raw, &mut budget)?;
        let line = &raw[start..];
        if start > 0 && (line == b"\r\n" || line == b"\n") {
            break;
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    match response.parse(&raw) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err(HttpError::Malformed("incomplete response head"))
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HttpError::Malformed("too many headers"))
        }
        Err(httparse::Error::Version) => {
            return Err(HttpError::Malformed("not an http/1 status line"))
        }
        Err(httparse::Error::Status) => return Err(HttpError::Malformed("bad status code")),
        Err(_) => return Err(HttpError::Malformed("bad header line")),
    }
    let status = response
        .code
        .filter(|s| (100..600).contains(s))
        .ok_or(HttpError::Malformed("bad status code"))?;
    let mut content_length: Option<usize> = None;
    let mut chunked = false;
    let mut headers = Vec::with_capacity(response.headers.len());
    for header in response.headers.iter() {
        let framing = header.name.eq_ignore_ascii_case("content-length")
            || header.name.eq_ignore_ascii_case("transfer-encoding");
        let value = match std::str::from_utf8(header.value) {
            Ok(value) => value.trim().to_owned(),
            Err(_) if framing => return Err(HttpError::Malformed("non-utf8 response head")),
            Err(_) => String::from_utf8_lossy(header.value).trim().to_owned(),
        };
        headers.push((header.name.to_owned(), value));
        let value = headers[headers.len() - 1].1.as_str();
        if header.name.eq_ignore_ascii_case("content-length") {
            let n: usize = value
                .parse()
                .map_err(|_| HttpError::Malformed("bad content-length"))?;
            if content_length.is_some_and(|m| m != n) {
                return Err(HttpError::Malformed("conflicting content-length"));
            }
            content_length = Some(n);
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
            if !chunked {
                return Err(HttpError::Malformed("unsupported transfer-encoding"));
            }
        }
    }
    Ok(ResponseHead {
        status,
        headers,
        content_length,
        chunked,
    })
}

/// Parses a response from `reader`: status line, headers, then the body. Interim (1xx)
/// answers are skipped.
pub fn read_response<R: Read>(reader: R, max_body: usize) -> Result<Response, HttpError> {
    let mut reader = BufReader::new(reader);
    let head = read_final_head(&mut reader)?;
    let mut body = Vec::new();
    if let Some(n) = head.content_length() {
        if n > max_body {
            return Err(HttpError::TooLarge(max_body));
        }
        body.reserve_exact(n);
    }
    copy_body(&mut reader, &head, &mut body, max_body)?;
    Ok(Response {
        status: head.status,
        body,
    })
}

/// The piece of a body copied at once.
const COPY_PIECE: usize = 16 * 1024;

/// Copies the body that `head` frames from `reader` to `sink` (see [`Exchange::copy_body`]).
fn copy_body<R: BufRead>(
    reader: &mut R,
    head: &ResponseHead,
    sink: &mut dyn Write,
    max_body: usize,
) -> Result<u64, HttpError> {
    if head.chunked {
        copy_chunked(reader, sink, max_body)
    } else if let Some(n) = head.content_length {
        if n > max_body {
            return Err(HttpError::TooLarge(max_body));
        }
        copy_exact(reader, n, sink, "body shorter than content-length")?;
        Ok(n as u64)
    } else {
        // Up to the end of the connection.
        let mut total = 0usize;
        let mut piece = vec![0u8; COPY_PIECE];
        loop {
            let want = piece.len().min((max_body - total).saturating_add(1));
            let n = match reader.read(&mut piece[..want]) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error(e)),
            };
            if n == 0 {
                return Ok(total as u64);
            }
            let keep = n.min(max_body - total);
            sink.write_all(&piece[..keep]).map_err(HttpError::Sink)?;
            total += keep;
            if keep < n {
                return Err(HttpError::TooLarge(max_body));
            }
        }
    }
}

/// Copies exactly `n` bytes from `reader` to `sink`; fewer is `Malformed(short)`.
fn copy_exact<R: BufRead>(
    reader: &mut R,
    mut n: usize,
    sink: &mut dyn Write,
    short: &'static str,
) -> Result<(), HttpError> {
    while n > 0 {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(e)),
        };
        if buf.is_empty() {
            return Err(HttpError::Malformed(short));
        }
        let take = buf.len().min(n);
        sink.write_all(&buf[..take]).map_err(HttpError::Sink)?;
        reader.consume(take);
        n -= take;
    }
    Ok(())
}

fn copy_chunked<R: BufRead>(
    reader: &mut R,
    sink: &mut dyn Write,
    max_body: usize,
) -> Result<u64, HttpError> {
    let mut total = 0usize;
    loop {
        let mut line = Vec::new();
        read_line(reader, &mut line, &mut 1024)?;
        let size = match httparse::parse_chunk_size(&line) {
            Ok(httparse::Status::Complete((_, size))) => size,
            _ => return Err(HttpError::Malformed("bad chunk size")),
        };
        if size == 0 {
            // Trailers, up to the empty line.
            let mut budget = MAX_HEAD;
            loop {
                let mut trailer = Vec::new();
                read_line(reader, &mut trailer, &mut budget)?;
                if trailer == b"\r\n" || trailer == b"\n" {
                    return Ok(total as u64);
                }
            }
        }
        let room = max_body - total;
        let size = match usize::try_from(size) {
            Ok(size) if size <= room => size,
            _ => return Err(HttpError::TooLarge(max_body)),
        };
        copy_exact(reader, size, sink, "chunk shorter than its size")?;
        total += size;
        let mut end = Vec::new();
        read_line(reader, &mut end, &mut 2)?;
        if end != b"\r\n" && end != b"\n" {
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
    use std::os::unix::net::UnixListener;
    use std::thread;

    /// Serves one connection: reads the request head and body, answers `canned`,
    /// and hands the raw request back.
    fn serve_once(
        canned: &'static [u8],
    ) -> (PathBuf, thread::JoinHandle<Vec<u8>>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
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
            .post_json("/v1/tools/echo", br#"{"a":1}"#, Duration::from_secs(30))
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
    fn any_method_with_headers_and_the_answers_head() {
        let (path, server, _dir) = serve_once(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nX-Odd: caf\xe9\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        );
        let client = UnixHttpClient::new(&path, 1024);
        let headers = vec![
            ("Accept".to_owned(), "text/html".to_owned()),
            ("X-Tab".to_owned(), "a\tb ".to_owned()),
        ];
        let request = Request {
            method: "PUT",
            path: "/v1/egress/web/https/example.org/a?b=c",
            headers: &headers,
            body: b"hello",
        };
        let exchange = client.request(&request, Duration::from_secs(30)).unwrap();
        assert_eq!(exchange.head().status, 200);
        assert_eq!(
            exchange.head().header("content-type"),
            Some("text/html; charset=utf-8")
        );
        // A value that is not UTF-8 is kept, replaced; only the framing headers must be.
        assert_eq!(exchange.head().header("x-odd"), Some("caf\u{fffd}"));
        assert_eq!(exchange.head().content_length(), None);
        let mut body = Vec::new();
        assert_eq!(exchange.copy_body(&mut body, 1024).unwrap(), 5);
        assert_eq!(body, b"abcde");
        let request = String::from_utf8(server.join().unwrap()).unwrap();
        assert_eq!(
            request,
            "PUT /v1/egress/web/https/example.org/a?b=c HTTP/1.1\r\nHost: broker\r\n\
             Connection: close\r\nContent-Length: 5\r\nAccept: text/html\r\n\
             X-Tab: a\tb\r\n\r\nhello"
        );
    }

    #[test]
    fn a_get_without_a_body_has_no_length_and_bad_requests_are_not_sent() {
        let (path, server, _dir) =
            serve_once(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n");
        let client = UnixHttpClient::new(&path, 1024);
        let ok = Request {
            method: "GET",
            path: "/v1/egress/api/x",
            headers: &[],
            body: b"",
        };
        let exchange = client.request(&ok, Duration::from_secs(30)).unwrap();
        assert_eq!(exchange.head().status, 204);
        assert_eq!(exchange.head().content_length(), Some(0));
        let request = String::from_utf8(server.join().unwrap()).unwrap();
        assert!(
            !request.to_ascii_lowercase().contains("content-length"),
            "{request}"
        );

        let mut sink = io::Cursor::new(Vec::new());
        let bad = |method: &'static str, name: &str, value: &str| {
            let headers = vec![(name.to_owned(), value.to_owned())];
            let request = Request {
                method,
                path: "/v1/x",
                headers: &headers,
                body: b"",
            };
            request.check().unwrap_err().to_string()
        };
        assert_eq!(
            bad("GE T", "A", "b"),
            "invalid request: the method is not an http token"
        );
        assert_eq!(
            bad("GET", "Content-Length", "1"),
            "invalid request: header Content-Length is set by the client itself"
        );
        assert_eq!(
            bad("GET", "HOST", "evil"),
            "invalid request: header HOST is set by the client itself"
        );
        assert_eq!(
            bad("GET", "X-A", "b\r\nX-Injected: 1"),
            "invalid request: the value of header X-A has a control character"
        );
        assert_eq!(
            bad("GET", "X A", "b"),
            "invalid request: header name \"X A\" is not an http token"
        );
        let headers = vec![("X-A".to_owned(), "b\nc".to_owned())];
        let request = Request {
            method: "GET",
            path: "/v1/x",
            headers: &headers,
            body: b"",
        };
        assert!(send(&mut sink, &request).is_err());
        assert!(sink.get_ref().is_empty());
    }

    /// A sink that keeps the first `n` bytes and refuses the rest.
    struct FirstBytes(Vec<u8>, usize);

    impl Write for FirstBytes {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let room = self.1 - self.0.len();
            if room == 0 {
                return Err(io::Error::other("full"));
            }
            let n = buf.len().min(room);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_body_is_copied_within_its_cap_and_a_sink_can_stop_it() {
        let framings: [&[u8]; 3] = [
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n0123\r\n6\r\n456789\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n0123456789",
        ];
        for input in framings {
            let exchange = send(Duplex(io::Cursor::new(input)), &get()).unwrap();
            let mut whole = Vec::new();
            assert_eq!(exchange.copy_body(&mut whole, 10).unwrap(), 10);
            assert_eq!(whole, b"0123456789");

            let exchange = send(Duplex(io::Cursor::new(input)), &get()).unwrap();
            let mut first = FirstBytes(Vec::new(), 5);
            let err = exchange.copy_body(&mut first, 1 << 20).unwrap_err();
            assert!(matches!(err, HttpError::Sink(_)), "{err:?}");
            assert_eq!(first.0, b"01234");

            let exchange = send(Duplex(io::Cursor::new(input)), &get()).unwrap();
            let mut capped = Vec::new();
            let err = exchange.copy_body(&mut capped, 9).unwrap_err();
            assert!(matches!(err, HttpError::TooLarge(9)), "{err:?}");
            assert!(capped.len() <= 9);
        }
    }

    fn get() -> Request<'static> {
        Request {
            method: "GET",
            path: "/v1/x",
            headers: &[],
            body: b"",
        }
    }

    /// Reads canned bytes, swallows writes.
    struct Duplex<R>(R);

    impl<R: Read> Read for Duplex<R> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl<R> Write for Duplex<R> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn chunked_response_over_a_real_socket() {
        let (path, server, _dir) = serve_once(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\n{\"err\r\n9\r\nor\":\"no\"}\r\n0\r\nX-Trailer: 1\r\n\r\n",
        );
        let client = UnixHttpClient::new(&path, 1024);
        let response = client
            .post_json("/v1/chat/completions", b"{}", Duration::from_secs(30))
            .unwrap();
        assert_eq!(response.status, 400);
        assert_eq!(response.body, br#"{"error":"no"}"#);
        server.join().unwrap();
    }

    #[test]
    fn oversized_and_malformed_responses_are_errors() {
        let too_large: [&[u8]; 4] = [
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nff\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n0123456789abcdef",
        ];
        for input in too_large {
            assert!(
                matches!(read_response(input, 10), Err(HttpError::TooLarge(10))),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
        let cases: [(&[u8], &str); 9] = [
            (
                b"garbage\r\n\r\n",
                "malformed broker response: not an http/1 status line",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab",
                "malformed broker response: body shorter than content-length",
            ),
            (
                b"HTTP/1.1 20x OK\r\n\r\n",
                "malformed broker response: bad status code",
            ),
            (
                b"HTTP/1.1 700 Odd\r\n\r\n",
                "malformed broker response: bad status code",
            ),
            (
                b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
                "malformed broker response: bad header line",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                "malformed broker response: conflicting content-length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                "malformed broker response: unsupported transfer-encoding",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                "malformed broker response: bad chunk size",
            ),
            (
                b"HTTP/1.1 200 OK\r\n",
                "malformed broker response: connection closed early",
            ),
        ];
        for (input, message) in cases {
            let err = read_response(input, 10).unwrap_err();
            assert_eq!(
                err.to_string(),
                message,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
        let many = format!(
            "HTTP/1.1 200 OK\r\n{}\r\n",
            "X-A: 1\r\n".repeat(MAX_HEADERS + 1)
        );
        assert_eq!(
            read_response(many.as_bytes(), 10).unwrap_err().to_string(),
            "malformed broker response: too many headers"
        );
        let long = format!("HTTP/1.1 200 OK\r\nX-A: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(
            read_response(long.as_bytes(), 10).unwrap_err().to_string(),
            "malformed broker response: response head too large"
        );
        let ok = read_response(&b"HTTP/1.1 204 No Content\r\n\r\n"[..], 10).unwrap();
        assert_eq!(ok.status, 204);
        assert!(ok.body.is_empty());
        // HTTP/1.0 and a missing reason phrase are still answers.
        let ok = read_response(&b"HTTP/1.0 200\r\nContent-Length: 2\r\n\r\nhi"[..], 10).unwrap();
        assert_eq!((ok.status, ok.body.as_slice()), (200, &b"hi"[..]));
    }

    #[test]
    fn an_early_answer_to_an_unread_body_is_still_read() {
        let dir = tempfile::tempdir().unwrap();
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
            .post_json("/v1/tools/x", &body, Duration::from_secs(30))
            .unwrap();
        assert_eq!(response.status, 413);
        assert_eq!(response.body, br#"{"error":"body too big"}"#);
        server.join().unwrap();
    }

    #[test]
    fn a_silent_server_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slow.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            // Silent until the client has given up (however long a busy machine takes).
            let _ = wait.recv();
            drop(stream);
        });
        let client = UnixHttpClient::new(&path, 1024);
        let err = client
            .post_json("/v1/tools/x", b"{}", Duration::from_millis(200))
            .unwrap_err();
        assert!(matches!(err, HttpError::Timeout), "{err:?}");
        done.send(()).unwrap();
        server.join().unwrap();
    }

    #[test]
    fn bad_paths_and_headers_are_refused_before_sending() {
        let mut sink = io::Cursor::new(Vec::new());
        for path in ["v1/x", "/v1/a b", "/v1/\r\nX: y"] {
            let err = post(&mut sink, path, "application/json", b"{}", 10).unwrap_err();
            assert_eq!(
                err.to_string(),
                "malformed broker response: invalid request path"
            );
        }
        let err = post(&mut sink, "/v1/x", "a\r\nX: y", b"{}", 10).unwrap_err();
        assert_eq!(
            err.to_string(),
            "malformed broker response: invalid accept header"
        );
        assert!(sink.get_ref().is_empty());
    }

    /// A reader that hands out at most `step` bytes per read, as a slow socket does.
    struct Trickle<'a>(&'a [u8], usize);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(self.1);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    fn summary(r: Result<Response, HttpError>) -> Result<(u16, Vec<u8>), String> {
        r.map(|r| (r.status, r.body)).map_err(|e| e.to_string())
    }

    /// Response-like inputs: a valid head and body, cut and with bytes flipped.
    fn responses() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let status = prop_oneof![Just(100u16), Just(200), Just(204), Just(413), 0u16..1000];
        let body = proptest::collection::vec(any::<u8>(), 0..64);
        (
            status,
            body,
            any::<bool>(),
            0usize..200,
            any::<(usize, u8)>(),
        )
            .prop_map(|(status, body, chunked, cut, (at, byte))| {
                let mut out = format!("HTTP/1.1 {status} X\r\n").into_bytes();
                if chunked {
                    out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                    out.extend_from_slice(format!("{:x}\r\n", body.len()).as_bytes());
                    out.extend_from_slice(&body);
                    out.extend_from_slice(b"\r\n0\r\n\r\n");
                } else {
                    out.extend_from_slice(
                        format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes(),
                    );
                    out.extend_from_slice(&body);
                }
                if cut > 0 && cut < out.len() {
                    out.truncate(out.len() - cut % out.len());
                }
                if !out.is_empty() {
                    let i = at % out.len();
                    out[i] = byte;
                }
                out
            })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 512,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// The oracle of the `http_response` fuzz target: never a panic, a body within the
        /// cap, a final status, and the same answer however the bytes are split.
        #[test]
        fn any_bytes_give_the_same_answer_in_any_chunking(
            input in proptest::prop_oneof![responses(), proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)],
            step in 1usize..8,
        ) {
            let whole = summary(read_response(&input[..], 32));
            if let Ok((status, body)) = &whole {
                proptest::prop_assert!(body.len() <= 32);
                proptest::prop_assert!((200..600).contains(status));
            }
            proptest::prop_assert_eq!(&whole, &summary(read_response(Trickle(&input, step), 32)));
        }
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
