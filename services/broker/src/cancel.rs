//! Cancelling a job (operators): `POST /v1/queues/{queue}/cancel {"id"}` writes the
//! cancellation to `tally.jobs-cancelled` (so no broker ever runs the job, whenever
//! it fetches it), then asks every owner of the queue's partitions to cancel it at
//! once (`/held/cancel`, with the caller's own credentials): a waiting job ends as
//! cancelled, a running one's worker is told on its next extend. A job no broker
//! holds, on a queue whose every partition an owner looked in with nothing left to
//! fetch, is unknown: 404 (a partition changing owner is in nobody's: 202).

#![allow(clippy::result_large_err)] // handlers return ready responses as errors

use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use rdkafka::producer::FutureRecord;
use serde_json::json;
use tally_core::jobs::api::{CancelRequest, HeldCancel};
use tally_core::jobs::JobCancel;
use tally_core::validate::check_id;
use tally_shared::kafka::now_ms;

use crate::http::{body, error, find, ApiState};

/// How long a cancel waits for each owner's answer.
const OWNER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an owner reads its partitions' log ends for (within [`OWNER_TIMEOUT`]).
const ENDS_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn cancel(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    request: Result<Json<CancelRequest>, JsonRejection>,
) -> Response {
    let (queue, request) = match checked(&state, &queue, request) {
        Ok(checked) => checked,
        Err(response) => return response,
    };
    let record = JobCancel::new(&queue.name, &request.id, now_ms());
    let Ok(payload) = serde_json::to_vec(&record) else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "encoding", "cannot encode the cancellation");
    };
    let (topic, key) = (state.names.jobs_cancelled(), record.key());
    let sent =
        state.broker.dead_producer.send(FutureRecord::to(&topic).key(&key).payload(&payload), OWNER_TIMEOUT).await;
    if let Err((err, _)) = sent {
        return error(StatusCode::SERVICE_UNAVAILABLE, "kafka_unavailable", format!("writing the cancellation: {err}"));
    }
    let owners: std::collections::BTreeSet<String> =
        tally_shared::lock::lock(&queue.owners, crate::state::OWNERS).values().cloned().collect();
    let mut states = Vec::new();
    let mut unfetched = 0i64;
    let mut unanswered = Vec::new();
    let mut looked_in = std::collections::BTreeSet::new();
    for owner in owners {
        let url = format!("http://{owner}/v1/queues/{}/held/cancel", queue.name);
        let mut ask = state.http.post(&url).json(&request).timeout(OWNER_TIMEOUT);
        if let Some(authorization) = headers.get(axum::http::header::AUTHORIZATION) {
            ask = ask.header(axum::http::header::AUTHORIZATION, authorization);
        }
        let answer = match ask.send().await {
            Ok(response) if response.status().is_success() => response.json::<HeldCancel>().await.ok(),
            _ => None,
        };
        match answer {
            Some(held) => {
                states.extend(held.state);
                unfetched += held.unfetched;
                looked_in.extend(held.served);
            }
            None => unanswered.push(owner),
        }
    }
    if let Some(was) = states.first() {
        return Json(json!({"queue": queue.name, "id": request.id, "cancelled": true, "was": was})).into_response();
    }
    if unknown(unfetched, &unanswered, &looked_in, queue.decl().partitions) {
        let message = format!(
            "no job {:?} waits or runs on queue {}: finished jobs cannot be cancelled (dead ones are requeued or \
             discarded: `tally jobs dead {}`); the cancellation is kept, so a job of this id enqueued later \
             does not run",
            request.id, queue.name, queue.name
        );
        return error(StatusCode::NOT_FOUND, "unknown_job", message);
    }
    // Not fetched yet (or an owner did not answer): it never runs once fetched.
    let body = json!({"queue": queue.name, "id": request.id, "cancelled": true, "was": "not_fetched",
        "unanswered": unanswered});
    (StatusCode::ACCEPTED, Json(body)).into_response()
}

/// Whether a job none of the owners holds is unknown: every owner answered, every
/// partition of the queue was looked in, and none has anything left to fetch.
fn unknown(
    unfetched: i64,
    unanswered: &[String],
    looked_in: &std::collections::BTreeSet<i32>,
    partitions: i32,
) -> bool {
    unfetched == 0 && unanswered.is_empty() && (0..partitions).all(|partition| looked_in.contains(&partition))
}

/// One broker's part: cancels the job in the partitions it serves.
pub async fn held(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    request: Result<Json<CancelRequest>, JsonRejection>,
) -> Response {
    let (queue, request) = match checked(&state, &queue, request) {
        Ok(checked) => checked,
        Err(response) => return response,
    };
    // What is left to fetch first, then the cancel: a job fetched in between is
    // found by the cancel, never missed by both.
    let (broker, served) = (state.broker.clone(), queue.clone());
    let deadline = std::time::Instant::now() + ENDS_TIMEOUT;
    let Ok((unfetched, served)) = tokio::task::spawn_blocking(move || broker.unfetched_now(&served, deadline)).await
    else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "reading the partitions' ends failed");
    };
    let state_here = state.broker.cancel_held(&queue.name, &request.id);
    state.broker.expire_leases();
    Json(HeldCancel { state: state_here, unfetched, served }).into_response()
}

/// The queue named and a cancel request naming a valid job id, or the 4xx answer.
fn checked(
    state: &ApiState,
    queue: &str,
    request: Result<Json<CancelRequest>, JsonRejection>,
) -> Result<(std::sync::Arc<crate::state::QueueRuntime>, CancelRequest), Response> {
    let (queue, request) = (find(state, queue)?, body(request)?);
    check_id(&request.id).map_err(|reason| error(StatusCode::BAD_REQUEST, "invalid_id", reason))?;
    Ok((queue, request))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::unknown;

    #[test]
    fn a_job_is_unknown_only_once_every_partition_was_looked_in_with_nothing_left_to_fetch() {
        let all: BTreeSet<i32> = (0..4).collect();
        assert!(unknown(0, &[], &all, 4));
        assert!(!unknown(3, &[], &all, 4), "records left to fetch");
        assert!(!unknown(0, &["b:1".to_string()], &all, 4), "an owner that did not answer");
        let moving: BTreeSet<i32> = [0, 1, 3].into();
        assert!(!unknown(0, &[], &moving, 4), "partition 2 changing owner: in nobody's");
        assert!(!unknown(0, &[], &BTreeSet::new(), 4), "owners that did not say where they looked");
    }
}
