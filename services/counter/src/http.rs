//! The internal read API `tally-query` calls: one request per shard, answered from
//! one snapshot. A shard this process does not own answers 409 `not_owner`, which
//! tells the caller to look up the owner again.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::json;
use tally_shared::wire::{ShardMetricsRequest, ShardReadRequest, ShardReadResponse};

use crate::metrics::Metrics;
use crate::shards::Shards;

#[derive(Clone)]
pub struct ReadState {
    pub shards: Arc<Shards>,
    pub metrics: Metrics,
}

pub fn router(state: ReadState) -> Router {
    Router::new().route("/internal/v1/read", post(read)).route("/internal/v1/metrics", post(metrics)).with_state(state)
}

fn error(status: StatusCode, code: &str, message: String) -> Response {
    (status, Json(json!({"error": {"code": code, "message": message}}))).into_response()
}

fn not_owner(shard: u32) -> Response {
    error(StatusCode::CONFLICT, "not_owner", format!("shard {shard} is not owned by this counter"))
}

async fn read(State(state): State<ReadState>, Json(request): Json<ShardReadRequest>) -> Response {
    let Some(store) = state.shards.get(request.shard).filter(|s| s.serving()) else { return not_owner(request.shard) };
    state.metrics.reads.inc_by(request.queries.len() as u64);
    let answered = tokio::task::spawn_blocking(move || store.read(&request.queries, request.now_ms)).await;
    match answered {
        Ok(Ok(answers)) => Json(ShardReadResponse { answers }).into_response(),
        Ok(Err(err)) => error(StatusCode::INTERNAL_SERVER_ERROR, "storage", err.to_string()),
        Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()),
    }
}

async fn metrics(State(state): State<ReadState>, Json(request): Json<ShardMetricsRequest>) -> Response {
    let Some(store) = state.shards.get(request.shard).filter(|s| s.serving()) else { return not_owner(request.shard) };
    let answered =
        tokio::task::spawn_blocking(move || store.metrics(&request.entity, request.after.as_deref(), request.limit))
            .await;
    match answered {
        Ok(Ok(page)) => Json(page).into_response(),
        Ok(Err(err)) => error(StatusCode::INTERNAL_SERVER_ERROR, "storage", err.to_string()),
        Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()),
    }
}
