//! The jobs console's data (`/v1/jobs…`): tally-query finds the dequeue brokers
//! itself (it follows their heartbeats on `queue-brokers`) and asks them. `GET
//! /v1/jobs` merges every live broker's queue stats — each partition's numbers from
//! the broker that owns it; a broker that does not answer is listed as unreachable
//! and the others still shown — with each queue's undecided dead jobs (counted at
//! most every [`DEAD_TOTALS_TTL`]); the dead-job listing, requeue and discard go to
//! the first live broker (so decisions about one job meet in one process). These
//! routes sit behind tally-query's own token like the rest of `/v1`; the brokers'
//! token comes from the client in `X-Broker-Authorization` and is passed on as the
//! broker's `Authorization` — tally-query holds no broker credentials of its own.
//! A broker's 401 becomes `broker_unauthorized`, so a client can tell which token
//! is missing.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::future::join_all;
use serde::Serialize;
use tally_core::assignment::Member;
use tally_core::jobs::api::{
    KeyInFlight, PartitionInfo, QueueStats, RunningJob, RunningJobs, ScheduleInfo, MAX_RUNNING_LISTED, TOP_KEYS,
};
use tally_core::jobs::limits::Limits;
use tally_shared::kafka::now_ms;
use tally_shared::lock::lock;
use tally_shared::membership::Membership;

use crate::api::{json_response, ApiState};
use crate::error::ApiError;

/// How long a queue's count of undecided dead jobs is reused (counting reads the
/// dead topic and the decisions to their ends).
pub const DEAD_TOTALS_TTL: Duration = Duration::from_secs(10);

