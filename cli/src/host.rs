//! The host and its container engine: the image, the runtime, the container's limits,
//! the roots and their disks, the mounts, warm turns and the socket path, as `explain`
//! shows them and as `doctor` checks them.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use roundtable_sandbox::operator::{self, is_private_dir, Floor, MAX_SOCKET_PATH};
use roundtable_sandbox::{Config, ConfigError, ContainerDriver, DockerDriver};

use crate::check::{fail, pass, Check};
use crate::show;

/// `explain`'s lines for the host: the image and runtime, the container, its limits and
/// disk, the mounts, warm turns.
pub(crate) fn explain(config: &Config) {
    let l = &config.limits;
    let (uid, gid) = config.worker_identity();
    println!("image         {}", config.image);
    println!(
        "runtime       {}",
        match config.runtime.as_deref() {
            None => "the engine's default (runc: the guest shares the host kernel)".to_owned(),
            Some(r) if r == roundtable_sandbox::operator::GVISOR_RUNTIME => {
                format!("{r} (gVisor: a user-space kernel between the guest and the host)")
            }
            Some(r) => r.to_owned(),
        }
    );
    println!(
        "container     user {uid}:{gid}, network none, read-only root, all capabilities dropped, \
         no-new-privileges, init process"
    );
    println!(
        "limits        memory {} MiB (no swap), {} cpus, {} pids, /tmp tmpfs {} MiB, reply {} KiB",
        l.memory_mb, l.cpus, l.pids, l.tmpfs_mb, l.output_kb
    );
    println!(
        "disk          workspace quota {} MiB / {} entries per channel; free-space floor max({} MiB, {} %) on the workspaces' and the engine's filesystems",
        l.workspace_mb, l.workspace_files, l.disk_floor_mb, l.disk_floor_percent
    );
    println!(
        "mounts        {}/turn-XXXXXX -> /run/roundtable (read-only, holds only broker.sock)",
        show(&config.run_root)
    );
    println!(
        "              {}/<sha256(channel)> -> /workspace (read-write; the root itself is never mounted)",
        show(&config.workspace_root)
    );
    let w = &config.warm;
    match (w.on(), w.ttl()) {
        (false, _) => println!("warm turns    off (every turn creates and starts its container)"),
        (true, ttl) => println!(
            "warm turns    on: each channel's next container is started after its turn, up to {} in all, \
             removed after {} unused; it reaches no broker before its turn",
            w.max,
            ttl.map_or("the channel's idle timeout".to_owned(), |t| format!("{} s", t.as_secs()))
        ),
    }
}

/// The container engine as `doctor` found it: its client, and whether it answered.
pub(crate) struct Engine {
    pub(crate) driver: DockerDriver,
    pub(crate) reachable: bool,
}

impl Engine {
    /// Asks the engine for its version: the `docker` line.
    pub(crate) async fn probe(config: &Config, checks: &mut Vec<Check>) -> Self {
        let driver = driver_for(config);
        let reachable = match driver.version().await {
            Ok(v) => {
                checks.push(pass("docker", format!("reachable, Docker {v}")));
                true
            }
            Err(e) => {
                checks.push(fail(
                    "docker",
                    e.to_string(),
                    "start the daemon (service docker start) and let this user use its socket \
                     (usermod -aG docker USER, then log in again)",
                ));
                false
            }
        };
        Self { driver, reachable }
    }
}

