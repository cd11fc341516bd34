//! The embedded offline model: an OpenAI-compatible endpoint on loopback that plays a fixed,
//! deterministic script, so a first run shows a real sealed turn without any account.
//!
//! For each guest message it drives the guest's tools for real, one step per request:
//! `write` the message to `notes/last-message.txt`, `read` it back, run `sh` (which shows
//! the sandbox from inside), call the first host tool offered (arguments made up from its
//! schema), then answer with what each step returned. It decides by looking at the tool
//! results since the last user message, so it keeps no state between requests.
//!
//! Like a real model it does what the guest asks: a message of the form `name: run: CMD`
//! makes the `sh` step run `CMD` (a guest could ask a real model the same).
//!
//! It listens on `127.0.0.1` only; use it with `allow_http`.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use roundtable_sandbox_protocol::builtin_tools::{self, READ, SH, WRITE};
use serde_json::{json, Value};

/// The model name the offline endpoint reports.
pub const OFFLINE_MODEL: &str = "roundtable-offline-demo";

/// A running offline model; stops when dropped.
#[derive(Debug)]
pub struct OfflineModel {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl OfflineModel {
    /// Starts the endpoint on an ephemeral loopback port.
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|req| async move {
                        Ok::<_, Infallible>(answer(req).await)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self { addr, task })
    }

    /// The API base to configure as `model_url`.
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

impl Drop for OfflineModel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return json_response(400, json!({"error": "unreadable body"})),
    };
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return json_response(400, json!({"error": "malformed JSON"}));
    };
    json_response(200, completion(next_message(&request)))
}

fn json_response(status: u16, body: Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("static response parts are valid")
}

fn completion(message: Value) -> Value {
    json!({
        "id": "offline",
        "object": "chat.completion",
        "model": OFFLINE_MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    })
}

fn text(content: String) -> Value {
    json!({"role": "assistant", "content": content})
}

fn call(step: usize, name: &str, arguments: Value) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [{
        "id": format!("offline-{step}"),
        "type": "function",
        "function": {"name": name, "arguments": arguments.to_string()}
    }]})
}

const NOTE: &str = "notes/last-message.txt";

/// The script: what to send next, given the conversation so far.
pub fn next_message(request: &Value) -> Value {
    let messages = request["messages"].as_array().cloned().unwrap_or_default();
    let system = messages
        .first()
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    if system.starts_with("You compact the conversation") {
        return text("Earlier, guests chatted with the offline demo model; their notes are in the workspace.\nFiles to reload:\n- notes/last-message.txt".into());
    }
    let last_user = messages.iter().rposition(|m| m["role"] == "user");
    let said = last_user
        .and_then(|i| messages[i]["content"].as_str())
        .unwrap_or_default()
        .to_owned();
    let earlier_guest_messages = messages
        .iter()
        .filter(|m| m["role"] == "user")
        .count()
        .saturating_sub(1);
    let results: Vec<String> = last_user
        .map(|i| &messages[i + 1..])
        .unwrap_or_default()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect();
    let host_tool = request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let f = &t["function"];
            let name = f["name"].as_str()?;
            (!builtin_tools::ALL.contains(&name) && !name.starts_with("mcp__"))
                .then(|| (name.to_owned(), example_arguments(&f["parameters"])))
        })
        .next();
    match results.len() {
        0 => call(0, WRITE, json!({"path": NOTE, "content": said})),
        1 => call(1, READ, json!({"path": NOTE})),
        2 => {
            let command = asked_command(&said).map_or_else(
                || "echo \"uid $(id -u), net: $(ls /sys/class/net | tr '\\n' ' ')\"; wc -c < notes/last-message.txt".to_owned(),
                str::to_owned,
            );
            call(2, SH, json!({"command": command, "timeout_seconds": 120}))
        }
        3 if host_tool.is_some() => {
            let (name, args) = host_tool.expect("checked");
            call(3, &name, args)
        }
        _ => {
            let short = |s: &str| {
                let one_line = s.split_whitespace().collect::<Vec<_>>().join(" ");
                let cut: String = one_line.chars().take(120).collect();
                if cut.len() < one_line.len() {
                    format!("{cut}…")
                } else {
                    cut
                }
            };
            let sh_said = results.get(2).map_or("", String::as_str);
            let mut out = format!(
                "[offline demo model] I saved your message to {NOTE} and read it back ({}); ",
                short(results.get(1).map_or("", String::as_str)),
            );
            match asked_command(&said) {
                // What the guest asked to see: the command's whole output, as the guest's
                // `sh` tool returned it (capped there, at its output cap).
                Some(command) => out.push_str(&format!(
                    "`{command}` in the sandbox said:\n{}\n",
                    sh_said.trim_end()
                )),
                None => out.push_str(&format!("`sh` in the sandbox said: {}.", short(sh_said))),
            }
            if let (Some((name, _)), Some(result)) = (&host_tool, results.get(3)) {
                out.push_str(&format!(
                    " The host tool {name} answered: {}.",
                    short(result)
                ));
            }
            out.push_str(&format!(
                " This channel's session holds {earlier_guest_messages} earlier message(s)."
            ));
            text(out)
        }
    }
}

