//! The built-in workspace tools: `read`, `write`, `edit`, `list` and `sh`.
//!
//! Every path goes through [`crate::confine::Root`], so the file tools never act outside
//! the workspace. Outputs are capped so a huge file or a chatty command cannot flood the
//! session. The session directory (`.roundtable`) is off limits to `write` and `edit`.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use roundtable_sandbox_protocol::builtin_tools as builtin;
use serde_json::{json, Map, Value};

use crate::chat::ToolDef;
use crate::confine::{create_regular, open_regular, PathError, Root};
use crate::session::SESSION_DIR;

/// The most bytes `read` returns in one call.
pub const READ_CAP: usize = 64 * 1024;
/// The default and largest number of lines `read` returns in one call.
const READ_LINES: u64 = 2000;
/// The largest file `write` writes and `edit` edits.
const FILE_CAP: usize = 4 * 1024 * 1024;
/// The most entries `list` shows.
const LIST_CAP: usize = 500;
/// The most bytes of each of stdout and stderr that `sh` keeps.
const SH_OUTPUT_CAP: usize = 16 * 1024;

/// Why a built-in tool call failed; shown to the model as the tool's error.
#[derive(Debug)]
pub enum ToolError {
    /// A path was refused or could not be resolved.
    Path(PathError),
    /// An argument is missing, of the wrong type, or unknown.
    Argument(String),
    /// The path is the guest's own session directory.
    Reserved,
    /// `edit` found the text zero or several times.
    Edit(String),
    /// Reading, writing or running failed.
    Io(String),
}

