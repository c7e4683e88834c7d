//! Messages that travel between tally services.
//!
//! Internal Kafka messages are bincode (compact and fast); messages that humans or
//! other systems read — dead letters, rollups, shard ownership, the internal read API —
//! are JSON.

use serde::{Deserialize, Serialize};

use crate::graph::{DescChange, EdgeUpdate};
use crate::time::WindowSpec;
use crate::{Error, Result};

/// One validated increment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Increment {
    pub entity: String,
    pub metric: String,
    pub delta: i64,
    /// Event time, ms since the epoch.
    pub ts: i64,
    /// The producer's idempotency key.
    pub id: Option<String>,
}

/// Where an internal message's content comes from: the input stream and partition.
/// Receivers keep one high-water mark per source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Source {
    /// Which input stream ([`Source::INCREMENTS`]).
    pub stream: u8,
    pub partition: u32,
}

impl Source {
    /// The producer topic `tally.increments` (partition: the input partition).
    pub const INCREMENTS: u8 = 1;
    /// The producer topic `tally.graph` (partition: the input partition).
    pub const GRAPH: u8 = 2;
    /// `tally-graph`'s outbox (partition 0).
    pub const GRAPH_PROCESSOR: u8 = 3;
    /// A counter shard's outbox (partition: the sending shard).
    pub const SHARD: u8 = 4;
}

/// One validated graph update with the producer's idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphUpdate {
    pub edge: EdgeUpdate,
    pub id: Option<String>,
}

/// A message on the internal graph-updates topic, consumed by `tally-graph`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GraphMessage {
    /// Graph updates from one source, in source order.
    Updates { source: Source, entries: Vec<(Stamp, GraphUpdate)> },
}

impl GraphMessage {
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes)
    }
}

/// A change to a counter's total made by another shard: `delta` for one bucket of
/// one counter (`width_ms` 0 is all-time).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TotalDelta {
    pub entity: String,
    pub metric: String,
    pub width_ms: i64,
    pub bucket: i64,
    pub delta: i64,
}

/// Borrowed [`TotalDelta`]; same encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct TotalDeltaRef<'a> {
    pub entity: &'a str,
    pub metric: &'a str,
    pub width_ms: i64,
    pub bucket: i64,
    pub delta: i64,
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    bincode::serde::encode_to_vec(value, bincode_config()).map_err(|err| Error::Wire(err.to_string()))
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let (message, used) =
        bincode::serde::decode_from_slice(bytes, bincode_config()).map_err(|err| Error::Wire(err.to_string()))?;
    if used != bytes.len() {
        return Err(Error::Wire(format!("{} trailing bytes", bytes.len() - used)));
    }
    Ok(message)
}

/// The deterministic position of one element within its source: the input record's
/// offset and the element's index in that record. Replays produce the same stamps,
/// so a receiver drops every stamp at or below its high-water mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    pub offset: i64,
    pub index: u32,
}

/// A message on the shard topic, consumed by the counter that owns the partition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ShardMessage {
    /// Increments from one source, in source order.
    Increments { source: Source, entries: Vec<(Stamp, Increment)> },
    /// From `tally-graph`: new descendant sets of origins this shard owns.
    DescChanges { source: Source, entries: Vec<(Stamp, DescChange)> },
    /// From another shard: changes to totals of counters this shard owns.
    Totals { source: Source, entries: Vec<(Stamp, TotalDelta)> },
}

/// The borrowed view of a [`ShardMessage`] the counter decodes: strings point into
/// the Kafka payload, so decoding a batch allocates once per message, not per field.
#[derive(Debug, Deserialize)]
pub enum ShardMessageRef<'a> {
    Increments {
        source: Source,
        #[serde(borrow)]
        entries: Vec<(Stamp, IncrementRef<'a>)>,
    },
    DescChanges {
        source: Source,
        entries: Vec<(Stamp, DescChange)>,
    },
    Totals {
        source: Source,
        #[serde(borrow)]
        entries: Vec<(Stamp, TotalDeltaRef<'a>)>,
    },
}

/// Borrowed [`Increment`]; same encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct IncrementRef<'a> {
    pub entity: &'a str,
    pub metric: &'a str,
    pub delta: i64,
    pub ts: i64,
    pub id: Option<&'a str>,
}

