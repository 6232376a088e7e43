//! Percentile summaries shared by every benchmark.

use serde::Serialize;
use std::time::Duration;

/// p50 / p90 / max of a set of timings, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub p50: f64,
    pub p90: f64,
    pub max: f64,
    pub runs: usize,
}

impl Summary {
    pub fn of(samples: &[Duration]) -> Summary {
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let pick = |q: f64| -> f64 {
            if ms.is_empty() {
                return f64::NAN;
            }
            let i = ((ms.len() as f64 - 1.0) * q).round() as usize;
            ms[i.min(ms.len() - 1)]
        };
        Summary {
            p50: pick(0.5),
            p90: pick(0.9),
            max: ms.last().copied().unwrap_or(f64::NAN),
            runs: ms.len(),
        }
    }
}

/// Prints one row of the human table to stderr.
pub fn row(name: &str, s: &Summary) {
    eprintln!(
        "{name:<28} p50 {:>9.3} ms  p90 {:>9.3} ms  max {:>9.3} ms  (n={})",
        s.p50, s.p90, s.max, s.runs
    );
}
