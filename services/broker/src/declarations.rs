//! Follows the declarations topic (`tally.queues`, written by `tally topics apply`)
//! so a queue declared or changed while the broker runs is served without a
//! restart — Pacer's brokers learn queue changes from Helix; tally's from a
//! compacted topic. A declaration whose topic does not exist yet is kept and tried
//! again until it does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::BaseConsumer;
use tally_shared::config::KafkaConfig;
use tally_shared::follow::Follow;
use tally_shared::kafka::{partition_count, TopicNames};
use tally_shared::topics::{QueueDecl, QueueRecord};
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::state::Broker;

/// Starts the follower thread.
pub fn follow(
    kafka: &KafkaConfig,
    broker: Arc<Broker>,
    names: TopicNames,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let topic = names.queues();
    let declared = Declared { broker, names, waiting: BTreeMap::new(), last_try: Instant::now() };
    let poll = Duration::from_millis(200);
    let group = "tally-broker-declarations";
    Ok(tally_shared::follow::follow(
        kafka,
        "broker-declarations",
        group,
        &topic,
        poll,
        tally_shared::follow::BACKGROUND_FETCH_WAIT,
        shutdown,
        declared,
    )?)
}

struct Declared {
    broker: Arc<Broker>,
    names: TopicNames,
    /// Declared, but their topics are not there yet.
    waiting: BTreeMap<String, QueueDecl>,
    last_try: Instant,
}

impl Follow for Declared {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        match QueueRecord::decode(payload) {
            Ok(decl) => {
                self.waiting.insert(decl.name.clone(), decl);
            }
            Err(err) => tracing::error!(offset, error = %err, "ignoring a queue declaration this release cannot read"),
        }
    }

    /// Serves the declared queues whose topics exist (tried every half second).
    fn idle(&mut self, client: &BaseConsumer) {
        if self.waiting.is_empty() || self.last_try.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_try = Instant::now();
        let (broker, names) = (&self.broker, &self.names);
        self.waiting.retain(|_, decl| {
            match partition_count(client, &names.jobs(&decl.name), Duration::from_secs(2)) {
                Ok(partitions) => {
                    // Every partition of the topic is served, whatever was declared.
                    let mut decl = decl.clone();
                    decl.partitions = decl.partitions.max(partitions as i32);
                    broker.declare(decl, names);
                    false
                }
                Err(_) => true,
            }
        });
    }
}
