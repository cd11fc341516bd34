//! The IRC bot's per-sender limits key: what `speaker_tokens_per_day`,
//! `speaker_turns_per_minute` and the bot's own per-guest output budget count a message
//! under, instead of the nick (which a client changes at will with `NICK`).
//!
//! **What is hashed.** The host part of the message's prefix (`nick!user@host`) as the
//! server relays it: the client's address (or its name, or the cloak the server gives it),
//! which the client cannot choose. The user part (the ident) is left out: without an ident
//! server (and ngIRCd's `Ident = no`) it is whatever the client sent in `USER`, a new one at
//! each reconnection, and even a verified ident is the client's own machine's answer; with
//! it a client would get fresh limits by reconnecting under another `USER`. An IPv6 address
//! counts by its /64 (one subscriber's network: a client holding a /64 could otherwise take
//! a fresh address per connection); an IPv4-mapped one as its IPv4 address.
//!
//! **How.** `HMAC-SHA256(secret, "roundtable-sandbox irc host v1\0" + host)` (the `hmac`
//! crate over `sha2`), written `irc-host:<64 hex>`. The secret (32 random bytes) is kept in
//! a file only the service user can read (created 0600 at the first start, refused when
//! anyone else can read or own it), so a key survives restarts and cannot be recomputed
//! from a host by whoever reads the budgets' state file. The key goes to the core as the
//! message's `limits_key`, which the budgets alone read: the model, the turn, the audit
//! trail, the logs and the metrics see the nick, never the host nor the key.

use std::io::Read;
use std::net::{IpAddr, Ipv6Addr};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The secret's length, in bytes.
pub const SECRET_LEN: usize = 32;

/// What separates this key's use from any other of the same secret.
const DOMAIN: &[u8] = b"roundtable-sandbox irc host v1\0";

/// Errors of the limits key's secret file.
#[derive(Debug, thiserror::Error)]
pub enum LimitsKeyError {
    /// The path is not absolute.
    #[error("limits key file {0} must be an absolute path")]
    NotAbsolute(PathBuf),
    /// The path lies in a root of the sandbox (a guest's workspace, a turn's run dir).
    #[error("limits key file {0} must be outside run_root and workspace_root")]
    InsideRoot(PathBuf),
    /// The file is a symbolic link, a directory or another special file.
    #[error("limits key file {0} is not a regular file")]
    NotAFile(PathBuf),
    /// Another user owns the file, or others may read or write it.
    #[error("limits key file {path} must be the service user's alone (mode 0600, owner uid {uid}); it is mode {mode:04o}, owner uid {owner}")]
    NotPrivate {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Its owner.
        owner: u32,
        /// The service user.
        uid: u32,
    },
    /// The file holds something other than a secret of [`SECRET_LEN`] bytes.
    #[error("limits key file {path} holds {len} bytes, not {SECRET_LEN} (move it aside to make a new key: every sender's limits start again)")]
    WrongLength {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// Reading, creating or writing it failed.
    #[error("limits key file {path}: {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

/// HMAC-SHA256 (RFC 2104, the `hmac` crate).
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// The host as it is keyed: ASCII lowercase; an IPv6 address as its /64, an IPv4-mapped one
/// as the IPv4 address.
pub fn normalise_host(host: &str) -> String {
    let host = host.to_ascii_lowercase();
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let net = Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX));
                format!("{net}/64")
            }
        },
        Ok(IpAddr::V4(v4)) => v4.to_string(),
        Err(_) => host,
    }
}

/// Turns a sender's host into its limits key.
#[derive(Clone)]
pub struct LimitsKeyer {
    secret: [u8; SECRET_LEN],
}

impl std::fmt::Debug for LimitsKeyer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitsKeyer").finish_non_exhaustive()
    }
}

impl LimitsKeyer {
    /// A keyer with this secret.
    pub fn new(secret: [u8; SECRET_LEN]) -> Self {
        Self { secret }
    }

    /// A keyer whose secret lives only in this process (no budgets' state file: nothing
    /// of the limits outlives the process anyway).
    pub fn ephemeral() -> Result<Self, LimitsKeyError> {
        random_secret(Path::new("/dev/urandom")).map(Self::new)
    }

    /// The limits key of a sender whose prefix names `host`.
    pub fn key(&self, host: &str) -> String {
        let mut message = DOMAIN.to_vec();
        message.extend_from_slice(normalise_host(host).as_bytes());
        let mac = hmac_sha256(&self.secret, &message);
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        format!("irc-host:{hex}")
    }
}

fn io<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> LimitsKeyError + 'a {
    move |source| LimitsKeyError::Io {
        path: path.to_owned(),
        what,
        source,
    }
}

fn random_secret(source: &Path) -> Result<[u8; SECRET_LEN], LimitsKeyError> {
    let mut secret = [0u8; SECRET_LEN];
    std::fs::File::open(source)
        .and_then(|mut f| f.read_exact(&mut secret))
        .map_err(io(source, "read random bytes"))?;
    Ok(secret)
}

/// Where the secret lives when no file is given: beside the budgets' state file
/// (`STATE_FILE.irc-limits-key`), so it survives restarts with the counters it keys.
pub fn default_path(state_file: &Path) -> PathBuf {
    let mut name = state_file.file_name().unwrap_or_default().to_owned();
    name.push(".irc-limits-key");
    state_file.with_file_name(name)
}

