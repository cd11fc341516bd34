//! Text a guest or a model made, made safe for a person's screen.
//!
//! Everything a guest or a model wrote is hostile to the terminal or chat client it is shown
//! in: an `ESC ] 52` sequence writes the clipboard, `ESC ] 0` sets the window title, a `CSI`
//! erases the line, a carriage return or a line break starts a line that looks like the
//! program's own, a bidi override reorders what follows. This module is the one place the
//! project's programs (the CLI and both example bots) make such text visible before they
//! print or post it.
//!
//! What is escaped ([`is_escaped`]): every C0 control (`U+0000`–`U+001F`, tab and line
//! breaks included), DEL (`U+007F`), every C1 control (`U+0080`–`U+009F`: 8-bit `CSI`,
//! `OSC`, `ST`…), the line and paragraph separators (`U+2028`, `U+2029`), every format
//! character (Unicode's category Cf: the bidi controls `U+061C`, `U+200E`, `U+200F`,
//! `U+202A`–`U+202E` and `U+2066`–`U+2069`; the zero-width space `U+200B`, the word joiner
//! and invisible operators `U+2060`–`U+2064`, the deprecated format controls
//! `U+206A`–`U+206F`, `U+FEFF`, the interlinear annotation controls `U+FFF9`–`U+FFFB`, the
//! tag characters `U+E0001` and `U+E0020`–`U+E007F`, which spell ASCII no one sees, the
//! shorthand, musical and hieroglyph format controls, the soft hyphen `U+00AD`, the
//! Mongolian vowel separator `U+180E`, the Arabic, Syriac and Kaithi number signs) and
//! every other character Unicode says to draw as nothing (default-ignorable: the variation
//! selectors `U+180B`–`U+180D`, `U+180F`, `U+FE00`–`U+FE0D` and `U+E0100`–`U+E01EF`, which
//! can hide bytes after any character, the grapheme joiner `U+034F`, the Khmer inherent
//! vowels `U+17B4`, `U+17B5`, the Hangul fillers `U+115F`, `U+1160`, `U+3164` and `U+FFA0`,
//! the unassigned `U+2065`, `U+FFF0`–`U+FFF8` and the rest of `U+E0000`–`U+E0FFF`), and
//! the braille blank `U+2800`, which draws as a blank that is no whitespace (a name that
//! looks empty). Kept: the zero-width joiner and non-joiner (`U+200D`, `U+200C`) and
//! the emoji variation selectors `U+FE0E` and `U+FE0F`, which emoji and scripts need. Each
//! escaped character becomes the text `\u{HEX}` (lowercase hex, Rust's notation): ESC is
//! shown as `\u{1b}`, 8-bit CSI as `\u{9b}`. Every other character is kept as it is, so
//! ordinary text (any script, emoji) reads unchanged.
//!
//! - [`escape`]: one string, for one line of output;
//! - [`lines`]: a multi-line text split at its line breaks, each line escaped, for a
//!   program that gives every line of a reply its own prefix (so a line of the reply cannot
//!   pass for one of the program's own);
//! - [`json`]: a JSON document printed for a person (`roundtable-sandbox turn`): JSON
//!   escapes C0 but not the rest; this escapes those too as `\uXXXX` (a surrogate pair past
//!   the BMP), the same document.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` is shown as an escape rather than as itself (see the module doc).
pub fn is_escaped(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}'
        | '\u{7f}'..='\u{9f}'
        | '\u{ad}'
        | '\u{34f}'
        | '\u{600}'..='\u{605}'
        | '\u{61c}'
        | '\u{6dd}'
        | '\u{70f}'
        | '\u{890}'..='\u{891}'
        | '\u{8e2}'
        | '\u{115f}'..='\u{1160}'
        | '\u{17b4}'..='\u{17b5}'
        | '\u{180b}'..='\u{180f}'
        | '\u{200b}'
        | '\u{200e}'..='\u{200f}'
        | '\u{2028}'..='\u{202e}'
        | '\u{2060}'..='\u{206f}'
        | '\u{2800}'
        | '\u{3164}'
        | '\u{fe00}'..='\u{fe0d}'
        | '\u{feff}'
        | '\u{ffa0}'
        | '\u{fff0}'..='\u{fffb}'
        | '\u{110bd}'
        | '\u{110cd}'
        | '\u{13430}'..='\u{1343f}'
        | '\u{1bca0}'..='\u{1bca3}'
        | '\u{1d173}'..='\u{1d17a}'
        | '\u{e0000}'..='\u{e0fff}')
}