impl std::fmt::Display for ToolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ToolError::Path(e) => e.fmt(f),
            ToolError::Argument(why) => write!(f, "invalid arguments: {why}"),
            ToolError::Reserved => write!(
                f,
                "'{SESSION_DIR}' holds the session and cannot be changed with file tools"
            ),
            ToolError::Edit(why) => f.write_str(why),
            ToolError::Io(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for ToolError {}

impl From<PathError> for ToolError {
    fn from(e: PathError) -> Self {
        ToolError::Path(e)
    }
}

/// How `sh` runs commands.
#[derive(Debug, Clone)]
pub struct ShellOptions {
    /// The shell, run as `<shell> -c <command>` (in the image: `/bin/sh`, busybox).
    pub shell: PathBuf,
    /// `PATH` in the command's otherwise empty environment.
    pub path_env: String,
    /// The default timeout.
    pub default_timeout: Duration,
    /// The longest timeout the model may ask for.
    pub max_timeout: Duration,
}

impl Default for ShellOptions {
    fn default() -> Self {
        Self {
            shell: PathBuf::from("/bin/sh"),
            path_env: "/bin".into(),
            default_timeout: Duration::from_secs(30),
            max_timeout: Duration::from_secs(120),
        }
    }
}

/// The built-in tools over one workspace.
#[derive(Debug, Clone)]
pub struct Builtins {
    root: Root,
    shell: ShellOptions,
}

/// The names of the built-in tools (defined once, in the protocol crate).
pub use roundtable_sandbox_protocol::builtin_tools::ALL as BUILTIN_NAMES;

impl Builtins {
    /// Built-ins over `root`, running commands as `shell` says.
    pub fn new(root: Root, shell: ShellOptions) -> Self {
        Self { root, shell }
    }

    /// The tool definitions offered to the model.
    pub fn definitions() -> Vec<ToolDef> {
        let def = |name: &str, description: &str, parameters: Value| ToolDef {
            name: name.into(),
            description: description.into(),
            parameters,
        };
        vec![
            def(
                builtin::READ,
                "Read a text file in the workspace. Returns up to `limit` lines (default 2000) starting at line `offset` (1-based, default 1), at most 64 KiB.",
                json!({"type":"object","properties":{
                    "path":{"type":"string","description":"file path relative to the workspace"},
                    "offset":{"type":"integer","minimum":1},
                    "limit":{"type":"integer","minimum":1}},
                    "required":["path"],"additionalProperties":false}),
            ),
            def(
                builtin::WRITE,
                "Create or overwrite a file in the workspace with the given content. Parent directories are created.",
                json!({"type":"object","properties":{
                    "path":{"type":"string"},
                    "content":{"type":"string"}},
                    "required":["path","content"],"additionalProperties":false}),
            ),
            def(
                builtin::EDIT,
                "Replace exactly one occurrence of old_text with new_text in a workspace file. Fails if old_text is absent or occurs more than once.",
                json!({"type":"object","properties":{
                    "path":{"type":"string"},
                    "old_text":{"type":"string"},
                    "new_text":{"type":"string"}},
                    "required":["path","old_text","new_text"],"additionalProperties":false}),
            ),
            def(
                builtin::LIST,
                "List a directory of the workspace (default: its root). Directories end with '/', symlinks with '@'.",
                json!({"type":"object","properties":{
                    "path":{"type":"string"}},
                    "additionalProperties":false}),
            ),
            def(
                builtin::SH,
                "Run a shell command (busybox sh -c) in the workspace directory, without network. Returns the exit status and the capped output.",
                json!({"type":"object","properties":{
                    "command":{"type":"string"},
                    "timeout_seconds":{"type":"integer","minimum":1,"maximum":120}},
                    "required":["command"],"additionalProperties":false}),
            ),
        ]
    }

    /// Runs the built-in `name`, or `None` when there is no such built-in.
    pub fn call(&self, name: &str, args: &Map<String, Value>) -> Option<Result<String, ToolError>> {
        Some(match name {
            builtin::READ => self.read(args),
            builtin::WRITE => self.write(args),
            builtin::EDIT => self.edit(args),
            builtin::LIST => self.list(args),
            builtin::SH => self.sh(args),
            _ => return None,
        })
    }

    fn read(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        only(args, &["path", "offset", "limit"])?;
        let raw = string(args, "path")?;
        let offset = integer(args, "offset")?.unwrap_or(1).max(1);
        let limit = integer(args, "limit")?
            .unwrap_or(READ_LINES)
            .clamp(1, READ_LINES);
        let path = self.root.existing(raw)?;
        let file = open_regular(&path).map_err(|e| self.io(&path, e))?;
        read_window(file, offset, limit, READ_CAP).map_err(|e| self.io(&path, e))
    }

    fn write(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        only(args, &["path", "content"])?;
        let raw = string(args, "path")?;
        let content = string(args, "content")?;
        if content.len() > FILE_CAP {
            return Err(ToolError::Argument(format!(
                "content larger than {FILE_CAP} bytes"
            )));
        }
        let path = self.root.for_writing(raw, true)?;
        self.writable(&path)?;
        let mut file = create_regular(&path).map_err(|e| self.io(&path, e))?;
        file.write_all(content.as_bytes())
            .map_err(|e| self.io(&path, e))?;
        Ok(format!(
            "wrote {} bytes to {}",
            content.len(),
            self.root.display(&path)
        ))
    }

    fn edit(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        only(args, &["path", "old_text", "new_text"])?;
        let raw = string(args, "path")?;
        let old = string(args, "old_text")?;
        let new = string(args, "new_text")?;
        if old.is_empty() {
            return Err(ToolError::Argument("old_text is empty".into()));
        }
        let path = self.root.existing(raw)?;
        self.writable(&path)?;
        let file = open_regular(&path).map_err(|e| self.io(&path, e))?;
        let mut bytes = Vec::new();
        file.take(FILE_CAP as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| self.io(&path, e))?;
        if bytes.len() > FILE_CAP {
            return Err(ToolError::Io(format!(
                "{} is larger than {FILE_CAP} bytes",
                self.root.display(&path)
            )));
        }
        let text = String::from_utf8(bytes).map_err(|_| {
            ToolError::Io(format!("{} is not utf-8 text", self.root.display(&path)))
        })?;
        let count = text.matches(old).count();
        match count {
            0 => {
                return Err(ToolError::Edit(format!(
                    "old_text was not found in {}",
                    self.root.display(&path)
                )))
            }
            1 => {}
            n => {
                return Err(ToolError::Edit(format!(
                    "old_text occurs {n} times in {}; give more context so it is unique",
                    self.root.display(&path)
                )))
            }
        }
        let updated = text.replacen(old, new, 1);
        let mut file = create_regular(&path).map_err(|e| self.io(&path, e))?;
        file.write_all(updated.as_bytes())
            .map_err(|e| self.io(&path, e))?;
        Ok(format!("edited {}", self.root.display(&path)))
    }

    fn list(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        only(args, &["path"])?;
        let raw = match args.get("path") {
            None | Some(Value::Null) => ".",
            Some(_) => string(args, "path")?,
        };
        let path = self.root.existing(raw)?;
        if !path.is_dir() {
            return Err(PathError::WrongKind(self.root.display(&path), "a directory").into());
        }
        let mut names = Vec::new();
        let mut more = false;
        for entry in std::fs::read_dir(&path).map_err(|e| self.io(&path, e))? {
            let entry = entry.map_err(|e| self.io(&path, e))?;
            if names.len() >= LIST_CAP * 4 {
                more = true;
                break;
            }
            let mut name = entry.file_name().to_string_lossy().into_owned();
            match entry.file_type() {
                Ok(t) if t.is_symlink() => name.push('@'),
                Ok(t) if t.is_dir() => name.push('/'),
                _ => {}
            }
            names.push(name);
        }
        names.sort();
        if names.len() > LIST_CAP {
            names.truncate(LIST_CAP);
            more = true;
        }
        let mut out = format!("{}:\n", self.root.display(&path));
        if names.is_empty() {
            out.push_str("(empty)\n");
        }
        for name in &names {
            out.push_str(name);
            out.push('\n');
        }
        if more {
            out.push_str(&format!("[more entries not shown; listed {LIST_CAP}]\n"));
        }
        Ok(out)
    }

    fn sh(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        only(args, &["command", "timeout_seconds"])?;
        let command = string(args, "command")?;
        let timeout = match integer(args, "timeout_seconds")? {
            Some(secs) => Duration::from_secs(secs.max(1)).min(self.shell.max_timeout),
            None => self.shell.default_timeout,
        };
        run_shell(&self.shell, self.root.path(), command, timeout)
    }

    /// Refuses the session directory.
    fn writable(&self, path: &Path) -> Result<(), ToolError> {
        if path.starts_with(self.root.path().join(SESSION_DIR)) {
            Err(ToolError::Reserved)
        } else {
            Ok(())
        }
    }

    fn io(&self, path: &Path, e: std::io::Error) -> ToolError {
        ToolError::Io(format!("{}: {e}", self.root.display(path)))
    }
}

/// Refuses arguments other than `allowed`.
fn only(args: &Map<String, Value>, allowed: &[&str]) -> Result<(), ToolError> {
    match args.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(key) => Err(ToolError::Argument(format!(
            "unknown argument '{}'",
            crate::chat::cap_text(key, 64)
        ))),
        None => Ok(()),
    }
}

