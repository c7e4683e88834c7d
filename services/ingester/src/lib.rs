//! `tally-ingester`: consumes `tally.increments` and `tally.graph`, validates every
//! element, routes valid increments to the counter shard that owns their entity and
//! valid graph updates to `tally-graph`'s topic, and writes each bad element to
//! `tally.dead-letter` with its reason. Stateless; scales as a consumer group.
//!
//! Exactly-once effect downstream without Kafka transactions: every routed entry
//! carries a deterministic stamp (input partition, offset, index in the message), so
//! when a restart replays input from the last committed offset the counter drops the
//! entries it already applied. An input position is committed only after every
//! output record before it is acknowledged ([`in_flight`]), so nothing is lost either.
//!
//! The loop is pipelined on one plain thread: while the producer's threads deliver a
//! batch, the next is consumed and routed; the idempotent, gapless producer keeps
//! every shard partition's records in the order they were sent.
//!
//! Every shard and the graph are told how far each input partition is routed
//! ([`marks`]): what reads with a write token wait for.

pub mod error;
pub mod gather;
pub mod in_flight;
pub mod marks;
pub mod metrics;
pub mod route;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::Registry;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{BorrowedMessage, Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientContext;
use tally_core::format::{INPUT_DRAINED_HEADER, RECORD_TIME_HEADER};
use tally_core::trace::{sampled, Span, SpanKind};
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{consumer_config, producer_config, wait_for_topic, TopicNames};
use tally_shared::lock::lock;
use tally_shared::rest::{Rest, TopicPartition, REST_AFTER, REST_CHECK};
use tally_shared::telemetry::{serve_admin, Readiness};
use tokio_util::sync::CancellationToken;

pub use error::{Error, Result};
use gather::{BatchEnds, Closed, Gather};
use in_flight::{InFlight, InputPartition};
use marks::PendingMarks;
use route::{Outgoing, Router};

/// How long a stopping ingester still waits for what it sent to be acknowledged.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Most batches sent and not yet acknowledged; the loop waits for the oldest beyond.
const MAX_IN_FLIGHT: usize = 16;
/// How often acknowledged positions are committed (and at shutdown). A restart
/// replays what was acknowledged after the last commit, which the stamps make
/// harmless; each commit is a round of statements on a broker that pays per request
/// (BENCHMARKS.md, "End to end: ingest").
const COMMIT_EVERY: Duration = Duration::from_secs(1);
/// What [`Pipeline::positions`]' and [`Acks::sender`]'s locks guard ([`tally_shared::lock`]).
const POSITIONS: &str = "the input positions read";
const ACKS: &str = "the delivery reports' sender";

/// Runs an ingester until `shutdown`; what was sent is delivered and committed
/// first (unless Kafka does not acknowledge it within [`SHUTDOWN_GRACE`]).
pub async fn run(config: TallyConfig, shutdown: CancellationToken) -> Result<()> {
    let registry = Registry::new();
    let metrics = metrics::Metrics::new(&registry);
    let readiness = Readiness::default();
    let admin = serve_admin(&config.ingester.admin_listen, registry, readiness.clone(), shutdown.clone()).await?;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let shards = wait_for_topic(&config.kafka, &names.shards(), Duration::from_secs(60)).await?;
    tracing::info!(admin = %admin, shards, "tally-ingester starting");

    let mut consumer_config = consumer_config(&config.kafka)?;
    consumer_config
        .set("group.id", &config.ingester.group_id)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer = consumer_config.create()?;
    let inputs = [names.increments(), names.graph()];
    let mut partitions = Vec::new();
    for input in &inputs {
        partitions.push(wait_for_topic(&config.kafka, input, Duration::from_secs(60)).await?);
    }
    if config.ingester.static_assignment {
        let mut tpl = TopicPartitionList::new();
        for (input, count) in inputs.iter().zip(&partitions) {
            for partition in 0..*count as i32 {
                tpl.add_partition_offset(input, partition, Offset::Stored)?;
            }
        }
        consumer.assign(&tpl)?;
    } else {
        consumer.subscribe(&[&inputs[0], &inputs[1]])?;
    }
    let (acks, acknowledged) = mpsc::channel();
    // Not asked for its producer id at once (`kafka::request_producer_id`, as the
    // other services' producers are): from a backlog the first batches then wait up
    // to a second for it and go out together, and `tally-bench ingest` measures the
    // asking ingester lower with one increment per message.
    let producer: ThreadedProducer<Acks> =
        producer_config(&config.kafka)?.create_with_context(Acks { sender: Mutex::new(acks) })?;

    // Lag per input partition this ingester holds and has read from, measured on
    // threads and clients of their own from the positions the loop has read up to.
    let positions: Arc<Mutex<HashMap<InputPartition, i64>>> = Arc::default();
    let mut reporters = Vec::new();
    for (index, input) in inputs.iter().enumerate() {
        let (read, held, lag) = (positions.clone(), positions.clone(), metrics.clone());
        let (topic, group) = (input.clone(), config.ingester.group_id.clone());
        reporters.push(tally_shared::lag::spawn_lag_reporter(
            &config.kafka,
            "ingester-lag",
            input.clone(),
            Duration::from_secs(5),
            shutdown.clone(),
            move || {
                let read = lock(&read, POSITIONS);
                read.iter().filter(|((input, _), _)| *input == index).map(|((_, p), next)| (*p as u32, *next)).collect()
            },
            move |partition, measured: tally_shared::lag::Lag| {
                // A partition revoked meanwhile is not set again.
                if !lock(&held, POSITIONS).contains_key(&(index, partition as i32)) {
                    return;
                }
                let partition = partition.to_string();
                lag.consumer_lag.with_label_values(&[&topic, &partition]).set(measured.records);
                if let Some(seconds) = measured.seconds {
                    lag.consumer_lag_seconds.with_label_values(&[&group, &topic, &partition]).set(seconds);
                }
            },
            // The ingester keeps no state of its input: a recreated input topic is
            // its consumer group's to reset, not a store to stop.
            |_, _, _| {},
        )?);
    }

    let router = Router::new(names.clone(), shards, config.kafka.record_budget())
        .writing_shard_records_in(config.ingester.shard_record_format)?
        .limiting(config.ingester.limits(&config.counting)?)
        .with_dimensions(config.counting.dimensions()?);
    let marks = PendingMarks::new(&names, shards as u32, config.ingester.marks_every_ms);
    let pipeline = Pipeline {
        marks: RefCell::new(marks),
        last_drained: Cell::new(false),
        marked_taken: RefCell::default(),
        consumer,
        producer,
        acknowledged,
        inputs,
        group: config.ingester.group_id.clone(),
        router,
        metrics,
        readiness: readiness.clone(),
        positions,
        gather: Gather {
            linger: Duration::from_millis(config.ingester.batch_linger_ms),
            max_records: config.ingester.batch_max_records.max(1),
            max_bytes: config.ingester.batch_max_bytes.max(1),
        },
    };
    let stop = shutdown.clone();
    let result = tally_shared::sched::spawn_background("ingest-pipeline", move || pipeline.run(&stop))
        .await
        .unwrap_or_else(|err| Err(Error::Delivery(format!("the ingest loop: {err}"))));
    readiness.set(false);
    shutdown.cancel();
    // A reporter may be mid-tick (watermark look-ups of up to a second): joined off
    // the runtime, whose thread still serves the admin endpoints.
    let joined = tokio::task::spawn_blocking(move || reporters.into_iter().for_each(|reporter| drop(reporter.join())));
    if let Err(err) = joined.await {
        tracing::warn!(error = %err, "joining the lag reporters");
    }
    tracing::info!("tally-ingester stopping");
    result
}

/// An acknowledgement of one output record of batch `seq`, or why it failed.
type Ack = std::result::Result<u64, String>;

/// Passes every delivery report to the loop.
struct Acks {
    sender: Mutex<Sender<Ack>>,
}

impl ClientContext for Acks {}

impl ProducerContext for Acks {
    type DeliveryOpaque = Box<u64>;

