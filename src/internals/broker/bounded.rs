//! The one bounded reader: every answer from outside (the model's, the compactor's, an MCP
//! server's over stdio or streamable HTTP, and an egress route's) is read through it, so no
//! door out of the host has caps of its own.
//!
//! - [`Caps`]: the bytes of one message and the JSON values it may hold;
//! - [`read_body`]: a whole HTTP body, refused at its length header or at the byte cap
//!   (the rest is never read);
//! - [`read_request`]: a guest's request body, the one reader the other way: into one
//!   buffer, at the byte cap;
//! - [`Lines`]: newline-delimited messages cut from a byte stream, each held to the byte
//!   cap: a line that never ends fails at the cap, not at the end of memory;
//! - [`SseEvents`]: the `data` of server-sent events cut from a byte stream, each held to
//!   the byte cap (built on [`Lines`]);
//! - [`check`]: the bytes and the JSON values counted (an upper bound, no tree built)
//!   before the caller parses the message into its typed shape (which keeps only what the
//!   broker forwards); [`off_thread`] runs both on a blocking thread: a hostile answer
//!   costs a blocking thread its CPU, never a runtime thread, so timers (a call's
//!   deadline, the turn's) and other channels' turns go on while it is read.

/// The caps on one message from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// Its bytes at most.
    pub(crate) bytes: usize,
    /// The JSON values it may hold at most (counted before it is parsed).
    pub(crate) values: usize,
}

/// The most JSON values a message parsed into a tree may hold (tool arguments, compaction
/// requests; an MCP message, of which no tree is built past its envelope), an object
/// counting as [`OBJECT_WEIGHT`] values: parsed, a value costs ~32 bytes and an object of
/// one member more, a map node of ~630 bytes, so this many are ~5 MiB at most (counted one
/// each, 32,767 `{"":0}` objects, 229 KB of a guest's tool arguments, were a ~21 MB tree:
/// four calls in flight past the host's 64 MiB).
pub(crate) const MAX_VALUES: usize = 65_536;

/// What an object counts as in [`values_over`]: itself, and its map node's cost.
pub(crate) const OBJECT_WEIGHT: usize = 9;

impl Caps {
    /// `bytes` and [`MAX_VALUES`].
    pub(crate) const fn bytes(bytes: usize) -> Self {
        Self {
            bytes,
            values: MAX_VALUES,
        }
    }
}

/// Why an answer was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ReadError {
    /// It is longer than the byte cap (the rest was not read).
    #[error("larger than {cap} bytes")]
    TooLarge {
        /// The cap.
        cap: usize,
    },
    /// It holds more JSON values than the cap (it was not parsed).
    #[error("of more than {cap} JSON values")]
    TooManyValues {
        /// The cap.
        cap: usize,
    },
    /// It is not the JSON shape expected.
    #[error("not {what}: {detail}")]
    Shape {
        /// The shape expected.
        what: &'static str,
        /// The parser's message, up to the first value it quotes, and the position
        /// (never the answer's text).
        detail: String,
    },
    /// The transport failed while it was read.
    #[error("read failed: {0}")]
    Transport(String),
}

/// Reads a whole HTTP body: refused at once when its `content-length` is past `cap`, and
/// at the first chunk that passes it otherwise (the rest is never read).
pub(crate) async fn read_body(
    response: &mut reqwest::Response,
    cap: usize,
) -> Result<Vec<u8>, ReadError> {
    if response.content_length().is_some_and(|n| n > cap as u64) {
        return Err(ReadError::TooLarge { cap });
    }
    let mut out = Vec::new();
    loop {
        let chunk = response
            .chunk()
            .await
            .map_err(|e| ReadError::Transport(e.without_url().to_string()))?;
        let Some(chunk) = chunk else { return Ok(out) };
        if out.len() + chunk.len() > cap {
            return Err(ReadError::TooLarge { cap });
        }
        out.extend_from_slice(&chunk);
    }
}

