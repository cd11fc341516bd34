//! An IRC bot on actix: each IRC channel is a sandbox channel, each nick the speaker; the
//! per-speaker limits count each sender by a keyed hash of their host, not by the nick.
//!
//! ```text
//! irc-bot --server 127.0.0.1:6667 --nick sandbox --join '#general,#dev' [settings flags]
//! ```
//!
//! In a joined channel, a message addressed to the bot (`sandbox: write me a haiku`) becomes
//! a [`GuestMessage`] for the channel `irc:#general` from the speaker `nick`; the reply is
//! posted back to the channel, every line addressed to that nick (`nick: …`). `!reset`
//! starts the channel's next turn with a fresh session (anyone's; `--reset-by ops` for the
//! channel's operators alone); `!stop` stops its running turn (for the channel's
//! operators: see `irc_ops`; `--stop-by anyone` for every member). The
//! bot's own lines start with `* ` (`* nick: reset: …`), which no reply line can: a nick
//! never starts with `*`.
//!
//! Replies are model output, so they are hostile: every control character is shown as an
//! escape (`\u{1b}`, see `roundtable_sandbox::display`; CR, LF and NUL never reach the
//! wire), each line is posted as its own `PRIVMSG` of at most 512 bytes (no line can
//! smuggle an IRC command) and long replies are cut. A reply highlights no one but the
//! guest it answers: the nick of every other member of the channel (followed from the
//! server's names list, joins, parts, kicks, quits and nick changes, compared as the server
//! folds nicks) that stands as a word in it gets a zero-width space after its first
//! character, so a model asked to repeat the nick list cannot mass-highlight the channel
//! (a nick of one character cannot be broken this way and is left as it is).
//!
//! Output is paced and fair: lines leave at most `--send-burst` at once, then one per
//! `--send-interval-ms` (longer for long lines, `--send-bytes-per-sec`), under the server's
//! flood rules (RFC 1459's 2 s per message past a burst; ngIRCd throttles a client past 3
//! commands or 256 bytes a second and disconnects one whose unread input passes 2 KiB).
//! Channels are served in turn, one line each; each channel's outbox holds at most
//! `--channel-outbox` lines (and one notice past them) and each guest (sender) gets at most `--guest-lines` lines per
//! `--guest-window-secs`: past either, lines are dropped and the channel is told once
//! (`* nick: output truncated, N line(s) dropped (…)`). When the server closes the link the
//! bot reconnects with backoff (1 s doubling to `--reconnect-max-secs`) and rejoins; the
//! sandbox, its channels and their sessions are untouched.
//!
//! **Kicked**, the bot withdraws from that channel (`Withdraw`): its running turn is
//! stopped and the messages queued behind it are dropped (they never run), what waits in
//! its outbox and every
//! reply still to come are dropped, and it does not join the channel again, at a
//! reconnection either, until it is invited back (`/INVITE sandbox #chan`, by anyone the
//! server lets invite: on a `+i` channel, its operators) or restarted. Its session is kept.
//!
//! **What the limits key on.** The model, the turn, the audit trail and the other guests see
//! the nick (the speaker's id and name). The per-speaker limits (`speaker_tokens_per_day`,
//! `speaker_turns_per_minute`, `--guest-lines`) count the sender under a keyed hash of the
//! host part of the message's prefix (see `irc_limits`), passed to the sandbox as the
//! message's `limits_key`: a `NICK` change gets no fresh limits. The secret is kept in
//! `--limits-key-file` (default: beside the budgets' state file), made 0600 at the first
//! start.

#![forbid(unsafe_code)]

mod irc_limits;
mod irc_ops;

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use irc_limits::LimitsKeyer;
use irc_ops::{CaseMapping, Roster};
use roundtable_sandbox::display;
use roundtable_sandbox::settings::SETTINGS_NOTE;
use roundtable_sandbox_actors::{
    GuestMessage, SandboxSupervisor, Shutdown, Speaker, StartFresh, Stop, SupervisorOptions,
    TurnFailure, Withdraw,
};
use roundtable_sandbox_examples::{serve_metrics, BotArgs, RollDice};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// An IRC bot: each IRC channel is a sandbox channel, each nick the speaker. A message
/// addressed to the bot (`sandbox: write me a haiku`) runs as a sealed turn; `!reset` and
/// `!stop` reset or stop the channel's turn.
#[derive(Debug, Parser)]
#[command(name = "irc-bot", version, after_help = SETTINGS_NOTE)]
struct Cli {
    /// The IRC server
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:6667")]
    server: String,
    /// The bot's nick
    #[arg(long, default_value = "sandbox")]
    nick: String,
    /// The channels to join, comma-separated
    #[arg(
        long,
        value_name = "#a,#b",
        value_delimiter = ',',
        default_value = "#general"
    )]
    join: Vec<String>,
    /// The secret of the per-sender limits key (32 random bytes, made 0600 at the first start;
    /// it must be this user's alone). Default: beside the budgets' state file
    /// (STATE_FILE.irc-limits-key); without a state file, a secret of this run only
    #[arg(long, value_name = "FILE")]
    limits_key_file: Option<PathBuf>,
    /// Who may `!stop` a channel's running turn: its operators (`@`, as the server says),
    /// or anyone in it
    #[arg(long, value_enum, default_value_t = Who::Ops)]
    stop_by: Who,
    /// Who may `!reset` a channel's session (the workspace's files stay): anyone in it, or
    /// its operators
    #[arg(long, value_enum, default_value_t = Who::Anyone)]
    reset_by: Who,
    #[command(flatten)]
    output: OutputOptions,
    #[command(flatten)]
    bot: BotArgs,
}

/// Who may use a command (`!stop`, `!reset`) in a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Who {
    /// The channel's operators (`@`, or the server's owner and admin modes).
    Ops,
    /// Anyone in the channel.
    Anyone,
}

/// How the bot paces and bounds what it posts.
#[derive(Debug, Clone, clap::Args)]
struct OutputOptions {
    /// Lines sent at once before pacing starts
    #[arg(long, value_name = "LINES", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..=20))]
    send_burst: u64,
    /// Least time between two lines once the burst is spent, in milliseconds
    #[arg(long, value_name = "MS", default_value_t = 1500,
          value_parser = clap::value_parser!(u64).range(100..=60_000))]
    send_interval_ms: u64,
    /// Most bytes a second once the burst is spent (a long line waits longer)
    #[arg(long, value_name = "BYTES", default_value_t = 320,
          value_parser = clap::value_parser!(u64).range(64..=1_000_000))]
    send_bytes_per_sec: u64,
    /// Most lines waiting in one channel's outbox; past it a reply is cut, with a notice (the one line past it when it is full)
    #[arg(long, value_name = "LINES", default_value_t = 16,
          value_parser = clap::value_parser!(u64).range(2..=1000))]
    channel_outbox: u64,
    /// Most lines posted for one guest (sender, by their host's key) per window; past it they are dropped, with a notice
    #[arg(long, value_name = "LINES", default_value_t = 12,
          value_parser = clap::value_parser!(u64).range(1..=1000))]
    guest_lines: u64,
    /// The window of --guest-lines, in seconds
    #[arg(long, value_name = "SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    guest_window_secs: u64,
    /// Longest wait between two attempts to reconnect, in seconds
    #[arg(long, value_name = "SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    reconnect_max_secs: u64,
}