    fn delivery(&self, result: &DeliveryResult<'_>, seq: Box<u64>) {
        let ack = match result {
            Ok(_) => Ok(*seq),
            Err((err, _)) => Err(err.to_string()),
        };
        if let Err(ack) = lock(&self.sender, ACKS).send(ack) {
            // The loop is gone only when the ingester is stopping.
            tracing::debug!(ack = ?ack.0, "a delivery report after the ingest loop stopped");
        }
    }
}

/// The consume → route → produce → commit loop and what it owns.
struct Pipeline {
    consumer: BaseConsumer,
    producer: ThreadedProducer<Acks>,
    acknowledged: Receiver<Ack>,
    inputs: [String; 2],
    /// The consumer group (a label of the lag metrics).
    group: String,
    router: Router,
    metrics: metrics::Metrics,
    readiness: Readiness,
    positions: Arc<Mutex<HashMap<InputPartition, i64>>>,
    gather: Gather,
    /// How far each input partition is routed, not yet told ([`marks`]).
    marks: RefCell<PendingMarks>,
    /// The input partitions marked through their committed offset since taken.
    marked_taken: RefCell<HashSet<InputPartition>>,
    /// Whether the last batch sent was `drained` (its marks say so too: a receiver
    /// then closes its batch at once).
    last_drained: Cell<bool>,
}

impl Pipeline {
    fn run(&self, shutdown: &CancellationToken) -> Result<()> {
        let mut in_flight = InFlight::default();
        let mut batch: Vec<BorrowedMessage<'_>> = Vec::with_capacity(self.gather.max_records.min(1 << 16));
        let mut ends = BatchEnds::default();
        let mut last_commit = Instant::now();
        let mut last_health: Option<Instant> = None;
        // Idle, it rests (`shared::rest`): its inputs paused, a look at their ends.
        let inputs: Vec<&str> = self.inputs.iter().map(String::as_str).collect();
        let mut rest = Rest::new(&inputs, REST_AFTER, REST_CHECK, self.metrics.fetch_resting.clone());
        // Where the group committed the partitions not read since this start (`None`:
        // not asked during this rest).
        let mut committed: Option<HashMap<InputPartition, i64>> = None;
        let result = loop {
            if shutdown.is_cancelled() {
                break Ok(());
            }
            if last_health.is_none_or(|at| at.elapsed() >= Duration::from_secs(5)) {
                last_health = Some(Instant::now());
                self.check_health();
            }
            let closed = self.gather.poll(&self.consumer, &self.inputs, &mut batch, &mut ends);
            if batch.is_empty() {
                rest.polled_nothing(&self.consumer, |_| false, || self.next_offsets(&mut committed));
            } else {
                rest.records_came(&self.consumer);
                committed = None;
                if let Err(err) = self.send(&batch, &ends, closed, &mut in_flight) {
                    break Err(err);
                }
                self.metrics.batch_records.observe(batch.len() as f64);
                self.marks.borrow_mut().routed(&ends.0);
                batch.clear();
                ends.clear();
            }
            if let Err(err) = self.send_marks(&mut in_flight) {
                break Err(err);
            }
            // Wait for the oldest batches while too many are out.
            let mut failed = None;
            while in_flight.len() >= MAX_IN_FLIGHT && failed.is_none() && !shutdown.is_cancelled() {
                failed = self.settle(&mut in_flight, Some(Duration::from_millis(50))).err();
            }
            if let Some(err) = failed.or_else(|| self.settle(&mut in_flight, None).err()) {
                break Err(err);
            }
            if last_commit.elapsed() >= COMMIT_EVERY {
                last_commit = Instant::now();
                self.commit(&mut in_flight, CommitMode::Async)?;
            }
        };
        // What was sent is delivered and committed before stopping; a failure or a
        // Kafka that does not answer leaves it to be replayed on the next start.
        if result.is_ok() {
            if let Err(err) = self.send_pending_marks(&mut in_flight) {
                tracing::warn!(error = %err, "sending the last marks; the next start marks its partitions");
            }
            let deadline = Instant::now() + SHUTDOWN_GRACE;
            while !in_flight.is_empty() && Instant::now() < deadline {
                self.settle(&mut in_flight, Some(Duration::from_millis(50)))?;
            }
            if !in_flight.is_empty() {
                tracing::warn!("stopping with records not acknowledged; they are replayed on the next start");
            }
            self.commit(&mut in_flight, CommitMode::Sync)?;
        }
        result
    }

