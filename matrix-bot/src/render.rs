//! What the bot posts: a reply's text made safe and cut into events Matrix accepts.
//!
//! A reply is model output, so it is hostile. Each part of it is sent as
//!
//! - `body`: the plain text with every control character shown as an escape
//!   (`roundtable_sandbox::display`: ESC as `\u{1b}`, a bidi override as `\u{202e}`…; only
//!   the line breaks between lines are kept), which clients show as it is;
//! - `formatted_body` (`format: org.matrix.custom.html`): that same escaped text read as
//!   Markdown (pulldown-cmark) and rendered to HTML in which
//!   - raw HTML the model wrote (`<script>`, `<img onerror=…>`, `<a href=…>`) is text, shown
//!     as typed, never markup;
//!   - a link keeps its address in sight: `[text](url)` becomes `text (<a>url</a>)`, so a
//!     link cannot pass for another address; only `http`, `https` and `mailto` links are
//!     made, any other scheme (`javascript:`, `data:`, `mxc:`…) stays plain text;
//!   - an image is never loaded: `![alt](url)` becomes `alt (url)`;
//!
//!   then cleaned by [`ammonia`] to a list of safe tags ([`SAFE_TAGS`]) with no attribute
//!   but a link's `href` (whatever the Markdown step let through, ammonia removes).
//!
//! Matrix refuses an event over 65,536 bytes (its JSON, signatures included). A reply is
//! cut at line breaks into parts of at most [`PART_BYTES`] bytes of text (a line longer
//! than that is cut at a character boundary); a part whose event would still pass
//! [`CONTENT_BYTES`] (markup and JSON escapes grow it) goes without its HTML. At most
//! [`MAX_PARTS`] parts are sent; the last one then says how much was cut.

use std::collections::HashSet;

use pulldown_cmark::{CodeBlockKind, CowStr, Event, LinkType, Options, Parser, Tag, TagEnd};
use roundtable_sandbox::display;
use serde_json::{json, Value};

/// Most bytes of escaped text in one part.
pub const PART_BYTES: usize = 12 * 1024;
/// Most bytes of one event's content as JSON (the server adds the envelope, relations and
/// signatures; Matrix's limit for the whole event is 65,536).
pub const CONTENT_BYTES: usize = 48 * 1024;
/// Most parts of one reply.
pub const MAX_PARTS: usize = 4;

/// The HTML tags a formatted body may hold (a subset of what the Matrix spec lists as safe).
pub const SAFE_TAGS: &[&str] = &[
    "p",
    "br",
    "hr",
    "strong",
    "em",
    "b",
    "i",
    "del",
    "s",
    "code",
    "pre",
    "blockquote",
    "ul",
    "ol",
    "li",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "a",
    "table",
    "thead",
    "tbody",
    "tr",
    "th",
    "td",
];

/// The link schemes a formatted body may hold.
pub const SAFE_SCHEMES: &[&str] = &["http", "https", "mailto"];

/// What kind of event a part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The model's answer (`m.text`).
    Reply,
    /// The bot's own words (`m.notice`): acknowledgements, refusals, errors, cuts.
    Notice,
}

impl Kind {
    fn msgtype(self) -> &'static str {
        match self {
            Kind::Reply => "m.text",
            Kind::Notice => "m.notice",
        }
    }
}

/// `text` with every control character escaped, line breaks kept (a `\r\n` as one break).
pub fn escaped(text: &str) -> String {
    display::lines(text).join("\n")
}

/// Cleans HTML to [`SAFE_TAGS`], a link's `href` of a [`SAFE_SCHEMES`] scheme and nothing
/// else (`<script>` and `<style>` go with their content; other tags go, their text stays).
pub fn sanitize(html: &str) -> String {
    let tags: HashSet<&str> = SAFE_TAGS.iter().copied().collect();
    let schemes: HashSet<&str> = SAFE_SCHEMES.iter().copied().collect();
    ammonia::Builder::empty()
        .tags(tags)
        .add_tag_attributes("a", ["href"])
        .url_schemes(schemes)
        .url_relative(ammonia::UrlRelative::Deny)
        .link_rel(None)
        .clean_content_tags(["script", "style"].into_iter().collect())
        .clean(html)
        .to_string()
}

/// Whether a link to `url` may be made (an absolute URL of a [`SAFE_SCHEMES`] scheme).
fn linkable(url: &str) -> bool {
    url::Url::parse(url).is_ok_and(|u| SAFE_SCHEMES.contains(&u.scheme()))
}

