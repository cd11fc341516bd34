//! Every rule of a configuration, in one place: [`resolve`] runs the pure checks first
//! (model, time zone, timeout, image, limits, identity, runtime, broker policy, instance,
//! roots' shape); only then are the two roots created (0700) and inspected.

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::broker;

use super::{
    time_zones, Config, ConfigError, Limits, ResolvedConfig, DEFAULT_PROMPT, GVISOR_RUNTIME,
    MAX_SOCKET_PATH, SOCKET_SUFFIX,
};

/// How the rules are run: stop at the first violation ([`resolve`], at startup), or note
/// every one and go on ([`violations`], for `doctor`). The same rules either way.
struct Rules {
    every: bool,
    found: Vec<ConfigError>,
}

impl Rules {
    /// A rule's verdict: in the first-violation mode its error stops the run; in the
    /// every-violation mode it is noted and the run goes on.
    fn check(&mut self, verdict: Result<(), ConfigError>) -> Result<(), ConfigError> {
        match verdict {
            Err(e) if self.every => {
                self.found.push(e);
                Ok(())
            }
            other => other,
        }
    }
}

/// What the pure rules resolve on the way.
struct Checked {
    time_zone: String,
    turn_timeout: Duration,
    uid: u32,
    gid: u32,
    policy: broker::BrokerPolicy,
}

/// Every rule without a side effect, in their order: the model, the warm pool, the time
/// zone, the turn timeout, the image, the limits, the steps and session budget, the
/// identity, the runtime, the broker policy, the instance, the roots' shape and what lies
/// above them, and the budgets.
fn pure_rules(config: &Config, rules: &mut Rules) -> Result<Checked, ConfigError> {
    if config.driver.is_none() && !cfg!(target_os = "linux") {
        rules.check(Err(ConfigError::NotLinux))?;
    }
    if config.model.trim().is_empty() {
        rules.check(Err(ConfigError::ModelMissing))?;
    }
    rules.check(config.warm.validate().map_err(ConfigError::Warm))?;
    let time_zone = match resolve_time_zone(config.effective_time_zone()) {
        Ok(zone) => zone.to_owned(),
        Err(e) => {
            rules.check(Err(e))?;
            String::new()
        }
    };
    let turn_timeout = config.effective_turn_timeout();
    if turn_timeout < Duration::from_secs(1) || turn_timeout > Duration::from_secs(600) {
        rules.check(Err(ConfigError::TurnTimeout(turn_timeout)))?;
    }
    if !valid_image_reference(&config.image) {
        rules.check(Err(ConfigError::InvalidImage(config.image.clone())))?;
    }
    for violation in config.limits.violations() {
        rules.check(Err(violation))?;
    }
    if let Some(steps) = config.max_steps {
        if !(1..=256).contains(&steps) {
            rules.check(Err(ConfigError::MaxSteps(steps)))?;
        }
    }
    if let Some(budget) = config.session_budget {
        if !(1000..=10_000_000).contains(&budget) {
            rules.check(Err(ConfigError::SessionBudget(budget)))?;
        }
    }
    let process_uid = nix::unistd::getuid().as_raw();
    let process_gid = nix::unistd::getgid().as_raw();
    let (uid, gid) = config.worker_identity();
    if uid == 0 || gid == 0 || uid != process_uid || gid != process_gid {
        rules.check(Err(ConfigError::Identity))?;
    }
    if let Some(runtime) = &config.runtime {
        if !valid_runtime(runtime) {
            rules.check(Err(ConfigError::InvalidRuntime(runtime.clone())))?;
        }
        // gVisor's gofer answers the socket for the guest: SO_PEERCRED says uid 0, so
        // the check would refuse every turn. Turning it off is the operator's explicit
        // choice, never implied.
        if runtime == GVISOR_RUNTIME && config.peer_uid_check {
            rules.check(Err(ConfigError::PeerUidCheckUnderRuntime(runtime.clone())))?;
        }
    }
    let policy = config.broker_policy(uid);
    // The policy's own rules give their first violation.
    rules.check(broker::validate_policy(&policy).map_err(ConfigError::from))?;
    if let Some(instance) = &config.instance {
        if !valid_instance(instance) {
            rules.check(Err(ConfigError::InvalidInstance(instance.clone())))?;
        }
    }
    let mut shaped = true;
    for root in [&config.run_root, &config.workspace_root] {
        if !root.is_absolute() || root == Path::new("/") {
            shaped = false;
            rules.check(Err(ConfigError::RootNotAbsolute(root.clone())))?;
        }
    }
    // What lies above each root, before anything is created under it (a root of the wrong
    // shape has no ancestors to judge).
    if shaped {
        rules.check(check_root_ancestors(&config.run_root, process_uid))?;
        rules.check(check_root_ancestors(&config.workspace_root, process_uid))?;
    }
    rules.check(check_budgets(
        config,
        [&config.run_root, &config.workspace_root],
    ))?;
    rules.check(
        (config.audit)
            .validate([&config.run_root, &config.workspace_root])
            .map_err(ConfigError::Audit),
    )?;
    Ok(Checked {
        time_zone,
        turn_timeout,
        uid,
        gid,
        policy,
    })
}

