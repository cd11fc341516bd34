//! One turn from start to end: load (or reset) the session, build the tools, run the
//! agent, save the session, and make the [`Reply`].
//!
//! The session file changes only after a successful turn: a model error or a save failure
//! gives `{ok:false,error}` and leaves the previous session as it was. A reset starts from
//! an empty session and archives the old file only when the new one is saved, so a failed
//! reset turn consumes nothing (the host keeps the reset pending and sends it again).

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};

use roundtable_sandbox_protocol::{Reply, Turn, BROKER_SOCKET, DEFAULT_MAX_STEPS, WORKSPACE_MOUNT};

use crate::agent::{run_turn, AgentLimits};
use crate::broker::Broker;
use crate::confine::Root;
use crate::fetch::{self, Fetcher};
use crate::html::HtmlConverter;
use crate::http::UnixHttpClient;
use crate::model::Model;
use crate::prompt;
use crate::session::{Session, SessionStore};
use crate::toolbox::{Remote, Toolbox};
use crate::tools::{Builtins, ShellOptions};

/// The compaction budget when the turn sets none, in estimated tokens.
pub const DEFAULT_BUDGET: u64 = 32_000;

/// Where the guest finds its world. [`RunnerOptions::container`] is the real one; tests point
/// it at temporary directories.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    pub workspace: PathBuf,
    pub socket: PathBuf,
    pub shell: ShellOptions,
    pub model_timeout: Duration,
    pub tool_timeout: Duration,
    /// The largest broker response read.
    pub max_response: usize,
    /// Where `fetch` reduces HTML to text.
    pub html: HtmlConverter,
}

impl RunnerOptions {
    /// The paths and limits inside the container.
    pub fn container() -> Self {
        Self {
            workspace: PathBuf::from(WORKSPACE_MOUNT),
            socket: PathBuf::from(BROKER_SOCKET),
            shell: ShellOptions::default(),
            model_timeout: Duration::from_secs(300),
            tool_timeout: Duration::from_secs(300),
            max_response: 4 * 1024 * 1024,
            html: HtmlConverter::this_program(),
        }
    }
}

/// Runs a turn against the broker.
pub fn run(turn: &Turn, config: &RunnerOptions) -> Reply {
    let client = UnixHttpClient::new(&config.socket, config.max_response);
    let broker = Broker::new(
        client,
        turn.model.clone(),
        config.model_timeout,
        config.tool_timeout,
    );
    run_with(turn, config, broker.clone(), broker, Utc::now())
}

/// Runs a turn with the given model and remote tools (the seam the tests use).
pub fn run_with<M: Model, R: Remote>(
    turn: &Turn,
    config: &RunnerOptions,
    mut model: M,
    remote: R,
    now: DateTime<Utc>,
) -> Reply {
    let root = match Root::new(&config.workspace) {
        Ok(root) => root,
        Err(e) => return Reply::error(format!("the workspace is not available: {e}")),
    };
    let store = SessionStore::new(root.path());
    let session = if turn.reset {
        log("reset requested: starting a fresh session");
        Session::default()
    } else {
        store.load()
    };
    if !prompt::time_zone(&turn.time_zone).1 {
        log(&format!(
            "unknown time zone '{}'; using UTC",
            prompt::clean_label(&turn.time_zone)
        ));
    }
    let system = prompt::system_prompt(&turn.prompt, now, &turn.time_zone, &turn.speaker);
    let user = prompt::user_message(&turn.speaker, &turn.text);
    let agent = AgentLimits::new(
        turn.max_steps.unwrap_or(DEFAULT_MAX_STEPS),
        turn.session_budget.unwrap_or(DEFAULT_BUDGET),
    );
    // Offered only when the turn has egress routes; its text is cut before the agent's cap.
    let fetch = Fetcher::new(
        &config.socket,
        &turn.egress,
        config.tool_timeout,
        fetch::text_cap(agent.tool_result_cap),
        config.html.clone(),
    );
    let mut tools = Toolbox::new(
        Builtins::new(root.clone(), config.shell.clone()),
        fetch,
        &turn.tools,
        &turn.mcp,
        remote,
    );
    let outcome = match run_turn(&mut model, &mut tools, &agent, &session, &system, user) {
        Ok(outcome) => outcome,
        Err(e) => {
            log(&format!("turn failed: {e}; the session is left as it was"));
            return Reply::error(e.to_string());
        }
    };
    if let Err(e) = store.save(&outcome.session, turn.reset) {
        log(&e.to_string());
        return Reply::error(e.to_string());
    }
    Reply::text(outcome.text, outcome.usage)
}

