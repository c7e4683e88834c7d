//! Failing closed, once for every log processor: a partition (a counter shard, the
//! graph-updates log) that meets a record it cannot decode, a corrupt value or a
//! broken invariant stops — it applies nothing more, `/readyz` names it, its reads
//! answer 503 `shard_failed` — while the others go on. An operator moves it past a
//! failed record with `tally shards skip`: the record goes to the dead-letter topic
//! with the operator's reason, and the partition resumes after it.
//!
//! The [`FailureBoard`] holds the failures and the operators' requests; the thread
//! that consumes the partitions records failures and carries out the requests
//! ([`FailureBoard::carry_out_skips`]); [`skip_router`] is the HTTP side.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::auth::{AuthConfig, Role};
use crate::lock::lock;
use crate::outbox::Relay;
use crate::{Error, Result};
use tally_core::wire::DeadLetter;

/// Why a partition stopped.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The offset it stopped at: the record that failed, or the first one not
    /// applied when the failure was not a record's (`None`: before any).
    pub offset: Option<i64>,
    pub reason: String,
    /// The record's bytes when the record itself failed to decode: what a skip
    /// sends to the dead-letter topic. `None`: not a record's failure, not skippable.
    pub record: Option<Arc<Vec<u8>>>,
}

/// An operator's request to move a failed partition past the record at `offset`.
pub struct SkipRequest {
    pub partition: u32,
    pub offset: i64,
    pub reason: String,
    pub done: oneshot::Sender<Result<(), String>>,
}

/// The body of `POST /internal/v1/shards/{partition}/skip`.
#[derive(Debug, Serialize, Deserialize)]
pub struct SkipBody {
    /// The offset of the failed record, as `/readyz` names it.
    pub offset: i64,
    /// Why it may be skipped: written into the dead letter.
    pub reason: String,
}

/// What [`FailureBoard`]'s locks guard ([`crate::lock`]).
const FAILURES: &str = "a failure board's failures";
const SKIPS: &str = "a failure board's skip requests";

/// The failures of one service's partitions and the skips asked for them.
pub struct FailureBoard {
    /// How a partition is named to operators: `shard 3`, `graph-updates partition 0`.
    name: fn(u32) -> String,
    failures: RwLock<BTreeMap<u32, Failure>>,
    skips: Mutex<Vec<SkipRequest>>,
}

impl FailureBoard {
    pub fn new(name: fn(u32) -> String) -> Self {
        Self { name, failures: RwLock::default(), skips: Mutex::default() }
    }

    /// What `/readyz` and error answers say about `partition`'s failure.
    pub fn describe(&self, partition: u32, failure: &Failure) -> String {
        let name = (self.name)(partition);
        match failure.offset {
            Some(offset) if failure.record.is_some() => {
                format!("{name} failed at offset {offset}: {}; `tally shards skip` moves past it", failure.reason)
            }
            Some(offset) => format!("{name} failed at offset {offset}: {}", failure.reason),
            None => format!("{name} failed: {}", failure.reason),
        }
    }

    /// Stops `partition`, loudly.
    pub fn fail(&self, partition: u32, failure: Failure) {
        tracing::error!(partition = %(self.name)(partition), offset = ?failure.offset, reason = %failure.reason, "failed: it applies nothing more until an operator acts");
        self.write().insert(partition, failure);
    }

    pub fn recover(&self, partition: u32) {
        self.write().remove(&partition);
    }

    /// Forgets every failure but `kept` (a new assignment: a record that failed
    /// fails again).
    pub fn reset(&self, kept: BTreeMap<u32, Failure>) {
        for (partition, failure) in &kept {
            tracing::error!(partition = %(self.name)(*partition), reason = %failure.reason, "failed: it applies nothing until an operator acts");
        }
        *self.write() = kept;
    }

    pub fn failure(&self, partition: u32) -> Option<Failure> {
        self.read().get(&partition).cloned()
    }

    pub fn is_failed(&self, partition: u32) -> bool {
        self.read().contains_key(&partition)
    }

    pub fn failed(&self) -> Vec<u32> {
        self.read().keys().copied().collect()
    }

    /// Every failure, described for `/readyz`.
    pub fn descriptions(&self) -> Vec<String> {
        self.read().iter().map(|(partition, failure)| self.describe(*partition, failure)).collect()
    }

    /// The answer to a read of a failed partition: 503 `shard_failed`.
    pub fn read_refusal(&self, partition: u32) -> Option<Response> {
        let failure = self.failure(partition)?;
        Some(error(StatusCode::SERVICE_UNAVAILABLE, "shard_failed", self.describe(partition, &failure)))
    }

    /// Carries out the queued skips on the consuming thread: the failed record goes
    /// to the dead-letter topic through `letters` (and is acknowledged), then
    /// `resume(partition, offset)` moves the store and the consumer past it.
    pub fn carry_out_skips(
        &self,
        letters: &Relay,
        topic: &str,
        budget: usize,
        mut resume: impl FnMut(u32, i64) -> Result<()>,
    ) -> u64 {
        let mut skipped = 0;
        for request in std::mem::take(&mut *lock(&self.skips, SKIPS)) {
            let result = self.skip(letters, topic, budget, &request, &mut resume);
            let name = (self.name)(request.partition);
            match &result {
                Ok(()) => {
                    skipped += 1;
                    tracing::warn!(partition = %name, offset = request.offset, reason = %request.reason, "an operator skipped a failed record: it is in the dead-letter topic, and the partition resumed after it");
                }
                Err(err) => tracing::error!(partition = %name, offset = request.offset, error = %err, "skip failed"),
            }
            if request.done.send(result.map_err(|err| err.to_string())).is_err() {
                tracing::debug!(partition = %name, "the skip's requester stopped waiting (timed out) before its answer");
            }
        }
        skipped
    }

