//! An upstream's `usage`, read by serde from a whole answer and from a stream's chunk
//! alike: its two counts, everything else of the answer skipped as it is read (no value
//! built). A whole answer is read through the bounded reader, off the async threads
//! ([`super::model`]); a stream's chunk is one held event of at most 64 KiB.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

/// An upstream's `usage`: its two counts, each absent or `null` as `None`.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct UsageWire {
    #[serde(default)]
    pub(super) prompt_tokens: Option<u64>,
    #[serde(default)]
    pub(super) completion_tokens: Option<u64>,
}

/// What is read of an answer or a chunk: its `choices` (only how many) and its `usage`
/// (kept raw until read, so a `usage` that is not an object of counts loses only itself).
#[derive(Deserialize)]
pub(super) struct UsageShape<'a> {
    #[serde(default)]
    pub(super) choices: Option<Vec<IgnoredAny>>,
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
}

impl UsageShape<'_> {
    /// The counts of its `usage`, if it has one that reads as counts.
    pub(super) fn usage(&self) -> Option<UsageWire> {
        serde_json::from_str::<Option<UsageWire>>(self.usage?.get())
            .ok()
            .flatten()
    }
}

/// A whole answer's top-level `usage`, if it has one and it reads as counts (`None` for
/// `"usage": null`, a `usage` that is not an object of counts, and an answer that is not a
/// JSON object).
pub(super) fn answer_usage(bytes: &[u8]) -> Option<UsageWire> {
    serde_json::from_slice::<UsageShape<'_>>(bytes)
        .ok()?
        .usage()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(b: &str) -> Option<(Option<u64>, Option<u64>)> {
        answer_usage(b.as_bytes()).map(|u| (u.prompt_tokens, u.completion_tokens))
    }

    #[test]
    fn usage_is_read_from_the_top_level_only() {
        let cases = [
            (
                r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":6}}"#,
                Some((Some(12), Some(6))),
            ),
            (
                r#"{"usage" : {"prompt_tokens":1},"choices":[]}"#,
                Some((Some(1), None)),
            ),
            (
                r#"{"choices":[{"message":{"content":"\"usage\":{\"prompt_tokens\":1}"}}],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#,
                Some((Some(7), Some(2))),
            ),
            (r#"{"choices":[{"usage":{"prompt_tokens":99}}]}"#, None),
            (
                r#"{"us\u0061ge":{"prompt_tokens":5}}"#,
                Some((Some(5), None)),
            ),
            (r#"{"usage":null}"#, None),
            (r#"{"usage":"lots"}"#, None),
            (r#"{"usage":{"prompt_tokens":-1}}"#, None),
            (r#"{"usage":{"prompt_tokens":18446744073709551616}}"#, None),
            (r#"[1,2]"#, None),
            (r#"{"usage":{"prompt_tokens":1}"#, None),
        ];
        for (answer, want) in cases {
            assert_eq!(read(answer), want, "{answer}");
        }
    }
}