/// The longest IRC line, CR LF included (RFC 1459/2812).
const IRC_LINE: usize = 512;
/// Room left for the prefix the server puts before a relayed line
/// (`:nick!~user@host `: nick up to 30, user 10, host 63).
const PREFIX_ROOM: usize = 110;
/// Most lines of one reply.
const MAX_LINES: usize = 6;
/// Most protocol lines (PONG, JOIN…) waiting to be sent.
const CONTROL_CAP: usize = 32;
/// How long a write or a connect may take before the link counts as lost.
const NET_TIMEOUT: Duration = Duration::from_secs(20);
/// The longest line read from the server; past it the line is skipped.
const READ_CAP: usize = 8192;

#[actix::main]
async fn main() -> std::process::ExitCode {
    roundtable_sandbox_examples::bot_main("irc-bot", |cli: &Cli| cli.bot.completions, run).await
}

/// A parsed IRC line: prefix nick and host, command, params (the trailing one included).
#[derive(Debug, PartialEq)]
struct IrcLine {
    nick: Option<String>,
    /// The host of a `nick!user@host` prefix (a user's; a server's prefix has none).
    host: Option<String>,
    command: String,
    params: Vec<String>,
}

fn parse_line(line: &str) -> Option<IrcLine> {
    let line = line.trim_end_matches(['\r', '\n']);
    let (prefix, rest) = match line.strip_prefix(':') {
        Some(r) => {
            let (p, rest) = r.split_once(' ')?;
            (Some(p), rest)
        }
        None => (None, line),
    };
    let (head, trailing) = match rest.split_once(" :") {
        Some((h, t)) => (h, Some(t)),
        None => (rest, None),
    };
    let mut words = head.split(' ').filter(|w| !w.is_empty());
    let command = words.next()?.to_ascii_uppercase();
    let mut params: Vec<String> = words.map(str::to_owned).collect();
    if let Some(t) = trailing {
        params.push(t.to_owned());
    }
    Some(IrcLine {
        nick: prefix.map(|p| p.split('!').next().unwrap_or(p).to_owned()),
        host: prefix
            .and_then(|p| p.split_once('!'))
            .and_then(|(_, user_host)| user_host.rsplit_once('@'))
            .map(|(_, host)| host.to_owned())
            .filter(|h| !h.is_empty()),
        command,
        params,
    })
}

/// The most text bytes of one `PRIVMSG {target} :…` line: what is left of 512 bytes after
/// the command, the target, CR LF and the prefix the server adds when it relays the line.
fn text_room(target: &str) -> usize {
    IRC_LINE - 2 - "PRIVMSG ".len() - target.len() - " :".len() - PREFIX_ROOM
}

/// A zero-width space: put after the first character of a member's nick in a reply, the
/// nick no longer highlights its owner (a client matches whole words), and reads the same.
const ZWSP: char = '\u{200b}';

/// The nicks a reply must not highlight: a channel's members but the guest it answers and
/// the bot, folded as the server folds nicks. A nick of one character cannot be kept from
/// highlighting this way (whatever is put around it, it stays a word): it is left as it is.
#[derive(Debug, Default)]
struct NoHighlight {
    mapping: CaseMapping,
    nicks: HashSet<String>,
    /// The longest nick, in bytes.
    longest: usize,
}

impl NoHighlight {
    /// `members` (folded by `mapping`) but those in `keep` (as they are written).
    fn new<'a>(
        mapping: CaseMapping,
        members: impl IntoIterator<Item = &'a str>,
        keep: &[&str],
    ) -> Self {
        let keep: Vec<String> = keep.iter().map(|k| mapping.fold(k)).collect();
        let nicks: HashSet<String> = members
            .into_iter()
            .filter(|m| m.chars().nth(1).is_some() && !keep.iter().any(|k| k == m))
            .map(str::to_owned)
            .collect();
        let longest = nicks.iter().map(String::len).max().unwrap_or(0);
        Self {
            mapping,
            nicks,
            longest,
        }
    }

    /// `line` with a [`ZWSP`] after the first character of every nick standing as a word in
    /// it (folded; a word is bounded by characters that are not ASCII letters or digits,
    /// where clients match a nick), again until none is left: the space can make a word of
    /// another nick (`ann` broken, `nn` stands alone).
    fn apply(&self, line: &str) -> String {
        let mut out = line.to_owned();
        if self.nicks.is_empty() {
            return out;
        }
        loop {
            // Folding keeps every byte in its place: the places found are `out`'s.
            let at = self.mentions(&self.mapping.fold(&out));
            if at.is_empty() {
                return out;
            }
            for i in at.into_iter().rev() {
                out.insert(i, ZWSP);
            }
        }
    }

    /// Where to break the nicks standing as words in `folded`: after each one's first
    /// character (never where a [`ZWSP`] already is, so that breaking ends).
    fn mentions(&self, folded: &str) -> Vec<usize> {
        let word = |c: char| c.is_ascii_alphanumeric();
        let mut at = Vec::new();
        let mut prev: Option<char> = None;
        for (i, c) in folded.char_indices() {
            let starts = !prev.is_some_and(word);
            prev = Some(c);
            let second = i + c.len_utf8();
            if !starts || folded[second..].starts_with(ZWSP) {
                continue;
            }
            let ends = folded[second..]
                .char_indices()
                .map(|(k, c)| (second + k, Some(c)))
                .chain([(folded.len(), None)])
                .take_while(|(end, _)| end - i <= self.longest);
            for (end, next) in ends {
                if !next.is_some_and(word) && self.nicks.contains(&folded[i..end]) {
                    at.push(second);
                    break;
                }
            }
        }
        at
    }
}

/// The most of `rest` that fits `room` bytes once its nicks are broken ([`NoHighlight`]):
/// how many bytes of it, and the text to post (at least one character).
fn fit(rest: &str, room: usize, quiet: &NoHighlight) -> (usize, String) {
    let mut cut = rest.len().min(room);
    loop {
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut == 0 {
            let one = rest.chars().next().map_or(0, char::len_utf8);
            return (one, quiet.apply(&rest[..one]));
        }
        let shown = quiet.apply(&rest[..cut]);
        if shown.len() <= room {
            return (cut, shown);
        }
        cut = cut.saturating_sub(shown.len() - room);
    }
}

