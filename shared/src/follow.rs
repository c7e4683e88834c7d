//! Following a small control topic from its beginning, for as long as a service
//! runs: shard owners (tally-query), broker heartbeats and queue declarations
//! (tally-broker). One thread and one loop, whatever the records mean.

use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::consumer::BaseConsumer;
use rdkafka::Message;
use tokio_util::sync::CancellationToken;

use crate::config::KafkaConfig;
use crate::kafka::follower;
use crate::Result;

/// What a follower does with the records it reads.
pub trait Follow: Send + 'static {
    /// One record, in log order (`payload` empty for a tombstone).
    fn record(&mut self, offset: i64, payload: &[u8]);

    /// After every poll, with the follower's client for metadata lookups.
    fn idle(&mut self, _client: &BaseConsumer) {}
}

/// How long a follower's fetch may wait at the broker for records when its lag is
/// how long a failover takes (membership, shard claims): a broker that holds every
/// fetch for the whole wait (the local one) delays a takeover by up to that much at
/// each hop.
pub const FAILOVER_FETCH_WAIT: Duration = Duration::from_millis(100);
/// librdkafka's default, for followers nothing waits on (declarations, cancels).
pub const BACKGROUND_FETCH_WAIT: Duration = Duration::from_millis(500);

/// Reads partition 0 of `topic` from its beginning on a thread named `name` (its
/// consumer group, which commits nothing, is `group`; its fetches wait up to
/// `fetch_wait` at the broker, unless `kafka.client` says) until `shutdown`.
#[allow(clippy::too_many_arguments)]
pub fn follow(
    kafka: &KafkaConfig,
    name: &str,
    group: &str,
    topic: &str,
    poll: Duration,
    fetch_wait: Duration,
    shutdown: CancellationToken,
    mut handler: impl Follow,
) -> Result<JoinHandle<()>> {
    let consumer = follower(kafka, group, topic, fetch_wait)?;
    let topic = topic.to_string();
    let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
        while !shutdown.is_cancelled() {
            match consumer.poll(poll) {
                Some(Ok(message)) => handler.record(message.offset(), message.payload().unwrap_or_default()),
                Some(Err(err)) => tracing::warn!(topic, error = %err, "following"),
                None => {}
            }
            handler.idle(&consumer);
        }
    })?;
    Ok(thread)
}
