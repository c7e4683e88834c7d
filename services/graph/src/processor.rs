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
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use tally_core::wire::ShardOwner;
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{client_config, now_ms, producer_config, TopicNames};
use tally_shared::outbox::Relay;
use tally_shared::telemetry::Readiness;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::store::{BatchReport, GraphStore, UpdateRecord};
use tally_shared::failures::{Failure, FailureBoard};

const HEARTBEAT: Duration = Duration::from_secs(5);

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
    let announcer: ThreadedProducer<DefaultProducerContext> = producer_config(&config.kafka)?.create()?;
    let instance = format!("{:016x}", rand::random::<u64>());
    let announce = |addr: Option<String>| {
        let claim = ShardOwner::new(ShardOwner::GRAPH, addr, instance.clone(), now_ms());
        if let Ok(payload) = serde_json::to_vec(&claim) {
            let topic = names.shard_owners();
            let record = BaseRecord::to(&topic).key("graph").payload(&payload);
            if let Err((err, _)) = announcer.send(record) {
                tracing::warn!(error = %err, "announcing the graph read API");
            }
        }
    };
    tracing::info!(start = ?start, addr = %read_addr, "graph processor consuming");
    // Lag on its own thread and client: broker round trips never hold up the batches.
    let lag_client: BaseConsumer = client_config(&config.kafka)?.create()?;
    let (lag_store, lag_metrics, lag_topic) = (store.clone(), metrics.clone(), input.clone());
    let lag_reporter = tally_shared::shutdown::every("graph-lag", HEARTBEAT, shutdown.clone(), move || {
        if let Ok((_, high)) = lag_client.fetch_watermarks(&lag_topic, 0, Duration::from_secs(1)) {
            lag_metrics.consumer_lag.set((high - lag_store.progress().next_offset.unwrap_or(0)).max(0));
        }
    })?;
    let linger = Duration::from_millis(config.graph.batch_linger_ms);
    let max_records = config.graph.batch_max_records.max(1);
    let mut last_heartbeat: Option<Instant> = None;
    let mut batch: Vec<(i64, Option<i64>, Vec<u8>)> = Vec::new();
    while !shutdown.is_cancelled() {
        batch.clear();
        let deadline = Instant::now() + linger;
        while batch.len() < max_records {
            let wait = if batch.is_empty() {
                Duration::from_millis(100)
            } else {
                deadline.saturating_duration_since(Instant::now())
            };
            match consumer.poll(wait) {
                Some(Ok(message)) => {
                    let timestamp = message.timestamp().to_millis().filter(|ts| *ts >= 0);
                    batch.push((message.offset(), timestamp, message.payload().unwrap_or_default().to_vec()))
                }
                Some(Err(err)) => tracing::warn!(error = %err, "consumer error"),
                None if batch.is_empty() => break,
                None => {}
            }
            if !batch.is_empty() && Instant::now() >= deadline {
                break;
            }
        }
        if !batch.is_empty() && !failures.is_failed(PARTITION) {
            let records: Vec<UpdateRecord<'_>> = batch
                .iter()
                .map(|(offset, timestamp, payload)| UpdateRecord { offset: *offset, payload, timestamp: *timestamp })
                .collect();
            let report = match store.apply(&records, now_ms()) {
                Ok(report) => report,
                Err(err) => {
                    let offset = store.progress().next_offset;
                    failures.fail(PARTITION, Failure { offset, reason: err.to_string(), record: None });
                    pause(&consumer, &input);
                    BatchReport::default()
                }
            };
            if let Some((offset, reason)) = &report.undecodable {
                let record =
                    batch.iter().find(|(o, _, _)| o == offset).map(|(_, _, payload)| Arc::new(payload.clone()));
                failures.fail(PARTITION, Failure { offset: Some(*offset), reason: reason.clone(), record });
                pause(&consumer, &input);
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
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&input, PARTITION as i32, Offset::Offset(offset + 1))?;
            consumer.seek_partitions(tpl.clone(), Duration::from_secs(10))?;
            consumer.resume(&tpl)?;
            Ok(())
        });
        metrics.skipped_records.inc_by(skipped);
        metrics.failed.set(failures.failed().len() as i64);
        readiness.set_failures(failures.descriptions());
        if last_heartbeat.is_none_or(|at| at.elapsed() >= HEARTBEAT) {
            last_heartbeat = Some(Instant::now());
            announce(Some(read_addr.clone()));
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
    announce(None);
    let _ = announcer.flush(Duration::from_secs(5));
    let _ = lag_reporter.join();
    tracing::info!("graph processor stopped: batch persisted and relayed");
    Ok(())
}

/// The graph-updates topic's one partition.
const PARTITION: u32 = 0;

/// Stops fetching the graph-updates partition (it failed).
fn pause(consumer: &BaseConsumer, topic: &str) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, PARTITION as i32);
    if let Err(err) = consumer.pause(&tpl) {
        // Its records are dropped unapplied all the same.
        tracing::warn!(error = %err, "pausing the failed graph-updates partition");
    }
}

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
