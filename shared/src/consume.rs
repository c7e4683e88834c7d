//! The consuming side of every stateful log processor (a counter's shards,
//! tally-graph's log), written once: bounded batches polled on a plain thread,
//! positions that come from the processor's store (never a group's), failed
//! partitions paused and resumed past a skipped record, and lag measured on a thread
//! of its own so broker round trips never hold up a batch. What a batch *means* —
//! decoding it (fail closed: [`crate::failures`]) and applying it — stays with the
//! processor.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use tally_core::format::{parse_record_time, INPUT_DRAINED_HEADER, RECORD_TIME_HEADER};
use tokio_util::sync::CancellationToken;

use crate::rest::{Rest, REST_AFTER, REST_CHECK};
use crate::Result;

/// The shortest [`BatchLimits::quiet`]: a moment without records on a busy
/// machine is not the end of the load, however short the fetch wait.
pub const MIN_QUIET: Duration = Duration::from_millis(100);

/// How long a batch whose last record says its ingester read its input to the end
/// ([`INPUT_DRAINED_HEADER`]) waits for more ([`poll_batch`]): the rest of the
/// fetch that brought it is queued by then, and nothing else is on its way.
pub const DRAINED_QUIET: Duration = Duration::from_millis(2);

/// How big a batch may grow and how long it waits for more.
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    pub max_records: usize,
    /// Payload bytes, as `payload_bytes` counts them.
    pub max_bytes: usize,
    /// What a record's payload counts toward `max_bytes`: [`as_fetched`], or what it
    /// takes once unpacked (a counter's packed shard records, which `max_bytes` bounds
    /// the memory of).
    pub payload_bytes: fn(&[u8]) -> usize,
    /// How long a batch stays open (unless full), counted from when polling for it
    /// began.
    pub linger: Duration,
    /// How long [`drive`] may stretch `linger` under load ([`BatchLimits::open_for`]);
    /// set at or below `linger`, batches are never stretched.
    pub max_linger: Duration,
    /// A batch past `linger` closes once no record arrived for this long (see
    /// [`poll_batch`]); [`BatchLimits::quiet_for`] of the consumer's fetch wait.
    pub quiet: Duration,
}

/// A payload's bytes as fetched ([`BatchLimits::payload_bytes`]).
pub fn as_fetched(payload: &[u8]) -> usize {
    payload.len()
}

impl BatchLimits {
    /// How long the batch after one that took `applying` to apply may stay open: as
    /// long, within `linger..=max_linger`. While the processor keeps up, it then
    /// applies at most about half the time, and its batches grow with the load (a
    /// hot key is written once per batch, so bigger batches cost less per record)
    /// rather than its share of the CPU; under light load batches close after
    /// `linger`. After a `full` batch (a backlog) it is `linger`: the
    /// next batch fills without waiting, and the one that ends the backlog closes
    /// as soon as under light load (a shard catching up is ready no later).
    pub fn open_for(&self, applying: Duration, full: bool) -> Duration {
        if full {
            return self.linger;
        }
        applying.clamp(self.linger, self.max_linger.max(self.linger))
    }

    /// The `quiet` of a consumer whose fetches wait up to `fetch_wait` at the
    /// broker: twice that, and at least [`MIN_QUIET`]. A broker that holds every
    /// fetch for its whole wait (the local one) hands records over once per wait at
    /// most, even under load.
    pub fn quiet_for(fetch_wait: Duration) -> Duration {
        (fetch_wait * 2).max(MIN_QUIET)
    }
}

/// The time of the input record `message` came from: its [`RECORD_TIME_HEADER`],
/// else its Kafka timestamp. A header that does not decode (no tally producer wrote
/// it) is said loudly and the Kafka timestamp used: the payload decides whether the
/// record is tally's at all.
fn record_time(message: &rdkafka::message::BorrowedMessage<'_>) -> Option<i64> {
    use rdkafka::message::Headers;
    let header = message
        .headers()
        .and_then(|headers| headers.iter().find(|h| h.key == RECORD_TIME_HEADER).and_then(|h| h.value));
    if let Some(value) = header {
        match parse_record_time(value) {
            Ok(ms) => return Some(ms),
            Err(err) => {
                tracing::warn!(partition = message.partition(), offset = message.offset(), error = %err, "a record's time header")
            }
        }
    }
    message.timestamp().to_millis().filter(|ts| *ts >= 0)
}

/// Whether the record carries [`INPUT_DRAINED_HEADER`]: the ingester that sent it
/// had read its input to the end.
fn says_input_drained(message: &rdkafka::message::BorrowedMessage<'_>) -> bool {
    use rdkafka::message::Headers;
    message.headers().is_some_and(|headers| headers.iter().any(|h| h.key == INPUT_DRAINED_HEADER))
}

