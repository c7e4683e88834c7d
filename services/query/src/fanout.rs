//! Sending reads to the counters that own the shards: one request per counter per
//! client request (all its shards at once, over the counter's read link; over JSON
//! when the link is off or the counter has none), all counters in parallel, shards
//! retried against a newer owner when a counter says it no longer owns them or does
//! not answer.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tally_core::sharding::shard_of;
use tally_core::wire::{
    FreshReadResponse, GraphAncestorsRequest, GraphNeighboursRequest, GraphNeighboursResponse, ReadRequest,
    ShardAnswer, ShardMetricsRequest, ShardMetricsResponse, ShardOutcome, ShardOwner, ShardQueries, ShardQuery,
};

use crate::after::{After, LogEnds, Touches};
use crate::error::ApiError;
use crate::freshness::{too_stale, AsOf, Seen};
use crate::read_link::{LinkError, Links};
use tally_shared::claims::{Claim, ClaimTable};

const ATTEMPTS: usize = 4;
/// How long a read that allows staleness waits for the owners before it asks the
/// standbys too (a quarter of its bound when that is less).
const HEDGE_MS: i64 = 200;

/// The first shard of `answered` staler than `bound` (or of unknown staleness).
fn stale_beyond(answered: &Answered, bound: i64) -> Option<&AsOf> {
    answered.as_of.iter().find(|as_of| as_of.lag_ms.is_none_or(|lag| lag > bound))
}

pub struct Fanout {
    pub owners: Arc<ClaimTable>,
    pub client: reqwest::Client,
    /// Read links to the counters (`None`: `query.read_link = false`, reads go over
    /// HTTP).
    pub links: Option<Links>,
    pub shards: u32,
    /// How long to wait for an owner to (re)appear.
    pub owner_wait: Duration,
    /// Each shard's freshness when it last answered ([`crate::freshness`]).
    pub seen: Arc<Seen>,
    /// The shard topic's ends, for reads with write tokens ([`crate::after`]; `None`:
    /// such reads that need them are unavailable).
    pub ends: Option<LogEnds>,
    /// `tally_query_token_wait_seconds`.
    pub token_waits: prometheus::HistogramVec,
    /// Where the shards' standbys are ([`crate::standbys`]).
    pub standbys: Arc<crate::standbys::Standbys>,
}

/// A read's answers, in the order asked, and how fresh each shard read was.
#[derive(Debug)]
pub struct Answered {
    pub answers: Vec<ShardAnswer>,
    /// By shard.
    pub as_of: Vec<AsOf>,
}

impl Fanout {
    pub fn shard_of(&self, entity: &str) -> u32 {
        shard_of(entity, self.shards)
    }

    /// Answers `queries` as [`Fanout::read_all`] does; with `after`, only once
    /// every shard they touch holds those writes ([`crate::after`]), its `as_of`
    /// saying how far; with `max_staleness_ms`, only data at most that old, waiting
    /// at most that long (see [`crate::freshness`]).
    pub async fn read(
        &self,
        queries: Vec<ShardQuery>,
        now_ms: i64,
        max_staleness_ms: Option<i64>,
        after: Option<&After>,
    ) -> Result<Answered, ApiError> {
        let Some(after) = after else { return self.read_fresh(queries, now_ms, max_staleness_ms, true).await };
        let mut touches = Touches::default();
        for query in &queries {
            touches.add(self.shard_of(&query.entity), query.kind);
        }
        let mut reached = self.wait_after(after, &touches).await?;
        // Never from a standby: it may be behind what its owner served.
        let mut answered = self.read_fresh(queries, now_ms, max_staleness_ms, false).await?;
        for as_of in &mut answered.as_of {
            as_of.through = reached.remove(&as_of.shard).unwrap_or_default();
        }
        Ok(answered)
    }

