//! The internal neighbours API `tally-query` calls: one page of an entity's direct
//! neighbours in the current graph, sorted, after the last name of the previous page.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use tally_shared::wire::{GraphNeighboursRequest, GraphNeighboursResponse};

use crate::store::GraphStore;

pub fn router(store: Arc<GraphStore>) -> Router {
    Router::new().route("/internal/v1/graph", post(neighbours)).with_state(store)
}

async fn neighbours(State(store): State<Arc<GraphStore>>, Json(request): Json<GraphNeighboursRequest>) -> Response {
    let Ok(graph) = store.graph.read() else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "graph lock poisoned").into_response();
    };
    let all = graph.neighbours(&request.entity, request.outgoing);
    let start = request.after.as_deref().map_or(0, |after| all.partition_point(|name| *name <= after));
    let entities: Vec<String> = all[start..].iter().take(request.limit).map(|name| name.to_string()).collect();
    let more = start + entities.len() < all.len();
    Json(GraphNeighboursResponse { entities, more }).into_response()
}
