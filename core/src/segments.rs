//! Segmented counters: an increment's `segments` (dimension → value), how a segment
//! combination is named inside tally, and which combinations a segment query selects.
//!
//! A combination travels and is stored as a **segmented metric**: the metric, then
//! [`COMBINATION`] (0x01), then its pairs sorted by dimension, each `name 0x1e value`,
//! joined by 0x1f. Names, values and metrics hold no control characters, so the
//! separators are unambiguous, and a counter's combinations sort right after its own
//! keys (`metric 0x00 …` < `metric 0x01 …`), where one scan finds them all. Every
//! path that carries a metric (shard records, totals, descendant moves, the count keys)
//! carries a segmented one unchanged; only the counter's apply splits it (the
//! increment counts under the plain metric and under its combination) and its reads
//! select among combinations.
//!
//! The **overflow combination** is the metric followed by [`COMBINATION`] alone: where
//! an entity's metric reached its cap of combinations, new ones count there (under the
//! plain metric as always); no filter selects it, and a breakdown reports it apart.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Starts the combination part of a segmented metric.
pub const COMBINATION: char = '\u{1}';
/// Separates a pair's dimension from its value.
const NAME_VALUE: char = '\u{1e}';
/// Separates pairs.
const PAIRS: char = '\u{1f}';
/// Most dimensions one increment carries.
pub const MAX_DIMENSIONS: usize = 8;
/// Longest dimension name or value, in bytes.
pub const MAX_SEGMENT_BYTES: usize = 64;
/// Combinations an entity's metric keeps by default before new ones overflow
/// (`counting.max_segment_combinations`).
pub const DEFAULT_MAX_COMBINATIONS: u32 = 10_000;

/// A dimension's name matches `[a-z0-9_]{1,64}`.
pub fn check_dimension(name: &str) -> Result<(), String> {
    let allowed = |b: u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_');
    if name.is_empty() || name.len() > MAX_SEGMENT_BYTES || !name.bytes().all(allowed) {
        return Err(format!("segments: dimension {name:?} must match [a-z0-9_]{{1,64}}"));
    }
    Ok(())
}

/// A segment's value is 1–64 bytes of UTF-8 without control characters, and not
/// `*` (a query's "any value").
pub fn check_value(dimension: &str, value: &str) -> Result<(), String> {
    if value.is_empty() || value.len() > MAX_SEGMENT_BYTES {
        return Err(format!("segments: {dimension}'s value must be 1-64 bytes of UTF-8"));
    }
    if value == "*" {
        return Err(format!("segments: {dimension}'s value must not be * (what a query says for any value)"));
    }
    if value.chars().any(char::is_control) {
        return Err(format!("segments: {dimension}'s value must not contain control characters"));
    }
    Ok(())
}

/// The dimensions each metric declares (`counting.dimensions`): an increment may
/// carry segments only of its metric's dimensions, and a query filter or break down
/// only by them. A metric declares none unless listed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dimensions(BTreeMap<String, Vec<String>>);

impl Dimensions {
    /// Declarations checked: metric names valid, at most [`MAX_DIMENSIONS`] distinct
    /// valid dimension names each.
    pub fn new(declared: BTreeMap<String, Vec<String>>) -> Result<Self, String> {
        for (metric, dimensions) in &declared {
            crate::validate::check_metric(metric).map_err(|reason| format!("{metric:?}: {reason}"))?;
            if dimensions.len() > MAX_DIMENSIONS {
                return Err(format!("{metric}: at most {MAX_DIMENSIONS} dimensions, not {}", dimensions.len()));
            }
            for (at, name) in dimensions.iter().enumerate() {
                check_dimension(name).map_err(|reason| format!("{metric}: {reason}"))?;
                if dimensions[..at].contains(name) {
                    return Err(format!("{metric}: dimension {name} declared twice"));
                }
            }
        }
        Ok(Self(declared))
    }

    /// The dimensions `metric` declares (none: empty).
    pub fn of(&self, metric: &str) -> &[String] {
        self.0.get(metric).map_or(&[], Vec::as_slice)
    }

    /// Checks `dimension` for a query of `metric`.
    pub fn check_query(&self, metric: &str, dimension: &str) -> Result<(), String> {
        if self.of(metric).iter().any(|d| d == dimension) {
            return Ok(());
        }
        Err(match self.of(metric) {
            [] => format!("metric {metric} declares no dimensions (counting.dimensions)"),
            declared => format!("{metric} has no dimension {dimension:?}; it has {}", declared.join(", ")),
        })
    }

