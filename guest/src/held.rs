//! `roundtable-guest --held-files [DIR]`: counts, from inside the sandbox, the files of the
//! workspace (or of `DIR`, an absolute path: an MCP session's data, `/data`) that the
//! container's processes hold open with no name left (deleted while open). The host runs it with
//! an engine exec where it cannot see the guest's descriptors itself (gVisor: the guest's
//! processes are the Sentry's, not the host's), and parses the one line it prints
//! ([`HeldReport`]).
//!
//! It walks this kernel's `/proc/<pid>/task/<tid>/fd/*` and `stat`s each entry through the
//! kernel's magic link (never opening it, never following any other path a guest made),
//! and counts every regular file on the workspace's filesystem that has no name left
//! (`st_nlink == 0`, or a link target the kernel marks ` (deleted)`: gVisor keeps a deleted
//! file's link count), each inode once, by allocated blocks. A live process whose
//! descriptors it cannot read, or a deleted workspace file held only by a memory mapping,
//! is reported as such; the host treats those, and any failure, as "cannot be measured".
//!
//! It runs with the guest's uid next to the guest, so the guest can signal it or starve
//! it: every such end (killed, no output, a timeout) fails closed on the host.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use roundtable_sandbox_protocol::held::HeldReport;
use roundtable_sandbox_protocol::WORKSPACE_MOUNT;

/// Measures, prints the report and exits: 0 when a report was printed, 2 otherwise.
pub fn main() -> ! {
    // Not dumpable: a process of the guest (same uid) may not read or write this one's
    // memory or descriptors through /proc (where the kernel enforces it).
    let _ = nix::sys::prctl::set_dumpable(false);
    let dir = std::env::args_os()
        .nth(2)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| WORKSPACE_MOUNT.into());
    if !dir.is_absolute() {
        eprintln!(
            "roundtable-guest: held files: {} is not absolute",
            dir.display()
        );
        std::process::exit(2);
    }
    let report = match measure(Path::new("/proc"), &dir) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("roundtable-guest: held files: {e}");
            std::process::exit(2);
        }
    };
    let mut out = std::io::stdout().lock();
    if out
        .write_all(report.line().as_bytes())
        .and_then(|()| out.flush())
        .is_err()
    {
        std::process::exit(2);
    }
    std::process::exit(0);
}

fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(nix::libc::ESRCH)
}

fn denied(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::PermissionDenied
}

