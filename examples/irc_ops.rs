//! Who is in each channel the IRC bot joined, and who is its operator, as the IRC server
//! says: the bot lets only operators `!stop` a channel's running turn (by default;
//! `--stop-by anyone` lets every member), as the Matrix bot lets only moderators, and it
//! keeps a reply from highlighting the channel's members (`irc_bot::reply_lines`).
//!
//! [`Roster`] follows one connection: the names list at each join (`353`: every member; a
//! nick with `@`, `&` or `~` before it holds operator status or more), then `JOIN`, `MODE`
//! (`+o`/`-o`, and the `q`/`a` owner and admin modes some servers have), `NICK`, `PART`,
//! `KICK` and `QUIT`. Nicks and channels compare case-insensitively, folded as the server
//! folds them ([`CaseMapping`]: its `CASEMAPPING`, `rfc1459` unless it says otherwise).

use std::collections::HashMap;

/// The prefixes of a names list that mean operator status or more.
const OP_PREFIXES: &[char] = &['~', '&', '@'];
/// Every prefix a names list may put before a nick.
const ALL_PREFIXES: &[char] = &['~', '&', '@', '%', '+'];
/// The channel modes that take a parameter whichever their sign (`l` only when set).
const MODES_WITH_PARAM: &str = "ovhqabeIk";
/// The modes that give operator status or more.
const OP_MODES: &str = "oqa";

/// How the server folds nicks and channels (the `CASEMAPPING` of its `005` line): ASCII
/// letters, and for `rfc1459` `[]\~` as `{}|^` (`strict-rfc1459`: not `~`). Each folds an
/// ASCII character to an ASCII one: a folded text has the same bytes at the same places.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum CaseMapping {
    /// `ascii`: letters only.
    Ascii,
    /// `rfc1459` (RFC 1459's, the default when the server says none).
    #[default]
    Rfc1459,
    /// `strict-rfc1459`.
    StrictRfc1459,
}

impl CaseMapping {
    /// The mapping a server names (`CASEMAPPING=ascii`); `None` for one this bot does not
    /// know.
    pub fn named(name: &str) -> Option<Self> {
        Some(match name {
            "ascii" => Self::Ascii,
            "rfc1459" => Self::Rfc1459,
            "strict-rfc1459" => Self::StrictRfc1459,
            _ => return None,
        })
    }

    /// `text` folded.
    pub fn fold(self, text: &str) -> String {
        text.chars()
            .map(|c| match (c, self) {
                ('A'..='Z', _) => c.to_ascii_lowercase(),
                ('[', Self::Rfc1459 | Self::StrictRfc1459) => '{',
                (']', Self::Rfc1459 | Self::StrictRfc1459) => '}',
                ('\\', Self::Rfc1459 | Self::StrictRfc1459) => '|',
                ('~', Self::Rfc1459) => '^',
                _ => c,
            })
            .collect()
    }
}

/// The members of each channel the bot is in, and whether each is an operator: by folded
/// channel and nick.
#[derive(Debug, Default)]
pub struct Roster {
    mapping: CaseMapping,
    channels: HashMap<String, HashMap<String, bool>>,
}

impl Roster {
    /// The server's case mapping (its `005` line, which comes before the bot joins).
    pub fn set_mapping(&mut self, mapping: CaseMapping) {
        self.mapping = mapping;
    }

    /// The server's case mapping.
    pub fn mapping(&self) -> CaseMapping {
        self.mapping
    }

    /// `text` folded as the server folds nicks.
    pub fn fold(&self, text: &str) -> String {
        self.mapping.fold(text)
    }

    /// The bot joined `channel`: its list starts empty until the names list.
    pub fn joined(&mut self, channel: &str) {
        self.channels.insert(self.fold(channel), HashMap::new());
    }

    /// The bot left `channel` (kicked): nothing of it is kept.
    pub fn parted(&mut self, channel: &str) {
        self.channels.remove(&self.fold(channel));
    }

    fn channel(&mut self, channel: &str) -> Option<&mut HashMap<String, bool>> {
        let channel = self.fold(channel);
        self.channels.get_mut(&channel)
    }

    /// A names list (`353`) of `channel`: `@alice bob +carol`. Of a joined channel only: a
    /// server's list of any other (`NAMES #x` of a channel the bot is not in) would grow
    /// the map for nothing.
    pub fn names(&mut self, channel: &str, names: &str) {
        let mapping = self.mapping;
        let Some(members) = self.channel(channel) else {
            return;
        };
        for name in names.split(' ').filter(|n| !n.is_empty()) {
            let nick = name.trim_start_matches(ALL_PREFIXES);
            let prefix = &name[..name.len() - nick.len()];
            // `nick!user@host` where the server lists hosts too.
            let nick = nick.split('!').next().unwrap_or(nick);
            if !nick.is_empty() {
                members.insert(mapping.fold(nick), prefix.contains(OP_PREFIXES));
            }
        }
    }

    /// `nick` joined `channel` (someone else: the bot's own join is [`Roster::joined`]).
    pub fn join(&mut self, channel: &str, nick: &str) {
        let nick = self.fold(nick);
        if let Some(members) = self.channel(channel) {
            members.entry(nick).or_insert(false);
        }
    }

    /// `MODE channel modes args…`: `+o-o+v bob carol dave`.
    pub fn mode(&mut self, channel: &str, modes: &str, args: &[String]) {
        let mapping = self.mapping;
        let Some(members) = self.channel(channel) else {
            return;
        };
        let mut args = args.iter();
        let mut adding = true;
        for m in modes.chars() {
            match m {
                '+' => adding = true,
                '-' => adding = false,
                m if MODES_WITH_PARAM.contains(m) || (m == 'l' && adding) => {
                    let Some(nick) = args.next() else { return };
                    if OP_MODES.contains(m) {
                        members.insert(mapping.fold(nick), adding);
                    }
                }
                _ => {}
            }
        }
    }