fn string<'a>(args: &'a Map<String, Value>, key: &str) -> Result<&'a str, ToolError> {
    match args.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(ToolError::Argument(format!("{key} must be a string"))),
        None => Err(ToolError::Argument(format!("{key} is required"))),
    }
}

fn integer(args: &Map<String, Value>, key: &str) -> Result<Option<u64>, ToolError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .or_else(|| {
                v.as_f64()
                    .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                    .map(|f| f as u64)
            })
            .map(Some)
            .ok_or_else(|| ToolError::Argument(format!("{key} must be a non-negative integer"))),
    }
}

/// Reads lines `offset..offset+limit` (1-based) of `file`, at most `cap` bytes, without
/// holding more than the window in memory.
fn read_window(
    file: std::fs::File,
    offset: u64,
    limit: u64,
    cap: usize,
) -> std::io::Result<String> {
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let mut line = 1u64;
    let mut shown = 0u64;
    let mut out: Vec<u8> = Vec::new();
    let mut capped = false;
    let mut more = false;
    'outer: loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        let mut i = 0;
        while i < buf.len() {
            if line < offset {
                match buf[i..].iter().position(|&b| b == b'\n') {
                    Some(p) => {
                        i += p + 1;
                        line += 1;
                    }
                    None => i = buf.len(),
                }
                continue;
            }
            if shown >= limit {
                more = true;
                reader.consume(i);
                break 'outer;
            }
            let (end, newline) = match buf[i..].iter().position(|&b| b == b'\n') {
                Some(p) => (i + p + 1, true),
                None => (buf.len(), false),
            };
            let room = cap - out.len();
            if end - i > room {
                out.extend_from_slice(&buf[i..i + room]);
                capped = true;
                reader.consume(i + room);
                break 'outer;
            }
            out.extend_from_slice(&buf[i..end]);
            if newline {
                line += 1;
                shown += 1;
            }
            i = end;
        }
        reader.consume(i);
    }
    if out[..out.len().min(8192)].contains(&0) {
        return Ok("[binary file; not shown]".into());
    }
    if out.is_empty() {
        return Ok(if offset > 1 {
            format!("[nothing at offset {offset}: the file has fewer lines]")
        } else {
            "[empty file]".into()
        });
    }
    let mut text = String::from_utf8_lossy(&out).into_owned();
    if capped {
        text.push_str(&format!(
            "\n[output capped at {cap} bytes in line {line}; continue with offset={}]",
            line + 1
        ));
    } else if more {
        text.push_str(&format!(
            "\n[more lines follow; continue with offset={line}]"
        ));
    }
    Ok(text)
}

