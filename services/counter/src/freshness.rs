//! How fresh a shard's store is: what it applied, the input time of the newest
//! record it applied (no later than when it was applied), and its log's end as
//! last learned from the consumer's fetches (librdkafka's cached high watermark,
//! read after every turn of the loop: while the loop rests, its checks of the
//! ends wake it within `rest::REST_CHECK` of a record arriving, so the cached end
//! is no staler).
//!
//! The lag ([`lag_ms`]) is how much newer input the store may be missing: 0 up to
//! when it was last seen caught up with its log, else the age of the newest
//! input it applied.

use std::sync::Mutex;

use tally_shared::lock::lock;

/// What [`Freshness`]'s lock guards ([`tally_shared::lock`]).
const FRESHNESS: &str = "a shard's freshness";

/// A shard store's freshness; written by the applying thread and the loop's turn,
/// read by status requests.
#[derive(Debug)]
pub struct Freshness {
    state: Mutex<State>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    /// The next offset of the shard's log to apply: the store's own, copied here
    /// after each batch so a read takes no lock a commit holds.
    applied: i64,
    /// The input time of the newest record applied since the store was opened.
    newest_input_ms: Option<i64>,
    /// The log's end as last learned, and when.
    end: Option<(i64, i64)>,
}

/// A shard's freshness at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsOf {
    /// The next offset of the shard's log to apply.
    pub applied: i64,
    /// How much newer input the store may be missing (none: not known yet).
    pub lag_ms: Option<i64>,
}

impl Freshness {
    /// A store opened at `applied` (its next offset).
    pub fn new(applied: i64) -> Self {
        Self { state: Mutex::new(State { applied, newest_input_ms: None, end: None }) }
    }

    /// A batch was applied up to `next_offset`; its newest record's input time.
    pub fn applied(&self, next_offset: i64, newest_input_ms: Option<i64>) {
        let mut state = lock(&self.state, FRESHNESS);
        state.applied = state.applied.max(next_offset);
        state.newest_input_ms = state.newest_input_ms.max(newest_input_ms);
    }

    /// The log ended at `end` at `at_ms`.
    pub fn learned_end(&self, end: i64, at_ms: i64) {
        lock(&self.state, FRESHNESS).end = Some((end, at_ms));
    }

    pub fn as_of(&self, now_ms: i64) -> AsOf {
        let state = *lock(&self.state, FRESHNESS);
        AsOf { applied: state.applied, lag_ms: lag_ms(state.applied, state.newest_input_ms, state.end, now_ms) }
    }
}

/// The lag of a store that applied up to `applied` (its next offset), whose newest
/// applied record's input time is `newest_input_ms`, and whose log ended at
/// `end.0` when last learned at `end.1`: caught up then, it misses at most what
/// came since (`now − end.1`); behind, at least what came since its newest input
/// (`now − newest_input_ms`); behind with nothing applied yet: not known.
pub fn lag_ms(applied: i64, newest_input_ms: Option<i64>, end: Option<(i64, i64)>, now_ms: i64) -> Option<i64> {
    match end {
        Some((end, at_ms)) if applied >= end => Some((now_ms - at_ms).max(0)),
        _ => newest_input_ms.map(|input_ms| (now_ms - input_ms).max(0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caught_up_a_store_lags_since_it_was_seen_so_else_by_its_newest_input() {
        let now = 100_000;
        // Caught up when its end was learned 80 ms ago, whatever its input's age.
        assert_eq!(lag_ms(50, Some(10_000), Some((50, now - 80)), now), Some(80));
        assert_eq!(lag_ms(50, None, Some((50, now - 80)), now), Some(80), "an empty log, or one applied before");
        // Behind its log: the newest input applied is the measure.
        assert_eq!(lag_ms(40, Some(now - 2_500), Some((50, now - 80)), now), Some(2_500));
        assert_eq!(lag_ms(40, Some(now - 2_500), None, now), Some(2_500));
        assert_eq!(lag_ms(40, None, Some((50, now)), now), None, "nothing applied yet: not known");
        // Clocks a little apart never make a negative lag.
        assert_eq!(lag_ms(40, Some(now + 30), None, now), Some(0));
        assert_eq!(lag_ms(50, None, Some((50, now + 30)), now), Some(0));
    }

    #[test]
    fn freshness_keeps_the_furthest_applied_and_newest_input() {
        let freshness = Freshness::new(10);
        assert_eq!(freshness.as_of(1_000), AsOf { applied: 10, lag_ms: None });
        freshness.applied(20, Some(900));
        freshness.applied(15, Some(800));
        assert_eq!(freshness.as_of(1_000), AsOf { applied: 20, lag_ms: Some(100) });
        freshness.learned_end(20, 990);
        assert_eq!(freshness.as_of(1_000), AsOf { applied: 20, lag_ms: Some(10) });
        freshness.learned_end(25, 995);
        assert_eq!(freshness.as_of(1_000), AsOf { applied: 20, lag_ms: Some(100) });
    }
}