/// The text of the lines to post in `target` for a reply to `to`: every control character
/// escaped ([`display`]), split at line breaks and at [`text_room`] (on a char boundary),
/// every line starting `to: `, at most [`MAX_LINES`]; the nicks of `quiet` (the channel's
/// other members) broken, so that the reply highlights none of them.
fn reply_lines(target: &str, to: &str, text: &str, quiet: &NoHighlight) -> Vec<String> {
    let prefix = format!("{}: ", display::escape(to));
    let room = text_room(target).saturating_sub(prefix.len()).max(16);
    let escaped = display::lines(text);
    // Each line's text (escaped) and what is posted of it: its nicks are broken once the
    // line is cut, where its ends are word boundaries.
    // Past the lines posted, the rest is only counted: cut as it is.
    let plain = NoHighlight::default();
    let mut lines: Vec<(&str, String)> = Vec::new();
    for line in &escaped {
        let mut rest = line.trim();
        while !rest.is_empty() {
            let quiet = if lines.len() < MAX_LINES {
                quiet
            } else {
                &plain
            };
            let (cut, shown) = fit(rest, room, quiet);
            lines.push((&rest[..cut], shown));
            rest = rest[cut..].trim_start();
        }
    }
    if lines.len() > MAX_LINES {
        let more = lines.len() - MAX_LINES;
        lines.truncate(MAX_LINES);
        let mark = format!(" …(cut, {more} more line(s))");
        // The mark fits the line: the text makes room for it.
        let (source, shown) = &mut lines[MAX_LINES - 1];
        let (_, fitted) = fit(source, room.saturating_sub(mark.len()), quiet);
        *shown = fitted + &mark;
    }
    if lines.is_empty() {
        return vec![format!("{prefix}(no answer)")];
    }
    lines
        .into_iter()
        .map(|(_, shown)| format!("{prefix}{shown}"))
        .collect()
}

/// One of the bot's own lines (`* to: text`): never one a reply can start.
fn own_line(to: &str, text: &str) -> String {
    format!("* {}: {text}", display::escape(to))
}

/// The sending side's flood rule: RFC 1459's message timer, with ngIRCd's bytes per second.
/// Each line moves the timer on by its cost (`interval`, or its bytes at `bytes_per_sec`
/// when that is longer); a line may leave while the timer is less than `burst - 1`
/// intervals ahead of now.
#[derive(Debug)]
struct Pacer {
    timer: Instant,
    span: Duration,
    interval: Duration,
    bytes_per_sec: u64,
}

impl Pacer {
    fn new(o: &OutputOptions, now: Instant) -> Self {
        let interval = Duration::from_millis(o.send_interval_ms);
        Self {
            timer: now,
            span: interval * (o.send_burst as u32 - 1),
            interval,
            bytes_per_sec: o.send_bytes_per_sec,
        }
    }

    /// When the next line may leave.
    fn ready_at(&self, now: Instant) -> Instant {
        let timer = self.timer.max(now);
        if timer <= now + self.span {
            now
        } else {
            timer - self.span
        }
    }

    /// A line of `bytes` (CR LF included) left at `now`.
    fn sent(&mut self, now: Instant, bytes: usize) {
        let by_size = Duration::from_millis(bytes as u64 * 1000 / self.bytes_per_sec);
        self.timer = self.timer.max(now) + self.interval.max(by_size);
    }
}

/// A line waiting in a channel's outbox.
#[derive(Debug)]
struct Queued {
    text: String,
    /// On the last line of a reply: for whom, and when the reply was ready (logged when it
    /// leaves).
    done: Option<(String, Instant)>,
}

#[derive(Debug)]
struct ChannelOut {
    /// As joined (lowercase).
    name: String,
    joined: bool,
    /// Kicked, and not joined since: not joined again (at a reconnect either) until invited.
    kicked: bool,
    /// How many times the bot was kicked from it: a reply to a message asked before a kick
    /// is not posted.
    epoch: u64,
    lines: VecDeque<Queued>,
}

/// A guest's output in the current window.
#[derive(Debug)]
struct Budget {
    since: Instant,
    used: u64,
    noticed: bool,
}

/// What [`Outbox::post`] did with a reply.
#[derive(Debug, PartialEq)]
struct Posted {
    queued: usize,
    dropped: usize,
    noticed: bool,
    depth: usize,
}

/// A line leaving the outbox: its wire text, its channel (none for a protocol line) and, on a
/// reply's last line, for whom and when the reply was ready.
type Outgoing = (String, Option<String>, Option<(String, Instant)>);

/// Everything waiting to be sent: protocol lines first, then the channels' lines in turn,
/// each channel bounded, each guest within its budget.
#[derive(Debug)]
struct Outbox {
    control: VecDeque<String>,
    channels: Vec<ChannelOut>,
    next: usize,
    cap: usize,
    budget_lines: u64,
    window: Duration,
    guests: HashMap<String, Budget>,
}

impl Outbox {
    fn new(channels: &[String], o: &OutputOptions) -> Self {
        Self {
            control: VecDeque::new(),
            channels: channels
                .iter()
                .map(|c| ChannelOut {
                    name: c.to_lowercase(),
                    joined: false,
                    kicked: false,
                    epoch: 0,
                    lines: VecDeque::new(),
                })
                .collect(),
            next: 0,
            cap: o.channel_outbox as usize,
            budget_lines: o.guest_lines,
            window: Duration::from_secs(o.guest_window_secs),
            guests: HashMap::new(),
        }
    }

    /// A protocol line (the oldest is dropped past [`CONTROL_CAP`]).
    fn control(&mut self, line: String) {
        if self.control.len() == CONTROL_CAP {
            self.control.pop_front();
        }
        self.control.push_back(line);
    }

    fn channel(&mut self, name: &str) -> Option<&mut ChannelOut> {
        let name = name.to_lowercase();
        self.channels.iter_mut().find(|c| c.name == name)
    }

    /// The link is new: nothing of the old one is sent, no channel is joined yet (the
    /// channels' lines wait for their JOIN).
    fn reconnected(&mut self) {
        self.control.clear();
        for c in &mut self.channels {
            c.joined = false;
        }
    }

    /// The channels to join at a (re)connection: all but those the bot was kicked from.
    fn to_join(&self) -> Vec<&str> {
        self.channels
            .iter()
            .filter(|c| !c.kicked)
            .map(|c| c.name.as_str())
            .collect()
    }

    /// The bot was kicked from `name`: it is not joined again until invited, what waits in
    /// its outbox is dropped (how many lines), and so is every reply to a message asked
    /// before now ([`Outbox::current`]).
    fn kicked(&mut self, name: &str) -> Option<usize> {
        let c = self.channel(name)?;
        c.joined = false;
        c.kicked = true;
        c.epoch += 1;
        let dropped = c.lines.len();
        c.lines.clear();
        Some(dropped)
    }

    /// The channel's count of kicks now (a reply carries the one of when it was asked).
    fn epoch(&self, name: &str) -> u64 {
        let name = name.to_lowercase();
        self.channels
            .iter()
            .find(|c| c.name == name)
            .map_or(0, |c| c.epoch)
    }

    /// Whether a reply asked at `epoch` in `name` may be posted: no kick since.
    fn current(&self, name: &str, epoch: u64) -> bool {
        self.epoch(name) == epoch
    }

