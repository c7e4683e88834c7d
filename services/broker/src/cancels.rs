//! Operators' cancellations (`tally.jobs-cancelled`, compacted): read to its end
//! before the broker fetches a job, then followed, so every broker knows every
//! cancelled job — one it holds ends at once (or is told on its next extend), one
//! it fetches later never runs.

use std::sync::Arc;
use std::time::Duration;

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
    let mut cancels = Cancels { broker };
    for (offset, payload) in tally_shared::kafka::read_to_end_at(kafka, &topic, Duration::from_secs(30))? {
        cancels.record(offset, &payload);
    }
    let poll = Duration::from_millis(100);
    Ok(tally_shared::follow::follow(kafka, "broker-cancels", "tally-broker-cancels", &topic, poll, shutdown, cancels)?)
}

struct Cancels {
    broker: Arc<Broker>,
}

impl Follow for Cancels {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        match JobCancel::decode(payload) {
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
