//! Claims on the shard-owners topic: where tally-query sends the reads of a shard
//! (a counter announces the shards it serves, tally-graph its read API under
//! [`ShardOwner::GRAPH`]), every heartbeat and at once on every change; a claim
//! without an address lets a shard go.
//!
//! Each claim carries its epoch ([`ShardOwner::at_ms`]): when this process took the
//! shard, repeated unchanged in every claim and in the release of that tenure. A
//! shard taken again gets a new epoch. Readers keep the newest epoch (an older claim
//! only while the shard has no owner), so the claims and releases a paused owner
//! sends late, under the epoch of its lost tenure, are ignored.

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
    /// Shards let go lately, with their epoch and how many more heartbeats repeat
    /// the release (one lost on the way would leave a claim nobody holds).
    released: BTreeMap<u32, (i64, u32)>,
}

/// How many heartbeats repeat a release.
const RELEASE_REPEATS: u32 = 3;

impl Announcer {
    /// Claims on `topic` by an owner serving reads at `read_addr`; its producer
    /// already asked for its id (`kafka::request_producer_id`: blocks until the broker
    /// answers, up to 10 s — call it off the async runtime).
    pub fn new(kafka: &KafkaConfig, topic: String, read_addr: String) -> Result<Self> {
        let producer = producer_config(kafka)?.create()?;
        crate::kafka::request_producer_id(&producer);
        let instance = format!("{:016x}", rand_u64());
        let (epochs, released) = (BTreeMap::new(), BTreeMap::new());
        Ok(Self { producer, topic, read_addr, instance, last: None, epochs, last_epoch: 0, released })
    }

    /// Whether the claims are due again.
    pub fn due(&self) -> bool {
        self.last.is_none_or(|at| at.elapsed() >= HEARTBEAT)
    }

    /// Claims exactly `shards` (logged when they `changed`): the ones claimed before
    /// and not now are released. A shard claimed anew gets an epoch above this
    /// process's earlier ones and above `newest_seen(shard)`, the newest epoch read
    /// for it (so a clock behind another machine's cannot hide the claim).
    pub fn announce(&mut self, shards: &[u32], changed: bool, newest_seen: impl Fn(u32) -> Option<i64>) {
        if changed {
            tracing::info!(shards = ?shards, addr = %self.read_addr, "announcing shard ownership");
        }
        let gone: Vec<u32> = self.epochs.keys().filter(|shard| !shards.contains(shard)).copied().collect();
        for shard in gone {
            if let Some(epoch) = self.epochs.remove(&shard) {
                self.released.insert(shard, (epoch, RELEASE_REPEATS));
            }
        }
        // A shard claimed again stops repeating its old release.
        self.released.retain(|shard, _| !shards.contains(shard));
        for (shard, (epoch, repeats)) in std::mem::take(&mut self.released) {
            self.publish(shard, None, epoch);
            if repeats > 1 {
                self.released.insert(shard, (epoch, repeats - 1));
            }
        }
        for &shard in shards {
            let epoch = match self.epochs.get(&shard) {
                Some(epoch) => *epoch,
                None => {
                    let floor = newest_seen(shard).map_or(0, |seen| seen + 1);
                    self.last_epoch = now_ms().max(self.last_epoch + 1).max(floor);
                    self.epochs.insert(shard, self.last_epoch);
                    self.last_epoch
                }
            };
            self.publish(shard, Some(self.read_addr.clone()), epoch);
        }
        self.last = Some(Instant::now());
    }

    /// The producer's fatal error, if it failed for good (claims go nowhere more:
    /// the service must stop).
    pub fn fatal(&self) -> Option<String> {
        self.producer.client().fatal_error().map(|(code, message)| format!("{code:?}: {message}"))
    }

    /// This process's id in its claims.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Releases a claim another process made under this one's address (a previous
    /// incarnation's, killed before it let go), under that claim's `epoch`.
    pub fn release_orphan(&mut self, shard: u32, epoch: i64) {
        if !self.epochs.contains_key(&shard) {
            tracing::info!(shard, epoch, "releasing a claim a previous process at this address left");
            self.publish(shard, None, epoch);
        }
    }

    /// Lets every claimed shard go, and waits (a little) for the releases to be
    /// written.
    pub fn release_all(&mut self) {
        let released = std::mem::take(&mut self.released).into_iter().map(|(shard, (epoch, _))| (shard, epoch));
        for (shard, epoch) in std::mem::take(&mut self.epochs).into_iter().chain(released) {
            self.publish(shard, None, epoch);
        }
        if let Err(err) = self.producer.flush(Duration::from_secs(5)) {
            // The others take the shards when this owner's claims expire instead.
            tracing::warn!(error = %err, "the shard releases were not flushed");
        }
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
