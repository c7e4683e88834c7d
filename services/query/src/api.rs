//! The public read API: parsing and validating requests, and shaping the
//! answers. Every mistake in a request is a 400 with a JSON error; nothing a client
//! sends can cause a 500.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tally_core::keys::Count;
use tally_core::segments::Dimensions;
use tally_core::time::{format_duration, parse_duration, WindowSpec};
use tally_core::validate::{check_entity, check_metric};
use tally_core::wire::{GraphNeighboursRequest, Kind, ShardAnswer, ShardQuery};
use tally_shared::http::page_token;

use crate::error::ApiError;
use crate::fanout::Answered;
use crate::fanout::Fanout;
use crate::freshness::{check_staleness, AsOf};
use crate::metrics::Metrics;
use crate::segments::{split_query, Group, GroupSeries, SegmentParams};

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1 << 20;

pub struct ApiState {
    pub fanout: Fanout,
    pub brokers: crate::jobs::Brokers,
    pub metrics: Metrics,
    pub auth: tally_shared::auth::AuthConfig,
    pub max_batch: usize,
    /// The dimensions each metric declares (`counting.dimensions`): what segment
    /// queries may name.
    pub dimensions: Dimensions,
}

pub fn router(state: Arc<ApiState>) -> Router {
    let v1 = Router::new()
        .route("/v1/counters/{entity}/{metric}", get(counter))
        .route("/v1/counters/{entity}/{metric}/series", get(series))
        .route("/v1/counters/{entity}/{metric}/contributors", get(crate::contributors::contributors))
        .route("/v1/query", post(batch))
        .route("/v1/entities/{entity}/metrics", get(entity_metrics))
        .route("/v1/graph/{entity}", get(graph_neighbours))
        .route("/v1/status", get(crate::status::status))
        // The jobs console's data, from the brokers with their token passed on.
        .route("/v1/jobs", get(crate::jobs::overview))
        .route("/v1/jobs/{queue}/dead", get(crate::jobs::dead))
        .route("/v1/jobs/{queue}/dead/{action}", post(crate::jobs::decide))
        .route("/v1/jobs/{queue}/cancel", post(crate::jobs::cancel))
        .route("/v1/jobs/{queue}/running", get(crate::jobs::running));
    let v1 = tally_shared::auth::require(v1, &state.auth, &[tally_shared::auth::Role::Reader]);
    Router::new()
        .merge(crate::dashboard::router())
        .merge(v1)
        .fallback(|| async {
            ApiError { status: StatusCode::NOT_FOUND, code: "not_found", message: "no such endpoint".into() }
        })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WindowParams {
    window: Option<String>,
    kind: Option<String>,
    max_staleness_ms: Option<i64>,
    after: Option<String>,
    max_wait_ms: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SeriesParams {
    step: Option<String>,
    range: Option<String>,
    kind: Option<String>,
    max_staleness_ms: Option<i64>,
    after: Option<String>,
    max_wait_ms: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsParams {
    limit: Option<usize>,
    page_token: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    queries: Vec<BatchQuery>,
    max_staleness_ms: Option<i64>,
    /// Write tokens, as a list or comma-separated like the query parameter.
    after: Option<Tokens>,
    max_wait_ms: Option<i64>,
}

/// `after` in a body: one string of comma-separated tokens, or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Tokens {
    One(String),
    Many(Vec<String>),
}

impl Tokens {
    /// As the query parameter takes them (`None`: an empty list).
    fn joined(self) -> Option<String> {
        match self {
            Tokens::One(tokens) => Some(tokens),
            Tokens::Many(tokens) if tokens.is_empty() => None,
            Tokens::Many(tokens) => Some(tokens.join(",")),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchQuery {
    entity: String,
    metric: String,
    window: Option<String>,
    kind: Option<String>,
    /// Filters: dimension → value (`*`: any).
    segments: Option<BTreeMap<String, String>>,
    /// A breakdown by this dimension (every group, largest first).
    by: Option<String>,
}

pub(crate) fn path_error(rejection: PathRejection) -> ApiError {
    ApiError::bad_request("invalid_path", rejection.body_text())
}

pub(crate) fn query_error(rejection: QueryRejection) -> ApiError {
    ApiError::bad_request("invalid_parameter", rejection.body_text())
}

fn parse_kind(kind: Option<&str>) -> Result<Kind, ApiError> {
    match kind.unwrap_or("total") {
        "total" => Ok(Kind::Total),
        "direct" => Ok(Kind::Direct),
        other => Err(ApiError::bad_request("invalid_kind", format!("kind: must be total or direct, not `{other}`"))),
    }
}

pub(crate) fn parse_window(window: Option<&str>) -> Result<(WindowSpec, String), ApiError> {
    match window.unwrap_or("all") {
        "all" => Ok((WindowSpec::All, "all".into())),
        text => {
            let ms = parse_duration(text)
                .map_err(|err| ApiError::bad_request("invalid_window", format!("window: {err}")))?;
            Ok((WindowSpec::Last { window_ms: ms }, format_duration(ms)))
        }
    }
}

pub(crate) fn check_counter(entity: &str, metric: &str) -> Result<(), ApiError> {
    check_entity(entity).map_err(|m| ApiError::bad_request("invalid_entity", m))?;
    check_metric(metric).map_err(|m| ApiError::bad_request("invalid_metric", m))
}

pub(crate) fn now_ms() -> i64 {
    tally_shared::kafka::now_ms()
}

/// A shard's per-query error becomes the client's 400.
pub(crate) fn answer_error(answer: &ShardAnswer) -> Option<ApiError> {
    match answer {
        // A segment query whose read would walk or answer more than a read may: a 422.
        ShardAnswer::Error { code, message } => Some(match code.as_str() {
            "too_many_combinations" => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "too_many_combinations", message.clone())
            }
            "too_many_groups" => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "too_many_groups", message.clone()),
            _ => ApiError::bad_request("invalid_window", message.clone()),
        }),
        _ => None,
    }
}

/// A segment query answered as a plain one: the counter predates segments (an
/// older counter reading the JSON route ignores them). Never passed off as the
/// filtered answer.
pub(crate) fn unsegmented_answer(query: &ShardQuery, answer: &ShardAnswer) -> Option<ApiError> {
    let plain = matches!(answer, ShardAnswer::Window { .. } | ShardAnswer::Series { .. });
    (query.segments.is_some() && plain).then(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "segments_unsupported",
            "the counter holding this entity does not answer segment queries: upgrade counters first",
        )
    })
}