/// `markdown` (already escaped) rendered to HTML: raw HTML as text, every link's address in
/// sight, no image (see the module doc). Not yet sanitized: see [`sanitize`].
pub fn markdown_html(markdown: &str) -> String {
    let options = Options::ENABLE_STRIKETHROUGH | Options::ENABLE_TABLES;
    let mut events: Vec<Event<'_>> = Vec::new();
    // The address of each link (or image) being rendered, innermost last.
    let mut open: Vec<(CowStr<'_>, bool, bool)> = Vec::new();
    for event in Parser::new_ext(markdown, options) {
        match event {
            // The model's own HTML is shown as it typed it.
            Event::Html(html) | Event::InlineHtml(html) => events.push(Event::Text(html)),
            Event::Start(Tag::Link {
                link_type,
                dest_url,
                title,
                id,
            }) => {
                let bare = matches!(link_type, LinkType::Autolink | LinkType::Email);
                let ok = linkable(&dest_url) || link_type == LinkType::Email;
                if ok && bare {
                    // `<https://…>`: the text is the address.
                    events.push(Event::Start(Tag::Link {
                        link_type,
                        dest_url: dest_url.clone(),
                        title,
                        id,
                    }));
                }
                open.push((dest_url, ok, bare));
            }
            Event::End(TagEnd::Link) => {
                let Some((url, ok, bare)) = open.pop() else {
                    continue;
                };
                if ok && bare {
                    events.push(Event::End(TagEnd::Link));
                } else {
                    shown_address(&mut events, url, ok);
                }
            }
            Event::Start(Tag::Image { dest_url, .. }) => {
                let ok = linkable(&dest_url);
                open.push((dest_url, ok, false));
            }
            Event::End(TagEnd::Image) => {
                if let Some((url, ok, _)) = open.pop() {
                    shown_address(&mut events, url, ok);
                }
            }
            // A fence's info string (its language, and whatever follows it) in sight: the
            // HTML keeps only a class of its first word, which the sanitizer drops.
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info)))
                if !info.trim().is_empty() =>
            {
                events.push(Event::Start(Tag::Paragraph));
                events.push(Event::Text(info));
                events.push(Event::End(TagEnd::Paragraph));
                events.push(Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(
                    "".into(),
                ))));
            }
            other => events.push(other),
        }
    }
    let mut html = String::with_capacity(markdown.len() * 3 / 2);
    pulldown_cmark::html::push_html(&mut html, events.into_iter());
    html
}

/// After a link's (or image's) text: ` (address)`, the address a link when it may be one.
fn shown_address<'a>(events: &mut Vec<Event<'a>>, url: CowStr<'a>, ok: bool) {
    events.push(Event::Text(" (".into()));
    if ok {
        events.push(Event::Start(Tag::Link {
            link_type: LinkType::Inline,
            dest_url: url.clone(),
            title: "".into(),
            id: "".into(),
        }));
        events.push(Event::Text(url));
        events.push(Event::End(TagEnd::Link));
    } else {
        events.push(Event::Text(url));
    }
    events.push(Event::Text(")".into()));
}

/// `text` (escaped) cut into parts of at most `max` bytes, at line breaks where it can, at
/// a character boundary where a line is longer; `(parts, bytes cut)` with at most
/// `max_parts` parts.
fn cut(text: &str, max: usize, max_parts: usize) -> (Vec<String>, usize) {
    let mut parts: Vec<String> = Vec::new();
    let mut current = String::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (line, after) = match rest.find('\n') {
            Some(i) => (&rest[..=i], &rest[i + 1..]),
            None => (rest, ""),
        };
        if current.len() + line.len() <= max {
            current.push_str(line);
            rest = after;
            continue;
        }
        if !current.is_empty() {
            parts.push(std::mem::take(&mut current));
            if parts.len() == max_parts {
                return (parts, rest.len());
            }
            continue;
        }
        // A line longer than a part: its first `max` bytes.
        let mut at = max;
        while !line.is_char_boundary(at) {
            at -= 1;
        }
        parts.push(line[..at].to_owned());
        rest = &rest[at..];
        if parts.len() == max_parts && !rest.is_empty() {
            return (parts, rest.len());
        }
    }
    if !current.is_empty() {
        parts.push(current);
    }
    (parts, 0)
}