/// Reads the secret at `path`, or makes it (32 random bytes, 0600, written whole under a
/// temporary name and linked into place, so a crash or a second bot never leaves a short
/// file or replaces a key). An existing file must be a regular file of `uid`'s, mode 0600
/// (no group or other bit), of [`SECRET_LEN`] bytes. `roots` are the sandbox's run and
/// workspace roots: the file may not lie in one.
pub fn load_or_create(
    path: &Path,
    uid: u32,
    roots: [&Path; 2],
) -> Result<([u8; SECRET_LEN], bool), LimitsKeyError> {
    if !path.is_absolute() {
        return Err(LimitsKeyError::NotAbsolute(path.to_owned()));
    }
    if roots.iter().any(|r| path.starts_with(r)) {
        return Err(LimitsKeyError::InsideRoot(path.to_owned()));
    }
    let created = match std::fs::symlink_metadata(path) {
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => create(path)?,
        Err(e) => return Err(io(path, "inspect")(e)),
    };
    // Opened without following a link (nor waiting on a FIFO), then checked through the
    // descriptor: what is checked is what is read.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits())
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(code) if code == nix::errno::Errno::ELOOP as i32 => {
                LimitsKeyError::NotAFile(path.to_owned())
            }
            _ => io(path, "open")(e),
        })?;
    let meta = file.metadata().map_err(io(path, "inspect"))?;
    if !meta.file_type().is_file() {
        return Err(LimitsKeyError::NotAFile(path.to_owned()));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if meta.uid() != uid || mode & 0o077 != 0 {
        return Err(LimitsKeyError::NotPrivate {
            path: path.to_owned(),
            mode,
            owner: meta.uid(),
            uid,
        });
    }
    if meta.len() != SECRET_LEN as u64 {
        return Err(LimitsKeyError::WrongLength {
            path: path.to_owned(),
            len: meta.len(),
        });
    }
    let mut secret = [0u8; SECRET_LEN];
    (&file).read_exact(&mut secret).map_err(io(path, "read"))?;
    Ok((secret, created))
}

/// Makes the secret file; whether this call made it (false: another process did first).
fn create(path: &Path) -> Result<bool, LimitsKeyError> {
    let secret = random_secret(Path::new("/dev/urandom"))?;
    let tmp = roundtable_sandbox_examples::write_private_temp(path, &secret)
        .map_err(io(path, "create"))?;
    // Linked, not renamed: an existing key (another bot's, made meanwhile) is never replaced.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            roundtable_sandbox_examples::sync_parent(path)
                .map_err(io(path, "sync its directory"))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io(path, "create")(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // Test cases 1, 2 and 6 of RFC 4231 (6: a key longer than the block).
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_host_keys_the_same_whatever_the_nick_and_another_host_differently() {
        let keyer = LimitsKeyer::new([7; SECRET_LEN]);
        let a = keyer.key("guest-1.example.net");
        assert!(a.starts_with("irc-host:") && a.len() == 9 + 64, "{a}");
        assert_eq!(a, keyer.key("Guest-1.EXAMPLE.net"));
        assert_ne!(a, keyer.key("guest-2.example.net"));
        // Another secret, another key: the key cannot be recomputed from the host alone.
        assert_ne!(
            a,
            LimitsKeyer::new([8; SECRET_LEN]).key("guest-1.example.net")
        );
        // An IPv6 address counts by its /64; an IPv4-mapped one as IPv4.
        assert_eq!(
            keyer.key("2001:db8:1:2::5"),
            keyer.key("2001:db8:1:2:ffff:ffff:ffff:ffff")
        );
        assert_ne!(keyer.key("2001:db8:1:2::5"), keyer.key("2001:db8:1:3::5"));
        assert_eq!(keyer.key("::ffff:192.0.2.1"), keyer.key("192.0.2.1"));
        assert_eq!(normalise_host("0::1"), "::/64");
        // Never the host itself, in any form.
        assert!(!a.contains("guest") && !a.contains("example"));
    }

    #[test]
    fn the_secret_file_is_made_private_kept_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let roots = [Path::new("/nonexistent/run"), Path::new("/nonexistent/ws")];
        let path = dir.path().join("budgets.sqlite.irc-limits-key");
        assert_eq!(default_path(&dir.path().join("budgets.sqlite")), path);
        let (first, created) = load_or_create(&path, uid, roots).unwrap();
        assert!(created);
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
        assert_eq!(meta.len(), SECRET_LEN as u64);
        // Nothing else is left in the directory (the temporary file is gone).
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // A restart reads the same secret.
        let (again, created) = load_or_create(&path, uid, roots).unwrap();
        assert_eq!((again, created), (first, false));

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert_eq!(
            load_or_create(&path, uid, roots).unwrap_err().to_string(),
            format!(
                "limits key file {} must be the service user's alone (mode 0600, owner uid {uid}); it is mode 0640, owner uid {uid}",
                path.display()
            )
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, b"short").unwrap();
        assert_eq!(
            load_or_create(&path, uid, roots).unwrap_err().to_string(),
            format!(
                "limits key file {} holds 5 bytes, not 32 (move it aside to make a new key: every sender's limits start again)",
                path.display()
            )
        );
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert_eq!(
            load_or_create(&link, uid, roots).unwrap_err().to_string(),
            format!("limits key file {} is not a regular file", link.display())
        );
        assert_eq!(
            load_or_create(Path::new("key"), uid, roots)
                .unwrap_err()
                .to_string(),
            "limits key file key must be an absolute path"
        );
        let inside = Path::new("/nonexistent/ws/key");
        assert_eq!(
            load_or_create(inside, uid, roots).unwrap_err().to_string(),
            "limits key file /nonexistent/ws/key must be outside run_root and workspace_root"
        );
    }
}
