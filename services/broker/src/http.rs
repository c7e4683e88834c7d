//! The worker API: dequeue (long poll), ack, nack, extend, the queue
//! stats, and dead jobs for operators ([`crate::dead`]). Every error is a JSON `{"error":{"code","message"}}` with a 4xx status.

#![allow(clippy::result_large_err)] // handlers return ready responses as errors

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tally_core::jobs::api::{
    AckRequest, AckResponse, DequeueRequest, DequeueResponse, ExtendRequest, NackRequest, MAX_DEQUEUE, MAX_ERROR_BYTES,
    MAX_RUNNING_LISTED, MAX_WAIT_MS,
};
use tally_shared::auth::{require, AuthConfig, Role};
use tally_shared::http::ApiError;
use tally_shared::kafka::now_ms;

use crate::state::{Broker, QueueRuntime};

#[derive(Clone)]
pub struct ApiState {
    pub broker: Arc<Broker>,
    pub auth: AuthConfig,
    pub dead: Arc<tally_shared::dead_jobs::DeadJobs>,
    pub names: tally_shared::kafka::TopicNames,
    /// For asking the other owners of a queue's partitions (cancellations).
    pub http: reqwest::Client,
}

/// Stats for workers, operators and tally-query (the cluster token); dequeue, ack,
/// nack and extend for workers; dead jobs and cancellations for operators.
pub fn router(state: ApiState) -> Router {
    let auth = &state.auth;
    let stats = Router::new().route("/v1/queues", get(list)).route("/v1/queues/{queue}", get(stats));
    let work = Router::new()
        .route("/v1/queues/{queue}/dequeue", post(dequeue))
        .route("/v1/queues/{queue}/ack", post(ack))
        .route("/v1/queues/{queue}/nack", post(nack))
        .route("/v1/queues/{queue}/extend", post(extend));
    let dead = Router::new()
        .route("/v1/queues/{queue}/dead", get(crate::dead::list))
        .route("/v1/queues/{queue}/dead/requeue", post(crate::dead::requeue))
        .route("/v1/queues/{queue}/dead/discard", post(crate::dead::discard))
        .route("/v1/queues/{queue}/cancel", post(crate::cancel::cancel))
        .route("/v1/queues/{queue}/held/cancel", post(crate::cancel::held));
    let stats =
        stats.route("/v1/queues/{queue}/unique/{key}", get(unique)).route("/v1/queues/{queue}/running", get(running));
    require(stats, auth, &[Role::Worker, Role::Operator, Role::Cluster])
        .merge(require(work, auth, &[Role::Worker]))
        .merge(require(dead, auth, &[Role::Operator]))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20))
        .with_state(state)
}

pub(crate) fn error(status: StatusCode, code: &'static str, message: impl Into<String>) -> Response {
    ApiError::new(status, code, message).into_response()
}

pub(crate) fn find(state: &ApiState, queue: &str) -> Result<Arc<QueueRuntime>, Response> {
    state.broker.queue(queue).ok_or_else(|| {
        let message = format!(
            "no queue named {queue:?} is declared here: add a [[queue]] entry to the declarations file \
                 (broker.declarations) and run `tally topics apply` with the same config"
        );
        error(StatusCode::NOT_FOUND, "unknown_queue", message)
    })
}

pub(crate) fn body<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, Response> {
    body.map(|Json(b)| b).map_err(|err| error(StatusCode::BAD_REQUEST, "invalid_body", err.body_text()))
}

async fn list(State(state): State<ApiState>) -> Response {
    let queues: Vec<_> = state.broker.queues().iter().map(|q| state.broker.stats(q)).collect();
    Json(json!({ "queues": queues })).into_response()
}

async fn stats(State(state): State<ApiState>, Path(queue): Path<String>) -> Response {
    match find(&state, &queue) {
        Ok(queue) => Json(state.broker.stats(&queue)).into_response(),
        Err(response) => response,
    }
}

