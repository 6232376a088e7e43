//! Percentile summaries shared by every benchmark.

use serde::Serialize;
use serde_json::{json, Map, Value};
use std::time::Duration;

/// Every benchmark's error type.
pub type Error = Box<dyn std::error::Error>;

/// Adds what was being done to an error.
pub trait Context<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, Error>;
}

impl<T, E: std::fmt::Display> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, Error> {
        self.map_err(|e| format!("{}: {e}", what()).into())
    }
}

/// A benchmark's output: the JSON object and the stderr table.
#[derive(Default)]
pub struct Report(Map<String, Value>);

impl Report {
    /// A timing: its summary goes to the table and the JSON.
    pub fn timing(&mut self, key: &str, samples: &[Duration]) {
        let s = Summary::of(samples);
        row(key, &s);
        self.0.insert(key.to_string(), json!(s));
    }

    /// A single value, printed and recorded.
    pub fn value(&mut self, key: &str, v: Value) {
        eprintln!("{key:<28} {v}");
        self.0.insert(key.to_string(), v);
    }

    /// Records `v` without printing it.
    pub fn insert(&mut self, key: &str, v: Value) {
        self.0.insert(key.to_string(), v);
    }

    /// The JSON object.
    pub fn into_value(self) -> Value {
        Value::Object(self.0)
    }
}

/// p50 / p90 / p99 / max of a set of timings, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
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
            p99: pick(0.99),
            max: ms.last().copied().unwrap_or(f64::NAN),
            runs: ms.len(),
        }
    }
}

/// Prints one row of the human table to stderr.
pub fn row(name: &str, s: &Summary) {
    eprintln!(
        "{name:<28} p50 {:>9.3} ms  p90 {:>9.3} ms  p99 {:>9.3} ms  max {:>9.3} ms  (n={})",
        s.p50, s.p90, s.p99, s.max, s.runs
    );
}