/// One window's answer as clients see it: typed, so a batch of answers is written
/// straight to the response without building a JSON tree first. Fields are declared
/// in the order the answers always had (alphabetical).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum WindowResult<'a> {
    Window {
        entity: &'a str,
        from: i64,
        kind: &'static str,
        metric: &'a str,
        resolution: String,
        to: i64,
        value: Count,
        window: &'a str,
    },
    Segmented(SegmentWindow<'a>),
    Error {
        error: ErrorBody,
    },
}

/// A segment query's answer over a window: the filtered `value`, or with `by` a page
/// of the `breakdown`; `overflow` is what the metric's overflow combination holds
/// (counts past the cap of combinations, which no filter selects).
#[derive(Debug, Serialize)]
struct SegmentWindow<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    breakdown: Option<Vec<Group>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    by: Option<&'a str>,
    entity: &'a str,
    from: i64,
    kind: &'static str,
    metric: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    next_page_token: Option<String>,
    overflow: Count,
    resolution: String,
    segments: &'a BTreeMap<String, String>,
    to: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<Count>,
    window: &'a str,
}

/// A segment query's answer over a series: the filtered `points`, or with `by` a
/// page of `series` per group.
#[derive(Debug, Serialize)]
struct SegmentSeries<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    by: Option<&'a str>,
    entity: &'a str,
    kind: &'static str,
    metric: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    next_page_token: Option<String>,
    overflow: Vec<Point>,
    #[serde(skip_serializing_if = "Option::is_none")]
    points: Option<Vec<Point>>,
    range: String,
    resolution: String,
    segments: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    series: Option<Vec<GroupSeries<Point>>>,
    step: String,
}