/// Every violation of the rules [`resolve`] runs before its side effects, in their order,
/// none of them stopping the others: `doctor`'s view of a configuration (nothing is
/// created; startup stops at the first of the same). The roots themselves (their owner
/// and mode, once created), their separation and the socket path's length are judged on
/// the canonical roots at startup; `doctor` checks those per root
/// ([`is_private_dir`], [`check_socket_path`]).
#[cfg(any(feature = "cli", feature = "testing"))]
pub fn violations(config: &Config) -> Vec<ConfigError> {
    let mut rules = Rules {
        every: true,
        found: Vec::new(),
    };
    // Never an error in this mode: every violation is noted.
    let _ = pure_rules(config, &mut rules);
    rules.found
}

/// The broker socket's path under `run_root` ([`SOCKET_SUFFIX`]) must fit in
/// [`MAX_SOCKET_PATH`] bytes: its length, or the violation. Startup judges the canonical
/// run root; `doctor` the configured one.
pub fn check_socket_path(run_root: &Path) -> Result<usize, ConfigError> {
    let len = run_root.as_os_str().len() + SOCKET_SUFFIX.len();
    if len > MAX_SOCKET_PATH {
        return Err(ConfigError::SocketPathTooLong(run_root.to_owned()));
    }
    Ok(len)
}

/// Validates every rule and prepares the two roots. Nothing else has a side effect.
pub(super) fn resolve(config: &Config) -> Result<ResolvedConfig, ConfigError> {
    let Checked {
        time_zone,
        turn_timeout,
        uid,
        gid,
        policy,
    } = pure_rules(
        config,
        &mut Rules {
            every: false,
            found: Vec::new(),
        },
    )?;
    let process_uid = nix::unistd::getuid().as_raw();
    // Side effects start here: the roots are created private, then inspected.
    let run_root = prepare_root(&config.run_root, process_uid)?;
    let workspace_root = prepare_root(&config.workspace_root, process_uid)?;
    if run_root == workspace_root
        || run_root.starts_with(&workspace_root)
        || workspace_root.starts_with(&run_root)
    {
        return Err(ConfigError::RootsNotSeparate(run_root, workspace_root));
    }
    check_socket_path(&run_root)?;
    // Again with the canonical roots (a state file under a root by another path).
    check_budgets(config, [&run_root, &workspace_root])?;
    (config.audit)
        .validate([&run_root, &workspace_root])
        .map_err(ConfigError::Audit)?;
    let instance = config
        .instance
        .clone()
        .unwrap_or_else(|| default_instance(&run_root));
    let mut resolved = ResolvedConfig {
        run_root,
        workspace_root,
        uid,
        gid,
        time_zone,
        turn_timeout,
        prompt: config
            .prompt
            .clone()
            .unwrap_or_else(|| DEFAULT_PROMPT.to_owned()),
        instance,
        image: config.image.clone(),
        model: config.model.clone(),
        limits: config.limits,
        max_steps: config.max_steps,
        session_budget: config.session_budget,
        command: config.command.clone(),
        runtime: config.runtime.clone(),
        warm: config.warm,
        budgets: config.budgets.clone(),
        audit: config.audit.clone(),
        docker: config.docker_options(),
        broker: policy,
    };
    // The policy built and validated once above, given the runtime's engine: confined MCP
    // sessions run through the same engine, identity and runtime as the guests, their data
    // under MCP_DATA_DIR of the workspace root, held to the workspaces' free-space floor.
    resolved.broker.mcp_engine = Some(crate::broker::McpEngine {
        docker_host: resolved.docker.host.clone(),
        driver: None,
        guest_image: resolved.image.clone(),
        instance: resolved.instance.clone(),
        uid: resolved.uid,
        gid: resolved.gid,
        data_root: resolved.workspace_root.join(super::MCP_DATA_DIR),
        runtime: resolved.runtime.clone(),
        floor: resolved.limits.disk_floor(),
    });
    Ok(resolved)
}