impl<'a> ShardMessageRef<'a> {
    pub fn decode(bytes: &'a [u8]) -> Result<Self> {
        let (message, used) = bincode::serde::borrow_decode_from_slice(bytes, bincode_config())
            .map_err(|err| Error::Wire(err.to_string()))?;
        if used != bytes.len() {
            return Err(Error::Wire(format!("{} trailing bytes", bytes.len() - used)));
        }
        Ok(message)
    }
}

fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
}

impl ShardMessage {
    pub fn encode(&self) -> Result<Vec<u8>> {
        match self {
            ShardMessage::Increments { source, entries } => Self::encode_increments(*source, entries),
            other => encode(other),
        }
    }

    /// The bytes of `ShardMessage::Increments { source, entries }` without building
    /// it, so the ingester encodes its entries in place instead of cloning them.
    pub fn encode_increments(source: Source, entries: &[(Stamp, Increment)]) -> Result<Vec<u8>> {
        /// Same shape as [`ShardMessage`] (bincode writes the variant's index, not its name).
        #[derive(Serialize)]
        enum Borrowed<'a> {
            Increments { source: Source, entries: &'a [(Stamp, Increment)] },
        }
        bincode::serde::encode_to_vec(Borrowed::Increments { source, entries }, bincode_config())
            .map_err(|err| Error::Wire(err.to_string()))
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes)
    }
}

/// A record of `tally.dead-letter` (SPEC §4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// Position of the element in an array message; absent when the whole message
    /// was rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub reason: String,
    /// The original bytes, base64.
    pub payload: String,
}

impl DeadLetter {
    /// The `payload` field for rejected bytes: base64.
    pub fn payload_of(raw: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(raw)
    }
}

/// A record of `tally.rollups` (SPEC §4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollup {
    pub entity: String,
    pub metric: String,
    /// A resolution name such as `1h`, or `all`.
    pub resolution: String,
    pub bucket: i64,
    pub total: i64,
    pub direct: i64,
}

/// A counter's claim on a shard, on the shard-owners topic: where to send reads.
/// `tally-graph` announces its read address on the same topic under
/// [`ShardOwner::GRAPH`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardOwner {
    pub shard: u32,
    /// `host:port` of the owner's internal read API; `None` when it let go of the shard.
    pub addr: Option<String>,
    /// A random id per counter process, to tell owners apart.
    pub instance: String,
    /// Wall-clock ms of the claim; later claims win.
    pub at_ms: i64,
}

impl ShardOwner {
    /// The `shard` of `tally-graph`'s claim.
    pub const GRAPH: u32 = u32::MAX;
}

/// `kind` of a read (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    #[default]
    Total,
    Direct,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Total => "total",
            Kind::Direct => "direct",
        }
    }
}

/// One question to a counter shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardQuery {
    pub entity: String,
    pub metric: String,
    pub kind: Kind,
    pub spec: WindowSpec,
}

/// The internal read API: many questions to one shard, answered from one snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardReadRequest {
    pub shard: u32,
    /// The clock of the request, so every answer of a batch uses the same `now`.
    pub now_ms: i64,
    pub queries: Vec<ShardQuery>,
}

/// Answers in request order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardReadResponse {
    pub answers: Vec<ShardAnswer>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardAnswer {
    Window { value: i64, resolution: String, from: i64, to: i64 },
    Series { resolution: String, points: Vec<(i64, i64)> },
    Error { code: String, message: String },
}

