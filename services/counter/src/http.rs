//! The internal read API `tally-query` calls: the read link
//! ([`crate::read_link`], binary, many reads at once on one connection) or
//! `POST /internal/v2/read` (the same messages as JSON) asks one counter about
//! several shards at once, each answered from one snapshot of its store, all on one
//! blocking thread (the all-time totals of one or two counters — a point read each —
//! on the runtime's thread: cheaper than the hand-off). A shard
//! this process does not own, or not now (still catching up with the log, or its
//! lease lapsed), answers `not_owner`, which tells the caller to look up the owner
//! again; a failed shard answers `failed` (`shard_failed` to clients). The metrics
//! listing asks about one shard: 409 `not_owner`, 503 `shard_failed`.
//! `GET /internal/v1/status` lists the shards held and their lag (the dashboard's
//! freshness); `POST /internal/v1/positions` how far each asked shard applied, relayed
//! and took each input partition (what reads with a write token wait for).
//! `POST /internal/v1/standby-read` is `/internal/v2/read` of the shards this
//! counter holds as standbys (caught up once, lease valid): what tally-query falls
//! back on for a read that allows staleness while an owner is silent.
//! `POST /internal/v1/shards/{shard}/skip` is `tally shards skip`
//! ([`tally_shared::failures`]), `POST /internal/v1/snapshots` is `tally snapshot`
//! ([`snapshot_router`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tally_core::time::WindowSpec;
use tally_core::wire::{
    CounterStatus, FreshReadResponse, PositionsRequest, PositionsResponse, ReadRequest, ShardAsOf, ShardMetricsRequest,
    ShardOutcome, ShardQueries, StorePositions,
};
use tally_shared::auth::{AuthConfig, Role};
use tally_shared::failures::{skip_router, Failure};
use tally_shared::http::ApiError;
use tally_shared::snapshot::snapshot_router;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::shards::Shards;
use crate::store::ShardStore;

#[derive(Clone)]
pub struct ReadState {
    pub shards: Arc<Shards>,
    pub metrics: Metrics,
    /// Whether this counter takes snapshots (`tally snapshot` asks it to).
    pub snapshots: bool,
    /// Cancelled when the counter stops: read links close.
    pub shutdown: CancellationToken,
}

/// The internal routes: reads, the read link and status for tally services (the
/// cluster token), shard skips and snapshots for operators.
pub fn router(state: ReadState, auth: &AuthConfig) -> Router {
    let internal = Router::new()
        .route("/internal/v2/read", post(read))
        .route("/internal/v1/standby-read", post(standby_read))
        .route(tally_shared::read_link::PATH, get(crate::read_link::open))
        .route("/internal/v1/metrics", post(metrics))
        .route("/internal/v1/status", get(status))
        .route("/internal/v1/positions", post(positions));
    tally_shared::auth::require(internal, auth, &[Role::Cluster])
        .with_state(state.clone())
        .merge(skip_router(state.shards.failures.clone(), auth))
        .merge(snapshot_router(state.snapshots.then(|| state.shards.snapshot_requests.clone()), auth))
}

/// The store of `shard` when it serves reads; the answer to give otherwise (boxed:
/// a response is big, the store a pointer).
fn serving(state: &ReadState, shard: u32) -> Result<Arc<ShardStore>, Box<Response>> {
    if let Some(refusal) = state.shards.failures.read_refusal(shard) {
        return Err(Box::new(refusal));
    }
    state.shards.served(shard).ok_or_else(|| {
        let message = format!("shard {shard} is not owned by this counter");
        Box::new(ApiError::new(StatusCode::CONFLICT, "not_owner", message).into_response())
    })
}

/// Runs a read on a blocking thread. Corrupt data it meets fails the shard (503
/// `shard_failed` from then on); other storage errors are 500s.
async fn answer<T: serde::Serialize + Send + 'static>(
    state: &ReadState,
    shard: u32,
    work: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> Response {
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(answer)) => Json(answer).into_response(),
        Ok(Err(err)) if err.is_corruption() => {
            let failure = Failure { offset: None, reason: format!("a read met corrupt data: {err}"), record: None };
            state.shards.failures.fail(shard, failure);
            state.shards.failures.read_refusal(shard).unwrap_or_else(|| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "storage", err.to_string()).into_response()
            })
        }
        Ok(Err(err)) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "storage", err.to_string()).into_response(),
        Err(err) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()).into_response(),
    }
}

/// All-time totals of at most this many counters are read on the runtime's thread.
const INLINE_READS: usize = 2;

/// Whether `request` is answered on the runtime's thread: the all-time total of a
/// counter or two (a point read each, microseconds from the memtable or the block
/// cache). Handing it to the blocking pool and back cost more than the read, in two
/// thread wake-ups. A window (a scan of up to hundreds of buckets) or a series goes
/// to the pool, so the runtime's thread — the only one by default — never scans;
/// so does a segment query (a walk of the entity's combinations).
pub(crate) fn answers_inline(request: &ReadRequest) -> bool {
    let mut queries = request.shards.iter().flat_map(|shard| &shard.queries);
    queries.clone().count() <= INLINE_READS
        && queries.all(|q| matches!(q.spec, WindowSpec::All) && q.segments.is_none())
}

/// Which stores a read may answer from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Served {
    /// Owned shards this counter serves.
    Owned,
    /// Shards this counter holds as standbys.
    Standby,
}