/// How long a broker may take to list its stats or count a queue's dead jobs: a
/// broker slower than this is shown as unreachable in the overview.
const OVERVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a dead-job listing or decision may take (it reads two topics to
/// their ends and produces records).
const DEAD_JOBS_TIMEOUT: Duration = Duration::from_secs(60);

/// The header that carries the brokers' bearer token.
pub const BROKER_AUTHORIZATION: &str = "x-broker-authorization";

/// What [`Brokers::dead_totals`]' lock guards ([`tally_shared::lock`]).
const DEAD_TOTALS: &str = "the dead-job totals";

/// The live dequeue brokers, as their heartbeats say.
pub struct Brokers {
    pub membership: Arc<Membership>,
    pub timeout_ms: u64,
    /// queue → (when counted, undecided dead jobs).
    dead_totals: Mutex<HashMap<String, (Instant, usize)>>,
}

impl Brokers {
    pub fn new(membership: Arc<Membership>, timeout_ms: u64) -> Self {
        Self { membership, timeout_ms, dead_totals: Mutex::default() }
    }

    pub fn live(&self) -> Vec<Member> {
        self.membership.live(now_ms(), self.timeout_ms)
    }

    fn cached_dead_total(&self, queue: &str) -> Option<usize> {
        let totals = lock(&self.dead_totals, DEAD_TOTALS);
        totals.get(queue).filter(|(at, _)| at.elapsed() < DEAD_TOTALS_TTL).map(|(_, total)| *total)
    }

    fn cache_dead_total(&self, queue: &str, total: usize) {
        let mut totals = lock(&self.dead_totals, DEAD_TOTALS);
        totals.insert(queue.to_string(), (Instant::now(), total));
    }
}

#[derive(Debug, Serialize)]
struct BrokerView {
    instance: String,
    addr: String,
    heard_at_ms: Option<i64>,
    /// Why its stats are missing, when it did not answer.
    error: Option<String>,
}

#[derive(Debug, Serialize, PartialEq)]
struct QueueView {
    queue: String,
    /// Ready and delayed in the owners' buffers plus not yet fetched.
    depth: i64,
    ready: usize,
    delayed: usize,
    /// Of the delayed, those waiting for a retry.
    retrying: usize,
    in_flight: usize,
    /// Records not yet fetched by the owners (consumer lag).
    lag: i64,
    /// How long the longest-waiting ready job has waited, over the owners.
    oldest_ready_age_ms: Option<i64>,
    /// Dead jobs not requeued or discarded yet.
    dead: Option<usize>,
    /// Dequeues per second over all brokers, recently.
    rate: f64,
    rate_limit_per_sec: Option<u32>,
    fifo: bool,
    /// Its concurrency limits (empty: none).
    #[serde(skip_serializing_if = "Limits::is_empty")]
    limits: Limits,
    /// The concurrency keys with the most jobs in flight over every owner.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_keys: Vec<KeyInFlight>,
    /// Its schedules and their next runs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    schedules: Vec<ScheduleInfo>,
    /// Jobs cancelled by operators, over every broker since it started.
    cancelled: u64,
    /// Jobs replaced by a newer one of their unique key, over every broker since
    /// it started.
    replaced: u64,
    partitions: Vec<PartitionInfo>,
}

#[derive(Debug, Serialize)]
struct JobsOverview {
    at_ms: i64,
    brokers: Vec<BrokerView>,
    queues: Vec<QueueView>,
}

/// Every broker's stats of its queues → one view per queue: each partition as its
/// owner reports it (as any broker does when no broker owns it), rates summed.
fn merge(answers: Vec<Vec<QueueStats>>) -> Vec<QueueView> {
    let mut queues: BTreeMap<String, (QueueStats, f64)> = BTreeMap::new();
    let mut ended: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut keys: BTreeMap<String, BTreeMap<String, KeyInFlight>> = BTreeMap::new();
    for stats in answers.into_iter().flatten() {
        let rate = stats.rate;
        let (cancelled, replaced) = ended.entry(stats.queue.clone()).or_default();
        (*cancelled, *replaced) = (*cancelled + stats.cancelled, *replaced + stats.replaced);
        // A key lives in one partition: its owner's count is the count.
        let of_queue = keys.entry(stats.queue.clone()).or_default();
        for key in &stats.top_keys {
            of_queue.insert(key.key.clone(), key.clone());
        }
        let (merged, rates) = queues.entry(stats.queue.clone()).or_insert_with(|| (stats.clone(), 0.0));
        *rates += rate;
        for partition in stats.partitions {
            match merged.partitions.iter_mut().find(|p| p.partition == partition.partition) {
                Some(known) if partition.owned_here && !known.owned_here => *known = partition,
                Some(_) => {}
                None => merged.partitions.push(partition),
            }
        }
    }
    queues
        .into_values()
        .map(|(stats, rate)| {
            let mut partitions = stats.partitions;
            partitions.sort_by_key(|p| p.partition);
            let owned = || partitions.iter().filter(|p| p.owned_here);
            let (ready, delayed) = (owned().map(|p| p.ready).sum(), owned().map(|p| p.delayed).sum::<usize>());
            let lag = owned().map(|p| p.lag).sum::<i64>();
            let mut top_keys: Vec<KeyInFlight> = keys.remove(&stats.queue).unwrap_or_default().into_values().collect();
            top_keys.sort_by(|a, b| b.in_flight.cmp(&a.in_flight).then_with(|| a.key.cmp(&b.key)));
            top_keys.truncate(TOP_KEYS);
            let (cancelled, replaced) = ended.get(&stats.queue).copied().unwrap_or_default();
            QueueView {
                queue: stats.queue,
                depth: (ready + delayed) as i64 + lag,
                ready,
                delayed,
                retrying: owned().map(|p| p.retrying).sum(),
                in_flight: owned().map(|p| p.in_flight).sum(),
                lag,
                oldest_ready_age_ms: owned().filter_map(|p| p.oldest_ready_age_ms).max(),
                dead: None,
                rate,
                rate_limit_per_sec: stats.rate_limit_per_sec,
                fifo: stats.fifo,
                limits: stats.limits,
                top_keys,
                schedules: stats.schedules,
                cancelled,
                replaced,
                partitions,
            }
        })
        .collect()
}

/// Sends a request to the broker at `addr` with the client's `Authorization`:
/// the broker's status and body.
async fn ask(
    state: &ApiState,
    addr: &str,
    (method, path, timeout): (Method, &str, Duration),
    headers: &HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Bytes), ApiError> {
    let mut request = state.fanout.client.request(method, format!("http://{addr}{path}")).timeout(timeout);
    if let Some(authorization) = headers.get(BROKER_AUTHORIZATION) {
        request = request.header(axum::http::header::AUTHORIZATION, authorization);
    }
    if !body.is_empty() {
        request = request.header(axum::http::header::CONTENT_TYPE, "application/json").body(body);
    }
    let unreachable = |err: reqwest::Error| {
        ApiError::new(StatusCode::BAD_GATEWAY, "broker_unreachable", format!("dequeue broker at {addr}: {err}"))
    };
    let response = request.send().await.map_err(unreachable)?;
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if status == StatusCode::UNAUTHORIZED {
        let message = "the dequeue broker refused: dead jobs need the operator token (X-Broker-Authorization)";
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "broker_unauthorized", message));
    }
    Ok((status, response.bytes().await.map_err(unreachable)?))
}