    /// [`Fanout::read_all`] bounded by `max_staleness_ms`; falling back on the
    /// shards' standbys while their owners are silent, when `from_standbys`.
    async fn read_fresh(
        &self,
        queries: Vec<ShardQuery>,
        now_ms: i64,
        max_staleness_ms: Option<i64>,
        from_standbys: bool,
    ) -> Result<Answered, ApiError> {
        let Some(bound) = max_staleness_ms else { return self.read_all(queries, now_ms).await };
        let shards: std::collections::BTreeSet<u32> = queries.iter().map(|q| self.shard_of(&q.entity)).collect();
        let clock = tally_shared::kafka::now_ms();
        let within = Duration::from_millis(bound.max(1) as u64);
        // Standbys answer only when the owners do not, after a hedge (at once for an
        // owner known silent): a standby may be behind its owner.
        let standbys = from_standbys && self.standbys_for(&queries);
        let mut hedge = Duration::from_millis((bound / 4).clamp(1, HEDGE_MS) as u64);
        for &shard in &shards {
            let silent = self.seen.stale_and_silent(shard, bound, clock);
            if let Some(staleness) = silent.filter(|staleness| *staleness > bound) {
                if !standbys {
                    return Err(too_stale(shard, Some(staleness), bound, "its owner has not answered since"));
                }
                hedge = Duration::ZERO;
            }
        }
        let fallback = async {
            tokio::time::sleep(hedge).await;
            match tokio::time::timeout(within, self.read_standbys(&queries, now_ms)).await {
                Ok(Ok(answered)) => Some(answered),
                _ => None,
            }
        };
        let owners = tokio::time::timeout(within, self.read_all(queries.clone(), now_ms));
        tokio::pin!(fallback, owners);
        let mut fallback_done = !standbys;
        let owners_said = loop {
            tokio::select! {
                biased;
                said = &mut owners => break said,
                answered = &mut fallback, if !fallback_done => {
                    fallback_done = true;
                    if let Some(answered) = answered.filter(|answered| stale_beyond(answered, bound).is_none()) {
                        return Ok(answered);
                    }
                }
            }
        };
        let answered = match owners_said {
            Ok(Ok(answered)) => answered,
            // A refusal (a failed shard, a bad query) stands: only silence falls back.
            Ok(Err(err)) if err.code != "shard_unavailable" => return Err(err),
            said => {
                // The owners are silent or ran out of time: what the standbys say, if
                // it is fresh enough.
                if !fallback_done {
                    if let Some(answered) = fallback.await.filter(|answered| stale_beyond(answered, bound).is_none()) {
                        return Ok(answered);
                    }
                }
                match said {
                    Ok(Err(err)) => return Err(err),
                    _ => {
                        // Only the shards that did not answer during this read.
                        let silent = self.seen.unanswered(shards.iter().copied(), clock, tally_shared::kafka::now_ms());
                        let shard = silent.first().or(shards.first()).copied().unwrap_or_default();
                        return Err(too_stale(shard, None, bound, "no answer within max_staleness_ms"));
                    }
                }
            }
        };
        if let Some(stale) = stale_beyond(&answered, bound) {
            return Err(too_stale(stale.shard, stale.lag_ms, bound, "as its owner says"));
        }
        Ok(answered)
    }

