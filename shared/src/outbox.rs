//! The transactional outbox of a stateful service: messages for the shard topic
//! written in the same RocksDB write batch as the state that produced them, then
//! relayed here and deleted once the broker acknowledged them.
//!
//! Entries go out in key order on an idempotent producer, so each receiver sees one
//! sender's stamps in increasing order; an entry sent twice (the service stopped
//! before deleting it) is at or below the receiver's high-water stamp and dropped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext, PurgeConfig};
use rdkafka::ClientContext;

use crate::config::KafkaConfig;
use crate::kafka::{producer_config, request_producer_id};
use crate::{Error, Result};

/// One outbox record: its key in the store, the partition it goes to, the bytes.
#[derive(Debug, Clone)]
pub struct OutboxEntry {
    pub key: Vec<u8>,
    pub partition: u32,
    pub payload: Vec<u8>,
}

/// The outbox key of the `chunk`-th message for `partition` produced at sender
/// position `position`: sorts by position, then partition, then chunk.
pub fn outbox_key(position: i64, partition: u32, chunk: u32) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&(position as u64).to_be_bytes());
    key[8..12].copy_from_slice(&partition.to_be_bytes());
    key[12..].copy_from_slice(&chunk.to_be_bytes());
    key
}

/// The partition an outbox key sends to.
pub fn outbox_partition(key: &[u8]) -> Option<u32> {
    key.get(8..12).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes)
}

/// The outbox held in column family `cf`, in send order.
pub(crate) fn read_outbox(db: &rocksdb::DB, cf: &rocksdb::ColumnFamily) -> Result<Vec<OutboxEntry>> {
    let mut entries = Vec::new();
    for item in db.iterator_cf(cf, rocksdb::IteratorMode::Start) {
        let (key, payload) = item?;
        let partition =
            outbox_partition(&key).ok_or_else(|| Error::corrupt(format!("outbox key {key:?}: malformed")))?;
        entries.push(OutboxEntry { key: key.to_vec(), partition, payload: payload.to_vec() });
    }
    Ok(entries)
}

/// Drops relayed entries from the outbox in `cf`.
pub(crate) fn delete_outbox(db: &rocksdb::DB, cf: &rocksdb::ColumnFamily, entries: &[OutboxEntry]) -> Result<()> {
    let mut batch = rocksdb::WriteBatch::default();
    for entry in entries {
        batch.delete_cf(cf, &entry.key);
    }
    Ok(db.write(batch)?)
}

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

/// Sends records to one topic and waits for their acknowledgements: outbox
/// entries, and anything else delivered at least once from a store's marks.
pub struct Relay {
    producer: BaseProducer<RelayContext>,
    topic: String,
    /// How long a round waits for its acknowledgements before it reports failure
    /// (what was not acknowledged is sent again next round).
    wait: Duration,
}

impl Relay {
    /// A relay to `topic` whose producer already asked for its id
    /// ([`request_producer_id`]: blocks until the broker answers, up to 10 s — call it
    /// off the async runtime).
    pub fn new(kafka: &KafkaConfig, topic: String) -> Result<Self> {
        Self::with(producer_config(kafka)?, topic, true)
    }

    /// A relay for records that carry no stamps (dead letters): delivered at least
    /// once, without the gapless guarantee, whose errors are fatal to a producer.
    pub fn unstamped(kafka: &KafkaConfig, topic: String) -> Result<Self> {
        Self::with(crate::kafka::unstamped_producer_config(kafka)?, topic, true)
    }

    /// A relay for records that carry their own order ([`crate::kafka::positioned_producer_config`]):
    /// the one whose queue may be [`Relay::purge`]d.
    pub fn positioned(kafka: &KafkaConfig, topic: String) -> Result<Self> {
        Self::with(crate::kafka::positioned_producer_config(kafka)?, topic, false)
    }

    /// A relay on a producer made from `config`; an idempotent one asks for its id
    /// now (`idempotent`).
    fn with(config: rdkafka::ClientConfig, topic: String, idempotent: bool) -> Result<Self> {
        let producer = config.create_with_context(RelayContext::default())?;
        if idempotent {
            request_producer_id(&producer);
        }
        Ok(Self { producer, topic, wait: Duration::from_secs(30) })
    }

