//! The guest's own seccomp layer, installed by `main` before anything else (before the turn
//! is read) and inherited by every process of the turn: every tool, every `sh`.
//!
//! It stacks on the engine's default profile (filters stack; the most restrictive answer
//! wins). The container runs with `no-new-privileges`, and installing a filter sets
//! `no_new_privs` anyway, so nothing in the turn can remove it. It refuses with `EPERM`:
//!
//! - `ptrace`, `process_vm_readv`, `process_vm_writev`, `pidfd_getfd`, `kcmp`: no process
//!   of a turn inspects, steals from or compares another's descriptors (Docker's profile
//!   allows `ptrace` on kernels >= 4.8, and this host has no Yama);
//! - `sendmsg`, `sendmmsg`: the only way to pass a descriptor (`SCM_RIGHTS`): a file sent
//!   over a unix socket and closed is held only in the socket's queue, where the quota's
//!   descriptor scan cannot see it. Nothing of a turn needs them: the guest's broker client
//!   writes with `write(2)`, busybox's tools have no network to talk to (an MCP session
//!   with a network, run under this layer by `--exec`, resolves names with glibc's
//!   `single-request` option, which sends with `send(2)`);
//! - `io_uring_setup`, `io_uring_enter`, `io_uring_register`: io_uring runs `sendmsg`,
//!   `fallocate` and the rest behind seccomp's back;
//! - `fallocate` with `FALLOC_FL_KEEP_SIZE` set and `FALLOC_FL_PUNCH_HOLE` not: it
//!   allocates blocks without growing the file, so `RLIMIT_FSIZE` (the per-file quota)
//!   never applies (ext4 let 128 MiB through in one call). Plain `fallocate` grows the size
//!   and stays held by `RLIMIT_FSIZE`; `PUNCH_HOLE` (which the kernel accepts only with
//!   `KEEP_SIZE`) only frees space and stays allowed; `ZERO_RANGE | KEEP_SIZE` and
//!   `UNSHARE_RANGE | KEEP_SIZE` allocate like `KEEP_SIZE` alone and are refused.
//!
//! Any other call is left to the engine's profile. A call from another ABI than the
//! filter's (i386 `int 0x80` on x86_64) kills the process: the filter compares syscall
//! numbers of one ABI only, so letting another through would let it pass untouched. On
//! x86_64 the x32 numbers of the refused calls are refused too (a kernel built with x32).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// `FALLOC_FL_KEEP_SIZE`.
pub const FALLOC_FL_KEEP_SIZE: u64 = 0x01;
/// `FALLOC_FL_PUNCH_HOLE`.
pub const FALLOC_FL_PUNCH_HOLE: u64 = 0x02;

/// Why the layer could not be built or installed.
#[derive(Debug)]
pub enum LayerError {
    /// The filter could not be built (an unsupported architecture, a bad rule).
    Build(String),
    /// The kernel refused the filter.
    Install(String),
}

impl std::fmt::Display for LayerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerError::Build(why) => write!(f, "cannot build the seccomp filter: {why}"),
            LayerError::Install(why) => write!(f, "cannot install the seccomp filter: {why}"),
        }
    }
}

impl std::error::Error for LayerError {}

/// The calls refused whatever their arguments, by name (for messages) and number.
#[cfg(target_arch = "x86_64")]
const REFUSED: &[(&str, i64)] = &[
    ("ptrace", 101),
    ("process_vm_readv", 310),
    ("process_vm_writev", 311),
    ("kcmp", 312),
    ("pidfd_getfd", 438),
    ("sendmsg", 46),
    ("sendmmsg", 307),
    ("io_uring_setup", 425),
    ("io_uring_enter", 426),
    ("io_uring_register", 427),
];

#[cfg(target_arch = "aarch64")]
const REFUSED: &[(&str, i64)] = &[
    ("ptrace", 117),
    ("process_vm_readv", 270),
    ("process_vm_writev", 271),
    ("kcmp", 272),
    ("pidfd_getfd", 438),
    ("sendmsg", 211),
    ("sendmmsg", 269),
    ("io_uring_setup", 425),
    ("io_uring_enter", 426),
    ("io_uring_register", 427),
];

#[cfg(target_arch = "x86_64")]
const FALLOCATE: i64 = 285;
#[cfg(target_arch = "aarch64")]
const FALLOCATE: i64 = 47;

/// The x32 ABI's numbers (`__X32_SYSCALL_BIT | n`) of the refused calls: the same audit
/// arch as x86_64, so the arch check lets them in.
#[cfg(target_arch = "x86_64")]
const X32: &[i64] = &[
    521, // ptrace
    539, // process_vm_readv
    540, // process_vm_writev
    312, // kcmp
    438, // pidfd_getfd
    518, // sendmsg
    538, // sendmmsg
    425, 426, 427, // io_uring_*
    285, // fallocate (conditional, below)
];
#[cfg(target_arch = "x86_64")]
const X32_SYSCALL_BIT: i64 = 0x4000_0000;

