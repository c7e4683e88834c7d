//! The processor thread: consumes `tally.graph-updates` (one partition, one
//! `tally-graph` instance), applies batches to the [`GraphStore`], relays the
//! outbox to the counter shards, and announces its read address.
//!
//! A plain thread over a `BaseConsumer`: graph traversals are CPU work that must not
//! block the async runtime. It resumes from the store's offset, never a group's.
//!
//! It fails closed ([`tally_shared::failures`]): a record that does not decode, a gap
//! in the log, or a batch the store cannot apply stops the graph at that offset —
//! nothing more is applied, `/readyz` and neighbour reads say why. `tally shards skip
//! graph` moves it past a record that does not decode; the others need the store
//! restored or rebuilt.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, DefaultConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tally_core::wire::ShardOwner;
use tally_shared::announce::{Announcer, HEARTBEAT};
use tally_shared::config::TallyConfig;
use tally_shared::consume::{
    ahead_of_log, committed_offsets, drive, pause, unreplayable, AdvisoryCommits, BatchLimits, LogCheck, LoopSetup,
    Polled, Processor,
};
use tally_shared::kafka::{now_ms, TopicNames};
use tally_shared::lag::{spawn_lag_reporter, Lag};
use tally_shared::outbox::Relay;
use tally_shared::snapshot::{SnapshotAges, SnapshotRequests, SnapshotStore, Snapshotter};
use tally_shared::store_name::StoreName;
use tally_shared::telemetry::Readiness;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::store::{GraphStore, UpdateRecord, GRAPH};
use tally_shared::failures::{Failure, FailureBoard};

pub struct ProcessorSetup {
    pub config: TallyConfig,
    pub store: Arc<GraphStore>,
    /// The graph-updates partition's failure, if any, and operators' skips.
    pub failures: Arc<FailureBoard>,
    pub metrics: Metrics,
    pub readiness: Readiness,
    pub read_addr: String,
    /// Where the graph's snapshots are kept, and operators' requests to take one
    /// now (`None`: snapshots off).
    pub snapshots: Option<(SnapshotStore, Arc<SnapshotRequests>)>,
    /// Where the snapshot gauges go.
    pub registry: prometheus::Registry,
}

/// The name of the graph's snapshots: under its log's name.
pub fn snapshot_name(names: &TopicNames) -> String {
    StoreName::graph(names).to_string()
}

