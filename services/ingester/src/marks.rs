//! Marks: how far the ingester has routed each input partition, told to every shard
//! (increments) and to the graph (graph updates) as a record of their own. A shard
//! that applied the mark of a record has every entry of it meant for that shard,
//! routed or not; reads with a write token wait for exactly that.
//!
//! A mark goes after the outputs of the batches it covers, on the same gapless
//! producer, so it never overtakes them; marks are sent at most every
//! `ingester.marks_every_ms` (a round is one small record per shard) and whenever
//! some are due while the input is idle, so the last batch before a pause is marked;
//! a stopping ingester sends what is pending. An ingester that takes a partition
//! marks it through its group's committed offset: every record below was routed and
//! acknowledged before, so before anything this one sends.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tally_core::wire::{GraphMessage, ShardMessage, Source, Stamp};
use tally_shared::kafka::TopicNames;

use crate::error::Result;
use crate::in_flight::InputPartition;
use crate::route::Outgoing;

/// The inputs, in the order the ingester consumes them: increments, then graph.
const INCREMENTS_INPUT: usize = 0;

/// Marks routed but not yet told.
pub struct PendingMarks {
    every: Option<Duration>,
    /// By source, the last offset routed whole.
    routed: BTreeMap<Source, i64>,
    last_sent: Option<Instant>,
    shards_topic: String,
    graph_topic: String,
    shards: u32,
}

impl PendingMarks {
    /// Marks sent at most `every_ms` (0: never) to the `shards` partitions of the
    /// shard topic and to the graph's.
    pub fn new(names: &TopicNames, shards: u32, every_ms: u64) -> Self {
        Self {
            every: (every_ms > 0).then(|| Duration::from_millis(every_ms)),
            routed: BTreeMap::new(),
            last_sent: None,
            shards_topic: names.shards(),
            graph_topic: names.graph_updates(),
            shards,
        }
    }

    /// A batch that read up to `ends` (next offsets, exclusive) was handed to the
    /// producer.
    pub fn routed(&mut self, ends: &[(InputPartition, i64)]) {
        if self.every.is_none() {
            return;
        }
        // A partition read from its start has nothing to mark yet.
        for &((input, partition), next) in ends.iter().filter(|(_, next)| *next > 0) {
            let stream = if input == INCREMENTS_INPUT { Source::INCREMENTS } else { Source::GRAPH };
            let through = self.routed.entry(Source { stream, partition: partition as u32 }).or_insert(next - 1);
            *through = (*through).max(next - 1);
        }
    }

    /// The mark records due at `now`, if any (then none are pending).
    pub fn due(&mut self, now: Instant) -> Result<Vec<Outgoing>> {
        let Some(every) = self.every else { return Ok(Vec::new()) };
        if self.last_sent.is_some_and(|at| now.duration_since(at) < every) {
            return Ok(Vec::new());
        }
        self.take(now)
    }

    /// Every pending mark record, due or not (a stopping ingester's last).
    pub fn pending(&mut self) -> Result<Vec<Outgoing>> {
        self.take(Instant::now())
    }

    /// The pending mark records, sent at `now`.
    fn take(&mut self, now: Instant) -> Result<Vec<Outgoing>> {
        if self.every.is_none() || self.routed.is_empty() {
            return Ok(Vec::new());
        }
        self.last_sent = Some(now);
        let routed = std::mem::take(&mut self.routed);
        let (increments, graph): (Vec<_>, Vec<_>) = routed
            .into_iter()
            .map(|(source, through)| (source, Stamp::through(through)))
            .partition(|(source, _)| source.stream == Source::INCREMENTS);
        let mut out = Vec::new();
        if !increments.is_empty() {
            let payload = ShardMessage::Marks { marks: increments }.encode()?;
            for shard in 0..self.shards {
                out.push(self.record(&self.shards_topic, shard as i32, payload.clone()));
            }
        }
        if !graph.is_empty() {
            let payload = GraphMessage::Marks { marks: graph }.encode()?;
            out.push(self.record(&self.graph_topic, 0, payload));
        }
        Ok(out)
    }

    fn record(&self, topic: &str, partition: i32, payload: Vec<u8>) -> Outgoing {
        Outgoing {
            topic: topic.to_string(),
            partition: Some(partition),
            key: b"marks".to_vec(),
            payload,
            timestamp: None,
            traces: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_shard(out: &Outgoing) -> ShardMessage {
        ShardMessage::decode(&out.payload).unwrap()
    }

    #[test]
    fn marks_say_the_last_offset_routed_to_every_shard_and_the_graph() {
        let names = TopicNames::new("t.");
        let mut marks = PendingMarks::new(&names, 3, 50);
        let start = Instant::now();
        assert!(marks.due(start).unwrap().is_empty(), "nothing routed");
        marks.routed(&[((0, 1), 10), ((1, 0), 4)]);
        marks.routed(&[((0, 1), 8), ((0, 0), 3), ((0, 5), 0)]);
        let out = marks.due(start).unwrap();
        let increments = vec![
            (Source { stream: Source::INCREMENTS, partition: 0 }, Stamp::through(2)),
            (Source { stream: Source::INCREMENTS, partition: 1 }, Stamp::through(9)),
        ];
        let targets: Vec<(&str, Option<i32>)> = out.iter().map(|o| (o.topic.as_str(), o.partition)).collect();
        assert_eq!(
            targets,
            vec![("t.shards", Some(0)), ("t.shards", Some(1)), ("t.shards", Some(2)), ("t.graph-updates", Some(0))]
        );
        for shard in &out[..3] {
            assert_eq!(decode_shard(shard), ShardMessage::Marks { marks: increments.clone() });
        }
        let graph = GraphMessage::decode(&out[3].payload).unwrap();
        assert_eq!(
            graph,
            GraphMessage::Marks { marks: vec![(Source { stream: Source::GRAPH, partition: 0 }, Stamp::through(3))] }
        );

        // At most every 50 ms; the routed positions wait for the next round.
        marks.routed(&[((0, 1), 12)]);
        assert!(marks.due(start + Duration::from_millis(49)).unwrap().is_empty());
        let out = marks.due(start + Duration::from_millis(50)).unwrap();
        assert_eq!(out.len(), 3, "only the shards: no graph input since");
        assert_eq!(
            decode_shard(&out[0]),
            ShardMessage::Marks {
                marks: vec![(Source { stream: Source::INCREMENTS, partition: 1 }, Stamp::through(11))]
            }
        );
    }

    #[test]
    fn pending_marks_go_whether_due_or_not() {
        let mut marks = PendingMarks::new(&TopicNames::new(""), 2, 60_000);
        marks.routed(&[((0, 1), 10)]);
        assert_eq!(marks.due(Instant::now()).unwrap().len(), 2);
        marks.routed(&[((0, 1), 11)]);
        assert!(marks.due(Instant::now()).unwrap().is_empty(), "not due for a minute");
        let last = marks.pending().unwrap();
        let want = ShardMessage::Marks {
            marks: vec![(Source { stream: Source::INCREMENTS, partition: 1 }, Stamp::through(10))],
        };
        assert_eq!(last.iter().map(decode_shard).collect::<Vec<_>>(), vec![want.clone(), want]);
        assert!(marks.pending().unwrap().is_empty());
    }

    #[test]
    fn off_sends_nothing() {
        let mut marks = PendingMarks::new(&TopicNames::new(""), 3, 0);
        marks.routed(&[((0, 1), 10)]);
        assert!(marks.due(Instant::now()).unwrap().is_empty());
    }
}
