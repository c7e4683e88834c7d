//! Turning a batch of producer records into output records: shard messages for the
//! valid increments (grouped per input partition and shard, in input order; in
//! format 4, the default, a shard's groups are the sections of one record), graph
//! messages for the valid graph updates (per input partition, in input order) and
//! dead letters for everything rejected.

use std::collections::BTreeMap;

use rdkafka::message::BorrowedMessage;
use rdkafka::Message;
use rustc_hash::FxHashMap;
use tally_core::format::{RECORD_V2, RECORD_V4};
use tally_core::input::{parse_graph_updates, parse_increments, Limits, Rejection, REASON_FIELDS};
use tally_core::records::split_by_size;
use tally_core::segments::Dimensions;
use tally_core::sharding::shard_of;
use tally_core::trace::{TraceContext, MAX_LINKS};
use tally_core::wire::bundle::{BUNDLE_OVERHEAD, SECTION_OVERHEAD};
use tally_core::wire::{
    DeadLetter, GraphMessage, GraphUpdate, IncrementCow, IncrementFields, ShardMessage, Source, Stamp,
    V2_RECORD_OVERHEAD,
};
use tally_shared::kafka::{now_ms, TopicNames};

use crate::error::Result;
use crate::metrics::Metrics;

/// A producer record as the router sees it.
#[derive(Debug, Clone, Copy)]
pub struct InputRecord<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    /// The record's timestamp, when it has one.
    pub timestamp: Option<i64>,
    pub payload: &'a [u8],
    /// The trace it belongs to (its first `traceparent` header).
    pub trace: Option<TraceContext>,
}

impl<'a> From<&'a BorrowedMessage<'a>> for InputRecord<'a> {
    fn from(message: &'a BorrowedMessage<'a>) -> Self {
        Self {
            topic: message.topic(),
            partition: message.partition(),
            offset: message.offset(),
            timestamp: message.timestamp().to_millis(),
            payload: message.payload().unwrap_or_default(),
            trace: tally_shared::otel::contexts_of(message.headers()).first().copied(),
        }
    }
}

/// The trace contexts of a batch's input records, by the shards their increments
/// went to: each shard record carries on those of its shard (the counter's batch
/// span links each once).
#[derive(Default)]
struct ShardTraces(BTreeMap<usize, Vec<TraceContext>>);

impl ShardTraces {
    fn note(&mut self, shard: usize, trace: TraceContext) {
        let contexts = self.0.entry(shard).or_default();
        // A record's increments come one after another.
        if contexts.len() < MAX_LINKS && contexts.last() != Some(&trace) {
            contexts.push(trace);
        }
    }

    fn of(&self, shard: usize) -> Vec<TraceContext> {
        self.0.get(&shard).cloned().unwrap_or_default()
    }
}

/// One record to produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub topic: String,
    /// Explicit partition (shard messages); `None` lets the key decide.
    pub partition: Option<i32>,
    pub key: Vec<u8>,
    pub payload: Vec<u8>,
    /// For routed entries, the time of the input record of the last entry (receivers
    /// run their dedupe window on it; for a bundle of sections, format 4, the latest
    /// of its sections' times, each of which carries its own), sent in the
    /// `tally.record-time.v1` header; the Kafka timestamp is always the producer's
    /// (when it was routed).
    pub timestamp: Option<i64>,
    /// The trace contexts of the input records whose increments a shard record
    /// carries (at most [`MAX_LINKS`]), each sent as a `traceparent` header.
    pub traces: Vec<TraceContext>,
}

/// What one batch held.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RouteCounts {
    pub increments: u64,
    pub graph_updates: u64,
    /// Elements (or whole messages) sent to the dead-letter topic…
    pub rejected: u64,
    /// …by the field their reason names ([`REASON_FIELDS`]).
    pub rejected_by_field: [u64; REASON_FIELDS.len()],
}