/// Runs until `shutdown`; the batch in hand is persisted and relayed first.
pub fn run(setup: ProcessorSetup, shutdown: CancellationToken) -> Result<()> {
    let ProcessorSetup { config, store, failures, metrics, registry, readiness, read_addr, snapshots } = setup;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let input = names.graph_updates();
    let mut consumer_config = tally_shared::kafka::consumer_config(&config.kafka)?;
    // A store offset the log no longer holds restarts at the earliest record: the
    // gap fails the graph rather than jumping to the end.
    consumer_config.set("group.id", GROUP).set("enable.auto.commit", "false").set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer = consumer_config.create()?;
    let start = store.next_offset().map_or(Offset::Beginning, Offset::Offset);
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(&input, 0, start)?;
    consumer.assign(&assignment)?;
    // Not ready before it applied what the log held at start (a rebuild).
    let (log_start, start_end) = consumer.fetch_watermarks(&input, PARTITION as i32, Duration::from_secs(10))?;
    let committed = committed_offsets(&consumer, &input, &[PARTITION]).get(&PARTITION).copied();
    let check = LogCheck { next: store.next_offset(), log_start, log_end: start_end, committed };
    let topic_id = tally_shared::topic_id::current(consumer.client(), &input);
    let recreated = || {
        let reason = tally_shared::topic_id::check_store(store.store(), &input, topic_id.as_deref())
            .unwrap_or_else(|err| Some(format!("checking its store's topic id: {err}")))?;
        Some((store.next_offset().unwrap_or(0), reason))
    };
    let failed = unreplayable(check).or_else(|| ahead_of_log(store.next_offset(), start_end)).or_else(recreated);
    if let Some((offset, reason)) = failed {
        failures.fail(PARTITION, Failure { offset: Some(offset), reason, record: None });
        pause(&consumer, &input, &[PARTITION]);
    }

    // One producer for the dead-letter topic: the loop's skipped records and the
    // store's refused updates.
    let letters = Arc::new(Relay::unstamped(&config.kafka, names.dead_letter())?);
    tracing::info!(start = ?start, "graph processor consuming");
    let (lag_store, lag_metrics, lag_failures) = (store.clone(), metrics.clone(), failures.clone());
    let lag_reporter = spawn_lag_reporter(
        &config.kafka,
        "graph-lag",
        input.clone(),
        HEARTBEAT,
        shutdown.clone(),
        move || vec![(PARTITION, lag_store.next_offset().unwrap_or(0))],
        move |partition, lag: Lag| {
            lag_metrics.consumer_lag.set(lag.records);
            if let Some(seconds) = lag.seconds {
                lag_metrics.consumer_lag_seconds.with_label_values(&[GROUP, &partition.to_string()]).set(seconds);
            }
        },
        // graph-updates deleted and recreated under the graph: it stops.
        move |partition, offset, reason| {
            if !lag_failures.is_failed(partition) {
                lag_failures.fail(partition, Failure { offset: Some(offset), reason, record: None });
            }
        },
    )?;
    let setup = LoopSetup {
        topic: &input,
        limits: BatchLimits {
            max_records: config.graph.batch_max_records,
            max_bytes: usize::MAX,
            payload_bytes: tally_shared::consume::as_fetched,
            linger: Duration::from_millis(config.graph.batch_linger_ms),
            max_linger: Duration::from_millis(config.graph.batch_linger_ms),
            quiet: BatchLimits::quiet_for(tally_shared::kafka::fetch_wait(&config.kafka)),
        },
        failures: &failures,
        letters: &letters,
        record_budget: config.kafka.record_budget(),
        heartbeat: HEARTBEAT,
        resting: metrics.fetch_resting.clone(),
    };
    let mut processor = GraphProcessor {
        store: store.clone(),
        failures: failures.clone(),
        metrics,
        readiness,
        announcer: Announcer::new(&config.kafka, names.shard_owners(), read_addr)?,
        relay: Relay::new(&config.kafka, names.shards())?,
        letters: letters.clone(),
        start_end,
        catching_up_since: Some(std::time::Instant::now()),
        input: input.clone(),
        advisory: AdvisoryCommits::default(),
        threads: vec![("lag reporter", lag_reporter)],
        shutdown: shutdown.clone(),
    };
    if let Some((snapshots, requests)) = snapshots {
        // On a thread of its own: the checkpoint takes the commit lock for moments,
        // the upload runs beside the batches.
        let scratch = config.graph.data_dir.with_extension("checkpoints");
        let mut snapshotter = Snapshotter::new(snapshots, &config.snapshots, scratch);
        let gauges = ("tally_graph_snapshot_age_seconds", "tally_graph_snapshot_interval_seconds");
        let mut ages = SnapshotAges::new(&registry, gauges, &[], &snapshotter);
        let (name, snapshot_store, snapshot_metrics) =
            (snapshot_name(&names), store.clone(), processor.metrics.clone());
        let every =
            tally_shared::shutdown::every("graph-snapshots", Duration::from_secs(2), shutdown.clone(), move || {
                let stores = [(name.clone(), snapshot_store.store())];
                let (taken, failed) = snapshotter.round(&requests, &stores);
                snapshot_metrics.snapshots_taken.inc_by(taken);
                snapshot_metrics.snapshot_failures.inc_by(failed);
                ages.report(&snapshotter, [(Vec::new(), name.as_str(), snapshot_store.store())]);
            })?;
        processor.threads.push(("snapshots", every));
    }
    let result = drive(&consumer, &setup, &mut processor, &shutdown);
    // Stopping for good (also after an error): the helper threads end with it.
    shutdown.cancel();
    processor.readiness.set(false);
    relay_outbox(&store, (&processor.relay, &processor.letters), &processor.metrics);
    processor.announcer.release_all();
    for (name, thread) in processor.threads.drain(..) {
        if thread.join().is_err() {
            tracing::error!(thread = name, "a graph thread panicked");
        }
    }
    tracing::info!("graph processor stopped: batch persisted and relayed");
    result
}

/// The graph's part of the consume loop ([`drive`]): applying batches to the store,
/// and with the turns its readiness, claim and outbox relays.
struct GraphProcessor {
    store: Arc<GraphStore>,
    failures: Arc<FailureBoard>,
    metrics: Metrics,
    readiness: Readiness,
    announcer: Announcer,
    /// Sends the outbox (descendant changes) to the counter shards.
    relay: Relay,
    /// Sends the dead letters of refused updates.
    letters: Arc<Relay>,
    /// The end of the log at start: not ready before it applied that much…
    start_end: i64,
    /// …and since when it waits for it (`None` once it caught up).
    catching_up_since: Option<std::time::Instant>,
    /// The graph-updates topic.
    input: String,
    /// The group's offset, committed now and then for lag tooling.
    advisory: AdvisoryCommits,
    /// Watched: one that ends before shutdown (a panic) stops the processor.
    threads: Vec<(&'static str, std::thread::JoinHandle<()>)>,
    shutdown: CancellationToken,
}

impl Processor<DefaultConsumerContext> for GraphProcessor {
    type Error = Error;

    fn next_offsets(&self) -> Vec<(u32, i64)> {
        self.store.next_offset().map(|next| (PARTITION, next)).into_iter().collect()
    }