#[cfg(target_arch = "x86_64")]
fn arch() -> TargetArch {
    TargetArch::x86_64
}
#[cfg(target_arch = "aarch64")]
fn arch() -> TargetArch {
    TargetArch::aarch64
}

/// The fallocate rule: `mode & (KEEP_SIZE | PUNCH_HOLE) == KEEP_SIZE`.
fn keep_size_without_punch_hole() -> Result<Vec<SeccompRule>, LayerError> {
    let cond = SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE),
        FALLOC_FL_KEEP_SIZE,
    )
    .map_err(|e| LayerError::Build(e.to_string()))?;
    Ok(vec![
        SeccompRule::new(vec![cond]).map_err(|e| LayerError::Build(e.to_string()))?
    ])
}

/// The layer as a BPF program for this architecture.
pub fn program() -> Result<BpfProgram, LayerError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        REFUSED.iter().map(|&(_, nr)| (nr, Vec::new())).collect();
    rules.insert(FALLOCATE, keep_size_without_punch_hole()?);
    #[cfg(target_arch = "x86_64")]
    for &nr in X32 {
        let chain = if nr == FALLOCATE {
            keep_size_without_punch_hole()?
        } else {
            Vec::new()
        };
        rules.insert(X32_SYSCALL_BIT | nr, chain);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc_eperm()),
        arch(),
    )
    .map_err(|e| LayerError::Build(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| LayerError::Build(e.to_string()))
}

/// `EPERM`, the engine profile's own answer to a refused call.
fn libc_eperm() -> u32 {
    nix::errno::Errno::EPERM as u32
}

/// Builds and installs the layer on the calling thread (call it while the process has one
/// thread: before the turn is read, before anything is spawned). On error nothing of the
/// turn may run.
pub fn install() -> Result<(), LayerError> {
    let program = program()?;
    seccompiler::apply_filter(&program).map_err(|e| LayerError::Install(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// Installs the layer on a fresh thread (a filter binds the thread that installs it and
    /// its children, not the test harness) and runs `check` there.
    fn under_the_layer<T: Send + 'static>(check: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            install().unwrap();
            check()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn the_program_builds_for_this_architecture() {
        let program = program().unwrap();
        assert!(program.len() > REFUSED.len(), "{}", program.len());
    }

    #[test]
    fn fallocate_keep_size_is_refused_and_the_rest_allowed() {
        use nix::fcntl::{fallocate, FallocateFlags as F};
        let dir = crate::testutil::TempDir::new();
        let path = dir.path().join("f");
        let results = under_the_layer(move || {
            let file = std::fs::File::create(&path).unwrap();
            let fd = file.as_fd();
            let try_mode = |mode: F| fallocate(fd, mode, 0, 4096).map_err(|e| e as i32);
            vec![
                try_mode(F::FALLOC_FL_KEEP_SIZE),
                try_mode(F::FALLOC_FL_KEEP_SIZE | F::FALLOC_FL_ZERO_RANGE),
                try_mode(F::FALLOC_FL_KEEP_SIZE | F::FALLOC_FL_PUNCH_HOLE),
                try_mode(F::empty()),
            ]
        });
        let eperm = Err(nix::errno::Errno::EPERM as i32);
        assert_eq!(results[0], eperm, "KEEP_SIZE");
        assert_eq!(results[1], eperm, "ZERO_RANGE | KEEP_SIZE");
        // The last two reach the filesystem (whatever it says of them, not EPERM).
        assert_ne!(results[2], eperm, "PUNCH_HOLE | KEEP_SIZE");
        assert_eq!(results[3], Ok(()), "plain");
    }

    #[test]
    fn descriptors_cannot_be_sent_but_sockets_still_write() {
        use nix::sys::socket::{
            sendmsg, socketpair, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
        };
        use std::io::{IoSlice, Read, Write};
        let (sent, written) = under_the_layer(|| {
            let (a, b) = socketpair(
                AddressFamily::Unix,
                SockType::Stream,
                None,
                SockFlag::empty(),
            )
            .unwrap();
            let passed = [std::os::fd::AsRawFd::as_raw_fd(&b)];
            let sent = sendmsg::<()>(
                std::os::fd::AsRawFd::as_raw_fd(&a),
                &[IoSlice::new(b"x")],
                &[ControlMessage::ScmRights(&passed)],
                MsgFlags::empty(),
                None,
            )
            .map_err(|e| e as i32);
            // What the broker client does: plain writes on a unix stream.
            let mut tx = std::os::unix::net::UnixStream::from(a);
            let mut rx = std::os::unix::net::UnixStream::from(b);
            tx.write_all(b"ok").unwrap();
            let mut got = [0u8; 2];
            rx.read_exact(&mut got).unwrap();
            (sent, got)
        });
        assert_eq!(sent, Err(nix::errno::Errno::EPERM as i32));
        assert_eq!(&written, b"ok");
    }
}