    /// The lines of one reply to `to` in `target`, ready at `ready`: queued within the
    /// guest's budget and the channel's cap, the rest dropped with one notice per guest per
    /// window. The budget is the sender's, counted under their limits key (not the nick,
    /// which they change at will); the notice is addressed to the nick.
    fn post(&mut self, target: &str, to: Guest<'_>, lines: Vec<String>, ready: Instant) -> Posted {
        let Guest { nick, key } = to;
        let (budget_lines, window, cap) = (self.budget_lines, self.window, self.cap);
        self.guests
            .retain(|_, b| ready.saturating_duration_since(b.since) < window);
        // A channel the bot did not join, or was kicked from: nothing is kept for it.
        let Some(channel) = self
            .channels
            .iter_mut()
            .find(|c| c.name == target && !c.kicked)
        else {
            return Posted {
                queued: 0,
                dropped: lines.len(),
                noticed: false,
                depth: 0,
            };
        };
        let budget = self.guests.entry(key.to_owned()).or_insert(Budget {
            since: ready,
            used: 0,
            noticed: false,
        });
        let total = lines.len();
        let by_budget = (budget_lines - budget.used) as usize;
        let room = cap.saturating_sub(channel.lines.len());
        let mut take = total.min(by_budget).min(room);
        let mut notice = None;
        // A drop is told once per guest per window, within the cap when there is room (the
        // notice takes the last place), else in the one place past it: a channel filled
        // exactly to its cap is told too, and a channel holds at most `cap + 1` lines.
        if take < total && !budget.noticed && channel.lines.len() <= cap {
            if take == room && take > 0 {
                take -= 1;
            }
            let why = if by_budget < total.min(room) {
                format!(
                    "at most {budget_lines} line(s) per {} s for each guest",
                    window.as_secs()
                )
            } else {
                "this channel's outbox is full".to_owned()
            };
            notice = Some(own_line(
                nick,
                &format!("output truncated, {} line(s) dropped ({why})", total - take),
            ));
            budget.noticed = true;
        }
        budget.used += take as u64;
        let mut queued: Vec<Queued> = lines
            .into_iter()
            .take(take)
            .chain(notice.clone())
            .map(|text| Queued { text, done: None })
            .collect();
        if let Some(last) = queued.last_mut() {
            last.done = Some((nick.to_owned(), ready));
        }
        channel.lines.extend(queued);
        Posted {
            queued: take,
            dropped: total - take,
            noticed: notice.is_some(),
            depth: channel.lines.len(),
        }
    }

    /// Whether a line could leave now.
    fn has_ready(&self) -> bool {
        !self.control.is_empty()
            || self
                .channels
                .iter()
                .any(|c| c.joined && !c.lines.is_empty())
    }

    /// The next line to send, as `(wire text, channel, done)`: a protocol line, else one
    /// line of the next joined channel in turn that has one.
    fn pop(&mut self) -> Option<Outgoing> {
        if let Some(line) = self.control.pop_front() {
            return Some((line, None, None));
        }
        let n = self.channels.len();
        for i in 0..n {
            let idx = (self.next + i) % n;
            let c = &mut self.channels[idx];
            if !c.joined {
                continue;
            }
            if let Some(q) = c.lines.pop_front() {
                self.next = (idx + 1) % n;
                return Some((
                    format!("PRIVMSG {} :{}", c.name, q.text),
                    Some(c.name.clone()),
                    q.done,
                ));
            }
        }
        None
    }
}

/// Whom a post is for: the nick it is addressed to and the sender's limits key.
#[derive(Debug, Clone, Copy)]
struct Guest<'a> {
    nick: &'a str,
    key: &'a str,
}

/// A reply ready to be posted.
#[derive(Debug)]
struct Reply {
    target: String,
    nick: String,
    /// The sender's limits key (their output budget's).
    key: String,
    text: String,
    ready: Instant,
    /// The channel's [`Outbox::epoch`] when the message was asked.
    epoch: u64,
}

/// Why a connection ended.
enum Ended {
    Lost(String),
    Stopped,
}

async fn run(cli: Cli) -> Result<()> {
    let Cli {
        server,
        nick,
        join,
        limits_key_file,
        stop_by,
        reset_by,
        output,
        bot: BotArgs {
            settings, metrics, ..
        },
        ..
    } = cli;
    let join: Vec<String> = join.iter().map(|c| c.to_lowercase()).collect();
    let (mut config, offline) = settings.build().await.context("configuration")?;
    let keyer = limits_keyer(limits_key_file, &config)?;
    config.tools.push(Arc::new(RollDice));
    let mut supervisor = SupervisorOptions::new(config);
    // Kept to the end of the run: dropping it stops the endpoint.
    let _metrics = serve_metrics("irc-bot", &metrics, &mut supervisor)?;
    let sandbox = SandboxSupervisor::start(supervisor).await?;
    eprintln!(
        "irc-bot: connecting to {server} as {nick} ({})",
        if offline.is_some() {
            "embedded offline model"
        } else {
            "configured model"
        }
    );

    let (replies_tx, mut replies) = mpsc::channel::<Reply>(64);
    let mut outbox = Outbox::new(&join, &output);
    let max_backoff = Duration::from_secs(output.reconnect_max_secs);
    let mut backoff = Duration::from_secs(1);
    let stop = roundtable_sandbox_examples::stop_signal();
    tokio::pin!(stop);
    let mut first = true;
    loop {
        let connected = tokio::select! {
            c = tokio::time::timeout(NET_TIMEOUT, tokio::net::TcpStream::connect(&server)) => {
                c.map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut)).and_then(|c| c)
            }
            () = &mut stop => break,
        };
        let ended = match connected {
            // A server that cannot be reached at startup is a usage error.
            Err(e) if first => {
                return Err(e).with_context(|| format!("connect to {server}"));
            }
            Err(e) => Ended::Lost(format!("cannot connect to {server}: {e}")),
            Ok(stream) => {
                first = false;
                let session = Session {
                    nick: &nick,
                    join: &join,
                    keyer: &keyer,
                    sandbox: &sandbox,
                    replies_tx: &replies_tx,
                    pacer: Pacer::new(&output, Instant::now()),
                    roster: Roster::default(),
                    stop_by,
                    reset_by,
                };
                session
                    .run(stream, &mut outbox, &mut replies, &mut stop, &mut backoff)
                    .await
            }
        };
        match ended {
            Ended::Stopped => break,
            Ended::Lost(why) => {
                eprintln!(
                    "irc-bot: {}; reconnecting in {} s",
                    display::escape(&why),
                    backoff.as_secs()
                );
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = &mut stop => break,
                }
                backoff = (backoff * 2).min(max_backoff);
            }
        }
    }
    eprintln!("irc-bot: stopping on a signal");
    let report = sandbox.send(Shutdown).await;
    if let Ok(report) = report {
        eprintln!(
            "irc-bot: shut down ({} running turn(s) stopped, {} queued message(s) refused)",
            report.stopped_turns, report.refused_queued
        );
    }
    drop(offline);
    Ok(())
}