/// Runs `<shell> -c command` in `cwd` with a cleared environment, in its own process
/// group, killing the whole group at the timeout (and afterwards, so no background job
/// outlives the call). Output is capped.
pub fn run_shell(
    config: &ShellOptions,
    cwd: &Path,
    command: &str,
    timeout: Duration,
) -> Result<String, ToolError> {
    use std::os::unix::process::CommandExt;

    let mut child = Command::new(&config.shell)
        .arg("-c")
        .arg(command)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", &config.path_env)
        .env("HOME", cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| ToolError::Io(format!("cannot start the shell: {e}")))?;
    let pgid = child.id();
    let (tx, rx) = mpsc::channel();
    for (which, pipe) in [
        (
            0u8,
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ),
        (
            1u8,
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ),
    ] {
        let Some(pipe) = pipe else { continue };
        let tx = tx.clone();
        std::thread::spawn(move || {
            let _ = tx.send((which, drain_capped(pipe, SH_OUTPUT_CAP)));
        });
    }
    drop(tx);

    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => {
                timed_out = true;
                kill_group(pgid);
                let _ = child.kill();
                break child.wait().ok();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(ToolError::Io(format!("waiting for the shell failed: {e}"))),
        }
    };
    // Background jobs left behind would hold the pipes open: end the group.
    kill_group(pgid);

    let mut outputs = [(Vec::new(), false), (Vec::new(), false)];
    let grace = Instant::now() + Duration::from_secs(2);
    for _ in 0..2 {
        let left = grace.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((which, output)) => outputs[usize::from(which)] = output,
            Err(_) => break,
        }
    }
    let [(stdout, out_capped), (stderr, err_capped)] = outputs;
    let mut text = String::new();
    if timed_out {
        text.push_str(&format!(
            "timed out after {} s; the command was killed\n",
            timeout.as_secs()
        ));
    } else {
        match status.and_then(|s| s.code()) {
            Some(code) => text.push_str(&format!("exit status {code}\n")),
            None => text.push_str("killed by a signal\n"),
        }
    }
    for (name, bytes, capped) in [
        ("stdout", stdout, out_capped),
        ("stderr", stderr, err_capped),
    ] {
        if bytes.is_empty() {
            continue;
        }
        text.push_str(&format!("{name}:\n{}", String::from_utf8_lossy(&bytes)));
        if capped {
            text.push_str(&format!("\n[{name} capped at {SH_OUTPUT_CAP} bytes]"));
        }
        if !text.ends_with('\n') {
            text.push('\n');
        }
    }
    Ok(text)
}