/// The internal metrics-listing API of a shard.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardMetricsRequest {
    pub shard: u32,
    pub entity: String,
    /// List metrics strictly after this one.
    pub after: Option<String>,
    pub limit: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricTotals {
    pub metric: String,
    pub total: i64,
    pub direct: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardMetricsResponse {
    pub metrics: Vec<MetricTotals>,
    /// Whether more metrics follow the last one returned.
    pub more: bool,
}

/// The internal neighbours API of `tally-graph`: one page of an entity's direct
/// neighbours, sorted, strictly after `after`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphNeighboursRequest {
    pub entity: String,
    /// Out-edges (`descendants` direction) when true, in-edges otherwise.
    pub outgoing: bool,
    pub after: Option<String>,
    pub limit: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphNeighboursResponse {
    pub entities: Vec<String>,
    /// Whether more neighbours follow the last one returned.
    pub more: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn shard_messages_round_trip(
            partition in any::<u32>(),
            entries in proptest::collection::vec(
                (any::<i64>(), any::<u32>(), "\\PC{1,20}", "[a-z]{1,8}", any::<i64>(), any::<i64>(), proptest::option::of("[a-z0-9]{1,10}")),
                0..20,
            ),
        ) {
            let message = ShardMessage::Increments {
                source: Source { stream: Source::INCREMENTS, partition },
                entries: entries.into_iter().map(|(offset, index, entity, metric, delta, ts, id)| {
                    (Stamp { offset, index }, Increment { entity, metric, delta, ts, id })
                }).collect(),
            };
            let bytes = message.encode().unwrap();
            let ShardMessageRef::Increments { source, entries } = ShardMessageRef::decode(&bytes).unwrap() else {
                panic!("decoded another variant");
            };
            let ShardMessage::Increments { source: want_source, entries: want } = &message else { unreachable!() };
            prop_assert_eq!(&source, want_source);
            prop_assert_eq!(entries.len(), want.len());
            for ((stamp, got), (want_stamp, want)) in entries.iter().zip(want) {
                prop_assert_eq!(stamp, want_stamp);
                prop_assert_eq!((got.entity, got.metric, got.delta, got.ts, got.id), (want.entity.as_str(), want.metric.as_str(), want.delta, want.ts, want.id.as_deref()));
            }
            prop_assert_eq!(ShardMessage::decode(&bytes).unwrap(), message);
        }
    }

    #[test]
    fn graph_and_totals_messages_round_trip_borrowed() {
        let source = Source { stream: Source::SHARD, partition: 3 };
        let delta = TotalDelta {
            entity: "user:7".into(),
            metric: "views".into(),
            width_ms: 60_000,
            bucket: -60_000,
            delta: -4,
        };
        let totals = ShardMessage::Totals { source, entries: vec![(Stamp { offset: 9, index: 2 }, delta)] };
        let bytes = totals.encode().unwrap();
        assert_eq!(ShardMessage::decode(&bytes).unwrap(), totals);
        let Ok(ShardMessageRef::Totals { entries, .. }) = ShardMessageRef::decode(&bytes) else { panic!("totals") };
        assert_eq!((entries[0].1.entity, entries[0].1.bucket, entries[0].1.delta), ("user:7", -60_000, -4));

        let change = DescChange { origin: "a".into(), added: vec!["b".into()], removed: vec![] };
        let changes =
            ShardMessage::DescChanges { source, entries: vec![(Stamp { offset: 1, index: 0 }, change.clone())] };
        let Ok(ShardMessageRef::DescChanges { entries, .. }) = ShardMessageRef::decode(&changes.encode().unwrap())
        else {
            panic!("changes")
        };
        assert_eq!(entries[0].1, change);

        let edge = EdgeUpdate { op: crate::graph::EdgeOp::Remove, from: "a".into(), to: "b".into() };
        let graph = GraphMessage::Updates {
            source,
            entries: vec![(Stamp { offset: 1, index: 0 }, GraphUpdate { edge, id: None })],
        };
        assert_eq!(GraphMessage::decode(&graph.encode().unwrap()).unwrap(), graph);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(ShardMessage::decode(&[0xff; 7]).is_err());
        assert!(ShardMessage::decode(&[]).is_err());
        let mut bytes =
            ShardMessage::Increments { source: Source { stream: 1, partition: 0 }, entries: vec![] }.encode().unwrap();
        bytes.push(0);
        assert!(ShardMessage::decode(&bytes).is_err());
    }

    #[test]
    fn stamps_order_by_offset_then_index() {
        assert!(Stamp { offset: 1, index: 9 } < Stamp { offset: 2, index: 0 });
        assert!(Stamp { offset: 2, index: 0 } < Stamp { offset: 2, index: 1 });
    }
}
