//! The internal read API `tally-query` calls: one request per shard, answered from
//! one snapshot. A shard this process does not own answers 409 `not_owner`, which
//! tells the caller to look up the owner again; a failed shard answers 503
//! `shard_failed`. `POST /internal/v1/shards/{shard}/skip` is `tally shards skip`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::json;
use std::time::Duration;

use axum::extract::Path;
use serde::{Deserialize, Serialize};
use tally_shared::wire::{ShardMetricsRequest, ShardReadRequest, ShardReadResponse};

use crate::metrics::Metrics;
use crate::shards::{Shards, SkipRequest};
use crate::store::ShardStore;

#[derive(Clone)]
pub struct ReadState {
    pub shards: Arc<Shards>,
    pub metrics: Metrics,
}

pub fn router(state: ReadState) -> Router {
    Router::new()
        .route("/internal/v1/read", post(read))
        .route("/internal/v1/metrics", post(metrics))
        .route("/internal/v1/shards/{shard}/skip", post(skip))
        .with_state(state)
}

/// The body of a skip request.
#[derive(Debug, Serialize, Deserialize)]
pub struct SkipBody {
    /// The offset of the failed record (as `/readyz` names it).
    pub offset: i64,
    /// Why: written into the dead letter.
    pub reason: String,
}

/// How long a skip waits for the consumer thread.
const SKIP_WAIT: Duration = Duration::from_secs(60);

fn error(status: StatusCode, code: &str, message: String) -> Response {
    (status, Json(json!({"error": {"code": code, "message": message}}))).into_response()
}

fn not_owner(shard: u32) -> Response {
    error(StatusCode::CONFLICT, "not_owner", format!("shard {shard} is not owned by this counter"))
}

/// The store of `shard` when it serves reads; the answer to give otherwise.
fn serving(state: &ReadState, shard: u32) -> Result<Arc<ShardStore>, Response> {
    if let Some(failure) = state.shards.failure(shard) {
        return Err(error(StatusCode::SERVICE_UNAVAILABLE, "shard_failed", failure.describe(shard)));
    }
    state.shards.get(shard).filter(|s| s.serving()).ok_or_else(|| not_owner(shard))
}

async fn read(State(state): State<ReadState>, Json(request): Json<ShardReadRequest>) -> Response {
    let store = match serving(&state, request.shard) {
        Ok(store) => store,
        Err(response) => return response,
    };
    state.metrics.reads.inc_by(request.queries.len() as u64);
    let answered = tokio::task::spawn_blocking(move || store.read(&request.queries, request.now_ms)).await;
    match answered {
        Ok(Ok(answers)) => Json(ShardReadResponse { answers }).into_response(),
        Ok(Err(err)) => error(StatusCode::INTERNAL_SERVER_ERROR, "storage", err.to_string()),
        Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()),
    }
}

async fn metrics(State(state): State<ReadState>, Json(request): Json<ShardMetricsRequest>) -> Response {
    let store = match serving(&state, request.shard) {
        Ok(store) => store,
        Err(response) => return response,
    };
    let answered =
        tokio::task::spawn_blocking(move || store.metrics(&request.entity, request.after.as_deref(), request.limit))
            .await;
    match answered {
        Ok(Ok(page)) => Json(page).into_response(),
        Ok(Err(err)) => error(StatusCode::INTERNAL_SERVER_ERROR, "storage", err.to_string()),
        Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()),
    }
}

async fn skip(State(state): State<ReadState>, Path(shard): Path<u32>, Json(body): Json<SkipBody>) -> Response {
    let Some(failure) = state.shards.failure(shard) else {
        return error(StatusCode::CONFLICT, "not_failed", format!("shard {shard} has not failed on this counter"));
    };
    if failure.offset != Some(body.offset) || failure.record.is_none() {
        return error(StatusCode::CONFLICT, "not_this_record", failure.describe(shard));
    }
    if body.reason.trim().is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_reason",
            "a reason is required: it goes into the dead letter".into(),
        );
    }
    let (done, answer) = tokio::sync::oneshot::channel();
    state.shards.request_skip(SkipRequest { shard, offset: body.offset, reason: body.reason, done });
    match tokio::time::timeout(SKIP_WAIT, answer).await {
        Ok(Ok(Ok(()))) => {
            Json(json!({"shard": shard, "skipped": body.offset, "resumed_at": body.offset + 1})).into_response()
        }
        Ok(Ok(Err(message))) => error(StatusCode::CONFLICT, "skip_failed", message),
        Ok(Err(_)) => error(StatusCode::SERVICE_UNAVAILABLE, "stopping", "the counter is stopping".into()),
        Err(_) => {
            error(StatusCode::GATEWAY_TIMEOUT, "timeout", format!("the skip was not carried out within {SKIP_WAIT:?}"))
        }
    }
}
