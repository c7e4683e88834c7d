//! How fresh an answer is, and reads bounded by staleness.
//!
//! Every read answers with `as_of`: for each shard it read, the next offset of
//! the shard's log its store applies (everything below is in the answer), how
//! much newer input it may be missing (`lag_ms`, the counter's
//! `freshness`) and who served it. A read with `max_staleness_ms` answers at
//! once when every shard it reads lags at most that much, else 503
//! `too_stale`: it waits for the counters at most that long, and a shard whose
//! read went unanswered less than that long ago, its data already that old, is
//! refused at once (a paused counter never holds a dashboard; one read per bound
//! asks again, to learn it is back).

use std::collections::HashMap;
use std::sync::Mutex;

use axum::http::StatusCode;
use serde::Serialize;
use tally_core::wire::ShardAsOf;
use tally_shared::lock::lock;

use crate::error::ApiError;

/// What [`Seen`]'s lock guards ([`tally_shared::lock`]).
const SEEN: &str = "the shards' last freshness";

/// The most a read may ask to wait for fresh enough data.
pub const MAX_STALENESS_MS: i64 = 3_600_000;

/// How fresh one shard of an answer was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AsOf {
    /// The next offset of the shard's log it applies (none: its counter did not
    /// say, an older release).
    pub applied: Option<i64>,
    /// How much newer input it may be missing, in ms (none: not known).
    pub lag_ms: Option<i64>,
    /// `owner`: the counter that owns the shard; `standby`: one holding it as a
    /// standby, while the owner was silent (a read that allows staleness).
    pub served_by: &'static str,
    pub shard: u32,
    /// For a read with write tokens (`after=`): per input partition they name, the
    /// token of the last record the answer holds ([`crate::after`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub through: Vec<String>,
}

impl AsOf {
    pub fn of(shard: u32, as_of: Option<ShardAsOf>) -> Self {
        let (applied, lag_ms) = (as_of.map(|a| a.applied), as_of.and_then(|a| a.lag_ms));
        Self { applied, lag_ms, served_by: "owner", shard, through: Vec::new() }
    }
}

/// Each shard's freshness when it last answered, and whether a read of it went
/// unanswered since.
#[derive(Debug, Default)]
pub struct Seen {
    shards: Mutex<HashMap<u32, Last>>,
}

#[derive(Debug, Clone, Copy)]
struct Last {
    lag_ms: Option<i64>,
    /// When its lag was last told (a read's answer or its owner's status).
    at_ms: i64,
    /// When a read of it was last answered.
    read_at_ms: Option<i64>,
    /// When a read of it last went unanswered, since one was answered.
    unanswered_at: Option<i64>,
}

impl Seen {
    /// A read of the shard was answered, `as_of` this.
    pub fn answered(&self, as_of: &AsOf, now_ms: i64) {
        let last = Last { lag_ms: as_of.lag_ms, at_ms: now_ms, read_at_ms: Some(now_ms), unanswered_at: None };
        lock(&self.shards, SEEN).insert(as_of.shard, last);
    }

    /// The shard's owner told its lag otherwise (its status): the staleness counts
    /// from it, but whether reads of it go unanswered does not change.
    pub fn reported(&self, shard: u32, lag_ms: Option<i64>, now_ms: i64) {
        let mut shards = lock(&self.shards, SEEN);
        let last = shards.entry(shard).or_insert(Last { lag_ms, at_ms: now_ms, read_at_ms: None, unanswered_at: None });
        (last.lag_ms, last.at_ms) = (lag_ms, now_ms);
    }

    /// A read of `shards` begun at `since_ms` ran out of time at `now_ms`: those
    /// that did not answer since are marked, and returned.
    pub fn unanswered(&self, shards: impl IntoIterator<Item = u32>, since_ms: i64, now_ms: i64) -> Vec<u32> {
        let mut seen = lock(&self.shards, SEEN);
        let mut silent = Vec::new();
        for shard in shards {
            match seen.get_mut(&shard) {
                Some(last) if last.read_at_ms.is_some_and(|at| at >= since_ms) => {}
                Some(last) => {
                    last.unanswered_at = Some(now_ms);
                    silent.push(shard);
                }
                None => silent.push(shard),
            }
        }
        silent
    }

    /// How stale `shard`'s data is at least at `now_ms`: its lag when it was last
    /// told (a read's answer or its owner's status), and the time since (none:
    /// never told, or its lag was not known).
    pub fn staleness(&self, shard: u32, now_ms: i64) -> Option<i64> {
        let last = *lock(&self.shards, SEEN).get(&shard)?;
        Some(last.lag_ms? + (now_ms - last.at_ms).max(0))
    }

