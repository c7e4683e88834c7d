//! Segment queries in the public API ([`tally_core::segments`]): the parameters
//! `segment.<dimension>=<value>` (a filter; `*`: any value), `by=<dimension>` (a
//! breakdown, largest first, paged by `limit` and `page_token`), checked against the
//! metric's declared dimensions, and the answers' shape. The counter owning the
//! entity sums the combinations (one read of its shard, whatever their number);
//! this side only orders and pages the groups.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tally_core::keys::Count;
use tally_core::segments::{Dimensions, Selector};
use tally_shared::http::page_token;

use crate::error::ApiError;

/// What a query parameter naming a filter starts with.
const FILTER_PREFIX: &str = "segment.";
/// Groups in a breakdown's page unless `limit` says otherwise, and at most.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1_000;

/// The segment part of a read's parameters.
#[derive(Debug, Default)]
pub(crate) struct SegmentParams {
    /// The filters as given (`*` for a wildcard), for the answer.
    pub filters: BTreeMap<String, String>,
    pub by: Option<String>,
    /// The breakdown's page: groups skipped, and at most how many follow.
    pub offset: usize,
    pub limit: usize,
}

impl SegmentParams {
    /// From a batch query's fields (no pages: a batch answers every group).
    pub(crate) fn of(filters: Option<BTreeMap<String, String>>, by: Option<String>) -> Self {
        Self { filters: filters.unwrap_or_default(), by, offset: 0, limit: usize::MAX }
    }

    /// The selector the counter applies; `None` when the read selects no segments.
    pub(crate) fn selector(&self, dimensions: &Dimensions, metric: &str) -> Result<Option<Selector>, ApiError> {
        if self.filters.is_empty() && self.by.is_none() {
            return Ok(None);
        }
        let filters = self
            .filters
            .iter()
            .map(|(dimension, value)| (dimension.clone(), (value != "*").then(|| value.clone())))
            .collect();
        let selector = Selector { filters, by: self.by.clone() };
        selector.check(dimensions, metric).map_err(|reason| ApiError::bad_request("invalid_segment", reason))?;
        Ok(Some(selector))
    }
}

/// Splits a query string into its segment filters and `by` and the rest (its own
/// `limit` and `page_token` included), which is parsed as `T`.
pub(crate) fn split_query_unpaged<T: DeserializeOwned>(raw: Option<&str>) -> Result<(T, SegmentParams), ApiError> {
    split(raw, false)
}

/// Splits a query string into its segment parameters and the rest, which is parsed
/// as `T` (whose own rules refuse unknown parameters).
pub(crate) fn split_query<T: DeserializeOwned>(raw: Option<&str>) -> Result<(T, SegmentParams), ApiError> {
    split(raw, true)
}

/// [`split_query`]; `paged`: `limit` and `page_token` page a breakdown.
fn split<T: DeserializeOwned>(raw: Option<&str>, paged: bool) -> Result<(T, SegmentParams), ApiError> {
    let invalid = |message: String| ApiError::bad_request("invalid_parameter", message);
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw.unwrap_or_default())
        .map_err(|err| invalid(format!("Failed to deserialize query string: {err}")))?;
    let mut segments = SegmentParams { limit: DEFAULT_LIMIT, ..SegmentParams::default() };
    let (mut rest, mut page, mut limited) = (Vec::new(), None, false);
    for (name, value) in pairs {
        if let Some(dimension) = name.strip_prefix(FILTER_PREFIX) {
            if segments.filters.insert(dimension.to_string(), value).is_some() {
                return Err(invalid(format!("{name}: given twice")));
            }
            continue;
        }
        match name.as_str() {
            "by" if segments.by.is_some() => return Err(invalid("by: given twice".into())),
            "by" => segments.by = Some(value),
            "limit" if paged => {
                limited = true;
                segments.limit =
                    value.parse().ok().filter(|limit| (1..=MAX_LIMIT).contains(limit)).ok_or_else(|| {
                        ApiError::bad_request("invalid_limit", format!("limit: must be 1-{MAX_LIMIT}"))
                    })?;
            }
            "page_token" if paged => page = Some(value),
            _ => rest.push((name, value)),
        }
    }
    if let Some(token) = page.filter(|token| !token.is_empty()) {
        let invalid = || ApiError::bad_request("invalid_page_token", "page_token: not a token this API issued");
        let fields = page_token::decode(&token, "g1", 1).ok_or_else(invalid)?;
        segments.offset = fields.first().and_then(|offset| offset.parse().ok()).ok_or_else(invalid)?;
    }
    if segments.by.is_none() && (segments.offset > 0 || limited) {
        return Err(invalid("limit and page_token page a breakdown: give by=<dimension>".into()));
    }
    let rest = serde_urlencoded::to_string(&rest).map_err(|err| invalid(err.to_string()))?;
    let parsed = serde_urlencoded::from_str(&rest)
        .map_err(|err| invalid(format!("Failed to deserialize query string: {err}")))?;
    Ok((parsed, segments))
}

