//! A real Synapse homeserver for the tests, started on loopback with SQLite from the venv
//! `scripts/synapse-venv.sh` makes, and a small client of its APIs (HTTP/1.0 over a TCP
//! stream: every request is one connection, read to its end).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use serde_json::{json, Value};

/// Kills its child when dropped (each a specific pid we started).
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_until_or(what: &str, mut ok: impl FnMut() -> bool, context: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out waiting for {what}; {}", context());
}

/// The venv's Python (`$ROUNDTABLE_SYNAPSE_VENV`, else the clone's `.venv-synapse`).
fn python() -> PathBuf {
    let venv = std::env::var_os("ROUNDTABLE_SYNAPSE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-synapse"));
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "no Synapse venv at {}: run scripts/synapse-venv.sh (scripts/test.sh does)",
        venv.display()
    );
    python
}

/// The shared secret the tests register users with.
const SHARED_SECRET: &str = "roundtable-test-registration-secret";

/// A running Synapse (killed when dropped) and its client API.
pub struct Synapse {
    _proc: Proc,
    pub port: u16,
    pub url: String,
    dir: PathBuf,
}

/// Starts Synapse in `dir` (its config, SQLite database, media and log there), listening on
/// `127.0.0.1` only, without federation or key servers, registration by shared secret only.
/// `rc_message` is every user's message rate limit (per second, burst), the bot's included.
pub fn start(dir: &Path, rc_message: (f64, u32)) -> Synapse {
    let port = free_port();
    let d = dir.join("synapse");
    std::fs::create_dir_all(&d).unwrap();
    let base = d.join("homeserver.yaml");
    // The generated config: its signing key, secrets and log config.
    let generated = Command::new(python())
        .args(["-m", "synapse.app.homeserver", "--server-name", "localhost"])
        .arg("--config-path")
        .arg(&base)
        .args(["--generate-config", "--report-stats=no"])
        .current_dir(&d)
        .output()
        .unwrap();
    assert!(generated.status.success(), "{generated:?}");
    // Read after it: the listener on loopback alone (client API only), no key servers, the
    // tests' limits.
    let overrides = d.join("test.yaml");
    let (per_second, burst) = rc_message;
    std::fs::write(
        &overrides,
        format!(
            "listeners:\n  - port: {port}\n    bind_addresses: ['127.0.0.1']\n    type: http\n    tls: false\n    x_forwarded: false\n    resources:\n      - names: [client]\n        compress: false\n\
             trusted_key_servers: []\nsuppress_key_server_warning: true\nregistration_shared_secret: \"{SHARED_SECRET}\"\n\
             enable_registration: false\npresence:\n  enabled: false\n\
             rc_message:\n  per_second: {per_second}\n  burst_count: {burst}\n\
             rc_invites:\n  per_room: {{per_second: 100, burst_count: 100}}\n  per_user: {{per_second: 100, burst_count: 100}}\n  per_issuer: {{per_second: 100, burst_count: 100}}\n\
             rc_joins:\n  local: {{per_second: 100, burst_count: 100}}\n\
             rc_login:\n  address: {{per_second: 100, burst_count: 100}}\n  account: {{per_second: 100, burst_count: 100}}\n"
        ),
    )
    .unwrap();
    launch(d, port)
}

