//! The workspace quota and the free-space floor: how much disk a channel's workspace may
//! hold, and how little free space the host keeps.
//!
//! Layers, none of which needs root, and none of which follows, opens, reads or changes a
//! guest path (a workspace, its entries and the guest's processes are hostile):
//! 1. **Per file, in the kernel**: the container runs with `RLIMIT_FSIZE` at the quota
//!    (`ulimit fsize`), so a write or truncate cannot grow one file past it (the writer gets
//!    `SIGXFSZ` / `EFBIG`; the turn fails with a clear error). `fallocate` with
//!    `FALLOC_FL_KEEP_SIZE` is not held by it on every filesystem (ext4 allocates anyway):
//!    the layers below catch it, see docs/security.md for the bound.
//! 2. **During the turn**: a watcher measures the workspace every [`WATCH_INTERVAL`] (or
//!    four times what the last measure cost, if longer, up to [`MAX_WATCH_PAUSE`]) and kills the container as soon
//!    as it is over quota, or as soon as a guarded filesystem is below its free-space floor.
//! 3. **Before each turn**: a workspace over quota, or a filesystem below its floor,
//!    refuses the turn with a clear error until an operator frees space.
//!
//! The measure ([`measure`]) works by descriptor only: it holds the workspace open, lists
//! each directory through its own descriptor, `fstatat`s each entry without following it
//! (`AT_SYMLINK_NOFOLLOW`) and opens a subdirectory only relative to its parent's
//! descriptor with `O_NOFOLLOW | O_DIRECTORY`, so a directory the guest swaps for a
//! symlink mid-walk is never followed out of the workspace. It counts allocated blocks
//! (`st_blocks * 512`: a sparse file costs what it occupies, preallocated space counts) and
//! inodes, each `(dev, ino)` once (hard links count once), and stops as soon as either limit
//! is passed. What it cannot measure counts as over quota, and is never "fixed" by the host:
//! a directory the guest made unreadable, a tree nested past [`MAX_DEPTH`], an entry on
//! another filesystem.
//!
//! Files a turn deleted while holding them open (and `O_TMPFILE` files) are in no directory:
//! the watcher asks the driver how to count them ([`ContainerDriver::held_files`]). Where the
//! guest's processes are host processes (runc), the driver lists their host pids; each
//! `/proc/<pid>` is checked to be in that container's cgroup, then the entries of its `fd`
//! dirs are `stat`ed — never opened — and every regular file with no link left on the
//! workspace's filesystem counts. Where they are not (gVisor), the driver counts them inside
//! the sandbox (the guest program's `--held-files` measurer, run by the engine) and reports
//! every failure to do so. A process that hides its descriptors (not dumpable), a deleted
//! workspace file held only through a memory mapping, or a count that failed cannot be
//! measured, so it counts as over quota too, once it has stayed so for [`UNMEASURABLE_FOR`]
//! (the tree alone is held to the quota meanwhile).

use std::collections::HashSet;
use std::ffi::CStr;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;

use crate::driver::{ContainerDriver, ContainerProcesses, HeldFiles, Unmeasurable};

/// How often the watcher measures a running turn's workspace (at least; a workspace whose
/// measure costs much CPU is measured less often, so the watcher stays under ~20 % of a
/// core, but never less often than every [`MAX_WATCH_PAUSE`]).
pub const WATCH_INTERVAL: Duration = Duration::from_millis(250);

/// The longest pause between two measures of a running turn's workspace. The pause grows
/// with the CPU the tree walk took, not its wall time: on a loaded machine a measure waits
/// for a core, and a pause grown from that wait (four times it, unbounded) let a guest write
/// 1.7 GB past an 8 MiB quota between two measures (load 44).
pub const MAX_WATCH_PAUSE: Duration = Duration::from_secs(1);

/// The deepest directory nesting the measure follows (it holds one descriptor per level);
/// a deeper workspace cannot be measured and counts as over quota.
pub const MAX_DEPTH: usize = 128;

/// How soon a measure that failed in a way a race explains is tried again.
const RETRY_AFTER: Duration = Duration::from_millis(50);

/// How long the turn's processes may stay unmeasurable (every measure in a row failing in a
/// way a race explains) before the turn counts as over quota. The engine's own init is not
/// dumpable from its `setuid` until its `exec` of the guest, and waits there for the
/// container's start: on a busy machine that lasts past a second. Meanwhile the tree itself
/// is still measured and held to the quota; what a hidden process holds open is freed when
/// the turn is killed.
pub const UNMEASURABLE_FOR: Duration = Duration::from_secs(3);

/// The most of one process's `/proc/<pid>/maps` the host reads. Its 65,530 mappings (the
/// kernel's default cap) of ordinary paths are under 8 MiB; a guest's own deep, long paths
/// made it gigabytes, read whole every tick. Past it the process cannot be measured.
pub const MAX_MAPS_BYTES: u64 = 16 << 20;

/// How many times a directory that changed while it was listed is listed again.
const RELISTS: u8 = 3;

/// What a workspace holds, as far as it was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Allocated bytes (`st_blocks * 512`) of every inode counted, each once.
    pub bytes: u64,
    /// Entries counted (files, dirs, links…): every inode once, and every further name of
    /// one (a hard link); the workspace dir itself excluded.
    pub entries: u64,
    /// Of `bytes`: files in no directory, held open by the turn's processes.
    pub held_bytes: u64,
    /// How many such files.
    pub held_files: u64,
}

/// A workspace's quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Bytes the workspace may hold.
    pub max_bytes: u64,
    /// Entries (files, dirs, links) it may hold.
    pub max_entries: u64,
}

impl Quota {
    /// A quota of `mb` MiB (saturating) and `entries` entries.
    pub(crate) fn from_mib(mb: u64, entries: u64) -> Self {
        Self {
            max_bytes: mb.saturating_mul(1 << 20),
            max_entries: entries,
        }
    }

    /// Whether `usage` is past this quota.
    pub fn exceeded_by(&self, usage: &Usage) -> bool {
        usage.bytes > self.max_bytes || usage.entries > self.max_entries
    }
}

/// The free space a filesystem must keep: the larger of `min_bytes` and `min_percent` of
/// its size (what an unprivileged writer can use of it; both zero: no floor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Floor {
    /// The least free bytes.
    pub min_bytes: u64,
    /// The least free space in percent of the filesystem's size.
    pub min_percent: u64,
}

