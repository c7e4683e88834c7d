//! `GET /v1/status`: how fresh the counts are, for the dashboard's freshness
//! indicator — which counter serves each shard, each shard's state, how many
//! records of its log it has not applied yet (measured by the counter every few
//! seconds), how much newer input it may be missing in ms (`lag_ms`, the
//! counter's `freshness`), and whether the graph is served.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use futures::future::join_all;
use serde::Serialize;
use tally_core::wire::{CounterStatus, ShardOwner, ShardState};
use tally_shared::kafka::now_ms;

use crate::api::{json_response, ApiState};
use crate::error::ApiError;

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
    /// How much newer input it may be missing, in ms (none: not known yet).
    lag_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
struct Status {
    at_ms: i64,
    /// Records not applied yet over every serving shard; `None` while a serving
    /// shard's lag has not been measured yet.
    lag: Option<i64>,
    /// The oldest lag measurement summed in `lag`.
    lag_at_ms: Option<i64>,
    /// The largest `lag_ms` of the serving shards; `None` while a serving shard's
    /// is not known.
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
    let answers = join_all(by_counter.keys().map(|addr| async move {
        let response = fanout.client.get(format!("http://{addr}/internal/v1/status")).send().await;
        match response {
            Ok(response) if response.status().is_success() => response.json::<CounterStatus>().await.ok(),
            _ => None,
        }
    }))
    .await;
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
            }
            tracing::trace!(addr, shard, state = view.state, "shard status");
        }
    }
    let graph = fanout.owners.get(ShardOwner::GRAPH).and_then(|claim| claim.addr);
    json_response(&Status {
        at_ms: now_ms(),
        lag: shards.iter().filter(|s| s.state == "serving").map(|s| s.lag).sum(),
        lag_at_ms: shards.iter().filter(|s| s.state == "serving").filter_map(|s| s.lag_at_ms).min(),
        lag_ms: shards
            .iter()
            .filter(|s| s.state == "serving")
            .map(|s| s.lag_ms)
            .try_fold(None, |most: Option<i64>, lag| lag.map(|lag| Some(most.map_or(lag, |most| most.max(lag)))))
            .flatten(),
        serving: shards.iter().filter(|s| s.state == "serving").count(),
        shards,
        graph,
    })
}
