//! Who is a channel operator, as the IRC server says: the IRC bot lets only them `!stop` a
//! channel's running turn (by default; `--stop-by anyone` lets every member), as the
//! Matrix bot lets only moderators.
//!
//! [`Ops`] follows one connection: the names list at each join (`353`: a nick with `@`,
//! `&` or `~` before it holds operator status or more), then `MODE` (`+o`/`-o`, and the
//! `q`/`a` owner and admin modes some servers have), `NICK`, `PART`, `KICK` and `QUIT`.
//! Nicks and channels compare case-insensitively (ASCII, as most servers fold them).

use std::collections::{HashMap, HashSet};

/// The prefixes of a names list that mean operator status or more.
const OP_PREFIXES: &[char] = &['~', '&', '@'];
/// Every prefix a names list may put before a nick.
const ALL_PREFIXES: &[char] = &['~', '&', '@', '%', '+'];
/// The channel modes that take a parameter whichever their sign (`l` only when set).
const MODES_WITH_PARAM: &str = "ovhqabeIk";
/// The modes that give operator status or more.
const OP_MODES: &str = "oqa";

/// The operators of each channel, by lower-case channel and nick.
#[derive(Debug, Default)]
pub struct Ops(HashMap<String, HashSet<String>>);

impl Ops {
    /// The bot joined `channel`: its list starts empty until the names list.
    pub fn joined(&mut self, channel: &str) {
        self.0.insert(channel.to_ascii_lowercase(), HashSet::new());
    }

    /// A names list (`353`) of `channel`: `@alice bob +carol`. Of a joined channel only: a
    /// server's list of any other (`NAMES #x` of a channel the bot is not in) would grow
    /// the map for nothing.
    pub fn names(&mut self, channel: &str, names: &str) {
        let Some(ops) = self.0.get_mut(&channel.to_ascii_lowercase()) else {
            return;
        };
        for name in names.split(' ').filter(|n| !n.is_empty()) {
            let nick = name.trim_start_matches(ALL_PREFIXES);
            let prefix = &name[..name.len() - nick.len()];
            if prefix.contains(OP_PREFIXES) {
                ops.insert(nick.to_ascii_lowercase());
            } else {
                ops.remove(&nick.to_ascii_lowercase());
            }
        }
    }

    /// `MODE channel modes args…`: `+o-o+v bob carol dave`.
    pub fn mode(&mut self, channel: &str, modes: &str, args: &[String]) {
        let Some(ops) = self.0.get_mut(&channel.to_ascii_lowercase()) else {
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
                        let nick = nick.to_ascii_lowercase();
                        if adding {
                            ops.insert(nick);
                        } else {
                            ops.remove(&nick);
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// `old` is now `new`, in every channel.
    pub fn nick(&mut self, old: &str, new: &str) {
        let (old, new) = (old.to_ascii_lowercase(), new.to_ascii_lowercase());
        for ops in self.0.values_mut() {
            if ops.remove(&old) {
                ops.insert(new.clone());
            }
        }
    }

    /// `nick` left `channel` (`PART`, `KICK`), or every channel (`QUIT`: `None`).
    pub fn left(&mut self, channel: Option<&str>, nick: &str) {
        let nick = nick.to_ascii_lowercase();
        match channel {
            Some(c) => {
                if let Some(ops) = self.0.get_mut(&c.to_ascii_lowercase()) {
                    ops.remove(&nick);
                }
            }
            None => self.0.values_mut().for_each(|ops| {
                ops.remove(&nick);
            }),
        }
    }

    /// Whether `nick` is an operator of `channel` now.
    pub fn is_op(&self, channel: &str, nick: &str) -> bool {
        self.0
            .get(&channel.to_ascii_lowercase())
            .is_some_and(|ops| ops.contains(&nick.to_ascii_lowercase()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_names_list_then_modes_nicks_and_leaving() {
        let mut ops = Ops::default();
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
        assert_eq!(ops.0.len(), 1);
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
}