/// The per-sender limits key's secret: `--limits-key-file`, else beside the budgets' state
/// file, else one of this run only (said on stderr, never the secret).
fn limits_keyer(file: Option<PathBuf>, config: &roundtable_sandbox::Config) -> Result<LimitsKeyer> {
    let path = file.or_else(|| {
        config
            .budgets
            .state_file
            .as_deref()
            .map(irc_limits::default_path)
    });
    let Some(path) = path else {
        eprintln!(
            "irc-bot: per-sender limits keyed on the sender's host (HMAC-SHA256; a key of this run only: no budgets state file)"
        );
        return Ok(LimitsKeyer::ephemeral()?);
    };
    let roots = [config.run_root.as_path(), config.workspace_root.as_path()];
    let uid = nix::unistd::geteuid().as_raw();
    let (secret, created) = irc_limits::load_or_create(&path, uid, roots)?;
    eprintln!(
        "irc-bot: per-sender limits keyed on the sender's host (HMAC-SHA256, key {} {})",
        if created { "made in" } else { "read from" },
        display::escape(&path.display().to_string())
    );
    Ok(LimitsKeyer::new(secret))
}

/// One connection to the server.
struct Session<'a> {
    nick: &'a str,
    join: &'a [String],
    keyer: &'a LimitsKeyer,
    sandbox: &'a actix::Addr<SandboxSupervisor>,
    replies_tx: &'a mpsc::Sender<Reply>,
    pacer: Pacer,
    /// The channels' members and operators on this connection.
    roster: Roster,
    stop_by: Who,
    reset_by: Who,
}