    /// How stale `shard`'s data is at least, when a read of it went unanswered
    /// less than `within` ms ago: its lag when it last answered, and the time since
    /// (none: it answers, its lag was not known, or it is time to ask again).
    pub fn stale_and_silent(&self, shard: u32, within: i64, now_ms: i64) -> Option<i64> {
        let last = *lock(&self.shards, SEEN).get(&shard)?;
        last.unanswered_at.filter(|at| now_ms - at < within)?;
        Some(last.lag_ms? + (now_ms - last.at_ms).max(0))
    }
}

/// The answer to a read whose data is staler than `bound` ms.
pub fn too_stale(shard: u32, staleness_ms: Option<i64>, bound: i64, why: &str) -> ApiError {
    let how = staleness_ms.map_or_else(|| "of unknown age".to_string(), |ms| format!("{ms} ms behind"));
    let message =
        format!("shard {shard} is {how} ({why}), past max_staleness_ms = {bound}: retry, or allow more staleness");
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "too_stale", message)
}

/// A read's `max_staleness_ms`, checked.
pub fn check_staleness(max_staleness_ms: Option<i64>) -> Result<Option<i64>, ApiError> {
    match max_staleness_ms {
        Some(ms) if !(0..=MAX_STALENESS_MS).contains(&ms) => Err(ApiError::bad_request(
            "invalid_max_staleness",
            format!("max_staleness_ms: must be 0 to {MAX_STALENESS_MS}"),
        )),
        bound => Ok(bound),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_is_stale_and_silent_only_after_a_read_went_unanswered() {
        let seen = Seen::default();
        let as_of = AsOf::of(3, Some(ShardAsOf { applied: 10, lag_ms: Some(40) }));
        seen.answered(&as_of, 1_000);
        assert_eq!(seen.stale_and_silent(3, 500, 1_500), None, "it answers");
        assert_eq!(seen.unanswered([3, 4], 1_100, 1_400), vec![3, 4]);
        assert_eq!(seen.stale_and_silent(3, 500, 1_500), Some(540));
        assert_eq!(seen.stale_and_silent(3, 500, 1_900), None, "a bound later, it is asked again");
        assert_eq!(seen.stale_and_silent(4, 500, 1_500), None, "never seen");
        seen.answered(&as_of, 1_600);
        assert_eq!(seen.stale_and_silent(3, 500, 1_700), None, "it answered again");
        seen.answered(&AsOf::of(3, Some(ShardAsOf { applied: 10, lag_ms: None })), 1_800);
        assert_eq!(seen.unanswered([3], 1_700, 1_800), Vec::<u32>::new(), "it answered during the read");
        seen.unanswered([3], 1_900, 1_800);
        assert_eq!(seen.stale_and_silent(3, 500, 1_900), None, "its lag was not known");
    }

    #[test]
    fn a_status_report_moves_the_staleness_but_not_the_reads_unanswered_marks() {
        let seen = Seen::default();
        seen.reported(3, Some(40), 1_000);
        assert_eq!(seen.staleness(3, 1_500), Some(540), "a report alone starts the clock");
        assert_eq!(seen.unanswered([3], 900, 1_600), vec![3], "no read of it was ever answered");
        // Its owner keeps reporting while reads of it go unanswered: they stay refused.
        seen.reported(3, Some(10), 1_700);
        assert_eq!(seen.stale_and_silent(3, 500, 1_800), Some(110), "still silent to reads");
        assert_eq!(seen.unanswered([3], 1_650, 1_900), vec![3], "a report is not an answer to the read");
        seen.answered(&AsOf::of(3, Some(ShardAsOf { applied: 10, lag_ms: Some(5) })), 2_000);
        assert_eq!(seen.stale_and_silent(3, 500, 2_100), None, "a read was answered");
        assert_eq!(seen.unanswered([3], 1_950, 2_100), Vec::<u32>::new());
    }

    #[test]
    fn a_shards_staleness_grows_from_when_it_was_last_told() {
        let seen = Seen::default();
        assert_eq!(seen.staleness(3, 1_000), None, "never seen");
        seen.answered(&AsOf::of(3, Some(ShardAsOf { applied: 10, lag_ms: Some(40) })), 1_000);
        assert_eq!((seen.staleness(3, 1_000), seen.staleness(3, 7_000)), (Some(40), Some(6_040)));
        assert_eq!(seen.staleness(3, 900), Some(40), "a clock that stepped back adds nothing");
        seen.answered(&AsOf::of(3, Some(ShardAsOf { applied: 11, lag_ms: None })), 8_000);
        assert_eq!(seen.staleness(3, 9_000), None, "its lag was not known");
    }

    #[test]
    fn staleness_bounds_are_checked() {
        assert_eq!(check_staleness(None).unwrap(), None);
        assert_eq!(check_staleness(Some(500)).unwrap(), Some(500));
        for bad in [-1, MAX_STALENESS_MS + 1] {
            assert_eq!(check_staleness(Some(bad)).unwrap_err().code, "invalid_max_staleness");
        }
    }
}
