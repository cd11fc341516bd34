//! The tools offered to the model: the built-ins, the host tools of the turn, and the
//! MCP tools of the turn, with the names the model sees and the way back to each.
//!
//! Names toward the model follow the OpenAI rule `^[A-Za-z0-9_-]{1,64}$`:
//! - built-ins: `read`, `write`, `edit`, `list`, `sh`, and `fetch` when the turn has egress
//!   routes (they win over a host tool of the same name, which is then left out and
//!   logged; `fetch` is reserved even when it is not offered);
//! - host tools: their name as given (one that breaks the rule is left out and logged);
//! - MCP tools: `mcp__{server}__{tool}`, every character outside `[A-Za-z0-9_-]` replaced
//!   by `_`, cut to 64 characters, and made unique with a `_2`, `_3` … suffix when two
//!   would collide. The name is mapped back to the exact server and tool when called.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use roundtable_sandbox_protocol::{paths, McpServerSpec, ToolSpec};

use crate::agent::Tools;
use crate::chat::{cap_text, ToolDef};
use crate::fetch::Fetcher;
use crate::http::encode_segment;
use crate::tools::{Builtins, BUILTIN_NAMES};

/// The longest tool name a model accepts.
const MAX_NAME: usize = 64;

/// Calls a host or MCP tool through the broker.
pub trait Remote {
    /// `POST path` with the arguments object: `Ok(content)` or `Err(error for the model)`.
    fn call(&mut self, path: &str, args: &Map<String, Value>) -> Result<String, String>;
}

/// Where a tool name leads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Builtin,
    Fetch,
    Host(String),
    Mcp { server: String, tool: String },
}

/// All tools of one turn.
#[derive(Debug)]
pub struct Toolbox<R> {
    builtins: Builtins,
    fetch: Option<Fetcher>,
    remote: R,
    defs: Vec<ToolDef>,
    routes: BTreeMap<String, Route>,
}