    /// The next offset to read of each input partition: what this ingester read up
    /// to, else where its group committed (asked once per rest, into `committed`).
    fn next_offsets(&self, committed: &mut Option<HashMap<InputPartition, i64>>) -> Vec<(TopicPartition, i64)> {
        if committed.is_none() {
            if let Ok(list) = self.consumer.committed(Duration::from_secs(1)) {
                let mut offsets = HashMap::new();
                for element in list.elements() {
                    let input = self.inputs.iter().position(|name| name == element.topic());
                    if let (Some(input), Offset::Offset(offset)) = (input, element.offset()) {
                        offsets.insert((input, element.partition()), offset);
                    }
                }
                *committed = Some(offsets);
            }
        }
        let read = lock(&self.positions, POSITIONS);
        let mut next: HashMap<InputPartition, i64> = committed.clone().unwrap_or_default();
        next.extend(read.iter().map(|(at, offset)| (*at, *offset)));
        next.into_iter().map(|((input, partition), offset)| ((input, partition as u32), offset)).collect()
    }

    /// Ready while it holds input partitions; the lag of partitions it no longer
    /// holds (a rebalance moved them) is no longer reported here.
    fn check_health(&self) {
        let assigned = self.consumer.assignment().ok();
        self.readiness.set(assigned.as_ref().is_some_and(|assigned| assigned.count() > 0));
        let Some(assigned) = assigned else { return };
        let holds =
            |(input, partition): &InputPartition| assigned.find_partition(&self.inputs[*input], *partition).is_some();
        let mut positions = lock(&self.positions, POSITIONS);
        for (input, partition) in positions.keys().filter(|key| !holds(key)) {
            let (topic, partition) = (&self.inputs[*input], partition.to_string());
            if let Err(err) = self.metrics.consumer_lag.remove_label_values(&[topic, &partition]) {
                // Only when it was never set.
                tracing::debug!(error = %err, input = %topic, partition, "no lag to stop reporting");
            }
            // Set only once a look found a record's time.
            self.metrics.consumer_lag_seconds.remove_label_values(&[&self.group, topic, &partition]).ok();
        }
        positions.retain(|key, _| holds(key));
        drop(positions);
        self.mark_taken(&assigned);
    }

