//! Parsing and validation of producer messages: increments and graph
//! updates.
//!
//! A message holds one JSON object or an array of them. Every element is either
//! accepted as a typed [`IncrementCow`] / [`GraphUpdate`] or rejected with a precise
//! reason; a bad element in an array rejects that element only.

mod scan;

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::graph::{EdgeOp, EdgeUpdate};
use crate::segments::Dimensions;
use crate::validate::{check_entity, check_id, check_metric};
use crate::wire::{GraphUpdate, IncrementCow};

/// One element (or the whole message) a producer got wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection<'a> {
    /// Position in the array, `None` when the message itself was rejected or was a
    /// single object.
    pub index: Option<u32>,
    /// What is wrong, naming the field: `metric: must match [a-z0-9_.:-]{1,64}`.
    pub reason: String,
    /// The bytes of the rejected element (the whole message when `index` is `None`).
    pub raw: &'a [u8],
}

/// The fields a rejection can name, as the bounded label that counts rejections
/// by reason (`tally_ingester_dead_letters_total{reason}`); `other` for any not listed.
pub const REASON_FIELDS: [&str; 12] =
    ["message", "element", "entity", "metric", "delta", "ts", "id", "segments", "op", "from", "to", "other"];

impl Rejection<'_> {
    /// The index in [`REASON_FIELDS`] of the field its reason names (the reason's
    /// text up to its first `:`, a path's first part: `segments.country`).
    pub fn field(&self) -> usize {
        let path = self.reason.split(':').next().unwrap_or_default();
        let named = path.split('.').next().unwrap_or_default();
        let other = REASON_FIELDS.len() - 1;
        REASON_FIELDS[..other].iter().position(|field| *field == named).unwrap_or(other)
    }
}

/// The numbers an increment may carry. Anything outside is refused with a
/// reason naming the setting, never wrapped, and never counted into buckets that
/// can no longer hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest `|delta|` accepted (`ingester.max_abs_delta`).
    pub max_abs_delta: i64,
    /// How far past the ingester's clock a `ts` may lie (`ingester.max_future_ms`).
    pub max_future_ms: i64,
    /// How far behind the clock a `ts` may lie: the longest retention of the
    /// configured resolutions, past which no bucket keeps the event.
    pub max_age_ms: i64,
}

impl Limits {
    /// `|delta|` up to 2^53: every count stays exact as a JSON number in every
    /// reader, and 1 024 of the largest still fit one i64 total.
    pub const DEFAULT_MAX_ABS_DELTA: i64 = 1 << 53;
    pub const DEFAULT_MAX_FUTURE_MS: i64 = 3_600_000;
    /// No bound but the epoch: for tests and benchmarks of the parse alone.
    pub const NONE: Limits = Limits { max_abs_delta: i64::MAX, max_future_ms: i64::MAX, max_age_ms: i64::MAX };

    /// The limits with the default bounds and `resolutions`' longest retention.
    pub fn new(resolutions: &crate::time::Resolutions) -> Self {
        Self {
            max_abs_delta: Self::DEFAULT_MAX_ABS_DELTA,
            max_future_ms: Self::DEFAULT_MAX_FUTURE_MS,
            max_age_ms: resolutions.longest_retention_ms(),
        }
    }

    /// The window of event times accepted at `now_ms`.
    pub fn at(self, now_ms: i64) -> Bounds {
        Bounds {
            limits: self,
            earliest_ts: now_ms.saturating_sub(self.max_age_ms),
            latest_ts: now_ms.saturating_add(self.max_future_ms),
        }
    }
}

/// [`Limits`] at one moment: what [`parse_increments`] checks each increment against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    limits: Limits,
    earliest_ts: i64,
    latest_ts: i64,
}

impl Bounds {
    /// Accepts every `delta` and every `ts` from the epoch on: for tests and
    /// benchmarks of the parse alone.
    pub fn none() -> Self {
        Self { limits: Limits::NONE, earliest_ts: 0, latest_ts: i64::MAX }
    }

