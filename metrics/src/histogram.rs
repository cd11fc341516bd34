//! A histogram of atomics, exported as prometheus-client exports its own.
//!
//! prometheus-client's `Histogram` takes a write lock for each observation; every model
//! call observes three (its duration, its input and its output tokens), each shared by
//! every turn's calls on every core. Here an observation is two relaxed atomic adds (its
//! bucket and a compare-and-swap on the sum's bits), no lock, on one of [`STRIPES`] copies
//! of the buckets and sum picked by the observing thread, 128 bytes apart in one allocation:
//! two cores observing at once do not pull the same line back and forth. A scrape adds the
//! stripes up and derives the count from the buckets, so `_count` always equals the `+Inf`
//! bucket; the sum may miss an observation in flight.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// A histogram (cheap to clone: a shared handle).
#[derive(Clone, Debug)]
pub(crate) struct Histogram(Arc<Inner>);

/// Copies of a histogram's counts, one picked by each observing thread.
const STRIPES: usize = 4;

#[derive(Debug)]
struct Inner {
    /// The buckets' upper bounds, ascending, the last `f64::MAX` (as prometheus-client's).
    bounds: Box<[f64]>,
    /// [`STRIPES`] stripes of `stride` words each, in one allocation: a stripe's sum (its
    /// `f64` bits), then its observations per bucket (not cumulative: the encoder adds them
    /// up), then 16 words (128 bytes) of padding, so no two stripes share a cache line or
    /// an adjacent-line prefetch pair.
    words: Box<[AtomicU64]>,
    stride: usize,
}

/// This thread's stripe: threads take them in turn as they first observe.
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        // A `const` initializer: no lazy-init check on each read, just the thread's slot.
        static MINE: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
    }
    MINE.with(|mine| match mine.get() {
        usize::MAX => {
            let i = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
            mine.set(i);
            i
        }
        i => i,
    })
}

impl Histogram {
    /// A histogram with these upper bounds (and one above them all).
    pub(crate) fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        let bounds: Box<[f64]> = bounds.into_iter().chain([f64::MAX]).collect();
        let stride = 1 + bounds.len() + 16;
        let words = (0..STRIPES * stride)
            .map(|_| AtomicU64::new(0f64.to_bits()))
            .collect();
        Self(Arc::new(Inner {
            bounds,
            words,
            stride,
        }))
    }

    /// Counts `v` in the first bucket whose bound is at least `v` (none for a NaN, which
    /// is not counted).
    pub(crate) fn observe(&self, v: f64) {
        let Some(i) = self.0.bounds.iter().position(|b| *b >= v) else {
            return;
        };
        let at = stripe() * self.0.stride;
        let stripe = &self.0.words[at..at + self.0.stride];
        stripe[1 + i].fetch_add(1, Ordering::Relaxed);
        let _ = stripe[0].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    /// The sum, the count and each bucket's (upper bound, observations).
    fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let stripes: Vec<&[AtomicU64]> = self.0.words.chunks(self.0.stride).collect();
        let buckets: Vec<(f64, u64)> = (self.0.bounds.iter().enumerate())
            .map(|(i, b)| {
                let n = stripes.iter().map(|s| s[1 + i].load(Ordering::Relaxed));
                (*b, n.sum())
            })
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = (stripes.iter())
            .map(|s| f64::from_bits(s[0].load(Ordering::Relaxed)))
            .sum();
        (sum, count, buckets)
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.snapshot();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::registry::Registry;

    /// The text a scrape reads is prometheus-client's own histogram's, observation for
    /// observation, including from several threads at once.
    #[test]
    fn encodes_as_prometheus_clients_histogram() {
        let bounds = [0.5, 1.0, 4.0];
        let (ours, theirs) = (
            Histogram::new(bounds),
            prometheus_client::metrics::histogram::Histogram::new(bounds),
        );
        let values = [0.1, 0.5, 0.75, 1.0, 3.0, 4.0, 9.0, 1e300, 0.25];
        std::thread::scope(|s| {
            for chunk in values.chunks(3) {
                let ours = ours.clone();
                s.spawn(move || chunk.iter().for_each(|v| ours.observe(*v)));
            }
        });
        values.iter().for_each(|v| theirs.observe(*v));
        let text = |h: Box<dyn Fn(&mut Registry)>| {
            let mut r = Registry::default();
            h(&mut r);
            let mut out = String::new();
            encode(&mut out, &r).unwrap();
            out
        };
        let a = text(Box::new(move |r| {
            r.register("h", "a histogram", ours.clone())
        }));
        let b = text(Box::new(move |r| {
            r.register("h", "a histogram", theirs.clone())
        }));
        assert_eq!(a, b);
        assert!(a.contains("h_count 9"), "{a}");
        assert!(a.contains("h_bucket{le=\"1.0\"} 5"), "{a}");
    }
}