/// The command a guest message of the form `name: run: CMD` asks to run.
fn asked_command(said: &str) -> Option<&str> {
    said.split_once(": ")
        .map_or(said, |(_, t)| t)
        .strip_prefix("run: ")
}

/// Arguments that satisfy a simple schema: required properties with a value of their type.
fn example_arguments(schema: &Value) -> Value {
    let mut args = serde_json::Map::new();
    let props = schema["properties"].as_object();
    for name in schema["required"].as_array().into_iter().flatten() {
        let Some(name) = name.as_str() else { continue };
        let prop = props.and_then(|p| p.get(name)).cloned().unwrap_or_default();
        let value = if let Some(first) = prop["enum"].as_array().and_then(|e| e.first()) {
            first.clone()
        } else {
            match prop["type"].as_str() {
                Some("integer") => json!(prop["minimum"].as_i64().unwrap_or(0).max(6)),
                Some("number") => json!(1.0),
                Some("boolean") => json!(true),
                Some("array") => json!([]),
                Some("object") => json!({}),
                _ => json!("demo"),
            }
        };
        args.insert(name.to_owned(), value);
    }
    Value::Object(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(tool_results: usize, with_host_tool: bool) -> Value {
        let mut messages = vec![
            json!({"role": "system", "content": "prompt"}),
            json!({"role": "user", "content": "ann: hello"}),
        ];
        for i in 0..tool_results {
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": []}));
            messages.push(json!({"role": "tool", "tool_call_id": i.to_string(), "content": format!("result {i}")}));
        }
        let mut tools =
            vec![json!({"type": "function", "function": {"name": "sh", "parameters": {}}})];
        if with_host_tool {
            tools.push(json!({"type": "function", "function": {"name": "roll_dice",
                "parameters": {"type": "object", "properties": {"sides": {"type": "integer", "minimum": 2}}, "required": ["sides"]}}}));
        }
        json!({"messages": messages, "tools": tools})
    }

    #[test]
    fn plays_write_read_sh_host_tool_then_answers() {
        let name = |v: Value| {
            v["tool_calls"][0]["function"]["name"]
                .as_str()
                .map(str::to_owned)
        };
        assert_eq!(name(next_message(&req(0, true))).as_deref(), Some("write"));
        assert_eq!(name(next_message(&req(1, true))).as_deref(), Some("read"));
        assert_eq!(name(next_message(&req(2, true))).as_deref(), Some("sh"));
        let host = next_message(&req(3, true));
        assert_eq!(name(host.clone()).as_deref(), Some("roll_dice"));
        assert_eq!(
            host["tool_calls"][0]["function"]["arguments"],
            json!({"sides": 6}).to_string()
        );
        let done = next_message(&req(4, true));
        let content = done["content"].as_str().unwrap();
        assert!(
            content.contains("roll_dice answered: result 3"),
            "{content}"
        );
        assert!(content.contains("0 earlier message(s)"), "{content}");
        let mut asked = req(2, false);
        asked["messages"][1]["content"] = json!("ann: run: sleep 30");
        let sh = next_message(&asked);
        assert_eq!(
            sh["tool_calls"][0]["function"]["arguments"],
            json!({"command": "sleep 30", "timeout_seconds": 120}).to_string()
        );
        // Without a host tool the answer comes after sh.
        assert!(next_message(&req(3, false))["content"].is_string());
    }

    #[test]
    fn a_run_answer_shows_the_whole_output() {
        let mut asked = req(3, false);
        asked["messages"][1]["content"] = json!("ann: run: seq 1 2000");
        let output = format!(
            "exit status 0\nstdout:\n{}",
            (1..=2000).map(|i| format!("{i}\n")).collect::<String>()
        );
        asked["messages"][7]["content"] = json!(output);
        let done = next_message(&asked);
        let content = done["content"].as_str().unwrap();
        assert!(
            content.contains(&format!(
                "`seq 1 2000` in the sandbox said:\n{}",
                output.trim_end()
            )),
            "{content}"
        );
        // Without `run:` the sh result is summed up on one line.
        let plain = next_message(&req(3, false));
        assert!(plain["content"]
            .as_str()
            .unwrap()
            .contains("`sh` in the sandbox said: result 2."));
    }
}