/// Answers every shard of `request`, each from one snapshot of its store, with
/// how fresh that store was.
pub(crate) fn answer_read(state: &ReadState, request: ReadRequest, from: Served) -> FreshReadResponse {
    let asked: usize = request.shards.iter().map(|shard| shard.queries.len()).sum();
    state.metrics.reads.inc_by(asked as u64);
    let now_ms = request.now_ms;
    let (shards, as_of) = request.shards.into_iter().map(|shard| read_shard(state, shard, now_ms, from)).unzip();
    FreshReadResponse { shards, as_of }
}

/// `POST /internal/v2/read`: the read link's messages as JSON, for a tally-query
/// that does not use the link ([`crate::read_link`]).
async fn read(State(state): State<ReadState>, body: axum::body::Bytes) -> Response {
    read_from(state, body, Served::Owned).await
}

/// `POST /internal/v1/standby-read`: a read of standbys' stores.
async fn standby_read(State(state): State<ReadState>, body: axum::body::Bytes) -> Response {
    read_from(state, body, Served::Standby).await
}

async fn read_from(state: ReadState, body: axum::body::Bytes, from: Served) -> Response {
    // Parsed here rather than by axum's `Json` extractor, which tracks the path of
    // every field for its error messages (a fifth of this handler's time).
    let request: ReadRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => return ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", err.to_string()).into_response(),
    };
    if answers_inline(&request) {
        return Json(answer_read(&state, request, from)).into_response();
    }
    match tokio::task::spawn_blocking(move || answer_read(&state, request, from)).await {
        Ok(response) => Json(response).into_response(),
        Err(err) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()).into_response(),
    }
}

/// One shard's part of a read, and how fresh its store was: taken before the
/// read, so the answer holds at least what it says. Corrupt data it meets fails
/// the shard.
fn read_shard(
    state: &ReadState,
    ShardQueries { shard, queries }: ShardQueries,
    now_ms: i64,
    from: Served,
) -> (ShardOutcome, Option<ShardAsOf>) {
    let failures = &state.shards.failures;
    if let Some(failure) = failures.failure(shard) {
        return (ShardOutcome::Failed { message: failures.describe(shard, &failure) }, None);
    }
    let store = match from {
        Served::Owned => state.shards.served(shard),
        Served::Standby => state.shards.standby_served(shard),
    };
    let Some(store) = store else { return (ShardOutcome::NotOwner, None) };
    let as_of = store.freshness.as_of(tally_shared::kafka::now_ms());
    let as_of = ShardAsOf { applied: as_of.applied, lag_ms: as_of.lag_ms };
    match store.read(&queries, now_ms) {
        Ok(answers) => (ShardOutcome::Answers { answers }, Some(as_of)),
        Err(err) if err.is_corruption() => {
            let failure = Failure { offset: None, reason: format!("a read met corrupt data: {err}"), record: None };
            let message = failures.describe(shard, &failure);
            failures.fail(shard, failure);
            (ShardOutcome::Failed { message }, None)
        }
        Err(err) => (ShardOutcome::Unavailable { message: format!("shard {shard}: {err}") }, None),
    }
}

async fn metrics(State(state): State<ReadState>, Json(request): Json<ShardMetricsRequest>) -> Response {
    let store = match serving(&state, request.shard) {
        Ok(store) => store,
        Err(response) => return *response,
    };
    let shard = request.shard;
    answer(&state, shard, move || store.metrics(&request.entity, request.after.as_deref(), request.limit)).await
}

async fn status(State(state): State<ReadState>) -> Json<CounterStatus> {
    Json(CounterStatus { shards: state.shards.status() })
}

/// Where each asked shard stands ([`PositionsRequest`]): served shards only, so a
/// waiting reader never counts on a store that does not answer reads.
async fn positions(State(state): State<ReadState>, Json(request): Json<PositionsRequest>) -> Response {
    if let Err(message) = request.check() {
        return ApiError::bad_request("invalid_body", message).into_response();
    }
    let request = Arc::new(request);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(request.wait_ms);
    loop {
        // Armed before the look, so a change during it wakes the wait.
        let changed = state.shards.changed.notified();
        let (asked, shards) = (request.clone(), state.shards.clone());
        let response = match tokio::task::spawn_blocking(move || look(&shards, &asked)).await {
            Ok(response) => response,
            Err(err) => {
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()).into_response()
            }
        };
        let moved = response.positions.iter().zip(request.seen.iter().chain(std::iter::repeat(&None))).any(
            |(now, seen)| match (now, seen) {
                (StorePositions::Served(now), Some(seen)) => (now.applied, now.relayed) != *seen,
                _ => true,
            },
        );
        if moved || tokio::time::timeout_at(deadline, changed).await.is_err() {
            return Json(response).into_response();
        }
    }
}

/// Where each of `request`'s shards stands now.
fn look(shards: &Shards, request: &PositionsRequest) -> PositionsResponse {
    let failures = &shards.failures;
    let positions = request.shards.iter().map(|&shard| {
        if let Some(failure) = failures.failure(shard) {
            return StorePositions::Failed { message: failures.describe(shard, &failure) };
        }
        match shards.served(shard).map(|store| store.positions(&request.sources)) {
            None => StorePositions::NotOwner,
            Some(Ok(positions)) => StorePositions::Served(positions),
            Some(Err(err)) => StorePositions::Failed { message: format!("shard {shard}: {err}") },
        }
    });
    PositionsResponse { positions: positions.collect() }
}