    fn apply(&mut self, _: &BaseConsumer, batch: &[Polled], _: &mut Vec<Polled>) -> Vec<u32> {
        let records: Vec<UpdateRecord<'_>> = batch
            .iter()
            .map(|polled| UpdateRecord { offset: polled.offset, payload: &polled.payload, timestamp: polled.timestamp })
            .collect();
        let report = match self.store.apply(&records, now_ms()) {
            Ok(report) => report,
            Err(err) => {
                let offset = self.store.next_offset();
                self.failures.fail(PARTITION, Failure { offset, reason: err.to_string(), record: None });
                return vec![PARTITION];
            }
        };
        let metrics = &self.metrics;
        metrics.applied_updates.inc_by(report.updates);
        metrics.dropped.with_label_values(&["redelivered"]).inc_by(report.redelivered);
        metrics.dropped.with_label_values(&["id"]).inc_by(report.duplicate_ids);
        metrics.desc_changes.inc_by(report.changes);
        metrics.edges.set(tally_shared::lock::read(&self.store.graph, GRAPH).edge_count() as i64);
        metrics.dropped.with_label_values(&["max_descendants"]).inc_by(report.refused);
        if report.outbox_messages > 0 || report.refused > 0 {
            relay_outbox(&self.store, (&self.relay, &self.letters), metrics);
        }
        if let Some((next, found)) = report.gap {
            let reason = format!("the log has no records {next}..{found} the store has not applied (deleted by retention, or the topic was recreated): restore or rebuild the graph's store");
            self.failures.fail(PARTITION, Failure { offset: Some(next), reason, record: None });
            return vec![PARTITION];
        }
        match &report.undecodable {
            Some((offset, reason)) => {
                let record = batch.iter().find(|p| p.offset == *offset).map(|p| Arc::new(p.payload.clone()));
                self.failures.fail(PARTITION, Failure { offset: Some(*offset), reason: reason.clone(), record });
                vec![PARTITION]
            }
            None => Vec::new(),
        }
    }

    fn skip_record(&mut self, _: u32, offset: i64) -> tally_shared::Result<()> {
        self.store.store().skip_record(offset)
    }

    fn turn(&mut self, consumer: &BaseConsumer<DefaultConsumerContext>, skipped: u64, heartbeat: bool) -> Result<()> {
        self.metrics.skipped_records.inc_by(skipped);
        self.metrics.failed.set(self.failures.failed().len() as i64);
        self.readiness.set_failures(self.failures.descriptions());
        if heartbeat {
            if let Some((name, _)) = self.threads.iter().find(|(_, thread)| thread.is_finished()) {
                if !self.shutdown.is_cancelled() {
                    return Err(Error::Processor(format!("the {name} thread stopped unexpectedly")));
                }
            }
            // Read (announced) and ready once it caught up with the log it found at
            // start — a rebuild or a restored snapshot is older than what was read
            // before — and while its outbox gets through.
            let caught_up = self.store.next_offset().unwrap_or(0) >= self.start_end;
            if caught_up {
                self.announcer.announce(&[ShardOwner::GRAPH], false, |_| None);
                if let Some(since) = self.catching_up_since.take() {
                    self.metrics.catch_up_seconds.observe(since.elapsed().as_secs_f64());
                }
            }
            if let Some(next) = self.store.next_offset() {
                self.advisory.commit(consumer, &self.input, vec![(PARTITION, next)]);
            }
            let outbox_ok = relay_outbox(&self.store, (&self.relay, &self.letters), &self.metrics);
            self.readiness.set(outbox_ok && caught_up);
            if let Some(fatal) = self.relay.fatal().or_else(|| self.letters.fatal()).or_else(|| self.announcer.fatal())
            {
                // It delivers nothing more: stop loudly; the outbox waits in the store.
                return Err(Error::Processor(format!("a producer (outbox or claims) failed for good: {fatal}")));
            }
        }
        Ok(())
    }
}

/// The graph-updates topic's one partition.
const PARTITION: u32 = 0;
/// The graph's consumer group (its offsets committed for lag tools only).
const GROUP: &str = "tally-graph";

/// Sends what the outbox holds (descendant changes to the shards, then dead
/// letters); on failure it stays for the next round. Whether the outbox got through.
fn relay_outbox(store: &GraphStore, (relay, letters): (&Relay, &Relay), metrics: &Metrics) -> bool {
    let sent = store.relay_outbox(relay).and_then(|count| {
        let refused = store.letters()?;
        if !refused.is_empty() {
            letters.send_all("graph", &refused)?;
            store.delete_letters(&refused)?;
        }
        Ok(count)
    });
    match sent {
        Ok(count) => {
            metrics.outbox_relayed.inc_by(count);
            true
        }
        Err(err) => {
            tracing::warn!(error = %err, "relaying the outbox; retrying later");
            false
        }
    }
}
