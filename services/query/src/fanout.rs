//! Sending reads to the counters that own the shards: one request per shard per
//! client request, all shards in parallel, retried against a newer owner when a
//! counter says it no longer owns the shard or does not answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tally_core::sharding::shard_of;
use tally_core::wire::{
    GraphNeighboursRequest, GraphNeighboursResponse, ShardAnswer, ShardMetricsRequest, ShardMetricsResponse,
    ShardOwner, ShardQuery, ShardReadRequest, ShardReadResponse,
};

use crate::error::ApiError;
use crate::owners::{Claim, Owners};

const ATTEMPTS: usize = 4;

pub struct Fanout {
    pub owners: Arc<Owners>,
    pub client: reqwest::Client,
    pub shards: u32,
    /// How long to wait for an owner to (re)appear.
    pub owner_wait: Duration,
}

impl Fanout {
    pub fn shard_of(&self, entity: &str) -> u32 {
        shard_of(entity, self.shards)
    }

    /// Answers `queries` in order, reading each shard once.
    pub async fn read(&self, queries: Vec<ShardQuery>, now_ms: i64) -> Result<Vec<ShardAnswer>, ApiError> {
        let total = queries.len();
        let mut by_shard: HashMap<u32, (Vec<usize>, Vec<ShardQuery>)> = HashMap::new();
        for (index, query) in queries.into_iter().enumerate() {
            let slot = by_shard.entry(self.shard_of(&query.entity)).or_default();
            slot.0.push(index);
            slot.1.push(query);
        }
        let calls = by_shard.into_iter().map(|(shard, (indexes, queries))| async move {
            let request = ShardReadRequest { shard, now_ms, queries };
            let response: ShardReadResponse = self.call(shard, "/internal/v1/read", &request).await?;
            Ok::<_, ApiError>((indexes, response.answers))
        });
        let mut answers: Vec<Option<ShardAnswer>> = vec![None; total];
        for result in join_all(calls).await {
            let (indexes, shard_answers) = result?;
            for (index, answer) in indexes.into_iter().zip(shard_answers) {
                answers[index] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|a| a.ok_or_else(|| ApiError::unavailable("a shard answered fewer queries than asked")))
            .collect()
    }

    /// One page of an entity's metrics.
    pub async fn metrics(
        &self,
        entity: &str,
        after: Option<String>,
        limit: usize,
    ) -> Result<ShardMetricsResponse, ApiError> {
        let shard = self.shard_of(entity);
        let request = ShardMetricsRequest { shard, entity: entity.to_string(), after, limit };
        self.call(shard, "/internal/v1/metrics", &request).await
    }

    /// One page of an entity's neighbours, from `tally-graph`.
    pub async fn neighbours(&self, request: &GraphNeighboursRequest) -> Result<GraphNeighboursResponse, ApiError> {
        self.call(ShardOwner::GRAPH, "/internal/v1/graph", request).await
    }

    async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        shard: u32,
        path: &str,
        body: &Req,
    ) -> Result<Resp, ApiError> {
        let mut claim: Option<Claim> = self.owners.get(shard).filter(|c| c.addr.is_some());
        for _ in 0..ATTEMPTS {
            let current = match claim.take() {
                Some(current) => current,
                None => self.owners.wait_newer(shard, None, self.owner_wait).await.ok_or_else(|| {
                    ApiError::unavailable(format!("nothing serves {} right now; retry shortly", owner_name(shard)))
                })?,
            };
            let Some(addr) = &current.addr else { continue };
            let sent = self.client.post(format!("http://{addr}{path}")).json(body).send().await;
            match sent {
                Ok(response) if response.status().is_success() => {
                    return response
                        .json::<Resp>()
                        .await
                        .map_err(|err| ApiError::unavailable(format!("shard {shard}: bad answer: {err}")));
                }
                Ok(response) if response.status() == reqwest::StatusCode::CONFLICT => {
                    tracing::debug!(shard, addr, "owner moved; waiting for a newer claim");
                }
                Ok(response) => {
                    let status = response.status();
                    let text = response.text().await.unwrap_or_default();
                    return Err(match serde_json::from_str::<serde_json::Value>(&text) {
                        // A shard stopped by a failure: said as such, with the owner's words.
                        Ok(body) if body["error"]["code"] == "shard_failed" => ApiError::shard_failed(
                            body["error"]["message"].as_str().unwrap_or("the shard failed").to_string(),
                        ),
                        _ => ApiError::unavailable(format!("shard {shard} failed ({status}): {text}")),
                    });
                }
                Err(err) => tracing::debug!(shard, addr, error = %err, "owner unreachable; waiting for a newer claim"),
            }
            claim = self.owners.wait_newer(shard, Some(current.version), self.owner_wait).await;
            if claim.is_none() {
                break;
            }
        }
        Err(ApiError::unavailable(format!("{} is unavailable; retry shortly", owner_name(shard))))
    }
}

fn owner_name(shard: u32) -> String {
    if shard == ShardOwner::GRAPH {
        "the graph (tally-graph)".into()
    } else {
        format!("shard {shard}")
    }
}