    /// The segmented metric of an increment of `metric` with `segments` (pairs in any
    /// order), or why they are refused: an undeclared or repeated dimension, a bad
    /// value, more than [`MAX_DIMENSIONS`]. No segments: the metric itself.
    pub fn segmented(&self, metric: &str, segments: &[(&str, &str)]) -> Result<Option<String>, String> {
        if segments.is_empty() {
            return Ok(None);
        }
        if segments.len() > MAX_DIMENSIONS {
            return Err(format!("segments: at most {MAX_DIMENSIONS} dimensions, not {}", segments.len()));
        }
        let declared = self.of(metric);
        let mut sorted: Vec<(&str, &str)> = Vec::with_capacity(segments.len());
        for &(name, value) in segments {
            if !declared.iter().any(|d| d == name) {
                check_dimension(name)?;
                return Err(match declared {
                    [] => format!("segments: metric {metric} declares no dimensions (counting.dimensions)"),
                    _ => format!("segments: {metric} has no dimension {name:?}; it has {}", declared.join(", ")),
                });
            }
            check_value(name, value)?;
            sorted.push((name, value));
        }
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(format!("segments: dimension {} given twice", pair[0].0));
        }
        let mut out = String::with_capacity(
            metric.len() + 1 + segments.iter().map(|(n, v)| n.len() + v.len() + 2).sum::<usize>(),
        );
        out.push_str(metric);
        out.push(COMBINATION);
        for (at, (name, value)) in sorted.iter().enumerate() {
            if at > 0 {
                out.push(PAIRS);
            }
            out.push_str(name);
            out.push(NAME_VALUE);
            out.push_str(value);
        }
        Ok(Some(out))
    }
}

/// A segmented metric, split: `metric` is the plain one, `full` the whole name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Combination<'a> {
    pub metric: &'a str,
    pub full: &'a str,
}

impl<'a> Combination<'a> {
    /// The combination of a segmented metric; `None` for a plain one.
    pub fn of(name: &'a str) -> Option<Self> {
        let at = name.find(COMBINATION)?;
        Some(Self { metric: &name[..at], full: name })
    }

    /// Its pairs, `(dimension, value)`, sorted by dimension; none for the overflow
    /// combination.
    pub fn pairs(&self) -> impl Iterator<Item = (&'a str, &'a str)> {
        let body = &self.full[self.metric.len() + COMBINATION.len_utf8()..];
        body.split(PAIRS).filter(|pair| !pair.is_empty()).map(|pair| pair.split_once(NAME_VALUE).unwrap_or((pair, "")))
    }

    /// The overflow combination of its metric (a prefix of its own name).
    pub fn overflow(&self) -> &'a str {
        &self.full[..self.metric.len() + COMBINATION.len_utf8()]
    }

    /// Whether it is its metric's overflow combination.
    pub fn is_overflow(&self) -> bool {
        self.full.len() == self.metric.len() + COMBINATION.len_utf8()
    }
}

/// The plain metric of a metric name, segmented or not.
pub fn plain_metric(name: &str) -> &str {
    Combination::of(name).map_or(name, |combination| combination.metric)
}

/// The prefix every combination of `metric` starts with.
pub fn combinations_prefix(metric: &str) -> String {
    let mut prefix = String::with_capacity(metric.len() + 1);
    prefix.push_str(metric);
    prefix.push(COMBINATION);
    prefix
}

/// What a segment query selects: combinations holding every filtered dimension (with
/// the given value, or any value for `None`: a wildcard), grouped by the value of
/// dimension `by`, if any (combinations without it are left out).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Selector {
    pub filters: Vec<(String, Option<String>)>,
    pub by: Option<String>,
}

/// Where a combination's counts go under a [`Selector`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selected<'a> {
    /// Into the group of this value of `by` ("" without `by`).
    Group(&'a str),
    /// Into the overflow, reported apart (it may hold any value).
    Overflow,
}