/// An answer and how fresh the shards it read were (`as_of` first, in the
/// alphabetical order of every answer's fields).
#[derive(Debug, Serialize)]
struct Fresh<T> {
    as_of: Vec<AsOf>,
    #[serde(flatten)]
    answer: T,
}

/// A series as clients see it (fields in alphabetical order, as every answer's).
/// Counts may pass 2^63: written by value, never through a JSON tree of i64s.
#[derive(Debug, Serialize)]
struct Series<'a> {
    entity: &'a str,
    kind: &'static str,
    metric: &'a str,
    points: Vec<Point>,
    range: String,
    resolution: String,
    step: String,
}

#[derive(Debug, Serialize)]
struct Point {
    t: i64,
    value: Count,
}

/// A page of an entity's metrics as clients see it.
#[derive(Debug, Serialize)]
struct MetricsPage<'a> {
    entity: &'a str,
    metrics: Vec<ListedMetric<'a>>,
    next_page_token: Option<String>,
}

#[derive(Debug, Serialize)]
struct ListedMetric<'a> {
    direct: Count,
    metric: &'a str,
    total: Count,
}

#[derive(Debug, Serialize)]
struct ErrorBody {
    code: String,
    message: String,
}

#[derive(Debug, Serialize)]
struct BatchResults<'a> {
    results: Vec<WindowResult<'a>>,
}

/// `answer` as a JSON response, written straight from the typed value.
pub(crate) fn json_response(answer: &impl Serialize) -> Result<Response, ApiError> {
    let body = serde_json::to_vec(answer)
        .map_err(|err| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()))?;
    Ok(([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response())
}

fn window_result<'a>(
    query: &'a ShardQuery,
    window: &'a str,
    segments: &'a SegmentParams,
    answer: ShardAnswer,
) -> WindowResult<'a> {
    match answer {
        ShardAnswer::Segments { resolution, from, to, groups, overflow, .. } => {
            let (value, breakdown, next_page_token) = match &segments.by {
                None => (Some(groups.first().and_then(|g| g.1.first().copied()).unwrap_or(0)), None, None),
                Some(_) => {
                    let shape =
                        |segment, points: Vec<Count>| Group { segment, value: points.first().copied().unwrap_or(0) };
                    let (page, token) = crate::segments::page(groups, segments, shape);
                    (None, Some(page), token)
                }
            };
            WindowResult::Segmented(SegmentWindow {
                breakdown,
                by: segments.by.as_deref(),
                entity: &query.entity,
                from,
                kind: query.kind.as_str(),
                metric: &query.metric,
                next_page_token,
                overflow: overflow.first().copied().unwrap_or(0),
                resolution,
                segments: &segments.filters,
                to,
                value,
                window,
            })
        }
        ShardAnswer::Window { value, resolution, from, to } => WindowResult::Window {
            entity: &query.entity,
            from,
            kind: query.kind.as_str(),
            metric: &query.metric,
            resolution,
            to,
            value,
            window,
        },
        ShardAnswer::Error { code, message } => WindowResult::Error { error: ErrorBody { code, message } },
        ShardAnswer::Series { .. } => WindowResult::Error {
            error: ErrorBody { code: "internal".into(), message: "unexpected series answer".into() },
        },
    }
}

async fn counter(
    State(state): State<Arc<ApiState>>,
    path: Result<Path<(String, String)>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let Path((entity, metric)) = path.map_err(path_error)?;
    let (params, segments): (WindowParams, _) = split_query(raw.as_deref())?;
    check_counter(&entity, &metric)?;
    let kind = parse_kind(params.kind.as_deref())?;
    let (spec, window) = parse_window(params.window.as_deref())?;
    let staleness = check_staleness(params.max_staleness_ms)?;
    let after = crate::after::parse(params.after.as_deref(), params.max_wait_ms)?;
    let selector = segments.selector(&state.dimensions, &metric)?;
    let query = ShardQuery { segments: selector, ..ShardQuery::plain(entity, metric, kind, spec) };
    let timer = state.metrics.request_seconds.with_label_values(&["counter"]).start_timer();
    let Answered { mut answers, as_of } =
        state.fanout.read(vec![query.clone()], now_ms(), staleness, after.as_ref()).await?;
    timer.observe_duration();
    let answer = answers.pop().ok_or_else(|| ApiError::unavailable("no answer"))?;
    if let Some(err) = answer_error(&answer).or_else(|| unsegmented_answer(&query, &answer)) {
        return Err(err);
    }
    json_response(&Fresh { as_of, answer: window_result(&query, &window, &segments, answer) })
}