    fn check(&self, delta: i64, ts: i64) -> Result<(), String> {
        let Limits { max_abs_delta, max_future_ms, max_age_ms } = self.limits;
        if delta.unsigned_abs() > max_abs_delta.unsigned_abs() {
            return Err(format!("delta: {delta} is beyond ±{max_abs_delta} (ingester.max_abs_delta)"));
        }
        if ts < 0 {
            return Err("ts: must be milliseconds since the epoch (>= 0)".into());
        }
        if ts > self.latest_ts {
            return Err(format!(
                "ts: {ts} is more than {} ahead of the ingester's clock (ingester.max_future_ms)",
                crate::time::format_duration(max_future_ms.unsigned_abs())
            ));
        }
        if ts < self.earliest_ts {
            return Err(format!(
                "ts: {ts} is older than the longest retention ({}): no bucket keeps it",
                crate::time::format_duration(max_age_ms.unsigned_abs())
            ));
        }
        Ok(())
    }
}

/// The increment as producers write it, before the naming rules are checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIncrement<'a> {
    #[serde(borrow)]
    entity: Cow<'a, str>,
    #[serde(borrow)]
    metric: Cow<'a, str>,
    #[serde(default)]
    delta: Option<i64>,
    #[serde(default)]
    ts: Option<i64>,
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
    /// Dimension → value ([`crate::segments`]); a JSON object of strings.
    #[serde(default, borrow)]
    segments: Option<BTreeMap<Cow<'a, str>, Cow<'a, str>>>,
}

/// A struct read only from a JSON object. serde's derived structs also take an array
/// of their fields in order (`["user:7","views"]`), which producers' messages must not
/// hold: such an element is rejected, as the element-by-element way rejects it.
struct ObjectOnly<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Visit<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        deserializer.deserialize_map(Visit(std::marker::PhantomData)).map(ObjectOnly)
    }
}

/// Parses an increments message, calling `accept(index, increment)` for each valid
/// element (its names borrowed from `payload` where they can be) and
/// `reject(rejection)` for each invalid one, in message order.
///
/// `record_ts` is the Kafka record's timestamp: the event time of increments that
/// carry no `ts`; `bounds` are what their numbers must keep; `dimensions` what
/// segments each metric may carry.
pub fn parse_increments<'a>(
    payload: &'a [u8],
    record_ts: i64,
    bounds: &Bounds,
    dimensions: &Dimensions,
    mut accept: impl FnMut(u32, IncrementCow<'a>),
    reject: impl FnMut(Rejection<'a>),
) {
    // Most messages are arrays of valid increments: those are read in one pass, by
    // the scanner when they are plain (`scan`), else by serde_json. A message with
    // anything to reject goes the element-by-element way, which names each bad
    // element and its bytes (and accepts the same valid ones).
    // A single plain object read by the scanner and valid is accepted as it is;
    // anything else about it the general way decides.
    if first_significant_byte(payload) == Some(b'{') {
        if let Some(increment) =
            scan::plain_increment(payload).and_then(|raw| checked(raw, record_ts, bounds, dimensions).ok())
        {
            return accept(0, increment);
        }
    } else if first_significant_byte(payload) == Some(b'[') {
        let all_checked = |raws: Vec<RawIncrement<'a>>| -> Option<Vec<IncrementCow<'a>>> {
            raws.into_iter().map(|raw| checked(raw, record_ts, bounds, dimensions)).collect::<Result<Vec<_>, _>>().ok()
        };
        let all_valid = match scan::plain_increments(payload) {
            Some(raws) => all_checked(raws),
            None => serde_json::from_slice::<Vec<ObjectOnly<RawIncrement>>>(payload)
                .ok()
                .and_then(|raws| all_checked(raws.into_iter().map(|ObjectOnly(raw)| raw).collect())),
        };
        if let Some(increments) = all_valid {
            for (index, increment) in increments.into_iter().enumerate() {
                accept(u32::try_from(index).unwrap_or(u32::MAX), increment);
            }
            return;
        }
    }
    parse_elements(payload, |raw| parse_one(raw, record_ts, bounds, dimensions), accept, reject);
}

/// Parses a graph message (`add_edge` / `remove_edge` objects) like
/// [`parse_increments`].
pub fn parse_graph_updates<'a>(
    payload: &'a [u8],
    accept: impl FnMut(u32, GraphUpdate),
    reject: impl FnMut(Rejection<'a>),
) {
    parse_elements(payload, parse_graph_update, accept, reject);
}

/// One object or an array of objects, each parsed by `parse`.
fn parse_elements<'a, T>(
    payload: &'a [u8],
    parse: impl Fn(&'a str) -> Result<T, String>,
    mut accept: impl FnMut(u32, T),
    mut reject: impl FnMut(Rejection<'a>),
) {
    let whole = |reason: String| Rejection { index: None, reason, raw: payload };
    match first_significant_byte(payload) {
        Some(b'{') => match std::str::from_utf8(payload) {
            Ok(text) => match parse(text) {
                Ok(element) => accept(0, element),
                Err(reason) => reject(whole(reason)),
            },
            Err(err) => reject(whole(format!("message: invalid UTF-8: {err}"))),
        },
        Some(b'[') => {
            let elements: Vec<&RawValue> = match serde_json::from_slice(payload) {
                Ok(elements) => elements,
                Err(err) => return reject(whole(format!("message: invalid JSON array: {err}"))),
            };
            for (index, element) in elements.into_iter().enumerate() {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                let text = element.get();
                match parse(text) {
                    Ok(parsed) => accept(index, parsed),
                    Err(reason) => reject(Rejection { index: Some(index), reason, raw: text.as_bytes() }),
                }
            }
        }
        _ => reject(whole("message: expected a JSON object or an array of objects".into())),
    }
}

fn first_significant_byte(payload: &[u8]) -> Option<u8> {
    payload.iter().copied().find(|b| !b.is_ascii_whitespace())
}

/// Deserializes one JSON object, naming the field that is wrong.
fn deserialize_object<'a, T: Deserialize<'a>>(text: &'a str) -> Result<T, String> {
    if first_significant_byte(text.as_bytes()) != Some(b'{') {
        return Err("element: expected a JSON object".into());
    }
    parse_naming_the_field(text, "element")
}

/// Parses `text` as a `T`; a refusal names the field at fault (`priority: invalid
/// value…`), or `what` when the fault is the whole (`job: missing field…`).
pub(crate) fn parse_naming_the_field<'a, T: Deserialize<'a>>(text: &'a str, what: &str) -> Result<T, String> {
    // Most input is valid: parse without tracking the path, and only for input
    // that fails again with it, to name the field (the same parser accepts the same).
    if let Ok(parsed) = serde_json::from_str(text) {
        return Ok(parsed);
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let parsed: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if path == "." || path.is_empty() {
            format!("{what}: {inner}")
        } else {
            format!("{path}: {inner}")
        }
    })?;
    deserializer.end().map_err(|err| format!("{what}: {err}"))?;
    Ok(parsed)
}

/// A graph update as producers write it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGraphUpdate<'a> {
    #[serde(borrow)]
    op: Cow<'a, str>,
    #[serde(borrow)]
    from: Cow<'a, str>,
    #[serde(borrow)]
    to: Cow<'a, str>,
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
}

