//! Reading a whole completion's `usage` without parsing the completion.
//!
//! The budgets and the call's event need two numbers of an answer the broker otherwise
//! forwards unread. A full parse that skipped the rest (serde with one field) was the
//! largest part of the *on* broker's extra cost per call (callgrind, session 16: ~5,300
//! instructions of a ~12,400 difference); this walk finds the top-level `usage` with
//! strings and nesting tracked and reads only its two counts.
//!
//! What it reads is what `serde_json` reads as `Option<UsageWire>` from the top-level
//! object's `usage` member, for every valid answer (a property test checks it), with three
//! differences: a key written with escapes (`"us\u0061ge"`) is not recognised (the answer is
//! counted by the estimate, as an answer without usage is), an answer with two top-level
//! `usage` members is read by its last (serde refused it), and an answer that is invalid
//! JSON *before* its `usage` member may still be counted by it (the walk reads back from the
//! end; a full parse gave up on it and fell back to the estimate; one broken after it is
//! not read). All three are the upstream's own doing: the upstream is the one party that
//! reports usage, and a model's output cannot write any of them (it sits inside JSON
//! strings, where a quote is escaped, and the walk tells an escaped quote from one that
//! ends a string exactly, backwards as forwards).

/// An upstream's `usage`: its two counts, each absent or `null` as `None`.
#[derive(serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct UsageWire {
    #[serde(default)]
    pub(super) prompt_tokens: Option<u64>,
    #[serde(default)]
    pub(super) completion_tokens: Option<u64>,
}

/// A whole answer's top-level `usage`, if it has one and it reads as counts (`None` for
/// `"usage": null` and for a `usage` that is not an object of counts).
pub(super) fn answer_usage(bytes: &[u8]) -> Option<UsageWire> {
    let at = top_level_value(bytes, b"usage")?;
    let mut c = Cursor { b: bytes, i: at };
    c.ws();
    if c.literal(b"null") {
        return None;
    }
    c.usage_object()
}

/// Where the value of the top-level object's last `key` starts (just past its colon).
/// The key must be written without escapes; a key inside a string, or in a nested object
/// or array, is not it.
///
/// Walked from the end: upstreams write `usage` as the answer's last member, so the walk
/// reads its last ~70 bytes, not the model's text before them. Backwards is as exact as
/// forwards: a quote is escaped exactly when an odd run of backslashes precedes it, and a
/// valid answer ends outside any string, so each unescaped quote met going back opens or
/// closes a string. The bytes between strings are stepped through once (brackets and the
/// next string's closing quote); a string is passed with one SIMD search for its opening
/// quote.
fn top_level_value(bytes: &[u8], key: &[u8]) -> Option<usize> {
    let escaped = |q: usize| {
        bytes[..q].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
    };
    let mut depth = 0usize;
    let mut i = bytes.len();
    // Stepping back through the bytes outside every string; a string is passed at once.
    while i > 0 {
        i -= 1;
        match bytes[i] {
            b'}' | b']' => depth += 1,
            b'{' | b'[' => depth = depth.checked_sub(1)?,
            b'"' => {
                // Outside every string, a quote ends one (read backwards); escaped, it is
                // not JSON. A string outside the top-level object: not an answer.
                let close = i;
                if escaped(close) || depth == 0 {
                    return None;
                }
                let mut end = close;
                let open = loop {
                    let q = memchr::memrchr(b'"', &bytes[..end])?;
                    if !escaped(q) {
                        break q;
                    }
                    end = q;
                };
                if depth == 1 && &bytes[open + 1..close] == key {
                    let mut c = Cursor {
                        b: bytes,
                        i: close + 1,
                    };
                    c.ws();
                    if c.byte(b':') {
                        return Some(c.i);
                    }
                }
                i = open;
            }
            _ => {}
        }
    }
    None
}

