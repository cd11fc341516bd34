//! Removing declared secrets (the model key, host tools' and MCP servers' credentials) from
//! what flows back to the guest.
//!
//! - [`Secrets`]: the set of secrets to remove, longest first;
//! - [`Secrets::redact`]: one whole string;
//! - [`Redactor`]: a byte stream, chunk by chunk. A secret split across chunk boundaries is
//!   still found: only the longest tail of a chunk that could begin a secret is held back
//!   until the next chunk (so an SSE event, which ends in a newline, is never delayed).
//!   At the end of a stream a held tail is sent as [`REDACTED`] ([`Redactor::finish`]);
//!   on every error path it is dropped ([`Redactor::abandon`]): it may be a piece of a
//!   secret, and no piece of one ever leaves.

use std::sync::Mutex;

use memchr::memmem;

use super::BrokerPolicy;

/// A broker's secrets, built once from its policy ([`BrokerPolicy::secret_strings`]) and
/// built again only when a key provider (the model's or the summarizer's) has handed out a
/// key it had not seen: every model call, tool result and summary takes the set as it is.
pub(crate) struct SecretSet {
    built: Mutex<(u64, Secrets)>,
    /// Secrets beyond the policy's own (the egress routes' credentials).
    extra: Vec<String>,
}

impl SecretSet {
    /// The set of `policy` as it is now, with `extra`.
    pub(crate) fn new(policy: &BrokerPolicy, extra: Vec<String>) -> Self {
        let built = Secrets::new(
            policy
                .secret_strings()
                .into_iter()
                .chain(extra.iter().cloned()),
        );
        Self {
            built: Mutex::new((generation(policy), built)),
            extra,
        }
    }

    /// The secrets to redact now (a provider's new keys included).
    pub(crate) fn get(&self, policy: &BrokerPolicy) -> Secrets {
        let now = generation(policy);
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        if built.0 != now {
            let all = policy
                .secret_strings()
                .into_iter()
                .chain(self.extra.iter().cloned());
            *built = (now, Secrets::new(all));
        }
        built.1.clone()
    }
}

/// How many keys the policy's providers have handed out so far.
fn generation(policy: &BrokerPolicy) -> u64 {
    let summarizer = policy
        .compaction
        .as_ref()
        .map_or(0, |c| c.api_key.generation());
    policy.api_key.generation().wrapping_add(summarizer)
}

/// What replaces a secret.
pub(crate) const REDACTED: &str = "[redacted]";

/// Secrets to redact; empty ones are ignored. Cheap to clone (shared).
#[derive(Clone, Default)]
pub(crate) struct Secrets {
    list: std::sync::Arc<[Vec<u8>]>,
    /// All of them in one automaton (leftmost, then longest): a text is searched once
    /// however many secrets there are and however often a short one occurs (searched one
    /// secret at a time, a short one met m times cost m passes over the rest of the text).
    finder: Option<std::sync::Arc<aho_corasick::AhoCorasick>>,
}

impl Secrets {
    /// The non-empty, distinct secrets, longest first (a secret that contains another is
    /// replaced whole).
    pub(crate) fn new(secrets: impl IntoIterator<Item = String>) -> Self {
        let mut v: Vec<Vec<u8>> = secrets
            .into_iter()
            .filter(|s| !s.is_empty())
            .map(String::into_bytes)
            .collect();
        v.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        v.dedup();
        // (Built only past its own size limits, which no configured set reaches: then
        // each secret is searched in turn.)
        let finder = (!v.is_empty())
            .then(|| {
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(&v)
                    .ok()
            })
            .flatten()
            .map(std::sync::Arc::new);
        Self {
            list: v.into(),
            finder,
        }
    }

    /// The length of the longest secret (0 for none).
    pub(crate) fn longest(&self) -> usize {
        self.list.first().map_or(0, Vec::len)
    }

    fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The earliest occurrence of any secret in `hay`: (position, length); at one position
    /// the longest secret wins.
    fn find(&self, hay: &[u8]) -> Option<(usize, usize)> {
        if let Some(finder) = &self.finder {
            return finder.find(hay).map(|m| (m.start(), m.len()));
        }
        let mut best: Option<(usize, usize)> = None;
        for s in self.list.iter() {
            let limit = best.map_or(hay.len(), |(p, _)| (p + s.len()).min(hay.len()));
            if let Some(pos) = memmem::find(&hay[..limit], s) {
                if best.is_none_or(|(p, _)| pos < p) {
                    best = Some((pos, s.len()));
                }
            }
        }
        best
    }