async fn series(
    State(state): State<Arc<ApiState>>,
    path: Result<Path<(String, String)>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let Path((entity, metric)) = path.map_err(path_error)?;
    let (params, segments): (SeriesParams, _) = split_query(raw.as_deref())?;
    check_counter(&entity, &metric)?;
    let kind = parse_kind(params.kind.as_deref())?;
    let step_ms = parse_duration(params.step.as_deref().unwrap_or("1h"))
        .map_err(|e| ApiError::bad_request("invalid_step", format!("step: {e}")))?;
    let range_ms = parse_duration(params.range.as_deref().unwrap_or("24h"))
        .map_err(|e| ApiError::bad_request("invalid_range", format!("range: {e}")))?;
    let staleness = check_staleness(params.max_staleness_ms)?;
    let after = crate::after::parse(params.after.as_deref(), params.max_wait_ms)?;
    let selector = segments.selector(&state.dimensions, &metric)?;
    let query = ShardQuery {
        segments: selector,
        ..ShardQuery::plain(entity, metric, kind, WindowSpec::Series { step_ms, range_ms })
    };
    let timer = state.metrics.request_seconds.with_label_values(&["series"]).start_timer();
    let Answered { mut answers, as_of } =
        state.fanout.read(vec![query.clone()], now_ms(), staleness, after.as_ref()).await?;
    timer.observe_duration();
    if let Some(err) = answers.last().and_then(|answer| unsegmented_answer(&query, answer)) {
        return Err(err);
    }
    match answers.pop() {
        Some(ShardAnswer::Series { resolution, points }) => json_response(&Fresh {
            as_of,
            answer: Series {
                entity: &query.entity,
                kind: kind.as_str(),
                metric: &query.metric,
                points: points.into_iter().map(|(t, value)| Point { t, value }).collect(),
                range: format_duration(range_ms),
                resolution,
                step: format_duration(step_ms),
            },
        }),
        Some(ShardAnswer::Segments { resolution, from, step, groups, overflow, .. }) => {
            let points = |values: Vec<Count>| -> Vec<Point> {
                values.into_iter().zip(0i64..).map(|(value, i)| Point { t: from + i * step, value }).collect()
            };
            let (filtered, series, next_page_token) = match &segments.by {
                None => (Some(points(groups.into_iter().next().map(|g| g.1).unwrap_or_default())), None, None),
                Some(_) => {
                    let shape = |segment, values| GroupSeries { points: points(values), segment };
                    let (page, token) = crate::segments::page(groups, &segments, shape);
                    (None, Some(page), token)
                }
            };
            json_response(&Fresh {
                as_of,
                answer: SegmentSeries {
                    by: segments.by.as_deref(),
                    entity: &query.entity,
                    kind: kind.as_str(),
                    metric: &query.metric,
                    next_page_token,
                    overflow: points(overflow),
                    points: filtered,
                    range: format_duration(range_ms),
                    resolution,
                    segments: &segments.filters,
                    series,
                    step: format_duration(step_ms),
                },
            })
        }
        Some(answer) => Err(answer_error(&answer).unwrap_or_else(|| ApiError::unavailable("unexpected answer"))),
        None => Err(ApiError::unavailable("no answer")),
    }
}

