//! Gathering one batch of input records: it closes when full, `linger` after its
//! first record, or as soon as nothing more is queued and every input partition it
//! read stands at the end its last fetch reported — the end of a backlog or of a
//! light load's fetch does not wait out `linger` (nothing else is on its way).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, ConsumerContext};
use rdkafka::message::BorrowedMessage;
use rdkafka::Message;
use tally_shared::kafka::cached_high_watermark;

use crate::in_flight::InputPartition;

/// How long a batch waits for more before it looks whether its partitions stand at
/// their ends.
const END_LOOK: Duration = Duration::from_millis(2);

/// How long a poll waits while the batch is still empty (then the caller's loop
/// runs its heartbeat and rest).
const EMPTY_WAIT: Duration = Duration::from_millis(100);

/// How big a batch may grow and how long it waits for more.
#[derive(Debug, Clone, Copy)]
pub struct Gather {
    pub linger: Duration,
    pub max_records: usize,
    /// Payload bytes.
    pub max_bytes: usize,
}

/// Why a batch closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// Nothing came: the batch is empty.
    Empty,
    Full,
    /// Nothing more was queued and each partition it read stood at its end.
    ReadToTheEnd,
    /// `linger` passed with more still to come.
    Lingered,
}

/// The next offset to read of each input partition a batch read, in the order the
/// partitions first came.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchEnds(pub Vec<(InputPartition, i64)>);

impl BatchEnds {
    /// Notes a record at `offset` of input partition `at`.
    pub fn note(&mut self, at: InputPartition, offset: i64) {
        // Records come in runs of one partition: the last one first.
        let found = match self.0.last_mut() {
            Some(last) if last.0 == at => Some(last),
            _ => self.0.iter_mut().find(|(partition, _)| *partition == at),
        };
        match found {
            Some((_, next)) => *next = (*next).max(offset + 1),
            None => self.0.push((at, offset + 1)),
        }
    }

    /// Whether every partition read stands at (or past) its end as `end_of` tells
    /// it; `None` (no fetch has said) is not an end.
    pub fn at_the_end(&self, end_of: impl Fn(InputPartition) -> Option<i64>) -> bool {
        !self.0.is_empty() && self.0.iter().all(|(at, next)| end_of(*at).is_some_and(|end| *next >= end))
    }

    /// [`BatchEnds::at_the_end`] of the ends `consumer`'s last fetches reported
    /// (librdkafka's cached high watermarks: no round trip).
    pub fn fetched_to_the_end<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, inputs: &[String]) -> bool {
        self.at_the_end(|(input, partition)| cached_high_watermark(consumer, &inputs[input], partition))
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

impl Gather {
    /// Polls one batch into `batch` (empty when called) and `ends` from `consumer`,
    /// whose topics are `inputs` (a record's input is its topic's index there).
    pub fn poll<'c, C: ConsumerContext>(
        &self,
        consumer: &'c BaseConsumer<C>,
        inputs: &[String],
        batch: &mut Vec<BorrowedMessage<'c>>,
        ends: &mut BatchEnds,
    ) -> Closed {
        let mut bytes = 0usize;
        let mut deadline: Option<Instant> = None;
        loop {
            let wait = deadline.map_or(EMPTY_WAIT, |d| d.saturating_duration_since(Instant::now()).min(END_LOOK));
            match consumer.poll(wait) {
                Some(Ok(message)) => {
                    bytes += message.payload_len();
                    ends.note((input_of(inputs, message.topic()), message.partition()), message.offset());
                    batch.push(message);
                    deadline.get_or_insert_with(|| Instant::now() + self.linger);
                }
                Some(Err(err)) => tracing::warn!(error = %err, "consumer error"),
                None if batch.is_empty() => return Closed::Empty,
                None if ends.fetched_to_the_end(consumer, inputs) => return Closed::ReadToTheEnd,
                None => {}
            }
            if batch.len() >= self.max_records || bytes >= self.max_bytes {
                return Closed::Full;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Closed::Lingered;
            }
        }
    }
}

/// The index of `topic` among `inputs` (the first when it is none of them: a
/// consumer only reads its inputs).
pub fn input_of(inputs: &[String], topic: &str) -> usize {
    inputs.iter().position(|name| name == topic).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::consumer::Consumer;
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

    #[test]
    fn ends_keep_each_partitions_next_offset_in_the_order_they_came() {
        let mut ends = BatchEnds::default();
        for (at, offset) in [((0, 2), 7), ((0, 2), 8), ((1, 0), 3), ((0, 2), 9), ((0, 5), 0), ((1, 0), 4)] {
            ends.note(at, offset);
        }
        assert_eq!(ends.0, vec![((0, 2), 10), ((1, 0), 5), ((0, 5), 1)]);
        let end_of = |ends: [i64; 3]| {
            move |at: InputPartition| match at {
                (0, 2) => Some(ends[0]),
                (1, 0) => Some(ends[1]),
                (0, 5) if ends[2] >= 0 => Some(ends[2]),
                _ => None,
            }
        };
        assert!(ends.at_the_end(end_of([10, 5, 1])));
        assert!(!ends.at_the_end(end_of([11, 5, 1])), "one partition has more");
        assert!(!ends.at_the_end(end_of([10, 5, -1])), "a partition no fetch has told the end of");
        assert!(!BatchEnds::default().at_the_end(|_| Some(0)), "an empty batch read nothing");
    }

    /// Three records, all the topic holds: the batch closes once they are taken,
    /// long before its linger.
    #[test]
    fn a_batch_that_read_its_partitions_to_the_end_closes_without_lingering() {
        let topic = "gather-test";
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic(topic, 1, 1).unwrap();
        let mut client = rdkafka::ClientConfig::new();
        client.set("bootstrap.servers", cluster.bootstrap_servers());
        let producer: BaseProducer = client.create().unwrap();
        for payload in ["a", "b", "c"] {
            producer.send(BaseRecord::<(), _>::to(topic).payload(payload)).unwrap();
        }
        producer.flush(Duration::from_secs(5)).unwrap();
        client.set("group.id", "gather-test").set("enable.auto.commit", "false").set("fetch.wait.max.ms", "10");
        let consumer: BaseConsumer = client.create().unwrap();
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(topic, 0, Offset::Beginning).unwrap();
        consumer.assign(&assignment).unwrap();

        let gather = Gather { linger: Duration::from_millis(400), max_records: 1000, max_bytes: 1 << 20 };
        let inputs = ["other".to_string(), topic.to_string()];
        let (mut batch, mut ends) = (Vec::new(), BatchEnds::default());
        let deadline = Instant::now() + Duration::from_secs(10);
        let (closed, took) = loop {
            let started = Instant::now();
            let closed = gather.poll(&consumer, &inputs, &mut batch, &mut ends);
            if closed != Closed::Empty || Instant::now() > deadline {
                break (closed, started.elapsed());
            }
        };
        let payloads: Vec<&[u8]> = batch.iter().map(|m| m.payload().unwrap()).collect();
        assert_eq!(payloads, vec![&b"a"[..], b"b", b"c"]);
        assert_eq!(ends.0, vec![((1, 0), 3)]);
        assert_eq!(closed, Closed::ReadToTheEnd);
        assert!(took < Duration::from_millis(200), "lingered {took:?}");
    }
}