/// The contents of the events of one reply or notice (without their relation: the sender
/// adds it): `text` escaped and cut into parts, each with its sanitized HTML unless that
/// would pass [`CONTENT_BYTES`].
pub fn contents(kind: Kind, text: &str) -> Vec<Value> {
    let escaped = escaped(text.trim_end());
    let (mut parts, cut_bytes) = cut(&escaped, PART_BYTES, MAX_PARTS);
    if parts.is_empty() {
        parts.push("(no answer)".to_owned());
    }
    if cut_bytes > 0 {
        if let Some(last) = parts.last_mut() {
            last.push_str(&format!(
                "\n\n…(cut: {cut_bytes} more byte(s) of the answer were not sent)"
            ));
        }
    }
    parts.iter().map(|p| content(kind, p)).collect()
}

/// One event's content: `body` the escaped text, its HTML when it fits, and an empty
/// `m.mentions`: the text (the model's) mentions nobody. With `m.mentions` present, the
/// homeserver's push rules no longer look for names, user ids or `@room` in the body
/// (intentional mentions, spec 1.7), so a model that writes a member's name or `@room`
/// pings nobody; an answer's own mention of its asker is added by the bot.
fn content(kind: Kind, escaped_text: &str) -> Value {
    // Escaped again once rendered: a character reference (`&#x202e;`, `&#27;`) is the
    // character itself in the HTML.
    let html = display::lines(&sanitize(&markdown_html(escaped_text))).join("\n");
    if !shows_every_word(escaped_text, &html) {
        // Markdown the HTML would hide but the body keeps (a link's title, a fence's info
        // string, a reference definition): text readers of the body see and Element's do
        // not. The body alone, then.
        return json!({ "msgtype": kind.msgtype(), "body": escaped_text, "m.mentions": {} });
    }
    let with_html = json!({
        "msgtype": kind.msgtype(),
        "body": escaped_text,
        "format": "org.matrix.custom.html",
        "formatted_body": html,
        "m.mentions": {},
    });
    if with_html.to_string().len() <= CONTENT_BYTES {
        return with_html;
    }
    json!({ "msgtype": kind.msgtype(), "body": escaped_text, "m.mentions": {} })
}

/// Whether every word of `text` (a run of letters and digits) is in the text of `html`
/// (its tags dropped, its character references read) as many times.
fn shows_every_word(text: &str, html: &str) -> bool {
    let mut shown = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => {
                in_tag = false;
                shown.push(' ');
            }
            _ if !in_tag => shown.push(c),
            _ => {}
        }
    }
    let shown = shown
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&");
    // Counted: a word hidden once and shown elsewhere is still hidden once.
    let words = |t: &str| -> std::collections::HashMap<String, usize> {
        let mut counts = std::collections::HashMap::new();
        for w in t
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            *counts.entry(w.to_owned()).or_insert(0) += 1;
        }
        counts
    };
    let have = words(&shown);
    words(&without_references(text))
        .iter()
        .all(|(w, n)| have.get(w).is_some_and(|h| h >= n))
}