/// `doctor`'s lines for the host: the image and the runtime (by the engine), the roots,
/// the workspaces' and the engine's disks against the floor.
pub(crate) async fn doctor(config: &Config, engine: &Engine, uid: u32) -> Vec<Check> {
    let driver = &engine.driver;
    let mut checks = Vec::new();
    checks.push(if !engine.reachable {
        fail(
            "image",
            format!("{}: not checked, Docker is unreachable", config.image),
            "fix the docker check first",
        )
    } else {
        match driver.image_present(&config.image).await {
            Ok(true) => pass("image", format!("{} present", config.image)),
            Ok(false) => fail(
                "image",
                format!("{} is missing", config.image),
                "build it: scripts/build-image.sh (or roundtable-sandbox image build)",
            ),
            Err(e) => fail("image", e.to_string(), "fix the docker check first"),
        }
    });
    checks.push(if !engine.reachable {
        fail(
            "runtime",
            "not checked, Docker is unreachable".to_owned(),
            "fix the docker check first",
        )
    } else {
        runtime_check(config.runtime.as_deref(), driver.runtimes().await)
    });
    checks.push(check_root("run_root", &config.run_root, uid));
    checks.push(check_root("workspace_root", &config.workspace_root, uid));
    let floor = config.limits.disk_floor();
    checks.push(floor_check(
        "workspace disk",
        &config.workspace_root,
        &floor,
    ));
    checks.push(if !engine.reachable {
        fail(
            "engine disk",
            "not checked, Docker is unreachable",
            "fix the docker check first",
        )
    } else {
        match driver.data_root().await {
            Ok(Some(root)) => floor_check("engine disk", &root, &floor),
            Ok(None) => pass("engine disk", "the engine reports no data root"),
            Err(e) => fail("engine disk", e.to_string(), "fix the docker check first"),
        }
    });
    checks
}

/// The broker's socket path under `run_root` must fit a unix socket's.
pub(crate) fn socket_check(config: &Config) -> Check {
    match roundtable_sandbox::operator::check_socket_path(&config.run_root) {
        Err(e) => fail(
            "socket path",
            e.to_string(),
            "choose a shorter run_root, e.g. /run/roundtable or /srv/rt/run",
        ),
        Ok(len) => pass("socket path", format!("{len} of {MAX_SOCKET_PATH} bytes")),
    }
}

fn check_root(name: &'static str, path: &Path, uid: u32) -> Check {
    // What lies above the root: the runtime's own startup check.
    if let Err(e) = roundtable_sandbox::operator::check_root_ancestors(path, uid) {
        let hint = match &e {
            ConfigError::RootAncestorWritable { ancestor, .. } => format!(
                "chmod go-w {} (or choose a root whose every parent only root or this user can write)",
                ancestor.display()
            ),
            ConfigError::RootAncestorOwner { .. } => {
                "choose a root whose every parent is owned by root or this user".to_owned()
            }
            _ => "choose a directory this user can create".to_owned(),
        };
        return fail(name, format!("{:#}", anyhow::Error::from(e)), hint);
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => pass(
            name,
            format!("{} will be created 0700 at startup", path.display()),
        ),
        Err(e) => fail(
            name,
            format!("{}: {e}", path.display()),
            "choose a directory this user can create",
        ),
        Ok(_) => {
            let meta = match std::fs::metadata(path) {
                Ok(m) => m,
                Err(e) => {
                    return fail(
                        name,
                        format!("{}: {e}", path.display()),
                        "fix or remove the dangling link",
                    )
                }
            };
            // The runtime's own rule (`is_private_dir`); the lines below say which part
            // of it fails.
            if !meta.is_dir() {
                fail(
                    name,
                    format!("{} is not a directory", path.display()),
                    "point it at a dedicated directory",
                )
            } else if is_private_dir(meta.uid(), meta.mode(), uid) {
                pass(name, format!("{} (owner {uid}, mode 700)", path.display()))
            } else if meta.uid() != uid {
                fail(
                    name,
                    format!(
                        "{} is owned by uid {}, not {uid}",
                        path.display(),
                        meta.uid()
                    ),
                    format!("chown {uid} {}", path.display()),
                )
            } else {
                fail(
                    name,
                    format!(
                        "{} has mode {:o}; group and others must have no access",
                        path.display(),
                        meta.mode() & 0o7777
                    ),
                    format!("chmod 700 {}", path.display()),
                )
            }
        }
    }
}

