//! Sends every shard's outbox — totals for descendants that live on other shards —
//! to the shard topic, and deletes what the broker acknowledged.
//!
//! Entries go out in outbox order (source offset, then target) on an idempotent
//! producer, so each receiver sees one sender's stamps in increasing order; an entry
//! sent twice (the relay crashed before deleting it, or a rebuilt shard produced it
//! again) is at or below the receiver's high-water stamp and dropped there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::ClientContext;
use tally_shared::config::KafkaConfig;
use tally_shared::kafka::producer_config;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::shards::Shards;

/// Counts failed deliveries of the current round.
#[derive(Default)]
pub struct RelayContext {
    failures: AtomicU64,
}

impl ClientContext for RelayContext {}

impl ProducerContext for RelayContext {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: Self::DeliveryOpaque) {
        if let Err((err, _)) = result {
            tracing::warn!(error = %err, "outbox delivery failed; it will be sent again");
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub struct Relay {
    producer: BaseProducer<RelayContext>,
    topic: String,
}

impl Relay {
    pub fn new(kafka: &KafkaConfig, topic: String) -> Result<Self> {
        Ok(Self { producer: producer_config(kafka)?.create_with_context(RelayContext::default())?, topic })
    }

    /// Sends the outbox of every owned shard and waits for the acknowledgements;
    /// returns how many messages were relayed.
    pub fn relay(&self, shards: &Shards, metrics: &Metrics) -> Result<u64> {
        let mut relayed = 0;
        for shard in shards.owned() {
            let Some(store) = shards.get(shard) else { continue };
            let entries = store.outbox()?;
            if entries.is_empty() {
                continue;
            }
            self.producer.context().failures.store(0, Ordering::Relaxed);
            for entry in &entries {
                let key = shard.to_string();
                let mut record =
                    BaseRecord::to(&self.topic).partition(entry.target as i32).key(&key).payload(&entry.payload);
                loop {
                    match self.producer.send(record) {
                        Ok(()) => break,
                        Err((err, returned)) if is_queue_full(&err) => {
                            record = returned;
                            self.producer.poll(Duration::from_millis(5));
                        }
                        Err((err, _)) => return Err(err.into()),
                    }
                }
            }
            self.producer.flush(Duration::from_secs(30))?;
            if self.producer.context().failures.load(Ordering::Relaxed) > 0 {
                return Err(Error::Shard { shard, message: "outbox relay failed; retrying next batch".into() });
            }
            store.delete_outbox(&entries)?;
            relayed += entries.len() as u64;
        }
        metrics.outbox_relayed.inc_by(relayed);
        Ok(relayed)
    }
}

fn is_queue_full(err: &rdkafka::error::KafkaError) -> bool {
    matches!(err.rdkafka_error_code(), Some(rdkafka::types::RDKafkaErrorCode::QueueFull))
}
