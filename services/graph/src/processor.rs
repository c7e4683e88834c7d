//! The processor thread: consumes `tally.graph-updates` (one partition, one
//! `tally-graph` instance), applies batches to the [`GraphStore`], relays the
//! outbox to the counter shards, and announces its read address.
//!
//! A plain thread over a `BaseConsumer`: graph traversals are CPU work that must not
//! block the async runtime. It resumes from the store's offset, never a group's.
//!
//! It fails closed ([`tally_shared::failures`]): a record that does not decode, or a
//! batch the store cannot apply, stops the graph at that offset — nothing more is
//! applied, `/readyz` and neighbour reads say why — until `tally shards skip graph`
//! moves it past the record.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tally_core::wire::ShardOwner;
use tally_shared::announce::{Announcer, HEARTBEAT};
use tally_shared::config::TallyConfig;
use tally_shared::consume::{pause, poll_batch, resume_at, spawn_lag_reporter, BatchLimits, Polled};
use tally_shared::kafka::{client_config, now_ms, TopicNames};
use tally_shared::outbox::Relay;
use tally_shared::telemetry::Readiness;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::store::{BatchReport, GraphStore, UpdateRecord};
use tally_shared::failures::{Failure, FailureBoard};

pub struct ProcessorSetup {
    pub config: TallyConfig,
    pub store: Arc<GraphStore>,
    /// The graph-updates partition's failure, if any, and operators' skips.
    pub failures: Arc<FailureBoard>,
    pub metrics: Metrics,
    pub readiness: Readiness,
    pub read_addr: String,
}

/// Runs until `shutdown`; the batch in hand is persisted and relayed first.
pub fn run(setup: ProcessorSetup, shutdown: CancellationToken) -> Result<()> {
    let ProcessorSetup { config, store, failures, metrics, readiness, read_addr } = setup;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let input = names.graph_updates();
    let mut consumer_config = client_config(&config.kafka)?;
    consumer_config.set("group.id", "tally-graph").set("enable.auto.commit", "false");
    let consumer: BaseConsumer = consumer_config.create()?;
    let start = store.progress().next_offset.map_or(Offset::Beginning, Offset::Offset);
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(&input, 0, start)?;
    consumer.assign(&assignment)?;
    // Not ready before it applied what the log held at start (a rebuild).
    let (_, start_end) = consumer.fetch_watermarks(&input, PARTITION as i32, Duration::from_secs(10))?;

    let relay = Relay::new(&config.kafka, names.shards())?;
    let letters = Relay::new(&config.kafka, names.dead_letter())?;
    let mut announcer = Announcer::new(&config.kafka, names.shard_owners(), read_addr)?;
    tracing::info!(start = ?start, "graph processor consuming");
    let (lag_store, lag_metrics) = (store.clone(), metrics.clone());
    let lag_reporter = spawn_lag_reporter(
        &config.kafka,
        "graph-lag",
        input.clone(),
        HEARTBEAT,
        shutdown.clone(),
        move || vec![(PARTITION, lag_store.progress().next_offset.unwrap_or(0))],
        move |_, lag| lag_metrics.consumer_lag.set(lag),
    )?;
    let limits = BatchLimits {
        max_records: config.graph.batch_max_records,
        max_bytes: usize::MAX,
        linger: Duration::from_millis(config.graph.batch_linger_ms),
    };
    let mut batch: Vec<Polled> = Vec::new();
    while !shutdown.is_cancelled() {
        poll_batch(&consumer, &limits, &mut batch, || false);
        if !batch.is_empty() && !failures.is_failed(PARTITION) {
            let records: Vec<UpdateRecord<'_>> = batch
                .iter()
                .map(|polled| UpdateRecord {
                    offset: polled.offset,
                    payload: &polled.payload,
                    timestamp: polled.timestamp,
                })
                .collect();
            let report = match store.apply(&records, now_ms()) {
                Ok(report) => report,
                Err(err) => {
                    let offset = store.progress().next_offset;
                    failures.fail(PARTITION, Failure { offset, reason: err.to_string(), record: None });
                    pause(&consumer, &input, &[PARTITION]);
                    BatchReport::default()
                }
            };
            if let Some((offset, reason)) = &report.undecodable {
                let record = batch.iter().find(|p| p.offset == *offset).map(|p| Arc::new(p.payload.clone()));
                failures.fail(PARTITION, Failure { offset: Some(*offset), reason: reason.clone(), record });
                pause(&consumer, &input, &[PARTITION]);
            }
            metrics.applied_updates.inc_by(report.updates);
            metrics.dropped.with_label_values(&["redelivered"]).inc_by(report.redelivered);
            metrics.dropped.with_label_values(&["id"]).inc_by(report.duplicate_ids);
            metrics.desc_changes.inc_by(report.changes);
            if let Ok(graph) = store.graph.read() {
                metrics.edges.set(graph.edge_count() as i64);
            }
            if report.outbox_messages > 0 {
                relay_outbox(&store, &relay, &metrics);
            }
        }
        let budget = config.kafka.record_budget();
        let skipped = failures.carry_out_skips(&letters, &input, budget, |_, offset| {
            store.skip_record(offset).map_err(|err| tally_shared::Error::Skip(err.to_string()))?;
            resume_at(&consumer, &input, PARTITION, offset + 1)
        });
        metrics.skipped_records.inc_by(skipped);
        metrics.failed.set(failures.failed().len() as i64);
        readiness.set_failures(failures.descriptions());
        if announcer.due() {
            announcer.announce(&[ShardOwner::GRAPH], false);
            // Ready once it caught up with the log it found at start (and while
            // its outbox gets through); a failure above makes it not ready anyway.
            let outbox_ok = relay_outbox(&store, &relay, &metrics);
            readiness.set(outbox_ok && store.progress().next_offset.unwrap_or(0) >= start_end);
            if let Some(fatal) = relay.fatal() {
                // It delivers nothing more: stop loudly; the outbox waits in the store.
                return Err(Error::Processor(format!("the outbox producer failed for good: {fatal}")));
            }
        }
    }
    readiness.set(false);
    relay_outbox(&store, &relay, &metrics);
    announcer.release(&[ShardOwner::GRAPH]);
    if lag_reporter.join().is_err() {
        tracing::error!("the lag reporter panicked");
    }
    tracing::info!("graph processor stopped: batch persisted and relayed");
    Ok(())
}

/// The graph-updates topic's one partition.
const PARTITION: u32 = 0;

/// Sends what the outbox holds; on failure it stays for the next round. Whether
/// the outbox got through.
fn relay_outbox(store: &GraphStore, relay: &Relay, metrics: &Metrics) -> bool {
    let sent = store.outbox().and_then(|entries| {
        if entries.is_empty() {
            return Ok(0);
        }
        relay.send_all("graph", &entries)?;
        store.delete_outbox(&entries)?;
        Ok(entries.len() as u64)
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
