//! The bench's statistics, in one place: samples and their summary (p50, p95, mean), the
//! ratios and medians the verdicts read, their 95 % intervals (distribution-free for a
//! median, bootstrap for a ratio of p50s), the balanced orders the sides run in, and how an
//! interval or a distribution is printed.

use std::time::Duration;

use serde::Serialize;

/// A summary of [`Samples`] as the JSON results hold it (ms, rounded to 3 decimals; NaN,
/// written `null`, when there are none).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub n: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

/// Durations of one measured path.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    ms: Vec<f64>,
}

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.ms.push(d.as_secs_f64() * 1000.0);
    }

    /// The samples in the order they were pushed (ms).
    pub fn values(&self) -> &[f64] {
        &self.ms
    }

    pub fn len(&self) -> usize {
        self.ms.len()
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.ms.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    /// Nearest-rank percentile, in milliseconds (NaN when empty).
    pub fn pct(&self, p: f64) -> f64 {
        nearest_rank(&self.sorted(), p)
    }

    pub fn p50(&self) -> f64 {
        self.pct(50.0)
    }

    pub fn p95(&self) -> f64 {
        self.pct(95.0)
    }

    pub fn mean(&self) -> f64 {
        if self.ms.is_empty() {
            return f64::NAN;
        }
        self.ms.iter().sum::<f64>() / self.ms.len() as f64
    }

    pub fn min(&self) -> f64 {
        self.ms.iter().copied().fold(f64::NAN, f64::min)
    }

    pub fn max(&self) -> f64 {
        self.ms.iter().copied().fold(f64::NAN, f64::max)
    }

    pub fn summary(&self) -> Summary {
        Summary {
            n: self.len(),
            p50_ms: round3(self.p50()),
            p95_ms: round3(self.p95()),
            mean_ms: round3(self.mean()),
            min_ms: round3(self.min()),
            max_ms: round3(self.max()),
        }
    }
}

/// Named samples kept in the order their names first came (a turn's phases, the bare
/// lifecycle's steps).
#[derive(Debug, Default)]
pub struct NamedSamples(Vec<(String, Samples)>);

impl NamedSamples {
    pub fn push(&mut self, name: &str, d: Duration) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some((_, s)) => s.push(d),
            None => {
                let mut s = Samples::default();
                s.push(d);
                self.0.push((name.to_owned(), s));
            }
        }
    }

    /// Each phase's span, from its start to the next phase's start (`began`: each phase's
    /// start in order), under `prefix` + its name.
    pub fn push_spans(&mut self, prefix: &str, began: &[(String, Duration)]) {
        for w in began.windows(2) {
            self.push(
                &format!("{prefix}{}", w[0].0),
                w[1].1.saturating_sub(w[0].1),
            );
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Samples)> {
        self.0.iter().map(|(n, s)| (n.as_str(), s))
    }

    /// The summaries by name (JSON keys sorted).
    pub fn summaries(&self) -> std::collections::BTreeMap<String, Summary> {
        self.0
            .iter()
            .map(|(n, s)| (n.clone(), s.summary()))
            .collect()
    }
}

/// The nearest-rank percentile `p` of `sorted` (NaN when empty).
fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Rounds to 3 decimals (JSON readability); NaN becomes null through serde_json.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Each value rounded to 3 decimals.
pub fn round3_all(v: &[f64]) -> Vec<f64> {
    v.iter().map(|x| round3(*x)).collect()
}

/// A 95 % interval as the JSON results hold it: `[lo, hi]` rounded, or `null`.
pub fn ci95(ci: Option<(f64, f64)>) -> Option<[f64; 2]> {
    ci.map(|(a, b)| [round3(a), round3(b)])
}

/// A 95 % interval as `[lo, hi]`, or why there is none.
pub fn interval(ci: Option<(f64, f64)>) -> String {
    ci.map_or_else(
        || "too few samples".to_owned(),
        |(lo, hi)| format!("[{lo:.3}, {hi:.3}]"),
    )
}