/// A record copied out of the consumer.
#[derive(Debug, Clone)]
pub struct Polled {
    pub partition: i32,
    pub offset: i64,
    /// The time of the input record it came from ([`RECORD_TIME_HEADER`]; a record
    /// without the header: its Kafka timestamp); `None` when it has neither.
    pub timestamp: Option<i64>,
    pub payload: Vec<u8>,
    /// It says its ingester had read its input to the end ([`INPUT_DRAINED_HEADER`]).
    pub drained: bool,
    /// The trace contexts it carries (its input records', [`crate::otel::contexts_of`]).
    pub traces: Vec<tally_core::trace::TraceContext>,
}

impl Polled {
    /// `message`, copied.
    pub fn copy(message: &rdkafka::message::BorrowedMessage<'_>) -> Self {
        Self {
            partition: message.partition(),
            offset: message.offset(),
            timestamp: record_time(message),
            payload: message.payload().unwrap_or_default().to_vec(),
            drained: says_input_drained(message),
            traces: crate::otel::contexts_of(message.headers()),
        }
    }
}

/// Polls one bounded batch into `batch`, which may hold records already (those a
/// processor took while applying the batch before: [`Processor::apply`]); true when
/// it closed full.
/// It closes when full, when `open_for` (at least `limits.linger`) passed since it
/// opened, past `limits.linger` once no record arrived for `limits.quiet` (the load
/// that stretched it has stopped: at the end of a backlog, waiting out the stretch
/// only delays the last records) — or, `linger` or not, once nothing more came for
/// [`DRAINED_QUIET`] after a record that says its ingester read its input to the
/// end ([`INPUT_DRAINED_HEADER`]: the end of a load, or a light one, told from a
/// pause between an ingester's sends; what else came in the same fetch is already
/// queued) —, or, while still empty, after one idle poll (so the caller's heartbeat
/// work runs). After every poll `interrupted()` is asked:
/// true (a rebalance reset the positions) discards what was collected and returns.
pub fn poll_batch<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    limits: &BatchLimits,
    open_for: Duration,
    batch: &mut Vec<Polled>,
    mut interrupted: impl FnMut() -> bool,
) -> bool {
    let mut bytes: usize = batch.iter().map(|polled| (limits.payload_bytes)(&polled.payload)).sum();
    let opened = Instant::now();
    let deadline = opened + open_for.max(limits.linger);
    // When the batch closes, given when its last record came (or it opened) and
    // whether that record said its input was drained.
    let closes = |quiet_from: Instant, drained: bool| match drained {
        true => deadline.min(quiet_from + DRAINED_QUIET),
        false => deadline.min((quiet_from + limits.quiet).max(opened + limits.linger)),
    };
    let (mut quiet_from, mut drained) = (opened, batch.last().is_some_and(|polled| polled.drained));
    loop {
        let wait = if batch.is_empty() {
            Duration::from_millis(100)
        } else {
            closes(quiet_from, drained).saturating_duration_since(Instant::now())
        };
        let polled = consumer.poll(wait);
        if interrupted() {
            batch.clear();
            return false;
        }
        match polled {
            Some(Ok(message)) => {
                quiet_from = Instant::now();
                let polled = Polled::copy(&message);
                drained = polled.drained;
                bytes += (limits.payload_bytes)(&polled.payload);
                batch.push(polled);
            }
            Some(Err(err)) => tracing::warn!(error = %err, "consumer error"),
            None if batch.is_empty() => return false,
            None => {}
        }
        let full = batch.len() >= limits.max_records.max(1) || bytes >= limits.max_bytes.max(1);
        if full || (!batch.is_empty() && Instant::now() >= closes(quiet_from, drained)) {
            return full;
        }
    }
}

/// Where a store stands against its log, to tell whether it can be brought up to
/// date by replaying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogCheck {
    /// The store's next offset (`None`: an empty store).
    pub next: Option<i64>,
    /// The log's first and next offsets as the broker reports them now.
    pub log_start: i64,
    pub log_end: i64,
    /// How far the processors' group once committed (advisory, for lag tooling: at
    /// most what was applied), when known.
    pub committed: Option<i64>,
}

/// Why the store cannot be brought up to date from the log — records it never
/// applied are gone (deleted by retention, no snapshot covers them, or the topic
/// was recreated) — or `None` when it can. Such a store must not serve: a rebuild
/// from what is left would be partial. Gone records show as a log that starts past
/// the store, or (on brokers that report an emptied log as `0..0`, like the local
/// one) as a log that ends before records the group already applied once.
pub fn unreplayable(check: LogCheck) -> Option<(i64, String)> {
    let needed = check.next.unwrap_or(0);
    if check.log_start > needed {
        let reason = format!(
            "the log starts at offset {}, but the store needs it from offset {needed}: retention deleted \
             records no snapshot covers, so a rebuild would be partial (restore a snapshot that reaches {}, or \
             rebuild the topic)",
            check.log_start, check.log_start
        );
        return Some((check.log_start, reason));
    }
    let committed = check.committed.filter(|&committed| committed > needed && check.log_end < committed)?;
    let reason = format!(
        "the log ends at offset {}, but records up to {committed} were applied before (the group's committed \
         offset) and the store needs them from offset {needed}: they are gone (deleted by retention with no \
         snapshot covering them, or the topic was recreated), so a rebuild would be partial (restore a snapshot \
         that reaches {committed}, or reset the group's offsets if the topic was recreated on purpose)",
        check.log_end
    );
    Some((needed, reason))
}