/// Why a guest's request body was not read.
#[derive(Debug)]
pub(crate) enum RequestBody {
    /// Past the cap.
    TooLarge,
    /// The connection failed or broke HTTP's framing.
    Unreadable,
}

/// Reads a guest's request body into one buffer, frame by frame, at most `cap` bytes. No
/// frame is kept: 1 MiB sent as one-byte chunks, collected, was a million frames, each
/// pinning a piece of hyper's read buffer (~40 MiB of host memory per call).
pub(crate) async fn read_request(
    mut body: hyper::body::Incoming,
    cap: usize,
) -> Result<Vec<u8>, RequestBody> {
    use http_body_util::BodyExt as _;
    use hyper::body::Body as _;
    let declared = body.size_hint().exact().unwrap_or(0);
    let mut buf = Vec::with_capacity(usize::try_from(declared).unwrap_or(cap).min(cap));
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(|_| RequestBody::Unreadable)?.into_data() else {
            continue;
        };
        if buf.len() + data.len() > cap {
            return Err(RequestBody::TooLarge);
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf)
}

/// Reads at most `cap` bytes of a body; `true` beside them when there was more (an error
/// body is shown cut, not refused).
pub(crate) async fn read_prefix(
    response: &mut reqwest::Response,
    cap: usize,
) -> Result<(Vec<u8>, bool), ReadError> {
    let mut out = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| ReadError::Transport(e.without_url().to_string()))?
    {
        if out.len() + chunk.len() > cap {
            out.extend_from_slice(&chunk[..cap - out.len()]);
            return Ok((out, true));
        }
        out.extend_from_slice(&chunk);
    }
    Ok((out, false))
}

/// Newline-delimited messages cut from a byte stream as it arrives, each at most `cap`
/// bytes (its `\n`, and a `\r` before it, not counted or kept). Blank lines are skipped.
#[derive(Debug)]
pub(crate) struct Lines {
    cap: usize,
    /// The current line's bytes so far.
    line: Vec<u8>,
}

impl Lines {
    /// Lines of at most `cap` bytes.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            cap,
            line: Vec::new(),
        }
    }

    /// The lines `chunk` completes, in order; [`ReadError::TooLarge`] as soon as the
    /// current line passes the cap (the stream cannot be read on: the caller ends it).
    pub(crate) fn push(&mut self, mut chunk: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        let mut out = Vec::new();
        while let Some(end) = memchr::memchr(b'\n', chunk) {
            let (head, rest) = chunk.split_at(end);
            self.extend(head)?;
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if line.len() > self.cap {
                return Err(ReadError::TooLarge { cap: self.cap });
            }
            out.push(line);
            chunk = &rest[1..];
        }
        self.extend(chunk)?;
        out.retain(|l| !l.iter().all(u8::is_ascii_whitespace));
        Ok(out)
    }

    /// Whatever is left when the stream ends (a last line without its newline).
    pub(crate) fn finish(&mut self) -> Option<Vec<u8>> {
        let line = std::mem::take(&mut self.line);
        (!line.iter().all(u8::is_ascii_whitespace)).then_some(line)
    }

    fn extend(&mut self, bytes: &[u8]) -> Result<(), ReadError> {
        // Only the `\r` of a `\r\n` may be the one byte past the cap.
        let len = self.line.len() + bytes.len();
        let last = bytes.last().or(self.line.last());
        if len > self.cap.saturating_add(1) || (len > self.cap && last != Some(&b'\r')) {
            self.line = Vec::new();
            return Err(ReadError::TooLarge { cap: self.cap });
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }
}

/// The `data` of each server-sent event cut from a byte stream (its `data:` lines joined
/// with `\n`), each at most `cap` bytes; events with no data (comments, keep-alives) are
/// skipped, and an event named anything but `message` is dropped.
#[derive(Debug)]
pub(crate) struct SseEvents {
    lines: Lines,
    cap: usize,
    data: Vec<u8>,
    has_data: bool,
    named_other: bool,
}