/// Runs the Synapse configured in `d` on `port`; returns once it answers.
fn launch(d: PathBuf, port: u16) -> Synapse {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(d.join("stderr.log"))
        .unwrap();
    let proc = Proc(
        Command::new(python())
            .args(["-m", "synapse.app.homeserver", "-c"])
            .arg(d.join("homeserver.yaml"))
            .arg("-c")
            .arg(d.join("test.yaml"))
            .current_dir(&d)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let url = format!("http://127.0.0.1:{port}");
    let hs = Synapse {
        _proc: proc,
        port,
        url,
        dir: d.clone(),
    };
    wait_until_or(
        "Synapse to listen",
        || {
            hs.try_request("GET", "/_matrix/client/versions", None, None)
                .is_ok()
        },
        || std::fs::read_to_string(d.join("stderr.log")).unwrap_or_default(),
    );
    hs
}

/// A user's id and access token.
#[derive(Clone, Debug)]
pub struct User {
    pub id: String,
    pub token: String,
}

impl Synapse {
    /// Stops this Synapse (killed: its clients' connections drop) and returns a closure
    /// that starts it again, on the same port and database.
    pub fn kill(self) -> impl FnOnce() -> Synapse {
        let (dir, port) = (self.dir.clone(), self.port);
        drop(self);
        move || launch(dir, port)
    }

    fn try_request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> std::io::Result<(u16, Value)> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut head = format!(
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        if let Some(t) = token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        s.write_all(body.as_bytes())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        let text = String::from_utf8_lossy(&out);
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| std::io::Error::other(format!("no head in {text:?}")))?;
        let status: u16 = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status in {head:?}")))?;
        let value = serde_json::from_str(body).unwrap_or(Value::Null);
        Ok((status, value))
    }

    /// A request; a 429 is waited out as the server says and sent again; any other status
    /// but 200 panics.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Value {
        for _ in 0..100 {
            let (status, value) = self.try_request(method, path, token, body).unwrap();
            match status {
                200 => return value,
                429 => {
                    let ms = value["retry_after_ms"].as_u64().unwrap_or(500);
                    std::thread::sleep(Duration::from_millis(ms));
                }
                _ => panic!("{method} {path}: {status} {value}"),
            }
        }
        panic!("{method} {path}: rate-limited for ever");
    }

    /// Registers `name` with the shared secret (as the admin API's `register` wants: an
    /// HMAC-SHA1 of the nonce, the name, the password and the admin flag).
    pub fn register(&self, name: &str, password: &str, admin: bool) -> User {
        let nonce = self.call("GET", "/_synapse/admin/v1/register", None, None)["nonce"]
            .as_str()
            .unwrap()
            .to_owned();
        let mut mac = Hmac::<sha1::Sha1>::new_from_slice(SHARED_SECRET.as_bytes()).unwrap();
        let kind = if admin { "admin" } else { "notadmin" };
        mac.update(format!("{nonce}\0{name}\0{password}\0{kind}").as_bytes());
        let digest: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let r = self.call(
            "POST",
            "/_synapse/admin/v1/register",
            None,
            Some(&json!({"nonce": nonce, "username": name, "password": password, "admin": admin, "mac": digest})),
        );
        User {
            id: r["user_id"].as_str().unwrap().to_owned(),
            token: r["access_token"].as_str().unwrap().to_owned(),
        }
    }

    /// A room made by `by`, `invite`d, encrypted or not; its id.
    pub fn create_room(&self, by: &User, invite: &[&str], encrypted: bool) -> String {
        let mut body = json!({"preset": "private_chat", "invite": invite});
        if encrypted {
            body["initial_state"] = json!([{
                "type": "m.room.encryption", "state_key": "",
                "content": {"algorithm": "m.megolm.v1.aes-sha2"}
            }]);
        }
        self.call(
            "POST",
            "/_matrix/client/v3/createRoom",
            Some(&by.token),
            Some(&body),
        )["room_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub fn join(&self, user: &User, room: &str) {
        self.call(
            "POST",
            &format!("/_matrix/client/v3/join/{}", enc(room)),
            Some(&user.token),
            Some(&json!({})),
        );
    }

    pub fn invite(&self, by: &User, room: &str, whom: &str) {
        self.call(
            "POST",
            &format!("/_matrix/client/v3/rooms/{}/invite", enc(room)),
            Some(&by.token),
            Some(&json!({"user_id": whom})),
        );
    }

    /// Where `user`'s sync is now (an initial sync's `next_batch`).
    pub fn sync_token(&self, user: &User) -> String {
        self.call(
            "GET",
            "/_matrix/client/v3/sync?timeout=0",
            Some(&user.token),
            None,
        )["next_batch"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// Who is typing in `room` by the last change since `since` (`None`: no change), as
    /// `user`'s sync shows it (an initial sync does not show typing); `since` moves on.
    pub fn typing_since(&self, user: &User, room: &str, since: &mut String) -> Option<Vec<String>> {
        let sync = self.call(
            "GET",
            &format!("/_matrix/client/v3/sync?timeout=0&since={}", enc(since)),
            Some(&user.token),
            None,
        );
        *since = sync["next_batch"].as_str().unwrap().to_owned();
        sync["rooms"]["join"][room]["ephemeral"]["events"]
            .as_array()
            .into_iter()
            .flatten()
            .rfind(|e| e["type"] == "m.typing")
            .map(|e| {
                e["content"]["user_ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|u| u.as_str().map(str::to_owned))
                    .collect()
            })
    }

    pub fn kick(&self, by: &User, room: &str, whom: &str, reason: &str) {
        self.call(
            "POST",
            &format!("/_matrix/client/v3/rooms/{}/kick", enc(room)),
            Some(&by.token),
            Some(&json!({"user_id": whom, "reason": reason})),
        );
    }

    /// Sends `content` (an `m.room.message`) as `by`; the event's id.
    pub fn send(&self, by: &User, room: &str, content: Value) -> String {
        static TXN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let txn = format!(
            "t{}-{}",
            std::process::id(),
            TXN.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        );
        self.call(
            "PUT",
            &format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/{txn}",
                enc(room)
            ),
            Some(&by.token),
            Some(&content),
        )["event_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// A plain text message.
    pub fn say(&self, by: &User, room: &str, body: &str) -> String {
        self.send(by, room, json!({"msgtype": "m.text", "body": body}))
    }

    /// The room's last events as `user` sees them, oldest first.
    pub fn messages(&self, user: &User, room: &str) -> Vec<Value> {
        let r = self.call(
            "GET",
            &format!(
                "/_matrix/client/v3/rooms/{}/messages?dir=b&limit=200",
                enc(room)
            ),
            Some(&user.token),
            None,
        );
        let mut events = r["chunk"].as_array().cloned().unwrap_or_default();
        events.reverse();
        events
    }

    /// `whom`'s membership in `room` as `user` sees it.
    pub fn membership(&self, user: &User, room: &str, whom: &str) -> String {
        let (status, v) = self
            .try_request(
                "GET",
                &format!(
                    "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
                    enc(room),
                    enc(whom)
                ),
                Some(&user.token),
                None,
            )
            .unwrap();
        if status != 200 {
            return format!("none ({status})");
        }
        v["membership"].as_str().unwrap_or("?").to_owned()
    }

    /// Lifts `user`'s own message rate limit (the admin API), for a flooding test user.
    pub fn unlimit(&self, admin: &User, user: &User) {
        self.call(
            "POST",
            &format!(
                "/_synapse/admin/v1/users/{}/override_ratelimit",
                enc(&user.id)
            ),
            Some(&admin.token),
            Some(&json!({"messages_per_second": 0, "burst_count": 0})),
        );
    }

    /// `user`'s devices (the admin API).
    pub fn devices(&self, admin: &User, user: &str) -> Vec<String> {
        self.call(
            "GET",
            &format!("/_synapse/admin/v2/users/{}/devices", enc(user)),
            Some(&admin.token),
            None,
        )["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["device_id"].as_str().unwrap().to_owned())
            .collect()
    }
}

/// `s` percent-encoded for a path segment.
pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