    fn skip(
        &self,
        letters: &Relay,
        topic: &str,
        budget: usize,
        request: &SkipRequest,
        resume: &mut impl FnMut(u32, i64) -> Result<()>,
    ) -> Result<()> {
        let partition = request.partition;
        let failure =
            self.failure(partition).ok_or_else(|| Error::Skip(format!("{} has not failed", (self.name)(partition))))?;
        let record = match (&failure.record, failure.offset) {
            (Some(record), Some(offset)) if offset == request.offset => record.clone(),
            _ => return Err(Error::Skip(self.describe(partition, &failure))),
        };
        let reason = format!("skipped by an operator: {} (it failed: {})", request.reason, failure.reason);
        let letter = DeadLetter::encode(topic, partition as i32, request.offset, None, &reason, &record, budget)?;
        let key = format!("{topic}/{partition}/{}", request.offset);
        letters.send_keyed([(key.as_str(), letter.as_slice())])?;
        resume(partition, request.offset)?;
        self.recover(partition);
        Ok(())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u32, Failure>> {
        crate::lock::read(&self.failures, FAILURES)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<u32, Failure>> {
        crate::lock::write(&self.failures, FAILURES)
    }
}

/// How long a skip waits for the consuming thread.
const SKIP_WAIT: Duration = Duration::from_secs(60);

/// `POST /internal/v1/shards/{partition}/skip` (`tally shards skip`), for operators.
pub fn skip_router(board: Arc<FailureBoard>, auth: &AuthConfig) -> Router {
    let routes = Router::new().route("/internal/v1/shards/{partition}/skip", post(skip));
    crate::auth::require(routes, auth, &[Role::Operator]).with_state(board)
}

async fn skip(
    State(board): State<Arc<FailureBoard>>,
    partition: Result<Path<u32>, PathRejection>,
    body: Result<Json<SkipBody>, JsonRejection>,
) -> Response {
    // Bad requests answer in the one JSON error format, like every other mistake.
    let partition = match partition {
        Ok(Path(partition)) => partition,
        Err(rejection) => return error(StatusCode::BAD_REQUEST, "invalid_path", rejection.body_text()),
    };
    let body = match body {
        Ok(Json(body)) => body,
        Err(rejection) => return error(rejection.status(), "invalid_body", rejection.body_text()),
    };
    let Some(failure) = board.failure(partition) else {
        return error(StatusCode::CONFLICT, "not_failed", format!("{} has not failed here", (board.name)(partition)));
    };
    if failure.offset != Some(body.offset) || failure.record.is_none() {
        return error(StatusCode::CONFLICT, "not_this_record", board.describe(partition, &failure));
    }
    if body.reason.trim().is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_reason",
            "a reason is required: it goes into the dead letter".into(),
        );
    }
    let (done, answer) = oneshot::channel();
    lock(&board.skips, SKIPS).push(SkipRequest { partition, offset: body.offset, reason: body.reason, done });
    match tokio::time::timeout(SKIP_WAIT, answer).await {
        Ok(Ok(Ok(()))) => {
            Json(serde_json::json!({"skipped": body.offset, "resumed_at": body.offset + 1})).into_response()
        }
        Ok(Ok(Err(message))) => error(StatusCode::CONFLICT, "skip_failed", message),
        Ok(Err(_)) => error(StatusCode::SERVICE_UNAVAILABLE, "stopping", "the service is stopping".into()),
        Err(_) => {
            error(StatusCode::GATEWAY_TIMEOUT, "timeout", format!("the skip was not carried out within {SKIP_WAIT:?}"))
        }
    }
}

fn error(status: StatusCode, code: &'static str, message: String) -> Response {
    crate::http::ApiError::new(status, code, message).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves the skip endpoint of `board` on a free port; its base URL.
    async fn serve(board: Arc<FailureBoard>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, skip_router(board, &AuthConfig::default())).await });
        format!("http://{addr}/internal/v1/shards")
    }

    #[tokio::test]
    async fn garbage_and_oversized_skip_requests_get_json_errors_and_change_nothing() {
        let board = Arc::new(FailureBoard::new(|shard| format!("shard {shard}")));
        let record = Some(Arc::new(b"junk".to_vec()));
        board.fail(3, Failure { offset: Some(7), reason: "not a tally record".into(), record });
        let base = serve(board.clone()).await;
        let client = reqwest::Client::new();
        let huge = serde_json::json!({"offset": 7, "reason": "x".repeat(3 << 20)}).to_string();
        let cases: [(String, String, u16, &str); 6] = [
            (format!("{base}/3/skip"), "not json".into(), 400, "invalid_body"),
            (format!("{base}/3/skip"), r#"{"offset":"seven","reason":"r"}"#.into(), 422, "invalid_body"),
            (format!("{base}/3/skip"), huge, 413, "invalid_body"),
            (format!("{base}/three/skip"), r#"{"offset":7,"reason":"r"}"#.into(), 400, "invalid_path"),
            (format!("{base}/3/skip"), r#"{"offset":8,"reason":"r"}"#.into(), 409, "not_this_record"),
            (format!("{base}/4/skip"), r#"{"offset":7,"reason":"r"}"#.into(), 409, "not_failed"),
        ];
        for (url, body, status, code) in cases {
            let response =
                client.post(&url).header("content-type", "application/json").body(body).send().await.unwrap();
            let got_status = response.status().as_u16();
            let answer: serde_json::Value = response.json().await.unwrap_or_default();
            assert_eq!((got_status, answer["error"]["code"].as_str()), (status, Some(code)), "{url}: {answer}");
        }
        assert!(board.is_failed(3), "no request moved the shard");
        assert!(board.skips.lock().unwrap().is_empty(), "none was queued");
    }
}