    /// Answers `queries` in order: one request per counter that owns any of their
    /// shards (each shard read once, from one snapshot); shards whose owner moved or
    /// did not answer are asked again of the owner of a newer claim.
    pub async fn read_all(&self, queries: Vec<ShardQuery>, now_ms: i64) -> Result<Answered, ApiError> {
        let total = queries.len();
        let mut pending: BTreeMap<u32, (Vec<usize>, Vec<ShardQuery>)> = BTreeMap::new();
        for (index, query) in queries.into_iter().enumerate() {
            let slot = pending.entry(self.shard_of(&query.entity)).or_default();
            slot.0.push(index);
            slot.1.push(query);
        }
        let mut answers: Vec<Option<ShardAnswer>> = vec![None; total];
        let mut as_of: BTreeMap<u32, AsOf> = BTreeMap::new();
        // The claim version each shard was last asked under.
        let mut tried: HashMap<u32, u64> = HashMap::new();
        for _ in 0..ATTEMPTS {
            if pending.is_empty() {
                break;
            }
            let claims = join_all(pending.keys().map(|&shard| {
                let last = tried.get(&shard).copied();
                async move { (shard, self.claim_newer_than(shard, last).await) }
            }))
            .await;
            let mut by_owner: HashMap<String, Vec<u32>> = HashMap::new();
            for (shard, claim) in claims {
                let Some(Claim { addr: Some(addr), version, .. }) = claim else {
                    return Err(ApiError::unavailable(format!(
                        "nothing serves {} right now; retry shortly",
                        owner_name(shard)
                    )));
                };
                tried.insert(shard, version);
                by_owner.entry(addr).or_default().push(shard);
            }
            // Each counter's answer is taken as it comes: one that answered is known
            // fresh even when the read as a whole runs out of time.
            let mut calls: futures::stream::FuturesUnordered<_> = by_owner
                .into_iter()
                .map(|(addr, shards)| {
                    let request = ReadRequest {
                        now_ms,
                        shards: shards
                            .iter()
                            .map(|shard| ShardQueries { shard: *shard, queries: pending[shard].1.clone() })
                            .collect(),
                    };
                    async move {
                        let response = self.ask(&addr, &request).await;
                        (addr, shards, response)
                    }
                })
                .collect();
            while let Some((addr, shards, response)) = futures::StreamExt::next(&mut calls).await {
                let response = match response {
                    Ok(Ok(response)) => response,
                    Ok(Err(refused)) => return Err(refused),
                    Err(why) => {
                        tracing::debug!(addr, why, "owner unreachable; waiting for a newer claim");
                        continue;
                    }
                };
                if response.shards.len() != shards.len() {
                    return Err(ApiError::unavailable(format!("{addr} answered for fewer shards than asked")));
                }
                let freshness = response.as_of.into_iter().chain(std::iter::repeat(None));
                for ((shard, outcome), fresh) in shards.into_iter().zip(response.shards).zip(freshness) {
                    match outcome {
                        ShardOutcome::Answers { answers: shard_answers } => {
                            let Some((indexes, asked)) = pending.remove(&shard) else { continue };
                            let fresh = AsOf::of(shard, fresh);
                            self.seen.answered(&fresh, tally_shared::kafka::now_ms());
                            as_of.insert(shard, fresh);
                            if shard_answers.len() != asked.len() {
                                return Err(ApiError::unavailable(format!(
                                    "shard {shard} answered {} of {} queries",
                                    shard_answers.len(),
                                    asked.len()
                                )));
                            }
                            for (index, answer) in indexes.into_iter().zip(shard_answers) {
                                answers[index] = Some(answer);
                            }
                        }
                        ShardOutcome::NotOwner => {
                            tracing::debug!(shard, addr, "owner moved; waiting for a newer claim")
                        }
                        // A shard stopped by a failure: said as such, with the owner's words.
                        ShardOutcome::Failed { message } => return Err(ApiError::shard_failed(message)),
                        ShardOutcome::Unavailable { message } => return Err(ApiError::unavailable(message)),
                    }
                }
            }
        }
        if let Some(shard) = pending.keys().next() {
            return Err(ApiError::unavailable(format!("{} is unavailable; retry shortly", owner_name(*shard))));
        }
        let answers = answers
            .into_iter()
            .map(|a| a.ok_or_else(|| ApiError::unavailable("a shard answered fewer queries than asked")))
            .collect::<Result<_, _>>()?;
        Ok(Answered { answers, as_of: as_of.into_values().collect() })
    }

