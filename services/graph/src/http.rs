//! The internal graph API `tally-query` calls: one page of an entity's direct
//! neighbours in the current graph, sorted, after the last name of the previous page;
//! and an entity's ancestors (everything that reaches it, bounded), for `contributors`.
//! `POST /internal/v1/positions`: how far the graph applied, relayed and took each
//! input partition (what reads with a write token wait for).
//! A failed graph answers 503 `shard_failed`; `POST /internal/v1/shards/0/skip` is
//! `tally shards skip graph`, `POST /internal/v1/snapshots` (merged in by `run`) is
//! `tally snapshot`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use tally_core::wire::{
    GraphAncestorsRequest, GraphNeighboursRequest, GraphNeighboursResponse, PositionsRequest, PositionsResponse,
    StorePositions,
};
use tally_shared::auth::{AuthConfig, Role};
use tally_shared::failures::{skip_router, FailureBoard};
use tally_shared::http::ApiError;

use crate::store::{GraphStore, GRAPH};

/// The internal routes: neighbours and ancestors for tally-query (the cluster
/// token), skips for operators.
pub fn router(store: Arc<GraphStore>, failures: Arc<FailureBoard>, auth: &AuthConfig) -> Router {
    let internal = Router::new()
        .route("/internal/v1/graph", post(neighbours))
        .route("/internal/v1/graph/ancestors", post(ancestors))
        .route("/internal/v1/positions", post(positions));
    tally_shared::auth::require(internal, auth, &[Role::Cluster])
        .with_state((store, failures.clone()))
        .merge(skip_router(failures, auth))
}

type GraphState = (Arc<GraphStore>, Arc<FailureBoard>);

/// Runs `answer` on the current graph, unless the graph failed.
fn with_graph(
    (store, failures): &GraphState,
    answer: impl FnOnce(&tally_core::graph::Graph) -> GraphNeighboursResponse,
) -> Response {
    if let Some(refusal) = failures.read_refusal(0) {
        return refusal;
    }
    let graph = tally_shared::lock::read(&store.graph, GRAPH);
    Json(answer(&graph)).into_response()
}

/// [`with_graph`] on a blocking thread: a read waits for the graph's lock, which the
/// processor holds while it applies a record of edges, and may walk or sort many
/// nodes — neither belongs on the runtime's thread (one by default).
async fn off_runtime(
    state: GraphState,
    answer: impl FnOnce(&tally_core::graph::Graph) -> GraphNeighboursResponse + Send + 'static,
) -> Response {
    tokio::task::spawn_blocking(move || with_graph(&state, answer)).await.unwrap_or_else(|err| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()).into_response()
    })
}

/// A `limit` past `max`: 400 `invalid_limit`, before any walk.
fn check_limit(limit: usize, max: usize) -> Result<(), ApiError> {
    match (1..=max).contains(&limit) {
        true => Ok(()),
        false => Err(ApiError::bad_request("invalid_limit", format!("limit: must be 1-{max}"))),
    }
}

/// A walk of up to `limit` nodes (at most [`GraphAncestorsRequest::MAX_LIMIT`]).
async fn ancestors(State(state): State<GraphState>, Json(request): Json<GraphAncestorsRequest>) -> Response {
    if let Err(refused) = check_limit(request.limit, GraphAncestorsRequest::MAX_LIMIT) {
        return refused.into_response();
    }
    off_runtime(state, move |graph| {
        let (names, more) = graph.ancestors(&request.entity, request.limit);
        GraphNeighboursResponse { entities: names.into_iter().map(str::to_string).collect(), more }
    })
    .await
}

async fn neighbours(State(state): State<GraphState>, Json(request): Json<GraphNeighboursRequest>) -> Response {
    if let Err(refused) = check_limit(request.limit, GraphNeighboursRequest::MAX_LIMIT) {
        return refused.into_response();
    }
    off_runtime(state, move |graph| {
        let all = graph.neighbours(&request.entity, request.outgoing);
        let start = request.after.as_deref().map_or(0, |after| all.partition_point(|name| *name <= after));
        let entities: Vec<String> = all[start..].iter().take(request.limit).map(|name| name.to_string()).collect();
        let more = start + entities.len() < all.len();
        GraphNeighboursResponse { entities, more }
    })
    .await
}

/// Where the graph stands ([`PositionsRequest`], its shards ignored): one answer.
async fn positions(State((store, failures)): State<GraphState>, Json(request): Json<PositionsRequest>) -> Response {
    if let Err(message) = request.check() {
        return ApiError::bad_request("invalid_body", message).into_response();
    }
    let answer = move || match failures.failure(0) {
        Some(failure) => StorePositions::Failed { message: failures.describe(0, &failure) },
        None => match store.positions(&request.sources) {
            Ok(positions) => StorePositions::Served(positions),
            Err(err) => StorePositions::Failed { message: format!("the graph: {err}") },
        },
    };
    match tokio::task::spawn_blocking(answer).await {
        Ok(answer) => Json(PositionsResponse { positions: vec![answer] }).into_response(),
        Err(err) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()).into_response(),
    }
}