    /// Marks each input partition newly held through its group's committed offset
    /// ([`marks`]): a record below it never needs to wait for input after it.
    fn mark_taken(&self, assigned: &TopicPartitionList) {
        let mut marked = self.marked_taken.borrow_mut();
        let held: HashSet<InputPartition> = assigned
            .elements()
            .iter()
            .filter_map(|e| Some((self.inputs.iter().position(|name| name == e.topic())?, e.partition())))
            .collect();
        marked.retain(|at| held.contains(at));
        if held.iter().all(|at| marked.contains(at)) {
            return;
        }
        let Ok(committed) = self.consumer.committed(Duration::from_secs(1)) else { return };
        let mut ends = Vec::new();
        for element in committed.elements() {
            let Some(input) = self.inputs.iter().position(|name| name == element.topic()) else { continue };
            let at = (input, element.partition());
            if let (false, Offset::Offset(next)) = (marked.contains(&at), element.offset()) {
                ends.push((at, next));
            }
            marked.insert(at);
        }
        self.marks.borrow_mut().routed(&ends);
    }

    /// Routes a batch and hands its output to the producer. A batch that closed
    /// before it was full and read each of its input partitions to the end the
    /// broker last reported is sent as `drained` ([`INPUT_DRAINED_HEADER`]).
    fn send(
        &self,
        batch: &[BorrowedMessage<'_>],
        ends: &BatchEnds,
        closed: Closed,
        in_flight: &mut InFlight,
    ) -> Result<()> {
        let started = tally_core::trace::now_unix_nanos();
        let outgoing = self.router.route(batch, &self.metrics)?;
        if tally_shared::otel::enabled() {
            self.record_route_span(started, batch.len(), &outgoing);
        }
        lock(&self.positions, POSITIONS).extend(ends.0.iter().copied());
        let drained = match closed {
            Closed::ReadToTheEnd => true,
            Closed::Lingered => ends.fetched_to_the_end(&self.consumer, &self.inputs),
            Closed::Full | Closed::Empty => false,
        };
        self.last_drained.set(drained);
        let seq = in_flight.open(ends.0.clone(), outgoing.len());
        for out in &outgoing {
            self.produce(out, drained, seq, in_flight)?;
        }
        Ok(())
    }

    /// The span of routing a batch with traced records: it links their contexts
    /// (which travel on in the shard records' headers).
    fn record_route_span(&self, started: u64, records: usize, outgoing: &[Outgoing]) {
        let contexts = sampled(outgoing.iter().flat_map(|out| out.traces.iter().copied()));
        if contexts.is_empty() {
            return;
        }
        let mut span = Span::start(format!("route {}", self.inputs.join(",")), SpanKind::Consumer, None)
            .attribute("messaging.system", "kafka")
            .attribute("messaging.operation.type", "process")
            .attribute("messaging.consumer.group.name", self.group.as_str())
            .attribute("messaging.batch.message_count", records as i64)
            .link(contexts);
        span.start_unix_nanos = started;
        tally_shared::otel::record(span.end());
    }

    /// Sends the marks that are due ([`marks`]), after every output routed before.
    fn send_marks(&self, in_flight: &mut InFlight) -> Result<()> {
        let due = self.marks.borrow_mut().due(Instant::now())?;
        self.send_mark_records(due, in_flight)
    }

    /// Sends every pending mark, due or not.
    fn send_pending_marks(&self, in_flight: &mut InFlight) -> Result<()> {
        let pending = self.marks.borrow_mut().pending()?;
        self.send_mark_records(pending, in_flight)
    }

    fn send_mark_records(&self, due: Vec<Outgoing>, in_flight: &mut InFlight) -> Result<()> {
        if due.is_empty() {
            return Ok(());
        }
        let seq = in_flight.open(Vec::new(), due.len());
        due.iter().try_for_each(|out| self.produce(out, self.last_drained.get(), seq, in_flight))
    }

    fn produce(&self, out: &Outgoing, drained: bool, seq: u64, in_flight: &mut InFlight) -> Result<()> {
        let mut record = BaseRecord::with_opaque_to(&out.topic, Box::new(seq)).payload(&out.payload).key(&out.key);
        if let Some(partition) = out.partition {
            record = record.partition(partition);
        }
        // The input's time travels in a header; the record's Kafka timestamp is now,
        // so the shard topic's retention counts from routing.
        let time = out.timestamp.map(tally_core::format::record_time_value);
        if time.is_some() || drained || !out.traces.is_empty() {
            let mut headers = OwnedHeaders::new_with_capacity(2 + out.traces.len());
            if let Some(value) = &time {
                headers = headers.insert(Header { key: RECORD_TIME_HEADER, value: Some(&value[..]) });
            }
            if drained {
                headers = headers.insert(Header { key: INPUT_DRAINED_HEADER, value: Some(&[][..]) });
            }
            record = record.headers(tally_shared::otel::with_contexts(headers, &out.traces));
        }
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((err, returned))
                    if matches!(err.rdkafka_error_code(), Some(rdkafka::types::RDKafkaErrorCode::QueueFull)) =>
                {
                    record = returned;
                    self.settle(in_flight, Some(Duration::from_millis(5)))?;
                }
                Err((err, _)) => return Err(err.into()),
            }
        }
    }

