//! "Explain a total" (`GET /v1/counters/{entity}/{metric}/contributors`): an entity's
//! own direct count and the ancestors whose direct counts make up the rest of its
//! total, largest first, paginated.
//!
//! Cost and bounds: every page asks tally-graph for the entity's ancestors (at most
//! [`MAX_ANCESTORS`]; more is a 422 `too_many_ancestors`) and reads the direct count of
//! each in one fan-out (one request per counter, chunks of [`READ_CHUNK`] queries),
//! then sorts them: O(A log A) for A ancestors, whatever the page size. The page
//! token carries the read time of the first page, so every page of one listing sums
//! the same window, and `direct + Σ contributors = total` holds exactly across the
//! pages of a listing while no graph change or increment is in flight. Ancestors
//! whose direct count in the window is 0 contribute nothing and are left out.

use std::sync::Arc;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use base64::Engine;
use serde::{Deserialize, Serialize};
use tally_core::validate::check_entity;
use tally_core::wire::{Kind, ShardAnswer, ShardQuery};

use crate::api::{answer_error, check_counter, json_response, now_ms, parse_window, path_error, query_error, ApiState};
use crate::error::ApiError;

/// The most ancestors a contributors listing reads.
pub const MAX_ANCESTORS: usize = 100_000;
/// Queries per fan-out read.
pub const READ_CHUNK: usize = 10_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContributorsParams {
    window: Option<String>,
    limit: Option<usize>,
    page_token: Option<String>,
}

#[derive(Debug, Serialize)]
struct Contributor<'a> {
    entity: &'a str,
    value: i64,
}

#[derive(Debug, Serialize)]
struct Contributors<'a> {
    entity: &'a str,
    metric: &'a str,
    window: &'a str,
    resolution: String,
    from: i64,
    to: i64,
    total: i64,
    direct: i64,
    contributors: Vec<Contributor<'a>>,
    next_page_token: Option<String>,
}

/// Where a listing stands: the read time of its first page and the next offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Position {
    now_ms: i64,
    offset: usize,
}

fn encode_position(position: Position) -> String {
    let text = format!("c1:{}:{}", position.now_ms, position.offset);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
}

fn decode_position(token: &str) -> Result<Position, ApiError> {
    let invalid = || ApiError::bad_request("invalid_page_token", "page_token: not a token this API issued");
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token).map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let mut parts = text.split(':');
    let (Some("c1"), Some(now), Some(offset), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(invalid());
    };
    let now_ms = now.parse::<i64>().ok().filter(|now| *now >= 0).ok_or_else(invalid)?;
    let offset = offset.parse::<usize>().map_err(|_| invalid())?;
    Ok(Position { now_ms, offset })
}

/// The nonzero contributors, largest first (ties by name).
fn rank<'a>(ancestors: &'a [String], values: &[i64]) -> Vec<Contributor<'a>> {
    let mut ranked: Vec<Contributor<'a>> = ancestors
        .iter()
        .zip(values)
        .filter(|(_, value)| **value != 0)
        .map(|(entity, value)| Contributor { entity, value: *value })
        .collect();
    ranked.sort_by(|a, b| b.value.cmp(&a.value).then_with(|| a.entity.cmp(b.entity)));
    ranked
}

pub async fn contributors(
    State(state): State<Arc<ApiState>>,
    path: Result<Path<(String, String)>, PathRejection>,
    params: Result<Query<ContributorsParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Path((entity, metric)) = path.map_err(path_error)?;
    let Query(params) = params.map_err(query_error)?;
    check_counter(&entity, &metric)?;
    let (spec, window) = parse_window(params.window.as_deref())?;
    let limit = params.limit.unwrap_or(100);
    if !(1..=1_000).contains(&limit) {
        return Err(ApiError::bad_request("invalid_limit", "limit: must be 1-1000"));
    }
    let position = match params.page_token.as_deref() {
        None | Some("") => Position { now_ms: now_ms(), offset: 0 },
        Some(token) => decode_position(token)?,
    };
    let timer = state.metrics.request_seconds.with_label_values(&["contributors"]).start_timer();
    let graph = state.fanout.ancestors(&entity, MAX_ANCESTORS).await?;
    if graph.more {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "too_many_ancestors",
            format!("{entity} has more than {MAX_ANCESTORS} ancestors: too many to rank in one request"),
        ));
    }
    // Ancestors' names come from the graph, which checked them when they arrived.
    debug_assert!(graph.entities.iter().all(|a| check_entity(a).is_ok()));
    let query = |entity: &str, kind| ShardQuery { entity: entity.to_string(), metric: metric.clone(), kind, spec };
    let mut queries = vec![query(&entity, Kind::Total), query(&entity, Kind::Direct)];
    queries.extend(graph.entities.iter().map(|ancestor| query(ancestor, Kind::Direct)));
    let mut answers = Vec::with_capacity(queries.len());
    for chunk in queries.chunks(READ_CHUNK) {
        answers.extend(state.fanout.read(chunk.to_vec(), position.now_ms).await?);
    }
    timer.observe_duration();
    if let Some(err) = answers.iter().find_map(answer_error) {
        return Err(err);
    }
    let mut values = Vec::with_capacity(answers.len());
    let mut window_of_total = None;
    for answer in answers {
        match answer {
            ShardAnswer::Window { value, resolution, from, to } => {
                window_of_total.get_or_insert((resolution, from, to));
                values.push(value);
            }
            _ => return Err(ApiError::unavailable("unexpected answer")),
        }
    }
    let (Some((resolution, from, to)), [total, direct, ancestor_values @ ..]) = (window_of_total, values.as_slice())
    else {
        return Err(ApiError::unavailable("no answer"));
    };
    let ranked = rank(&graph.entities, ancestor_values);
    let page: Vec<Contributor> = ranked.into_iter().skip(position.offset).take(limit + 1).collect();
    let more = page.len() > limit;
    let mut page = page;
    page.truncate(limit);
    let next_page_token =
        more.then(|| encode_position(Position { now_ms: position.now_ms, offset: position.offset + limit }));
    json_response(&Contributors {
        entity: &entity,
        metric: &metric,
        window: &window,
        resolution,
        from,
        to,
        total: *total,
        direct: *direct,
        contributors: page,
        next_page_token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip_and_reject_forgeries() {
        let position = Position { now_ms: 1_763_780_000_000, offset: 200 };
        assert_eq!(decode_position(&encode_position(position)).unwrap(), position);
        for forged in ["", "!!", "YzE6MTp4", "YzI6MToy", "YzE6LTE6Mg", "YzE6MToyOjM"] {
            assert_eq!(decode_position(forged).unwrap_err().code, "invalid_page_token", "{forged}");
        }
    }

    #[test]
    fn contributors_rank_largest_first_without_zeros() {
        let ancestors: Vec<String> = ["a", "b", "c", "d", "e"].iter().map(|s| s.to_string()).collect();
        let ranked = rank(&ancestors, &[3, 0, 7, 3, -2]);
        let got: Vec<(&str, i64)> = ranked.iter().map(|c| (c.entity, c.value)).collect();
        assert_eq!(got, vec![("c", 7), ("a", 3), ("d", 3), ("e", -2)]);
    }
}