impl Floor {
    /// Whether there is a floor at all (0 and 0: none).
    pub fn is_on(&self) -> bool {
        self.min_bytes != 0 || self.min_percent != 0
    }

    /// The floor in bytes of a filesystem of `total` bytes.
    pub fn bytes_of(&self, total: u64) -> u64 {
        self.min_bytes.max(total / 100 * self.min_percent)
    }
}

/// Why a workspace was refused or a turn ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error(
        "this channel's workspace is over its quota ({used} used{held}; the limit is {limit}); \
         an operator must free space in it before the next turn"
    )]
    /// The workspace holds more than its quota.
    Exceeded {
        /// What it holds.
        used: String,
        /// What of it is in deleted files held open (empty: none).
        held: String,
        /// The quota.
        limit: String,
    },
    #[error(
        "this channel's workspace cannot be measured ({0}); an operator must fix or clear it \
         before the next turn"
    )]
    /// The workspace cannot be measured (why, without guest-chosen names).
    Measure(String),
    #[error(
        "the filesystem of {path} ({what}) has {free_mib} MiB free, below its floor of \
         {floor_mib} MiB; turns are refused until an operator frees space"
    )]
    /// A guarded filesystem is below its floor.
    FreeSpace {
        /// What it holds.
        what: &'static str,
        /// A path on it.
        path: PathBuf,
        /// Its free space.
        free_mib: u64,
        /// Its floor.
        floor_mib: u64,
    },
    /// A guarded filesystem's free space cannot be read.
    #[error("the free space of {path} ({what}) cannot be read: {reason}")]
    FreeSpaceUnknown {
        /// What it holds.
        what: &'static str,
        /// A path on it.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl QuotaError {
    pub(crate) fn exceeded(quota: &Quota, usage: &Usage) -> Self {
        if usage.entries > quota.max_entries {
            QuotaError::Exceeded {
                used: format!("more than {} entries", quota.max_entries),
                held: String::new(),
                limit: format!("{} entries", quota.max_entries),
            }
        } else {
            let held = if usage.held_files > 0 {
                format!(
                    ", {} MiB of it in {} deleted files held open",
                    usage.held_bytes.div_ceil(1 << 20),
                    usage.held_files
                )
            } else {
                String::new()
            };
            QuotaError::Exceeded {
                used: format!("{} MiB", usage.bytes.div_ceil(1 << 20)),
                held,
                limit: format!("{} MiB", quota.max_bytes >> 20),
            }
        }
    }
}

/// Why a measure failed. The messages never hold a guest-chosen name.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    /// A directory cannot be opened or searched.
    #[error("a directory in it cannot be opened or searched: {0}")]
    Unreadable(std::io::Error),
    /// The tree is deeper than the measure descends.
    #[error("it is nested deeper than {MAX_DEPTH} directories")]
    TooDeep,
    /// An entry is on another filesystem (a mount).
    #[error("an entry in it is on another filesystem")]
    ForeignDevice,
    /// A process of the turn cannot be inspected.
    #[error("a process of the turn hides its open files from the host")]
    HiddenDescriptors,
    /// A deleted file is held only by a memory mapping.
    #[error("a deleted workspace file is held only through a memory mapping")]
    MappedDeleted,
    /// A process's list of mappings is longer than the host reads.
    #[error("a process of the turn maps more than the host reads ({MAX_MAPS_BYTES} bytes of /proc maps)")]
    MapsTooLong,
    /// What the turn's processes hold could not be counted inside the sandbox.
    #[error("{0}")]
    Sandbox(Unmeasurable),
    /// A system call failed.
    #[error("{op}")]
    Io {
        /// The call.
        op: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

impl MeasureError {
    fn io(op: &'static str) -> impl FnOnce(Errno) -> MeasureError {
        move |e| MeasureError::Io {
            op,
            source: e.into(),
        }
    }

    /// Failures that no retry can cure (the guest did it on purpose). The others may be a
    /// moment's race: a file removed mid-walk; a process between the engine's `setuid` and
    /// `exec` (not dumpable for that instant); a mapping being torn down.
    fn is_final(&self) -> bool {
        matches!(
            self,
            MeasureError::Unreadable(_)
                | MeasureError::TooDeep
                | MeasureError::ForeignDevice
                | MeasureError::MapsTooLong
        )
    }
}

/// A channel's workspace, held open: every measure starts from this descriptor.
#[derive(Debug)]
pub struct Workspace {
    fd: OwnedFd,
    dev: u64,
    ino: u64,
}

impl Workspace {
    /// Opens the workspace dir. Its path is the host's own (`workspace_root/<segment>`); the
    /// last component is refused if it is a symlink.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        Self::from_fd(rustix::fs::open(dir, dir_flags(), Mode::empty())?)
    }

    /// Opens the directory `name` in `root` (a held descriptor; `name` one component, a
    /// symlink refused).
    pub fn open_at(root: BorrowedFd<'_>, name: &str) -> std::io::Result<Self> {
        Self::from_fd(rustix::fs::openat(root, name, dir_flags(), Mode::empty())?)
    }

    fn from_fd(fd: OwnedFd) -> std::io::Result<Self> {
        let (dev, ino) = key(&rustix::fs::fstat(&fd)?);
        Ok(Self { fd, dev, ino })
    }

    /// The workspace directory's identity (device, inode).
    pub fn id(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY
        | OFlags::DIRECTORY
        | OFlags::NOFOLLOW
        | OFlags::CLOEXEC
        | OFlags::NONBLOCK
        | OFlags::NOCTTY
}

fn key(st: &Stat) -> (u64, u64) {
    (st.st_dev, st.st_ino)
}

// The stat field types differ per architecture: the casts are not the same everywhere.
#[allow(clippy::unnecessary_cast)]
fn stamp(st: &Stat) -> (i64, u64, i64, u64, u64) {
    (
        st.st_mtime,
        st.st_mtime_nsec as u64,
        st.st_ctime,
        st.st_ctime_nsec as u64,
        st.st_nlink as u64,
    )
}

fn blocks(st: &Stat) -> u64 {
    (st.st_blocks as u64).saturating_mul(512)
}

struct Frame {
    dir: Dir,
    before: (i64, u64, i64, u64, u64),
    relists: u8,
}

impl Frame {
    fn new(fd: OwnedFd) -> Result<Self, MeasureError> {
        let before = stamp(&rustix::fs::fstat(&fd).map_err(MeasureError::io("stat a directory"))?);
        let dir = Dir::new(fd).map_err(MeasureError::io("list a directory"))?;
        Ok(Self {
            dir,
            before,
            relists: 0,
        })
    }

    fn fd(&self) -> Result<BorrowedFd<'_>, MeasureError> {
        self.dir.fd().map_err(MeasureError::io("list a directory"))
    }

    /// At the end of its listing: a directory that changed while it was listed may have
    /// had an entry renamed past the listing, so it is listed again (what was counted is
    /// not again), at most [`RELISTS`] times. Whether it was rewound.
    fn relisted(&mut self) -> Result<bool, MeasureError> {
        let after = rustix::fs::fstat(self.fd()?).map_err(MeasureError::io("stat a directory"))?;
        if stamp(&after) != self.before && self.relists < RELISTS {
            self.relists += 1;
            self.before = stamp(&after);
            self.dir.rewind();
            Ok(true)
        } else {
            Ok(false)
        }
    }
}

