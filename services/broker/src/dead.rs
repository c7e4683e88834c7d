//! The dead-jobs part of the worker API, for operators (the jobs console):
//! `GET /v1/queues/{queue}/dead?limit=…&page_token=…` lists the queue's dead jobs
//! nobody requeued or discarded yet, oldest place first; `POST
//! /v1/queues/{queue}/dead/requeue` and `…/dead/discard` with `{"jobs":[{"partition",
//! "offset"}]}` decide about some ([`tally_shared::dead_jobs`]). Behind the same
//! bearer token as the rest of the API.

#![allow(clippy::result_large_err)] // handlers return ready responses as errors

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tally_core::jobs::{DeadJob, DeadJobAction};
use tally_shared::dead_jobs::Listing;
use tally_shared::http::page_token;

use crate::http::{body, error, find, ApiState};

/// The most jobs one decision request names.
pub const MAX_DECIDED: usize = 1_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    limit: Option<usize>,
    page_token: Option<String>,
}

/// A dead job's place in its queue: what names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Place {
    partition: i32,
    offset: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecideRequest {
    jobs: Vec<Place>,
}

fn encode_place(place: Place) -> String {
    page_token::encode("d1", &[&place.partition.to_string(), &place.offset.to_string()])
}

fn decode_place(token: &str) -> Option<Place> {
    let fields = page_token::decode(token, "d1", 2)?;
    Some(Place { partition: fields[0].parse().ok()?, offset: fields[1].parse().ok()? })
}

fn place(job: &DeadJob) -> Place {
    Place { partition: job.partition, offset: job.offset }
}

/// The queue's undecided dead jobs, read on a blocking thread.
async fn undecided(state: &ApiState, queue: &str) -> Result<Listing, Response> {
    let dead = state.dead.clone();
    let queue = queue.to_string();
    match tokio::task::spawn_blocking(move || dead.undecided(&queue)).await {
        Ok(Ok(listing)) => Ok(listing),
        Ok(Err(err)) => Err(error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", format!("reading dead jobs: {err}"))),
        Err(err) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string())),
    }
}

pub async fn list(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let queue = match find(&state, &queue) {
        Ok(queue) => queue,
        Err(response) => return response,
    };
    let Ok(Query(params)) = params else {
        return error(StatusCode::BAD_REQUEST, "invalid_parameter", "parameters: limit and page_token only");
    };
    let limit = params.limit.unwrap_or(50);
    if !(1..=1_000).contains(&limit) {
        return error(StatusCode::BAD_REQUEST, "invalid_limit", "limit: must be 1-1000");
    }
    let after = match params.page_token.as_deref() {
        None | Some("") => None,
        Some(token) => match decode_place(token) {
            Some(place) => Some(place),
            None => {
                return error(StatusCode::BAD_REQUEST, "invalid_page_token", "page_token: not a token this API issued")
            }
        },
    };
    let listing = match undecided(&state, &queue.name).await {
        Ok(listing) => listing,
        Err(response) => return response,
    };
    let total = listing.jobs.len();
    let start = after.map_or(0, |after| {
        listing.jobs.partition_point(|job| (job.partition, job.offset) <= (after.partition, after.offset))
    });
    let page: Vec<&DeadJob> = listing.jobs[start..].iter().take(limit).collect();
    let more = start + page.len() < total;
    let next_page_token = more.then(|| page.last().map(|job| encode_place(place(job)))).flatten();
    let dead: Vec<_> = page
        .iter()
        .map(|job| {
            json!({
                "partition": job.partition, "offset": job.offset, "id": job.job.id, "attempts": job.attempts,
                "error": job.error, "payload": job.job.payload, "key": job.job.key, "run_at": job.job.run_at,
                "truncated": job.truncated,
            })
        })
        .collect();
    Json(json!({
        "queue": queue.name, "total": total, "unreadable": listing.unreadable, "dead": dead,
        "next_page_token": next_page_token,
    }))
    .into_response()
}

pub async fn requeue(
    state: State<ApiState>,
    queue: Path<String>,
    request: Result<Json<DecideRequest>, JsonRejection>,
) -> Response {
    decide(state, queue, request, DeadJobAction::Requeued).await
}

pub async fn discard(
    state: State<ApiState>,
    queue: Path<String>,
    request: Result<Json<DecideRequest>, JsonRejection>,
) -> Response {
    decide(state, queue, request, DeadJobAction::Discarded).await
}

async fn decide(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    request: Result<Json<DecideRequest>, JsonRejection>,
    action: DeadJobAction,
) -> Response {
    let (queue, request) = match (find(&state, &queue), body(request)) {
        (Ok(queue), Ok(request)) => (queue, request),
        (Err(response), _) | (_, Err(response)) => return response,
    };
    if request.jobs.is_empty() || request.jobs.len() > MAX_DECIDED {
        return error(StatusCode::BAD_REQUEST, "invalid_jobs", format!("jobs: name 1-{MAX_DECIDED} dead jobs"));
    }
    let places: Vec<(i32, i64)> = request.jobs.iter().map(|p| (p.partition, p.offset)).collect();
    let report = match state.dead.decide_all(&queue.name, &places, action).await {
        Ok(report) => report,
        Err(err) => return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", format!("deciding dead jobs: {err}")),
    };
    let verb = match action {
        DeadJobAction::Requeued => "requeued",
        DeadJobAction::Discarded => "discarded",
    };
    if let Some(failed) = report.failed {
        let message = format!("{} {verb}, then deciding stopped {failed}", report.decided);
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message);
    }
    let not_found: Vec<Place> =
        report.not_found.iter().map(|&(partition, offset)| Place { partition, offset }).collect();
    let refused: Vec<_> = report
        .refused
        .iter()
        .map(|((partition, offset), reason)| json!({"partition": partition, "offset": offset, "reason": reason}))
        .collect();
    Json(json!({ verb: report.decided, "not_found": not_found, "refused": refused })).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_tokens_round_trip_and_reject_forgeries() {
        let place = Place { partition: 3, offset: 1_234 };
        assert_eq!(decode_place(&encode_place(place)), Some(place));
        assert_eq!(decode_place("!!"), None);
        assert_eq!(decode_place(&page_token::encode("d1", &["3"])), None);
        assert_eq!(decode_place(&page_token::encode("n1", &["3", "4"])), None);
    }
}