async fn batch(
    State(state): State<Arc<ApiState>>,
    body: Result<Json<BatchBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(body) = body.map_err(|rejection| ApiError::bad_request("invalid_body", rejection.body_text()))?;
    if body.queries.len() > state.max_batch {
        return Err(ApiError::bad_request(
            "batch_too_large",
            format!("at most {} queries per request", state.max_batch),
        ));
    }
    let mut queries = Vec::with_capacity(body.queries.len());
    let mut windows = Vec::with_capacity(body.queries.len());
    let mut selections = Vec::with_capacity(body.queries.len());
    for (index, q) in body.queries.into_iter().enumerate() {
        let in_query = |err: ApiError| ApiError { message: format!("queries[{index}]: {}", err.message), ..err };
        check_counter(&q.entity, &q.metric).map_err(in_query)?;
        let kind = parse_kind(q.kind.as_deref()).map_err(in_query)?;
        let (spec, window) = parse_window(q.window.as_deref()).map_err(in_query)?;
        let segments = SegmentParams::of(q.segments, q.by);
        let selector = segments.selector(&state.dimensions, &q.metric).map_err(in_query)?;
        queries.push(ShardQuery { segments: selector, ..ShardQuery::plain(q.entity, q.metric, kind, spec) });
        windows.push(window);
        selections.push(segments);
    }
    let staleness = check_staleness(body.max_staleness_ms)?;
    let after = crate::after::parse(body.after.and_then(Tokens::joined).as_deref(), body.max_wait_ms)?;
    let timer = state.metrics.request_seconds.with_label_values(&["batch"]).start_timer();
    let Answered { answers, as_of } = state.fanout.read(queries.clone(), now_ms(), staleness, after.as_ref()).await?;
    timer.observe_duration();
    let results = queries
        .iter()
        .zip(&windows)
        .zip(&selections)
        .zip(answers)
        .map(|(((query, window), segments), answer)| match unsegmented_answer(query, &answer) {
            Some(err) => WindowResult::Error { error: ErrorBody { code: err.code.into(), message: err.message } },
            None => window_result(query, window, segments, answer),
        })
        .collect();
    json_response(&Fresh { as_of, answer: BatchResults { results } })
}