/// Reads a pipe to its end, keeping the first `cap` bytes.
fn drain_capped(mut pipe: Box<dyn Read + Send>, cap: usize) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut capped = false;
    let mut buf = [0u8; 8192];
    loop {
        match pipe.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = cap - kept.len();
                if n > room {
                    capped = true;
                }
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    (kept, capped)
}

/// Sends SIGKILL to the process group `pgid` (the shell's own group, made with
/// `process_group(0)`); never to group 0 or 1, which would mean the caller's group or init's.
fn kill_group(pgid: u32) {
    let Ok(raw) = i32::try_from(pgid) else { return };
    if raw <= 1 || pgid == std::process::id() {
        return;
    }
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(raw),
        nix::sys::signal::Signal::SIGKILL,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;

    fn builtins(dir: &TempDir) -> Builtins {
        let shell = ShellOptions {
            path_env: "/bin:/usr/bin".into(),
            ..ShellOptions::default()
        };
        Builtins::new(Root::new(dir.path()).unwrap(), shell)
    }

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn call(b: &Builtins, name: &str, v: Value) -> Result<String, ToolError> {
        b.call(name, &args(v)).unwrap()
    }

    #[test]
    fn write_read_edit_list_round_trip() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        let out = call(
            &b,
            "write",
            json!({"path":"notes/a.txt","content":"one\ntwo\nthree\n"}),
        )
        .unwrap();
        assert_eq!(out, "wrote 14 bytes to notes/a.txt");
        assert_eq!(
            call(&b, "read", json!({"path":"notes/a.txt"})).unwrap(),
            "one\ntwo\nthree\n"
        );
        let window = call(
            &b,
            "read",
            json!({"path":"notes/a.txt","offset":2,"limit":1}),
        )
        .unwrap();
        assert_eq!(window, "two\n\n[more lines follow; continue with offset=3]");
        call(
            &b,
            "edit",
            json!({"path":"notes/a.txt","old_text":"two","new_text":"2"}),
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("notes/a.txt")).unwrap(),
            "one\n2\nthree\n"
        );
        let listing = call(&b, "list", json!({})).unwrap();
        assert_eq!(listing, ".:\nnotes/\n");
        assert!(call(&b, "read", json!({"path":"notes/a.txt","bogus":1})).is_err());
        assert!(call(&b, "read", json!({"path":7})).is_err());
        assert!(b.call("nope", &Map::new()).is_none());
    }

    #[test]
    fn escapes_are_refused() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("pw")).unwrap();
        for path in ["../../etc/passwd", "/etc/passwd", "pw"] {
            let err = call(&b, "read", json!({ "path": path })).unwrap_err();
            assert!(
                err.to_string().contains("outside the workspace"),
                "{path}: {err}"
            );
            let err = call(&b, "write", json!({ "path": path, "content": "x" })).unwrap_err();
            assert!(
                err.to_string().contains("outside the workspace"),
                "{path}: {err}"
            );
        }
        assert!(call(&b, "list", json!({"path":"/etc"})).is_err());
        assert!(call(
            &b,
            "edit",
            json!({"path":"pw","old_text":"root","new_text":"x"})
        )
        .is_err());
    }

    #[test]
    fn a_symlink_made_with_sh_is_refused_by_read() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        let out = call(
            &b,
            "sh",
            json!({"command":"ln -s /etc/passwd link && echo made"}),
        )
        .unwrap();
        assert!(out.contains("made"), "{out}");
        let err = call(&b, "read", json!({"path":"link"})).unwrap_err();
        assert!(err.to_string().contains("outside the workspace"), "{err}");
    }

    #[test]
    fn huge_file_read_is_capped() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        let line = "x".repeat(1000) + "\n";
        std::fs::write(dir.path().join("big.txt"), line.repeat(1000)).unwrap();
        let out = call(&b, "read", json!({"path":"big.txt"})).unwrap();
        assert!(out.len() < READ_CAP + 200, "{}", out.len());
        assert!(
            out.contains("[output capped at 65536 bytes"),
            "{}",
            &out[out.len() - 100..]
        );
        // One enormous line is capped too.
        std::fs::write(dir.path().join("line.txt"), "y".repeat(1 << 20)).unwrap();
        let out = call(&b, "read", json!({"path":"line.txt","offset":1})).unwrap();
        assert!(out.len() < READ_CAP + 200);
        std::fs::write(dir.path().join("empty"), "").unwrap();
        assert_eq!(
            call(&b, "read", json!({"path":"empty"})).unwrap(),
            "[empty file]"
        );
        let out = call(&b, "read", json!({"path":"big.txt","offset":5000})).unwrap();
        assert!(out.starts_with("[nothing at offset 5000"), "{out}");
        std::fs::write(dir.path().join("bin"), [0u8, 1, 2]).unwrap();
        assert_eq!(
            call(&b, "read", json!({"path":"bin"})).unwrap(),
            "[binary file; not shown]"
        );
    }

    #[test]
    fn edit_refuses_absent_and_non_unique_text() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        std::fs::write(dir.path().join("f"), "a a b").unwrap();
        let err = call(
            &b,
            "edit",
            json!({"path":"f","old_text":"zz","new_text":"x"}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("not found"), "{err}");
        let err = call(
            &b,
            "edit",
            json!({"path":"f","old_text":"a","new_text":"x"}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("occurs 2 times"), "{err}");
        let err = call(&b, "edit", json!({"path":"f","old_text":"","new_text":"x"})).unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("f")).unwrap(),
            "a a b"
        );
    }

    #[test]
    fn the_session_directory_is_reserved() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        let err = call(
            &b,
            "write",
            json!({"path":".roundtable/session.json","content":"{}"}),
        )
        .unwrap_err();
        assert!(matches!(err, ToolError::Reserved), "{err}");
    }

    #[test]
    fn sh_runs_a_pipeline_in_the_workspace() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        let out = call(&b, "sh", json!({"command":"echo hi | wc -c"})).unwrap();
        assert!(out.starts_with("exit status 0\nstdout:\n"), "{out}");
        assert_eq!(out.trim_end().rsplit('\n').next().unwrap().trim(), "3");
        let out = call(
            &b,
            "sh",
            json!({"command":"pwd; echo $HOME; env | wc -l; exit 3"}),
        )
        .unwrap();
        let root = dir.path().display().to_string();
        assert!(out.starts_with("exit status 3\n"), "{out}");
        assert!(out.contains(&format!("{root}\n{root}\n")), "{out}");
        let out = call(&b, "sh", json!({"command":"echo oops >&2"})).unwrap();
        assert!(out.contains("stderr:\noops\n"), "{out}");
    }

    #[test]
    fn sh_times_out_and_kills_background_jobs() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        let start = Instant::now();
        let out = call(&b, "sh", json!({"command":"sleep 30","timeout_seconds":1})).unwrap();
        assert!(out.starts_with("timed out after 1 s"), "{out}");
        assert!(start.elapsed() < Duration::from_secs(10));
        // A background job holding stdout open does not keep the call waiting.
        let start = Instant::now();
        let out = call(&b, "sh", json!({"command":"sleep 30 & echo started"})).unwrap();
        assert!(out.contains("started"), "{out}");
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn sh_output_is_capped() {
        let dir = TempDir::new();
        let b = builtins(&dir);
        let out = call(
            &b,
            "sh",
            json!({"command":"i=0; while [ $i -lt 3000 ]; do echo 0123456789; i=$((i+1)); done"}),
        )
        .unwrap();
        assert!(
            out.contains("[stdout capped at 16384 bytes]"),
            "{}",
            out.len()
        );
        assert!(out.len() < SH_OUTPUT_CAP + 200);
    }
}