/// The `[budgets]` rules (a custom store stands for the state file).
fn check_budgets(config: &Config, roots: [&Path; 2]) -> Result<(), ConfigError> {
    let mut budgets = config.budgets.clone();
    if config.budget_store.is_some() {
        if budgets.state_file.is_some() {
            return Err(ConfigError::Budgets(
                "state_file and a custom budget store are both set; use one".into(),
            ));
        }
        budgets.state_file = Some(PathBuf::from("/custom-store"));
    }
    budgets.validate(roots).map_err(ConfigError::Budgets)
}

/// Checks every directory above `root` (the canonical path of its nearest existing part;
/// the root need not exist yet): each must be owned by root or `service_uid`, and writable
/// by group or others only if sticky (as `/tmp` is). Anyone else who can write one of them
/// could rename the root away and put their own directory in its place after startup.
/// `doctor` runs this same check.
pub fn check_root_ancestors(root: &Path, service_uid: u32) -> Result<(), ConfigError> {
    let inspect = |source| ConfigError::InspectRoot {
        path: root.to_owned(),
        source,
    };
    // The nearest part of the path that exists: the root itself, or a parent.
    let mut existing = root;
    loop {
        match std::fs::symlink_metadata(existing) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match existing.parent() {
                Some(parent) => existing = parent,
                None => return Err(inspect(e)),
            },
            Err(e) => return Err(inspect(e)),
        }
    }
    let canonical = std::fs::canonicalize(existing).map_err(inspect)?;
    // The root itself is judged by `prepare_root`; everything above it here.
    let first = if existing == root {
        canonical.parent()
    } else {
        Some(canonical.as_path())
    };
    for ancestor in first.into_iter().flat_map(Path::ancestors) {
        let meta = std::fs::metadata(ancestor).map_err(inspect)?;
        let (owner, mode) = (meta.uid(), meta.mode() & 0o7777);
        if owner != 0 && owner != service_uid {
            return Err(ConfigError::RootAncestorOwner {
                root: root.to_owned(),
                ancestor: ancestor.to_owned(),
                owner,
            });
        }
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(ConfigError::RootAncestorWritable {
                root: root.to_owned(),
                ancestor: ancestor.to_owned(),
                mode,
            });
        }
    }
    Ok(())
}

/// Whether a directory's owner and mode make it private to the service user: owned by
/// `service_uid`, no group or other permission bit. The one rule for the roots (at
/// startup and again on the descriptor the runtime holds) and the channel directories.
pub fn is_private_dir(owner: u32, mode: u32, service_uid: u32) -> bool {
    owner == service_uid && mode & 0o077 == 0
}

/// Creates `root` (0700) if it is missing, checks that it is a directory of this process's
/// user closed to everyone else, and gives its canonical path.
fn prepare_root(root: &Path, process_uid: u32) -> Result<PathBuf, ConfigError> {
    let inspect = |source| ConfigError::InspectRoot {
        path: root.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(|source| ConfigError::CreateRoot {
            path: root.to_owned(),
            source,
        })?;
    let meta = std::fs::metadata(root).map_err(inspect)?;
    if !meta.is_dir() || !is_private_dir(meta.uid(), meta.mode(), process_uid) {
        return Err(ConfigError::RootNotPrivate(root.to_owned()));
    }
    std::fs::canonicalize(root).map_err(inspect)
}

impl Limits {
    /// Checks each limit's range: the first violation.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.violations().into_iter().next().map_or(Ok(()), Err)
    }

    /// Every limit out of its range, in order.
    pub fn violations(&self) -> Vec<ConfigError> {
        let mut out = Vec::new();
        if !(16..=1 << 20).contains(&self.memory_mb) {
            out.push(ConfigError::MemoryLimit(self.memory_mb));
        }
        if !(self.cpus.is_finite() && self.cpus > 0.0 && self.cpus <= 1024.0) {
            out.push(ConfigError::CpuLimit(self.cpus));
        }
        if !(8..=65536).contains(&self.pids) {
            out.push(ConfigError::PidsLimit(self.pids));
        }
        if !(1..=4096).contains(&self.tmpfs_mb) {
            out.push(ConfigError::TmpfsLimit(self.tmpfs_mb));
        }
        if !(1..=65536).contains(&self.output_kb) {
            out.push(ConfigError::OutputLimit(self.output_kb));
        }
        if !(1..=1 << 24).contains(&self.workspace_mb) {
            out.push(ConfigError::WorkspaceLimit(self.workspace_mb));
        }
        if !(16..=10_000_000).contains(&self.workspace_files) {
            out.push(ConfigError::WorkspaceFilesLimit(self.workspace_files));
        }
        if self.disk_floor_mb > 1 << 24 {
            out.push(ConfigError::DiskFloorLimit(self.disk_floor_mb));
        }
        if self.disk_floor_percent > 90 {
            out.push(ConfigError::DiskFloorPercent(self.disk_floor_percent));
        }
        out
    }
}

