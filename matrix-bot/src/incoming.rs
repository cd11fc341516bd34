//! What the bot reads: which events it answers, and which invites it takes.
//!
//! **Which events.** An `m.room.message` of type `m.text` from someone else, addressed to
//! the bot: its user id in the event's `m.mentions` (what clients send for a mention or a
//! reply), the message starting with the bot's name (`bot: …`, for clients without
//! `m.mentions`), a reply to an event the bot sent, or the configured prefix. Never its own
//! events, edits (`m.replace`: an edit would re-run a question), notices (`m.notice`:
//! another bot's output), emotes, redacted events or other types.
//!
//! **Only events after it started.** Three rules, each enough in the usual case, together
//! also when a server or a clock misbehaves:
//!
//! - by place ([`answerable_from`]): the first sync of a process (a full sync: the rooms'
//!   state and their latest events, all from before the start) is read for its state and
//!   invites only, and in a room the bot joins later, the events before its own join (the
//!   room's history, which the join's sync carries) are not answered. This needs no clock;
//!   it needs the first sync to be new (the bot's filter is its process's own: a homeserver
//!   may answer a repeated request from a cache, and Synapse's first sync of a bot
//!   restarted within two minutes was the old process's, whose syncs then replayed the
//!   past);
//! - by time ([`message`]): a message the homeserver stamped (`origin_server_ts`) before
//!   the bot's start is not answered, wherever it comes (a replay, a late federation);
//! - a restart begins with a full sync again, so no old message (nor one sent while the
//!   bot was down) is answered after it.
//!
//! **Which invites** ([`InviteRule`]): the inviter (the sender of the invite's
//! `m.room.member` event, which the inviter's homeserver signs) must be on the allow-list:
//! a server name (its every user) or a user id. By default the bot's own homeserver.

use serde_json::Value;

/// A command of the room's turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `!reset`: the room's next turn starts a fresh session.
    Reset,
    /// `!stop`: stop the room's running turn.
    Stop,
    /// `!status`: where the room's turn is.
    Status,
}

impl Command {
    fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "!reset" => Some(Self::Reset),
            "!stop" => Some(Self::Stop),
            "!status" => Some(Self::Status),
            _ => None,
        }
    }
}

/// What an event asks of the bot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// A command.
    Command(Command),
    /// A question for the room's agent (the text without its address).
    Turn(String),
}

/// A message the bot answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The event's id (the reply answers it).
    pub event_id: String,
    /// Its sender's user id.
    pub sender: String,
    /// The thread it is in (its root's id), if any: the reply goes there too.
    pub thread: Option<String>,
    /// What it asks.
    pub ask: Ask,
}

/// Who the bot is, as messages address it.
#[derive(Debug, Clone)]
pub struct Me {
    /// `@bot:server`.
    pub user_id: String,
    /// Its display name, if it has one.
    pub display_name: Option<String>,
    /// The configured prefix, if any.
    pub prefix: Option<String>,
    /// Messages stamped (`origin_server_ts`, ms since the epoch) before this are not
    /// answered: the bot's start.
    pub not_before_ms: u64,
}

impl Me {
    /// The localpart (`bot` of `@bot:server`).
    fn localpart(&self) -> &str {
        self.user_id
            .strip_prefix('@')
            .and_then(|u| u.split_once(':'))
            .map_or(self.user_id.as_str(), |(l, _)| l)
    }

    /// `text` without a leading address (`Name: `, `@bot:server, `, …); `None` when it
    /// does not start with one.
    fn strip_name<'t>(&self, text: &'t str) -> Option<&'t str> {
        let names = [
            Some(self.user_id.as_str()),
            self.display_name.as_deref(),
            Some(self.localpart()),
        ];
        for name in names.into_iter().flatten().filter(|n| !n.is_empty()) {
            let Some(head) = text.get(..name.len()) else {
                continue;
            };
            if !head.eq_ignore_ascii_case(name) {
                continue;
            }
            let rest = &text[name.len()..];
            if let Some(rest) = rest.strip_prefix([':', ',']) {
                return Some(rest);
            }
        }
        None
    }
}