    /// The current claim of `shard` when it is newer than version `than` (any, when
    /// `None`); else waits for one up to `owner_wait`.
    async fn claim_newer_than(&self, shard: u32, than: Option<u64>) -> Option<Claim> {
        let current = self.owners.get(shard).filter(|c| c.addr.is_some() && than.is_none_or(|v| c.version > v));
        match current {
            Some(claim) => Some(claim),
            None => self.owners.wait_newer(shard, than, self.owner_wait).await,
        }
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

    /// Every entity that reaches `entity`, sorted, from `tally-graph`; at most
    /// `limit` (`more` when there are more).
    pub async fn ancestors(&self, entity: &str, limit: usize) -> Result<GraphNeighboursResponse, ApiError> {
        let request = GraphAncestorsRequest { entity: entity.to_string(), limit };
        self.call(ShardOwner::GRAPH, "/internal/v1/graph/ancestors", &request).await
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
            match self.post::<Req, Resp>(addr, path, body, None).await {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(refused)) if refused.code == "not_owner" => {
                    tracing::debug!(shard, addr, "owner moved; waiting for a newer claim");
                }
                Ok(Err(refused)) => return Err(refused),
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

impl Fanout {
    /// Asks the counter at `addr` over its read link, or over HTTP when the link is
    /// turned off or the counter does not open links: its answer; its refusal as the
    /// client's error; or why it could not be reached.
    async fn ask(&self, addr: &str, request: &ReadRequest) -> Result<Result<FreshReadResponse, ApiError>, String> {
        let mut within = None;
        if let Some(links) = &self.links {
            let started = std::time::Instant::now();
            match links.read(addr, request).await {
                Ok(response) => return Ok(Ok(response)),
                Err(LinkError::Failed(why)) => return Err(why),
                // What is left of the read's deadline.
                Err(LinkError::Unsupported) => within = Some(links.timeout().saturating_sub(started.elapsed())),
            }
        }
        self.post(addr, "/internal/v2/read", request, within).await.map_err(|err| err.to_string())
    }

    /// POSTs `body` to the owner at `addr` (taking at most `within`, when given, else
    /// the client's timeout): its answer; its refusal as the client's error
    /// (`not_owner` for a 409, `shard_failed` with the owner's words); or why it
    /// could not be reached.
    pub(crate) async fn post<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &Req,
        within: Option<Duration>,
    ) -> Result<Result<Resp, ApiError>, reqwest::Error> {
        let mut post = self.client.post(format!("http://{addr}{path}")).json(body);
        if let Some(within) = within {
            post = post.timeout(within);
        }
        let response = post.send().await?;
        let status = response.status();
        if status.is_success() {
            let answer = response.json::<Resp>().await;
            return Ok(answer.map_err(|err| ApiError::unavailable(format!("{addr}: bad answer: {err}"))));
        }
        if status == reqwest::StatusCode::CONFLICT {
            return Ok(Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                "not_owner",
                format!("{addr} no longer owns it"),
            )));
        }
        let text = response.text().await.unwrap_or_default();
        Ok(Err(match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(body) if body["error"]["code"] == "shard_failed" => {
                ApiError::shard_failed(body["error"]["message"].as_str().unwrap_or("the shard failed").to_string())
            }
            _ => ApiError::unavailable(format!("{addr} failed ({status}): {text}")),
        }))
    }
}

fn owner_name(shard: u32) -> String {
    if shard == ShardOwner::GRAPH {
        "the graph (tally-graph)".into()
    } else {
        format!("shard {shard}")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::routing::{get, post};
    use axum::Json;

    use super::*;

    /// A counter of an earlier release: no read link (404), reads over JSON, each
    /// answered with the request's clock. Its address and how many links were asked.
    async fn counter_without_links() -> (String, Arc<AtomicUsize>) {
        let asked = Arc::new(AtomicUsize::new(0));
        let counted = asked.clone();
        let app = axum::Router::new()
            .route(
                tally_shared::read_link::PATH,
                get(move || async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    axum::http::StatusCode::NOT_FOUND
                }),
            )
            .route("/internal/v2/read", post(|Json(request): Json<ReadRequest>| async move { Json(answer(&request)) }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (addr, asked)
    }

    fn answer(request: &ReadRequest) -> FreshReadResponse {
        FreshReadResponse {
            shards: vec![ShardOutcome::Failed { message: format!("read at {}", request.now_ms) }],
            as_of: vec![None],
        }
    }

    fn fanout(links: Option<Links>) -> Fanout {
        Fanout {
            owners: Arc::default(),
            client: reqwest::Client::new(),
            links,
            shards: 4,
            seen: Default::default(),
            owner_wait: Duration::from_millis(100),
            ends: None,
            token_waits: crate::metrics::Metrics::new(&prometheus::Registry::new()).token_wait_seconds,
            standbys: Arc::default(),
        }
    }

    #[tokio::test]
    async fn a_counter_without_links_is_read_over_json_and_so_is_every_counter_with_links_off() {
        let (addr, asked) = counter_without_links().await;
        let request = |now_ms| ReadRequest { now_ms, shards: Vec::new() };
        let with_links = fanout(Some(Links::new(Duration::from_secs(5))));
        for now in [1, 2] {
            assert_eq!(with_links.ask(&addr, &request(now)).await.unwrap().unwrap(), answer(&request(now)));
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1, "the refusal is remembered");
        let without = fanout(None);
        assert_eq!(without.ask(&addr, &request(3)).await.unwrap().unwrap(), answer(&request(3)));
        assert_eq!(asked.load(Ordering::SeqCst), 1, "links off: never asked");
    }
}
