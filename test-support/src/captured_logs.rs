//! A `tracing` writer that keeps everything written to it, for tests that read their logs.

use std::sync::{Arc, Mutex};

/// Collects every byte the subscriber it is given to writes.
#[derive(Debug, Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Captured {
    /// Everything captured so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// The lines holding every one of `needles`.
    pub fn lines(&self, needles: &[&str]) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .map(str::to_owned)
            .collect()
    }
}

/// Runs `test` in a current-thread runtime whose default subscriber writes what is logged
/// at `level` and above to the returned [`Captured`] (so every task of the runtime logs
/// there), and hands it the same.
pub fn run_captured<F: std::future::Future<Output = ()>>(
    level: tracing::Level,
    test: impl FnOnce(Captured) -> F,
) -> Captured {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(level)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(test(logs.clone()));
    drop(rt);
    logs
}
