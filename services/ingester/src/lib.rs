//! `tally-ingester`: consumes `tally.increments` and `tally.graph`, validates every
//! element, routes valid increments to the counter shard that owns their entity and
//! valid graph updates to `tally-graph`'s topic, and writes each bad element to
//! `tally.dead-letter` with its reason. Stateless; scales as a consumer group.
//!
//! Exactly-once effect downstream without Kafka transactions: every routed entry
//! carries a deterministic stamp (input partition, offset, index in the message), so
//! when a restart replays input from the last committed offset the counter drops the
//! entries it already applied. Input offsets are committed only after every output
//! record of the batch is acknowledged, so nothing is lost either.

pub mod error;
pub mod metrics;
pub mod route;

use std::time::Duration;

use futures::future::join_all;
use prometheus::Registry;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{client_config, producer_config, wait_for_topic, TopicNames};
use tally_shared::telemetry::{serve_admin, Readiness};
use tokio_util::sync::CancellationToken;

pub use error::{Error, Result};
use route::{Outgoing, Router};

/// How long a stopping ingester still waits for the batch in hand to be acknowledged.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Runs an ingester until `shutdown`; the batch in hand is delivered and committed
/// first (unless Kafka does not acknowledge it within [`SHUTDOWN_GRACE`]).
pub async fn run(config: TallyConfig, shutdown: CancellationToken) -> Result<()> {
    let registry = Registry::new();
    let metrics = metrics::Metrics::new(&registry);
    let readiness = Readiness::default();
    let admin = serve_admin(&config.ingester.admin_listen, registry, readiness.clone(), shutdown.clone()).await?;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let shards = wait_for_topic(&config.kafka, &names.shards(), Duration::from_secs(60)).await?;
    tracing::info!(admin = %admin, shards, "tally-ingester starting");

    let mut consumer_config = client_config(&config.kafka)?;
    consumer_config
        .set("group.id", &config.ingester.group_id)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest");
    let consumer: StreamConsumer = consumer_config.create()?;
    let inputs = [names.increments(), names.graph()];
    if config.ingester.static_assignment {
        let mut tpl = TopicPartitionList::new();
        for input in &inputs {
            let partitions = wait_for_topic(&config.kafka, input, Duration::from_secs(60)).await?;
            for partition in 0..partitions as i32 {
                tpl.add_partition_offset(input, partition, Offset::Stored)?;
            }
        }
        consumer.assign(&tpl)?;
    } else {
        consumer.subscribe(&[&inputs[0], &inputs[1]])?;
    }
    let producer: FutureProducer = producer_config(&config.kafka)?.create()?;

    let router = Router::new(names.clone(), shards, config.kafka.record_budget());
    let linger = Duration::from_millis(config.ingester.batch_linger_ms);
    let max_records = config.ingester.batch_max_records.max(1);
    let max_bytes = config.ingester.batch_max_bytes.max(1);
    let mut health = tokio::time::interval(Duration::from_secs(5));
    let result = loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            // Idle or not: lag and readiness (it holds input partitions) stay current.
            _ = health.tick() => {
                tokio::task::block_in_place(|| report_health(&consumer, &metrics, &readiness));
                continue;
            }
            message = consumer.recv() => message,
        };
        let mut batch: Vec<BorrowedMessage<'_>> = Vec::with_capacity(max_records);
        let mut batch_bytes = 0usize;
        match first {
            Ok(message) => {
                batch_bytes += message.payload_len();
                batch.push(message);
            }
            Err(err) => {
                tracing::warn!(error = %err, "consumer error");
                continue;
            }
        }
        let deadline = tokio::time::Instant::now() + linger;
        while batch.len() < max_records && batch_bytes < max_bytes {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(Ok(message)) => {
                    batch_bytes += message.payload_len();
                    batch.push(message);
                }
                Ok(Err(err)) => tracing::warn!(error = %err, "consumer error"),
                Err(_) => break,
            }
        }
        let outgoing = match router.route(&batch, &metrics) {
            Ok(outgoing) => outgoing,
            Err(err) => break Err(err),
        };
        let delivered = deliver(&producer, outgoing);
        tokio::pin!(delivered);
        let done = tokio::select! {
            done = &mut delivered => done,
            _ = shutdown.cancelled() => match tokio::time::timeout(SHUTDOWN_GRACE, &mut delivered).await {
                Ok(done) => done,
                // Records never time out, so a Kafka that is gone would hold the
                // batch for ever: stop without committing (the next run replays it).
                Err(_) => {
                    tracing::warn!("stopping with a batch not acknowledged; it is replayed on the next start");
                    break Ok(());
                }
            },
        };
        if let Err(err) = done.and_then(|()| commit(&consumer, &batch)) {
            break Err(err);
        }
        metrics.batch_records.observe(batch.len() as f64);
    };
    readiness.set(false);
    tracing::info!("tally-ingester stopping");
    result
}

