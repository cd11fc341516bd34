//! A real PostgreSQL server for the budgets' shared store: Debian's `postgresql` binaries
//! (`scripts/setup.sh --tests` installs them), a private data directory made by `initdb` in a
//! temporary directory, started as the user the tests run as (the service user), listening
//! on loopback only (its unix socket in the data directory). Stopped (fast shutdown),
//! killed (`SIGKILL`) and started again on the same port and data by the fault tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One server (killed and its directory removed when dropped).
#[derive(Debug)]
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
    /// Extra `-c` settings given at each start.
    extra: Vec<String>,
}

/// The directory of Debian's server binaries (`/usr/lib/postgresql/<version>/bin`), the
/// newest installed.
pub fn bin_dir() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").is_file() && p.join("postgres").is_file())
        .collect();
    found.sort();
    found.pop()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Postgres {
    /// `initdb` (trust on loopback and the socket, user `postgres`) and a start.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// The same, with `-c` settings (`"fsync=off"`, …) at every start.
    pub fn start_with(extra: &[&str]) -> Self {
        let bin = bin_dir()
            .expect("PostgreSQL's server binaries (scripts/setup.sh --tests installs postgresql)");
        let dir = tempfile::Builder::new()
            .prefix("rt-pg-")
            .tempdir_in("/tmp")
            .unwrap();
        let data = dir.path().join("data");
        let out = Command::new(bin.join("initdb"))
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(&data)
            .stdout(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = Self {
            dir,
            bin,
            port: free_port(),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        pg.up();
        pg
    }

    /// The data directory.
    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The port (loopback).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `db` (TLS off: loopback).
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{db}?sslmode=disable&connect_timeout=3",
            self.port
        )
    }

    /// Starts the server (again, on the same port and data) and waits until it answers.
    pub fn up(&mut self) {
        assert!(self.child.is_none(), "already running");
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .args(["-c", "max_connections=50", "-c", "log_min_messages=fatal"]);
        for e in &self.extra {
            cmd.args(["-c", e]);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.log"))
            .unwrap();
        self.child = Some(
            cmd.stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start postgres"),
        );
        let started = Instant::now();
        loop {
            let ok = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "postgres did not start: {}",
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Fast shutdown (`SIGINT`: sessions ended, checkpoint), waited for.
    pub fn stop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGINT);
    }

    /// A crash of the server (`SIGKILL` of the postmaster; its backends end when they
    /// notice), waited for.
    pub fn kill(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGKILL);
        // The orphaned backends hold the port's shared memory a moment.
        std::thread::sleep(Duration::from_millis(300));
    }

    fn signal(&mut self, sig: nix::sys::signal::Signal) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig);
            let _ = child.wait();
        }
    }

    /// Runs `sql` with `psql` on database `db`; its output (tuples only, unaligned).
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = Command::new("psql")
            .args(["-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1"])
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-d", db, "-c", sql])
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Creates database `name`.
    pub fn create_db(&self, name: &str) {
        self.psql("postgres", &format!("CREATE DATABASE \"{name}\""));
    }

    /// The directory a test may keep files in (removed with the server).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGKILL);
    }
}