/// `text` with every [`is_escaped`] character written as `\u{HEX}`; borrowed when there is
/// none.
pub fn escape(text: &str) -> Cow<'_, str> {
    match escaped_with(text, is_escaped, |out, c| {
        let _ = write!(out, "\\u{{{:x}}}", c as u32);
    }) {
        Some(out) => Cow::Owned(out),
        None => Cow::Borrowed(text),
    }
}

/// `text` with each character `which` picks written by `write` instead; `None` when it
/// picks none.
fn escaped_with(
    text: &str,
    which: fn(char) -> bool,
    write: fn(&mut String, char),
) -> Option<String> {
    if !text.chars().any(which) {
        return None;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if which(c) {
            write(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Some(out)
}

/// The lines of `text` (split at `\n`, a `\r\n` counting as one break), each escaped: a
/// lone `\r`, a `U+2028` or any other control inside a line is shown, never obeyed. An
/// empty text is one empty line; a final line break adds no empty line.
pub fn lines(text: &str) -> Vec<Cow<'_, str>> {
    let mut out: Vec<Cow<'_, str>> = text
        .split_inclusive('\n')
        .map(|l| match l.strip_suffix('\n') {
            Some(l) => escape(l.strip_suffix('\r').unwrap_or(l)),
            None => escape(l),
        })
        .collect();
    if out.is_empty() {
        out.push(Cow::Borrowed(""));
    }
    out
}

/// `value` as pretty-printed JSON with every [`is_escaped`] character inside its strings
/// written as a JSON `\uXXXX` escape (the C0 ones already are): the same document, safe to
/// print.
pub fn json(value: &impl serde::Serialize) -> serde_json::Result<String> {
    let text = serde_json::to_string_pretty(value)?;
    let escaped = escaped_with(&text, is_escaped_in_json, |out, c| {
        // One `\uXXXX` per UTF-16 unit: a character past the BMP (a tag, `U+1D173`) is a
        // surrogate pair, as JSON writes it.
        for unit in c.encode_utf16(&mut [0; 2]) {
            let _ = write!(out, "\\u{unit:04x}");
        }
    });
    Ok(escaped.unwrap_or(text))
}

/// The escaped characters serde_json leaves raw: all of them but C0, which it escapes (the
/// only C0 characters left in its output are the pretty printer's own newlines and spaces).
fn is_escaped_in_json(c: char) -> bool {
    is_escaped(c) && c > '\u{1f}'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_control_is_made_visible() {
        for c in (0u32..0x20).chain(0x7f..0xa0) {
            let c = char::from_u32(c).unwrap();
            let shown = escape(&c.to_string()).into_owned();
            assert_eq!(shown, format!("\\u{{{:x}}}", c as u32));
            assert!(!shown.chars().any(char::is_control), "{shown:?}");
        }
        for c in [
            '\u{61c}',
            '\u{200e}',
            '\u{200f}',
            '\u{2028}',
            '\u{2029}',
            '\u{202a}',
            '\u{202b}',
            '\u{202c}',
            '\u{202d}',
            '\u{202e}',
            '\u{2066}',
            '\u{2067}',
            '\u{2068}',
            '\u{2069}',
            // Invisible: text hidden in a reply (the tag characters spell ASCII).
            '\u{200b}',
            '\u{2060}',
            '\u{2064}',
            '\u{feff}',
            '\u{e0000}',
            '\u{e0041}',
            '\u{e007f}',
            // Variation selectors that hide bytes after any character, and the fillers and
            // joiners that show nothing (a display name that looks empty).
            '\u{fe00}',
            '\u{fe0d}',
            '\u{e0100}',
            '\u{e01ef}',
            '\u{ad}',
            '\u{34f}',
            '\u{115f}',
            '\u{1160}',
            '\u{180e}',
            '\u{3164}',
            '\u{ffa0}',
        ] {
            assert!(is_escaped(c), "{c:?}");
        }
    }

    #[test]
    fn the_review_s_sequences_are_shown_not_obeyed() {
        let hostile = "a\u{1b}]52;c;aGk=\u{7}b\u{1b}]0;owned\u{7}\u{1b}[2K\r[#ops] reset: x\u{9b}31m\u{9d}0;t\u{9c}\u{7f}\u{202e}cba";
        assert_eq!(
            escape(hostile),
            "a\\u{1b}]52;c;aGk=\\u{7}b\\u{1b}]0;owned\\u{7}\\u{1b}[2K\\u{d}[#ops] reset: x\\u{9b}31m\\u{9d}0;t\\u{9c}\\u{7f}\\u{202e}cba"
        );
    }

    #[test]
    fn ordinary_text_is_kept_and_borrowed() {
        for text in [
            "hello",
            "é ü 日本語 🎲",
            // The joiners emoji and scripts need are kept.
            "👨\u{200d}👩\u{200d}👧 می\u{200c}خواهم",
            // The emoji presentation selectors are kept.
            "❤\u{fe0f} ✔\u{fe0e}",
            "tab-free `code` \\u{1b} as text",
            "",
        ] {
            assert!(matches!(escape(text), Cow::Borrowed(t) if t == text));
        }
        // The characters around the escaped ranges are kept.
        let around = "\u{a0}\u{2027}\u{202f}\u{2070}\u{27ff}\u{2801}\u{180a}\u{1810}\u{ffe8}\u{fffc}\u{1d172}\u{1d17b}\u{1bc9f}\u{1bca4}\u{e1000}";
        assert!(matches!(escape(around), Cow::Borrowed(_)), "{around:?}");
    }

    /// Every format character (Cf) and every default-ignorable one is shown, but the joiners
    /// and the emoji presentation selectors: among them, the ones a review found passing.
    #[test]
    fn invisible_characters_are_shown_but_the_joiners_emoji_need() {
        let ranges: &[(u32, u32)] = &[
            // The review's: Mongolian variation selectors, the deprecated format controls,
            // the interlinear annotations, the musical and shorthand format controls, the
            // braille blank.
            (0x180b, 0x180d),
            (0x180f, 0x180f),
            (0x206a, 0x206f),
            (0xfff9, 0xfffb),
            (0x1d173, 0x1d17a),
            (0x1bca0, 0x1bca3),
            (0x2800, 0x2800),
            // The other Cf and default-ignorable ones.
            (0x600, 0x605),
            (0x6dd, 0x6dd),
            (0x70f, 0x70f),
            (0x890, 0x891),
            (0x8e2, 0x8e2),
            (0x17b4, 0x17b5),
            (0x2065, 0x2065),
            (0xfff0, 0xfff8),
            (0x110bd, 0x110bd),
            (0x110cd, 0x110cd),
            (0x13430, 0x1343f),
            (0xe0001, 0xe0001),
            (0xe0080, 0xe00ff),
            (0xe01f0, 0xe0fff),
        ];
        for &(from, to) in ranges {
            for c in (from..=to).filter_map(char::from_u32) {
                assert!(is_escaped(c), "{:x}", c as u32);
                assert_eq!(
                    escape(&format!("a{c}b")),
                    format!("a\\u{{{:x}}}b", c as u32)
                );
            }
        }
        for kept in ['\u{200c}', '\u{200d}', '\u{fe0e}', '\u{fe0f}'] {
            assert!(!is_escaped(kept), "{kept:?}");
        }
    }

    #[test]
    fn lines_split_at_breaks_and_escape_the_rest() {
        assert_eq!(lines("one\r\ntwo\nthree\n"), ["one", "two", "three"]);
        assert_eq!(lines("a\rb\u{2028}c\r"), ["a\\u{d}b\\u{2028}c\\u{d}"]);
        assert_eq!(lines(""), [""]);
        assert_eq!(lines("\n\nx"), ["", "", "x"]);
    }

    #[test]
    fn json_stays_the_same_document() {
        let value = serde_json::json!({
            "text": "\u{1b}]0;t\u{7}\u{9b}2J\u{9d}\u{9c}\u{7f}\u{202e}é\n",
            // Past the BMP: a surrogate pair each.
            "tags": "\u{e0041}\u{1d173}x",
        });
        let shown = json(&value).unwrap();
        assert!(
            !shown
                .chars()
                .any(|c| is_escaped(c) && c != '\n' && c != ' '),
            "{shown:?}"
        );
        assert!(
            shown.contains(r"\u009b2J\u009d\u009c\u007f\u202eé"),
            "{shown}"
        );
        assert!(shown.contains(r"\udb40\udc41\ud834\udd73x"), "{shown}");
        let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(back, value);
    }
}