/// The 10th to 90th percentiles of `s` (ms), for a distribution's shape at a glance.
pub fn deciles(s: &Samples) -> String {
    (1..10)
        .map(|d| format!("{:.2}", s.pct(f64::from(d) * 10.0)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The median of the iterations' differences `a[i] − b[i]` (µs, each iteration ran one of
/// each back to back) with its 95 % interval, as `+12 µs [-3, +30]`.
pub fn paired_diff(a: &Samples, b: &Samples) -> String {
    let d: Vec<f64> = a
        .values()
        .iter()
        .zip(b.values())
        .map(|(a, b)| (a - b) * 1000.0)
        .collect();
    format!(
        "{:+.0} µs {}",
        median(&d),
        median_ci(&d).map_or_else(String::new, |(lo, hi)| format!("[{lo:+.0}, {hi:+.0}]"))
    )
}

/// `a / b`, rounded to 3 decimals.
pub fn ratio(a: f64, b: f64) -> f64 {
    round3(a / b)
}

/// The median of `v` (the mean of the two middle values when their number is even; NaN
/// when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The median of the ratios `a[i] / b[i]` of pairs measured in the same round (the
/// machine's drift between rounds cancels).
pub fn paired_median(a: &[f64], b: &[f64]) -> f64 {
    median(&ratios(a, b))
}

/// The pairs' ratios `a[i] / b[i]`.
fn ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a / b).collect()
}

/// A distribution-free 95 % confidence interval for the median of `v`: the order
/// statistics `k` and `n + 1 - k` (1-based) for the largest `k` with
/// `P(Binomial(n, ½) < k) ≤ 2.5 %` (its coverage is at least 95 %); `None` under 6 values,
/// too few for one.
pub fn median_ci(v: &[f64]) -> Option<(f64, f64)> {
    let n = v.len();
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    // P(X <= j) for X ~ Binomial(n, 1/2), summed in logs (n may be in the thousands).
    let ln_choose = |j: usize| -> f64 {
        (1..=j)
            .map(|i| ((n + 1 - i) as f64).ln() - (i as f64).ln())
            .sum()
    };
    let mut below = 0.0f64;
    let mut k = 0usize;
    for j in 0..n {
        below += (ln_choose(j) - n as f64 * std::f64::consts::LN_2).exp();
        if below > 0.025 {
            break;
        }
        k = j + 1;
    }
    (k >= 1 && k <= n / 2).then(|| (sorted[k - 1], sorted[n - k]))
}

/// [`median_ci`] of the pairs' ratios `a[i] / b[i]`.
pub fn paired_median_ci(a: &[f64], b: &[f64]) -> Option<(f64, f64)> {
    median_ci(&ratios(a, b))
}

/// A 95 % bootstrap interval for `p50(a) / p50(b)` (nearest rank, as [`Samples::p50`]) where `a[i]` and `b[i]` were measured
/// side by side (one iteration): 2,000 resamples of the iterations, pairs kept together (so
/// the machine's drift between iterations stays cancelled), the 2.5th and 97.5th
/// percentiles of the resampled ratios. The generator is seeded: the same samples give the
/// same interval. `None` for fewer than 10 pairs.
pub fn paired_p50_ratio_ci(a: &Samples, b: &Samples) -> Option<(f64, f64)> {
    let n = a.len().min(b.len());
    if n < 10 {
        return None;
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut resampled = Vec::with_capacity(2_000);
    let (mut ra, mut rb) = (vec![0.0; n], vec![0.0; n]);
    for _ in 0..2_000 {
        for j in 0..n {
            let i = (next() % n as u64) as usize;
            ra[j] = a.ms[i];
            rb[j] = b.ms[i];
        }
        ra.sort_by(f64::total_cmp);
        rb.sort_by(f64::total_cmp);
        resampled.push(nearest_rank(&ra, 50.0) / nearest_rank(&rb, 50.0));
    }
    resampled.sort_by(f64::total_cmp);
    Some((resampled[49], resampled[1_949]))
}

/// The order in which round `round` runs `n` sides, a Williams design: over `n` rounds
/// (`2 n` when `n` is odd) every side runs in every position equally often and runs right
/// after every other side equally often, so neither a position in the round nor what ran
/// just before favours a side (the rotation `k, k+1, k+2` put one side after another in
/// two rounds of three, and an A/A control read 0.94).
pub fn balanced_order(n: usize, round: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    // First row 0, 1, n-1, 2, n-2, …; row i adds i to each (mod n).
    let mut first = Vec::with_capacity(n);
    let (mut lo, mut hi) = (0usize, n);
    for j in 0..n {
        if j % 2 == 0 {
            first.push(lo);
            lo += 1;
        } else {
            hi -= 1;
            first.push(hi);
        }
    }
    // For odd n a row and its mirror image together balance what follows what.
    let cycle = if n.is_multiple_of(2) { n } else { 2 * n };
    let block = round % cycle;
    let mut row: Vec<usize> = first.iter().map(|s| (s + block % n) % n).collect();
    if block >= n {
        row.reverse();
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over one cycle every side is in every position equally often and follows every other
    /// side equally often.
    #[test]
    fn balanced_orders_are_balanced() {
        for n in 2..=6usize {
            let cycle = if n.is_multiple_of(2) { n } else { 2 * n };
            let mut position = vec![vec![0; n]; n];
            let mut follows = vec![vec![0; n]; n];
            for r in 0..cycle {
                let row = balanced_order(n, r);
                let mut sorted = row.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n={n} row {row:?}");
                for (p, s) in row.iter().enumerate() {
                    position[*s][p] += 1;
                }
                for w in row.windows(2) {
                    follows[w[0]][w[1]] += 1;
                }
            }
            let per_position = cycle / n;
            assert!(
                position.iter().flatten().all(|c| *c == per_position),
                "n={n}: {position:?}"
            );
            let per_pair = cycle * (n - 1) / (n * (n - 1));
            for (a, row) in follows.iter().enumerate() {
                for (b, c) in row.iter().enumerate() {
                    if a != b {
                        assert_eq!(*c, per_pair, "n={n}: {a} then {b}: {follows:?}");
                    }
                }
            }
        }
    }

    /// The order statistics of the median's interval, against the binomial table: n = 18
    /// gives the 5th and 14th values (coverage 96.9 %), n = 100 the 40th and 61st.
    #[test]
    fn median_ci_takes_the_binomial_order_statistics() {
        let v: Vec<f64> = (1..=18).map(f64::from).collect();
        assert_eq!(median_ci(&v), Some((5.0, 14.0)));
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(median_ci(&v), Some((40.0, 61.0)));
        assert_eq!(median_ci(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
    }

    /// Pairs whose ratio is 2 in every iteration bootstrap to exactly 2; a wider spread
    /// gives an interval around the samples' own ratio.
    #[test]
    fn paired_p50_ratio_ci_brackets_the_ratio() {
        let (mut a, mut b) = (Samples::default(), Samples::default());
        for i in 1..=50u64 {
            a.push(Duration::from_micros(2 * i * 100));
            b.push(Duration::from_micros(i * 100));
        }
        let (lo, hi) = paired_p50_ratio_ci(&a, &b).unwrap();
        assert!(
            (lo - 2.0).abs() < 1e-9 && (hi - 2.0).abs() < 1e-9,
            "{lo} {hi}"
        );
        let (mut a, mut b) = (Samples::default(), Samples::default());
        for i in 0..200u64 {
            a.push(Duration::from_micros(1_000 + (i * 37) % 200));
            b.push(Duration::from_micros(1_000 + (i * 53) % 200));
        }
        let r = a.p50() / b.p50();
        let (lo, hi) = paired_p50_ratio_ci(&a, &b).unwrap();
        assert!(lo < r && r < hi && hi - lo < 0.2, "{lo} {r} {hi}");
    }

    #[test]
    fn paired_median_reads_the_rounds_ratios() {
        assert_eq!(paired_median(&[2.0, 9.0, 3.0], &[1.0, 10.0, 3.0]), 1.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