    /// `bytes` with every secret replaced; borrowed when there is none.
    pub(crate) fn redact_bytes<'a>(&self, bytes: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        let Some((first, _)) = self.find(bytes) else {
            return std::borrow::Cow::Borrowed(bytes);
        };
        let mut out = Vec::with_capacity(bytes.len());
        out.extend_from_slice(&bytes[..first]);
        let mut i = first;
        while let Some((pos, len)) = self.find(&bytes[i..]) {
            out.extend_from_slice(&bytes[i..i + pos]);
            out.extend_from_slice(REDACTED.as_bytes());
            i += pos + len;
        }
        out.extend_from_slice(&bytes[i..]);
        std::borrow::Cow::Owned(out)
    }

    /// `text` with every secret replaced.
    pub(crate) fn redact(&self, text: &str) -> String {
        match self.redact_bytes(text.as_bytes()) {
            std::borrow::Cow::Borrowed(_) => text.to_owned(),
            // Secrets are whole strings and the replacement is ASCII: still UTF-8.
            std::borrow::Cow::Owned(v) => String::from_utf8_lossy(&v).into_owned(),
        }
    }

    /// The first `max_chars` characters of `text` with every secret replaced: redacted
    /// before it is cut, and a tail that may be the start of a secret dropped with the cut
    /// (no piece of one is shown).
    pub(crate) fn redact_cut(&self, text: &str, max_chars: usize) -> String {
        // Any secret that starts in the first `max_chars` characters ends in `head`.
        let head_end = text
            .char_indices()
            .nth(max_chars.saturating_add(self.longest()))
            .map_or(text.len(), |(i, _)| i);
        self.redact_prefix(&text[..head_end], head_end < text.len())
            .chars()
            .take(max_chars)
            .collect()
    }

    /// `text` with every secret replaced; when it was `cut` from a longer text, a tail that
    /// may be the start of a secret goes with the cut (no piece of one is shown).
    pub(crate) fn redact_prefix(&self, text: &str, cut: bool) -> String {
        if !cut {
            return self.redact(text);
        }
        let mut redactor = Redactor::new(self.clone());
        let clean = redactor.push(text.as_bytes());
        redactor.abandon();
        String::from_utf8_lossy(&clean).into_owned()
    }

    /// Whether a secret, or the start of one at the end, is in `bytes`.
    pub(crate) fn could_occur(&self, bytes: &[u8]) -> bool {
        self.find(bytes).is_some() || self.held_tail(bytes) > 0
    }

    /// Whether `tail` is a proper prefix of some secret.
    fn could_grow(&self, tail: &[u8]) -> bool {
        self.list
            .iter()
            .any(|s| s.len() > tail.len() && s.starts_with(tail))
    }

    /// The length of the longest tail of `bytes` that is a proper prefix of a secret.
    fn held_tail(&self, bytes: &[u8]) -> usize {
        let mut hold = 0;
        for s in self.list.iter() {
            let max = (s.len() - 1).min(bytes.len());
            if let Some(n) = (hold + 1..=max).rev().find(|&n| bytes.ends_with(&s[..n])) {
                hold = n;
            }
        }
        hold
    }
}

/// Streams bytes through, replacing every secret.
pub(crate) struct Redactor {
    secrets: Secrets,
    pending: Vec<u8>,
}

impl Redactor {
    /// A redactor for `secrets` (none: everything passes through).
    pub(crate) fn new(secrets: Secrets) -> Self {
        Self {
            secrets,
            pending: Vec::new(),
        }
    }