/// A position in an answer.
struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn ws(&mut self) {
        while self.b.get(self.i).is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// Steps over `want` if it is next.
    fn byte(&mut self, want: u8) -> bool {
        let here = self.b.get(self.i) == Some(&want);
        self.i += usize::from(here);
        here
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        let here = self.b[self.i..].starts_with(word);
        if here {
            self.i += word.len();
        }
        here
    }

    /// The string that starts here (at its quote): its contents' span, raw; the cursor
    /// past its closing quote. `None` when it does not end.
    fn string(&mut self) -> Option<(usize, usize)> {
        let start = self.i + 1;
        let mut j = start;
        loop {
            // A model's text is most of an answer's bytes: searched, not stepped through.
            j += memchr::memchr2(b'"', b'\\', self.b.get(j..)?)?;
            if self.b[j] == b'"' {
                break;
            }
            j += 2;
        }
        self.i = j + 1;
        Some((start, j))
    }

    /// `{ "prompt_tokens": n, "completion_tokens": n, ... }` (or `[n, n]`) with each count a JSON
    /// unsigned integer or `null`, other members' values skipped; `None` for anything
    /// else (as serde refuses it: a count of another type, a duplicate count, a broken
    /// object).
    fn usage_object(&mut self) -> Option<UsageWire> {
        let mut out = UsageWire {
            prompt_tokens: None,
            completion_tokens: None,
        };
        if self.byte(b'[') {
            // serde's other form of a struct: its fields in order, `[prompt, completion]`.
            let mut counts = [None, None];
            for (k, slot) in counts.iter_mut().enumerate() {
                self.ws();
                if k == 0 && self.b.get(self.i) == Some(&b']') {
                    break;
                }
                if k == 1 {
                    if self.byte(b']') {
                        self.i -= 1;
                        break;
                    }
                    if !self.byte(b',') {
                        return None;
                    }
                    self.ws();
                }
                *slot = self.count()?;
            }
            self.ws();
            [out.prompt_tokens, out.completion_tokens] = counts;
            return self.byte(b']').then_some(out);
        }
        if !self.byte(b'{') {
            return None;
        }
        let (mut seen_prompt, mut seen_completion) = (false, false);
        self.ws();
        if self.byte(b'}') {
            return Some(out);
        }
        loop {
            self.ws();
            if self.b.get(self.i) != Some(&b'"') {
                return None;
            }
            let (start, end) = self.string()?;
            self.ws();
            if !self.byte(b':') {
                return None;
            }
            self.ws();
            match &self.b[start..end] {
                b"prompt_tokens" => {
                    if std::mem::replace(&mut seen_prompt, true) {
                        return None;
                    }
                    out.prompt_tokens = self.count()?;
                }
                b"completion_tokens" => {
                    if std::mem::replace(&mut seen_completion, true) {
                        return None;
                    }
                    out.completion_tokens = self.count()?;
                }
                _ => self.skip_value()?,
            }
            self.ws();
            if self.byte(b'}') {
                return Some(out);
            }
            if !self.byte(b',') {
                return None;
            }
        }
    }

    /// A count: `null` (`Some(None)`), or an unsigned integer that fits `u64` and is not
    /// followed by a fraction or an exponent.
    fn count(&mut self) -> Option<Option<u64>> {
        if self.literal(b"null") {
            return Some(None);
        }
        let digits = self.b[self.i..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let text = &self.b[self.i..self.i + digits];
        // JSON has no leading zeros; serde refuses `01`.
        if digits == 0 || (digits > 1 && text[0] == b'0') {
            return None;
        }
        self.i += digits;
        if matches!(self.b.get(self.i), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        let mut n = 0u64;
        for d in text {
            n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
        }
        Some(Some(n))
    }

    /// Steps over one value: a string, an object or array (strings inside tracked), or a
    /// scalar (up to the next `,`, `}` or `]`).
    fn skip_value(&mut self) -> Option<()> {
        match *self.b.get(self.i)? {
            b'"' => self.string().map(drop),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match *self.b.get(self.i)? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
            }
            _ => {
                let n = self.b[self.i..]
                    .iter()
                    .take_while(|b| !matches!(b, b',' | b'}' | b']'))
                    .count();
                (n > 0).then(|| self.i += n)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What serde reads: the top-level object's `usage` as `Option<UsageWire>`.
    fn full(b: &str) -> Option<UsageWire> {
        #[derive(serde::Deserialize)]
        struct WithUsage {
            #[serde(default)]
            usage: Option<UsageWire>,
        }
        serde_json::from_str::<WithUsage>(b)
            .ok()
            .and_then(|w| w.usage)
    }

    fn walked(b: &str) -> Option<(Option<u64>, Option<u64>)> {
        answer_usage(b.as_bytes()).map(|u| (u.prompt_tokens, u.completion_tokens))
    }

    /// The walk reads what a full parse reads, for answers that hide the key in strings,
    /// nested objects and escapes, and for counts serde refuses.
    #[test]
    fn usage_is_read_from_the_top_level_only() {
        let cases = [
            r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":6}}"#,
            r#"{"usage" : {"prompt_tokens":1},"choices":[]}"#,
            r#"{"choices":[{"message":{"content":"\"usage\":{\"prompt_tokens\":1}"}}],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#,
            r#"{"choices":[{"usage":{"prompt_tokens":99}}],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#,
            r#"{"choices":[{"usage":{"prompt_tokens":99}}]}"#,
            r#"{"x":"usage","y":["usage",{"usage":1}],"usage":{"prompt_tokens":5}}"#,
            r#"{"x":"a\\","usage":{"prompt_tokens":8,"completion_tokens":1}}"#,
            r#"{"x":"\\\"usage\":{","usage":{"prompt_tokens":9}}"#,
            r#"{"usage":null}"#,
            r#"{"usage":{}}"#,
            r#"{"usage":{ "total_tokens" : 18 , "prompt_tokens" : 10 , "x":{"prompt_tokens":1}, "completion_tokens":8 }}"#,
            r#"{"choices":"{{{{","usage":{"prompt_tokens":2,"completion_tokens":2}}"#,
            r#"{}"#,
            r#"[]"#,
            r#"{"usage":"#,
            r#"{"usage":{"prompt_tokens":-1}}"#,
            r#"{"usage":{"prompt_tokens":1.0}}"#,
            r#"{"usage":{"prompt_tokens":1e3}}"#,
            r#"{"usage":{"prompt_tokens":01}}"#,
            r#"{"usage":{"prompt_tokens":"12"}}"#,
            r#"{"usage":{"prompt_tokens":null,"completion_tokens":3}}"#,
            r#"{"usage":{"prompt_tokens":1,"prompt_tokens":2}}"#,
            r#"{"usage":{"prompt_tokens":18446744073709551615}}"#,
            r#"{"usage":{"prompt_tokens":18446744073709551616}}"#,
            r#"{"usage":{"prompt_tokens":1,}}"#,
            r#"{"usage":{"prompt_tokens":1 "completion_tokens":2}}"#,
            r#"{"usage":[1,2]}"#,
            r#"{"usage":[]}"#,
            r#"{"usage":[ null ]}"#,
            r#"{"usage":[1,2,3]}"#,
            r#"{"usage":[1,]}"#,
            r#"{"usage":[,1]}"#,
            r#"{"usage":7}"#,
            r#"{"a":"unterminated"#,
        ];
        for b in cases {
            assert_eq!(
                walked(b),
                full(b).map(|u| (u.prompt_tokens, u.completion_tokens)),
                "{b}"
            );
        }
        // Where the two differ, by design: an answer broken before its `usage` member (the
        // walk reads back from the end) still has it read where a full parse gives up on
        // the whole answer, two top-level `usage` members are read by the last (a full
        // parse refuses them), and a key with escapes is not read. An answer broken after
        // its `usage` is not read, as a full parse does not.
        assert_eq!(
            walked(r#"}}{"usage":{"prompt_tokens":4}}"#),
            Some((Some(4), None))
        );
        assert_eq!(
            walked(r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#),
            Some((Some(2), None))
        );
        assert_eq!(walked(r#"{"us\u0061ge":{"prompt_tokens":4}}"#), None);
        assert_eq!(walked(r#"{"usage":{"prompt_tokens":4}, oops"#), None);
        assert_eq!(walked(r#"{"usage":{"prompt_tokens":4}}""#), None);
        assert_eq!(walked(r#"{"usage":{"prompt_tokens":4}}\""#), None);
    }

    /// A JSON value whose strings and keys are drawn from words that trip a naive scan.
    fn tricky_json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let word = prop::sample::select(vec![
            "usage",
            "\"usage\":",
            "{",
            "}",
            "[",
            "\\",
            "\"",
            "prompt_tokens",
            "completion_tokens",
            "a b",
            "é",
        ]);
        let text = prop::collection::vec(word.clone(), 0..4).prop_map(|w| w.concat());
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<i32>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            text.prop_map(Value::from),
            (any::<u16>(), any::<u16>()).prop_map(|(p, c)| {
                serde_json::json!({"prompt_tokens": p, "completion_tokens": c})
            }),
        ];
        leaf.prop_recursive(4, 32, 5, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((word.clone(), inner), 0..4).prop_map(|kv| {
                    Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
                }),
            ]
        })
    }

    proptest::proptest! {
        /// Over generated answers (usage at the top, nested, in strings, absent, of every
        /// type), compact or pretty, the walk reads what a full parse reads.
        #[test]
        fn usage_walk_agrees_with_a_full_parse(
            body in proptest::collection::vec(
                (proptest::sample::select(vec!["usage", "choices", "x"]), tricky_json()),
                0..5,
            ),
            pretty in proptest::bool::ANY,
        ) {
            let object: serde_json::Map<String, serde_json::Value> =
                body.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            let text = if pretty {
                serde_json::to_string_pretty(&object)
            } else {
                serde_json::to_string(&object)
            }
            .expect("json");
            let want = full(&text).map(|u| (u.prompt_tokens, u.completion_tokens));
            proptest::prop_assert_eq!(walked(&text), want, "{}", text);
        }
    }
}