/// Why a store is ahead of its log — it applied records up to `next - 1`, and the
/// log ends before them: the topic was deleted and recreated (its offsets started
/// again at 0), or the broker lost records it had acknowledged — or `None`. Such a
/// store must stop: consuming on would skip the new records below `next` as already
/// applied, and count the rest on top of another log's. An empty log (`0..0`) says
/// nothing: the local broker reports a log that retention emptied so, whatever
/// offsets it held; a recreated topic is told once it holds a record.
pub fn ahead_of_log(next: Option<i64>, log_end: i64) -> Option<(i64, String)> {
    let next = next.filter(|&next| log_end > 0 && next > log_end)?;
    let reason = format!(
        "the log ends at offset {log_end}, but the store applied it up to offset {}: the topic was deleted and \
         recreated, or the broker lost records it had acknowledged; nothing more is applied (restore a store of this \
         log, or delete the store to rebuild from the log as it is)",
        next - 1
    );
    Some((next, reason))
}

/// The offsets `consumer`'s group committed for `partitions` of `topic` (those it
/// has); empty when they cannot be read now (the check then relies on the log's
/// start alone).
pub fn committed_offsets<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partitions: &[u32],
) -> std::collections::HashMap<u32, i64> {
    let mut tpl = TopicPartitionList::new();
    for &partition in partitions {
        tpl.add_partition(topic, partition as i32);
    }
    match consumer.committed_offsets(tpl, Duration::from_secs(10)) {
        Ok(committed) => committed
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(offset) => Some((e.partition() as u32, offset)),
                _ => None,
            })
            .collect(),
        Err(err) => {
            tracing::warn!(topic, error = %err, "reading the group's committed offsets");
            Default::default()
        }
    }
}

/// How often, at most, a processor's advisory offsets are committed
/// ([`AdvisoryCommits`]).
pub const ADVISORY_COMMIT_EVERY: Duration = Duration::from_secs(1);

/// A processor's advisory commits ([`commit_advisory`]), at most one per
/// [`ADVISORY_COMMIT_EVERY`] and only of offsets that moved since the last: each is
/// a round of statements on a broker that pays per request (the local one serves
/// every client's statements on one task), and lag tooling needs no more than
/// about a second's detail. The group's offsets then trail the stores by up to that
/// much, which is what advisory offsets may do: they are at most what was applied.
#[derive(Debug, Default)]
pub struct AdvisoryCommits {
    last: Option<(Instant, Vec<(u32, i64)>)>,
}

impl AdvisoryCommits {
    /// Commits `offsets` of `topic` if [`AdvisoryCommits::due`] at `now`.
    pub fn commit<C: ConsumerContext>(&mut self, consumer: &BaseConsumer<C>, topic: &str, offsets: Vec<(u32, i64)>) {
        let now = Instant::now();
        if self.due(&offsets, now) {
            commit_advisory(consumer, topic, &offsets);
            self.last = Some((now, offsets));
        }
    }

    /// Whether `offsets` are to be committed at `now`: none were yet, or they differ
    /// from the last ones committed and [`ADVISORY_COMMIT_EVERY`] has passed since.
    pub fn due(&self, offsets: &[(u32, i64)], now: Instant) -> bool {
        match &self.last {
            None => !offsets.is_empty(),
            Some((at, last)) => last != offsets && now.saturating_duration_since(*at) >= ADVISORY_COMMIT_EVERY,
        }
    }
}

/// Commits the stores' next offsets (`partition` → offset) to the group: advisory,
/// for lag tooling and [`unreplayable`], never where consumption resumes.
pub fn commit_advisory<C: ConsumerContext>(consumer: &BaseConsumer<C>, topic: &str, offsets: &[(u32, i64)]) {
    let mut tpl = TopicPartitionList::new();
    for &(partition, next) in offsets {
        if let Err(err) = tpl.add_partition_offset(topic, partition as i32, Offset::Offset(next)) {
            tracing::warn!(error = %err, topic, partition, next, "not committing an advisory offset");
        }
    }
    if tpl.count() > 0 {
        if let Err(err) = consumer.commit(&tpl, rdkafka::consumer::CommitMode::Async) {
            // Advisory: the next commit carries newer offsets.
            tracing::debug!(error = %err, topic, "an advisory commit failed");
        }
    }
}

