//! "Explain a total" (`GET /v1/counters/{entity}/{metric}/contributors`): an entity's
//! own direct count and the ancestors whose direct counts make up the rest of its
//! total, largest first, paginated.
//!
//! Cost and bounds: every page asks tally-graph for the entity's ancestors (at most
//! [`MAX_ANCESTORS`]; more is a 422 `too_many_ancestors`) and reads the direct count of
//! each at one read time (fan-outs of up to [`READ_CHUNK`] queries, each one request
//! per counter),
//! then sorts them: O(A log A) for A ancestors, whatever the page size. The page
//! token carries the read time of the first page (refused after an hour) and the
//! last contributor shown, so every page of one listing sums the same window and
//! continues after that contributor in rank order; `direct + Σ contributors = total`
//! holds exactly across the pages of a listing while no graph change or increment is
//! in flight. Ancestors whose direct count in the window is 0 contribute nothing and
//! are left out.

use std::sync::Arc;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use tally_core::keys::Count;
use tally_core::validate::check_entity;
use tally_core::wire::{Kind, ShardAnswer, ShardQuery};
use tally_shared::http::page_token;

use crate::api::{answer_error, check_counter, json_response, now_ms, parse_window, path_error, ApiState};
use crate::error::ApiError;
use crate::freshness::{check_staleness, AsOf};

/// The most ancestors a contributors listing reads (as many as tally-graph walks).
pub const MAX_ANCESTORS: usize = tally_core::wire::GraphAncestorsRequest::MAX_LIMIT;
/// Queries per fan-out read.
pub const READ_CHUNK: usize = 10_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContributorsParams {
    window: Option<String>,
    limit: Option<usize>,
    page_token: Option<String>,
    max_staleness_ms: Option<i64>,
    after: Option<String>,
    max_wait_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
struct Contributor<'a> {
    entity: &'a str,
    value: Count,
}

#[derive(Debug, Serialize)]
struct Contributors<'a> {
    /// How fresh each shard read was (the oldest answer of a shard read twice).
    as_of: Vec<AsOf>,
    entity: &'a str,
    metric: &'a str,
    window: &'a str,
    resolution: String,
    from: i64,
    to: i64,
    total: Count,
    direct: Count,
    contributors: Vec<Contributor<'a>>,
    next_page_token: Option<String>,
    /// The segment filters explained (`segment.<dimension>=<value>`), if any: every
    /// count above is of the combinations they select.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    segments: &'a std::collections::BTreeMap<String, String>,
}

/// How old a page token's read time may be: a listing is read page after page
/// within minutes, and a read time much older than its buckets' retention would
/// read buckets past it.
const TOKEN_MAX_AGE_MS: i64 = 3_600_000;

/// Where a listing stands: the read time of its first page, and the last
/// contributor shown (pages continue after it in rank order, so the others keep
/// their place when some value changes between pages; a contributor whose own value
/// moves it across that point may be missed or shown twice).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Position {
    now_ms: i64,
    after: Option<(Count, String)>,
}

fn encode_position(position: &Position) -> String {
    let (value, entity) = position.after.clone().unwrap_or_default();
    page_token::encode("c2", &[&position.now_ms.to_string(), &value.to_string(), &entity])
}

/// The position a token carries, refused unless this API issued it within the last
/// [`TOKEN_MAX_AGE_MS`] (by its read time; a minute of clock skew allowed).
fn decode_position(token: &str, now_ms: i64) -> Result<Position, ApiError> {
    let invalid = || ApiError::bad_request("invalid_page_token", "page_token: not a token this API issued");
    let fields = page_token::decode(token, "c2", 3).ok_or_else(invalid)?;
    let [read_at, value, entity] = fields.as_slice() else { return Err(invalid()) };
    let read_at = read_at.parse::<i64>().map_err(|_| invalid())?;
    if !(now_ms - TOKEN_MAX_AGE_MS..=now_ms + 60_000).contains(&read_at) {
        return Err(ApiError::bad_request(
            "expired_page_token",
            "page_token: issued more than an hour ago; start the listing again",
        ));
    }
    let value = value.parse::<Count>().map_err(|_| invalid())?;
    check_entity(entity).map_err(|_| invalid())?;
    Ok(Position { now_ms: read_at, after: Some((value, entity.to_string())) })
}