/// Measures the workspace, and the files the turn's processes hold open after deleting
/// them (when given: `held`, as the driver reports them), stopping as soon as `quota` is
/// passed.
pub fn measure(
    workspace: &Workspace,
    quota: &Quota,
    held: Option<&HeldFiles>,
) -> Result<Usage, MeasureError> {
    let mut tally = Tally {
        quota,
        seen: HashSet::new(),
        usage: Usage::default(),
    };
    if let Walked::OverQuota = walk(workspace, &mut tally)? {
        return Ok(tally.usage);
    }
    tally.add_held(workspace.dev, held)?;
    Ok(tally.usage)
}

/// What a measure has counted: every file once (by device and inode), against its quota.
struct Tally<'q> {
    quota: &'q Quota,
    seen: HashSet<(u64, u64)>,
    usage: Usage,
}

/// What counting one file did.
enum Counted {
    /// It was counted before (a hard link, or a directory listed again).
    Again,
    /// Counted, within the quota.
    New,
    /// Counted, and the usage is past the quota.
    Over,
}

/// How a walk of the workspace's tree ended.
enum Walked {
    Whole,
    /// Stopped as soon as the quota was passed.
    OverQuota,
}

impl Tally<'_> {
    /// Counts one more name of an inode counted before; whether the usage is past the
    /// quota.
    fn count_name(&mut self) -> bool {
        self.usage.entries += 1;
        self.quota.exceeded_by(&self.usage)
    }

    /// Counts one file, unless it was counted before.
    fn count(&mut self, st: &Stat) -> Counted {
        if !self.seen.insert(key(st)) {
            return Counted::Again;
        }
        self.usage.entries += 1;
        self.usage.bytes = self.usage.bytes.saturating_add(blocks(st));
        if self.quota.exceeded_by(&self.usage) {
            Counted::Over
        } else {
            Counted::New
        }
    }

    /// Adds the files the turn's processes hold open after deleting them.
    fn add_held(&mut self, dev: u64, held: Option<&HeldFiles>) -> Result<(), MeasureError> {
        let usage = &mut self.usage;
        match held {
            None => {}
            Some(HeldFiles::HostProcesses(processes)) => {
                held_files(dev, processes, &mut self.seen, usage)?;
            }
            // Counted inside the sandbox, on its view of the workspace: no name is left to them,
            // so none of them is in the tree just walked.
            Some(HeldFiles::Counted { files, bytes }) => {
                usage.held_files = usage.held_files.saturating_add(*files);
                usage.held_bytes = usage.held_bytes.saturating_add(*bytes);
                usage.bytes = usage.bytes.saturating_add(*bytes);
            }
            Some(HeldFiles::Unmeasurable(why)) => {
                return Err(match why {
                    Unmeasurable::HiddenDescriptors => MeasureError::HiddenDescriptors,
                    Unmeasurable::MappedDeleted => MeasureError::MappedDeleted,
                    other => MeasureError::Sandbox(other.clone()),
                })
            }
        }
        Ok(())
    }
}

/// Walks the workspace's tree depth first, counting every entry once, never leaving its
/// device or following a link, stopping as soon as the quota is passed.
fn walk(workspace: &Workspace, tally: &mut Tally<'_>) -> Result<Walked, MeasureError> {
    let root_fd = rustix::fs::openat(workspace.fd.as_fd(), c".", dir_flags(), Mode::empty())
        .map_err(MeasureError::io("open the workspace"))?;
    let root = rustix::fs::fstat(&root_fd).map_err(MeasureError::io("stat the workspace"))?;
    tally.seen.insert(key(&root));
    tally.usage.bytes = blocks(&root);
    let mut stack = vec![Frame::new(root_fd)?];
    while let Some(frame) = stack.last_mut() {
        let entry = match frame.dir.read() {
            None => {
                if !frame.relisted()? {
                    stack.pop();
                }
                continue;
            }
            // Removed while listed (a racing writer): nothing left to count there.
            Some(Err(Errno::NOENT)) => {
                stack.pop();
                continue;
            }
            Some(Err(e)) => return Err(MeasureError::io("list a directory")(e)),
            Some(Ok(e)) => e,
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let st = match rustix::fs::statat(frame.fd()?, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => continue,
            Err(Errno::ACCESS) => return Err(MeasureError::Unreadable(Errno::ACCESS.into())),
            Err(e) => return Err(MeasureError::io("stat an entry")(e)),
        };
        if st.st_dev != workspace.dev {
            return Err(MeasureError::ForeignDevice);
        }
        match tally.count(&st) {
            // Another name of an inode counted before (a hard link) is an entry of its own
            // (tens of millions of names fit in a quota's bytes, each one statted by every
            // measure); a directory listed again is not.
            Counted::Again if frame.relists == 0 => {
                if tally.count_name() {
                    return Ok(Walked::OverQuota);
                }
                continue;
            }
            Counted::Again => continue,
            Counted::Over => return Ok(Walked::OverQuota),
            Counted::New => {}
        }
        if FileType::from_raw_mode(st.st_mode as _) != FileType::Directory {
            continue;
        }
        if stack.len() >= MAX_DEPTH {
            return Err(MeasureError::TooDeep);
        }
        let parent = stack.last().expect("a frame is being read");
        let child = match open_child(parent.fd()?, name) {
            Ok(Some(fd)) => fd,
            Ok(None) => continue,
            Err(e) => return Err(e),
        };
        let frame = Frame::new(child)?;
        // What was opened may not be what was stat'ed (swapped in between): it is inside the
        // workspace all the same (opened relative to its parent, never through a link).
        let opened =
            rustix::fs::fstat(frame.fd()?).map_err(MeasureError::io("stat a directory"))?;
        if opened.st_dev != workspace.dev {
            return Err(MeasureError::ForeignDevice);
        }
        if key(&opened) != key(&st) {
            match tally.count(&opened) {
                Counted::Again => continue,
                Counted::Over => return Ok(Walked::OverQuota),
                Counted::New => {}
            }
        }
        stack.push(frame);
    }
    Ok(Walked::Whole)
}

/// Opens a subdirectory relative to its parent, never through a link. `None`: it is no
/// longer a directory (removed or swapped for something else, which the walk does not follow).
fn open_child(parent: BorrowedFd<'_>, name: &CStr) -> Result<Option<OwnedFd>, MeasureError> {
    match rustix::fs::openat(parent, name, dir_flags(), Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR) => Ok(None),
        Err(Errno::ACCESS) => Err(MeasureError::Unreadable(Errno::ACCESS.into())),
        Err(e) => Err(MeasureError::io("open a directory")(e)),
    }
}

