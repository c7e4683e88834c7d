//! When a failed job runs again: exponential backoff, capped.

use serde::{Deserialize, Serialize};

/// `base_ms · 2^(attempt-1)`, at most `max_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetrySchedule {
    pub base_ms: i64,
    pub max_ms: i64,
}

impl Default for RetrySchedule {
    fn default() -> Self {
        Self { base_ms: 1_000, max_ms: 300_000 }
    }
}

impl RetrySchedule {
    /// The wait after the `attempt`-th failure (1 = the first).
    pub fn delay_ms(&self, attempt: u32) -> i64 {
        let doublings = attempt.saturating_sub(1).min(62);
        self.base_ms.max(0).saturating_mul(1i64 << doublings).min(self.max_ms.max(0))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn doubles_then_caps() {
        let schedule = RetrySchedule { base_ms: 100, max_ms: 1_000 };
        let delays: Vec<i64> = (1..=6).map(|a| schedule.delay_ms(a)).collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1_000, 1_000]);
    }

    proptest! {
        #[test]
        fn never_shrinks_never_exceeds_the_cap(base in 0i64..100_000, max in 0i64..10_000_000, attempt in 1u32..200) {
            let schedule = RetrySchedule { base_ms: base, max_ms: max };
            prop_assert!(schedule.delay_ms(attempt) <= max.max(0));
            prop_assert!(schedule.delay_ms(attempt + 1) >= schedule.delay_ms(attempt));
        }
    }
}
