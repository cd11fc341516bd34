//! The held-files report: what `roundtable-guest --held-files` prints when the host runs it
//! inside a sandbox whose processes the host cannot see (gVisor): the workspace files the
//! turn's processes hold open with no name left (deleted while open), counted from inside.
//!
//! The measurer runs with the guest's uid, next to the guest, so its output is hostile
//! input: one line, at most [`MAX_OUTPUT`] bytes, parsed strictly ([`HeldReport::parse`]);
//! anything else is "cannot be measured" on the host.

/// The argument that makes `roundtable-guest` measure instead of running a turn.
pub const HELD_FILES_ARG: &str = "--held-files";
/// Where the guest program is, in every image the runtime runs (the production guest image
/// and the test suite's hostile image).
pub const GUEST_PROGRAM: &str = "/roundtable-guest";
/// The most output the host reads from the measurer; more is garbage.
pub const MAX_OUTPUT: usize = 4096;

const TAG: &str = "roundtable-held-files 1";

/// What the measurer found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldReport {
    /// Every process could be read: `files` regular files on the workspace's filesystem with
    /// no name left, `bytes` allocated to them (each inode once).
    Counted {
        /// How many such files.
        files: u64,
        /// Their allocated bytes.
        bytes: u64,
    },
    /// A live process's descriptors could not be read.
    HiddenDescriptors,
    /// A deleted workspace file is held only through a memory mapping (its size unknown).
    MappedDeleted,
}

impl HeldReport {
    /// The report as the measurer prints it: one line, ending in `\n`.
    pub fn line(&self) -> String {
        match self {
            HeldReport::Counted { files, bytes } => format!("{TAG} counted {files} {bytes}\n"),
            HeldReport::HiddenDescriptors => format!("{TAG} hidden\n"),
            HeldReport::MappedDeleted => format!("{TAG} mapped\n"),
        }
    }

    /// Parses the measurer's whole stdout: exactly one [`HeldReport::line`] and nothing
    /// else (no second line, no missing newline, no sign, no leading zero, nothing past
    /// [`MAX_OUTPUT`]); `None` otherwise.
    pub fn parse(out: &[u8]) -> Option<Self> {
        if out.len() > MAX_OUTPUT {
            return None;
        }
        let text = std::str::from_utf8(out).ok()?;
        let body = text.strip_suffix('\n')?;
        if body.contains('\n') {
            return None;
        }
        let rest = body.strip_prefix(TAG)?.strip_prefix(' ')?;
        match rest {
            "hidden" => return Some(HeldReport::HiddenDescriptors),
            "mapped" => return Some(HeldReport::MappedDeleted),
            _ => {}
        }
        let mut fields = rest.strip_prefix("counted ")?.split(' ');
        let (files, bytes) = (number(fields.next()?)?, number(fields.next()?)?);
        if fields.next().is_some() {
            return None;
        }
        Some(HeldReport::Counted { files, bytes })
    }
}

/// A decimal `u64` in its one canonical spelling.
fn number(s: &str) -> Option<u64> {
    let canonical =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    canonical.then(|| s.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_report_reads_back_and_nothing_else_does() {
        for r in [
            HeldReport::Counted { files: 0, bytes: 0 },
            HeldReport::Counted {
                files: 16,
                bytes: u64::MAX,
            },
            HeldReport::HiddenDescriptors,
            HeldReport::MappedDeleted,
        ] {
            assert_eq!(HeldReport::parse(r.line().as_bytes()), Some(r));
        }
        let good = "roundtable-held-files 1 counted 3 4096\n";
        assert!(HeldReport::parse(good.as_bytes()).is_some());
        for bad in [
            "",
            "\n",
            "roundtable-held-files 1 counted 3 4096",
            "roundtable-held-files 1 counted 3 4096\n\n",
            "roundtable-held-files 1 counted 0 0\nroundtable-held-files 1 counted 3 4096\n",
            "roundtable-held-files 1 counted 3 4096 5\n",
            "roundtable-held-files 1 counted 3\n",
            "roundtable-held-files 1 counted +3 4096\n",
            "roundtable-held-files 1 counted 03 4096\n",
            "roundtable-held-files 1 counted 3  4096\n",
            "roundtable-held-files 1 counted 3 18446744073709551616\n",
            "roundtable-held-files 1 counted -1 0\n",
            "roundtable-held-files 2 counted 3 4096\n",
            " roundtable-held-files 1 counted 3 4096\n",
            "roundtable-held-files 1 hidden \n",
            "roundtable-held-files 1 Hidden\n",
            "roundtable-held-files 1 counted 3 4096\r\n",
        ] {
            assert_eq!(HeldReport::parse(bad.as_bytes()), None, "{bad:?}");
        }
        let mut long = good.as_bytes().to_vec();
        long.resize(MAX_OUTPUT + 1, b' ');
        assert_eq!(HeldReport::parse(&long), None);
        assert_eq!(
            HeldReport::parse(b"roundtable-held-files 1 counted 3 \xff\n"),
            None
        );
    }
}