impl Session<'_> {
    async fn run(
        mut self,
        stream: tokio::net::TcpStream,
        outbox: &mut Outbox,
        replies: &mut mpsc::Receiver<Reply>,
        stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
        backoff: &mut Duration,
    ) -> Ended {
        let (read, mut write) = stream.into_split();
        let mut reader = tokio::io::BufReader::new(read);
        let mut buf = Vec::new();
        let mut skipping = false;
        outbox.reconnected();
        outbox.control(format!("NICK {}", self.nick));
        outbox.control(format!("USER {} 0 * :roundtable-sandbox bot", self.nick));
        loop {
            let now = Instant::now();
            let wake = if outbox.has_ready() {
                self.pacer.ready_at(now)
            } else {
                now + Duration::from_secs(3600)
            };
            let mut limited = (&mut reader).take(READ_CAP as u64);
            tokio::select! {
                // Cancel safe: a partial line stays in `buf` for the next read.
                read = limited.read_until(b'\n', &mut buf) => {
                    match read {
                        Ok(0) => return Ended::Lost("the server closed the connection".into()),
                        Err(e) => return Ended::Lost(format!("read from the server: {e}")),
                        Ok(_) => {}
                    }
                    if buf.last() != Some(&b'\n') {
                        if buf.len() >= READ_CAP {
                            buf.clear();
                            skipping = true;
                        }
                        continue;
                    }
                    let line = String::from_utf8_lossy(&buf).into_owned();
                    buf.clear();
                    if std::mem::take(&mut skipping) {
                        continue;
                    }
                    if let Some(ended) = self.handle(&line, outbox, backoff).await {
                        return ended;
                    }
                }
                Some(reply) = replies.recv() => {
                    let who = display::escape(&reply.nick);
                    if !outbox.current(&reply.target, reply.epoch) {
                        eprintln!(
                            "irc-bot: {}: reply for {who} dropped (the bot was kicked since it was asked)",
                            reply.target
                        );
                        continue;
                    }
                    let lines = reply_lines(
                        &reply.target,
                        &reply.nick,
                        &reply.text,
                        &self.no_highlight(&reply.target, &reply.nick),
                    );
                    let n = lines.len();
                    let to = Guest { nick: &reply.nick, key: &reply.key };
                    let posted = outbox.post(&reply.target, to, lines, reply.ready);
                    eprintln!("irc-bot: {}: reply for {who} ready ({n} line(s))", reply.target);
                    if posted.dropped > 0 {
                        eprintln!(
                            "irc-bot: {}: dropped {} line(s) for {who}{}; outbox {}/{}",
                            reply.target,
                            posted.dropped,
                            if posted.noticed { " (notice posted)" } else { "" },
                            posted.depth,
                            outbox.cap,
                        );
                    }
                }
                () = tokio::time::sleep_until(wake.into()) => {
                    let Some((line, channel, done)) = outbox.pop() else { continue };
                    let wire = format!("{line}\r\n");
                    debug_assert!(wire.len() <= IRC_LINE, "{wire:?}");
                    debug_assert!(!line.contains(['\r', '\n', '\0']), "{line:?}");
                    match tokio::time::timeout(NET_TIMEOUT, write.write_all(wire.as_bytes())).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Ended::Lost(format!("write to the server: {e}")),
                        Err(_) => return Ended::Lost("write to the server timed out".into()),
                    }
                    self.pacer.sent(Instant::now(), wire.len());
                    if let (Some(channel), Some((nick, ready))) = (channel, done) {
                        eprintln!(
                            "irc-bot: {channel}: reply for {} posted in {} ms",
                            display::escape(&nick),
                            ready.elapsed().as_millis()
                        );
                    }
                }
                () = stop.as_mut() => {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(2),
                        write.write_all(b"QUIT :shutting down\r\n"),
                    )
                    .await;
                    return Ended::Stopped;
                }
            }
        }
    }

    /// Whether `who` is the bot (as the server folds nicks).
    fn is_me(&self, who: Option<&str>) -> bool {
        who.is_some_and(|w| self.roster.fold(w) == self.roster.fold(self.nick))
    }

    /// What a reply to `to` in `channel` must not highlight: the channel's other members.
    fn no_highlight(&self, channel: &str, to: &str) -> NoHighlight {
        NoHighlight::new(
            self.roster.mapping(),
            self.roster.members(channel),
            &[to, self.nick],
        )
    }

    /// The bot was kicked (`KICK channel nick :reason`): it stops the channel's running
    /// turn and every turn still queued there, drops what waits in its outbox and every
    /// reply still to come, and stays out until invited (or restarted).
    async fn kicked(&mut self, msg: &IrcLine, outbox: &mut Outbox) {
        let Some(dropped) = outbox.kicked(&msg.params[0]) else {
            return;
        };
        let name = msg.params[0].to_lowercase();
        self.roster.parted(&name);
        let channel = format!("irc:{name}");
        // Its running turn stopped, its queued messages never run.
        let withdrawn = self
            .sandbox
            .send(Withdraw { channel })
            .await
            .unwrap_or_default();
        eprintln!(
            "irc-bot: {name}: kicked by {} ({}); {}, {} queued message(s) and {dropped} queued line(s) dropped; not joining again until invited",
            display::escape(msg.nick.as_deref().unwrap_or("?")),
            display::escape(msg.params.get(2).map_or("", String::as_str)),
            if withdrawn.stopped {
                "its running turn stopped"
            } else {
                "no turn was running"
            },
            withdrawn.dropped,
        );
    }

    /// Handles one line from the server; `Some` when the connection must end.
    async fn handle(
        &mut self,
        line: &str,
        outbox: &mut Outbox,
        backoff: &mut Duration,
    ) -> Option<Ended> {
        let msg = parse_line(line)?;
        let nick = self.nick;
        match msg.command.as_str() {
            "PING" => outbox.control(format!(
                "PONG :{}",
                msg.params.last().cloned().unwrap_or_default()
            )),
            // The server's features: how it folds nicks.
            "005" => {
                let mapping = msg
                    .params
                    .iter()
                    .find_map(|p| CaseMapping::named(p.strip_prefix("CASEMAPPING=")?));
                if let Some(mapping) = mapping {
                    self.roster.set_mapping(mapping);
                }
            }
            "001" => {
                let join = outbox.to_join().join(",");
                if !join.is_empty() {
                    outbox.control(format!("JOIN {join}"));
                }
                *backoff = Duration::from_secs(1);
                eprintln!("irc-bot: registered; joining {}", display::escape(&join));
            }
            "433" => return Some(Ended::Lost(format!("nick {nick} is in use"))),
            "JOIN" if self.is_me(msg.nick.as_deref()) => {
                if let Some(c) = msg.params.first().and_then(|c| outbox.channel(c)) {
                    c.joined = true;
                    c.kicked = false;
                    self.roster.joined(&c.name);
                }
            }
            "KICK" if msg.params.len() >= 2 && self.is_me(Some(&msg.params[1])) => {
                self.kicked(&msg, outbox).await;
            }
            // Invited back to a channel it was kicked from (or could not join): it joins.
            "INVITE" if msg.params.len() >= 2 && self.is_me(Some(&msg.params[0])) => {
                if let Some(c) = outbox.channel(&msg.params[1]) {
                    if !c.joined {
                        let name = c.name.clone();
                        eprintln!(
                            "irc-bot: {name}: invited by {}; joining",
                            display::escape(msg.nick.as_deref().unwrap_or("?"))
                        );
                        outbox.control(format!("JOIN {name}"));
                    }
                }
            }
            // Who is in each channel and who is an operator: the names list at a join, then
            // what changes it.
            "353" if msg.params.len() >= 4 => self.roster.names(&msg.params[2], &msg.params[3]),
            "JOIN" => {
                if let (Some(who), Some(channel)) = (msg.nick.as_deref(), msg.params.first()) {
                    self.roster.join(channel, who);
                }
            }
            "MODE" if msg.params.len() >= 2 => {
                self.roster
                    .mode(&msg.params[0], &msg.params[1], &msg.params[2..]);
            }
            "NICK" => {
                if let (Some(old), Some(new)) = (msg.nick.as_deref(), msg.params.first()) {
                    self.roster.nick(old, new);
                }
            }
            "PART" => {
                if let (Some(who), Some(channel)) = (msg.nick.as_deref(), msg.params.first()) {
                    self.roster.left(Some(channel), who);
                }
            }
            "KICK" if msg.params.len() >= 2 => {
                self.roster.left(Some(&msg.params[0]), &msg.params[1]);
            }
            "QUIT" => {
                if let Some(who) = msg.nick.as_deref() {
                    self.roster.left(None, who);
                }
            }
            "PRIVMSG" if msg.params.len() == 2 => {
                let target = msg.params[0].to_lowercase();
                if !self.join.contains(&target) {
                    return None;
                }
                let text = msg.params[1].trim().to_owned();
                let from = msg.nick.clone()?;
                // A user's message always comes with `nick!user@host`: one without cannot
                // be counted against its sender, so it is not served.
                let key = self.keyer.key(msg.host.as_deref()?);
                let to = Guest {
                    nick: &from,
                    key: &key,
                };
                let channel = format!("irc:{target}");
                let now = Instant::now();
                let may = |who: Who| who == Who::Anyone || self.roster.is_op(&target, &from);
                if text == "!reset" {
                    let what = if !may(self.reset_by) {
                        "only the channel's operators may reset its session"
                    } else {
                        let _ = self.sandbox.send(StartFresh { channel }).await;
                        "the next turn starts a fresh session"
                    };
                    let line = own_line(&from, &format!("reset: {what}"));
                    outbox.post(&target, to, vec![line], now);
                } else if text == "!stop" {
                    let may = may(self.stop_by);
                    let what = if !may {
                        "only the channel's operators may stop a turn"
                    } else if self.sandbox.send(Stop { channel }).await.unwrap_or(false) {
                        "the running turn was stopped"
                    } else {
                        "nothing was running"
                    };
                    outbox.post(
                        &target,
                        to,
                        vec![own_line(&from, &format!("stop: {what}"))],
                        now,
                    );
                } else if let Some(asked) = text
                    .strip_prefix(&format!("{nick}:"))
                    .or_else(|| text.strip_prefix(&format!("{nick},")))
                {
                    let asked = asked.trim().to_owned();
                    if asked.is_empty() {
                        return None;
                    }
                    let tx = self.replies_tx.clone();
                    let epoch = outbox.epoch(&target);
                    let speaker = Speaker {
                        id: from.clone(),
                        name: from.clone(),
                    };
                    // The model, the turn and the audit trail see the nick; the budgets
                    // count the host's key.
                    let message =
                        GuestMessage::new(&channel, speaker, asked).with_limits_key(key.clone());
                    // Queued now, not when the task first runs: a `!reset` read in the same
                    // batch of lines, sent inline after it, would otherwise be stamped first.
                    let answer = self.sandbox.send(message);
                    actix::spawn(async move {
                        let answer = answer.await;
                        let text = match answer {
                            Ok(Ok(o)) if o.reply.ok => o.reply.text.unwrap_or_default(),
                            // A full queue is not worth an error line on a public channel.
                            Ok(Err(e)) if e.failure() == TurnFailure::Busy => {
                                "busy with earlier messages; ask again in a moment".to_owned()
                            }
                            Ok(Ok(o)) => format!("error: {}", o.reply.error.unwrap_or_default()),
                            Ok(Err(e)) => format!("error: {e}"),
                            Err(e) => format!("error: {e}"),
                        };
                        let _ = tx
                            .send(Reply {
                                target,
                                nick: from,
                                key,
                                text,
                                ready: Instant::now(),
                                epoch,
                            })
                            .await;
                    });
                }
            }
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["irc-bot", "--join", "#a,#b", "--nick", "n"]).unwrap();
        assert_eq!(cli.join, ["#a", "#b"]);
        assert_eq!(
            (cli.server.as_str(), cli.nick.as_str()),
            ("127.0.0.1:6667", "n")
        );
        let defaults = Cli::try_parse_from(["irc-bot"]).unwrap();
        assert_eq!(defaults.join, ["#general"]);
        let e = Cli::try_parse_from(["irc-bot", "--server"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    }

    #[test]
    fn parses_irc_lines() {
        assert_eq!(
            parse_line(":ann!u@h PRIVMSG #Gen :sandbox: hi: there\r\n"),
            Some(IrcLine {
                nick: Some("ann".into()),
                host: Some("h".into()),
                command: "PRIVMSG".into(),
                params: vec!["#Gen".into(), "sandbox: hi: there".into()],
            })
        );
        assert_eq!(parse_line("PING :abc").unwrap().params, vec!["abc"]);
        // The host of a user's prefix; a server's prefix has none.
        let hosted = |l: &str| parse_line(l).unwrap().host;
        assert_eq!(
            hosted(":ann!~a@guest-1.example.net PRIVMSG #c :x").as_deref(),
            Some("guest-1.example.net")
        );
        assert_eq!(
            hosted(":ann!~a@0::1 PRIVMSG #c :x").as_deref(),
            Some("0::1")
        );
        assert_eq!(
            hosted(":ann!~a@b@host PRIVMSG #c :x").as_deref(),
            Some("host")
        );
        assert_eq!(hosted(":irc.test NOTICE * :hi"), None);
        assert_eq!(hosted(":ann PRIVMSG #c :x"), None);
        assert_eq!(hosted(":ann!~a@ PRIVMSG #c :x"), None);
        assert_eq!(
            parse_line(":srv 001 sandbox :Welcome").unwrap().command,
            "001"
        );
    }

    /// [`reply_lines`] in a channel whose members are none but the asker.
    fn plain_reply(target: &str, to: &str, text: &str) -> Vec<String> {
        reply_lines(target, to, text, &NoHighlight::default())
    }

    /// A reply that names the channel's members (a guest asked the model for the nick list)
    /// highlights none of them but the guest it answers (and the bot, whose highlight is
    /// harmless): each member's nick standing as a word gets a zero-width space after its
    /// first character, folded as the server folds nicks; and the lines still fit.
    #[test]
    fn a_reply_highlights_no_member_but_the_asker() {
        let members = [
            "ann", "bob", "carol", "{dan}", "sandbox", "z", "x-a", "ab", "nn",
        ];
        let quiet = NoHighlight::new(CaseMapping::Rfc1459, members, &["Ann", "SANDBOX"]);
        let lines = reply_lines(
            "#c",
            "Ann",
            "bob, CAROL and [Dan] said hi to ann and sandbox;\nbobby is no bob_ but bob-x, 2bob; z\nx-ab",
            &quiet,
        );
        assert_eq!(
            lines,
            [
                "Ann: b\u{200b}ob, C\u{200b}AROL and [\u{200b}Dan] said hi to ann and sandbox;",
                "Ann: bobby is no b\u{200b}ob_ but b\u{200b}ob-x, 2bob; z",
                // `ab` broken makes a word of `x-a`: broken too.
                "Ann: x\u{200b}-a\u{200b}b",
            ]
        );
        // Shown as the display shows text (the space is the bot's, not the model's: a
        // zero-width space in the reply itself is shown as an escape).
        assert_eq!(
            reply_lines("#c", "ann", "b\u{200b}ob", &quiet),
            ["ann: b\\u{200b}ob"]
        );
        // A reply of nothing but nicks: every line fits, and no nick is left whole.
        let target = "#a-rather-long-channel-name-of-fifty-bytes-padding";
        let lines = reply_lines(target, "ann", &"bob nn ".repeat(400), &quiet);
        assert_eq!(lines.len(), MAX_LINES);
        for l in &lines {
            let wire = format!("PRIVMSG {target} :{l}\r\n");
            assert!(wire.len() + PREFIX_ROOM <= IRC_LINE, "{} bytes", wire.len());
            let text = l.strip_prefix("ann: ").unwrap();
            assert!(
                text.split([' ', '\u{200b}', '…', '(', ','])
                    .all(|w| w != "bob" && w != "nn"),
                "{l}"
            );
        }
        assert!(lines[MAX_LINES - 1].contains(" …(cut, "), "{lines:?}");
    }

    #[test]
    fn hostile_replies_cannot_smuggle_commands() {
        let lines = plain_reply("#c", "ann", "ok\r\nQUIT :bye\u{7}\nJOIN #x\0\r");
        assert_eq!(
            lines,
            vec![
                "ann: ok",
                "ann: QUIT :bye\\u{7}",
                "ann: JOIN #x\\u{0}\\u{d}"
            ]
        );
        // Each is sent as `PRIVMSG #chan :<line>`: a whole line is text, never a command.
        assert!(lines.iter().all(|l| !l.contains(['\r', '\n', '\0'])));
        // A reply's lines start with the nick they answer, the bot's own with `* `.
        assert!(own_line("ann", "reset: x").starts_with("* ann: "));
        let forged = plain_reply(
            "#c",
            "ann",
            "x\n* ann: reset: the next turn starts a fresh session",
        );
        assert_eq!(
            forged[1],
            "ann: * ann: reset: the next turn starts a fresh session"
        );
    }

    #[test]
    fn every_line_fits_512_bytes_with_the_servers_prefix() {
        let target = "#a-rather-long-channel-name-of-fifty-bytes-padding";
        for text in ["é".repeat(1000), "x".repeat(5000), "日本".repeat(700)] {
            let lines = plain_reply(target, "somebody-with-a-long-nick", &text);
            for l in &lines {
                let wire = format!("PRIVMSG {target} :{l}\r\n");
                assert!(wire.len() + PREFIX_ROOM <= IRC_LINE, "{} bytes", wire.len());
            }
        }
        let many = "x\n".repeat(20);
        let lines = plain_reply("#c", "ann", &many);
        assert_eq!(lines.len(), MAX_LINES);
        assert!(
            lines[MAX_LINES - 1].ends_with("…(cut, 14 more line(s))"),
            "{lines:?}"
        );
        let long = "y".repeat(3000);
        let lines = plain_reply("#c", "ann", &long);
        assert!(
            lines[MAX_LINES - 1].ends_with("…(cut, 2 more line(s))"),
            "{lines:?}"
        );
        assert!(
            format!("PRIVMSG #c :{}\r\n", lines[MAX_LINES - 1]).len() + PREFIX_ROOM <= IRC_LINE
        );
    }

    fn options(args: &[&str]) -> OutputOptions {
        let mut all = vec!["irc-bot"];
        all.extend(args);
        Cli::try_parse_from(all).unwrap().output
    }

    #[test]
    fn the_pacer_allows_a_burst_then_one_line_per_interval_longer_for_long_lines() {
        let o = options(&[]);
        let t0 = Instant::now();
        let mut p = Pacer::new(&o, t0);
        for _ in 0..4 {
            assert_eq!(p.ready_at(t0), t0);
            p.sent(t0, 100);
        }
        // The burst is spent: the next line waits an interval.
        assert_eq!(p.ready_at(t0), t0 + Duration::from_millis(1500));
        // Idle, the allowance comes back.
        let later = t0 + Duration::from_secs(60);
        assert_eq!(p.ready_at(later), later);
        // A 512-byte line costs 1.6 s at 320 B/s; a short one the interval.
        let mut p = Pacer::new(&options(&["--send-burst", "1"]), t0);
        p.sent(t0, 512);
        assert_eq!(p.ready_at(t0), t0 + Duration::from_millis(1600));
        p.sent(p.ready_at(t0), 10);
        assert_eq!(p.ready_at(t0), t0 + Duration::from_millis(3100));
    }

    fn outbox(args: &[&str]) -> Outbox {
        let mut o = Outbox::new(&["#a".into(), "#b".into()], &options(args));
        for c in &mut o.channels {
            c.joined = true;
        }
        o
    }

    /// A guest whose limits key is its nick (each nick another sender).
    fn guest(nick: &str) -> Guest<'_> {
        Guest { nick, key: nick }
    }

    fn lines(n: usize, what: &str) -> Vec<String> {
        (0..n).map(|i| format!("{what} {i}")).collect()
    }

    #[test]
    fn channels_are_served_in_turn_protocol_lines_first() {
        let mut o = outbox(&[]);
        let now = Instant::now();
        o.post("#a", guest("ann"), lines(5, "a"), now);
        o.post("#b", guest("bob"), lines(2, "b"), now);
        o.control("PONG :x".into());
        let sent: Vec<String> = std::iter::from_fn(|| o.pop().map(|(l, _, _)| l)).collect();
        assert_eq!(
            sent,
            [
                "PONG :x",
                "PRIVMSG #a :a 0",
                "PRIVMSG #b :b 0",
                "PRIVMSG #a :a 1",
                "PRIVMSG #b :b 1",
                "PRIVMSG #a :a 2",
                "PRIVMSG #a :a 3",
                "PRIVMSG #a :a 4"
            ]
        );
        // A channel not joined (yet, or again after a reconnect) keeps its lines.
        o.post("#a", guest("ann"), lines(1, "a"), now);
        o.reconnected();
        assert!(!o.has_ready());
        o.channels[0].joined = true;
        assert_eq!(o.pop().unwrap().0, "PRIVMSG #a :a 0");
    }

    #[test]
    fn a_guest_past_its_budget_is_cut_with_one_notice_per_window() {
        let mut o = outbox(&["--guest-lines", "5", "--guest-window-secs", "60"]);
        let now = Instant::now();
        let p = o.post("#a", guest("ann"), lines(3, "a"), now);
        assert_eq!((p.queued, p.dropped, p.noticed), (3, 0, false));
        let p = o.post("#a", guest("ann"), lines(4, "a"), now);
        assert_eq!((p.queued, p.dropped, p.noticed), (2, 2, true));
        assert_eq!(
            o.channels[0].lines.back().unwrap().text,
            "* ann: output truncated, 2 line(s) dropped (at most 5 line(s) per 60 s for each guest)"
        );
        // Further drops in the window are silent (the notice is no flood of its own).
        let p = o.post("#a", guest("ann"), lines(4, "a"), now);
        assert_eq!((p.queued, p.dropped, p.noticed), (0, 4, false));
        // Another guest has a budget of its own.
        assert_eq!(o.post("#b", guest("bob"), lines(2, "b"), now).queued, 2);
        // A new window, a new budget.
        let p = o.post(
            "#a",
            guest("ann"),
            lines(1, "a"),
            now + Duration::from_secs(61),
        );
        assert_eq!((p.queued, p.dropped), (1, 0));
    }

    #[test]
    fn a_channels_outbox_is_bounded() {
        let mut o = outbox(&["--channel-outbox", "4", "--guest-lines", "1000"]);
        let now = Instant::now();
        let p = o.post("#a", guest("ann"), lines(10, "a"), now);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (3, 7, true, 4));
        assert_eq!(
            o.channels[0].lines.back().unwrap().text,
            "* ann: output truncated, 7 line(s) dropped (this channel's outbox is full)"
        );
        // Full to its cap: the next guest's drop is told in the one line past it, and no
        // later one (a channel holds at most its cap and one notice).
        let p = o.post("#a", guest("bob"), lines(10, "a"), now);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (0, 10, true, 5));
        let p = o.post("#a", guest("cy"), lines(1, "a"), now);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (0, 1, false, 5));
        // Filled exactly to its cap by whole replies, then a drop: told (it was untold).
        let p = o.post("#b", guest("dee"), lines(2, "b"), now);
        assert_eq!((p.queued, p.noticed), (2, false));
        let p = o.post("#b", guest("dee"), lines(2, "b"), now);
        assert_eq!((p.queued, p.noticed, p.depth), (2, false, 4));
        let p = o.post("#b", guest("dee"), lines(2, "b"), now);
        assert_eq!((p.queued, p.dropped, p.noticed, p.depth), (0, 2, true, 5));
        // Lines for a channel the bot did not join are dropped.
        assert_eq!(o.post("#zz", guest("ann"), lines(2, "z"), now).dropped, 2);
        for _ in 0..CONTROL_CAP + 5 {
            o.control("PONG :x".into());
        }
        assert_eq!(o.control.len(), CONTROL_CAP);
    }

    /// Kicked from a channel, the bot drops what waits in its outbox and every reply to a
    /// message asked before the kick, and does not join it again at a reconnection (until
    /// invited: its JOIN).
    #[test]
    fn a_kick_drops_the_channels_output_and_the_replies_still_to_come() {
        let mut o = outbox(&[]);
        let now = Instant::now();
        let asked = o.epoch("#a");
        o.post("#a", guest("ann"), lines(5, "a"), now);
        o.post("#b", guest("bob"), lines(1, "b"), now);
        assert_eq!(o.kicked("#A"), Some(5));
        assert_eq!(o.kicked("#zz"), None);
        let sent: Vec<String> = std::iter::from_fn(|| o.pop().map(|(l, _, _)| l)).collect();
        assert_eq!(sent, ["PRIVMSG #b :b 0"]);
        // A reply asked before the kick, or any line, while kicked: dropped.
        assert!(!o.current("#a", asked));
        assert_eq!(o.post("#a", guest("ann"), lines(2, "a"), now).dropped, 2);
        assert!(o.channels[0].lines.is_empty());
        // Not joined again at a reconnection.
        o.reconnected();
        assert_eq!(o.to_join(), ["#b"]);
        // Invited, it joins: replies asked from now on are posted; those of before, never.
        let c = o.channel("#a").unwrap();
        (c.joined, c.kicked) = (true, false);
        assert!(!o.current("#a", asked));
        assert!(o.current("#a", o.epoch("#a")));
        assert_eq!(o.post("#a", guest("ann"), lines(1, "a"), now).queued, 1);
        assert_eq!(o.to_join(), ["#a", "#b"]);
    }

    /// Issue 43 item 6: a guest's output budget is its sender's, under the limits key: a
    /// new nick with the same key (a `NICK` change) shares it; the same nick from another
    /// sender has its own. The notice is addressed to the nick.
    #[test]
    fn a_guests_output_budget_follows_its_key_not_its_nick() {
        let mut o = outbox(&["--guest-lines", "3", "--guest-window-secs", "60"]);
        let now = Instant::now();
        let ann = Guest {
            nick: "ann",
            key: "irc-host:aa",
        };
        let renamed = Guest {
            nick: "ann2",
            key: "irc-host:aa",
        };
        let other = Guest {
            nick: "ann",
            key: "irc-host:bb",
        };
        assert_eq!(o.post("#a", ann, lines(3, "a"), now).queued, 3);
        let p = o.post("#a", renamed, lines(2, "a"), now);
        assert_eq!((p.queued, p.dropped, p.noticed), (0, 2, true));
        assert_eq!(
            o.channels[0].lines.back().unwrap().text,
            "* ann2: output truncated, 2 line(s) dropped (at most 3 line(s) per 60 s for each guest)"
        );
        assert_eq!(o.post("#b", other, lines(3, "b"), now).queued, 3);
    }
}