pub struct Router {
    names: TopicNames,
    shards: u32,
    /// The format version shard records of increments are written in
    /// (`ingester.shard_record_format`).
    shard_record_format: u8,
    /// The most bytes one output record's payload may take
    /// ([`KafkaConfig::record_budget`](tally_shared::config::KafkaConfig::record_budget)):
    /// messages are split to fit, dead letters truncated.
    record_budget: usize,
    /// What increments' numbers must keep (`ingester.max_abs_delta`,
    /// `ingester.max_future_ms`, the longest retention), checked against the clock
    /// once per batch.
    limits: Limits,
    /// The dimensions each metric's segments may name (`counting.dimensions`).
    dimensions: Dimensions,
}

impl Router {
    pub fn new(names: TopicNames, shards: u32, record_budget: usize) -> Self {
        let limits = Limits::new(&tally_core::time::Resolutions::default());
        let dimensions = Dimensions::default();
        Self { names, shards, shard_record_format: RECORD_V4, record_budget, limits, dimensions }
    }

    /// Accepts segments of the `dimensions` declared (none by default).
    pub fn with_dimensions(mut self, dimensions: Dimensions) -> Self {
        self.dimensions = dimensions;
        self
    }

    /// Checks increments against `limits` instead of the defaults.
    pub fn limiting(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Writes shard records of increments in format `version` (1, 2, 3 or 4) instead of 4.
    pub fn writing_shard_records_in(mut self, version: u8) -> Result<Self> {
        tally_shared::config::check_shard_record_format(version)?;
        self.shard_record_format = version;
        Ok(self)
    }

    /// Routes a batch of consumer messages. An output that cannot be encoded fails
    /// the batch (nothing of it is committed), never drops its input.
    pub fn route(&self, batch: &[BorrowedMessage<'_>], metrics: &Metrics) -> Result<Vec<Outgoing>> {
        let records: Vec<InputRecord<'_>> = batch.iter().map(InputRecord::from).collect();
        let (outgoing, counts) = self.route_records(&records)?;
        metrics.input_records.inc_by(records.len() as u64);
        metrics.input_bytes.inc_by(records.iter().map(|record| record.payload.len() as u64).sum());
        let mut output_bytes: BTreeMap<&str, u64> = BTreeMap::new();
        for out in &outgoing {
            *output_bytes.entry(&out.topic).or_default() += out.payload.len() as u64;
        }
        for (topic, bytes) in output_bytes {
            metrics.output_bytes.with_label_values(&[topic]).inc_by(bytes);
        }
        metrics.accepted.with_label_values(&["increment"]).inc_by(counts.increments);
        metrics.accepted.with_label_values(&["graph_update"]).inc_by(counts.graph_updates);
        for (field, rejected) in REASON_FIELDS.iter().zip(counts.rejected_by_field) {
            if rejected > 0 {
                metrics.dead_letters.with_label_values(&[field]).inc_by(rejected);
            }
        }
        Ok(outgoing)
    }

    /// Routes records; returns the output and what was accepted and rejected.
    pub fn route_records(&self, records: &[InputRecord<'_>]) -> Result<(Vec<Outgoing>, RouteCounts)> {
        // The increments of each (input partition, shard): per partition a row of
        // `shards` groups, the row found once per record, the group by index.
        let mut per_partition: IncrementsByPartition<'_> = BTreeMap::new();
        let mut graph: BTreeMap<i32, Vec<(Stamp, GraphUpdate)>> = BTreeMap::new();
        // The time of every input record, per input topic by (partition, offset): a
        // routed record carries the time of its last entry's input record.
        let (mut increment_times, mut graph_times) = (RecordTimes::default(), RecordTimes::default());
        let mut outgoing = Vec::new();
        let mut counts = RouteCounts::default();
        let mut unencodable: Option<tally_shared::Error> = None;
        let mut traced = ShardTraces::default();
        let graph_topic = self.names.graph();
        let bounds = self.limits.at(now_ms());
        for record in records {
            let record_time = record.timestamp.filter(|ts| *ts >= 0).unwrap_or_else(now_ms);
            let reject = |rejection: Rejection<'_>| {
                counts.rejected += 1;
                counts.rejected_by_field[rejection.field()] += 1;
                match self.dead_letter(record, rejection) {
                    Ok(letter) => outgoing.push(letter),
                    Err(err) => unencodable = Some(err),
                }
            };
            if record.topic == graph_topic {
                graph_times.insert((record.partition, record.offset), record_time);
                parse_graph_updates(
                    record.payload,
                    |index, update| {
                        counts.graph_updates += 1;
                        graph
                            .entry(record.partition)
                            .or_default()
                            .push((Stamp { offset: record.offset, index }, update));
                    },
                    reject,
                );
                continue;
            }
            increment_times.insert((record.partition, record.offset), record_time);
            let row = per_partition
                .entry(record.partition)
                .or_insert_with(|| (0..self.shards.max(1)).map(|_| Vec::new()).collect());
            parse_increments(
                record.payload,
                record_time,
                &bounds,
                &self.dimensions,
                |index, increment| {
                    counts.increments += 1;
                    let shard = shard_of(&increment.entity, self.shards) as usize;
                    row[shard].push((Stamp { offset: record.offset, index }, increment));
                    if let Some(trace) = record.trace {
                        traced.note(shard, trace);
                    }
                },
                reject,
            );
        }
        if let Some(err) = unencodable {
            return Err(err.into());
        }
        let first_shard_record = outgoing.len();
        if self.shard_record_format == RECORD_V4 {
            self.bundle_shard_records(&per_partition, &increment_times, &mut outgoing)?;
        } else {
            self.shard_records(&per_partition, &increment_times, &mut outgoing)?;
        }
        for out in &mut outgoing[first_shard_record..] {
            out.traces = out.partition.map(|shard| traced.of(shard as usize)).unwrap_or_default();
        }
        let updates_topic = self.names.graph_updates();
        for (partition, entries) in graph {
            let source = Source { stream: Source::GRAPH, partition: partition as u32 };
            for chunk in split_by_size(&entries, self.record_budget, |(_, update)| update.size_bound()) {
                outgoing.push(Outgoing {
                    topic: updates_topic.clone(),
                    partition: Some(0),
                    key: partition.to_string().into_bytes(),
                    payload: (GraphMessage::Updates { source, entries: chunk.to_vec() }).encode()?,
                    timestamp: last_time(&graph_times, partition, chunk),
                    traces: Vec::new(),
                });
            }
        }
        Ok((outgoing, counts))
    }

    /// The shard records of a batch's increments in format 4: per shard, one record
    /// bundling every input partition's increments as sections (in partition order,
    /// each in input order), more only when they do not fit the record budget.
    /// Sections are encoded partition by partition, while that partition's input
    /// (which the names borrow from) is still in the cache, then bundled shard by
    /// shard by their exact sizes.
    fn bundle_shard_records(
        &self,
        per_partition: &IncrementsByPartition<'_>,
        record_times: &RecordTimes,
        outgoing: &mut Vec<Outgoing>,
    ) -> Result<()> {
        let budget = self.record_budget.saturating_sub(BUNDLE_OVERHEAD);
        let section_budget = budget.saturating_sub(SECTION_OVERHEAD + V2_RECORD_OVERHEAD);
        let mut sections: Vec<Vec<(i64, Vec<u8>)>> = (0..self.shards.max(1)).map(|_| Vec::new()).collect();
        for (&partition, row) in per_partition {
            let source = Source { stream: Source::INCREMENTS, partition: partition as u32 };
            for (entries, sections) in row.iter().zip(&mut sections) {
                for chunk in split_by_size(entries, section_budget, |(_, increment)| increment.size_bound()) {
                    // Every input record's time was noted as it was parsed.
                    let record_time = last_time(record_times, partition, chunk).ok_or_else(|| {
                        tally_core::Error::Wire(format!("no record time for a section of input partition {partition}"))
                    })?;
                    sections.push((record_time, ShardMessage::encode_increments(source, chunk, RECORD_V2)?));
                }
            }
        }
        for (shard, sections) in sections.iter().enumerate() {
            for bundle in split_by_size(sections, budget, |(_, record)| SECTION_OVERHEAD + record.len()) {
                outgoing.push(self.bundle_record(shard, bundle)?);
            }
        }
        Ok(())
    }

    /// The record of one bundle of sections (record times and version 2 records) for
    /// `shard`: its Kafka header carries the latest of their times (each section
    /// carries its own).
    fn bundle_record(&self, shard: usize, sections: &[(i64, Vec<u8>)]) -> Result<Outgoing> {
        Ok(Outgoing {
            topic: self.names.shards(),
            partition: Some(shard as i32),
            key: shard.to_string().into_bytes(),
            payload: ShardMessage::bundle(sections)?,
            timestamp: sections.iter().map(|(time, _)| *time).max(),
            traces: Vec::new(),
        })
    }

    /// The shard records of a batch's increments in formats 1 to 3: one per input
    /// partition and shard, more only when they do not fit the record budget.
    fn shard_records(
        &self,
        per_partition: &IncrementsByPartition<'_>,
        record_times: &RecordTimes,
        outgoing: &mut Vec<Outgoing>,
    ) -> Result<()> {
        let shard_topic = self.names.shards();
        let groups = per_partition.iter().flat_map(|(&partition, row)| {
            row.iter()
                .enumerate()
                .filter(|(_, entries)| !entries.is_empty())
                .map(move |(shard, entries)| (partition, shard, entries))
        });
        for (partition, shard, entries) in groups {
            let source = Source { stream: Source::INCREMENTS, partition: partition as u32 };
            for chunk in split_by_size(entries, self.record_budget, |(_, increment)| increment.size_bound()) {
                outgoing.push(Outgoing {
                    topic: shard_topic.clone(),
                    partition: Some(shard as i32),
                    key: partition.to_string().into_bytes(),
                    payload: ShardMessage::encode_increments(source, chunk, self.shard_record_format)?,
                    timestamp: last_time(record_times, partition, chunk),
                    traces: Vec::new(),
                });
            }
        }
        Ok(())
    }

    /// The dead letter of a rejected element of `record`.
    fn dead_letter(&self, record: &InputRecord<'_>, rejection: Rejection<'_>) -> tally_shared::Result<Outgoing> {
        let key = format!("{}/{}/{}", record.topic, record.partition, record.offset).into_bytes();
        let letter = DeadLetter::encode(
            record.topic,
            record.partition,
            record.offset,
            rejection.index,
            &rejection.reason,
            rejection.raw,
            self.record_budget,
        );
        let (topic, traces) = (self.names.dead_letter(), Vec::new());
        Ok(Outgoing { topic, partition: None, key, payload: letter?, timestamp: None, traces })
    }
}

/// A batch's valid increments: per input partition, a row of one group per shard.
type IncrementsByPartition<'a> = BTreeMap<i32, Vec<Vec<(Stamp, IncrementCow<'a>)>>>;
/// The time of every input record of a batch from one input topic, by (partition,
/// offset): FxHash, as the keys are the broker's, not a producer's.
type RecordTimes = FxHashMap<(i32, i64), i64>;

/// The input time of the record that holds the last entry of `chunk`.
fn last_time<T>(record_times: &RecordTimes, partition: i32, chunk: &[(Stamp, T)]) -> Option<i64> {
    let (stamp, _) = chunk.last()?;
    record_times.get(&(partition, stamp.offset)).copied()
}

#[cfg(test)]
mod tests {
    use base64::Engine;
    use tally_core::wire::ShardMessage;