    /// A relay whose rounds wait at most `wait` for their acknowledgements.
    pub fn waiting_at_most(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The producer's fatal error, if it had one: it will deliver nothing more, and
    /// the service must stop (and replay from its stores when it starts again).
    pub fn fatal(&self) -> Option<String> {
        self.producer.client().fatal_error().map(|(code, reason)| format!("{code:?}: {reason}"))
    }

    /// Sends `entries` in order, keyed by `key`, and waits until every one is
    /// acknowledged; an error means some may not have been (send them all again).
    pub fn send_all(&self, key: &str, entries: &[OutboxEntry]) -> Result<()> {
        self.send(entries.iter().map(|entry| {
            BaseRecord::to(&self.topic).partition(entry.partition as i32).key(key).payload(entry.payload.as_slice())
        }))
    }

    /// Sends `(key, payload)` records, partitioned by key, and waits until every
    /// one is acknowledged; an error means some may not have been.
    pub fn send_keyed<'a>(&'a self, records: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Result<()> {
        self.send(records.into_iter().map(|(key, payload)| BaseRecord::to(&self.topic).key(key).payload(payload)))
    }

    /// Sends keyed records with a header each, a payload or none (a tombstone),
    /// partitioned by key, and waits until every one is acknowledged; an error means
    /// some may not have been.
    pub fn send_with_header<'a>(
        &'a self,
        header: &'a str,
        records: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>, &'a [u8])>,
    ) -> Result<()> {
        self.send(records.into_iter().map(|(key, payload, value)| {
            let headers = OwnedHeaders::new().insert(Header { key: header, value: Some(value) });
            let record = BaseRecord::to(&self.topic).key(key).headers(headers);
            match payload {
                Some(payload) => record.payload(payload),
                None => record,
            }
        }))
    }

    /// Drops every record still queued (their sends fail, counted as not
    /// delivered): a holder whose lease lapsed sends nothing more of it. Records
    /// already on the wire are left to land. Only for a [`Relay::positioned`] one: an
    /// idempotent producer would go on past the gap in its sequence numbers, which
    /// a broker refuses (the local one, Tansu 0.6, panicked on it).
    pub fn purge(&self) {
        self.producer.purge(PurgeConfig::default().queue());
    }

    fn send<'a>(&'a self, records: impl Iterator<Item = BaseRecord<'a, str, [u8]>>) -> Result<()> {
        self.producer.context().failures.store(0, Ordering::Relaxed);
        for mut record in records {
            let queued_by = std::time::Instant::now() + self.wait;
            loop {
                match self.producer.send(record) {
                    Ok(()) => break,
                    Err((err, returned))
                        if matches!(err.rdkafka_error_code(), Some(rdkafka::types::RDKafkaErrorCode::QueueFull)) =>
                    {
                        // A broker that takes nothing: give up the round (the caller
                        // sends again later, or stops) instead of waiting for ever.
                        if std::time::Instant::now() >= queued_by {
                            return Err(Error::Relay(format!(
                                "the producer's queue stayed full for {:?}: is the broker reachable?",
                                self.wait
                            )));
                        }
                        record = returned;
                        self.producer.poll(Duration::from_millis(5));
                    }
                    Err((err, _)) => return Err(err.into()),
                }
            }
        }
        self.producer.flush(self.wait)?;
        match self.producer.context().failures.load(Ordering::Relaxed) {
            0 => Ok(()),
            failed => Err(Error::Relay(format!("{failed} records were not delivered"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_by_position_then_partition_then_chunk() {
        assert!(outbox_key(1, 7, 9) < outbox_key(2, 0, 0));
        assert!(outbox_key(2, 0, 9) < outbox_key(2, 1, 0));
        assert!(outbox_key(2, 1, 0) < outbox_key(2, 1, 1));
        assert_eq!(outbox_partition(&outbox_key(5, 3, 1)), Some(3));
    }
}