impl SseEvents {
    /// Events of at most `cap` bytes of data.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            // A line holds at most the data and its field name.
            lines: Lines::new(cap.saturating_add(16)),
            cap,
            data: Vec::new(),
            has_data: false,
            named_other: false,
        }
    }

    /// The events `chunk` completes, in order.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        // A line past its cap is an event past the data's.
        self.push_lines(chunk)
            .map_err(|_| ReadError::TooLarge { cap: self.cap })
    }

    fn push_lines(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        // Blank lines end events, so they are found here, not skipped by `Lines`.
        let mut out = Vec::new();
        let mut start = 0;
        for (i, &b) in chunk.iter().enumerate() {
            if b != b'\n' {
                continue;
            }
            let lines = self.lines.push(&chunk[start..=i])?;
            start = i + 1;
            match lines.into_iter().next() {
                Some(line) => self.field(&line)?,
                None => {
                    if let Some(event) = self.end_event() {
                        out.push(event);
                    }
                }
            }
        }
        for line in self.lines.push(&chunk[start..])? {
            self.field(&line)?;
        }
        Ok(out)
    }

    /// The event left open when the stream ends, if it has data.
    pub(crate) fn finish(&mut self) -> Option<Vec<u8>> {
        if let Some(line) = self.lines.finish() {
            self.field(&line).ok()?;
        }
        self.end_event()
    }

    fn field(&mut self, line: &[u8]) -> Result<(), ReadError> {
        let (name, value) = match memchr::memchr(b':', line) {
            Some(0) => return Ok(()),
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        match name {
            b"data" => {
                let extra = usize::from(self.has_data);
                if self.data.len() + extra + value.len() > self.cap {
                    self.data = Vec::new();
                    return Err(ReadError::TooLarge { cap: self.cap });
                }
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            b"event" => self.named_other = value != b"message",
            _ => {}
        }
        Ok(())
    }

    fn end_event(&mut self) -> Option<Vec<u8>> {
        let data = std::mem::take(&mut self.data);
        let (has, other) = (self.has_data, self.named_other);
        self.has_data = false;
        self.named_other = false;
        (has && !other).then_some(data)
    }
}

/// An upper bound of the JSON values in `raw`: one per `[` and `,` outside strings and
/// [`OBJECT_WEIGHT`] per `{`, plus one. Stops counting past `limit`.
pub(crate) fn values_over(raw: &[u8], limit: usize) -> bool {
    let mut n = 1usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in raw {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'[' | b'{' | b',' => {
                    n += if b == b'{' { OBJECT_WEIGHT } else { 1 };
                    if n > limit {
                        return true;
                    }
                }
                _ => {}
            }
        }
    }
    false
}

/// Runs `work` (a read, a redaction) on a blocking thread, where what it owns is dropped.
pub(crate) async fn off_thread<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(work).await {
        Ok(out) => out,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled: the runtime is shutting down, and this caller with it.
        Err(_) => std::future::pending().await,
    }
}

/// The caps' check of a message: its bytes, then its values (an upper bound, counted
/// without a parse).
pub(crate) fn check(bytes: &[u8], caps: Caps) -> Result<(), ReadError> {
    if bytes.len() > caps.bytes {
        return Err(ReadError::TooLarge { cap: caps.bytes });
    }
    if values_over(bytes, caps.values) {
        return Err(ReadError::TooManyValues { cap: caps.values });
    }
    Ok(())
}