/// Counts what the processes under `proc` hold on the filesystem of `workspace`.
pub fn measure(proc: &Path, workspace: &Path) -> std::io::Result<HeldReport> {
    let ws = std::fs::symlink_metadata(workspace)?;
    if !ws.is_dir() {
        return Err(std::io::Error::other("the workspace is not a directory"));
    }
    let dev = ws.dev();
    let me = std::process::id().to_string();
    let (mut files, mut bytes) = (0u64, 0u64);
    let mut seen: HashSet<u64> = HashSet::new();
    let mut mapped: HashSet<u64> = HashSet::new();
    for entry in std::fs::read_dir(proc)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let pid_dir = proc.join(pid);
        let tasks = match std::fs::read_dir(pid_dir.join("task")) {
            Ok(t) => t,
            // gVisor shows no task of a leader that ended alone (`exit`, not `exit_group`)
            // while its threads live on: what they hold and map cannot be seen.
            Err(e) if gone(&e) && leader_gone_threads_live(&pid_dir) => {
                return Ok(HeldReport::HiddenDescriptors)
            }
            Err(e) if gone(&e) => continue,
            Err(e) if denied(&e) => return Ok(HeldReport::HiddenDescriptors),
            Err(e) => return Err(e),
        };
        let mut live_task: Option<std::path::PathBuf> = None;
        for task in tasks {
            let task = match task {
                Ok(t) => t,
                Err(e) if gone(&e) => break,
                Err(e) => return Err(e),
            };
            let task_dir = task.path();
            if live_task.is_none() && has_memory(&task_dir) {
                live_task = Some(task_dir.clone());
            }
            match held_by_task(&task_dir, dev, &mut seen, &mut files, &mut bytes) {
                Ok(()) => {}
                Err(e) if gone(&e) => {}
                // An exiting task or a zombie (no memory left) holds nothing; a live one
                // hides its descriptors.
                Err(e) if denied(&e) => {
                    if has_memory(&task_dir) {
                        return Ok(HeldReport::HiddenDescriptors);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        // The mappings of a task that has its memory: a leader that ended alone (`exit`,
        // not `exit_group`) is a zombie with none, its threads live on.
        let Some(live) = live_task else {
            continue;
        };
        match std::fs::File::open(live.join("maps")) {
            Ok(f) => {
                for line in std::io::BufReader::new(f).lines() {
                    match line {
                        Ok(line) => mapped.extend(mapped_deleted(&line, dev)),
                        Err(e) if gone(&e) => break,
                        Err(e) if denied(&e) => return Ok(HeldReport::HiddenDescriptors),
                        Err(e) => return Err(e),
                    }
                }
            }
            Err(e) if gone(&e) => {}
            Err(e) if denied(&e) => return Ok(HeldReport::HiddenDescriptors),
            Err(e) => return Err(e),
        }
    }
    if mapped.iter().any(|ino| !seen.contains(ino)) {
        return Ok(HeldReport::MappedDeleted);
    }
    Ok(HeldReport::Counted { files, bytes })
}

/// Whether the process at `pid_dir` is a zombie leader with threads still alive.
fn leader_gone_threads_live(pid_dir: &Path) -> bool {
    let Ok(status) = std::fs::read_to_string(pid_dir.join("status")) else {
        return false;
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    field("State:").is_some_and(|s| s.starts_with('Z'))
        && field("Threads:")
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n > 1)
}

fn has_memory(task_dir: &Path) -> bool {
    std::fs::read_to_string(task_dir.join("status"))
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("VmSize:")))
}

fn held_by_task(
    task_dir: &Path,
    dev: u64,
    seen: &mut HashSet<u64>,
    files: &mut u64,
    bytes: &mut u64,
) -> std::io::Result<()> {
    for fd in std::fs::read_dir(task_dir.join("fd"))? {
        let link = fd?.path();
        // `stat` through the magic link: the open file's own inode; nothing is opened.
        let st = match std::fs::metadata(&link) {
            Ok(st) => st,
            Err(e) if denied(&e) => return Err(e),
            // Closed meanwhile, or a descriptor with nothing to stat.
            Err(_) => continue,
        };
        if st.dev() != dev || !st.file_type().is_file() {
            continue;
        }
        let deleted = st.nlink() == 0
            || match std::fs::read_link(&link) {
                Ok(target) => target
                    .as_os_str()
                    .as_encoded_bytes()
                    .ends_with(b" (deleted)"),
                Err(e) if gone(&e) => continue,
                Err(e) if denied(&e) => return Err(e),
                // A target the kernel cannot spell (too long): counted, never skipped.
                Err(_) => true,
            };
        if deleted && seen.insert(st.ino()) {
            *files += 1;
            *bytes = bytes.saturating_add(st.blocks().saturating_mul(512));
        }
    }
    Ok(())
}

/// The inode of a deleted file on `dev` that a `/proc/<pid>/maps` line maps, if any.
fn mapped_deleted(line: &str, dev: u64) -> Option<u64> {
    if !line.ends_with(" (deleted)") {
        return None;
    }
    let mut fields = line.split_whitespace();
    let device = fields.nth(3)?;
    let inode: u64 = fields.next()?.parse().ok()?;
    let (major, minor) = device.split_once(':')?;
    let d = nix::sys::stat::makedev(
        u64::from_str_radix(major, 16).ok()?,
        u64::from_str_radix(minor, 16).ok()?,
    );
    (d == dev && inode != 0).then_some(inode)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `/proc` of the test's own making: each entry a link to a real process's dir.
    fn fake_proc(name: &str, pids: &[u32]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("held-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        for (i, pid) in pids.iter().enumerate() {
            std::os::unix::fs::symlink(format!("/proc/{pid}"), dir.join((i + 1).to_string()))
                .unwrap();
        }
        dir
    }

    #[test]
    fn counts_deleted_files_held_open_once_by_blocks() {
        let ws = fake_proc("ws", &[]);
        let kept = std::fs::File::create(ws.join("kept")).unwrap();
        kept.set_len(1 << 30).unwrap();
        let mut gone = std::fs::File::create(ws.join("gone")).unwrap();
        gone.write_all(&vec![1u8; 1 << 20]).unwrap();
        gone.sync_all().unwrap();
        std::fs::remove_file(ws.join("gone")).unwrap();
        // Two processes hold the deleted file (one twice), one the kept file.
        let hold = |f: &std::fs::File, g: &std::fs::File| {
            std::process::Command::new("sleep")
                .arg("10")
                .stdin(f.try_clone().unwrap())
                .stdout(g.try_clone().unwrap())
                .spawn()
                .unwrap()
        };
        let mut a = hold(&gone, &gone);
        let mut b = hold(&gone, &kept);
        let proc = fake_proc("proc", &[a.id(), b.id()]);
        let counted = measure(&proc, &ws).unwrap();
        // A process of another user (init) hides its descriptors, unless the test is root.
        let hidden = measure(&fake_proc("init", &[1]), &ws).unwrap();
        for c in [&mut a, &mut b] {
            let _ = c.kill();
            let _ = c.wait();
        }
        let HeldReport::Counted { files, bytes } = counted else {
            panic!("{counted:?}");
        };
        assert_eq!(files, 1);
        assert!((1 << 20..2 << 20).contains(&bytes), "{bytes}");
        if !nix::unistd::getuid().is_root() {
            assert_eq!(hidden, HeldReport::HiddenDescriptors);
        }
        for d in ["ws", "proc", "init"] {
            let _ = std::fs::remove_dir_all(
                std::env::temp_dir().join(format!("held-{d}-{}", std::process::id())),
            );
        }
    }

    #[test]
    fn maps_lines_name_deleted_files_on_the_device() {
        let dev = nix::sys::stat::makedev(0, 0x0d);
        assert_eq!(
            mapped_deleted(
                "7fe151200000-7fe151600000 rw-s 00000000 00:0d 2   /workspace/mapped (deleted)",
                dev
            ),
            Some(2)
        );
        assert_eq!(
            mapped_deleted(
                "00400000-00401000 r--p 00000000 00:08 14   /bin/busybox",
                dev
            ),
            None
        );
        assert_eq!(
            mapped_deleted(
                "7f0000002000-7f0000003000 rw-s 00000000 00:05 99 /dev/zero (deleted)",
                dev
            ),
            None
        );
    }
}
