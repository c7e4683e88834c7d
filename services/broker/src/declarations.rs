//! Follows the declarations topic (`tally.queues`, written by `tally topics apply`)
//! so a queue declared or changed while the broker runs is served without a
//! restart — Pacer's brokers learn queue changes from Helix; tally's from a
//! compacted topic. A declaration whose topic does not exist yet is kept and tried
//! again until it does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::Message;
use tally_shared::config::KafkaConfig;
use tally_shared::kafka::{follower, partition_count, TopicNames};
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
    let consumer = follower(kafka, "tally-broker-declarations", &names.queues())?;
    let thread = std::thread::Builder::new().name("broker-declarations".into()).spawn(move || {
        // Declared, but their topics are not there yet.
        let mut waiting: BTreeMap<String, QueueDecl> = BTreeMap::new();
        let mut last_try = Instant::now();
        while !shutdown.is_cancelled() {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(message)) => match QueueRecord::decode(message.payload().unwrap_or_default()) {
                    Ok(decl) => {
                        waiting.insert(decl.name.clone(), decl);
                    }
                    Err(err) => {
                        tracing::error!(offset = message.offset(), error = %err, "ignoring a queue declaration this release cannot read")
                    }
                },
                Some(Err(err)) => tracing::warn!(error = %err, "reading queue declarations"),
                None => {}
            }
            if waiting.is_empty() || last_try.elapsed() < Duration::from_millis(500) {
                continue;
            }
            last_try = Instant::now();
            waiting.retain(|_, decl| {
                let topic = names.jobs(&decl.name);
                match partition_count(&consumer, &topic, Duration::from_secs(2)) {
                    Ok(partitions) => {
                        // Every partition of the topic is served, whatever was declared.
                        let mut decl = decl.clone();
                        decl.partitions = decl.partitions.max(partitions as i32);
                        broker.declare(decl, &names);
                        false
                    }
                    Err(_) => true,
                }
            });
        }
    })?;
    Ok(thread)
}