/// Whether `name` is acceptable as a tool name toward the model.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Replaces every character outside `[A-Za-z0-9_-]` by `_`.
fn sanitize(part: &str) -> String {
    part.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The name an MCP tool gets toward the model, before de-duplication.
pub fn mcp_tool_name(server: &str, tool: &str) -> String {
    let mut name = format!("mcp__{}__{}", sanitize(server), sanitize(tool));
    name.truncate(MAX_NAME);
    name
}

/// A schema the model can take: the given one when it is an object, else an empty one.
fn schema(parameters: &Value) -> Value {
    if parameters.is_object() {
        parameters.clone()
    } else {
        serde_json::json!({"type":"object","properties":{}})
    }
}

impl<R: Remote> Toolbox<R> {
    /// The tools of a turn: built-ins (`fetch` when the turn has egress routes), then
    /// `host`, then `mcp`.
    pub fn new(
        builtins: Builtins,
        fetch: Option<Fetcher>,
        host: &[ToolSpec],
        mcp: &[McpServerSpec],
        remote: R,
    ) -> Self {
        let mut defs = Builtins::definitions();
        let mut routes: BTreeMap<String, Route> = BUILTIN_NAMES
            .iter()
            .map(|n| ((*n).to_string(), Route::Builtin))
            .collect();
        if let Some(fetch) = &fetch {
            defs.push(fetch.definition());
            routes.insert(fetch.definition().name, Route::Fetch);
        }
        for tool in host {
            if !valid_name(&tool.name) {
                log(&format!(
                    "host tool '{}' has an invalid name; left out",
                    cap_text(&tool.name, 80)
                ));
                continue;
            }
            if routes.contains_key(&tool.name) {
                log(&format!(
                    "host tool '{}' clashes with another tool; left out",
                    tool.name
                ));
                continue;
            }
            routes.insert(tool.name.clone(), Route::Host(tool.name.clone()));
            defs.push(ToolDef {
                name: tool.name.clone(),
                description: tool.description.clone(),
                parameters: schema(&tool.parameters),
            });
        }
        for server in mcp {
            for tool in &server.tools {
                let base = mcp_tool_name(&server.server, &tool.name);
                let mut name = base.clone();
                let mut n = 1;
                while routes.contains_key(&name) {
                    n += 1;
                    let suffix = format!("_{n}");
                    let mut stem = base.clone();
                    stem.truncate(MAX_NAME - suffix.len());
                    name = stem + &suffix;
                }
                routes.insert(
                    name.clone(),
                    Route::Mcp {
                        server: server.server.clone(),
                        tool: tool.name.clone(),
                    },
                );
                defs.push(ToolDef {
                    name,
                    description: tool.description.clone(),
                    parameters: schema(&tool.parameters),
                });
            }
        }
        Self {
            builtins,
            fetch,
            remote,
            defs,
            routes,
        }
    }

    /// The remote caller (for tests).
    #[cfg(test)]
    pub fn remote(&self) -> &R {
        &self.remote
    }
}

impl<R: Remote> Tools for Toolbox<R> {
    fn definitions(&self) -> Vec<ToolDef> {
        self.defs.clone()
    }

    fn call(&mut self, name: &str, args: &Map<String, Value>) -> Result<String, String> {
        match self.routes.get(name) {
            Some(Route::Builtin) => match self.builtins.call(name, args) {
                Some(result) => result.map_err(|e| e.to_string()),
                None => Err(format!("unknown tool '{name}'")),
            },
            Some(Route::Fetch) => match &self.fetch {
                Some(fetch) => fetch.call(args),
                None => Err(format!("unknown tool '{name}'")),
            },
            Some(Route::Host(tool)) => {
                let path = format!("{}{}", paths::TOOLS_PREFIX, encode_segment(tool));
                self.remote.call(&path, args)
            }
            Some(Route::Mcp { server, tool }) => {
                let path = format!(
                    "{}{}/{}",
                    paths::MCP_PREFIX,
                    encode_segment(server),
                    encode_segment(tool)
                );
                self.remote.call(&path, args)
            }
            None => Err(format!("unknown tool '{}'", cap_text(name, 64))),
        }
    }
}

fn log(message: &str) {
    eprintln!("roundtable-guest: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confine::Root;
    use crate::testutil::TempDir;
    use crate::tools::ShellOptions;
    use serde_json::json;

    #[derive(Debug, Default)]
    struct Recorder(Vec<(String, Map<String, Value>)>);

    impl Remote for Recorder {
        fn call(&mut self, path: &str, args: &Map<String, Value>) -> Result<String, String> {
            self.0.push((path.to_string(), args.clone()));
            Ok(format!("called {path}"))
        }
    }

    fn spec(name: &str) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: format!("{name} tool"),
            parameters: json!({"type":"object"}),
        }
    }

    #[test]
    fn names_and_routes() {
        let dir = TempDir::new();
        let builtins = Builtins::new(Root::new(dir.path()).unwrap(), ShellOptions::default());
        let host = vec![
            spec("weather"),
            spec("read"),
            spec("bad name"),
            spec("weather"),
        ];
        let long = "t".repeat(80);
        let mcp = vec![
            McpServerSpec {
                server: "git.hub".into(),
                tools: vec![spec("search/issues"), spec("search_issues"), spec(&long)],
            },
            McpServerSpec {
                server: "x".into(),
                tools: vec![ToolSpec {
                    parameters: json!("not a schema"),
                    ..spec("y")
                }],
            },
        ];
        let mut tb = Toolbox::new(builtins, None, &host, &mcp, Recorder::default());
        let names: Vec<String> = tb.definitions().into_iter().map(|d| d.name).collect();
        assert_eq!(
            names,
            vec![
                "read",
                "write",
                "edit",
                "list",
                "sh",
                "weather",
                "mcp__git_hub__search_issues",
                "mcp__git_hub__search_issues_2",
                &mcp_tool_name("git.hub", &long),
                "mcp__x__y",
            ]
        );
        assert!(names.iter().all(|n| valid_name(n)), "{names:?}");
        assert_eq!(mcp_tool_name("git.hub", &long).len(), 64);
        assert!(tb.definitions()[9].parameters.is_object());

        let args = json!({"q":"rust"}).as_object().unwrap().clone();
        assert_eq!(
            tb.call("weather", &args).unwrap(),
            "called /v1/tools/weather"
        );
        assert_eq!(
            tb.call("mcp__git_hub__search_issues", &args).unwrap(),
            "called /v1/mcp/git.hub/search%2Fissues"
        );
        assert_eq!(
            tb.call("mcp__git_hub__search_issues_2", &args).unwrap(),
            "called /v1/mcp/git.hub/search_issues"
        );
        assert_eq!(
            tb.call("bad name", &args).unwrap_err(),
            "unknown tool 'bad name'"
        );
        assert_eq!(tb.remote().0.len(), 3);
        assert_eq!(tb.remote().0[0].1, args);
        // The built-in `read` is not routed to the host tool of the same name.
        assert!(tb
            .call("read", &json!({"path":"nope"}).as_object().unwrap().clone())
            .is_err());
        assert_eq!(tb.remote().0.len(), 3);
    }
}