    /// Takes in the acknowledgements that arrived (waiting up to `wait` for one).
    /// A failed delivery is fatal: the producer is gapless, so nothing after it may
    /// be committed; the next start replays from the last commit.
    fn settle(&self, in_flight: &mut InFlight, wait: Option<Duration>) -> Result<()> {
        let mut next = match wait {
            Some(wait) => self.acknowledged.recv_timeout(wait).ok(),
            None => self.acknowledged.try_recv().ok(),
        };
        while let Some(ack) = next {
            match ack {
                Ok(seq) => in_flight.acknowledged(seq),
                Err(err) => return Err(Error::Delivery(err)),
            }
            next = self.acknowledged.try_recv().ok();
        }
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            return Err(Error::Delivery(format!("the producer failed for good: {code:?}: {reason}")));
        }
        Ok(())
    }

    /// Commits the positions whose batches (and all before) are acknowledged.
    fn commit(&self, in_flight: &mut InFlight, mode: CommitMode) -> Result<()> {
        let committable = in_flight.take_committable();
        if committable.is_empty() {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        for ((input, partition), offset) in committable {
            tpl.add_partition_offset(&self.inputs[input], partition, Offset::Offset(offset))?;
        }
        if let Err(err) = self.consumer.commit(&tpl, mode) {
            // After a rebalance the new owner replays; stamps make that harmless.
            tracing::warn!(error = %err, "offset commit failed");
        }
        Ok(())
    }
}
