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
    /// A binary could not be read.
    #[error("read {path}")]
    Read {
        /// The binary.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A binary is not static.
    #[error("{0} is not a static executable (build the guest with the static target; install busybox-static)")]
    NotStatic(PathBuf),
    #[error("list busybox applets with {path}: {reason}")]
    /// busybox could not list its applets.
    Applets {
        /// The busybox binary.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The engine failed.
    #[error(transparent)]
    Driver(#[from] crate::driver::DriverError),
    #[error("docker build of {tag} failed: {reason}")]
    /// The engine's build failed.
    Build {
        /// The image tag.
        tag: String,
        /// The engine's message.
        reason: String,
    },
    #[error("write the build context archive")]
    /// The build context could not be written.
    Archive {
        /// Why.
        source: std::io::Error,
    },
}

/// The two static binaries the image is made of.
#[derive(Debug, Clone)]
pub struct ImageSource {
    /// The static guest binary.
    pub guest: PathBuf,
    /// The static busybox binary (the shell and its applets).
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

pub use crate::driver::is_static_elf;

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
    context_of(&guest, &busybox, &applets).map_err(|source| ImageError::Archive { source })
}

/// The context's archive: plain ustar entries owned by root, with a fixed mtime, so the
/// same binaries give the same archive.
fn context_of(guest: &[u8], busybox: &[u8], applets: &str) -> std::io::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    let header = |kind: tar::EntryType, mode: u32, size: usize| {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(size as u64);
        h
    };
    let file = |tar: &mut tar::Builder<Vec<u8>>, name: &str, mode: u32, data: &[u8]| {
        tar.append_data(
            &mut header(tar::EntryType::Regular, mode, data.len()),
            name,
            data,
        )
    };
    file(&mut tar, "Dockerfile", 0o644, DOCKERFILE.as_bytes())?;
    file(
        &mut tar,
        ".dockerignore",
        0o644,
        b"Dockerfile\n.dockerignore\n",
    )?;
    file(&mut tar, "roundtable-guest", 0o755, guest)?;
    for (dir, mode) in [
        ("bin", 0o755),
        ("etc", 0o755),
        ("workspace", 0o755),
        ("run", 0o755),
        ("run/roundtable", 0o755),
        ("tmp", 0o1777),
    ] {
        tar.append_data(
            &mut header(tar::EntryType::Directory, mode, 0),
            format!("{dir}/"),
            std::io::empty(),
        )?;
    }
    file(&mut tar, "bin/busybox", 0o755, busybox)?;
    for applet in applets.lines().map(str::trim) {
        if !applet.is_empty() && applet != "busybox" && !applet.contains('/') {
            tar.append_link(
                &mut header(tar::EntryType::Symlink, 0o777, 0),
                format!("bin/{applet}"),
                "busybox",
            )?;
        }
    }
    file(
        &mut tar,
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/nonexistent:/bin/false\n",
    )?;
    file(&mut tar, "etc/group", 0o644, b"root:x:0:\n")?;
    tar.into_inner()
}

/// Builds the image `tag` with the engine's classic builder; returns the image id.
pub async fn build(
    driver: &DockerDriver,
    source: &ImageSource,
    tag: &str,
) -> Result<String, ImageError> {
    let context = context_tar(source)?;
    let docker = driver.engine().await?;
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
    fn context_archive_holds_the_image_tree() {
        let archive = context_of(b"GUEST", b"BUSYBOX", "sh\nls\nbusybox\n../x\n\n").unwrap();
        let mut entries = Vec::new();
        for entry in tar::Archive::new(&archive[..]).entries().unwrap() {
            let mut entry = entry.unwrap();
            let h = entry.header().clone();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0));
            let link = entry.link_name().unwrap().map(|l| l.display().to_string());
            entries.push((
                entry.path().unwrap().display().to_string(),
                h.entry_type(),
                h.mode().unwrap(),
                link,
                data,
            ));
        }
        let find = |name: &str| {
            entries
                .iter()
                .find(|e| e.0 == name)
                .unwrap_or_else(|| panic!("{name} in {entries:?}"))
        };
        let guest = find("roundtable-guest");
        assert_eq!(
            (guest.1, guest.2, guest.4.as_slice()),
            (tar::EntryType::Regular, 0o755, &b"GUEST"[..])
        );
        assert_eq!(find("Dockerfile").4, DOCKERFILE.as_bytes());
        let tmp = find("tmp/");
        assert_eq!((tmp.1, tmp.2), (tar::EntryType::Directory, 0o1777));
        let sh = find("bin/sh");
        assert_eq!(
            (sh.1, sh.3.as_deref()),
            (tar::EntryType::Symlink, Some("busybox"))
        );
        find("bin/ls");
        assert_eq!(find("bin/busybox").4, b"BUSYBOX");
        // Neither the applet list's own name nor a path in it becomes an entry.
        assert!(!entries.iter().any(|e| e.0.contains("..")), "{entries:?}");
        assert_eq!(
            entries
                .iter()
                .filter(|e| e.0.starts_with("bin/") && e.0 != "bin/")
                .count(),
            3
        );
        // The same binaries give the same archive.
        assert_eq!(
            archive,
            context_of(b"GUEST", b"BUSYBOX", "sh\nls\nbusybox\n../x\n\n").unwrap()
        );
    }
}