impl Selector {
    /// Where the combination's counts go; `None`: not selected.
    pub fn select<'a>(&self, combination: &Combination<'a>) -> Option<Selected<'a>> {
        if combination.is_overflow() {
            return Some(Selected::Overflow);
        }
        for (dimension, wanted) in &self.filters {
            let value = combination.pairs().find(|(name, _)| name == dimension).map(|(_, value)| value)?;
            if wanted.as_deref().is_some_and(|wanted| wanted != value) {
                return None;
            }
        }
        match &self.by {
            None => Some(Selected::Group("")),
            Some(by) => combination.pairs().find(|(name, _)| name == by).map(|(_, value)| Selected::Group(value)),
        }
    }

    /// Checks every dimension it names against `metric`'s declared ones.
    pub fn check(&self, dimensions: &Dimensions, metric: &str) -> Result<(), String> {
        for (dimension, value) in &self.filters {
            dimensions.check_query(metric, dimension)?;
            if let Some(value) = value {
                check_value(dimension, value)?;
            }
        }
        if let Some(by) = &self.by {
            dimensions.check_query(metric, by)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn dimensions() -> Dimensions {
        Dimensions::new(BTreeMap::from([(
            "views".to_string(),
            vec!["country".to_string(), "state".to_string(), "device".to_string()],
        )]))
        .unwrap()
    }

    #[test]
    fn a_combination_is_named_in_dimension_order_and_split_back() {
        let dims = dimensions();
        let name = dims.segmented("views", &[("state", "CA"), ("country", "US")]).unwrap().unwrap();
        assert_eq!(name, "views\u{1}country\u{1e}US\u{1f}state\u{1e}CA");
        let combination = Combination::of(&name).unwrap();
        assert_eq!(combination.metric, "views");
        assert_eq!(combination.pairs().collect::<Vec<_>>(), vec![("country", "US"), ("state", "CA")]);
        assert_eq!(combination.overflow(), "views\u{1}");
        assert!(Combination::of(combination.overflow()).unwrap().is_overflow());
        assert_eq!(plain_metric(&name), "views");
        assert_eq!(plain_metric("views"), "views");
        assert_eq!(dims.segmented("views", &[]).unwrap(), None);
    }

    #[test]
    fn bad_segments_are_refused_with_reasons() {
        let dims = dimensions();
        let refused = |metric: &str, segments: &[(&str, &str)]| dims.segmented(metric, segments).unwrap_err();
        assert!(refused("views", &[("colour", "red")]).contains("has no dimension \"colour\"; it has country"));
        assert!(refused("likes", &[("country", "US")]).contains("declares no dimensions"));
        assert!(refused("views", &[("country", "")]).contains("1-64 bytes"));
        assert!(refused("views", &[("country", &"x".repeat(65))]).contains("1-64 bytes"));
        assert!(refused("views", &[("country", "U\tS")]).contains("control characters"));
        assert!(refused("views", &[("country", "*")]).contains("must not be *"));
        assert!(refused("views", &[("Bad!", "x")]).contains("[a-z0-9_]"));
        let nine: Vec<(&str, &str)> = (0..9).map(|_| ("country", "US")).collect();
        assert!(refused("views", &nine).contains("at most 8"));
        assert!(refused("views", &[("country", "US"), ("country", "FR")]).contains("given twice"));
        let many = BTreeMap::from([("m".to_string(), (0..9).map(|i| format!("d{i}")).collect())]);
        assert!(Dimensions::new(many).unwrap_err().contains("at most 8"));
        assert!(Dimensions::new(BTreeMap::from([("m".into(), vec!["d".into(), "d".into()])])).is_err());
        assert!(dims.check_query("views", "device").is_ok());
        assert!(dims.check_query("views", "colour").is_err());
    }

    fn combination_of(pairs: &[(u8, u8)]) -> Option<String> {
        let names = ["country", "state", "device"];
        let mut seen = std::collections::BTreeMap::new();
        for &(d, v) in pairs {
            seen.insert(names[d as usize % 3], format!("v{v}"));
        }
        let segments: Vec<(&str, &str)> = seen.iter().map(|(n, v)| (*n, v.as_str())).collect();
        dimensions().segmented("views", &segments).unwrap()
    }

    proptest! {
        /// A selector picks exactly the combinations whose pairs satisfy every filter
        /// (checked on the pairs as a map), grouped by `by`'s value.
        #[test]
        fn selection_agrees_with_the_pairs_as_a_map(
            pairs in proptest::collection::vec((0u8..3, 0u8..3), 1..4),
            filters in proptest::collection::vec((0u8..3, proptest::option::of(0u8..3)), 0..3),
            by in proptest::option::of(0u8..3),
        ) {
            let names = ["country", "state", "device"];
            let name = combination_of(&pairs).unwrap();
            let combination = Combination::of(&name).unwrap();
            let map: BTreeMap<&str, &str> = combination.pairs().collect();
            let selector = Selector {
                filters: filters.iter().map(|&(d, v)| (names[d as usize].to_string(), v.map(|v| format!("v{v}")))).collect(),
                by: by.map(|d| names[d as usize].to_string()),
            };
            let matches = selector.filters.iter().all(|(d, v)| map.get(d.as_str()).is_some_and(|got| v.as_deref().is_none_or(|v| v == *got)));
            let expected = match (&selector.by, matches) {
                (_, false) => None,
                (None, true) => Some(Selected::Group("")),
                (Some(by), true) => map.get(by.as_str()).map(|v| Selected::Group(v)),
            };
            prop_assert_eq!(selector.select(&combination), expected);
            prop_assert_eq!(selector.select(&Combination::of("views\u{1}").unwrap()), Some(Selected::Overflow));
        }
    }
}
