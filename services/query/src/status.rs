//! `GET /v1/status`: how fresh the counts are, for the dashboard's freshness
//! indicator — which counter serves each shard, each shard's state, how many
//! records of its log it has not applied yet (measured by the counter every few
//! seconds), how much newer input it may be missing in ms (`lag_ms`, the
//! counter's `freshness`), and whether the graph is served. A shard whose counter
//! does not answer within [`STATUS_WITHIN`] is `unreachable`, its `lag_ms` what
//! its owner last reported ([`crate::standbys`] asks every second) plus the time
//! since: the indicator turns stale while a counter is silent rather than saying
//! nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::Response;
use futures::future::join_all;
use serde::Serialize;
use tally_core::wire::{CounterStatus, ShardOwner, ShardState};
use tally_shared::kafka::now_ms;

use crate::api::{json_response, ApiState};
use crate::error::ApiError;

/// How long the status waits for a counter's: past it, its shards are
/// `unreachable` (a dashboard's indicator never waits for a silent counter).
const STATUS_WITHIN: Duration = Duration::from_secs(1);

#[derive(Debug, Serialize)]
struct ShardView {
    shard: u32,
    /// `serving`, `catching_up`, `failed`, or `unreachable` (its counter did not
    /// answer) / `unowned` (no counter claims it).
    state: &'static str,
    counter: Option<String>,
    lag: Option<i64>,
    lag_at_ms: Option<i64>,
    /// The next offset of its log it applies.
    applied: Option<i64>,
    /// How much newer input it may be missing, in ms (none: not known yet); for
    /// an `unreachable` shard, at least its lag when it last answered plus the
    /// time since.
    lag_ms: Option<i64>,
}

/// A counter's status (`GET /internal/v1/status` at `addr`), if it answers within
/// `within`.
pub(crate) async fn counter_status(client: &reqwest::Client, addr: &str, within: Duration) -> Option<CounterStatus> {
    let response = client.get(format!("http://{addr}/internal/v1/status")).timeout(within).send().await;
    response.and_then(reqwest::Response::error_for_status).ok()?.json::<CounterStatus>().await.ok()
}

/// The largest `lag_ms` of the serving shards (none while one's is not known)
/// and of the unreachable ones whose is known.
fn largest_lag(shards: &[ShardView]) -> Option<i64> {
    let mut serving = shards.iter().filter(|s| s.state == "serving").map(|s| s.lag_ms);
    let serving = serving.try_fold(None, |most: Option<i64>, lag| Some(most.max(Some(lag?))))?;
    let silent = shards.iter().filter(|s| s.state == "unreachable").filter_map(|s| s.lag_ms).max();
    serving.max(silent)
}

#[derive(Debug, Serialize)]
struct Status {
    at_ms: i64,
    /// Records not applied yet over every serving shard; `None` while a serving
    /// shard's lag has not been measured yet.
    lag: Option<i64>,
    /// The oldest lag measurement summed in `lag`.
    lag_at_ms: Option<i64>,
    /// The largest `lag_ms` of the serving and the unreachable shards; `None`
    /// while a serving shard's is not known.
    lag_ms: Option<i64>,
    serving: usize,
    shards: Vec<ShardView>,
    /// `tally-graph`'s read address, when it is served.
    graph: Option<String>,
}

pub async fn status(State(state): State<Arc<ApiState>>) -> Result<Response, ApiError> {
    let fanout = &state.fanout;
    let mut by_counter: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let mut shards: Vec<ShardView> = Vec::new();
    for shard in 0..fanout.shards {
        let counter = fanout.owners.get(shard).and_then(|claim| claim.addr);
        if let Some(addr) = &counter {
            by_counter.entry(addr.clone()).or_default().push(shard);
        }
        shards.push(ShardView {
            shard,
            state: "unowned",
            counter,
            lag: None,
            lag_at_ms: None,
            applied: None,
            lag_ms: None,
        });
    }
    let answers = join_all(by_counter.keys().map(|addr| counter_status(&fanout.client, addr, STATUS_WITHIN))).await;
    for ((addr, claimed), answer) in by_counter.iter().zip(answers) {
        for &shard in claimed {
            let view = &mut shards[shard as usize];
            let held = answer.as_ref().and_then(|status| status.shards.iter().find(|s| s.shard == shard));
            view.state = match held.map(|s| s.state) {
                Some(ShardState::Serving) => "serving",
                Some(ShardState::CatchingUp) => "catching_up",
                Some(ShardState::Failed) => "failed",
                None if answer.is_none() => "unreachable",
                // Claimed by a counter that let go of it since (or keeps it as a
                // standby now): the claim is stale.
                None | Some(ShardState::Standby) => "unowned",
            };
            if let Some(held) = held {
                (view.lag, view.lag_at_ms) = (held.lag, held.lag_at_ms);
                (view.applied, view.lag_ms) = (held.applied, held.lag_ms);
            } else if answer.is_none() {
                view.lag_ms = fanout.seen.staleness(shard, now_ms());
            }
            tracing::trace!(addr, shard, state = view.state, "shard status");
        }
    }
    let graph = fanout.owners.get(ShardOwner::GRAPH).and_then(|claim| claim.addr);
    json_response(&Status {
        at_ms: now_ms(),
        lag: shards.iter().filter(|s| s.state == "serving").map(|s| s.lag).sum(),
        lag_at_ms: shards.iter().filter(|s| s.state == "serving").filter_map(|s| s.lag_at_ms).min(),
        lag_ms: largest_lag(&shards),
        serving: shards.iter().filter(|s| s.state == "serving").count(),
        shards,
        graph,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(shard: u32, state: &'static str, lag_ms: Option<i64>) -> ShardView {
        ShardView { shard, state, counter: None, lag: None, lag_at_ms: None, applied: None, lag_ms }
    }

    #[test]
    fn the_largest_lag_counts_silent_shards_and_waits_for_every_serving_ones() {
        let serving = [view(0, "serving", Some(40)), view(1, "serving", Some(90))];
        assert_eq!(largest_lag(&serving), Some(90));
        let silent = [view(0, "serving", Some(40)), view(1, "unreachable", Some(6_040)), view(2, "unreachable", None)];
        assert_eq!(largest_lag(&silent), Some(6_040), "a silent shard's staleness shows");
        let unknown = [view(0, "serving", None), view(1, "unreachable", Some(6_040))];
        assert_eq!(largest_lag(&unknown), None, "a serving shard's lag not known yet");
        let elsewhere =
            [view(0, "unowned", Some(10_000)), view(1, "failed", Some(10_000)), view(2, "catching_up", None)];
        assert_eq!(largest_lag(&elsewhere), None, "only serving and silent shards count");
        assert_eq!(largest_lag(&[view(0, "unreachable", Some(7_000))]), Some(7_000), "every counter silent");
    }
}
