//! A consume loop that rests while its logs are idle: its partitions paused, so it
//! sends no fetches, and one request for the partitions' ends every
//! [`REST_CHECK`] to learn when to fetch again. The ingester's loop and
//! [`crate::consume::drive`] (a counter's, the graph's) rest.
//!
//! A broker that holds every fetch for the consumer's whole wait (the local one)
//! looks at each partition once per wait, records or not, and those looks take the
//! cores the read path shares (BENCHMARKS.md, "Reads"). A shorter
//! wait brings a record to the processor sooner but costs more looks. Resting keeps
//! both: a short wait while records flow, and while none do, one look at the ends
//! per [`REST_CHECK`] instead of a fetch per wait. A record written while the loop
//! rests waits at most a check and the fetch after it longer than it would have; what is
//! fetched, and from where, does not change (a paused partition resumes at the
//! position it was paused at).

use std::time::{Duration, Instant};

use prometheus::IntGauge;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

/// How long a loop polls nothing before it rests: longer than the pauses within a
/// load. The local broker answers a backlog's fetches in lumps up to about two seconds
/// apart (one increment per message), and a look at the ends waits behind them: a
/// loop that rested between lumps came to the next one late (`tally-bench ingest`:
/// 0.83-0.88x raw at one second against 0.89-0.91x not resting).
pub const REST_AFTER: Duration = Duration::from_secs(5);
/// How often a resting loop asks for its partitions' ends.
pub const REST_CHECK: Duration = Duration::from_millis(100);
/// How long a check waits for the broker; past it, the loop fetches again.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// A partition of one of the loop's topics: the topic's index, the partition.
pub type TopicPartition = (usize, u32);

/// Whether a loop rests, and since when it polled nothing.
pub struct Rest {
    /// The topics the loop consumes.
    topics: Vec<String>,
    after: Duration,
    check: Duration,
    quiet_since: Instant,
    resting: Option<Resting>,
    /// 1 while resting.
    gauge: IntGauge,
}

/// The partitions a resting loop paused, and when it last checked their ends.
struct Resting {
    paused: Vec<TopicPartition>,
    checked: Instant,
}

impl Rest {
    /// A loop of `topics` that rests after `after` without records, checking every
    /// `check`; `gauge` says whether it rests.
    pub fn new(topics: &[&str], after: Duration, check: Duration, gauge: IntGauge) -> Self {
        gauge.set(0);
        let topics = topics.iter().map(|topic| topic.to_string()).collect();
        Self { topics, after, check, quiet_since: Instant::now(), resting: None, gauge }
    }

    pub fn is_resting(&self) -> bool {
        self.resting.is_some()
    }

    /// Records came: the loop fetches (every partition it paused to rest resumes).
    pub fn records_came<C: ConsumerContext>(&mut self, consumer: &BaseConsumer<C>) {
        self.quiet_since = Instant::now();
        self.wake(consumer);
    }

    /// The processor set the consumer's positions anew (an assignment, which
    /// resumes what it assigns): awake, with nothing of its own left paused.
    pub fn repositioned(&mut self) {
        self.quiet_since = Instant::now();
        self.resting = None;
        self.gauge.set(0);
    }