fn read_small(dir: BorrowedFd<'_>, name: &CStr) -> Result<String, Errno> {
    let fd = rustix::fs::openat(dir, name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    let mut text = String::new();
    std::fs::File::from(fd)
        .read_to_string(&mut text)
        .map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO))?;
    Ok(text)
}

/// Counts the regular files on `dev` with no link left that the container's processes hold
/// open (deleted while open, or `O_TMPFILE`), each once. Each `/proc/<pid>` is opened once
/// and used by descriptor, so a pid reused meanwhile is never mistaken for the container's.
pub fn held_files(
    dev: u64,
    processes: &ContainerProcesses,
    seen: &mut HashSet<(u64, u64)>,
    usage: &mut Usage,
) -> Result<(), MeasureError> {
    let uid = rustix::process::getuid().as_raw();
    let proc_fd = rustix::fs::open("/proc", dir_flags(), Mode::empty())
        .map_err(MeasureError::io("open /proc"))?;
    for pid in &processes.pids {
        let pid_dir =
            match rustix::fs::openat(&proc_fd, pid.to_string(), dir_flags(), Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::NOENT | Errno::SRCH) => continue,
                Err(e) => return Err(MeasureError::io("open a process dir")(e)),
            };
        let gone = |e: Errno| matches!(e, Errno::NOENT | Errno::SRCH);
        if let Some(marker) = &processes.cgroup_marker {
            match read_small(pid_dir.as_fd(), c"cgroup") {
                Ok(text) if text.contains(marker.as_str()) => {}
                // Reused by a process of another container or of the host: not the turn's.
                Ok(_) => continue,
                Err(e) if gone(e) => continue,
                Err(e) => return Err(MeasureError::io("read a process's cgroup")(e)),
            }
        }
        // The engine's own helpers (runc init, exec) run as root in the container's cgroup
        // for a moment; the guest's processes all run as the service user.
        match read_small(pid_dir.as_fd(), c"status") {
            Ok(text) => {
                let real_uid = text
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse::<u32>().ok());
                if real_uid != Some(uid) {
                    continue;
                }
            }
            Err(e) if gone(e) => continue,
            Err(e) => return Err(MeasureError::io("read a process's status")(e)),
        }
        let tasks = match rustix::fs::openat(&pid_dir, c"task", dir_flags(), Mode::empty()) {
            Ok(fd) => fd,
            Err(e) if gone(e) => continue,
            Err(Errno::ACCESS) => return Err(MeasureError::HiddenDescriptors),
            Err(e) => return Err(MeasureError::io("open a process's tasks")(e)),
        };
        // Each thread may have its own descriptor table (clone without CLONE_FILES).
        let mut live_task: Option<OwnedFd> = None;
        let mut task_list = Dir::read_from(&tasks).map_err(MeasureError::io("list tasks"))?;
        while let Some(task) = task_list.read() {
            let task = match task {
                Ok(t) => t,
                Err(e) if gone(e) => break,
                Err(e) => return Err(MeasureError::io("list tasks")(e)),
            };
            let tid = task.file_name();
            if tid == c"." || tid == c".." {
                continue;
            }
            let task_dir = match rustix::fs::openat(&tasks, tid, dir_flags(), Mode::empty()) {
                Ok(fd) => fd,
                Err(e) if gone(e) => continue,
                Err(e) => return Err(MeasureError::io("open a task dir")(e)),
            };
            match held_by_task(task_dir.as_fd(), dev, seen, usage) {
                // A task without memory (exiting, or a zombie) has its /proc files owned by
                // root for its last moments; it holds no file past them. A live task that
                // is not dumpable hides its descriptors.
                Err(MeasureError::HiddenDescriptors) if !has_memory(task_dir.as_fd()) => {}
                other => other?,
            }
            if live_task.is_none() && has_memory(task_dir.as_fd()) {
                live_task = Some(task_dir);
            }
        }
        // The process's mappings, from a task that has its memory: a leader that ended
        // alone (`exit`, not `exit_group`) is a zombie with none, its threads live on.
        let Some(maps_dir) = live_task else {
            continue;
        };
        match read_mapped_deleted(maps_dir.as_fd(), dev) {
            Ok(mapped) => {
                if mapped.iter().any(|k| !seen.contains(k)) {
                    return Err(MeasureError::MappedDeleted);
                }
            }
            Err(MapsRead::TooLong) => return Err(MeasureError::MapsTooLong),
            Err(MapsRead::Errno(e)) if gone(e) => continue,
            Err(MapsRead::Errno(Errno::ACCESS)) => return Err(MeasureError::HiddenDescriptors),
            Err(MapsRead::Errno(e)) => return Err(MeasureError::io("read a process's maps")(e)),
        }
    }
    Ok(())
}

