//! Claims on the shard-owners topic: where tally-query sends the reads of a shard
//! (a counter announces the shards it serves, tally-graph its read API under
//! [`ShardOwner::GRAPH`]), every heartbeat and at once on every change; a claim
//! without an address lets a shard go.
//!
//! Each claim carries its epoch ([`ShardOwner::at_ms`]): when this process took the
//! shard, repeated unchanged in every claim and in the release of that tenure. A
//! shard taken again gets a new epoch. Readers keep the newest epoch, so the claims
//! and releases a paused owner sends late, under the epoch of its lost tenure, are
//! ignored.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use tally_core::wire::ShardOwner;

use crate::config::KafkaConfig;
use crate::kafka::{now_ms, producer_config};
use crate::Result;

/// How often claims are repeated.
pub const HEARTBEAT: Duration = Duration::from_secs(5);

/// One process's claims.
pub struct Announcer {
    producer: ThreadedProducer<DefaultProducerContext>,
    topic: String,
    read_addr: String,
    /// A random id per process, to tell owners apart.
    instance: String,
    last: Option<Instant>,
    /// The epoch of each shard claimed now.
    epochs: BTreeMap<u32, i64>,
    /// The newest epoch taken: epochs of this process only grow.
    last_epoch: i64,
}

impl Announcer {
    pub fn new(kafka: &KafkaConfig, topic: String, read_addr: String) -> Result<Self> {
        let producer = producer_config(kafka)?.create()?;
        let instance = format!("{:016x}", rand_u64());
        Ok(Self { producer, topic, read_addr, instance, last: None, epochs: BTreeMap::new(), last_epoch: 0 })
    }

    /// Whether the claims are due again.
    pub fn due(&self) -> bool {
        self.last.is_none_or(|at| at.elapsed() >= HEARTBEAT)
    }

    /// Claims exactly `shards` (logged when they `changed`): the ones claimed before
    /// and not now are released.
    pub fn announce(&mut self, shards: &[u32], changed: bool) {
        if changed {
            tracing::info!(shards = ?shards, addr = %self.read_addr, "announcing shard ownership");
        }
        let gone: Vec<u32> = self.epochs.keys().filter(|shard| !shards.contains(shard)).copied().collect();
        for shard in gone {
            if let Some(epoch) = self.epochs.remove(&shard) {
                self.publish(shard, None, epoch);
            }
        }
        for &shard in shards {
            let epoch = match self.epochs.get(&shard) {
                Some(epoch) => *epoch,
                None => {
                    self.last_epoch = now_ms().max(self.last_epoch + 1);
                    self.epochs.insert(shard, self.last_epoch);
                    self.last_epoch
                }
            };
            self.publish(shard, Some(self.read_addr.clone()), epoch);
        }
        self.last = Some(Instant::now());
    }

    /// Lets every claimed shard go, and waits (a little) for the releases to be
    /// written.
    pub fn release_all(&mut self) {
        for (shard, epoch) in std::mem::take(&mut self.epochs) {
            self.publish(shard, None, epoch);
        }
        let _ = self.producer.flush(Duration::from_secs(5));
    }

    /// Sends, waiting while the producer's queue is full rather than dropping.
    fn publish(&self, shard: u32, addr: Option<String>, epoch: i64) {
        let claim = ShardOwner::new(shard, addr, self.instance.clone(), epoch);
        let Ok(payload) = serde_json::to_vec(&claim) else { return };
        let key = shard.to_string();
        let mut record = BaseRecord::to(&self.topic).key(&key).payload(&payload);
        for _ in 0..1_000 {
            match self.producer.send(record) {
                Ok(()) => return,
                Err((err, returned)) => {
                    if !matches!(err.rdkafka_error_code(), Some(rdkafka::types::RDKafkaErrorCode::QueueFull)) {
                        tracing::warn!(error = %err, "sending a claim; it goes again with the next heartbeat");
                        return;
                    }
                    record = returned;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        tracing::warn!("the producer queue stayed full; the claim goes again with the next heartbeat");
    }
}

/// A random u64 without a dependency: the hash of the time and the process id.
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_i64(now_ms());
    hasher.write_u32(std::process::id());
    hasher.finish()
}