/// One group of a breakdown over a window.
#[derive(Debug, Serialize)]
pub(crate) struct Group {
    pub segment: String,
    pub value: Count,
}

/// One group of a breakdown over a series.
#[derive(Debug, Serialize)]
pub(crate) struct GroupSeries<P> {
    pub points: Vec<P>,
    pub segment: String,
}

/// Groups largest first (by the sum of their points; ties by name), the page asked
/// for, and the token of the next page, if any.
pub(crate) fn page<T>(
    groups: Vec<(String, Vec<Count>)>,
    params: &SegmentParams,
    shape: impl Fn(String, Vec<Count>) -> T,
) -> (Vec<T>, Option<String>) {
    let mut ranked: Vec<(Count, String, Vec<Count>)> = groups
        .into_iter()
        .map(|(segment, points)| (points.iter().fold(0, |sum: Count, v| sum.saturating_add(*v)), segment, points))
        .collect();
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let total = ranked.len();
    let page: Vec<T> = ranked
        .into_iter()
        .skip(params.offset)
        .take(params.limit)
        .map(|(_, segment, points)| shape(segment, points))
        .collect();
    let next = params.offset.saturating_add(page.len());
    let token = (next < total).then(|| page_token::encode("g1", &[&next.to_string()]));
    (page, token)
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Params {
        window: Option<String>,
        max_wait_ms: Option<i64>,
    }

    fn dimensions() -> Dimensions {
        Dimensions::new(BTreeMap::from([("views".to_string(), vec!["country".to_string(), "state".to_string()])]))
            .unwrap()
    }

    #[test]
    fn segment_parameters_split_from_the_rest_and_are_checked() {
        let (params, segments): (Params, _) =
            split_query(Some("window=1h&segment.country=US&segment.state=*&by=state&limit=5&max_wait_ms=7")).unwrap();
        assert_eq!(params, Params { window: Some("1h".into()), max_wait_ms: Some(7) });
        let selector = segments.selector(&dimensions(), "views").unwrap().unwrap();
        assert_eq!(
            selector,
            Selector {
                filters: vec![("country".into(), Some("US".into())), ("state".into(), None)],
                by: Some("state".into())
            }
        );
        assert_eq!(segments.limit, 5);
        let (_, none): (Params, _) = split_query(Some("window=1h")).unwrap();
        assert_eq!(none.selector(&dimensions(), "views").unwrap(), None);
        let code = |query: &str| split_query::<Params>(Some(query)).unwrap_err().code;
        assert_eq!(code("colour=red"), "invalid_parameter");
        assert_eq!(code("segment.country=US&segment.country=FR"), "invalid_parameter");
        assert_eq!(code("by=state&limit=0"), "invalid_limit");
        assert_eq!(code("by=state&page_token=nonsense"), "invalid_page_token");
        assert_eq!(code("limit=5"), "invalid_parameter");
        assert_eq!(code("limit=100"), "invalid_parameter");
        assert_eq!(code("by=state&by=country"), "invalid_parameter");
        let unknown = |query: &str| {
            let (_, segments) = split_query::<Params>(Some(query)).unwrap();
            segments.selector(&dimensions(), "views").unwrap_err()
        };
        assert!(unknown("segment.colour=red").message.contains("has no dimension \"colour\""));
        assert!(unknown("by=device").message.contains("has no dimension \"device\""));
        let long = format!("segment.country={}", "x".repeat(65));
        assert!(unknown(&long).message.contains("1-64 bytes"), "an oversized value");
        let (_, segments) = split_query::<Params>(Some("segment.country=US")).unwrap();
        assert!(segments.selector(&dimensions(), "likes").unwrap_err().message.contains("declares no dimensions"));
    }

    #[test]
    fn groups_page_largest_first() {
        let groups = vec![("a".to_string(), vec![1, 1]), ("b".to_string(), vec![5, 0]), ("c".to_string(), vec![2, 0])];
        let params = SegmentParams { by: Some("d".into()), limit: 2, ..SegmentParams::default() };
        let (first, token) = page(groups.clone(), &params, |segment, points| (segment, points));
        assert_eq!(first, vec![("b".to_string(), vec![5, 0]), ("a".to_string(), vec![1, 1])]);
        let (_, rest): (Params, _) =
            split_query(Some(&format!("by=d&limit=2&page_token={}", token.clone().unwrap()))).unwrap();
        let (second, last) = page(groups, &rest, |segment, points| (segment, points));
        assert_eq!((second, last), (vec![("c".to_string(), vec![2, 0])], None));
    }
}
