//! Removing the key from what flows back to the guest.
//!
//! - [`redact`]: one whole buffer or string;
//! - [`Redactor`]: a byte stream, chunk by chunk. A key split across chunk boundaries is
//!   still found: only the longest tail of a chunk that could begin the key is held back
//!   until the next chunk (so an SSE event, which ends in a newline, is never delayed).

/// What replaces the key.
pub(crate) const REDACTED: &str = "[redacted]";

/// `text` with every occurrence of `key` replaced (no-op for an empty key).
pub(crate) fn redact(text: &str, key: Option<&str>) -> String {
    match key {
        Some(k) if !k.is_empty() => text.replace(k, REDACTED),
        _ => text.to_owned(),
    }
}

/// Streams bytes through, replacing every occurrence of the key.
pub(crate) struct Redactor {
    key: Vec<u8>,
    pending: Vec<u8>,
}

impl Redactor {
    /// A redactor for `key`; `None` or empty passes everything through.
    pub(crate) fn new(key: Option<&str>) -> Self {
        Self {
            key: key.unwrap_or_default().as_bytes().to_vec(),
            pending: Vec::new(),
        }
    }

    /// Takes one chunk; returns what can be sent now.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.key.is_empty() {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        let key = &self.key;
        let mut out = Vec::with_capacity(self.pending.len());
        let mut i = 0;
        while let Some(pos) = find(&self.pending[i..], key) {
            out.extend_from_slice(&self.pending[i..i + pos]);
            out.extend_from_slice(REDACTED.as_bytes());
            i += pos + key.len();
        }
        // Hold back only the longest tail that is a proper prefix of the key.
        let rest = &self.pending[i..];
        let hold = (1..key.len().min(rest.len() + 1))
            .rev()
            .find(|&n| rest.ends_with(&key[..n]))
            .unwrap_or(0);
        out.extend_from_slice(&rest[..rest.len() - hold]);
        let keep_from = self.pending.len() - hold;
        self.pending.drain(..keep_from);
        out
    }

    /// The held-back tail, at the end of the stream (it cannot be a whole key).
    pub(crate) fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(key: &str, chunks: &[&str]) -> (String, Vec<String>) {
        let mut r = Redactor::new(Some(key));
        let mut parts = Vec::new();
        for c in chunks {
            parts.push(String::from_utf8(r.push(c.as_bytes())).unwrap());
        }
        parts.push(String::from_utf8(r.finish()).unwrap());
        (parts.concat(), parts)
    }

    #[test]
    fn whole_and_split_keys_are_redacted() {
        let key = "sk-secret-123";
        assert_eq!(run(key, &["a sk-secret-123 b"]).0, "a [redacted] b");
        for split in 1..key.len() {
            let first = format!("x{}", &key[..split]);
            let second = format!("{}y", &key[split..]);
            let (all, _) = run(key, &[&first, &second]);
            assert_eq!(all, "x[redacted]y", "split at {split}");
        }
        let (all, _) = run(
            key,
            &[
                "s",
                "k",
                "-",
                "secret-1",
                "23",
                "sk-secret-123sk-secret-123",
            ],
        );
        assert_eq!(all, "[redacted][redacted][redacted]");
    }

    #[test]
    fn text_that_cannot_start_the_key_is_not_held_back() {
        let (_, parts) = run("sk-secret", &["data: {\"a\":1}\n\n", "data: [DONE]\n\n"]);
        assert_eq!(parts[0], "data: {\"a\":1}\n\n");
        assert_eq!(parts[1], "data: [DONE]\n\n");
        let (all, parts) = run("sk-secret", &["abc s", "k-nope"]);
        assert_eq!(parts[0], "abc ");
        assert_eq!(all, "abc sk-nope");
    }

    #[test]
    fn no_key_passes_through() {
        let mut r = Redactor::new(None);
        assert_eq!(r.push(b"abc"), b"abc");
        assert_eq!(redact("abc", Some("")), "abc");
    }
}
