//! Records that arrive while a batch is being applied. Those of a shard the batch
//! has not started yet join that shard's part of it: a shard's apply costs about
//! the same however many records it holds (its entities' buckets are written once
//! either way, BENCHMARKS.md), so at the end of a load the last records need not
//! wait for the apply in progress and then a whole batch of their own. The rest —
//! records of shards already started, or not in the batch — open the next batch
//! ([`tally_shared::consume::Processor::apply`]'s `carried`), in the order polled.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, ConsumerContext};
use tally_shared::consume::Polled;
use tally_shared::lock;

/// What the inbox's lock guards, for [`lock::poisoned`].
const INBOX: &str = "a batch's late records";

/// One batch's late records, polled as each shard starts.
pub struct LateRecords<'c, C: ConsumerContext> {
    consumer: &'c BaseConsumer<C>,
    inbox: Mutex<Inbox>,
}

struct Inbox {
    /// The batch's shards not started yet, and the records polled for each.
    waiting: HashMap<u32, Vec<Polled>>,
    /// Records for the next batch.
    carried: Vec<Polled>,
    /// Payload bytes polled so far, as `payload_bytes` counts them, and the most
    /// the batch may poll (the consumer keeps the rest).
    bytes: usize,
    budget: usize,
    payload_bytes: fn(&[u8]) -> usize,
}

impl<'c, C: ConsumerContext> LateRecords<'c, C> {
    /// For a batch of `shards`, polling at most `budget` bytes as `payload_bytes`
    /// counts them (0: none; the batch applies what it was polled with).
    pub fn new(
        consumer: &'c BaseConsumer<C>,
        shards: impl IntoIterator<Item = u32>,
        budget: usize,
        payload_bytes: fn(&[u8]) -> usize,
    ) -> Self {
        let waiting = shards.into_iter().map(|shard| (shard, Vec::new())).collect();
        let inbox = Inbox { waiting, carried: Vec::new(), bytes: 0, budget, payload_bytes };
        Self { consumer, inbox: Mutex::new(inbox) }
    }

    /// `shard` starts: the records that came for it since the batch was polled,
    /// those the consumer holds now included, in offset order.
    pub fn start(&self, shard: u32) -> Vec<Polled> {
        // Only the threads of one batch take it, for a poll's moments.
        let mut inbox = lock::lock(&self.inbox, INBOX);
        while inbox.bytes < inbox.budget {
            match self.consumer.poll(Duration::ZERO) {
                Some(Ok(message)) => {
                    let polled = Polled::copy(&message);
                    inbox.bytes += (inbox.payload_bytes)(&polled.payload);
                    match inbox.waiting.get_mut(&(polled.partition as u32)) {
                        Some(records) => records.push(polled),
                        None => inbox.carried.push(polled),
                    }
                }
                Some(Err(err)) => tracing::warn!(error = %err, "consumer error"),
                None => break,
            }
        }
        inbox.waiting.remove(&shard).unwrap_or_default()
    }

    /// Payload bytes polled so far (tests wait for the consumer's fetches with it).
    #[cfg(test)]
    pub(crate) fn polled_bytes(&self) -> usize {
        self.inbox.lock().unwrap().bytes
    }

    /// What the batch polled and did not apply: the next batch's first records.
    pub fn into_carried(self) -> Vec<Polled> {
        let inbox = self.inbox.into_inner().unwrap_or_else(|_| lock::poisoned(INBOX));
        let mut carried = inbox.carried;
        // Records of shards that never started (the batch stopped early) go on too.
        carried.extend(inbox.waiting.into_values().flatten());
        carried
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use rdkafka::consumer::{Consumer, DefaultConsumerContext};
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
    use tally_shared::config::KafkaConfig;
    use tally_shared::consume::as_fetched;

    use super::*;

    const TOPIC: &str = "shards";

    fn produce(producer: &BaseProducer, records: &[(i32, &str)]) {
        for &(partition, payload) in records {
            producer.send(BaseRecord::<(), _>::to(TOPIC).partition(partition).payload(payload)).unwrap();
        }
        producer.flush(Duration::from_secs(5)).unwrap();
    }

    /// Polls (as a shard outside the batch starting) until the batch took `bytes`.
    fn poll_until(late: &LateRecords<'_, DefaultConsumerContext>, bytes: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while late.polled_bytes() < bytes && Instant::now() < deadline {
            assert_eq!(late.start(99).len(), 0, "shard 99 is not in the batch");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(late.polled_bytes(), bytes);
    }

    fn offsets(records: &[Polled]) -> Vec<(i32, i64, String)> {
        let mut offsets: Vec<_> =
            records.iter().map(|r| (r.partition, r.offset, String::from_utf8(r.payload.clone()).unwrap())).collect();
        offsets.sort();
        offsets
    }

    /// Records of a shard not started yet join it; those of a shard started, or
    /// not in the batch, are carried to the next; no more than the budget is polled.
    #[test]
    fn late_records_join_shards_not_started_and_the_rest_open_the_next_batch() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic(TOPIC, 3, 1).unwrap();
        let kafka = KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let producer: BaseProducer = tally_shared::kafka::client_config(&kafka).unwrap().create().unwrap();
        let consumer = |group: &str| {
            let mut config = tally_shared::kafka::consumer_config(&kafka).unwrap();
            config.set("group.id", group).set("enable.auto.commit", "false").set("fetch.wait.max.ms", "10");
            let consumer: BaseConsumer = config.create().unwrap();
            let mut assignment = TopicPartitionList::new();
            for partition in 0..3 {
                assignment.add_partition_offset(TOPIC, partition, Offset::Beginning).unwrap();
            }
            consumer.assign(&assignment).unwrap();
            consumer
        };
        produce(&producer, &[(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1"), (2, "c0"), (2, "c1")]);

        let joining = consumer("late-test");
        let late = LateRecords::new(&joining, [0, 1], usize::MAX, as_fetched);
        poll_until(&late, 12);
        let one = late.start(1);
        assert_eq!(offsets(&one), [(1, 0, "b0".into()), (1, 1, "b1".into())]);
        produce(&producer, &[(1, "b2"), (0, "a2")]);
        poll_until(&late, 16);
        let zero = late.start(0);
        assert_eq!(offsets(&zero), [(0, 0, "a0".into()), (0, 1, "a1".into()), (0, 2, "a2".into())]);
        assert_eq!(offsets(&late.start(0)), [], "a shard starts once");
        let carried = late.into_carried();
        assert_eq!(offsets(&carried), [(1, 2, "b2".into()), (2, 0, "c0".into()), (2, 1, "c1".into())]);

        // A budget of two records' bytes: two polled, the rest left to the consumer.
        let bounded = consumer("bounded-test");
        let late = LateRecords::new(&bounded, [0, 1, 2], 4, as_fetched);
        poll_until(&late, 4);
        let taken = [0, 1, 2].map(|shard| late.start(shard).len());
        assert_eq!((taken.iter().sum::<usize>(), late.into_carried().len()), (2, 0));
        let mut left = 0;
        // Until a second passes without a record.
        while let Some(Ok(_)) = bounded.poll(Duration::from_secs(1)) {
            left += 1;
        }
        assert_eq!(left, 6, "the consumer kept the 6 of 8 records the budget did not take");
    }
}