/// Stops fetching `partitions` of `topic` (they failed). Their records already
/// polled are dropped by the caller all the same.
pub fn pause<C: ConsumerContext>(consumer: &BaseConsumer<C>, topic: &str, partitions: &[u32]) {
    if partitions.is_empty() {
        return;
    }
    let mut tpl = TopicPartitionList::new();
    for &partition in partitions {
        tpl.add_partition(topic, partition as i32);
    }
    if let Err(err) = consumer.pause(&tpl) {
        tracing::warn!(topic, error = %err, "pausing failed partitions");
    }
}

/// Resumes a paused partition at `offset` (past a skipped record).
pub fn resume_at<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partition: u32,
    offset: i64,
) -> Result<()> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition as i32, Offset::Offset(offset))?;
    let sought = consumer.seek_partitions(tpl.clone(), Duration::from_secs(10))?;
    // A partition that did not move would resume where it was paused, past records
    // it dropped: an error, for the skip to be tried again.
    for element in sought.elements() {
        element.error()?;
    }
    consumer.resume(&tpl)?;
    Ok(())
}

/// A stateful log processor's own part of the loop [`drive`] runs: applying its
/// batches and its periodic work. Everything else — polling bounded batches,
/// dropping the records of failed partitions, pausing them, carrying out operators'
/// skips and resuming past them — is the loop's.
pub trait Processor<C: ConsumerContext> {
    type Error: From<crate::Error>;

    /// Whether the consumer's positions were reset since the processor last looked
    /// (a rebalance): the batch being collected is dropped, its records come again.
    fn positions_reset(&self) -> bool {
        false
    }

    /// Applies a batch (records of partitions that have not failed, in offset order
    /// per partition); returns the partitions that failed in it (recorded on the
    /// failure board). A processor may poll `consumer` for more as it goes (a
    /// counter: for shards it has not started yet); what it polled and did not apply
    /// goes into `carried`, in the order polled, and opens the next batch.
    fn apply(&mut self, consumer: &BaseConsumer<C>, batch: &[Polled], carried: &mut Vec<Polled>) -> Vec<u32>;

    /// Moves the store of `partition` past the record at `offset`, which an
    /// operator skipped.
    fn skip_record(&mut self, partition: u32, offset: i64) -> Result<()>;

    /// The next offset the processor will apply of each partition it holds, for a
    /// loop that rests while idle ([`crate::rest`]): a partition it does not name
    /// counts from 0 (the loop then rests only while that partition's log is empty).
    fn next_offsets(&self) -> Vec<(u32, i64)> {
        Vec::new()
    }

    /// Whether the last [`Processor::turn`] set the consumer's positions anew (an
    /// assignment from the stores' offsets): records the batch before carried over
    /// are dropped then, the consumer fetches them again.
    fn repositioned(&mut self) -> bool {
        false
    }

    /// After every turn of the loop (a batch, or an idle poll): `skipped` records
    /// were skipped in it, and `heartbeat` says the periodic work is due. An error
    /// stops the loop.
    fn turn(&mut self, consumer: &BaseConsumer<C>, skipped: u64, heartbeat: bool) -> Result<(), Self::Error>;
}

/// What the loop needs besides the processor.
pub struct LoopSetup<'a> {
    pub topic: &'a str,
    pub limits: BatchLimits,
    /// The processor's partitions' failures and operators' skips.
    pub failures: &'a crate::failures::FailureBoard,
    /// Sends skipped records to the dead-letter topic.
    pub letters: &'a crate::outbox::Relay,
    /// The most bytes of one dead letter.
    pub record_budget: usize,
    pub heartbeat: Duration,
    /// 1 while the loop rests ([`crate::rest`]).
    pub resting: prometheus::IntGauge,
}