/// The name `Intl.DateTimeFormat` resolves a time zone to (`resolvedOptions().timeZone`),
/// as pi-roundtable-sandbox validates its `timeZone`: IANA names and their links in any ASCII letter
/// case, and ICU's legacy ids; `None` for a name it refuses. Taken from node (see
/// `scripts/gen-time-zones.sh`), e.g. `"utc"` → `"UTC"`, `"europe/berlin"` →
/// `"Europe/Berlin"`, `"US/Eastern"` → `"America/New_York"`, `"Asia/Kolkata"` →
/// `"Asia/Calcutta"`.
pub fn canonical_time_zone(name: &str) -> Option<&'static str> {
    if !name.is_ascii() {
        return None;
    }
    let key = name.to_ascii_lowercase();
    time_zones::TIME_ZONES
        .binary_search_by(|(k, _)| (*k).cmp(key.as_str()))
        .ok()
        .map(|i| time_zones::TIME_ZONES[i].1)
}

/// Where [`canonical_time_zone`]'s table comes from (node, ICU and tz versions).
pub const TIME_ZONE_SOURCE: &str = time_zones::SOURCE;

/// [`canonical_time_zone`], refusing a zone the guest cannot show (ICU's `SystemV/*` ids,
/// which are in no tz database).
fn resolve_time_zone(name: &str) -> Result<&'static str, ConfigError> {
    let canonical =
        canonical_time_zone(name).ok_or_else(|| ConfigError::InvalidTimeZone(name.to_owned()))?;
    if canonical.parse::<chrono_tz::Tz>().is_err() {
        return Err(ConfigError::TimeZoneUnsupported {
            given: name.to_owned(),
            canonical,
        });
    }
    Ok(canonical)
}

