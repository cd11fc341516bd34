//! The guest image, built FROM scratch: the static guest program and a static busybox.
//!
//! Parts:
//! - [`ImageSource`]: where the two static binaries come from;
//! - [`context_tar`]: the build context (Dockerfile, `/roundtable-guest`, `/bin/busybox` with
//!   its applets as symlinks, empty mount points, a sticky `/tmp`), as an in-memory tar;
//! - [`build`]: sends it to the engine's classic builder; no registry is contacted.

use std::path::{Path, PathBuf};

use bollard::query_parameters::BuildImageOptionsBuilder;
use futures_util::StreamExt;

use crate::driver::DockerDriver;

/// Errors of building the image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0} is not a static executable (build the guest with the static target; install busybox-static)")]
    NotStatic(PathBuf),
    #[error("list busybox applets with {path}: {reason}")]
    Applets { path: PathBuf, reason: String },
    #[error("{0}")]
    Driver(#[from] crate::driver::DriverError),
    #[error("docker build of {tag} failed: {reason}")]
    Build { tag: String, reason: String },
}

/// The two static binaries the image is made of.
#[derive(Debug, Clone)]
pub struct ImageSource {
    pub guest: PathBuf,
    pub busybox: PathBuf,
}

/// The Dockerfile of the guest image.
pub const DOCKERFILE: &str = "FROM scratch\nCOPY . /\nENV PATH=/bin\nWORKDIR /workspace\nENTRYPOINT [\"/roundtable-guest\"]\nLABEL org.opencontainers.image.title=\"roundtable-sandbox guest\"\n";

fn read(path: &Path) -> Result<Vec<u8>, ImageError> {
    std::fs::read(path).map_err(|source| ImageError::Read {
        path: path.to_owned(),
        source,
    })
}

/// A static ELF has no `PT_INTERP` program header (no dynamic loader).
pub fn is_static_elf(bytes: &[u8]) -> bool {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[o..o + 8]);
        u64::from_le_bytes(b) as usize
    };
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        o + 4 <= bytes.len()
            && u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) != 3
    })
}

/// The build context as a tar archive.
pub fn context_tar(source: &ImageSource) -> Result<Vec<u8>, ImageError> {
    let guest = read(&source.guest)?;
    let busybox = read(&source.busybox)?;
    for (path, bytes) in [(&source.guest, &guest), (&source.busybox, &busybox)] {
        if !is_static_elf(bytes) {
            return Err(ImageError::NotStatic(path.clone()));
        }
    }
    let out = std::process::Command::new(&source.busybox)
        .arg("--list")
        .output()
        .map_err(|e| ImageError::Applets {
            path: source.busybox.clone(),
            reason: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(ImageError::Applets {
            path: source.busybox.clone(),
            reason: out.status.to_string(),
        });
    }
    let applets = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut tar = Tar::default();
    tar.file("Dockerfile", 0o644, DOCKERFILE.as_bytes());
    tar.file(".dockerignore", 0o644, b"Dockerfile\n.dockerignore\n");
    tar.file("roundtable-guest", 0o755, &guest);
    for dir in ["bin", "etc", "workspace", "run", "run/roundtable"] {
        tar.dir(dir, 0o755);
    }
    tar.dir("tmp", 0o1777);
    tar.file("bin/busybox", 0o755, &busybox);
    for applet in applets.lines().map(str::trim) {
        if !applet.is_empty() && applet != "busybox" && !applet.contains('/') {
            tar.symlink(&format!("bin/{applet}"), "busybox");
        }
    }
    tar.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/nonexistent:/bin/false\n",
    );
    tar.file("etc/group", 0o644, b"root:x:0:\n");
    Ok(tar.finish())
}

/// Builds the image `tag` with the engine's classic builder; returns the image id.
pub async fn build(
    driver: &DockerDriver,
    source: &ImageSource,
    tag: &str,
) -> Result<String, ImageError> {
    let context = context_tar(source)?;
    let docker = driver.client().await?;
    let options = BuildImageOptionsBuilder::new()
        .dockerfile("Dockerfile")
        .t(tag)
        .rm(true)
        .forcerm(true)
        .build();
    let mut stream = docker.build_image(
        options,
        None,
        Some(bollard::body_full(bytes::Bytes::from(context))),
    );
    let mut id = None;
    while let Some(item) = stream.next().await {
        let info = item.map_err(|e| ImageError::Build {
            tag: tag.to_owned(),
            reason: e.to_string(),
        })?;
        if let Some(detail) = info.error_detail.and_then(|d| d.message) {
            return Err(ImageError::Build {
                tag: tag.to_owned(),
                reason: detail,
            });
        }
        if let Some(aux) = info.aux.and_then(|a| a.id) {
            id = Some(aux);
        }
    }
    Ok(id.unwrap_or_else(|| tag.to_owned()))
}

/// A minimal ustar writer: regular files, directories and symlinks, root-owned.
#[derive(Default)]
struct Tar {
    out: Vec<u8>,
}

impl Tar {
    fn header(&mut self, name: &str, mode: u32, size: usize, kind: u8, link: &str) {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        let octal = |h: &mut [u8; 512], at: usize, width: usize, value: u64| {
            let s = format!("{value:0w$o}\0", w = width - 1);
            h[at..at + width].copy_from_slice(s.as_bytes());
        };
        octal(&mut h, 100, 8, u64::from(mode));
        octal(&mut h, 108, 8, 0);
        octal(&mut h, 116, 8, 0);
        octal(&mut h, 124, 12, size as u64);
        octal(&mut h, 136, 12, 0);
        h[148..156].copy_from_slice(b"        ");
        h[156] = kind;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        let s = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(s.as_bytes());
        self.out.extend_from_slice(&h);
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.header(name, mode, data.len(), b'0', "");
        self.out.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.out.extend(std::iter::repeat_n(0u8, pad));
    }

    fn dir(&mut self, name: &str, mode: u32) {
        self.header(&format!("{name}/"), mode, 0, b'5', "");
    }

    fn symlink(&mut self, name: &str, target: &str) {
        self.header(name, 0o777, 0, b'2', target);
    }

    fn finish(mut self) -> Vec<u8> {
        self.out.extend(std::iter::repeat_n(0u8, 1024));
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_elf_detection() {
        assert!(!is_static_elf(b"#!/bin/sh\n"));
        // This test binary is dynamically linked (it has an interpreter).
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(!is_static_elf(&me));
        if let Ok(bb) = std::fs::read("/bin/busybox") {
            assert!(is_static_elf(&bb), "busybox-static is static");
        }
    }

    #[test]
    fn tar_headers_checksum() {
        let mut t = Tar::default();
        t.file("a", 0o644, b"hello");
        let out = t.finish();
        assert_eq!(out.len(), 512 + 512 + 1024);
        let h = &out[..512];
        let stored =
            u32::from_str_radix(std::str::from_utf8(&h[148..154]).unwrap().trim(), 8).unwrap();
        let mut copy = h.to_vec();
        copy[148..156].copy_from_slice(b"        ");
        assert_eq!(stored, copy.iter().map(|&b| u32::from(b)).sum::<u32>());
    }
}
