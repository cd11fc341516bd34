//! Text helpers both sides apply to hostile text the same way.

/// The longest label (speaker name or id, reload path) kept, in characters.
pub const MAX_LABEL: usize = 64;

/// Cuts `text` to at most `max` bytes on a character boundary, marking the cut.
pub fn cap_text(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n[truncated: {} of {} bytes shown]",
        &text[..end],
        end,
        text.len()
    )
}

/// A label made safe to show: control characters and line breaks become spaces, runs of
/// whitespace collapse, invisible format characters go, the result is trimmed and capped
/// at [`MAX_LABEL`] characters.
pub fn clean_label(raw: &str) -> String {
    let mut out = String::new();
    let mut space = false;
    for c in raw.chars() {
        if c.is_control() || c.is_whitespace() || is_invisible(c) {
            space = !out.is_empty();
            continue;
        }
        if space {
            out.push(' ');
            space = false;
        }
        out.push(c);
        if out.chars().count() >= MAX_LABEL {
            break;
        }
    }
    out
}

/// Format characters that render as nothing (bidi overrides, zero-width joiners …).
fn is_invisible(c: char) -> bool {
    matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_text_respects_char_boundaries() {
        let s = "ééé";
        let capped = cap_text(s, 3);
        assert!(capped.starts_with('é'));
        assert!(capped.contains("truncated"));
        assert_eq!(cap_text("abc", 3), "abc");
    }

    #[test]
    fn labels_are_cleaned() {
        assert_eq!(clean_label(" a\n\u{202e}b  c "), "a b c");
        assert_eq!(clean_label(&"x".repeat(100)).chars().count(), MAX_LABEL);
    }
}