/// A parse error as a [`ReadError::Shape`] of `what`: serde's message up to the first
/// value it quotes (`invalid type: string "…"`, `unknown variant `…``: the answer's own
/// text, a whole 15 MB string at worst), then the position.
pub(crate) fn shape(what: &'static str, e: &serde_json::Error) -> ReadError {
    let message = e.to_string();
    let kind = message
        .split(['"', '`'])
        .next()
        .unwrap_or_default()
        .split(" at line ")
        .next()
        .unwrap_or_default()
        .trim();
    let kind: String = kind.chars().take(120).collect();
    let quoted = if message.contains(['"', '`']) {
        " …"
    } else {
        ""
    };
    ReadError::Shape {
        what,
        detail: format!("{kind}{quoted} at line {} column {}", e.line(), e.column()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_cut_at_newlines_whatever_the_chunks() {
        let input = b"{\"a\":1}\r\n\n{\"b\":2}\n{\"c\"";
        for split in 0..input.len() {
            let mut lines = Lines::new(16);
            let (a, b) = input.split_at(split);
            let mut got = lines.push(a).unwrap();
            got.extend(lines.push(b).unwrap());
            assert_eq!(got, vec![b"{\"a\":1}".to_vec(), b"{\"b\":2}".to_vec()]);
            assert_eq!(lines.finish(), Some(b"{\"c\"".to_vec()));
        }
    }

    #[test]
    fn a_line_past_the_cap_fails_at_the_cap_without_a_newline() {
        let mut lines = Lines::new(8);
        assert_eq!(lines.push(b"12345678").unwrap(), Vec::<Vec<u8>>::new());
        assert_eq!(lines.push(b"9"), Err(ReadError::TooLarge { cap: 8 }));
        // Exactly the cap, with its \r\n, is a line.
        let mut lines = Lines::new(8);
        assert_eq!(
            lines.push(b"12345678\r\n").unwrap(),
            vec![b"12345678".to_vec()]
        );
        // The cap is checked before the bytes are kept: a huge chunk is not copied.
        let mut lines = Lines::new(8);
        assert!(lines.push(&[b'x'; 1 << 20]).is_err());
        assert!(lines.line.capacity() < 1 << 20);
    }

    #[test]
    fn sse_events_join_data_lines_and_skip_comments_and_other_events() {
        let input = b": keep-alive\n\nevent: message\ndata: {\"a\":\ndata: 1}\n\nevent: ping\ndata: x\n\ndata: last\n";
        for split in 0..input.len() {
            let mut sse = SseEvents::new(64);
            let (a, b) = input.split_at(split);
            let mut got = sse.push(a).unwrap();
            got.extend(sse.push(b).unwrap());
            assert_eq!(got, vec![b"{\"a\":\n1}".to_vec()], "split at {split}");
            assert_eq!(sse.finish(), Some(b"last".to_vec()));
        }
        let mut sse = SseEvents::new(8);
        assert_eq!(
            sse.push(b"data: 12345\ndata: 123\n"),
            Err(ReadError::TooLarge { cap: 8 })
        );
    }

    #[test]
    fn values_are_counted_before_the_parse() {
        let many = format!("[{}]", vec!["[]"; 100].join(","));
        // 1 + `[` + 100 `[` + 99 `,`: about twice the values, never fewer.
        assert!(values_over(many.as_bytes(), 200));
        assert!(!values_over(many.as_bytes(), 201));
        // An object counts as 9 (its map node): 1 + `[` + 100 × 9 + 99 `,`.
        let objects = format!("[{}]", vec![r#"{"":0}"#; 100].join(","));
        assert!(values_over(objects.as_bytes(), 1000));
        assert!(!values_over(objects.as_bytes(), 1001));
        // Brackets and commas inside strings are not values.
        assert!(!values_over(br#"["[[[,,,{{{\"[", 1]"#, 3));
        let caps = Caps {
            bytes: 1 << 20,
            values: 100,
        };
        assert_eq!(
            check(many.as_bytes(), caps),
            Err(ReadError::TooManyValues { cap: 100 })
        );
        assert_eq!(
            check(many.as_bytes(), Caps::bytes(10)),
            Err(ReadError::TooLarge { cap: 10 })
        );
        assert_eq!(check(b"[{},{}]", caps), Ok(()));
    }
}