/// The one consume loop of every stateful log processor: runs until `shutdown` or
/// the processor's error; the batch in hand is applied before it returns. Each
/// batch may stay open as long as the one before took to apply ([`BatchLimits::open_for`]).
/// While its log is idle it rests ([`crate::rest`]): no fetches, a look at the ends.
pub fn drive<C: ConsumerContext, P: Processor<C>>(
    consumer: &BaseConsumer<C>,
    setup: &LoopSetup<'_>,
    processor: &mut P,
    shutdown: &CancellationToken,
) -> Result<(), P::Error> {
    let (mut batch, mut carried): (Vec<Polled>, Vec<Polled>) = (Vec::new(), Vec::new());
    let mut last_heartbeat: Option<Instant> = None;
    let mut open_for = setup.limits.linger;
    let mut rest = Rest::new(&[setup.topic], REST_AFTER, REST_CHECK, setup.resting.clone());
    while !shutdown.is_cancelled() {
        batch.clear();
        batch.append(&mut carried);
        let full = poll_batch(consumer, &setup.limits, open_for, &mut batch, || processor.positions_reset());
        // Records of a failed partition polled before it was paused: not applied,
        // its store's offset stays at the failure.
        batch.retain(|polled| !setup.failures.is_failed(polled.partition as u32));
        if batch.is_empty() {
            open_for = setup.limits.linger;
            let next =
                || processor.next_offsets().into_iter().map(|(partition, next)| ((0, partition), next)).collect();
            rest.polled_nothing(consumer, |(_, partition)| setup.failures.is_failed(partition), next);
        } else {
            rest.records_came(consumer);
            let started = Instant::now();
            let failed = processor.apply(consumer, &batch, &mut carried);
            open_for = setup.limits.open_for(started.elapsed(), full);
            pause(consumer, setup.topic, &failed);
        }
        let skipped =
            setup.failures.carry_out_skips(setup.letters, setup.topic, setup.record_budget, |partition, offset| {
                processor.skip_record(partition, offset)?;
                resume_at(consumer, setup.topic, partition, offset + 1)
            });
        let heartbeat = last_heartbeat.is_none_or(|at| at.elapsed() >= setup.heartbeat);
        if heartbeat {
            last_heartbeat = Some(Instant::now());
            if let Some(fatal) = setup.letters.fatal() {
                // Skips would never be carried out again: stop loudly.
                return Err(crate::Error::Relay(format!("the dead-letter producer failed for good: {fatal}")).into());
            }
        }
        processor.turn(consumer, skipped, heartbeat)?;
        if processor.repositioned() {
            carried.clear();
            rest.repositioned();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

    use super::*;
    use crate::config::KafkaConfig;
    use crate::failures::FailureBoard;
    use crate::kafka::client_config;
    use crate::outbox::Relay;

    /// The first offsets go at once; later ones once they moved and a second has
    /// passed since the last commit — the newest offsets then, never a stale set.
    #[test]
    fn advisory_offsets_are_committed_when_they_moved_at_most_once_a_second() {
        let start = Instant::now();
        let mut commits = AdvisoryCommits::default();
        assert!(!commits.due(&[], start), "nothing to commit");
        let first = vec![(0, 10), (1, 5)];
        assert!(commits.due(&first, start));
        commits.last = Some((start, first.clone()));
        let moved = vec![(0, 12), (1, 5)];
        let just_before = start + ADVISORY_COMMIT_EVERY - Duration::from_millis(1);
        assert!(!commits.due(&moved, just_before), "within a second of the last commit");
        assert!(commits.due(&moved, start + ADVISORY_COMMIT_EVERY));
        assert!(!commits.due(&first, start + ADVISORY_COMMIT_EVERY * 5), "unmoved offsets go again");
        let reassigned = vec![(0, 10)];
        assert!(commits.due(&reassigned, start + ADVISORY_COMMIT_EVERY), "a partition fewer is a change");
    }

    #[test]
    fn a_batch_lingers_as_long_as_the_one_before_took_within_the_bounds() {
        let limits = BatchLimits {
            max_records: 1,
            max_bytes: 1,
            payload_bytes: as_fetched,
            linger: Duration::from_millis(20),
            max_linger: Duration::from_millis(500),
            quiet: Duration::from_millis(200),
        };
        let after = |ms| limits.open_for(Duration::from_millis(ms), false).as_millis();
        assert_eq!((after(0), after(20), after(300), after(500), after(9_000)), (20, 20, 300, 500, 500));
        let quiet = |ms| BatchLimits::quiet_for(Duration::from_millis(ms)).as_millis();
        assert_eq!((quiet(0), quiet(40), quiet(100), quiet(500)), (100, 100, 200, 1_000));
        let fixed = BatchLimits { max_linger: Duration::ZERO, ..limits };
        assert_eq!(fixed.open_for(Duration::from_millis(300), false), Duration::from_millis(20));
        // After a full batch (a backlog), the next one is not held back.
        assert_eq!(limits.open_for(Duration::from_millis(300), true), Duration::from_millis(20));
    }

    /// A mock cluster whose one-partition `topic` holds `payloads`, and the config
    /// that reaches it.
    fn mock_topic(
        topic: &str,
        payloads: &[&str],
    ) -> (MockCluster<'static, rdkafka::producer::DefaultProducerContext>, KafkaConfig) {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic(topic, 1, 1).unwrap();
        let kafka = KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let producer: BaseProducer = client_config(&kafka).unwrap().create().unwrap();
        for payload in payloads {
            producer.send(BaseRecord::<(), _>::to(topic).payload(*payload)).unwrap();
        }
        producer.flush(Duration::from_secs(5)).unwrap();
        (cluster, kafka)
    }

    /// A consumer of `group` reading `topic`'s partition from its beginning.
    fn consumer_from_start(kafka: &KafkaConfig, topic: &str, group: &str) -> BaseConsumer {
        let mut consumer_config = crate::kafka::consumer_config(kafka).unwrap();
        consumer_config.set("group.id", group).set("enable.auto.commit", "false");
        let consumer: BaseConsumer = consumer_config.create().unwrap();
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(topic, 0, Offset::Beginning).unwrap();
        consumer.assign(&assignment).unwrap();
        consumer
    }

    /// Batch limits of no size, with these times.
    fn unbounded(linger: Duration, max_linger: Duration, quiet: Duration) -> BatchLimits {
        let (max_records, max_bytes, payload_bytes) = (usize::MAX, usize::MAX, as_fetched as fn(&[u8]) -> usize);
        BatchLimits { max_records, max_bytes, payload_bytes, linger, max_linger, quiet }
    }

    /// [`drive`]s `processor` over `topic` until `shutdown`.
    fn drive_on<P: Processor<rdkafka::consumer::DefaultConsumerContext, Error = crate::Error>>(
        consumer: &BaseConsumer,
        kafka: &KafkaConfig,
        topic: &str,
        limits: BatchLimits,
        processor: &mut P,
        shutdown: &CancellationToken,
    ) {
        let failures = FailureBoard::new(|partition| format!("partition {partition}"));
        let letters = Relay::unstamped(kafka, "dead".into()).unwrap();
        let setup = LoopSetup {
            topic,
            limits,
            failures: &failures,
            letters: &letters,
            record_budget: 1 << 20,
            heartbeat: Duration::from_secs(1),
            resting: prometheus::IntGauge::new("resting", "resting").unwrap(),
        };
        drive(consumer, &setup, processor, shutdown).unwrap();
    }

    /// A batch is full once its payloads count `max_bytes` as `payload_bytes` counts
    /// them (a counter: packed records as what they unpack to).
    #[test]
    fn a_batch_is_full_by_the_bytes_its_payloads_count_for() {
        let topic = "weighed";
        let (_cluster, kafka) = mock_topic(topic, &["0123456789"; 10]);
        let first_batch = |payload_bytes: fn(&[u8]) -> usize| {
            let consumer = consumer_from_start(&kafka, topic, "weighed-test");
            let limits = BatchLimits {
                max_records: usize::MAX,
                max_bytes: 50,
                payload_bytes,
                linger: Duration::from_secs(5),
                max_linger: Duration::from_secs(5),
                quiet: Duration::from_secs(5),
            };
            let (mut batch, deadline) = (Vec::new(), Instant::now() + Duration::from_secs(10));
            let mut full = false;
            while batch.is_empty() && Instant::now() < deadline {
                full = poll_batch(&consumer, &limits, limits.linger, &mut batch, || false);
            }
            (full, batch.len())
        };
        assert_eq!(first_batch(as_fetched), (true, 5));
        assert_eq!(first_batch(|payload| payload.len() * 10), (true, 1));
    }

    /// Applies batches, the first slowly, and notes when each apply began and ended.
    struct SlowFirst {
        applies: Vec<(Instant, Instant)>,
        first_takes: Duration,
        /// Set: the producer is stopped halfway through the first apply.
        stop_producing: Option<Arc<AtomicBool>>,
        shutdown: CancellationToken,
    }

    impl Processor<rdkafka::consumer::DefaultConsumerContext> for SlowFirst {
        type Error = crate::Error;

        fn apply(&mut self, _: &BaseConsumer, _: &[Polled], _: &mut Vec<Polled>) -> Vec<u32> {
            let began = Instant::now();
            if self.applies.is_empty() {
                std::thread::sleep(self.first_takes / 2);
                if let Some(producing) = &self.stop_producing {
                    producing.store(false, Ordering::Relaxed);
                }
                std::thread::sleep(self.first_takes / 2);
            }
            self.applies.push((began, Instant::now()));
            if self.applies.len() == 2 {
                self.shutdown.cancel();
            }
            Vec::new()
        }

        fn skip_record(&mut self, _: u32, _: i64) -> Result<()> {
            Ok(())
        }

        fn turn(&mut self, _: &BaseConsumer, _: u64, _: bool) -> Result<()> {
            Ok(())
        }
    }

    const FIRST_TAKES: Duration = Duration::from_millis(600);
    const QUIET: Duration = Duration::from_millis(200);

    /// How the producer of [`second_batch_after_a_slow_apply`] goes on.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Trickle {
        /// It never stops.
        Steady,
        /// It stops halfway through the first apply.
        Stops,
        /// It stops there, its last record saying its input was drained.
        StopsDrained,
    }

    /// Drives two batches from a topic a producer trickles records into (every
    /// 5 ms), the first applied in [`FIRST_TAKES`]. How long the second batch
    /// stayed open.
    fn second_batch_after_a_slow_apply(how: Trickle) -> Duration {
        let cluster = MockCluster::new(1).unwrap();
        let topic = "linger";
        cluster.create_topic(topic, 1, 1).unwrap();
        let kafka = KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let producing = Arc::new(AtomicBool::new(true));
        let trickle = {
            let (producing, producer) =
                (producing.clone(), client_config(&kafka).unwrap().create::<BaseProducer>().unwrap());
            std::thread::spawn(move || {
                while producing.load(Ordering::Relaxed) {
                    // A record the full queue refuses is one fewer in the trickle.
                    producer.send(BaseRecord::<(), _>::to(topic).payload("x")).ok();
                    producer.poll(Duration::from_millis(5));
                }
                if how == Trickle::StopsDrained {
                    let drained = Header { key: INPUT_DRAINED_HEADER, value: Some(&[][..]) };
                    let headers = OwnedHeaders::new().insert(drained);
                    producer.send(BaseRecord::<(), _>::to(topic).payload("x").headers(headers)).unwrap();
                }
                // What is not flushed by now is not waited for by the test.
                producer.flush(Duration::from_secs(5)).ok();
            })
        };
        let mut consumer_config = crate::kafka::consumer_config(&kafka).unwrap();
        // The mock broker holds a fetch for its whole wait: records every 10 ms, well
        // within `QUIET` however busy the machine.
        consumer_config
            .set("group.id", "linger-test")
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "10");
        let consumer: BaseConsumer = consumer_config.create().unwrap();
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(topic, 0, Offset::Beginning).unwrap();
        consumer.assign(&assignment).unwrap();

        let shutdown = CancellationToken::new();
        let mut processor = SlowFirst {
            applies: Vec::new(),
            first_takes: FIRST_TAKES,
            stop_producing: (how != Trickle::Steady).then(|| producing.clone()),
            shutdown: shutdown.clone(),
        };
        let limits = unbounded(Duration::from_millis(10), Duration::from_secs(5), QUIET);
        drive_on(&consumer, &kafka, topic, limits, &mut processor, &shutdown);
        producing.store(false, Ordering::Relaxed);
        trickle.join().unwrap();

        let applies = &processor.applies;
        assert_eq!(applies.len(), 2);
        applies[1].0 - applies[0].1
    }

    /// While records trickle in, the batch after a slow apply stays open as long as
    /// that apply took (`max_linger` permitting), not just `linger`.
    #[test]
    fn drive_stretches_the_linger_after_a_slow_apply() {
        let between = second_batch_after_a_slow_apply(Trickle::Steady);
        // Records came in while the first batch was applied, so the second one
        // opened at once and lingered 600 ms (with `linger` alone: 10 ms).
        assert!(between >= FIRST_TAKES - Duration::from_millis(50), "the second batch lingered {between:?}");
        // As long as the apply took, not `max_linger`.
        assert!(between < Duration::from_secs(3), "the second batch lingered {between:?}");
    }

    /// When records stop coming, a stretched batch closes once `quiet` passed
    /// without one, not after the whole stretch.
    #[test]
    fn a_stretched_batch_closes_when_records_stop_coming() {
        let between = second_batch_after_a_slow_apply(Trickle::Stops);
        // The records of the apply's first half were waiting when the batch opened;
        // none came after them.
        assert!(between >= QUIET - Duration::from_millis(50), "the second batch lingered {between:?}");
        assert!(between < FIRST_TAKES - Duration::from_millis(150), "the second batch lingered {between:?}");
    }

    /// When the last record says its ingester's input was drained, the stretched
    /// batch closes `linger` after it: the load ended, no `quiet` to wait out.
    #[test]
    fn a_stretched_batch_closes_after_a_record_that_says_its_input_drained() {
        let between = second_batch_after_a_slow_apply(Trickle::StopsDrained);
        // Every record was waiting when the batch opened (10 ms of `linger`).
        assert!(between < QUIET - Duration::from_millis(100), "the second batch lingered {between:?}");
    }

    /// Under light load too, a batch whose last record says its ingester's input
    /// drained closes once nothing more is queued, without waiting out `linger`;
    /// the same records without it wait it out.
    #[test]
    fn a_batch_closes_once_nothing_follows_a_record_that_says_its_input_drained() {
        const LINGER: Duration = Duration::from_millis(400);
        let open_for = |drained: bool| -> (Duration, Vec<i64>) {
            let topic = "drained";
            let (_cluster, kafka) = mock_topic(topic, &["x", "x"]);
            let mut last = BaseRecord::<(), _>::to(topic).payload("x");
            if drained {
                let header = Header { key: INPUT_DRAINED_HEADER, value: Some(&[][..]) };
                last = last.headers(OwnedHeaders::new().insert(header));
            }
            let producer: BaseProducer = client_config(&kafka).unwrap().create().unwrap();
            producer.send(last).unwrap();
            producer.flush(Duration::from_secs(5)).unwrap();
            let consumer = consumer_from_start(&kafka, topic, "drained-test");
            // The batch opens with the first record; the two after it came in the
            // same fetch.
            let first = std::iter::repeat_with(|| consumer.poll(Duration::from_secs(1)))
                .take(20)
                .find_map(|polled| polled.and_then(Result::ok).map(|message| Polled::copy(&message)))
                .expect("the first record");
            let mut batch = vec![first];
            let started = Instant::now();
            let full =
                poll_batch(&consumer, &unbounded(LINGER, LINGER, Duration::from_secs(5)), LINGER, &mut batch, || false);
            assert!(!full);
            (started.elapsed(), batch.iter().map(|polled| polled.offset).collect())
        };
        let (drained, offsets) = open_for(true);
        assert_eq!(offsets, vec![0, 1, 2]);
        assert!(drained < LINGER / 2, "the batch lingered {drained:?} after its input drained");
        let (lingered, offsets) = open_for(false);
        assert_eq!(offsets, vec![0, 1, 2]);
        assert!(lingered >= LINGER - Duration::from_millis(5), "the batch closed after {lingered:?}");
    }

    /// Takes the first record of its first batch and hands the rest back as polled
    /// but not applied; notes the offsets of each batch it gets.
    struct HandsBack {
        batches: Vec<Vec<i64>>,
        /// Its turns say the consumer was repositioned.
        repositions: bool,
        shutdown: CancellationToken,
    }

    impl Processor<rdkafka::consumer::DefaultConsumerContext> for HandsBack {
        type Error = crate::Error;

        fn apply(&mut self, _: &BaseConsumer, batch: &[Polled], carried: &mut Vec<Polled>) -> Vec<u32> {
            self.batches.push(batch.iter().map(|polled| polled.offset).collect());
            match self.batches.len() {
                1 => carried.extend(batch[1..].iter().cloned()),
                _ => self.shutdown.cancel(),
            }
            Vec::new()
        }

        fn skip_record(&mut self, _: u32, _: i64) -> Result<()> {
            Ok(())
        }

        fn repositioned(&mut self) -> bool {
            self.repositions
        }

        fn turn(&mut self, _: &BaseConsumer, _: u64, _: bool) -> Result<()> {
            Ok(())
        }
    }

    /// What a processor polled during a batch and did not apply opens the next
    /// batch, which closes though no new record comes — unless the processor's turn
    /// repositioned the consumer.
    #[test]
    fn records_a_processor_carried_over_open_the_next_batch() {
        assert_eq!(batches_handed_back(false), vec![vec![0, 1, 2], vec![1, 2]]);
        assert_eq!(batches_handed_back(true), vec![vec![0, 1, 2]]);
    }

    /// The batches [`HandsBack`] got from 3 records (2 s at most).
    fn batches_handed_back(repositions: bool) -> Vec<Vec<i64>> {
        let topic = "carried";
        let (_cluster, kafka) = mock_topic(topic, &["x"; 3]);
        let consumer = consumer_from_start(&kafka, topic, "carried-test");
        let shutdown = CancellationToken::new();
        let mut processor = HandsBack { batches: Vec::new(), repositions, shutdown: shutdown.clone() };
        let half_a_second = Duration::from_millis(500);
        let limits = unbounded(half_a_second, half_a_second, half_a_second);
        let give_up = shutdown.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            give_up.cancel();
        });
        drive_on(&consumer, &kafka, topic, limits, &mut processor, &shutdown);
        processor.batches
    }

    #[test]
    fn a_store_ahead_of_its_log_is_named_with_both_offsets() {
        assert_eq!(ahead_of_log(None, 0), None, "an empty store");
        assert_eq!(ahead_of_log(Some(900), 900), None, "caught up");
        assert_eq!(ahead_of_log(Some(500), 900), None, "behind");
        assert_eq!(ahead_of_log(Some(500), 0), None, "an empty log: emptied by retention on the local broker");
        let (offset, reason) = ahead_of_log(Some(900), 3).unwrap();
        assert_eq!(offset, 900, "where the store stopped");
        assert!(reason.starts_with("the log ends at offset 3, but the store applied it up to offset 899: the topic was deleted and recreated"), "{reason}");
    }

    #[test]
    fn a_store_the_log_no_longer_reaches_cannot_be_replayed() {
        let check =
            |next, log_start, log_end, committed| unreplayable(LogCheck { next, log_start, log_end, committed });
        assert_eq!(check(None, 0, 0, None), None, "an empty store and an empty log");
        assert_eq!(check(None, 0, 900, Some(900)), None, "an empty store and the whole log");
        assert_eq!(check(Some(500), 100, 900, Some(900)), None, "a snapshot past the log's start");
        assert_eq!(check(Some(500), 500, 900, None), None);
        let (offset, empty) = check(None, 100, 900, None).unwrap();
        assert_eq!(offset, 100);
        assert!(empty.contains("starts at offset 100") && empty.contains("from offset 0"), "{empty}");
        assert!(check(Some(99), 100, 900, None).is_some(), "a snapshot older than the log's start");
        // A broker that reports an emptied log as 0..0.
        let (offset, gone) = check(None, 0, 0, Some(900)).unwrap();
        assert_eq!(offset, 0);
        assert!(gone.contains("ends at offset 0") && gone.contains("up to 900"), "{gone}");
        assert_eq!(check(Some(900), 0, 0, Some(900)), None, "a snapshot that reaches what was applied");
        assert!(check(Some(400), 0, 0, Some(900)).is_some(), "a snapshot short of it");
    }
}