async fn entity_metrics(
    State(state): State<Arc<ApiState>>,
    path: Result<Path<String>, PathRejection>,
    params: Result<Query<MetricsParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Path(entity) = path.map_err(path_error)?;
    let Query(params) = params.map_err(query_error)?;
    check_entity(&entity).map_err(|m| ApiError::bad_request("invalid_entity", m))?;
    let limit = params.limit.unwrap_or(100);
    if !(1..=1_000).contains(&limit) {
        return Err(ApiError::bad_request("invalid_limit", "limit: must be 1-1000"));
    }
    let after = match params.page_token.as_deref() {
        None | Some("") => None,
        Some(token) => Some(decode_token(token, check_metric)?),
    };
    let page = state.fanout.metrics(&entity, after, limit).await?;
    let next_page_token = if page.more { page.metrics.last().map(|m| encode_token(&m.metric)) } else { None };
    json_response(&MetricsPage {
        entity: &entity,
        metrics: page
            .metrics
            .iter()
            .map(|m| ListedMetric { direct: m.direct, metric: &m.metric, total: m.total })
            .collect(),
        next_page_token,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GraphParams {
    direction: Option<String>,
    limit: Option<usize>,
    page_token: Option<String>,
}

async fn graph_neighbours(
    State(state): State<Arc<ApiState>>,
    path: Result<Path<String>, PathRejection>,
    params: Result<Query<GraphParams>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Path(entity) = path.map_err(path_error)?;
    let Query(params) = params.map_err(query_error)?;
    check_entity(&entity).map_err(|m| ApiError::bad_request("invalid_entity", m))?;
    let direction = params.direction.unwrap_or_else(|| "descendants".into());
    let outgoing = match direction.as_str() {
        "descendants" => true,
        "ancestors" => false,
        _ => return Err(ApiError::bad_request("invalid_direction", "direction: must be descendants or ancestors")),
    };
    let limit = params.limit.unwrap_or(100);
    // As large a page as tally-graph answers.
    if !(1..=GraphNeighboursRequest::MAX_LIMIT).contains(&limit) {
        let message = format!("limit: must be 1-{}", GraphNeighboursRequest::MAX_LIMIT);
        return Err(ApiError::bad_request("invalid_limit", message));
    }
    let after = match params.page_token.as_deref() {
        None | Some("") => None,
        Some(token) => Some(decode_token(token, check_entity)?),
    };
    let request = GraphNeighboursRequest { entity: entity.clone(), outgoing, after, limit };
    let page = state.fanout.neighbours(&request).await?;
    let next_page_token = if page.more { page.entities.last().map(|e| encode_token(e)) } else { None };
    Ok(Json(json!({
        "entity": entity,
        "direction": direction,
        "entities": page.entities,
        "next_page_token": next_page_token,
    })))
}

/// A metrics or neighbours page token: the last name listed.
fn encode_token(name: &str) -> String {
    page_token::encode("n1", &[name])
}

/// The name a page token carries, checked like the names it stands for.
fn decode_token(token: &str, check: fn(&str) -> Result<(), &'static str>) -> Result<String, ApiError> {
    let invalid = || ApiError::bad_request("invalid_page_token", "page_token: not a token this API issued");
    let name = page_token::decode(token, "n1", 1).and_then(|mut fields| fields.pop()).ok_or_else(invalid)?;
    check(&name).map_err(|_| invalid())?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment query answered as a plain one (an older counter) is refused, never
    /// passed off as filtered; a counter's refusal of too much work is a 422.
    #[test]
    fn unsegmented_answers_and_refused_work_are_errors() {
        let plain = ShardQuery::plain("e".into(), "v".into(), Kind::Total, WindowSpec::All);
        let segmented = ShardQuery { segments: Some(tally_core::segments::Selector::default()), ..plain.clone() };
        let window = ShardAnswer::Window { value: 3, resolution: "all".into(), from: 0, to: 1 };
        assert!(unsegmented_answer(&plain, &window).is_none());
        let refused = unsegmented_answer(&segmented, &window).unwrap();
        assert_eq!((refused.status, refused.code), (StatusCode::SERVICE_UNAVAILABLE, "segments_unsupported"));
        let walked = ShardAnswer::Error { code: "too_many_combinations".into(), message: "many".into() };
        let err = answer_error(&walked).unwrap();
        assert_eq!((err.status, err.code), (StatusCode::UNPROCESSABLE_ENTITY, "too_many_combinations"));
        let groups = ShardAnswer::Error { code: "too_many_groups".into(), message: "long".into() };
        let err = answer_error(&groups).unwrap();
        assert_eq!((err.status, err.code), (StatusCode::UNPROCESSABLE_ENTITY, "too_many_groups"));
        let window_error = ShardAnswer::Error { code: "invalid_window".into(), message: "long".into() };
        assert_eq!(answer_error(&window_error).unwrap().code, "invalid_window");
    }

    #[test]
    fn windows_and_kinds_parse() {
        assert_eq!(parse_window(None).unwrap().0, WindowSpec::All);
        assert_eq!(parse_window(Some("7d")).unwrap(), (WindowSpec::Last { window_ms: 604_800_000 }, "7d".into()));
        assert_eq!(parse_window(Some("90s")).unwrap().1, "90s");
        assert_eq!(parse_window(Some("7 days")).unwrap_err().code, "invalid_window");
        assert_eq!(parse_kind(Some("direct")).unwrap(), Kind::Direct);
        assert_eq!(parse_kind(Some("sum")).unwrap_err().status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn window_answers_serialize_as_they_always_did() {
        let query = ShardQuery::plain("user:7".into(), "views".into(), Kind::Total, WindowSpec::All);
        let answer = ShardAnswer::Window { value: 42, resolution: "all".into(), from: 0, to: 9 };
        assert_eq!(
            serde_json::to_string(&window_result(&query, "all", &SegmentParams::default(), answer)).unwrap(),
            r#"{"entity":"user:7","from":0,"kind":"total","metric":"views","resolution":"all","to":9,"value":42,"window":"all"}"#
        );
        let refused = ShardAnswer::Error { code: "invalid_window".into(), message: "too long".into() };
        assert_eq!(
            serde_json::to_string(&window_result(&query, "all", &SegmentParams::default(), refused)).unwrap(),
            r#"{"error":{"code":"invalid_window","message":"too long"}}"#
        );
    }

    #[test]
    fn page_tokens_round_trip_and_reject_forgeries() {
        assert_eq!(decode_token(&encode_token("views.total"), check_metric).unwrap(), "views.total");
        assert!(decode_token("!!!", check_metric).is_err());
        assert!(decode_token(&encode_token("NOT A METRIC"), check_metric).is_err());
    }
}