    /// Takes one chunk; returns what can be sent now.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.secrets.is_empty() {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut i = 0;
        let mut hold_from = None;
        while let Some((pos, len)) = self.secrets.find(&self.pending[i..]) {
            let at = i + pos;
            if self.secrets.could_grow(&self.pending[at..]) {
                // A longer secret may begin here and end in the next chunk.
                hold_from = Some(at);
                break;
            }
            out.extend_from_slice(&self.pending[i..at]);
            out.extend_from_slice(REDACTED.as_bytes());
            i = at + len;
        }
        // Hold back only the longest tail that is a proper prefix of a secret.
        let keep_from = hold_from.unwrap_or_else(|| {
            let rest = &self.pending[i..];
            self.pending.len() - self.secrets.held_tail(rest)
        });
        out.extend_from_slice(&self.pending[i..keep_from]);
        self.pending.drain(..keep_from);
        out
    }

    /// The end of a complete stream: a held-back tail (the start of a secret, never a whole
    /// one) is sent as [`REDACTED`], not as itself.
    pub(crate) fn finish(&mut self) -> Vec<u8> {
        if std::mem::take(&mut self.pending).is_empty() {
            Vec::new()
        } else {
            REDACTED.as_bytes().to_vec()
        }
    }

    /// The stream failed or was cut: the held-back tail is dropped.
    pub(crate) fn abandon(&mut self) {
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secrets(list: &[&str]) -> Secrets {
        Secrets::new(list.iter().map(|s| s.to_string()))
    }

    #[test]
    fn a_cut_text_shows_no_piece_of_a_secret() {
        let s = secrets(&["sk-0123456789abcdef", "tok"]);
        // A whole secret early (its marker is shorter) and one cut by the head's end.
        let text = format!("tok{}sk-0123456789abcdef", "x".repeat(20));
        let cut = s.redact_cut(&text, 30);
        assert!(!cut.contains("sk-0"), "{cut}");
        assert!(cut.starts_with(REDACTED), "{cut}");
        // Whole, it is redacted as a whole.
        assert_eq!(
            s.redact_cut("a sk-0123456789abcdef b", 100),
            format!("a {REDACTED} b")
        );
        assert_eq!(s.redact_cut("héllo wörld", 4), "héll");
    }

    fn run(key: &str, chunks: &[&str]) -> (String, Vec<String>) {
        let mut r = Redactor::new(secrets(&[key]));
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
    fn a_held_tail_is_redacted_at_the_end_and_dropped_on_error() {
        let (all, _) = run("sk-secret", &["abc sk-sec"]);
        assert_eq!(all, "abc [redacted]");
        let mut r = Redactor::new(secrets(&["sk-secret"]));
        assert_eq!(r.push(b"abc sk-sec"), b"abc ");
        r.abandon();
        assert!(r.finish().is_empty());
    }

    #[test]
    fn several_secrets_overlapping_and_nested() {
        let s = secrets(&["abc", "abcdef", "xyz", ""]);
        assert_eq!(
            s.redact("1abcdef2abc3xyz"),
            "1[redacted]2[redacted]3[redacted]"
        );
        let mut r = Redactor::new(s);
        let mut out = r.push(b"..ab");
        out.extend(r.push(b"cde"));
        out.extend(r.push(b"f..xy"));
        out.extend(r.finish());
        assert_eq!(String::from_utf8(out).unwrap(), "..[redacted]..[redacted]");
    }

    /// The automaton finds what a search of each secret in turn finds: the earliest, and at
    /// one position the longest.
    #[test]
    fn one_pass_finds_what_each_secret_in_turn_finds() {
        let set = secrets(&[
            "production",
            "prod",
            "duct",
            "x".repeat(40).as_str(),
            "on p",
        ]);
        let each = Secrets {
            finder: None,
            ..set.clone()
        };
        assert!(set.finder.is_some());
        for text in [
            "production prod duct",
            "reproduction on production",
            "pro duct prod",
            &"production ".repeat(1000),
            "",
        ] {
            assert_eq!(set.redact(text), each.redact(text), "{text}");
        }
        assert_eq!(
            set.redact("a production and prod"),
            "a [redacted] and [redacted]"
        );
    }

    #[test]
    fn no_secret_passes_through() {
        let mut r = Redactor::new(Secrets::default());
        assert_eq!(r.push(b"abc"), b"abc");
        assert_eq!(secrets(&[""]).redact("abc"), "abc");
        assert!(matches!(
            secrets(&["k"]).redact_bytes(b"abc"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