/// Free space of the filesystem holding `path` (or its nearest existing parent) against
/// the floor.
fn floor_check(name: &'static str, path: &Path, floor: &Floor) -> Check {
    let mut at = path;
    while !at.exists() {
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    match operator::free_space(at) {
        Err(e) => fail(
            name,
            format!("{}: free space unknown: {e}", path.display()),
            "make the directory reachable by this user",
        ),
        Ok((free, total)) => {
            let min = floor.bytes_of(total);
            let fs = operator::filesystem_type(at).unwrap_or_else(|_| "unknown type".into());
            let detail = format!(
                "{} ({fs}): {} MiB free of {} MiB; floor {} MiB",
                path.display(),
                free >> 20,
                total >> 20,
                min.div_ceil(1 << 20)
            );
            if free < min {
                fail(
                    name,
                    format!("{detail}: below the floor, turns are refused"),
                    "free space on that filesystem, or lower limits.disk_floor_mb / limits.disk_floor_percent",
                )
            } else {
                pass(name, detail)
            }
        }
    }
}

pub(crate) fn user_check(uid: u32, gid: u32) -> Check {
    if uid == 0 {
        fail(
            "user",
            "running as root: the runtime refuses root",
            "run as the non-root service user (scripts/setup.sh creates `roundtable` in the docker group): \
             setpriv --reuid=roundtable --regid=roundtable --init-groups roundtable-sandbox …",
        )
    } else {
        pass("user", format!("uid {uid}, gid {gid}"))
    }
}

/// The configured runtime must be one the engine lists in its info's `Runtimes`.
fn runtime_check(
    wanted: Option<&str>,
    listed: Result<(Vec<String>, String), roundtable_sandbox::DriverError>,
) -> Check {
    let (names, default) = match listed {
        Ok(l) => l,
        Err(e) => return fail("runtime", e.to_string(), "fix the docker check first"),
    };
    match wanted {
        None => pass("runtime", format!("the engine's default ({default})")),
        Some(r) if names.iter().any(|n| n == r) => {
            pass("runtime", format!("{r}, listed by the engine"))
        }
        Some(r) => fail(
            "runtime",
            format!(
                "{r} is not listed by the engine (it lists {})",
                names.join(", ")
            ),
            if r == roundtable_sandbox::operator::GVISOR_RUNTIME {
                "run scripts/setup.sh --gvisor as root (installs runsc, adds it to \
                 /etc/docker/daemon.json, reloads the engine with SIGHUP)"
            } else {
                "add it to \"runtimes\" in /etc/docker/daemon.json and reload the engine \
                 (kill -HUP $(cat /var/run/docker.pid))"
            },
        ),
    }
}

fn driver_for(config: &Config) -> DockerDriver {
    let mut options = config.docker_options();
    options.call_timeout = std::time::Duration::from_secs(5);
    DockerDriver::new(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_detected_with_a_hint() {
        let c = user_check(0, 0);
        assert!(!c.ok);
        assert_eq!(c.detail, "running as root: the runtime refuses root");
        assert!(c.hint.unwrap().contains("setpriv --reuid=roundtable"));
        assert!(user_check(999, 995).ok);
    }

    #[test]
    fn runtime_check_names_the_fix() {
        let listed = || {
            Ok((
                vec!["runc".to_owned(), "runsc".to_owned()],
                "runc".to_owned(),
            ))
        };
        let c = runtime_check(None, listed());
        assert!(c.ok);
        assert_eq!(c.detail, "the engine's default (runc)");
        let c = runtime_check(Some("runsc"), listed());
        assert!(c.ok);
        assert_eq!(c.detail, "runsc, listed by the engine");
        let c = runtime_check(Some("runsc"), Ok((vec!["runc".into()], "runc".into())));
        assert!(!c.ok);
        assert_eq!(
            c.detail,
            "runsc is not listed by the engine (it lists runc)"
        );
        assert_eq!(
            c.hint.as_deref(),
            Some(
                "run scripts/setup.sh --gvisor as root (installs runsc, adds it to \
                 /etc/docker/daemon.json, reloads the engine with SIGHUP)"
            )
        );
        let c = runtime_check(Some("kata"), listed());
        assert!(!c.ok);
        assert!(c.hint.unwrap().starts_with("add it to \"runtimes\""));
    }
}