/// An engine runtime name as daemon.json keys them: `runc`, `runsc`, `kata-runtime`.
fn valid_runtime(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

fn valid_instance(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// `rt-` and 12 hex digits of the sha256 of the canonical run root.
pub(crate) fn default_instance(run_root: &Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(run_root.as_os_str().as_encoded_bytes());
    format!("rt-{}", &hex::encode(digest)[..12])
}

/// A Docker image reference, `[host[:port]/]path[:tag][@digest]`, as the distribution
/// reference grammar defines it (lowercase path components, a repository of at most 255
/// bytes, a sha256/sha384/sha512 digest of the right length), parsed by `oci-spec`.
/// ASCII only: the crate's tag pattern would take any Unicode word character, Docker's not.
pub fn valid_image_reference(reference: &str) -> bool {
    reference.is_ascii()
        && reference
            .parse::<oci_spec::distribution::Reference>()
            .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_zone_table_is_sorted_lowercase_and_renderable() {
        let table = time_zones::TIME_ZONES;
        assert!(table.len() > 600, "{}", table.len());
        for pair in table.windows(2) {
            assert!(pair[0].0 < pair[1].0, "{pair:?}");
        }
        let mut unrenderable = Vec::new();
        for (key, canonical) in table {
            assert_eq!(*key, key.to_ascii_lowercase());
            assert_eq!(
                canonical_time_zone(canonical),
                Some(*canonical),
                "{canonical}"
            );
            if canonical.parse::<chrono_tz::Tz>().is_err() {
                unrenderable.push(*canonical);
            }
        }
        // Only ICU's SystemV ids have no tz database zone.
        assert!(
            unrenderable.iter().all(|c| c.starts_with("SystemV/")),
            "{unrenderable:?}"
        );
        // Every name of the guest's tz database is accepted.
        for tz in chrono_tz::TZ_VARIANTS {
            assert!(canonical_time_zone(tz.name()).is_some(), "{}", tz.name());
        }
    }

    #[test]
    fn a_private_dir_is_the_service_users_with_no_group_or_other_bit() {
        assert!(is_private_dir(999, 0o700, 999));
        assert!(
            is_private_dir(999, 0o40700, 999),
            "the file type bits do not matter"
        );
        assert!(is_private_dir(999, 0o500, 999));
        assert!(!is_private_dir(1000, 0o700, 999), "another owner");
        assert!(!is_private_dir(0, 0o700, 999), "root's");
        for open in [0o710, 0o701, 0o750, 0o755, 0o707, 0o770] {
            assert!(!is_private_dir(999, open, 999), "{open:o}");
        }
    }

    #[test]
    fn image_references() {
        for good in [
            "roundtable-sandbox-guest:latest",
            "busybox",
            "library/busybox:1.36",
            "localhost:5000/a/b:v1",
            "registry.example.com/team/img@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "a__b/c.d-e",
        ] {
            assert!(valid_image_reference(good), "{good}");
        }
        for bad in [
            "",
            "Upper:tag",
            "a b",
            "img:",
            "img:-tag",
            "img@sha256:123",
            "/img",
            "img/",
            "a..b",
            "img:tag:tag2",
            "--rm",
            "img:täg",
            "img@sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0",
            "img@md5:0123456789abcdef0123456789abcdef",
        ] {
            assert!(!valid_image_reference(bad), "{bad}");
        }
    }

    #[test]
    fn limits_exact_errors() {
        let cases: [(Limits, &str); 5] = [
            (
                Limits {
                    memory_mb: 15,
                    ..Limits::default()
                },
                "limits.memory_mb must be 16 to 1048576, got 15",
            ),
            (
                Limits {
                    cpus: 0.0,
                    ..Limits::default()
                },
                "limits.cpus must be above 0 and at most 1024, got 0",
            ),
            (
                Limits {
                    pids: 7,
                    ..Limits::default()
                },
                "limits.pids must be 8 to 65536, got 7",
            ),
            (
                Limits {
                    tmpfs_mb: 0,
                    ..Limits::default()
                },
                "limits.tmpfs_mb must be 1 to 4096, got 0",
            ),
            (
                Limits {
                    output_kb: 0,
                    ..Limits::default()
                },
                "limits.output_kb must be 1 to 65536, got 0",
            ),
        ];
        for (limits, msg) in cases {
            assert_eq!(limits.validate().unwrap_err().to_string(), msg);
        }
        assert!(Limits::default().validate().is_ok());
        let w = Limits {
            workspace_mb: 0,
            ..Limits::default()
        };
        assert_eq!(
            w.validate().unwrap_err().to_string(),
            "limits.workspace_mb must be 1 to 16777216, got 0"
        );
        let w = Limits {
            workspace_files: 15,
            ..Limits::default()
        };
        assert_eq!(
            w.validate().unwrap_err().to_string(),
            "limits.workspace_files must be 16 to 10000000, got 15"
        );
        let w = Limits {
            disk_floor_mb: (1 << 24) + 1,
            ..Limits::default()
        };
        assert_eq!(
            w.validate().unwrap_err().to_string(),
            "limits.disk_floor_mb must be 0 to 16777216, got 16777217"
        );
        let w = Limits {
            disk_floor_percent: 91,
            ..Limits::default()
        };
        assert_eq!(
            w.validate().unwrap_err().to_string(),
            "limits.disk_floor_percent must be 0 to 90, got 91"
        );
        let off = Limits {
            disk_floor_mb: 0,
            disk_floor_percent: 0,
            ..Limits::default()
        };
        assert!(off.validate().is_ok());
        assert_eq!(Limits::default().disk_floor().bytes_of(100 << 30), 5 << 30);
        assert_eq!(Limits::default().disk_floor().bytes_of(10 << 30), 1 << 30);
    }
}