/// Whether a unique key is held in the partition this broker serves for it:
/// `{"partition", "held_until"}` (none: free; `i64::MAX`: until a job finishes),
/// 404 `not_owner` when another broker serves it.
async fn unique(State(state): State<ApiState>, Path((queue, key)): Path<(String, String)>) -> Response {
    let queue = match find(&state, &queue) {
        Ok(queue) => queue,
        Err(response) => return response,
    };
    let partition = tally_core::jobs::limits::partition_of(&key, queue.decl().partitions);
    match state.broker.unique_held_until(&queue, partition, &key) {
        Some(held_until) => Json(json!({"partition": partition, "held_until": held_until})).into_response(),
        None => error(StatusCode::NOT_FOUND, "not_owner", format!("partition {partition} is not served here")),
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RunningParams {
    limit: Option<usize>,
}

/// `GET /v1/queues/{queue}/running?limit=…`: the jobs in flight of the partitions
/// served here, the first `limit` (100 by default) by partition and offset.
async fn running(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    params: Result<axum::extract::Query<RunningParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let queue = match find(&state, &queue) {
        Ok(queue) => queue,
        Err(response) => return response,
    };
    let Ok(axum::extract::Query(params)) = params else {
        return error(StatusCode::BAD_REQUEST, "invalid_parameter", "parameters: limit only");
    };
    let limit = params.limit.unwrap_or(100);
    if !(1..=MAX_RUNNING_LISTED).contains(&limit) {
        return error(StatusCode::BAD_REQUEST, "invalid_limit", format!("limit: must be 1-{MAX_RUNNING_LISTED}"));
    }
    Json(state.broker.running(&queue, limit)).into_response()
}

async fn dequeue(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    request: Result<Json<DequeueRequest>, JsonRejection>,
) -> Response {
    let (queue, request) = match (find(&state, &queue), body(request)) {
        (Ok(queue), Ok(request)) => (queue, request),
        (Err(response), _) | (_, Err(response)) => return response,
    };
    if !(1..=MAX_DEQUEUE).contains(&request.max) {
        return error(StatusCode::BAD_REQUEST, "invalid_max", format!("max: must be 1-{MAX_DEQUEUE}"));
    }
    if request.wait_ms > MAX_WAIT_MS {
        return error(StatusCode::BAD_REQUEST, "invalid_wait", format!("wait_ms: must be at most {MAX_WAIT_MS}"));
    }
    let lease_ms = request.lease_ms.unwrap_or(queue.decl().lease_ms);
    if let Err(response) = check_lease_ms(&queue, lease_ms) {
        return response;
    }
    let deadline = Instant::now() + Duration::from_millis(request.wait_ms);
    loop {
        let started = Instant::now();
        let notified = queue.changed.notified();
        let jobs = state.broker.dequeue(&queue, request.max, lease_ms, now_ms());
        if !jobs.is_empty() {
            state
                .broker
                .metrics
                .dequeue_seconds
                .with_label_values(&[&queue.name])
                .observe(started.elapsed().as_secs_f64());
            return Json(DequeueResponse { jobs }).into_response();
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Json(DequeueResponse { jobs }).into_response();
        }
        // New jobs notify; delayed jobs and rate-limit tokens come with time: after
        // either, notified or timed out, it looks again.
        tokio::time::timeout(left.min(Duration::from_millis(50)), notified).await.ok();
    }
}

async fn ack(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    request: Result<Json<AckRequest>, JsonRejection>,
) -> Response {
    let (queue, request) = match (find(&state, &queue), body(request)) {
        (Ok(queue), Ok(request)) => (queue, request),
        (Err(response), _) | (_, Err(response)) => return response,
    };
    if request.leases.len() > MAX_DEQUEUE {
        return error(StatusCode::BAD_REQUEST, "too_many_leases", format!("leases: at most {MAX_DEQUEUE}"));
    }
    let unknown = state.broker.ack(&queue, &request.leases);
    Json(AckResponse { acked: request.leases.len() - unknown.len(), unknown }).into_response()
}

/// A lease asked at dequeue or extend: positive, and at most the queue's
/// `max_lease_ms`.
fn check_lease_ms(queue: &QueueRuntime, lease_ms: i64) -> Result<(), Response> {
    let max_lease_ms = queue.decl().max_lease_ms;
    if (1..=max_lease_ms).contains(&lease_ms) {
        return Ok(());
    }
    Err(error(
        StatusCode::BAD_REQUEST,
        "invalid_lease",
        format!("lease_ms: must be 1-{max_lease_ms} (the queue's max_lease_ms)"),
    ))
}

fn unknown_lease() -> Response {
    error(StatusCode::CONFLICT, "unknown_lease", "lease unknown, expired, or held by another broker")
}

async fn nack(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    request: Result<Json<NackRequest>, JsonRejection>,
) -> Response {
    let (queue, request) = match (find(&state, &queue), body(request)) {
        (Ok(queue), Ok(request)) => (queue, request),
        (Err(response), _) | (_, Err(response)) => return response,
    };
    let max_retry_ms = queue.decl().max_retry_ms();
    if request.retry_in_ms.is_some_and(|ms| !(0..=max_retry_ms).contains(&ms)) {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_retry",
            format!("retry_in_ms: must be 0-{max_retry_ms} (the queue's max_retry_ms, within its retention)"),
        );
    }
    if request.error.as_ref().is_some_and(|text| text.len() > MAX_ERROR_BYTES) {
        return error(
            StatusCode::BAD_REQUEST,
            "error_too_long",
            format!("error: at most {MAX_ERROR_BYTES} bytes (cut it; a dead job keeps its last error)"),
        );
    }
    let reason = request.error.as_deref().unwrap_or("nacked by the worker");
    match state.broker.nack(&queue, &request.lease, request.retry_in_ms, reason) {
        Ok(()) => Json(json!({"nacked": true})).into_response(),
        Err(_) => unknown_lease(),
    }
}

async fn extend(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    request: Result<Json<ExtendRequest>, JsonRejection>,
) -> Response {
    let (queue, request) = match (find(&state, &queue), body(request)) {
        (Ok(queue), Ok(request)) => (queue, request),
        (Err(response), _) | (_, Err(response)) => return response,
    };
    if let Err(response) = check_lease_ms(&queue, request.lease_ms) {
        return response;
    }
    match state.broker.extend(&queue, &request.lease, request.lease_ms) {
        Ok(extended) => {
            Json(json!({"lease_deadline": extended.deadline, "cancelled": extended.cancelled})).into_response()
        }
        Err(_) => unknown_lease(),
    }
}
