//! Samples and their summary (p50, p95, mean), and the JSON form of a summary.

use std::time::Duration;

/// Durations of one measured path.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    ms: Vec<f64>,
}

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.ms.push(d.as_secs_f64() * 1000.0);
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
        let v = self.sorted();
        if v.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
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

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "n": self.len(),
            "p50_ms": round3(self.p50()),
            "p95_ms": round3(self.p95()),
            "mean_ms": round3(self.mean()),
            "min_ms": round3(self.min()),
            "max_ms": round3(self.max()),
        })
    }
}

/// Rounds to 3 decimals (JSON readability); NaN becomes null through serde_json.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// `a / b`, rounded to 3 decimals.
pub fn ratio(a: f64, b: f64) -> f64 {
    round3(a / b)
}