fn log(message: &str) {
    eprintln!("roundtable-guest: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::tests::{calls, text, ScriptedModel};
    use crate::chat::{ChatRequest, Message, ModelReply};
    use crate::model::ModelError;
    use crate::testutil::TempDir;
    use chrono::TimeZone;
    use roundtable_sandbox_protocol::compaction::{CompactReply, CompactRequest};
    use roundtable_sandbox_protocol::{McpServerSpec, Speaker, ToolSpec};
    use serde_json::{json, Map, Value};
    use std::cell::RefCell;
    use std::rc::Rc;

    /// A scripted model whose requests stay readable after the turn took it.
    #[derive(Clone, Default)]
    struct Shared(Rc<RefCell<ScriptedModel>>);

    impl Model for Shared {
        fn complete(&mut self, request: &ChatRequest) -> Result<ModelReply, ModelError> {
            self.0.borrow_mut().complete(request)
        }

        fn compact(&mut self, request: &CompactRequest) -> Result<CompactReply, ModelError> {
            self.0.borrow_mut().compact(request)
        }
    }

    struct NoRemote;

    impl Remote for NoRemote {
        fn call(&mut self, path: &str, _: &Map<String, Value>) -> Result<String, String> {
            Err(format!("no broker for {path}"))
        }
    }

    fn turn(text: &str, name: &str, reset: bool) -> Turn {
        Turn {
            text: text.into(),
            speaker: Speaker {
                id: format!("id-{name}"),
                name: name.into(),
            },
            model: "m".into(),
            prompt: "You assist the guests.".into(),
            time_zone: "Europe/Paris".into(),
            reset,
            tools: vec![],
            mcp: vec![],
            egress: vec![],
            max_steps: None,
            session_budget: None,
        }
    }

    fn config(ws: &TempDir) -> RunnerOptions {
        RunnerOptions {
            workspace: ws.path().to_path_buf(),
            socket: ws.path().join("none.sock"),
            shell: ShellOptions {
                path_env: "/bin:/usr/bin".into(),
                ..ShellOptions::default()
            },
            ..RunnerOptions::container()
        }
    }

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2025, 6, 1, 12, 0, 0).unwrap()
    }

    fn run_scripted(
        t: &Turn,
        cfg: &RunnerOptions,
        script: Vec<Result<ModelReply, ModelError>>,
    ) -> (Reply, Vec<ChatRequest>) {
        let model = Shared::default();
        model.0.borrow_mut().replies = script.into();
        let reply = run_with(t, cfg, model.clone(), NoRemote, now());
        let requests = std::mem::take(&mut model.0.borrow_mut().requests);
        (reply, requests)
    }

    #[test]
    fn a_tool_using_turn_then_history_then_reset() {
        let ws = TempDir::new();
        let cfg = config(&ws);
        let (reply, requests) = run_scripted(
            &turn("note that the door code is 1234", "ann", false),
            &cfg,
            vec![
                calls(&[(
                    "c1",
                    "write",
                    r#"{"path":"note.txt","content":"door code 1234\n"}"#,
                )]),
                calls(&[
                    ("c2", "read", r#"{"path":"note.txt"}"#),
                    ("c3", "sh", r#"{"command":"echo hi | wc -c"}"#),
                ]),
                text("noted"),
            ],
        );
        assert_eq!(reply.check_shape(), Ok(()));
        assert_eq!(reply.text.as_deref(), Some("noted"), "{reply:?}");
        let usage = reply.usage.unwrap();
        assert_eq!((usage.model_calls, usage.tool_calls), (3, 3));
        let first = &requests[0].messages;
        let Message::System { content } = &first[0] else {
            panic!()
        };
        assert!(content.starts_with("You assist the guests."));
        assert!(
            content.contains("Sunday, 1 June 2025, 14:00 (Europe/Paris, UTC+02:00)"),
            "{content}"
        );
        assert!(content.contains("Now speaking: ann (id id-ann)."));
        assert_eq!(
            first[1],
            Message::User {
                content: "ann: note that the door code is 1234".into()
            }
        );
        let third = &requests[2].messages;
        let results: Vec<&str> = third
            .iter()
            .filter_map(|m| match m {
                Message::Tool { content, .. } => Some(content.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(results[1], "door code 1234\n");
        assert!(
            results[2].contains("stdout:\n") && results[2].trim_end().ends_with('3'),
            "{}",
            results[2]
        );

        // The next turn's request carries the history, attributed to its speakers.
        let (reply, requests) = run_scripted(
            &turn("what is the code?", "bob", false),
            &cfg,
            vec![text("1234")],
        );
        assert_eq!(reply.text.as_deref(), Some("1234"));
        let msgs = &requests[0].messages;
        assert_eq!(msgs.len(), 1 + 7 + 1);
        assert_eq!(
            msgs[8],
            Message::User {
                content: "bob: what is the code?".into()
            }
        );

        // After a reset the request carries none of it, and the old session is archived.
        let (reply, requests) = run_scripted(&turn("hello", "bob", true), &cfg, vec![text("hi")]);
        assert!(reply.ok);
        assert_eq!(requests[0].messages.len(), 2);
        let archived = std::fs::read_dir(ws.path().join(".roundtable"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("session.reset-")
            })
            .count();
        assert_eq!(archived, 1);
        let (_, requests) = run_scripted(&turn("again", "ann", false), &cfg, vec![text("x")]);
        assert_eq!(requests[0].messages.len(), 4);
    }

    #[test]
    fn a_model_error_leaves_the_session_file_untouched() {
        let ws = TempDir::new();
        let cfg = config(&ws);
        let (reply, _) = run_scripted(&turn("hi", "ann", false), &cfg, vec![text("hello")]);
        assert!(reply.ok);
        let file = ws.path().join(".roundtable/session.json");
        let before = std::fs::read(&file).unwrap();
        let (reply, _) = run_scripted(
            &turn("write something", "ann", false),
            &cfg,
            vec![
                calls(&[("c1", "write", r#"{"path":"x","content":"y"}"#)]),
                Err(ModelError("broker answered 502: upstream failed".into())),
            ],
        );
        assert_eq!(
            reply,
            Reply::error("the model call failed: broker answered 502: upstream failed")
        );
        assert_eq!(reply.check_shape(), Ok(()));
        assert_eq!(std::fs::read(&file).unwrap(), before);
        // A failed reset turn archives nothing either.
        let (reply, _) = run_scripted(
            &turn("hi", "ann", true),
            &cfg,
            vec![Err(ModelError("down".into()))],
        );
        assert!(!reply.ok);
        assert_eq!(std::fs::read(&file).unwrap(), before);
    }

    #[test]
    fn a_corrupt_session_is_set_aside_and_the_turn_goes_on() {
        let ws = TempDir::new();
        let cfg = config(&ws);
        std::fs::create_dir(ws.path().join(".roundtable")).unwrap();
        std::fs::write(
            ws.path().join(".roundtable/session.json"),
            b"{\"version\":1,\"messages\":[{\"ro",
        )
        .unwrap();
        let (reply, requests) = run_scripted(&turn("hi", "ann", false), &cfg, vec![text("hello")]);
        assert!(reply.ok, "{reply:?}");
        assert_eq!(requests[0].messages.len(), 2);
        let names: Vec<String> = std::fs::read_dir(ws.path().join(".roundtable"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().any(|n| n.starts_with("session.corrupt-")),
            "{names:?}"
        );
    }

    #[test]
    fn host_and_mcp_tools_reach_the_remote_and_a_missing_workspace_is_an_error() {
        let ws = TempDir::new();
        let cfg = config(&ws);
        let mut t = turn("weather?", "ann", false);
        t.tools = vec![ToolSpec {
            name: "weather".into(),
            description: "the weather".into(),
            parameters: json!({"type":"object"}),
        }];
        t.mcp = vec![McpServerSpec {
            server: "docs".into(),
            tools: vec![ToolSpec {
                name: "search".into(),
                description: "search".into(),
                parameters: json!({"type":"object"}),
            }],
        }];
        let (reply, requests) = run_scripted(
            &t,
            &cfg,
            vec![
                calls(&[("c1", "weather", "{}"), ("c2", "mcp__docs__search", "{}")]),
                text("done"),
            ],
        );
        assert!(reply.ok);
        let names: Vec<&str> = requests[0].tools.iter().map(|d| d.name.as_str()).collect();
        assert!(
            names.contains(&"weather") && names.contains(&"mcp__docs__search"),
            "{names:?}"
        );
        let msgs = &requests[1].messages;
        assert!(msgs.contains(&Message::Tool {
            tool_call_id: "c1".into(),
            content: "error: no broker for /v1/tools/weather".into()
        }));
        assert!(msgs.contains(&Message::Tool {
            tool_call_id: "c2".into(),
            content: "error: no broker for /v1/mcp/docs/search".into()
        }));

        let mut missing = cfg.clone();
        missing.workspace = ws.path().join("absent");
        let (reply, _) = run_scripted(&turn("hi", "ann", false), &missing, vec![text("x")]);
        assert!(!reply.ok);
        assert!(reply
            .error
            .unwrap()
            .starts_with("the workspace is not available"));
    }

    #[test]
    fn fetch_is_offered_only_when_the_turn_has_egress_routes() {
        use crate::testutil::{answer, StubBroker};
        use roundtable_sandbox_protocol::egress::{RouteForm, RouteSpec};
        let ws = TempDir::new();
        let broker = StubBroker::start(vec![answer(
            200,
            &[("Content-Type", "text/plain")],
            b"the page",
        )]);
        let mut cfg = config(&ws);
        cfg.socket = broker.socket().to_path_buf();
        let fetch_call = || {
            calls(&[(
                "c1",
                "fetch",
                r#"{"route":"web","url":"https://example.org/"}"#,
            )])
        };

        let (reply, requests) = run_scripted(
            &turn("read it", "ann", false),
            &cfg,
            vec![fetch_call(), text("no")],
        );
        assert!(reply.ok);
        assert!(requests[0].tools.iter().all(|d| d.name != "fetch"));
        assert!(requests[1].messages.contains(&Message::Tool {
            tool_call_id: "c1".into(),
            content: "error: unknown tool 'fetch'".into()
        }));

        let mut t = turn("read it", "ann", false);
        t.egress = vec![RouteSpec {
            name: "web".into(),
            form: RouteForm::Hosts {
                hosts: vec!["example.org".into()],
            },
            methods: vec!["GET".into()],
            description: String::new(),
        }];
        let (reply, requests) = run_scripted(&t, &cfg, vec![fetch_call(), text("done")]);
        assert_eq!(reply.text.as_deref(), Some("done"));
        let fetch = requests[0]
            .tools
            .iter()
            .find(|d| d.name == "fetch")
            .unwrap();
        // Cut before the turn's own cap of a tool result (32,000 bytes with the default budget).
        assert!(
            fetch.description.contains("at most 30 KiB"),
            "{}",
            fetch.description
        );
        let Some(Message::Tool { content, .. }) = requests[1].messages.last() else {
            panic!("{:?}", requests[1].messages)
        };
        assert!(
            content.starts_with("status 200 (GET https://example.org/ via route web)\n"),
            "{content}"
        );
        assert!(content.ends_with("body (text):\nthe page\n"), "{content}");
        assert_eq!(broker.requests().len(), 1);
    }

    #[test]
    fn the_real_broker_client_end_to_end_over_a_socket() {
        use std::io::{BufRead, BufReader, Read, Write};
        use std::os::unix::net::UnixListener;
        let ws = TempDir::new();
        let cfg = config(&ws);
        let listener = UnixListener::bind(&cfg.socket).unwrap();
        let server = std::thread::spawn(move || {
            let answers = [
                r#"{"choices":[{"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Paris\"}"}}]}}],"usage":{"prompt_tokens":7,"completion_tokens":1}}"#,
                r#"{"ok":true,"content":"sunny"}"#,
                r#"{"choices":[{"message":{"role":"assistant","content":"It is sunny."}}],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#,
            ];
            let mut seen = Vec::new();
            for answer in answers {
                let (stream, _) = listener.accept().unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut head = String::new();
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap();
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    head.push_str(&line);
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                seen.push((head, String::from_utf8(body).unwrap()));
                let mut stream = stream;
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{answer}",
                    answer.len()
                )
                .unwrap();
            }
            seen
        });
        let mut t = turn("weather in Paris?", "ann", false);
        t.tools = vec![ToolSpec {
            name: "weather".into(),
            description: "the weather".into(),
            parameters: json!({"type":"object","properties":{"city":{"type":"string"}}}),
        }];
        let reply = run(&t, &cfg);
        assert_eq!(reply.text.as_deref(), Some("It is sunny."), "{reply:?}");
        let usage = reply.usage.unwrap();
        assert_eq!(
            (
                usage.model_calls,
                usage.tool_calls,
                usage.prompt_tokens,
                usage.completion_tokens
            ),
            (2, 1, Some(16), Some(5))
        );
        let seen = server.join().unwrap();
        assert!(seen[0].0.starts_with("POST /v1/chat/completions HTTP/1.1"));
        let body: Value = serde_json::from_str(&seen[0].1).unwrap();
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream"], false);
        assert!(body.get("api_key").is_none());
        assert!(seen[1].0.starts_with("POST /v1/tools/weather HTTP/1.1"));
        assert_eq!(seen[1].1, r#"{"city":"Paris"}"#);
        let last: Value = serde_json::from_str(&seen[2].1).unwrap();
        assert_eq!(last["messages"][3]["content"], "sunny");
    }
}