    /// `old` is now `new`, in every channel.
    pub fn nick(&mut self, old: &str, new: &str) {
        let (old, new) = (self.fold(old), self.fold(new));
        for members in self.channels.values_mut() {
            if let Some(op) = members.remove(&old) {
                members.insert(new.clone(), op);
            }
        }
    }

    /// `nick` left `channel` (`PART`, `KICK`), or every channel (`QUIT`: `None`).
    pub fn left(&mut self, channel: Option<&str>, nick: &str) {
        let nick = self.fold(nick);
        match channel {
            Some(c) => {
                if let Some(members) = self.channel(c) {
                    members.remove(&nick);
                }
            }
            None => self.channels.values_mut().for_each(|members| {
                members.remove(&nick);
            }),
        }
    }

    /// Whether `nick` is an operator of `channel` now.
    pub fn is_op(&self, channel: &str, nick: &str) -> bool {
        self.channels
            .get(&self.fold(channel))
            .and_then(|members| members.get(&self.fold(nick)))
            .is_some_and(|op| *op)
    }

    /// The members of `channel` now, folded.
    pub fn members(&self, channel: &str) -> impl Iterator<Item = &str> {
        self.channels
            .get(&self.fold(channel))
            .into_iter()
            .flat_map(|members| members.keys().map(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn members(roster: &Roster, channel: &str) -> Vec<String> {
        let mut all: Vec<String> = roster.members(channel).map(str::to_owned).collect();
        all.sort();
        all
    }

    #[test]
    fn the_names_list_then_modes_nicks_and_leaving() {
        let mut ops = Roster::default();
        ops.joined("#Chan");
        ops.names("#chan", "@Alice bob +carol ~owner &admin %half @+both");
        for op in ["alice", "ALICE", "owner", "admin", "both"] {
            assert!(ops.is_op("#CHAN", op), "{op}");
        }
        for not in ["bob", "carol", "half", "nobody"] {
            assert!(!ops.is_op("#chan", not), "{not}");
        }
        assert!(!ops.is_op("#other", "alice"));
        // The list of a channel the bot has not joined is not kept.
        ops.names("#other", "@alice");
        assert!(!ops.is_op("#other", "alice"));
        assert_eq!(ops.channels.len(), 1);
        // Modes: the key (k) and the limit (l, when set) take a parameter; o, q and a give
        // operator status; v does not.
        ops.mode(
            "#chan",
            "+kov-o+l",
            &args(&["secret", "bob", "carol", "alice", "10"]),
        );
        assert!(ops.is_op("#chan", "bob"));
        assert!(!ops.is_op("#chan", "carol"));
        assert!(!ops.is_op("#chan", "alice"));
        assert!(!ops.is_op("#chan", "secret"));
        ops.mode("#chan", "-l+o", &args(&["carol"]));
        assert!(ops.is_op("#chan", "carol"));
        // A nick change keeps the status; leaving ends it.
        ops.nick("Bob", "Robert");
        assert!(ops.is_op("#chan", "robert") && !ops.is_op("#chan", "bob"));
        ops.left(Some("#chan"), "robert");
        assert!(!ops.is_op("#chan", "robert"));
        ops.left(None, "carol");
        assert!(!ops.is_op("#chan", "carol"));
        // A new join starts from the server's list again.
        ops.joined("#chan");
        assert!(!ops.is_op("#chan", "owner"));
        // Too few parameters: what is there is applied, nothing panics.
        ops.mode("#chan", "+oo", &args(&["dave"]));
        assert!(ops.is_op("#chan", "dave"));
    }

    /// The members a reply must not highlight: the names list, then who joins, leaves or
    /// changes nick; compared as the server folds nicks (`rfc1459` unless it says).
    #[test]
    fn members_follow_joins_nicks_and_leaving_folded_as_the_server_folds() {
        let mut r = Roster::default();
        r.joined("#a");
        r.joined("#b");
        r.names("#a", "@Ann +Bob carol [Dan] ~Eve!e@host");
        r.names("#b", "ann");
        assert_eq!(members(&r, "#A"), ["ann", "bob", "carol", "eve", "{dan}"]);
        r.join("#a", "Fay");
        r.join("#zz", "fay");
        r.nick("CAROL", "Cy");
        r.left(Some("#a"), "BOB");
        r.left(None, "ANN");
        r.left(Some("#a"), "{dan}");
        assert_eq!(members(&r, "#a"), ["cy", "eve", "fay"]);
        assert_eq!(members(&r, "#b"), Vec::<String>::new());
        assert_eq!(members(&r, "#zz"), Vec::<String>::new());
        // Kicked: nothing of the channel is kept.
        r.parted("#a");
        assert_eq!(members(&r, "#a"), Vec::<String>::new());
        // A server that folds ASCII letters only: `[` and `{` differ.
        assert_eq!(CaseMapping::Rfc1459.fold("[A]\\~"), "{a}|^");
        assert_eq!(CaseMapping::StrictRfc1459.fold("[A]\\~"), "{a}|~");
        assert_eq!(CaseMapping::Ascii.fold("[A]\\~"), "[a]\\~");
        assert_eq!(CaseMapping::named("ascii"), Some(CaseMapping::Ascii));
        assert_eq!(CaseMapping::named("utf8"), None);
        let mut r = Roster::default();
        r.set_mapping(CaseMapping::Ascii);
        r.joined("#c");
        r.names("#c", "[X] {x}");
        r.left(Some("#c"), "{X}");
        assert_eq!(members(&r, "#c"), ["[x]"]);
    }
}