/// Sends every output record and waits until all are acknowledged.
async fn deliver(producer: &FutureProducer, outgoing: Vec<Outgoing>) -> Result<()> {
    let mut deliveries = Vec::with_capacity(outgoing.len());
    for out in &outgoing {
        let mut record = FutureRecord::to(&out.topic).payload(&out.payload).key(&out.key);
        if let Some(partition) = out.partition {
            record = record.partition(partition);
        }
        if let Some(time) = out.timestamp {
            // The input's time travels in a header; the record's Kafka timestamp is
            // now, so the shard topic's retention counts from routing.
            let value = tally_core::format::record_time_value(time);
            let header = Header { key: tally_core::format::RECORD_TIME_HEADER, value: Some(&value[..]) };
            record = record.headers(OwnedHeaders::new_with_capacity(1).insert(header));
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    deliveries.push(delivery);
                    break;
                }
                Err((err, returned))
                    if matches!(err.rdkafka_error_code(), Some(rdkafka::types::RDKafkaErrorCode::QueueFull)) =>
                {
                    record = returned;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((err, _)) => return Err(err.into()),
            }
        }
    }
    for delivery in join_all(deliveries).await {
        match delivery {
            Ok(Ok(_)) => {}
            Ok(Err((err, _))) => return Err(Error::Delivery(err.to_string())),
            Err(_) => return Err(Error::Delivery("producer dropped a delivery".into())),
        }
    }
    Ok(())
}

/// Commits the next offset of every input partition of the batch.
fn commit(consumer: &StreamConsumer, batch: &[BorrowedMessage<'_>]) -> Result<()> {
    let mut next: std::collections::BTreeMap<(&str, i32), i64> = std::collections::BTreeMap::new();
    for message in batch {
        let entry = next.entry((message.topic(), message.partition())).or_insert(0);
        *entry = (*entry).max(message.offset() + 1);
    }
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), offset) in next {
        tpl.add_partition_offset(topic, partition, Offset::Offset(offset))?;
    }
    if let Err(err) = consumer.commit(&tpl, CommitMode::Async) {
        // After a rebalance the new owner replays; stamps make that harmless.
        tracing::warn!(error = %err, "offset commit failed");
    }
    Ok(())
}

/// Lag per input topic and partition; ready while it holds input partitions.
fn report_health(consumer: &StreamConsumer, metrics: &metrics::Metrics, readiness: &Readiness) {
    readiness.set(consumer.assignment().is_ok_and(|assigned| assigned.count() > 0));
    let Ok(positions) = consumer.position() else { return };
    for element in positions.elements() {
        let Offset::Offset(position) = element.offset() else { continue };
        if let Ok((_, high)) = consumer.fetch_watermarks(element.topic(), element.partition(), Duration::from_secs(1)) {
            let labels = [element.topic(), &element.partition().to_string()];
            metrics.consumer_lag.with_label_values(&labels).set((high - position).max(0));
        }
    }
}
