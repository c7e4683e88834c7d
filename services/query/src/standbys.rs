//! Reads served by standbys: a read that allows staleness (`max_staleness_ms`)
//! whose owner is silent — dead, paused, or not yet replaced — is asked of the
//! counters holding its shards as standbys (`POST /internal/v1/standby-read`),
//! its `as_of` saying `standby`, and taken only if it is as fresh as the read
//! allows. Where the standbys are is learned from the counters' status (every
//! counter that claims a shard, every [`REFRESH_EVERY`]) in the background, so a
//! read never waits for it. A read with write tokens never gets here: a standby
//! may be behind what the owner served.
//!
//! The same statuses tell how fresh each shard its owner serves is ([`Seen`]);
//! after each round every shard's staleness (its lag as last told plus the time
//! since) goes to `tally_query_shard_staleness_seconds`, which grows while an owner
//! is silent.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::future::join_all;
use tally_core::wire::{
    CounterStatus, FreshReadResponse, ReadRequest, ShardOutcome, ShardQueries, ShardQuery, ShardState,
};
use tally_shared::claims::ClaimTable;
use tally_shared::lock;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::fanout::{Answered, Fanout};
use crate::freshness::{AsOf, Seen};
use crate::status::counter_status;

/// How often the standbys' places are asked anew.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How long a counter's status may take before it is left out of a refresh.
const STATUS_TIMEOUT: Duration = Duration::from_millis(500);
/// What the lock guards ([`lock::poisoned`]).
const HELD: &str = "the standbys' places";

/// Which counter (read address) holds each shard as a standby, as last asked.
#[derive(Debug, Default)]
pub struct Standbys {
    held: RwLock<BTreeMap<u32, String>>,
}

impl Standbys {
    /// A counter holding `shard` as a standby, if one is known.
    pub fn of(&self, shard: u32) -> Option<String> {
        lock::read(&self.held, HELD).get(&shard).cloned()
    }

    /// Asks every counter that claims a shard of `shards` for its status, every
    /// [`REFRESH_EVERY`] until `shutdown`; what owners say of the shards they serve
    /// goes to `seen`, and each shard's staleness since to `staleness`.
    pub fn refresh(
        self: Arc<Self>,
        owners: Arc<ClaimTable>,
        client: reqwest::Client,
        shards: u32,
        (seen, staleness): (Arc<Seen>, prometheus::GaugeVec),
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            // A shard never heard from is as stale as the time since tally-query started.
            let started = tally_shared::kafka::now_ms();
            for shard in 0..shards {
                seen.reported(shard, Some(0), started);
            }
            while !shutdown.is_cancelled() {
                let mut counters: Vec<String> =
                    (0..shards).filter_map(|shard| owners.get(shard).and_then(|claim| claim.addr)).collect();
                counters.sort();
                counters.dedup();
                let asked = counters.iter().map(|addr| {
                    let client = &client;
                    async move { Some((addr.clone(), counter_status(client, addr, STATUS_TIMEOUT).await?)) }
                });
                let answers: Vec<(String, CounterStatus)> = join_all(asked).await.into_iter().flatten().collect();
                let now = tally_shared::kafka::now_ms();
                for (addr, status) in &answers {
                    let owner = |shard: u32| owners.get(shard).and_then(|claim| claim.addr).as_ref() == Some(addr);
                    for s in status.shards.iter().filter(|s| s.state == ShardState::Serving && owner(s.shard)) {
                        seen.reported(s.shard, s.lag_ms, now);
                    }
                }
                for shard in 0..shards {
                    let label = shard.to_string();
                    match seen.staleness(shard, now) {
                        Some(ms) => staleness.with_label_values(&[&label]).set(ms as f64 / 1_000.0),
                        // Its owner does not know its lag yet (a new owner catching up).
                        None => staleness.remove_label_values(&[&label]).unwrap_or_default(),
                    }
                }
                let held: BTreeMap<u32, String> = answers
                    .into_iter()
                    .flat_map(|(addr, status)| {
                        let standby = status.shards.into_iter().filter(|s| s.state == ShardState::Standby);
                        standby.map(move |s| (s.shard, addr.clone())).collect::<Vec<_>>()
                    })
                    .collect();
                *lock::write(&self.held, HELD) = held;
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(REFRESH_EVERY) => {}
                }
            }
        })
    }
}

impl Fanout {
    /// Whether every shard of `queries` has a known standby.
    pub(crate) fn standbys_for(&self, queries: &[ShardQuery]) -> bool {
        queries.iter().all(|query| self.standbys.of(self.shard_of(&query.entity)).is_some())
    }

    /// Answers `queries` from the shards' standbys, in order, each shard's `as_of`
    /// saying `standby`; an error when one has none or does not answer.
    pub(crate) async fn read_standbys(&self, queries: &[ShardQuery], now_ms: i64) -> Result<Answered, ApiError> {
        let mut by_counter: HashMap<String, BTreeMap<u32, Vec<usize>>> = HashMap::new();
        for (index, query) in queries.iter().enumerate() {
            let shard = self.shard_of(&query.entity);
            let addr = self.standbys.of(shard).ok_or_else(|| no_standby(shard))?;
            by_counter.entry(addr).or_default().entry(shard).or_default().push(index);
        }
        let calls = by_counter.into_iter().map(|(addr, shards)| async move {
            let request = ReadRequest {
                now_ms,
                shards: (shards.iter())
                    .map(|(&shard, indexes)| ShardQueries {
                        shard,
                        queries: indexes.iter().map(|&i| queries[i].clone()).collect(),
                    })
                    .collect(),
            };
            let answer = self.post::<_, FreshReadResponse>(&addr, "/internal/v1/standby-read", &request, None).await;
            (shards, answer)
        });
        let mut answers = vec![None; queries.len()];
        let mut as_of = Vec::new();
        for (shards, answer) in join_all(calls).await {
            let response = match answer {
                Ok(Ok(response)) => response,
                Ok(Err(refused)) => return Err(refused),
                Err(err) => return Err(ApiError::unavailable(format!("a standby did not answer: {err}"))),
            };
            let fresh = response.as_of.into_iter().chain(std::iter::repeat(None));
            for (((shard, indexes), outcome), fresh) in shards.into_iter().zip(response.shards).zip(fresh) {
                let ShardOutcome::Answers { answers: shard_answers } = outcome else { return Err(no_standby(shard)) };
                if shard_answers.len() != indexes.len() {
                    return Err(ApiError::unavailable(format!("shard {shard}'s standby answered too few queries")));
                }
                as_of.push(AsOf { served_by: "standby", ..AsOf::of(shard, fresh) });
                for (index, answer) in indexes.into_iter().zip(shard_answers) {
                    answers[index] = Some(answer);
                }
            }
        }
        as_of.sort_by_key(|as_of| as_of.shard);
        // Every query's shard answered above, each with as many answers as asked.
        let answers = answers.into_iter().collect::<Option<Vec<_>>>();
        let answers = answers.ok_or_else(|| ApiError::unavailable("a standby left a query unanswered"))?;
        Ok(Answered { answers, as_of })
    }
}

fn no_standby(shard: u32) -> ApiError {
    ApiError::unavailable(format!("shard {shard} has no standby serving it"))
}