/// Whether a task still has its memory (`VmSize` in its status): not exiting, not a zombie.
fn has_memory(task_dir: BorrowedFd<'_>) -> bool {
    read_small(task_dir, c"status").is_ok_and(|s| s.lines().any(|l| l.starts_with("VmSize:")))
}

fn held_by_task(
    task_dir: BorrowedFd<'_>,
    dev: u64,
    seen: &mut HashSet<(u64, u64)>,
    usage: &mut Usage,
) -> Result<(), MeasureError> {
    let fds = match rustix::fs::openat(task_dir, c"fd", dir_flags(), Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT | Errno::SRCH) => return Ok(()),
        Err(Errno::ACCESS) => return Err(MeasureError::HiddenDescriptors),
        Err(e) => return Err(MeasureError::io("open a descriptor table")(e)),
    };
    let mut list = Dir::read_from(&fds).map_err(MeasureError::io("list descriptors"))?;
    while let Some(entry) = list.read() {
        let entry = match entry {
            Ok(e) => e,
            Err(Errno::NOENT | Errno::SRCH) => break,
            Err(Errno::ACCESS) => return Err(MeasureError::HiddenDescriptors),
            Err(e) => return Err(MeasureError::io("list descriptors")(e)),
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        // `stat` of the magic link: the open file's own inode; nothing is opened.
        let st = match rustix::fs::statat(&fds, name, AtFlags::empty()) {
            Ok(st) => st,
            Err(Errno::ACCESS | Errno::PERM) => return Err(MeasureError::HiddenDescriptors),
            // Closed meanwhile, or a descriptor with nothing to stat.
            Err(_) => continue,
        };
        if st.st_dev == dev
            && st.st_nlink == 0
            && FileType::from_raw_mode(st.st_mode as _) == FileType::RegularFile
            && seen.insert(key(&st))
        {
            usage.held_files += 1;
            usage.held_bytes = usage.held_bytes.saturating_add(blocks(&st));
            usage.bytes = usage.bytes.saturating_add(blocks(&st));
        }
    }
    Ok(())
}

/// Why a process's mappings were not read.
enum MapsRead {
    Errno(Errno),
    /// Longer than [`MAX_MAPS_BYTES`].
    TooLong,
}

/// The `(dev, ino)` of every deleted file on `dev` that the task at `dir` maps.
fn read_mapped_deleted(dir: BorrowedFd<'_>, dev: u64) -> Result<Vec<(u64, u64)>, MapsRead> {
    let fd = rustix::fs::openat(
        dir,
        c"maps",
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(MapsRead::Errno)?;
    mapped_deleted(std::fs::File::from(fd), dev, MAX_MAPS_BYTES)
}

/// The `(dev, ino)` of every deleted file on `dev` in a `maps` text read from `from`, at
/// most `cap` bytes of it. Read in pieces: of a line only its head (the fields before the
/// path) and its last bytes (` (deleted)`) are kept, however long its path.
fn mapped_deleted(mut from: impl Read, dev: u64, cap: u64) -> Result<Vec<(u64, u64)>, MapsRead> {
    const HEAD: usize = 128;
    const DELETED: &[u8] = b" (deleted)";
    let mut found = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let (mut head, mut tail) = (
        Vec::with_capacity(HEAD),
        Vec::with_capacity(2 * DELETED.len()),
    );
    let mut read = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(MapsRead::Errno(
                    Errno::from_io_error(&e).unwrap_or(Errno::IO),
                ))
            }
        };
        read += n as u64;
        if read > cap {
            return Err(MapsRead::TooLong);
        }
        for piece in buf[..n].split_inclusive(|&b| b == b'\n') {
            let (text, ends) = match piece.strip_suffix(b"\n") {
                Some(text) => (text, true),
                None => (piece, false),
            };
            let room = HEAD - head.len();
            head.extend_from_slice(&text[..text.len().min(room)]);
            tail.extend_from_slice(&text[text.len().saturating_sub(DELETED.len())..]);
            tail.drain(..tail.len().saturating_sub(DELETED.len()));
            if ends {
                if tail.ends_with(DELETED) {
                    found.extend(deleted_mapping(&head, dev));
                }
                head.clear();
                tail.clear();
            }
        }
    }
    if tail.ends_with(DELETED) {
        found.extend(deleted_mapping(&head, dev));
    }
    Ok(found)
}

/// The `(dev, ino)` a `maps` line's head names, when it is on `dev`.
fn deleted_mapping(head: &[u8], dev: u64) -> Option<(u64, u64)> {
    // (A head cut inside a path's character: its fields, before the path, are ASCII.)
    let valid = match std::str::from_utf8(head) {
        Ok(_) => head.len(),
        Err(e) => e.valid_up_to(),
    };
    let head = std::str::from_utf8(&head[..valid]).ok()?;
    let mut fields = head.split_whitespace();
    let (_, _, _, device, inode) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let (major, minor) = device.split_once(':')?;
    let d = rustix::fs::makedev(
        u32::from_str_radix(major, 16).ok()?,
        u32::from_str_radix(minor, 16).ok()?,
    );
    let ino: u64 = inode.parse().ok()?;
    (d == dev && ino != 0).then_some((d, ino))
}

/// Measures the workspace at `dir` (the host's own path to it), without the turn's
/// processes: the check before a turn, and the tests' and operators' view.
pub fn measure_dir(dir: &Path, quota: &Quota) -> Result<Usage, MeasureError> {
    let workspace = Workspace::open(dir).map_err(|source| MeasureError::Io {
        op: "open the workspace",
        source,
    })?;
    measure(&workspace, quota, None)
}

/// Refuses a workspace over quota, or one that cannot be measured.
pub fn check(
    workspace: &Workspace,
    quota: &Quota,
    held: Option<&HeldFiles>,
) -> Result<Usage, QuotaError> {
    let usage =
        measure(workspace, quota, held).map_err(|e| QuotaError::Measure(crate::one_line(&e)))?;
    if quota.exceeded_by(&usage) {
        return Err(QuotaError::exceeded(quota, &usage));
    }
    Ok(usage)
}

/// A filesystem the floor guards: what it holds (for the error) and a path on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Guarded {
    /// What it holds (`the workspaces`, `the engine's data root`).
    pub what: &'static str,
    /// A path on it.
    pub path: PathBuf,
}