    /// A turn that polled nothing. Awake and quiet for `after`: pauses every
    /// assigned partition of its topics that has not failed (`is_failed`). Resting,
    /// every `check`: asks the broker for the paused partitions' ends and wakes when
    /// one ends past the next offset the processor will apply (`next_offsets`; a
    /// partition it does not name counts from 0), or when the broker does not answer.
    pub fn polled_nothing<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        is_failed: impl Fn(TopicPartition) -> bool,
        next_offsets: impl FnOnce() -> Vec<(TopicPartition, i64)>,
    ) {
        match &self.resting {
            None if self.quiet_since.elapsed() >= self.after => self.start(consumer, is_failed),
            Some(resting) if resting.checked.elapsed() >= self.check => {
                if self.grew(consumer, next_offsets()) {
                    self.wake(consumer);
                } else if let Some(resting) = &mut self.resting {
                    resting.checked = Instant::now();
                }
            }
            _ => {}
        }
    }

    fn start<C: ConsumerContext>(&mut self, consumer: &BaseConsumer<C>, is_failed: impl Fn(TopicPartition) -> bool) {
        let assigned = match consumer.assignment() {
            Ok(assigned) => assigned,
            Err(err) => return tracing::warn!(error = %err, "reading the assignment to rest"),
        };
        let paused: Vec<TopicPartition> = (0..self.topics.len())
            .flat_map(|topic| {
                let elements = assigned.elements_for_topic(&self.topics[topic]);
                elements.into_iter().map(move |element| (topic, element.partition() as u32))
            })
            .filter(|partition| !is_failed(*partition))
            .collect();
        if paused.is_empty() {
            return;
        }
        if let Err(err) = consumer.pause(&self.list(&paused, None)) {
            return tracing::warn!(error = %err, "pausing partitions to rest");
        }
        tracing::debug!(topics = ?self.topics, partitions = ?paused, "resting: no fetches until a log grows");
        self.resting = Some(Resting { paused, checked: Instant::now() });
        self.gauge.set(1);
    }

    fn wake<C: ConsumerContext>(&mut self, consumer: &BaseConsumer<C>) {
        let Some(resting) = self.resting.take() else { return };
        self.gauge.set(0);
        // Quiet from now on: what woke it has a whole `after` to come.
        self.quiet_since = Instant::now();
        // A partition that failed since it was paused stays paused: only the loop
        // that applies its records pauses one, and it applies nothing while resting.
        if let Err(err) = consumer.resume(&self.list(&resting.paused, None)) {
            tracing::warn!(error = %err, "resuming rested partitions");
        }
        tracing::debug!(topics = ?self.topics, "awake: a log grew");
    }

    /// Whether a paused partition's log ends past where its processor stands (or
    /// the broker did not say).
    fn grew<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, next_offsets: Vec<(TopicPartition, i64)>) -> bool {
        let Some(resting) = &self.resting else { return false };
        // One ListOffsets request for every paused partition: the latest offsets.
        let ends = match consumer.offsets_for_times(self.list(&resting.paused, Some(Offset::End)), CHECK_TIMEOUT) {
            Ok(ends) => ends,
            Err(err) => {
                tracing::debug!(error = %err, "asking for the ends of rested partitions; fetching again");
                return true;
            }
        };
        resting.paused.iter().any(|&(topic, partition)| {
            let next = next_offsets.iter().find(|(at, _)| *at == (topic, partition)).map_or(0, |(_, next)| *next);
            let end = ends.find_partition(&self.topics[topic], partition as i32);
            match end.map(|element| (element.error(), element.offset())) {
                Some((Ok(()), Offset::Offset(end))) => end > next,
                _ => true,
            }
        })
    }

    /// `partitions`, each at `offset` when given.
    fn list(&self, partitions: &[TopicPartition], offset: Option<Offset>) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for &(topic, partition) in partitions {
            let mut element = tpl.add_partition(&self.topics[topic], partition as i32);
            if let Some(offset) = offset {
                // Only an offset out of librdkafka's range fails, and `End` is not.
                if let Err(err) = element.set_offset(offset) {
                    tracing::warn!(error = %err, topic = %self.topics[topic], partition, "a partition's offset not set");
                }
            }
        }
        tpl
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};
    use rdkafka::Message;

    use super::*;
    use crate::config::KafkaConfig;
    use crate::failures::{Failure, FailureBoard};
    use crate::kafka::client_config;

    const TOPIC: &str = "rest";
    const AFTER: Duration = Duration::from_millis(200);
    const CHECK: Duration = Duration::from_millis(100);

    /// A mock broker with a record at offset 0 of partitions 0 and 1, and a
    /// consumer (10 ms fetch wait) that read both.
    struct Rig {
        _cluster: MockCluster<'static, DefaultProducerContext>,
        producer: BaseProducer,
        consumer: BaseConsumer,
        failures: FailureBoard,
        rest: Rest,
    }

    impl Rig {
        fn new() -> Self {
            let cluster = MockCluster::new(1).unwrap();
            cluster.create_topic(TOPIC, 2, 1).unwrap();
            let kafka = KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
            let producer: BaseProducer = client_config(&kafka).unwrap().create().unwrap();
            let mut config = crate::kafka::consumer_config(&kafka).unwrap();
            config.set("group.id", "rest-test").set("enable.auto.commit", "false").set("fetch.wait.max.ms", "10");
            let consumer: BaseConsumer = config.create().unwrap();
            let mut assignment = TopicPartitionList::new();
            for partition in [0, 1] {
                assignment.add_partition_offset(TOPIC, partition, Offset::Beginning).unwrap();
            }
            consumer.assign(&assignment).unwrap();
            let gauge = IntGauge::new("resting", "resting").unwrap();
            let mut rig = Self {
                _cluster: cluster,
                producer,
                consumer,
                failures: FailureBoard::new(|p| format!("p{p}")),
                rest: Rest::new(&[TOPIC], AFTER, CHECK, gauge),
            };
            rig.write(0);
            rig.write(1);
            assert_eq!(rig.polled(2, Duration::from_secs(10)), vec![(0, 0), (1, 0)]);
            rig.rest.records_came(&rig.consumer);
            rig
        }

        fn write(&self, partition: i32) {
            self.producer.send(BaseRecord::<(), _>::to(TOPIC).partition(partition).payload("x")).unwrap();
            self.producer.flush(Duration::from_secs(5)).unwrap();
        }

        /// `(partition, offset)` of what the consumer hands over within `within`
        /// (stopping at `expected` records), sorted.
        fn polled(&self, expected: usize, within: Duration) -> Vec<(i32, i64)> {
            let deadline = Instant::now() + within;
            let mut got = Vec::new();
            while got.len() < expected && Instant::now() < deadline {
                if let Some(Ok(message)) = self.consumer.poll(Duration::from_millis(20)) {
                    got.push((message.partition(), message.offset()));
                }
            }
            got.sort();
            got
        }

        /// One turn that polled nothing, the processor standing at `next`.
        fn nothing(&mut self, next: &[(u32, i64)]) {
            let next: Vec<(TopicPartition, i64)> = next.iter().map(|&(p, n)| ((0, p), n)).collect();
            let failures = &self.failures;
            self.rest.polled_nothing(&self.consumer, |(_, p)| failures.is_failed(p), || next);
        }

        /// Turns of a loop that polls nothing, for `span`, the processor standing at
        /// `next`.
        fn idle_for(&mut self, span: Duration, next: &[(u32, i64)]) {
            let until = Instant::now() + span;
            while Instant::now() < until {
                assert_eq!(self.consumer.poll(Duration::from_millis(20)).map(|m| m.map(|m| m.offset())), None);
                self.nothing(next);
            }
        }
    }

    #[test]
    fn an_idle_loop_rests_fetches_nothing_and_wakes_when_a_look_finds_a_record() {
        let mut rig = Rig::new();
        let applied = [(0, 1), (1, 1)];
        rig.idle_for(AFTER / 2, &applied);
        assert!(!rig.rest.is_resting(), "rested before it was quiet for {AFTER:?}");
        rig.idle_for(AFTER, &applied);
        assert!(rig.rest.is_resting());
        assert_eq!(rig.rest.gauge.get(), 1);
        // Looks at the ends find nothing new: it stays at rest.
        rig.idle_for(CHECK * 4, &applied);
        assert!(rig.rest.is_resting());
        // A record written meanwhile is not fetched: the partitions are paused.
        rig.write(1);
        assert_eq!(rig.polled(1, Duration::from_millis(500)), vec![]);
        assert!(rig.rest.is_resting());
        // The next look finds it, and the loop fetches it.
        std::thread::sleep(CHECK);
        rig.nothing(&applied);
        assert!(!rig.rest.is_resting());
        assert_eq!(rig.rest.gauge.get(), 0);
        assert_eq!(rig.polled(1, Duration::from_secs(10)), vec![(1, 1)]);
        rig.rest.records_came(&rig.consumer);
        // A partition the processor does not name counts from 0: its record wakes it.
        rig.idle_for(AFTER + CHECK, &[(0, 1), (1, 2)]);
        assert!(rig.rest.is_resting());
        rig.idle_for(CHECK * 2, &[(1, 2)]);
        assert!(!rig.rest.is_resting(), "partition 0's record did not wake it");
    }

    #[test]
    fn a_failed_partition_stays_paused_when_the_loop_wakes() {
        let mut rig = Rig::new();
        rig.failures.fail(1, Failure { offset: Some(1), reason: "broken".into(), record: None });
        let mut failed = TopicPartitionList::new();
        failed.add_partition(TOPIC, 1);
        rig.consumer.pause(&failed).unwrap();
        rig.idle_for(AFTER + CHECK, &[(0, 1), (1, 1)]);
        assert!(rig.rest.is_resting());
        rig.write(1);
        rig.write(0);
        rig.idle_for(CHECK * 2, &[(0, 1), (1, 1)]);
        assert!(!rig.rest.is_resting());
        assert_eq!(rig.polled(2, Duration::from_secs(2)), vec![(0, 1)]);
    }

    #[test]
    fn records_or_a_new_assignment_wake_a_resting_loop() {
        let mut rig = Rig::new();
        rig.idle_for(AFTER + CHECK, &[(0, 1), (1, 1)]);
        assert!(rig.rest.is_resting());
        rig.rest.records_came(&rig.consumer);
        assert!(!rig.rest.is_resting());
        rig.write(0);
        assert_eq!(rig.polled(1, Duration::from_secs(10)), vec![(0, 1)]);
        rig.idle_for(AFTER + CHECK, &[(0, 2), (1, 1)]);
        assert!(rig.rest.is_resting());
        rig.rest.repositioned();
        assert!(!rig.rest.is_resting());
        assert_eq!(rig.rest.gauge.get(), 0);
    }
}