    use super::*;

    /// A router that takes increments of any time: the tests' records are stamped
    /// in the first seconds of the epoch.
    fn test_router(shards: u32, record_budget: usize) -> Router {
        Router::new(TopicNames::new("tally."), shards, record_budget).limiting(Limits::NONE)
    }

    fn record(partition: i32, offset: i64, payload: &str) -> InputRecord<'_> {
        let (timestamp, trace) = (Some(5), None);
        InputRecord { topic: "tally.increments", partition, offset, timestamp, payload: payload.as_bytes(), trace }
    }

    /// Every routed increment of `out` as (shard, input partition, offset, index,
    /// entity, event time, record time), in the order a counter reads them.
    /// Checks that each went to the shard of its entity among `shards`.
    fn routed(out: &[Outgoing], shards: u32) -> Vec<(i32, u32, i64, u32, String, i64, i64)> {
        let mut routed = Vec::new();
        for o in out.iter().filter(|o| o.topic == "tally.shards") {
            let header_time = o.timestamp.expect("a shard record has a record time");
            for (time, message) in ShardMessage::decode_sections(&o.payload, header_time).unwrap() {
                let ShardMessage::Increments { source, entries } = message else {
                    panic!("the ingester only sends increments to shards")
                };
                for (stamp, inc) in entries {
                    let shard = o.partition.unwrap();
                    assert_eq!(shard, shard_of(&inc.entity, shards) as i32, "{}", inc.entity);
                    routed.push((shard, source.partition, stamp.offset, stamp.index, inc.entity, inc.ts, time));
                }
            }
        }
        routed
    }

