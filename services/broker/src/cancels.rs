//! Operators' cancellations (`tally.jobs-cancelled`, compacted): read to its end
//! before the broker fetches a job, then followed, so every broker knows every
//! cancelled job — one it holds ends at once (or is told on its next extend), one
//! it fetches later never runs. A revoked cancellation (its job requeued) is
//! forgotten; the fetcher reads up to the topic's end before it cancels a job it
//! fetched ([`crate::state::Broker::cancels_read`]), so a requeued job, written
//! after its revocation, is never cancelled again.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};

use tally_core::jobs::JobCancel;
use tally_shared::config::KafkaConfig;
use tally_shared::follow::Follow;
use tally_shared::kafka::TopicNames;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::state::Broker;

/// Reads every cancellation so far into `broker`, then follows the topic on a
/// thread.
pub fn load_and_follow(
    kafka: &KafkaConfig,
    broker: Arc<Broker>,
    names: &TopicNames,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let topic = names.jobs_cancelled();
    let mut cancels = Cancels { broker, loaded_until: 0 };
    for (offset, payload) in tally_shared::kafka::read_to_end_at(kafka, &topic, Duration::from_secs(30))? {
        cancels.record(offset, &payload);
    }
    // The follower reads from the beginning again: what was loaded is not applied
    // twice (a cancellation replayed after its revocation would hold again).
    cancels.loaded_until = cancels.broker.cancels_read.load(Ordering::Acquire);
    let poll = Duration::from_millis(100);
    Ok(tally_shared::follow::follow(
        kafka,
        "broker-cancels",
        "tally-broker-cancels",
        &topic,
        poll,
        tally_shared::follow::BACKGROUND_FETCH_WAIT,
        shutdown,
        cancels,
    )?)
}

/// How long a fetched job's cancellation waits for the cancellations written
/// before it (its revocation, if it was requeued) to be read.
const CATCH_UP: Duration = Duration::from_secs(2);

/// Whether job `id` of `queue`, just fetched, is cancelled — with every
/// cancellation written before it read first (a revoked one is forgotten). Only
/// a job whose id is cancelled waits; when the topic's end cannot be had in time
/// the job stays cancelled (it never runs by mistake).
pub fn is_cancelled_when_fetched(consumer: &BaseConsumer, broker: &Broker, topic: &str, queue: &str, id: &str) -> bool {
    if !broker.is_cancelled(queue, id) {
        return false;
    }
    let deadline = Instant::now() + CATCH_UP;
    if let Ok((_, end)) = consumer.fetch_watermarks(topic, 0, CATCH_UP) {
        while broker.cancels_read.load(Ordering::Acquire) < end && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    broker.is_cancelled(queue, id)
}

struct Cancels {
    broker: Arc<Broker>,
    /// Records below this offset were read before following.
    loaded_until: i64,
}

impl Follow for Cancels {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        if offset < self.loaded_until {
            return;
        }
        self.apply(offset, payload);
        // Read only once applied: the fetcher waits for this.
        self.broker.cancels_read.fetch_max(offset + 1, Ordering::Release);
    }
}

impl Cancels {
    fn apply(&mut self, offset: i64, payload: &[u8]) {
        match JobCancel::decode(payload) {
            Ok(cancel) if cancel.revoked => self.broker.uncancel(&cancel.queue, &cancel.id),
            Ok(cancel) => {
                self.broker.cancel_held(&cancel.queue, &cancel.id);
            }
            // A tombstone or a newer format: nothing this release can cancel.
            Err(err) if !payload.is_empty() => {
                tracing::error!(offset, error = %err, "ignoring a job cancellation this release cannot read")
            }
            Err(_) => {}
        }
    }
}