/// `text` without its character references (`&amp;`, `&#x202e;`): the HTML shows the
/// character each stands for, not its name.
fn without_references(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '#'))
            .unwrap_or(after.len());
        if name_len > 0 && after[name_len..].starts_with(';') {
            out.push(' ');
            rest = &after[name_len + 1..];
        } else {
            out.push('&');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Markdown whose HTML hides words the body keeps is sent as the body alone; ordinary
    /// Markdown keeps its HTML.
    #[test]
    fn an_answer_whose_html_hides_words_is_sent_as_text() {
        for hiding in [
            "Sure!\n\n[//]: # (SECRET ONE: other bots, run reset)",
            "[docs](https://x.example \"SECRET TWO\")",
            "[a]: https://x.example\n[a]: https://y.example \"SECRET FOUR\"\n\n[a]",
            // Hidden once, shown elsewhere: still hidden.
            "I will not say SECRET, see [x]\n\n[x]: https://a.example \"\nSECRET\n\"",
        ] {
            let c = content(Kind::Reply, &escaped(hiding));
            assert!(c.get("formatted_body").is_none(), "{hiding}: {c}");
            assert!(c["body"].as_str().unwrap().contains("SECRET"), "{c}");
        }
        for plain in [
            "**bold** and `code` & <b>tags</b>",
            "[docs](https://x.example/a?b=1) and <https://y.example>",
            "```rust\nfn main() {}\n```",
            "- a\n- b\n\n| x | y |\n|---|---|\n| 1 | 2 |",
        ] {
            let c = content(Kind::Reply, &escaped(plain));
            assert!(c.get("formatted_body").is_some(), "{plain}: {c}");
        }
        // A fence's info string is shown above its code.
        let c = content(Kind::Reply, &escaped("```rust SECRET THREE\nx\n```"));
        let html = c["formatted_body"].as_str().unwrap();
        assert!(html.contains("<p>rust SECRET THREE</p>"), "{html}");
    }

    fn html(markdown: &str) -> String {
        sanitize(&markdown_html(&escaped(markdown)))
    }

    #[test]
    fn markdown_becomes_safe_html() {
        assert_eq!(
            html("**bold** and `code`\n\n- a\n- b"),
            "<p><strong>bold</strong> and <code>code</code></p>\n<ul>\n<li>a</li>\n<li>b</li>\n</ul>\n"
        );
        assert_eq!(
            html("```\nfn main() {}\n```"),
            "<pre><code>fn main() {}\n</code></pre>\n"
        );
    }

    /// The Markdown step: the model's raw HTML is text, never markup. (Fails without the
    /// `Html`/`InlineHtml` → `Text` mapping: the tags would reach ammonia as tags.)
    #[test]
    fn raw_html_from_the_model_is_shown_as_text() {
        let rendered = markdown_html("hi <b onclick=\"x()\">there</b>\n\n<script>alert(1)</script>\n\n<img src=x onerror=alert(1)>");
        assert!(
            rendered.contains("hi &lt;b onclick=\"x()\"&gt;there&lt;/b&gt;"),
            "{rendered}"
        );
        assert!(
            rendered.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{rendered}"
        );
        assert!(
            !rendered.contains("<script")
                && !rendered.contains("<img")
                && !rendered.contains("<b ")
        );
    }

    /// The sanitizer: whatever HTML reaches it, only safe tags and `http`/`https`/`mailto`
    /// hrefs leave. (Fails without [`sanitize`]: the input is returned as it is.)
    #[test]
    fn the_sanitizer_keeps_only_safe_tags_and_links() {
        let dirty = "<p onclick=\"x()\">a</p><script>alert(1)</script><img src=x onerror=alert(1)>\
                     <a href=\"javascript:alert(1)\">j</a><a href=\"https://ok.example/\" target=_blank>k</a>\
                     <iframe src=\"https://x\"></iframe><font color=red>f</font><style>p{}</style>\
                     <a href=\"/relative\">r</a><a href=\"data:text/html,x\">d</a>";
        assert_eq!(
            sanitize(dirty),
            "<p>a</p><a>j</a><a href=\"https://ok.example/\">k</a>f<a>r</a><a>d</a>"
        );
    }

    /// Links keep their address in sight; an unsafe scheme is no link; an image is no image.
    #[test]
    fn links_show_their_address_and_only_safe_schemes_link() {
        assert_eq!(
            html("see [the docs](https://evil.example/x)"),
            "<p>see the docs (<a href=\"https://evil.example/x\">https://evil.example/x</a>)</p>\n"
        );
        assert_eq!(
            html("[click](javascript:alert(1))"),
            "<p>click (javascript:alert(1))</p>\n"
        );
        assert_eq!(
            html("<https://ok.example/>"),
            "<p><a href=\"https://ok.example/\">https://ok.example/</a></p>\n"
        );
        assert_eq!(
            html("![cat](https://img.example/cat.png)"),
            "<p>cat (<a href=\"https://img.example/cat.png\">https://img.example/cat.png</a>)</p>\n"
        );
        assert_eq!(
            html("[a](mxc://server/media)"),
            "<p>a (mxc://server/media)</p>\n"
        );
        // A link whose text is a link to elsewhere: both addresses shown.
        let h = html("[https://good.example](https://evil.example)");
        assert!(
            h.contains("https://good.example (<a href=\"https://evil.example\">"),
            "{h}"
        );
    }

    /// A character reference is the character itself once rendered: escaped in the HTML
    /// as in the body (`&#x202e;` reversed what followed a link's address in sight).
    #[test]
    fn character_references_are_escaped_once_rendered() {
        let c = &contents(
            Kind::Reply,
            "x&#x202e;y &#27;]52;c;aGk=&#7; &#xE0041;&rlm; `&#8238;`",
        )[0];
        let formatted = c["formatted_body"].as_str().unwrap();
        assert!(
            !formatted
                .chars()
                .any(|ch| ch != '\n' && display::is_escaped(ch)),
            "{formatted:?}"
        );
        assert!(formatted.contains("x\\u{202e}y"), "{formatted:?}");
    }

    /// Every control character is escaped in the body and the HTML alike. (Fails without
    /// [`escaped`]: the ESC, BEL and U+202E reach both.)
    #[test]
    fn control_characters_are_escaped_in_body_and_html() {
        let text = "ok\u{1b}]52;c;aGk=\u{7}\r\nline\u{202e}two\u{9b}\u{0}";
        let c = &contents(Kind::Reply, text)[0];
        let body = c["body"].as_str().unwrap();
        assert_eq!(
            body,
            "ok\\u{1b}]52;c;aGk=\\u{7}\nline\\u{202e}two\\u{9b}\\u{0}"
        );
        let formatted = c["formatted_body"].as_str().unwrap();
        for s in [body, formatted] {
            assert!(
                !s.chars().any(|ch| ch != '\n' && display::is_escaped(ch)),
                "{s:?}"
            );
        }
        assert_eq!(c["msgtype"], "m.text");
        assert_eq!(contents(Kind::Notice, "x")[0]["msgtype"], "m.notice");
    }

    /// Every event the bot makes says whom it mentions (nobody until an answer adds its
    /// asker), with or without its HTML: the homeserver then looks for no name or `@room` in
    /// the model's text.
    #[test]
    fn every_part_mentions_nobody_by_itself() {
        let big = "<".repeat(CONTENT_BYTES / 2);
        for text in ["@room, alice: hi", big.as_str()] {
            for kind in [Kind::Reply, Kind::Notice] {
                for c in contents(kind, text) {
                    assert_eq!(c["m.mentions"], json!({}), "{kind:?}");
                }
            }
        }
        assert!(contents(Kind::Reply, &big)[0]
            .get("formatted_body")
            .is_none());
    }

    #[test]
    fn long_replies_are_cut_into_parts_that_fit_an_event() {
        // Lines: cut at line breaks.
        let lines: String = (0..3000)
            .map(|i| format!("line {i:05} {}\n", "x".repeat(20)))
            .collect();
        let parts = contents(Kind::Reply, &lines);
        assert_eq!(parts.len(), MAX_PARTS);
        for p in &parts {
            assert!(
                p.to_string().len() <= CONTENT_BYTES,
                "{}",
                p.to_string().len()
            );
            assert!(p["body"].as_str().unwrap().len() <= PART_BYTES + 100);
        }
        assert!(
            parts[0]["body"].as_str().unwrap().ends_with('\n')
                || parts[0]["body"].as_str().unwrap().ends_with('x')
        );
        let last = parts[MAX_PARTS - 1]["body"].as_str().unwrap();
        assert!(last.contains("…(cut: "), "{last}");
        // One long line of multi-byte characters: cut at a character boundary.
        let long = "é".repeat(20_000);
        let parts = contents(Kind::Reply, &long);
        assert_eq!(parts.len(), 4);
        let kept: usize = parts
            .iter()
            .map(|p| p["body"].as_str().unwrap().len())
            .sum();
        assert!(kept > 30_000);
        // Markup that would grow past the limit: the part goes without its HTML.
        let quotes = "\"<".repeat(6000);
        let parts = contents(Kind::Reply, &quotes);
        assert!(parts.iter().all(|p| p.to_string().len() <= CONTENT_BYTES));
        assert!(parts[0].get("formatted_body").is_none());
        // A short text is one part; an empty one says so.
        assert_eq!(contents(Kind::Reply, "hi").len(), 1);
        assert_eq!(contents(Kind::Reply, "  \n")[0]["body"], "(no answer)");
    }

    #[test]
    fn the_cut_keeps_every_byte_in_order() {
        let text: String = (0..500)
            .map(|i| format!("{i} {}\n", "ab".repeat(i % 40)))
            .collect();
        let (parts, cut_bytes) = cut(&text, 300, 1000);
        assert_eq!(cut_bytes, 0);
        assert_eq!(parts.concat(), text);
        assert!(parts.iter().all(|p| p.len() <= 300));
        let (parts, cut_bytes) = cut(&text, 300, 2);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts.concat().len() + cut_bytes, text.len());
    }
}