/// The text of a reply without the quote of the replied-to event that older clients put
/// before it (`> <@x:y> …` lines, then an empty line).
fn without_reply_fallback(body: &str) -> &str {
    if !body.starts_with("> ") {
        return body;
    }
    let mut rest = body;
    while let Some(line_end) = rest.find('\n') {
        let line = &rest[..line_end];
        if line.starts_with('>') {
            rest = &rest[line_end + 1..];
        } else {
            break;
        }
    }
    rest.strip_prefix('\n').unwrap_or(rest)
}

/// What `event` (a timeline event's JSON) asks of the bot, or `None` when it is not a
/// message addressed to it (see the module doc). `sent_by_me` tells whether an event id is
/// one the bot sent (a reply to it addresses the bot).
pub fn message(event: &Value, me: &Me, sent_by_me: &dyn Fn(&str) -> bool) -> Option<Message> {
    if event["type"] != "m.room.message" {
        return None;
    }
    let sender = event["sender"].as_str()?;
    if sender == me.user_id {
        return None;
    }
    if !event["unsigned"]["redacted_because"].is_null() {
        return None;
    }
    // From before the start (or unstamped): not answered.
    if event["origin_server_ts"]
        .as_u64()
        .is_none_or(|ts| ts < me.not_before_ms)
    {
        return None;
    }
    let content = &event["content"];
    let relates = &content["m.relates_to"];
    if relates["rel_type"] == "m.replace" || !content["m.new_content"].is_null() {
        return None;
    }
    if content["msgtype"] != "m.text" {
        return None;
    }
    let body = content["body"].as_str()?;
    let event_id = event["event_id"].as_str()?.to_owned();
    let in_reply_to = relates["m.in_reply_to"]["event_id"].as_str();
    let thread = (relates["rel_type"] == "m.thread")
        .then(|| relates["event_id"].as_str().map(str::to_owned))
        .flatten();
    let mentions = &content["m.mentions"];
    let mentioned = mentions["user_ids"]
        .as_array()
        .is_some_and(|ids| ids.iter().any(|id| id == me.user_id.as_str()));
    // A thread's fallback reply (`is_falling_back`: clients point it at the thread's newest
    // event, often the bot's answer) is no reply: every later message of a thread the bot
    // answered in was a turn.
    let falling_back = thread.is_some() && relates["is_falling_back"] == true;
    let replied_to_me = !falling_back && in_reply_to.is_some_and(sent_by_me);
    let text = without_reply_fallback(body).trim();

    // What the message says once its address is taken off; `None`: not addressed. A bare
    // command first: a prefix that begins like one (`!`) would make `!stop` a turn.
    let asked: Option<&str> = if Command::parse(text).is_some() {
        Some(text)
    } else if let Some(rest) = me
        .prefix
        .as_deref()
        .filter(|p| !p.is_empty())
        .and_then(|p| text.strip_prefix(p))
    {
        Some(rest)
    } else if let Some(rest) = me.strip_name(text) {
        Some(rest)
    } else if mentioned || replied_to_me {
        Some(text)
    } else {
        None
    };
    let asked = asked?.trim();
    let ask = match Command::parse(asked) {
        Some(c) => Ask::Command(c),
        None if asked.is_empty() => return None,
        None => Ask::Turn(asked.to_owned()),
    };
    Some(Message {
        event_id,
        sender: sender.to_owned(),
        thread,
        ask,
    })
}

/// The index of the first event of a room's timeline (from one sync) that may be answered:
///
/// - in the process's first sync, none (`events.len()`): everything in it predates the
///   start;
/// - in a room joined since the last sync, those after the bot's own join
///   (`m.room.member`, `membership: join`, `state_key` the bot): the events before it are
///   the room's history. Without the join in the timeline, a `limited` timeline (the join
///   is before its first event) is answerable whole, any other none;
/// - otherwise all (`0`).
pub fn answerable_from(events: &[Value], me: &str, first_sync: bool, newly_joined: bool) -> usize {
    if first_sync {
        return events.len();
    }
    if !newly_joined {
        return 0;
    }
    match events.iter().rposition(|e| is_membership(e, me, "join")) {
        Some(i) => i + 1,
        None => events.len(),
    }
}