fn parse_graph_update(raw: &str) -> Result<GraphUpdate, String> {
    let parsed: RawGraphUpdate = deserialize_object(raw)?;
    let op = match parsed.op.as_ref() {
        "add_edge" => EdgeOp::Add,
        "remove_edge" => EdgeOp::Remove,
        _ => return Err("op: must be add_edge or remove_edge".into()),
    };
    check_entity(&parsed.from).map_err(|reason| reason.replacen("entity", "from", 1))?;
    check_entity(&parsed.to).map_err(|reason| reason.replacen("entity", "to", 1))?;
    if parsed.from == parsed.to {
        return Err("to: must differ from from (an entity never counts into itself)".into());
    }
    if let Some(id) = &parsed.id {
        check_id(id)?;
    }
    Ok(GraphUpdate {
        edge: EdgeUpdate { op, from: parsed.from.into_owned(), to: parsed.to.into_owned() },
        id: parsed.id.map(Cow::into_owned),
    })
}

fn parse_one<'a>(
    raw: &'a str,
    record_ts: i64,
    bounds: &Bounds,
    dimensions: &Dimensions,
) -> Result<IncrementCow<'a>, String> {
    checked(deserialize_object(raw)?, record_ts, bounds, dimensions)
}

/// An increment as parsed, once its names, id and numbers are checked.
/// With segments, its metric is the segmented one ([`crate::segments`]).
fn checked<'a>(
    parsed: RawIncrement<'a>,
    record_ts: i64,
    bounds: &Bounds,
    dimensions: &Dimensions,
) -> Result<IncrementCow<'a>, String> {
    check_entity(&parsed.entity)?;
    check_metric(&parsed.metric)?;
    if let Some(id) = &parsed.id {
        check_id(id)?;
    }
    let (delta, ts) = (parsed.delta.unwrap_or(1), parsed.ts.unwrap_or(record_ts));
    bounds.check(delta, ts)?;
    let segments: Vec<(&str, &str)> =
        parsed.segments.iter().flatten().map(|(name, value)| (name.as_ref(), value.as_ref())).collect();
    let metric = match dimensions.segmented(&parsed.metric, &segments)? {
        Some(segmented) => Cow::Owned(segmented),
        None => parsed.metric,
    };
    Ok(IncrementCow { entity: parsed.entity, metric, delta, ts, id: parsed.id })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Increment;

    type Rejected = Vec<(Option<u32>, String, String)>;

    /// The tests' clock stands at 1 000 ms; events up to 2·10^12 ms are accepted,
    /// `|delta|` up to the default 2^53.
    fn test_bounds() -> Bounds {
        Limits { max_abs_delta: Limits::DEFAULT_MAX_ABS_DELTA, max_future_ms: 1_999_999_999_000, max_age_ms: 1_000 }
            .at(1_000)
    }

    /// `v` declares `country` and `state`.
    fn test_dimensions() -> Dimensions {
        let declared = [("v".to_string(), vec!["country".to_string(), "state".to_string()])];
        Dimensions::new(declared.into_iter().collect()).unwrap()
    }

    #[test]
    fn segments_make_a_segmented_metric_and_bad_ones_are_rejected_naming_segments() {
        let (ok, bad) = run(r#"[{"entity":"a","metric":"v","segments":{"state":"CA","country":"US"}},
            {"entity":"a","metric":"v","segments":{}},
            {"entity":"a","metric":"v","segments":{"colour":"red"}},
            {"entity":"a","metric":"w","segments":{"country":"US"}},
            {"entity":"a","metric":"v","segments":{"country":""}},
            {"entity":"a","metric":"v","segments":{"country":1}},
            {"entity":"a","metric":"v","segments":["US"]}]"#);
        let metrics: Vec<(u32, &str)> = ok.iter().map(|(i, inc)| (*i, inc.metric.as_str())).collect();
        assert_eq!(metrics, vec![(0, "v\u{1}country\u{1e}US\u{1f}state\u{1e}CA"), (1, "v")]);
        let reasons: Vec<(Option<u32>, &str)> = bad.iter().map(|(i, r, _)| (*i, r.as_str())).collect();
        assert_eq!(reasons[0], (Some(2), "segments: v has no dimension \"colour\"; it has country, state"));
        assert_eq!(reasons[1], (Some(3), "segments: metric w declares no dimensions (counting.dimensions)"));
        assert_eq!(reasons[2], (Some(4), "segments: country's value must be 1-64 bytes of UTF-8"));
        assert!(reasons[3].1.starts_with("segments.country: invalid type"), "{}", reasons[3].1);
        assert!(reasons[4].1.starts_with("segments: invalid type"), "{}", reasons[4].1);
        let fields: Vec<&str> = bad
            .iter()
            .map(|(index, reason, raw)| {
                let rejection = Rejection { index: *index, reason: reason.clone(), raw: raw.as_bytes() };
                REASON_FIELDS[rejection.field()]
            })
            .collect();
        assert_eq!(fields, ["segments"; 5]);
    }

    fn run(payload: &str) -> (Vec<(u32, Increment)>, Rejected) {
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        parse_increments(
            payload.as_bytes(),
            1_000,
            &test_bounds(),
            &test_dimensions(),
            |i, inc| accepted.push((i, inc.into_owned())),
            |r| rejected.push((r.index, r.reason, String::from_utf8(r.raw.to_vec()).unwrap())),
        );
        (accepted, rejected)
    }

    type Reasons = Vec<(Option<u32>, String)>;

    fn graph(payload: &str) -> (Vec<(u32, GraphUpdate)>, Reasons) {
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        parse_graph_updates(payload.as_bytes(), |i, u| accepted.push((i, u)), |r| rejected.push((r.index, r.reason)));
        (accepted, rejected)
    }

    /// Each rejection counts under the field its reason names; a field not listed
    /// under `other`.
    #[test]
    fn rejections_are_counted_by_the_field_they_name() {
        let fields = |payload: &str, graph_updates: bool| {
            let mut fields = Vec::new();
            let mut note = |r: Rejection<'_>| fields.push(REASON_FIELDS[r.field()]);
            match graph_updates {
                true => parse_graph_updates(payload.as_bytes(), |_, _| {}, &mut note),
                false => parse_increments(
                    payload.as_bytes(),
                    1_000,
                    &test_bounds(),
                    &test_dimensions(),
                    |_, _| {},
                    &mut note,
                ),
            }
            fields
        };
        let increments = r#"[{"entity":"","metric":"v"},{"entity":"a","metric":"V!"},
            {"entity":"a","metric":"v","delta":1e300},{"entity":"a","metric":"v","delta":9007199254740993},
            {"entity":"a","metric":"v","ts":-1},{"entity":"a","metric":"v","id":""},
            {"entity":"a","metric":"v","colour":"red"},7]"#;
        // An unknown field is named by the producer: counted as `other`, never as its name.
        assert_eq!(fields(increments, false), ["entity", "metric", "delta", "delta", "ts", "id", "other", "element"]);
        assert_eq!(fields("[1,", false), ["message"]);
        let graph_updates = r#"[{"op":"rename","from":"a","to":"b"},{"op":"add_edge","from":"","to":"b"},
            {"op":"add_edge","from":"a","to":"a"}]"#;
        assert_eq!(fields(graph_updates, true), ["op", "from", "to"]);
        let unnamed = Rejection { index: None, reason: "colour.red: unknown".into(), raw: b"" };
        assert_eq!(REASON_FIELDS[unnamed.field()], "other");
    }

    #[test]
    fn graph_updates_and_their_rejections() {
        let (ok, bad) = graph(
            r#"[{"op":"add_edge","from":"answer:42","to":"user:7","id":"g-77"},
                {"op":"remove_edge","from":"answer:42","to":"user:7"},
                {"op":"rename","from":"a","to":"b"},
                {"op":"add_edge","from":"a","to":"a"},
                {"op":"add_edge","from":"","to":"b"},
                {"op":"add_edge","from":"a","to":"tab\there"},
                {"op":"add_edge","from":"a"}]"#,
        );
        assert_eq!(ok.len(), 2);
        assert_eq!(
            ok[0].1,
            GraphUpdate {
                edge: EdgeUpdate { op: EdgeOp::Add, from: "answer:42".into(), to: "user:7".into() },
                id: Some("g-77".into())
            }
        );
        assert_eq!((ok[1].0, ok[1].1.edge.op, ok[1].1.id.as_deref()), (1, EdgeOp::Remove, None));
        let reasons: Vec<&str> = bad.iter().map(|(_, r)| r.as_str()).collect();
        assert_eq!(reasons[0], "op: must be add_edge or remove_edge");
        assert!(reasons[1].starts_with("to: must differ from from"));
        assert_eq!(reasons[2], "from: must be 1-256 bytes of UTF-8");
        assert_eq!(reasons[3], "to: must not contain control characters");
        assert!(reasons[4].contains("missing field `to`"), "{}", reasons[4]);
        assert_eq!(bad.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![Some(2), Some(3), Some(4), Some(5), Some(6)]);
    }

    /// What the element-by-element way alone makes of `payload`.
    fn element_by_element(payload: &str) -> (Vec<(u32, Increment)>, Rejected) {
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        parse_elements(
            payload.as_bytes(),
            |raw| parse_one(raw, 1_000, &test_bounds(), &test_dimensions()),
            |i, inc: IncrementCow| accepted.push((i, inc.into_owned())),
            |r| rejected.push((r.index, r.reason, String::from_utf8(r.raw.to_vec()).unwrap())),
        );
        (accepted, rejected)
    }

    mod one_pass {
        use proptest::prelude::*;

        use super::*;

        /// A valid element, its fields in any order with any of JSON's whitespace
        /// around them, `delta`, `ts` and `id` there or not, its numbers of every
        /// size (up to 18 digits the scanner reads them, past that serde_json) or not
        /// `small`. Now and then its entity breaks the naming rules (a DEL).
        fn valid(small: bool) -> impl Strategy<Value = String> {
            let (delta, ts) = if small {
                ((-1_000i64..1_000).boxed(), (0i64..2_000_000_000_000).boxed())
            } else {
                (any::<i64>().boxed(), (0i64..i64::MAX).boxed())
            };
            let entity = prop_oneof![
                8 => (0u32..50).prop_map(|e| format!("user:{e}")),
                1 => Just("ünï".to_string()),
                1 => Just("a\u{7f}b".to_string()),
            ];
            let optional = (
                proptest::option::weighted(0.8, delta),
                proptest::option::weighted(0.8, ts),
                proptest::option::of("[a-z0-9-]{1,6}"),
            );
            let space = proptest::sample::select(vec!["", "", " ", "\n", "\t", "\r\n "]);
            // `v` declares country and state; colour is declared nowhere, and a
            // name may come twice.
            let metric = prop_oneof![3 => Just("v".to_string()), 1 => "[a-z0-9_.:-]{1,8}"];
            let pair = (proptest::sample::select(vec!["country", "state", "colour"]), "[A-Z]{0,2}");
            let segments = proptest::option::weighted(0.4, proptest::collection::vec(pair, 0..4));
            (entity, metric, optional, space, segments)
                .prop_flat_map(|(entity, metric, (delta, ts, id), space, segments)| {
                    let mut fields =
                        vec![format!(r#""entity"{space}:{space}"{entity}""#), format!(r#""metric":"{metric}""#)];
                    fields.extend(delta.map(|delta| format!(r#""delta":{space}{delta}"#)));
                    fields.extend(ts.map(|ts| format!(r#""ts"{space}:{ts}"#)));
                    fields.extend(id.map(|id| format!(r#""id":"{id}""#)));
                    fields.extend(segments.map(|pairs| {
                        let pairs: Vec<String> =
                            pairs.iter().map(|(name, value)| format!(r#""{name}"{space}:"{value}""#)).collect();
                        format!(r#""segments":{{{space}{}}}"#, pairs.join(","))
                    }));
                    (Just(fields).prop_shuffle(), Just(space))
                })
                .prop_map(|(fields, space)| format!("{{{space}{}{space}}}", fields.join(&format!("{space},"))))
        }

        /// Elements the scanner leaves to serde_json, valid or not.
        const UNUSUAL: &[&str] = &[
            r#"{"entity":"a","metric":"v","delta":null,"id":null}"#,
            r#"{"entity":"a","metric":"v","delta":-0}"#,
            r#"{"entity":"a","metric":"v","delta":1.0}"#,
            r#"{"entity":"a","metric":"v","ts":1e3}"#,
            r#"{"entity":"ünï\u0041","metric":"v"}"#,
            "{\t\"entity\":\"a\",\"metric\":\"v\"}",
            r#"{"entity":"a","metric":"v","delta":1234567890123456789}"#,
            r#"{"entity":"a","metric":"v","delta":01}"#,
            "{\"entity\":\"a\",\"metric\":\"v\",\"id\":\"a\tb\"}",
            "{\u{c}\"entity\":\"a\",\"metric\":\"v\"}",
        ];

        fn unusual() -> impl Strategy<Value = String> {
            proptest::sample::select(UNUSUAL).prop_map(String::from)
        }

        #[test]
        fn an_unusual_element_among_plain_ones_reads_as_element_by_element() {
            let plain = r#"{"entity":"user:1","metric":"views","delta":2}"#;
            for element in UNUSUAL {
                let payload = format!("[{plain},{element},{plain}]");
                assert_eq!(run(&payload), element_by_element(&payload), "{payload}");
            }
        }

        /// Elements the scanner reads (valid, or wrong only by the naming and time
        /// rules), and now and then one it leaves.
        fn plain() -> impl Strategy<Value = String> {
            let wrong = prop_oneof![
                Just(r#"{"entity":"a","metric":"BAD"}"#.to_string()),
                Just(r#"{"entity":"a","metric":"v","ts":-1}"#.to_string()),
                Just(r#"{"entity":"a","metric":"v","ts":4102444800000}"#.to_string()),
                Just(r#"{"entity":"a","metric":"v","delta":-9007199254740993}"#.to_string()),
                Just(r#"{"entity":"","metric":"v"}"#.to_string()),
            ];
            prop_oneof![26 => valid(true), 2 => wrong, 2 => unusual()]
        }

        /// Elements producers write: mostly valid (escapes, every field, defaults),
        /// and each way of getting one wrong.
        fn element() -> impl Strategy<Value = String> {
            let defaults = (0u32..50).prop_map(|e| format!(r#"{{ "metric" : "views", "entity" : "a\"{e}" }}"#));
            let wrong = prop_oneof![
                Just(r#"{"entity":"a","metric":"BAD"}"#.to_string()),
                Just(r#"{"entity":"a","metric":"v","extra":1}"#.to_string()),
                Just(r#"{"entity":"a","metric":"v","ts":-1}"#.to_string()),
                Just(r#"{"entity":"a","metric":"v","delta":"1"}"#.to_string()),
                Just(r#"{"entity":"a","entity":"b","metric":"v"}"#.to_string()),
                Just(r#"{"metric":"v"}"#.to_string()),
                Just(r#"{"entity":"","metric":"v"}"#.to_string()),
                Just("5".to_string()),
                Just("[]".to_string()),
                Just(r#"["user:1","views"]"#.to_string()),
                Just(r#"["user:1","views",5,100,"x"]"#.to_string()),
                Just("null".to_string()),
            ];
            prop_oneof![3 => valid(true), 3 => valid(false), 2 => defaults, 1 => wrong, 1 => unusual()]
        }

        proptest! {
            #[test]
            fn arrays_read_in_one_pass_as_element_by_element(
                elements in prop_oneof![
                    proptest::collection::vec(element(), 0..30),
                    proptest::collection::vec(plain(), 0..30),
                ],
                broken in proptest::option::of(0usize..4),
            ) {
                let mut payload = format!(" [{}] ", elements.join(" ,\n"));
                if let Some(cut) = broken {
                    cut_short(&mut payload, cut + 2);
                }
                prop_assert_eq!(run(&payload), element_by_element(&payload));
            }

            #[test]
            fn single_objects_read_in_one_pass_as_element_by_element(
                element in prop_oneof![element(), plain()],
                space in proptest::sample::select(vec!["", " ", "\n", "\r\n\t"]),
                broken in proptest::option::of(0usize..4),
            ) {
                let mut payload = format!("{space}{element}{space}");
                if let Some(cut) = broken {
                    cut_short(&mut payload, cut + 1);
                }
                prop_assert_eq!(run(&payload), element_by_element(&payload));
            }
        }

        /// Now and then a message that is not JSON at all: `payload` without about its
        /// last `bytes`, cut where a character starts (a name may end in a multi-byte one).
        fn cut_short(payload: &mut String, bytes: usize) {
            let mut at = payload.len().saturating_sub(bytes);
            while !payload.is_char_boundary(at) {
                at -= 1;
            }
            payload.truncate(at);
        }
    }

    /// A single object with a name past its bound: the scanner reads it, the check
    /// rejects it, and the reason is the element-by-element way's.
    #[test]
    fn an_oversized_single_object_is_rejected_as_element_by_element() {
        let payload = format!(r#"{{"entity":"{}","metric":"v"}}"#, "e".repeat(300));
        let (accepted, rejected) = run(&payload);
        assert_eq!(accepted, vec![]);
        assert_eq!(rejected, vec![(None, "entity: must be 1-256 bytes of UTF-8".to_string(), payload.clone())]);
        assert_eq!(run(&payload), element_by_element(&payload));
    }

    #[test]
    fn single_object_with_defaults() {
        let (ok, bad) = run(r#"{"entity":"answer:42","metric":"views"}"#);
        assert!(bad.is_empty());
        assert_eq!(ok.len(), 1);
        let inc = &ok[0].1;
        assert_eq!((inc.entity.as_str(), inc.metric.as_str(), inc.delta, inc.ts), ("answer:42", "views", 1, 1_000));
        assert_eq!(inc.id, None);
    }

    #[test]
    fn all_fields_and_escapes() {
        let (ok, _) = run(r#"{"entity":"a\"b","metric":"v","delta":-5,"ts":7,"id":"e-1"}"#);
        assert_eq!(
            ok[0].1,
            Increment { entity: "a\"b".into(), metric: "v".into(), delta: -5, ts: 7, id: Some("e-1".into()) }
        );
    }

    #[test]
    fn bad_element_in_array_rejects_only_it() {
        let (ok, bad) =
            run(r#"[{"entity":"a","metric":"v"}, {"entity":"a","metric":"BAD"}, 5, {"entity":"b","metric":"v"}]"#);
        assert_eq!(ok.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(bad.len(), 2);
        assert_eq!(bad[0].0, Some(1));
        assert_eq!(bad[0].1, "metric: must match [a-z0-9_.:-]{1,64}");
        assert_eq!(bad[0].2, r#"{"entity":"a","metric":"BAD"}"#);
        assert_eq!(bad[1].1, "element: expected a JSON object");
    }

    #[test]
    fn reasons_name_the_field() {
        let reason = |p: &str| run(p).1.remove(0).1;
        assert!(reason(r#"{"entity":"a","metric":"v","delta":"x"}"#).starts_with("delta: invalid type"));
        assert!(reason(r#"{"entity":"a","metric":"v","delta":1.5}"#).starts_with("delta: invalid type"));
        assert!(reason(r#"{"entity":"a","metric":"v","delta":99999999999999999999}"#).starts_with("delta:"));
        assert!(reason(r#"{"metric":"v"}"#).contains("missing field `entity`"));
        assert!(reason(r#"{"entity":"a","metric":"v","colour":1}"#).contains("unknown field `colour`"));
        assert_eq!(reason(r#"{"entity":"","metric":"v"}"#), "entity: must be 1-256 bytes of UTF-8");
        assert_eq!(reason(r#"{"entity":"a","metric":"v","id":""}"#), "id: must be 1-128 bytes");
        assert_eq!(reason(r#"{"entity":"a","metric":"v","ts":-1}"#), "ts: must be milliseconds since the epoch (>= 0)");
        assert!(reason(r#"{"entity":"a","metric":"v"} trailing"#).starts_with("element:"));
    }

    #[test]
    fn numbers_beyond_their_bounds_are_refused_naming_the_setting() {
        let limits = Limits { max_abs_delta: 100, max_future_ms: 3_600_000, max_age_ms: 86_400_000 };
        let now = 10 * 86_400_000;
        let parse = |payload: &str| {
            let (mut accepted, mut rejected) = (Vec::new(), Vec::new());
            parse_increments(
                payload.as_bytes(),
                now,
                &limits.at(now),
                &Dimensions::default(),
                |_, inc| accepted.push((inc.delta, inc.ts)),
                |r| rejected.push(r.reason),
            );
            (accepted, rejected)
        };
        let edges = format!(
            r#"[{{"entity":"a","metric":"v","delta":100,"ts":{}}},{{"entity":"a","metric":"v","delta":-100,"ts":{}}}]"#,
            now + 3_600_000,
            now - 86_400_000
        );
        assert_eq!(parse(&edges), (vec![(100, now + 3_600_000), (-100, now - 86_400_000)], vec![]));
        let beyond = format!(
            r#"[{{"entity":"a","metric":"v","delta":101}},{{"entity":"a","metric":"v","delta":-9223372036854775808}},
                {{"entity":"a","metric":"v","ts":{}}},{{"entity":"a","metric":"v","ts":{}}},{{"entity":"a","metric":"v"}}]"#,
            now + 3_600_001,
            now - 86_400_001
        );
        let reasons = vec![
            "delta: 101 is beyond ±100 (ingester.max_abs_delta)".to_string(),
            "delta: -9223372036854775808 is beyond ±100 (ingester.max_abs_delta)".to_string(),
            format!("ts: {} is more than 1h ahead of the ingester's clock (ingester.max_future_ms)", now + 3_600_001),
            format!("ts: {} is older than the longest retention (1d): no bucket keeps it", now - 86_400_001),
        ];
        assert_eq!(parse(&beyond), (vec![(1, now)], reasons));
        let default = Limits::new(&crate::time::Resolutions::default());
        assert_eq!(
            (default.max_abs_delta, default.max_future_ms, default.max_age_ms),
            (1 << 53, 3_600_000, 400 * 86_400_000)
        );
    }

    #[test]
    fn whole_message_rejections() {
        for payload in ["", "   ", "null", "42", "\"str\"", "[{\"entity\":", "{not json", "\u{fffd}"] {
            let (ok, bad) = run(payload);
            assert!(ok.is_empty(), "{payload:?}");
            assert_eq!(bad.len(), 1, "{payload:?}");
            assert_eq!(bad[0].0, None, "{payload:?}");
            assert_eq!(bad[0].2, payload);
        }
        let mut rejected = Vec::new();
        parse_increments(
            &[0xff, 0xfe],
            0,
            &Bounds::none(),
            &Dimensions::default(),
            |_, _| {},
            |r| rejected.push(r.reason),
        );
        assert_eq!(rejected.len(), 1);
    }

    #[test]
    fn empty_array_is_nothing() {
        let (ok, bad) = run("[]");
        assert!(ok.is_empty() && bad.is_empty());
    }
}
