//! Rate limits for log lines a guest can trigger.
//!
//! A guest that makes a device fail on purpose (malformed balloon reports,
//! bad queue addresses, requests that fail on the host) would otherwise get a
//! warning into the VMM's log for each attempt, as fast as it can make
//! them, and fill the node's disk. Every such log site goes through
//! [`warn_limited!`]: a token bucket of its own lets [`BURST`] lines through
//! at once and one more every [`PERIOD`]; the next line that gets through
//! says how many were dropped meanwhile (`suppressed=N`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines a log site may write at once.
pub const BURST: u32 = 5;
/// How often a log site earns one more line.
pub const PERIOD: Duration = Duration::from_secs(10);

/// A token bucket for one log site.
pub struct RateLimit(Mutex<Bucket>);

struct Bucket {
    tokens: u32,
    /// When the tokens were last counted; `None` before the first line.
    counted: Option<Instant>,
    /// Lines refused since the last one allowed.
    suppressed: u64,
}

impl RateLimit {
    /// A full bucket.
    pub const fn new() -> RateLimit {
        RateLimit(Mutex::new(Bucket {
            tokens: BURST,
            counted: None,
            suppressed: 0,
        }))
    }

    /// Whether a line may be written at `now`: `Some(n)` with the lines
    /// refused since the last one allowed, or `None`.
    pub fn allow(&self, now: Instant) -> Option<u64> {
        let mut b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let counted = *b.counted.get_or_insert(now);
        let earned = now.saturating_duration_since(counted).as_nanos() / PERIOD.as_nanos();
        if earned > 0 {
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            b.tokens = b.tokens.saturating_add(earned).min(BURST);
            b.counted = Some(counted + PERIOD * earned);
        }
        if b.tokens == 0 {
            b.suppressed += 1;
            return None;
        }
        b.tokens -= 1;
        Some(std::mem::take(&mut b.suppressed))
    }
}

/// `tracing::warn!` through a [`RateLimit`] of this call site's own.
macro_rules! warn_limited {
    ($($arg:tt)+) => {{
        static LIMIT: $crate::ratelimit::RateLimit = $crate::ratelimit::RateLimit::new();
        match LIMIT.allow(std::time::Instant::now()) {
            Some(0) => tracing::warn!($($arg)+),
            Some(suppressed) => tracing::warn!(suppressed, $($arg)+),
            None => {}
        }
    }};
}
pub(crate) use warn_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_site_gets_a_burst_then_one_line_a_period() {
        let limit = RateLimit::new();
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert_eq!(limit.allow(t0), Some(0));
        }
        for _ in 0..1000 {
            assert_eq!(limit.allow(t0 + PERIOD / 2), None, "the burst is spent");
        }
        assert_eq!(limit.allow(t0 + PERIOD), Some(1000), "says what it dropped");
        assert_eq!(limit.allow(t0 + PERIOD), None);
        // An hour of a guest trying a thousand times a second: the lines
        // written are the burst and one a period.
        let mut written = BURST as u64 + 1;
        let mut t = t0 + PERIOD;
        while t < t0 + Duration::from_secs(3600) {
            t += Duration::from_micros(1000);
            written += u64::from(limit.allow(t).is_some());
        }
        assert_eq!(written, BURST as u64 + 3600 / PERIOD.as_secs());
        // Quiet for long enough, the whole burst is back, no more.
        let later = t + PERIOD * 100;
        let burst = (0..BURST + 3).filter(|_| limit.allow(later).is_some());
        assert_eq!(burst.count(), BURST as usize);
    }
}