/// Free and total bytes of the filesystem holding `path`, both as an unprivileged writer
/// sees them: blocks reserved for root (or another user) are neither.
pub fn free_space(path: &Path) -> std::io::Result<(u64, u64)> {
    let v = rustix::fs::statvfs(path)?;
    let reserved = v.f_bfree.saturating_sub(v.f_bavail);
    Ok((
        v.f_bavail.saturating_mul(v.f_frsize),
        v.f_blocks
            .saturating_sub(reserved)
            .saturating_mul(v.f_frsize),
    ))
}

#[cfg(any(feature = "cli", feature = "testing"))]
/// The type of the filesystem holding `path` (for `doctor`): its name when known, else its
/// magic number.
pub fn filesystem_type(path: &Path) -> std::io::Result<String> {
    let magic = rustix::fs::statfs(path)?.f_type as u64;
    Ok(match magic {
        0xEF53 => "ext4".to_owned(),
        0x5846_5342 => "xfs".to_owned(),
        0x9123_683E => "btrfs".to_owned(),
        0x0102_1994 => "tmpfs".to_owned(),
        0x794C_7630 => "overlayfs".to_owned(),
        0x2FC1_2FC1 => "zfs".to_owned(),
        0x6969 => "nfs".to_owned(),
        0x6573_5546 => "fuse".to_owned(),
        other => format!("type {other:#x}"),
    })
}

/// Refuses when a guarded filesystem is below its floor, or its free space cannot be read.
pub(crate) fn check_floor(guarded: &[Guarded], floor: &Floor) -> Result<(), QuotaError> {
    if !floor.is_on() {
        return Ok(());
    }
    for g in guarded {
        let (free, total) = free_space(&g.path).map_err(|e| QuotaError::FreeSpaceUnknown {
            what: g.what,
            path: g.path.clone(),
            reason: e.to_string(),
        })?;
        let min = floor.bytes_of(total);
        if free < min {
            return Err(QuotaError::FreeSpace {
                what: g.what,
                path: g.path.clone(),
                free_mib: free >> 20,
                floor_mib: min.div_ceil(1 << 20),
            });
        }
    }
    Ok(())
}

/// What the watcher of a running turn guards.
#[derive(Debug, Clone)]
pub(crate) struct Watch {
    /// The turn's workspace.
    pub workspace: Arc<Workspace>,
    /// Its quota.
    pub quota: Quota,
    /// The free-space floor.
    pub floor: Floor,
    /// The filesystems the floor guards.
    pub guarded: Vec<Guarded>,
    /// The driver that counts (or lists the processes to count) what the container's
    /// processes hold open.
    pub driver: Arc<dyn ContainerDriver>,
    /// The turn's container (its processes hold files deleted while open).
    pub container: String,
}

/// Measures the workspace (and the files the turn's processes hold) and the guarded
/// filesystems' free space every [`WATCH_INTERVAL`] or more (off the async threads); returns
/// the error as soon as one is past its limit. Never returns otherwise: race it against the
/// turn.
pub(crate) async fn watch(w: Watch) -> QuotaError {
    let mut pause = WATCH_INTERVAL;
    // Since when every measure in a row failed in a way a race explains.
    let mut failing_since: Option<std::time::Instant> = None;
    // The held files are counted in a task of their own, waited for at most a tick: a slow
    // engine (the first inspect, or each exec under gVisor, on a loaded machine) delays that
    // count, never the tree's measure.
    let mut counting: Option<tokio_util::task::AbortOnDropHandle<HeldFiles>> = None;
    loop {
        tokio::time::sleep(pause).await;
        let started = std::time::Instant::now();
        let count = counting.get_or_insert_with(|| {
            let (driver, container) = (w.driver.clone(), w.container.clone());
            tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
                driver.held_files(&container).await
            }))
        });
        let held = match tokio::time::timeout(WATCH_INTERVAL, count).await {
            Ok(counted) => {
                counting = None;
                counted.ok()
            }
            Err(_) => None,
        };
        let held_counted = held.is_some();
        // Counting the held files is an engine exec under gVisor (~100 ms of the engine's
        // CPU, not ours): its wall time counts toward the pause, as the measure's CPU does.
        let counted_in = started.elapsed();
        let (ws, quota, floor, guarded) =
            (w.workspace.clone(), w.quota, w.floor, w.guarded.clone());
        let measured = tokio::task::spawn_blocking(move || {
            let cpu = thread_cpu_time();
            let result = (|| {
                check_floor(&guarded, &floor)?;
                let full = measure(&ws, &quota, held.as_ref());
                // While the turn's processes cannot be read, the tree alone is still measured.
                let tree = match &full {
                    Err(e) if !e.is_final() => Some(measure(&ws, &quota, None)),
                    _ => None,
                };
                Ok::<_, QuotaError>((full, tree))
            })();
            (result, thread_cpu_time().saturating_sub(cpu))
        })
        .await
        .map(|(result, cpu)| {
            pause = pause_after(cpu + counted_in);
            result
        });
        match measured {
            Ok(Err(floor_error)) => return floor_error,
            Ok(Ok((Ok(usage), _))) => {
                // Only a measure with the held files counted ends a run of failures.
                if held_counted {
                    failing_since = None;
                }
                if quota.exceeded_by(&usage) {
                    return QuotaError::exceeded(&quota, &usage);
                }
            }
            // What the guest did on purpose ends the turn at once; anything else (a race)
            // once it has lasted [`UNMEASURABLE_FOR`]; the tree is held to the quota meanwhile.
            Ok(Ok((Err(e), tree))) => {
                if e.is_final() {
                    return QuotaError::Measure(crate::one_line(&e));
                }
                match tree {
                    Some(Ok(usage)) if quota.exceeded_by(&usage) => {
                        return QuotaError::exceeded(&quota, &usage);
                    }
                    Some(Err(t)) if t.is_final() => {
                        return QuotaError::Measure(crate::one_line(&t))
                    }
                    _ => {}
                }
                let since = *failing_since.get_or_insert(started);
                if started.duration_since(since) >= UNMEASURABLE_FOR {
                    return QuotaError::Measure(crate::one_line(&e));
                }
                pause = pause.min(WATCH_INTERVAL).max(RETRY_AFTER);
            }
            Err(e) => tracing::debug!(error = %e, "workspace measure task"),
        }
    }
}