    #[test]
    fn shard_records_are_written_in_the_configured_format() {
        use tally_core::format::{RECORD_V1, RECORD_V2, RECORD_V3};
        // Enough increments for packing to pay, and a message of two.
        let many: String = format!(
            "[{}]",
            (0..300)
                .map(|i| format!(r#"{{"entity":"user-{}","metric":"views"}}"#, i % 40))
                .collect::<Vec<_>>()
                .join(",")
        );
        let few = r#"[{"entity":"a","metric":"v"},{"entity":"b","metric":"v","delta":3}]"#;
        for (payload, packed) in [(many.as_str(), true), (few, false)] {
            let records = [record(0, 10, payload)];
            let shard_records = |router: Router| -> Vec<Vec<u8>> {
                let (out, _) = router.route_records(&records).unwrap();
                out.into_iter().filter(|o| o.topic == "tally.shards").map(|o| o.payload).collect()
            };
            let router = || test_router(1, 900_000);
            let v4 = shard_records(router());
            let v3 = shard_records(router().writing_shard_records_in(3).unwrap());
            let v2 = shard_records(router().writing_shard_records_in(2).unwrap());
            let v1 = shard_records(router().writing_shard_records_in(1).unwrap());
            assert_eq!((v1.len(), v2.len(), v3.len(), v4.len()), (1, 1, 1, 1));
            // Format 3 packs a record only when that makes it smaller.
            let third = if packed { RECORD_V3 } else { RECORD_V2 };
            assert_eq!((v1[0][1], v2[0][1], v3[0][1]), (RECORD_V1, RECORD_V2, third));
            assert!(v3[0].len() <= v2[0].len(), "{} {}", v3[0].len(), v2[0].len());
            let decoded = ShardMessage::decode(&v1[0]).unwrap();
            assert_eq!(
                (ShardMessage::decode(&v2[0]).unwrap(), ShardMessage::decode(&v3[0]).unwrap()),
                (decoded.clone(), decoded.clone())
            );
            // Format 4: the same increments as the one section of a bundle, with the
            // input record's time (packed when that makes it smaller).
            let unpacked = tally_core::wire::packed::unpack(&v4[0]).unwrap();
            assert_eq!((unpacked[1], v4[0][1]), (RECORD_V4, if packed { RECORD_V3 } else { RECORD_V4 }));
            assert_eq!(ShardMessage::decode_sections(&v4[0], 0).unwrap(), vec![(5, decoded)]);
        }
        let Err(err) = test_router(1, 900_000).writing_shard_records_in(5) else { panic!("format 5 accepted") };
        assert!(err.to_string().contains("ingester.shard_record_format is 5: it is 1, 2, 3 or 4"), "{err}");
    }

    #[test]
    fn a_batch_sends_each_shard_one_record_of_every_partitions_increments() {
        let message = |n: usize, tag: &str| {
            let entries: Vec<String> =
                (0..n).map(|i| format!(r#"{{"entity":"{tag}-{}","metric":"v"}}"#, i % 50)).collect();
            format!("[{}]", entries.join(","))
        };
        let (a, b, c) = (message(400, "a"), message(300, "b"), message(200, "c"));
        let at = |partition, offset, payload: &'static str, timestamp| InputRecord {
            topic: "tally.increments",
            partition,
            offset,
            timestamp: Some(timestamp),
            payload: payload.as_bytes(),
            trace: None,
        };
        let (a, b, c): (&'static str, &'static str, &'static str) =
            (Box::leak(a.into_boxed_str()), Box::leak(b.into_boxed_str()), Box::leak(c.into_boxed_str()));
        let records = [at(3, 7, a, 1_000), at(0, 2, b, 2_000), at(3, 8, c, 3_000), at(0, 3, c, 4_000)];
        let by_partition = test_router(8, 900_000).writing_shard_records_in(3).unwrap();
        let (old, _) = by_partition.route_records(&records).unwrap();
        let (out, counts) = test_router(8, 900_000).route_records(&records).unwrap();
        assert_eq!(counts, RouteCounts { increments: 1_100, graph_updates: 0, rejected: 0, ..counts });
        // One record per shard (all 8 get some), where format 3 sends one per
        // input partition and shard.
        let shards: Vec<i32> = out.iter().map(|o| o.partition.unwrap()).collect();
        assert_eq!(shards, (0..8).collect::<Vec<_>>());
        assert_eq!(old.len(), 16);
        // The same entries in the same order per (shard, partition), each section
        // with the time of its last entry's input record, the record's header the
        // latest of its sections'.
        let mut bundled = routed(&out, 8);
        let mut separate = routed(&old, 8);
        assert_eq!(bundled.len(), 1_100);
        bundled.sort_by_key(|(shard, partition, ..)| (*shard, *partition));
        separate.sort_by_key(|(shard, partition, ..)| (*shard, *partition));
        assert_eq!(bundled, separate);
        assert!(bundled.iter().all(|(_, partition, .., time)| *time == if *partition == 0 { 4_000 } else { 3_000 }));
        assert!(out.iter().all(|o| o.timestamp == Some(4_000)));

        // Within a smaller budget a shard's bundle is cut into several records, each
        // source's entries still in order.
        let small = test_router(2, 3_000);
        let (out, _) = small.route_records(&records).unwrap();
        assert!(out.len() > 4, "{} records", out.len());
        assert!(out.iter().all(|o| o.payload.len() <= 3_000), "every record fits the budget");
        let cut = routed(&out, 2);
        assert_eq!(cut.len(), 1_100);
        for shard in 0..2 {
            for partition in [0, 3] {
                let stamps: Vec<(i64, u32)> = cut
                    .iter()
                    .filter(|(s, p, ..)| (*s, *p) == (shard, partition))
                    .map(|(_, _, offset, index, ..)| (*offset, *index))
                    .collect();
                assert!(stamps.windows(2).all(|pair| pair[0] < pair[1]), "in order: {stamps:?}");
                assert!(!stamps.is_empty());
            }
        }
    }

    #[test]
    fn routes_valid_entries_by_entity_and_bad_ones_to_dead_letter() {
        let router = test_router(4, 900_000);
        let records = [
            record(
                0,
                10,
                r#"[{"entity":"a","metric":"v"},{"entity":"b","metric":"BAD"},{"entity":"c","metric":"v","delta":3}]"#,
            ),
            record(1, 7, r#"{"entity":"a","metric":"v","ts":99}"#),
            record(1, 8, "not json"),
        ];
        let (out, counts) = router.route_records(&records).unwrap();
        let mut by_field = [0; REASON_FIELDS.len()];
        for field in ["metric", "message"] {
            by_field[REASON_FIELDS.iter().position(|known| *known == field).unwrap()] = 1;
        }
        assert_eq!(counts, RouteCounts { increments: 3, graph_updates: 0, rejected: 2, rejected_by_field: by_field });
        let letters: Vec<DeadLetter> = out
            .iter()
            .filter(|o| o.topic == "tally.dead-letter")
            .map(|o| serde_json::from_slice(&o.payload).unwrap())
            .collect();
        assert_eq!(letters.len(), 2);
        assert_eq!((letters[0].partition, letters[0].offset, letters[0].index), (0, 10, Some(1)));
        assert_eq!(letters[0].reason, "metric: must match [a-z0-9_.:-]{1,64}");
        let raw = base64::engine::general_purpose::STANDARD.decode(&letters[0].payload).unwrap();
        assert_eq!(raw, br#"{"entity":"b","metric":"BAD"}"#);
        assert_eq!((letters[1].offset, letters[1].index), (8, None));

        let mut routed: Vec<(u32, i64, u32, String, i64)> = routed(&out, 4)
            .into_iter()
            .map(|(_, partition, offset, index, entity, ts, _)| (partition, offset, index, entity, ts))
            .collect();
        routed.sort();
        assert_eq!(
            routed,
            vec![(0, 10, 0, "a".to_string(), 5), (0, 10, 2, "c".to_string(), 5), (1, 7, 0, "a".to_string(), 99)]
        );
    }

    /// The increments topic and the graph topic number their partitions and offsets
    /// alike: each routed record carries the time of its own topic's input record.
    #[test]
    fn a_routed_record_carries_its_own_topics_record_time() {
        let router = test_router(4, 900_000);
        let increments = InputRecord { timestamp: Some(1_000), ..record(2, 9, r#"{"entity":"a","metric":"v"}"#) };
        let graph = InputRecord {
            topic: "tally.graph",
            partition: 2,
            offset: 9,
            timestamp: Some(7_000),
            payload: br#"{"op":"add_edge","from":"a","to":"b"}"#,
            trace: None,
        };
        for records in [[increments, graph], [graph, increments]] {
            let (out, _) = router.route_records(&records).unwrap();
            let times: Vec<(&str, Option<i64>)> = out.iter().map(|o| (o.topic.as_str(), o.timestamp)).collect();
            assert_eq!(times, vec![("tally.shards", Some(1_000)), ("tally.graph-updates", Some(7_000))]);
            assert_eq!(routed(&out, 4).iter().map(|entry| entry.6).collect::<Vec<_>>(), vec![1_000]);
        }
    }

    /// A shard record carries on the trace contexts of the input records whose
    /// increments went to its shard in the batch, and only theirs, in every record
    /// format.
    #[test]
    fn shard_records_carry_their_input_records_trace_contexts() {
        let shards = 4;
        let entity_of_shard =
            |shard: u32| (0..).map(|i| format!("e{i}")).find(|e| shard_of(e, shards) == shard).unwrap();
        let (zero, one) = (entity_of_shard(0), entity_of_shard(1));
        let payloads = [
            format!(r#"[{{"entity":"{zero}","metric":"v"}},{{"entity":"{zero}","metric":"w"}}]"#),
            format!(r#"{{"entity":"{one}","metric":"v"}}"#),
            format!(r#"{{"entity":"{zero}","metric":"v"}}"#),
        ];
        let (first, second) = (TraceContext::root(), TraceContext::root());
        let records = [
            InputRecord { trace: Some(first), ..record(0, 1, &payloads[0]) },
            InputRecord { trace: Some(second), ..record(1, 2, &payloads[1]) },
            record(0, 3, &payloads[2]),
        ];
        for format in [2, 4] {
            let router = test_router(shards, 900_000).writing_shard_records_in(format).unwrap();
            let (out, _) = router.route_records(&records).unwrap();
            let traces: Vec<(Option<i32>, Vec<TraceContext>)> =
                out.iter().map(|o| (o.partition, o.traces.clone())).collect();
            assert_eq!(traces, vec![(Some(0), vec![first]), (Some(1), vec![second])], "format {format}");
        }
    }

    #[test]
    fn graph_updates_go_to_the_graph_topic_in_order() {
        let router = test_router(4, 900_000);
        let graph = |partition, offset, payload: &'static str| InputRecord {
            topic: "tally.graph",
            partition,
            offset,
            timestamp: Some(5),
            payload: payload.as_bytes(),
            trace: None,
        };
        let records = [
            graph(2, 4, r#"[{"op":"add_edge","from":"a","to":"b"},{"op":"add_edge","from":"a","to":"a"}]"#),
            graph(2, 5, r#"{"op":"remove_edge","from":"a","to":"b","id":"g-1"}"#),
        ];
        let (out, counts) = router.route_records(&records).unwrap();
        assert_eq!(counts, RouteCounts { increments: 0, graph_updates: 2, rejected: 1, ..counts });
        let letter: DeadLetter =
            serde_json::from_slice(&out.iter().find(|o| o.topic == "tally.dead-letter").unwrap().payload).unwrap();
        assert_eq!((letter.topic.as_str(), letter.offset, letter.index), ("tally.graph", 4, Some(1)));
        let updates: Vec<&Outgoing> = out.iter().filter(|o| o.topic == "tally.graph-updates").collect();
        assert_eq!(updates.len(), 1);
        let GraphMessage::Updates { source, entries } = GraphMessage::decode(&updates[0].payload).unwrap() else {
            panic!("graph updates expected")
        };
        assert_eq!(source, Source { stream: Source::GRAPH, partition: 2 });
        let stamps: Vec<(i64, u32)> = entries.iter().map(|(s, _)| (s.offset, s.index)).collect();
        assert_eq!(stamps, vec![(4, 0), (5, 0)]);
        assert_eq!(entries[1].1.id.as_deref(), Some("g-1"));
    }

    #[test]
    fn oversized_input_is_dead_lettered_within_the_budget_and_long_updates_split() {
        let router = test_router(4, 100_000);
        let garbage = "z".repeat(800_000);
        let long = "n".repeat(250);
        let updates: String = format!(
            "[{}]",
            (0..2_000)
                .map(|i| format!(r#"{{"op":"add_edge","from":"{long}{i}","to":"{long}x{i}"}}"#))
                .collect::<Vec<_>>()
                .join(",")
        );
        let graph = InputRecord {
            topic: "tally.graph",
            partition: 1,
            offset: 3,
            timestamp: Some(5),
            payload: updates.as_bytes(),
            trace: None,
        };
        let (out, counts) = router.route_records(&[record(0, 1, &garbage), graph]).unwrap();
        assert_eq!(counts, RouteCounts { increments: 0, graph_updates: 2_000, rejected: 1, ..counts });
        assert!(out.iter().all(|o| o.payload.len() <= 100_000), "every record fits the budget");
        let letters: Vec<DeadLetter> = out
            .iter()
            .filter(|o| o.topic == "tally.dead-letter")
            .map(|o| serde_json::from_slice(&o.payload).unwrap())
            .collect();
        assert_eq!(letters.len(), 1);
        assert_eq!(letters[0].truncated.get("payload"), Some(&800_000));
        let mut stamps = Vec::new();
        for o in out.iter().filter(|o| o.topic == "tally.graph-updates") {
            let GraphMessage::Updates { entries, .. } = GraphMessage::decode(&o.payload).unwrap() else {
                panic!("graph updates expected")
            };
            stamps.extend(entries.iter().map(|(stamp, _)| stamp.index));
        }
        assert_eq!(stamps, (0..2_000).collect::<Vec<u32>>(), "every update once, in order, over several records");
    }

    #[test]
    fn routing_is_deterministic_for_replays() {
        let router = test_router(8, 20_000);
        let payload: String = format!(
            "[{}]",
            (0..9000).map(|i| format!(r#"{{"entity":"e{}","metric":"v"}}"#, i % 3)).collect::<Vec<_>>().join(",")
        );
        let records = [record(0, 1, &payload)];
        let (first, _) = router.route_records(&records).unwrap();
        let (second, _) = router.route_records(&records).unwrap();
        assert_eq!(first, second);
        assert!(first.len() > 3, "large groups are split into several messages");
        assert!(first.iter().all(|o| o.payload.len() <= 20_000), "every record fits the budget");
    }
}