/// Whether `event` turns the room's end-to-end encryption on: the state event (a message
/// event of that type, which a room's power levels may let any member send, turned the
/// room off for the bot).
pub fn turns_encryption_on(event: &Value) -> bool {
    event["type"] == "m.room.encryption" && event["state_key"] == ""
}

/// Whether `event` sets `user`'s membership to `membership`.
pub fn is_membership(event: &Value, user: &str, membership: &str) -> bool {
    event["type"] == "m.room.member"
        && event["state_key"] == user
        && event["content"]["membership"] == membership
}

/// Who may invite the bot.
#[derive(Debug, Clone)]
pub struct InviteRule {
    /// Server names (lowercase; a port is part of the name).
    servers: Vec<String>,
    /// User ids.
    users: Vec<String>,
}

impl InviteRule {
    /// From `--invite-from` entries (`server.name`, `server.name:8448`, `@user:server`);
    /// empty: `own_server` alone.
    pub fn new(entries: &[String], own_server: &str) -> Result<Self, String> {
        let mut servers = Vec::new();
        let mut users = Vec::new();
        for e in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            if e.starts_with('@') {
                if server_of(e).is_none() {
                    return Err(format!("--invite-from {e}: a user id is @name:server"));
                }
                users.push(e.to_owned());
            } else if e.contains(['@', '/', ' ', '*']) {
                return Err(format!(
                    "--invite-from {e}: give a server name (example.org) or a user id (@name:example.org)"
                ));
            } else {
                servers.push(e.to_ascii_lowercase());
            }
        }
        if servers.is_empty() && users.is_empty() {
            servers.push(own_server.to_ascii_lowercase());
        }
        Ok(Self { servers, users })
    }

    /// Whether an invite from `inviter` (a user id) is taken.
    pub fn allows(&self, inviter: &str) -> bool {
        if self.users.iter().any(|u| u == inviter) {
            return true;
        }
        server_of(inviter).is_some_and(|s| self.servers.iter().any(|a| a.eq_ignore_ascii_case(s)))
    }

    /// The rule, for a log line.
    pub fn describe(&self) -> String {
        self.servers
            .iter()
            .map(|s| format!("every user of {s}"))
            .chain(self.users.iter().cloned())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The server name of a user id (`example.org:8448` of `@a:example.org:8448`).
pub fn server_of(user_id: &str) -> Option<&str> {
    let (local, server) = user_id.strip_prefix('@')?.split_once(':')?;
    (!local.is_empty() && !server.is_empty()).then_some(server)
}

/// The inviter of the bot, from an invite's stripped state: the sender of the bot's own
/// `m.room.member` invite event.
pub fn inviter(invite_state: &[Value], me: &str) -> Option<String> {
    invite_state
        .iter()
        .rev()
        .find(|e| is_membership(e, me, "invite"))
        .and_then(|e| e["sender"].as_str())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn me() -> Me {
        Me {
            user_id: "@bot:localhost".into(),
            display_name: Some("Sandbox Bot".into()),
            prefix: Some("!ai ".into()),
            not_before_ms: 1_000,
        }
    }

    fn text(sender: &str, body: &str) -> Value {
        json!({
            "type": "m.room.message", "sender": sender, "event_id": "$e1",
            "origin_server_ts": 2_000, "content": {"msgtype": "m.text", "body": body}
        })
    }

    fn never(_: &str) -> bool {
        false
    }

    fn asked(event: &Value) -> Option<Ask> {
        message(event, &me(), &never).map(|m| m.ask)
    }

    fn turn(t: &str) -> Option<Ask> {
        Some(Ask::Turn(t.into()))
    }

    #[test]
    fn messages_addressed_to_the_bot_are_answered() {
        assert_eq!(asked(&text("@ann:localhost", "bot: hello")), turn("hello"));
        assert_eq!(
            asked(&text("@ann:localhost", "Sandbox Bot: hi there")),
            turn("hi there")
        );
        assert_eq!(
            asked(&text("@ann:localhost", "@bot:localhost, hey")),
            turn("hey")
        );
        assert_eq!(
            asked(&text("@ann:localhost", "!ai what now")),
            turn("what now")
        );
        // A mention (m.mentions), wherever the name is in the text.
        let mut e = text("@ann:localhost", "tell me, Sandbox Bot, a joke");
        e["content"]["m.mentions"] = json!({"user_ids": ["@bot:localhost"]});
        assert_eq!(asked(&e), turn("tell me, Sandbox Bot, a joke"));
        // A reply to one of the bot's events, its fallback quote left out.
        let mut e = text(
            "@ann:localhost",
            "> <@bot:localhost> an answer\n> more\n\nand then?",
        );
        e["content"]["m.relates_to"] = json!({"m.in_reply_to": {"event_id": "$mine"}});
        let mine = |id: &str| id == "$mine";
        assert_eq!(
            message(&e, &me(), &mine).unwrap().ask,
            Ask::Turn("and then?".into())
        );
        assert_eq!(message(&e, &me(), &never), None);
        // Commands, bare or addressed.
        assert_eq!(
            asked(&text("@ann:localhost", "!reset")),
            Some(Ask::Command(Command::Reset))
        );
        assert_eq!(
            asked(&text("@ann:localhost", " !stop ")),
            Some(Ask::Command(Command::Stop))
        );
        assert_eq!(
            asked(&text("@ann:localhost", "bot: !status")),
            Some(Ask::Command(Command::Status))
        );
        // A prefix that begins like a command leaves the commands as they are.
        let bang = Me {
            prefix: Some("!".into()),
            ..me()
        };
        assert_eq!(
            message(&text("@ann:localhost", "!stop"), &bang, &never).map(|m| m.ask),
            Some(Ask::Command(Command::Stop))
        );
        assert_eq!(
            message(&text("@ann:localhost", "!what now"), &bang, &never).map(|m| m.ask),
            turn("what now")
        );
        // A thread's fallback reply to the bot's answer is no reply to the bot (a real
        // reply in a thread is).
        let mine = |id: &str| id == "$mine";
        let mut e = text("@ann:localhost", "thanks Bob");
        e["content"]["m.relates_to"] = json!({"rel_type": "m.thread", "event_id": "$root",
            "is_falling_back": true, "m.in_reply_to": {"event_id": "$mine"}});
        assert_eq!(message(&e, &me(), &mine), None);
        e["content"]["m.relates_to"]["is_falling_back"] = json!(false);
        assert_eq!(message(&e, &me(), &mine).map(|m| m.ask), turn("thanks Bob"));
        // In a thread: the reply goes there.
        let mut e = text("@ann:localhost", "bot: in a thread");
        e["content"]["m.relates_to"] = json!({"rel_type": "m.thread", "event_id": "$root"});
        assert_eq!(
            message(&e, &me(), &never).unwrap().thread.as_deref(),
            Some("$root")
        );
    }

    #[test]
    fn only_the_state_event_turns_encryption_on() {
        let state = json!({"type": "m.room.encryption", "state_key": "",
            "content": {"algorithm": "m.megolm.v1.aes-sha2"}});
        assert!(turns_encryption_on(&state));
        let message = json!({"type": "m.room.encryption",
            "content": {"algorithm": "m.megolm.v1.aes-sha2"}});
        assert!(!turns_encryption_on(&message));
    }

    /// Its own events, edits, notices and the rest are never answered. (Fails without the
    /// sender check: the bot would answer its own "bot: …" text, or an edit would run a
    /// question again.)
    #[test]
    fn its_own_events_edits_and_other_events_are_ignored() {
        assert_eq!(
            asked(&text("@bot:localhost", "bot: talking to myself")),
            None
        );
        assert_eq!(asked(&text("@bot:localhost", "!reset")), None);
        let mut edit = text("@ann:localhost", "* bot: hello again");
        edit["content"]["m.relates_to"] = json!({"rel_type": "m.replace", "event_id": "$e0"});
        edit["content"]["m.new_content"] = json!({"msgtype": "m.text", "body": "bot: hello again"});
        // (Clients put the edit's mentions on it too: addressed, but an edit.)
        edit["content"]["m.mentions"] = json!({"user_ids": ["@bot:localhost"]});
        assert_eq!(asked(&edit), None);
        let mut notice = text("@other-bot:localhost", "bot: loop?");
        notice["content"]["msgtype"] = json!("m.notice");
        assert_eq!(asked(&notice), None);
        let mut redacted = text("@ann:localhost", "bot: x");
        redacted["unsigned"] = json!({"redacted_because": {}});
        assert_eq!(asked(&redacted), None);
        let mut other = text("@ann:localhost", "bot: x");
        other["type"] = json!("m.reaction");
        assert_eq!(asked(&other), None);
        // Not addressed.
        assert_eq!(asked(&text("@ann:localhost", "hello all")), None);
        assert_eq!(asked(&text("@ann:localhost", "robot: hi")), None);
        assert_eq!(asked(&text("@ann:localhost", "bot:")), None);
    }

    /// A message stamped before the start is not answered, wherever it comes from. (Fails
    /// without the `origin_server_ts` check.)
    #[test]
    fn messages_stamped_before_the_start_are_not_answered() {
        let mut e = text("@ann:localhost", "bot: hello");
        assert!(asked(&e).is_some());
        e["origin_server_ts"] = json!(999);
        assert_eq!(asked(&e), None);
        e["origin_server_ts"] = json!(1_000);
        assert!(asked(&e).is_some());
        e["origin_server_ts"] = Value::Null;
        assert_eq!(asked(&e), None);
    }

    fn join(user: &str) -> Value {
        json!({"type": "m.room.member", "state_key": user, "sender": user, "content": {"membership": "join"}})
    }

    /// Old events: none of the first sync, none before the bot's own join in a room it just
    /// joined. (Fails if either rule is removed.)
    #[test]
    fn only_events_after_the_start_and_the_join_are_answerable() {
        let events = vec![
            text("@ann:localhost", "bot: old question"),
            join("@bot:localhost"),
            text("@ann:localhost", "bot: new question"),
        ];
        assert_eq!(answerable_from(&events, "@bot:localhost", true, false), 3);
        assert_eq!(answerable_from(&events, "@bot:localhost", true, true), 3);
        assert_eq!(answerable_from(&events, "@bot:localhost", false, true), 2);
        assert_eq!(answerable_from(&events, "@bot:localhost", false, false), 0);
        // Another member's join is not the bot's.
        let events = vec![text("@ann:localhost", "bot: old"), join("@ann:localhost")];
        assert_eq!(answerable_from(&events, "@bot:localhost", false, true), 2);
    }

    /// The invite allow-list. (Fails if `allows` takes any inviter, or compares names loosely.)
    #[test]
    fn invites_are_taken_only_from_the_allow_list() {
        let own = InviteRule::new(&[], "localhost").unwrap();
        assert!(own.allows("@ann:localhost"));
        assert!(own.allows("@ann:LocalHost"));
        assert!(!own.allows("@ann:evil.test"));
        assert!(!own.allows("@ann:localhost.evil.test"));
        assert!(!own.allows("@ann:localhost:8448"));
        assert!(!own.allows("@localhost:evil.test"));
        assert!(!own.allows("localhost"));
        let rule = InviteRule::new(
            &["other.test".into(), "@carol:localhost".into()],
            "localhost",
        )
        .unwrap();
        assert!(rule.allows("@carol:localhost"));
        assert!(rule.allows("@x:other.test"));
        assert!(!rule.allows("@ann:localhost"));
        assert!(!rule.allows("@carol:localhost.evil"));
        assert!(InviteRule::new(&["*.example".into()], "x").is_err());
        assert!(InviteRule::new(&["@nobody".into()], "x").is_err());
        assert_eq!(
            rule.describe(),
            "every user of other.test, @carol:localhost"
        );
    }

    #[test]
    fn the_inviter_is_the_sender_of_the_bots_invite() {
        let state = vec![
            json!({"type": "m.room.create", "state_key": "", "sender": "@x:evil.test", "content": {}}),
            json!({"type": "m.room.member", "state_key": "@bot:localhost", "sender": "@ann:localhost",
                   "content": {"membership": "invite"}}),
            json!({"type": "m.room.member", "state_key": "@ann:localhost", "sender": "@ann:localhost",
                   "content": {"membership": "join"}}),
        ];
        assert_eq!(
            inviter(&state, "@bot:localhost").as_deref(),
            Some("@ann:localhost")
        );
        assert_eq!(inviter(&state[..1], "@bot:localhost"), None);
        assert_eq!(server_of("@a:b.example:8448"), Some("b.example:8448"));
        assert_eq!(server_of("@:b"), None);
    }
}