/// The pause after a measure that cost `cost`: the tree walk's CPU time (not its wall time,
/// which on a loaded machine is mostly a wait for a core) and the held files' count.
fn pause_after(cpu: Duration) -> Duration {
    (cpu * 4).clamp(WATCH_INTERVAL, MAX_WATCH_PAUSE)
}

/// The CPU time the calling thread has used.
fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn quota(mb: u64, entries: u64) -> Quota {
        Quota {
            max_bytes: mb << 20,
            max_entries: entries,
        }
    }

    fn check_dir(d: &Path, q: &Quota) -> Result<Usage, QuotaError> {
        check(&Workspace::open(d).unwrap(), q, None)
    }

    /// A backend whose count of held files never answers (an engine stuck under load).
    #[derive(Debug)]
    struct Stuck;

    impl ContainerDriver for Stuck {
        fn run<'a>(
            &'a self,
            _: &'a crate::driver::ContainerSpec,
            _: &'a [u8],
            _: tokio_util::sync::CancellationToken,
        ) -> crate::driver::BoxFuture<
            'a,
            Result<crate::driver::RunOutcome, crate::driver::DriverError>,
        > {
            Box::pin(async { Err(crate::driver::DriverError::Unsupported { op: "run" }) })
        }
        fn remove<'a>(
            &'a self,
            _: &'a str,
        ) -> crate::driver::BoxFuture<'a, Result<(), crate::driver::DriverError>> {
            Box::pin(async { Ok(()) })
        }
        fn sweep<'a>(
            &'a self,
            _: crate::driver::SweepScope<'a>,
        ) -> crate::driver::BoxFuture<'a, Result<Vec<String>, crate::driver::DriverError>> {
            Box::pin(async { Ok(Vec::new()) })
        }
        fn data_root(
            &self,
        ) -> crate::driver::BoxFuture<
            '_,
            Result<Option<std::path::PathBuf>, crate::driver::DriverError>,
        > {
            Box::pin(async { Ok(None) })
        }
        fn held_files<'a>(&'a self, _: &'a str) -> crate::driver::BoxFuture<'a, HeldFiles> {
            Box::pin(std::future::pending())
        }
    }

    /// The tree is measured each tick whatever the engine does: a workspace over its quota
    /// ends the turn while the count of its held files is still pending (before: the watcher
    /// waited for that count, and a guest wrote on meanwhile).
    #[tokio::test]
    async fn a_count_of_held_files_that_never_answers_does_not_hold_up_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("big"), vec![1u8; 3 << 20]).unwrap();
        let watch = Watch {
            workspace: Arc::new(Workspace::open(dir.path()).unwrap()),
            quota: quota(1, 1000),
            floor: Floor {
                min_bytes: 0,
                min_percent: 0,
            },
            guarded: Vec::new(),
            driver: Arc::new(Stuck),
            container: "c".into(),
        };
        let started = std::time::Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(20), super::watch(watch))
            .await
            .expect("the watcher waited for the held files' count");
        assert!(e.to_string().contains("workspace is over its quota"), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn the_pause_follows_the_measures_cpu_and_stays_under_a_second() {
        assert_eq!(pause_after(Duration::ZERO), WATCH_INTERVAL);
        assert_eq!(
            pause_after(Duration::from_millis(100)),
            Duration::from_millis(400)
        );
        // A measure that cost much CPU (or a clock that jumped) never stops the watcher
        // for long: the guest writes meanwhile.
        assert_eq!(pause_after(Duration::from_secs(30)), MAX_WATCH_PAUSE);
        // What a measure waiting for a core costs is wall time, not CPU: it is not counted.
        let waited = std::time::Instant::now();
        let cpu = thread_cpu_time();
        std::thread::sleep(Duration::from_millis(300));
        assert!(thread_cpu_time() - cpu < Duration::from_millis(100));
        assert!(waited.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn counts_blocks_once_per_inode_without_following_links() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/a"), vec![1u8; 100_000]).unwrap();
        // A hard link's blocks count once; its name is an entry.
        std::fs::hard_link(d.join("sub/a"), d.join("a-again")).unwrap();
        // A sparse file: large size, few blocks.
        let f = std::fs::File::create(d.join("sparse")).unwrap();
        f.set_len(1 << 40).unwrap();
        // A link to a big tree outside is counted as a link, not followed.
        std::os::unix::fs::symlink("/usr", d.join("usr")).unwrap();
        let u = measure_dir(d, &quota(1024, 1000)).unwrap();
        assert_eq!(u.entries, 5, "{u:?}");
        assert!(u.bytes >= 100_000 && u.bytes < 200_000, "{u:?}");
        assert!(check_dir(d, &quota(1024, 1000)).is_ok());
        assert_eq!(
            check_dir(d, &quota(1024, 3)).unwrap_err().to_string(),
            "this channel's workspace is over its quota (more than 3 entries used; the limit is 3 entries); an operator must free space in it before the next turn"
        );
        // Names that cost no blocks (a file's hard links) are held to the entries: 5,000
        // of one file pass a limit of 1,000.
        let links = tempfile::tempdir().unwrap();
        std::fs::write(links.path().join("f"), b"x").unwrap();
        for i in 0..5000 {
            std::fs::hard_link(links.path().join("f"), links.path().join(format!("l{i}"))).unwrap();
        }
        assert_eq!(
            check_dir(links.path(), &quota(64, 1000)).unwrap_err().to_string(),
            "this channel's workspace is over its quota (more than 1000 entries used; the limit is 1000 entries); an operator must free space in it before the next turn"
        );
        // The measure stops at the first inode past the quota: alone in its dir, it is all.
        let alone = tempfile::tempdir().unwrap();
        std::fs::write(alone.path().join("big"), vec![1u8; (2 << 20) - 8192]).unwrap();
        assert_eq!(
            check_dir(alone.path(), &quota(1, 1000)).unwrap_err().to_string(),
            "this channel's workspace is over its quota (2 MiB used; the limit is 1 MiB); an operator must free space in it before the next turn"
        );
    }

    #[test]
    fn the_error_tells_what_is_held_open() {
        let usage = Usage {
            bytes: 72 << 20,
            entries: 3,
            held_bytes: 71 << 20,
            held_files: 12,
        };
        assert_eq!(
            QuotaError::exceeded(&quota(16, 100), &usage).to_string(),
            "this channel's workspace is over its quota (72 MiB used, 71 MiB of it in 12 deleted files held open; the limit is 16 MiB); an operator must free space in it before the next turn"
        );
    }

    #[test]
    fn an_unreadable_dir_counts_as_over_quota_and_keeps_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let hidden = dir.path().join("hidden");
        std::fs::create_dir(&hidden).unwrap();
        std::fs::write(hidden.join("x"), vec![1u8; 50_000]).unwrap();
        std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o000)).unwrap();
        if nix::unistd::getuid().is_root() {
            // root reads anything: the check needs the service user.
            std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).unwrap();
            return;
        }
        let err = check_dir(dir.path(), &quota(1024, 1000)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "this channel's workspace cannot be measured (a directory in it cannot be opened or searched: Permission denied (os error 13)); an operator must fix or clear it before the next turn"
        );
        let mode = std::fs::symlink_metadata(&hidden)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0, "the host never changes a workspace entry");
        std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).unwrap();
    }

    #[test]
    fn a_tree_deeper_than_the_limit_cannot_be_measured() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = dir.path().to_path_buf();
        for _ in 0..MAX_DEPTH + 1 {
            p.push("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        let err = measure_dir(dir.path(), &quota(1024, 100_000)).unwrap_err();
        assert_eq!(err.to_string(), "it is nested deeper than 128 directories");
        p.pop();
        p.pop();
        std::fs::remove_dir_all(p).unwrap();
        assert!(measure_dir(dir.path(), &quota(1024, 100_000)).is_ok());
    }

    #[test]
    fn what_the_driver_counts_inside_is_added_and_what_it_cannot_fails_the_measure() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        let q = quota(16, 1000);
        let tree = measure(&ws, &q, None).unwrap();
        let counted = HeldFiles::Counted {
            files: 3,
            bytes: 17 << 20,
        };
        let u = measure(&ws, &q, Some(&counted)).unwrap();
        assert_eq!((u.held_files, u.held_bytes), (3, 17 << 20));
        assert_eq!(u.bytes, tree.bytes + (17 << 20));
        assert_eq!(
            check(&ws, &q, Some(&counted)).unwrap_err().to_string(),
            "this channel's workspace is over its quota (18 MiB used, 17 MiB of it in 3 deleted files held open; the limit is 16 MiB); an operator must free space in it before the next turn"
        );
        // Every way the count can fail is a measure that failed, never a count of 0; none
        // is final: the watcher's grace applies, as to a hidden process under runc.
        for (why, text) in [
            (
                Unmeasurable::HiddenDescriptors,
                "a process of the turn hides its open files from the host",
            ),
            (
                Unmeasurable::MappedDeleted,
                "a deleted workspace file is held only through a memory mapping",
            ),
            (
                Unmeasurable::Measurer("the measurer ended with Some(137)".into()),
                "the open files of the turn could not be counted inside the sandbox: the measurer ended with Some(137)",
            ),
            (
                Unmeasurable::Processes("the engine did not answer".into()),
                "the processes of the turn could not be listed: the engine did not answer",
            ),
        ] {
            let e = measure(&ws, &q, Some(&HeldFiles::Unmeasurable(why))).unwrap_err();
            assert_eq!(e.to_string(), text);
            assert!(!e.is_final(), "{e}");
        }
    }

    #[test]
    fn maps_lines_name_deleted_files_on_the_device() {
        let dev = rustix::fs::makedev(0xfe, 0x01);
        let maps = "7f0000000000-7f0000001000 rw-s 00000000 fe:01 4242 /workspace/x (deleted)\n\
                    7f0000001000-7f0000002000 r--p 00000000 fe:01 17 /workspace/kept\n\
                    7f0000002000-7f0000003000 rw-s 00000000 00:05 99 /dev/zero (deleted)\n";
        let found = |text: &[u8], cap| match mapped_deleted(text, dev, cap) {
            Ok(v) => Some(v),
            Err(MapsRead::TooLong) => None,
            Err(MapsRead::Errno(e)) => panic!("{e}"),
        };
        assert_eq!(found(maps.as_bytes(), 1 << 20), Some(vec![(dev, 4242)]));
        // A path far longer than a read (a guest's deep, long names), split across reads:
        // its line's fields and its end are still read, and no more than them kept.
        let long = format!(
            "7f0000000000-7f0000001000 rw-s 00000000 fe:01 77 /workspace/{} (deleted)\n\
             7f0000001000-7f0000002000 r--p 00000000 fe:01 78 /workspace/{}\n\
             7f0000002000-7f0000003000 rw-s 00000000 fe:01 79 /w/{}x (deleted)",
            "d/".repeat(100_000),
            "e".repeat(70_000),
            "f".repeat(65_536 - 30),
        );
        assert_eq!(
            found(long.as_bytes(), 1 << 20),
            Some(vec![(dev, 77), (dev, 79)])
        );
        // Past the cap: not read on.
        assert_eq!(found(long.as_bytes(), 64 * 1024), None);
    }

    #[test]
    fn the_floor_is_the_larger_of_bytes_and_percent() {
        let floor = Floor {
            min_bytes: 1 << 30,
            min_percent: 5,
        };
        assert_eq!(floor.bytes_of(10 << 30), 1 << 30);
        assert_eq!(floor.bytes_of(100 << 30), 5 << 30);
        let dir = tempfile::tempdir().unwrap();
        let guarded = [Guarded {
            what: "the workspaces",
            path: dir.path().to_owned(),
        }];
        assert!(check_floor(
            &guarded,
            &Floor {
                min_bytes: 0,
                min_percent: 0
            }
        )
        .is_ok());
        let err = check_floor(
            &guarded,
            &Floor {
                min_bytes: u64::MAX / 2,
                min_percent: 0,
            },
        )
        .unwrap_err();
        let QuotaError::FreeSpace { free_mib, .. } = err else {
            panic!("{err:?}")
        };
        assert_eq!(
            err.to_string(),
            format!(
                "the filesystem of {} (the workspaces) has {free_mib} MiB free, below its floor of 8796093022208 MiB; turns are refused until an operator frees space",
                dir.path().display()
            )
        );
    }
}