fn no_broker() -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_broker", "no dequeue broker is running (tally-broker)")
}

/// A broker's answer passed on as it is (a 404 for an unknown queue is the
/// broker's own JSON error).
fn passed_on(status: StatusCode, body: Bytes) -> Response {
    (status, [(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `GET /v1/jobs`: the brokers and every queue they serve.
pub async fn overview(State(state): State<Arc<ApiState>>, headers: HeaderMap) -> Result<Response, ApiError> {
    let live = state.brokers.live();
    // Stats with tally-query's own (cluster) token: a caller's operator token is for
    // the dead jobs only, and a stale one must not hide the queues.
    let own = HeaderMap::new();
    let asked =
        join_all(live.iter().map(|broker| {
            ask(&state, &broker.addr, (Method::GET, "/v1/queues", OVERVIEW_TIMEOUT), &own, Bytes::new())
        }))
        .await;
    let mut answers = Vec::new();
    let mut brokers = Vec::new();
    for (member, answer) in live.iter().zip(asked) {
        let stats = match answer {
            Err(refused) if refused.code == "broker_unauthorized" => return Err(refused),
            Err(unreachable) => Err(unreachable.message),
            Ok((status, body)) if status.is_success() => {
                let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                serde_json::from_value::<Vec<QueueStats>>(parsed["queues"].clone())
                    .map_err(|err| format!("an answer this build cannot read: {err}"))
            }
            Ok((status, body)) => Err(format!("{status}: {}", String::from_utf8_lossy(&body))),
        };
        let error = stats.as_ref().err().cloned();
        answers.extend(stats.ok());
        brokers.push(BrokerView {
            heard_at_ms: state.brokers.membership.heard_at(&member.instance),
            instance: member.instance.clone(),
            addr: member.addr.clone(),
            error,
        });
    }
    let mut queues = merge(answers);
    if let Some(broker) = brokers.iter().find(|broker| broker.error.is_none()) {
        let (state, headers) = (&state, &headers);
        let totals = join_all(queues.iter().map(|queue| async move {
            if let Some(total) = state.brokers.cached_dead_total(&queue.queue) {
                return Some(total);
            }
            let path = format!("/v1/queues/{}/dead?limit=1", encode(&queue.queue));
            let call = (Method::GET, path.as_str(), OVERVIEW_TIMEOUT);
            let (status, body) = ask(state, &broker.addr, call, headers, Bytes::new()).await.ok()?;
            let parsed: serde_json::Value = serde_json::from_slice(&body).ok().filter(|_| status == StatusCode::OK)?;
            let total = parsed["total"].as_u64()? as usize;
            state.brokers.cache_dead_total(&queue.queue, total);
            Some(total)
        }))
        .await;
        for (queue, total) in queues.iter_mut().zip(totals) {
            queue.dead = total;
        }
    }
    json_response(&JobsOverview { at_ms: now_ms(), brokers, queues })
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunningParams {
    limit: Option<usize>,
}

/// `GET /v1/jobs/{queue}/running?limit=…`: the jobs in flight over every live
/// broker (each lists the partitions it serves), the first `limit` (100 by
/// default) by partition and offset; brokers that did not answer are named.
pub async fn running(
    State(state): State<Arc<ApiState>>,
    Path(queue): Path<String>,
    params: Result<axum::extract::Query<RunningParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let axum::extract::Query(params) =
        params.map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "invalid_parameter", "parameters: limit only"))?;
    let limit = params.limit.unwrap_or(100);
    if !(1..=MAX_RUNNING_LISTED).contains(&limit) {
        let message = format!("limit: must be 1-{MAX_RUNNING_LISTED}");
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_limit", message));
    }
    let live = state.brokers.live();
    if live.is_empty() {
        return Err(no_broker());
    }
    let path = format!("/v1/queues/{}/running?limit={limit}", encode(&queue));
    let own = HeaderMap::new();
    let asked = join_all(
        live.iter().map(|broker| ask(&state, &broker.addr, (Method::GET, &path, OVERVIEW_TIMEOUT), &own, Bytes::new())),
    )
    .await;
    let (mut listings, mut unreachable) = (Vec::new(), Vec::new());
    for (broker, answer) in live.iter().zip(asked) {
        match answer {
            Ok((status, body)) if status.is_success() => match serde_json::from_slice::<RunningJobs>(&body) {
                Ok(listing) => listings.push(listing),
                Err(err) => unreachable.push(format!("{}: an answer this build cannot read: {err}", broker.addr)),
            },
            // Every broker knows every declared queue: an unknown one is the caller's (a
            // 404 without that code is an older broker without the route).
            Ok((status, body))
                if status == StatusCode::NOT_FOUND && error_code(&body) == Some("unknown_queue".into()) =>
            {
                return Ok(passed_on(status, body))
            }
            Ok((status, body)) => {
                unreachable.push(format!("{}: {status}: {}", broker.addr, String::from_utf8_lossy(&body)))
            }
            Err(err) => unreachable.push(err.message),
        }
    }
    let mut merged = merge_running(listings, limit);
    merged["unreachable"] = unreachable.into();
    json_response(&merged)
}

/// The `error.code` of a JSON error body.
fn error_code(body: &[u8]) -> Option<String> {
    let parsed: serde_json::Value = serde_json::from_slice(body).ok()?;
    parsed["error"]["code"].as_str().map(str::to_string)
}

/// Brokers' listings of the jobs in flight → the first `limit` by partition and
/// offset, and the total.
fn merge_running(listings: Vec<RunningJobs>, limit: usize) -> serde_json::Value {
    let total: usize = listings.iter().map(|listing| listing.total).sum();
    let mut running: Vec<RunningJob> = listings.into_iter().flat_map(|listing| listing.running).collect();
    running.sort_by_key(|job| (job.partition, job.offset));
    running.truncate(limit);
    serde_json::json!({ "running": running, "total": total })
}

/// `GET /v1/jobs/{queue}/dead`: passed to a live broker as it came.
pub async fn dead(
    State(state): State<Arc<ApiState>>,
    Path(queue): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let mut target = format!("/v1/queues/{}/dead", encode(&queue));
    if let Some(query) = query {
        target.push('?');
        target.push_str(&query);
    }
    pass_on(&state, Method::GET, &target, &headers, Bytes::new()).await
}

/// `POST /v1/jobs/{queue}/cancel`: passed to a live broker as it came (body and
/// `Authorization`: the operators' token).
pub async fn cancel(
    State(state): State<Arc<ApiState>>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let target = format!("/v1/queues/{}/cancel", encode(&queue));
    pass_on(&state, Method::POST, &target, &headers, body).await
}

/// `POST /v1/jobs/{queue}/dead/requeue|discard`: passed to a live broker as it
/// came (body and `Authorization`).
pub async fn decide(
    State(state): State<Arc<ApiState>>,
    Path((queue, action)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    if action != "requeue" && action != "discard" {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", "dead jobs are requeued or discarded"));
    }
    let target = format!("/v1/queues/{}/dead/{action}", encode(&queue));
    let answer = pass_on(&state, Method::POST, &target, &headers, body).await;
    // The next overview counts this queue's dead jobs again.
    lock(&state.brokers.dead_totals, DEAD_TOTALS).remove(&queue);
    answer
}

async fn pass_on(
    state: &ApiState,
    method: Method,
    target: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let broker = state.brokers.live().into_iter().next().ok_or_else(no_broker)?;
    let (status, body) = ask(state, &broker.addr, (method, target, DEAD_JOBS_TIMEOUT), headers, body).await?;
    Ok(passed_on(status, body))
}

fn encode(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(partition: i32, owner: &str, owned_here: bool, ready: usize) -> PartitionInfo {
        let oldest_ready_age_ms = (ready > 0).then_some(ready as i64 * 100);
        PartitionInfo {
            partition,
            owner: Some(owner.into()),
            owned_here,
            ready,
            delayed: 1,
            retrying: 1,
            in_flight: 2,
            lag: 3,
            oldest_ready_age_ms,
            slots: Some(5),
            held_until: None,
        }
    }

    #[test]
    fn running_jobs_of_every_broker_are_listed_by_partition_and_offset() {
        let job = |partition: i32, offset: i64| RunningJob {
            id: format!("j{partition}-{offset}"),
            partition,
            offset,
            attempt: 1,
            lease_deadline_ms: 1_000 + offset,
            concurrency_key: None,
            priority: None,
            cancelled: partition == 2,
        };
        // Each broker lists its own partitions' first `limit`, with its total.
        let a = RunningJobs { running: vec![job(2, 5), job(2, 9)], total: 4 };
        let b = RunningJobs { running: vec![job(0, 7), job(1, 3)], total: 2 };
        let merged = merge_running(vec![a, b], 3);
        let want = serde_json::json!({ "running": [job(0, 7), job(1, 3), job(2, 5)], "total": 6 });
        assert_eq!(merged, want);
        assert_eq!(merged["running"][2]["cancelled"], true);
    }

    #[test]
    fn each_partition_comes_from_its_owner() {
        let stats = |rate: f64, partitions: Vec<PartitionInfo>| QueueStats {
            queue: "emails".into(),
            rate,
            partitions,
            ..Default::default()
        };
        let key = |key: &str, in_flight| KeyInFlight { key: key.into(), in_flight, limit: Some(2) };
        let mut a = stats(1.5, vec![partition(0, "a", true, 10), partition(1, "b", false, 0)]);
        (a.top_keys, a.cancelled, a.replaced) = (vec![key("t1", 2), key("t3", 1)], 1, 4);
        let mut b = stats(2.0, vec![partition(0, "a", false, 0), partition(1, "b", true, 20)]);
        (b.top_keys, b.cancelled, b.replaced) = (vec![key("t2", 2)], 2, 3);
        let merged = merge(vec![vec![a], vec![b]]);
        assert_eq!(
            merged,
            vec![QueueView {
                queue: "emails".into(),
                depth: 10 + 20 + 2 + 6,
                ready: 30,
                delayed: 2,
                retrying: 2,
                in_flight: 4,
                lag: 6,
                oldest_ready_age_ms: Some(2_000),
                dead: None,
                rate: 3.5,
                rate_limit_per_sec: None,
                fifo: false,
                limits: Limits::default(),
                top_keys: vec![key("t1", 2), key("t2", 2), key("t3", 1)],
                schedules: Vec::new(),
                cancelled: 3,
                replaced: 7,
                partitions: vec![partition(0, "a", true, 10), partition(1, "b", true, 20)],
            }]
        );
    }
}