/// The nonzero contributors, largest first (ties by name).
fn rank<'a>(ancestors: &'a [String], values: &[Count]) -> Vec<Contributor<'a>> {
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
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let Path((entity, metric)) = path.map_err(path_error)?;
    let (params, segments): (ContributorsParams, _) = crate::segments::split_query_unpaged(raw.as_deref())?;
    check_counter(&entity, &metric)?;
    if segments.by.is_some() {
        return Err(ApiError::bad_request(
            "invalid_segment",
            "contributors explain one selection: give segment.<dimension> filters, not by",
        ));
    }
    let selector = segments.selector(&state.dimensions, &metric)?;
    let (spec, window) = parse_window(params.window.as_deref())?;
    let limit = params.limit.unwrap_or(100);
    if !(1..=1_000).contains(&limit) {
        return Err(ApiError::bad_request("invalid_limit", "limit: must be 1-1000"));
    }
    let position = match params.page_token.as_deref() {
        None | Some("") => Position { now_ms: now_ms(), after: None },
        Some(token) => decode_position(token, now_ms())?,
    };
    let staleness = check_staleness(params.max_staleness_ms)?;
    let after = crate::after::parse(params.after.as_deref(), params.max_wait_ms)?;
    let timer = state.metrics.request_seconds.with_label_values(&["contributors"]).start_timer();
    // With write tokens, the ancestors and every direct count read hold them: the
    // wait of a total read is one for every shard and the graph.
    let mut reached = match &after {
        Some(after) => {
            let mut touches = crate::after::Touches::default();
            touches.add(state.fanout.shard_of(&entity), Kind::Total);
            state.fanout.wait_after(after, &touches).await?
        }
        None => Default::default(),
    };
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
    let query = |entity: &str, kind| ShardQuery {
        segments: selector.clone(),
        ..ShardQuery::plain(entity.to_string(), metric.clone(), kind, spec)
    };
    let mut queries = vec![query(&entity, Kind::Total), query(&entity, Kind::Direct)];
    queries.extend(graph.entities.iter().map(|ancestor| query(ancestor, Kind::Direct)));
    let mut answers = Vec::with_capacity(queries.len());
    let mut as_of: std::collections::BTreeMap<u32, AsOf> = std::collections::BTreeMap::new();
    for chunk in queries.chunks(READ_CHUNK) {
        let answered = state.fanout.read(chunk.to_vec(), position.now_ms, staleness, None).await?;
        answers.extend(answered.answers);
        for mut fresh in answered.as_of {
            if let Some(through) = reached.remove(&fresh.shard) {
                fresh.through = through;
            }
            as_of.entry(fresh.shard).or_insert(fresh);
        }
    }
    timer.observe_duration();
    if let Some(err) = answers
        .iter()
        .zip(&queries)
        .find_map(|(answer, query)| answer_error(answer).or_else(|| crate::api::unsegmented_answer(query, answer)))
    {
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
            // Filters only: one group, one point.
            ShardAnswer::Segments { resolution, from, to, groups, .. } => {
                window_of_total.get_or_insert((resolution, from, to));
                values.push(groups.first().and_then(|(_, points)| points.first().copied()).unwrap_or(0));
            }
            _ => return Err(ApiError::unavailable("unexpected answer")),
        }
    }
    let (Some((resolution, from, to)), [total, direct, ancestor_values @ ..]) = (window_of_total, values.as_slice())
    else {
        return Err(ApiError::unavailable("no answer"));
    };
    let ranked = rank(&graph.entities, ancestor_values);
    let start = match &position.after {
        None => 0,
        Some((value, entity)) => {
            ranked.partition_point(|c| (std::cmp::Reverse(c.value), c.entity) <= (std::cmp::Reverse(*value), entity))
        }
    };
    let mut page: Vec<Contributor> = ranked.into_iter().skip(start).take(limit + 1).collect();
    let more = page.len() > limit;
    page.truncate(limit);
    let next_page_token = more.then(|| {
        let last = page.last().map(|c| (c.value, c.entity.to_string()));
        encode_position(&Position { now_ms: position.now_ms, after: last })
    });
    json_response(&Contributors {
        as_of: as_of.into_values().collect(),
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
        segments: &segments.filters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip_and_reject_forgeries_and_old_tokens() {
        let now = 1_763_780_000_000;
        let position = Position { now_ms: now - 5_000, after: Some((-3, "a:b:c".into())) };
        assert_eq!(decode_position(&encode_position(&position), now).unwrap(), position);
        let forgeries = [
            "".to_string(),
            "!!".to_string(),
            page_token::encode("c1", &["1", "2"]),
            page_token::encode("c2", &["x", "1", "a"]),
            page_token::encode("c2", &["1763780000000", "x", "a"]),
            page_token::encode("c2", &["1763780000000", "1", "a\tb"]),
        ];
        for forged in &forgeries {
            assert_eq!(decode_position(forged, now).unwrap_err().code, "invalid_page_token", "{forged}");
        }
        for stale in [now - TOKEN_MAX_AGE_MS - 1, now + 60_001, i64::MAX, 0] {
            let token = encode_position(&Position { now_ms: stale, after: Some((1, "a".into())) });
            assert_eq!(decode_position(&token, now).unwrap_err().code, "expired_page_token", "{stale}");
        }
    }

    #[test]
    fn pages_continue_after_the_last_contributor_shown() {
        let ancestors: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let ranked = rank(&ancestors, &[5, 9, 5, 1]);
        let after = (5, "a".to_string());
        let start = ranked.partition_point(|c| {
            (std::cmp::Reverse(c.value), c.entity) <= (std::cmp::Reverse(after.0), after.1.as_str())
        });
        let rest: Vec<&str> = ranked[start..].iter().map(|c| c.entity).collect();
        assert_eq!(rest, vec!["c", "d"]);
    }

    #[test]
    fn contributors_rank_largest_first_without_zeros() {
        let ancestors: Vec<String> = ["a", "b", "c", "d", "e"].iter().map(|s| s.to_string()).collect();
        let ranked = rank(&ancestors, &[3, 0, 7, 3, -2]);
        let got: Vec<(&str, Count)> = ranked.iter().map(|c| (c.entity, c.value)).collect();
        assert_eq!(got, vec![("c", 7), ("a", 3), ("d", 3), ("e", -2)]);
    }
}
