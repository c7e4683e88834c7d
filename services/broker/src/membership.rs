//! Which dequeue brokers are alive: each broker publishes a heartbeat on
//! `tally.queue-brokers` every `heartbeat_ms` and follows the topic; a broker silent
//! for `member_timeout_ms`, or one that said it is leaving, is gone. Every broker
//! sees the same log, so all compute the same owners
//! ([`tally_core::jobs::assignment`]).
//!
//! (Kafka's consumer-group assignment could play this part on a real Kafka; the
//! local broker's group coordinator never evicts a member killed with -9, so tally
//! keeps its own, simple membership.)

use std::collections::BTreeMap;
use std::sync::RwLock;
use std::time::Duration;

use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use tally_core::jobs::api::BrokerHeartbeat;
use tally_core::jobs::assignment::Member;
use tally_shared::config::KafkaConfig;
use tally_shared::follow::Follow;
use tally_shared::kafka::{now_ms, producer_config};
use tokio_util::sync::CancellationToken;

use crate::error::Result;

#[derive(Default)]
pub struct Membership {
    /// instance → its latest heartbeat.
    latest: RwLock<BTreeMap<String, BrokerHeartbeat>>,
}

impl Membership {
    pub fn record(&self, heartbeat: BrokerHeartbeat) {
        if let Ok(mut latest) = self.latest.write() {
            let newer = latest.get(&heartbeat.instance).is_none_or(|h| h.at_ms <= heartbeat.at_ms);
            if newer {
                latest.insert(heartbeat.instance.clone(), heartbeat);
            }
        }
    }

    /// The brokers alive at `now`, sorted by instance.
    pub fn live(&self, now: i64, timeout_ms: u64) -> Vec<Member> {
        let Ok(latest) = self.latest.read() else { return Vec::new() };
        latest
            .values()
            .filter(|h| !h.leaving && h.at_ms + timeout_ms as i64 > now)
            .map(|h| Member { instance: h.instance.clone(), addr: h.addr.clone() })
            .collect()
    }
}

/// Publishes heartbeats until `shutdown`, then one saying it is leaving.
pub fn heartbeat(
    kafka: &KafkaConfig,
    topic: String,
    me: Member,
    every: Duration,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let producer: ThreadedProducer<DefaultProducerContext> = producer_config(kafka)?.create()?;
    let thread = std::thread::Builder::new().name("broker-heartbeat".into()).spawn(move || {
        let send = |leaving: bool| {
            let beat = BrokerHeartbeat::new(me.instance.clone(), me.addr.clone(), now_ms(), leaving);
            if let Ok(payload) = serde_json::to_vec(&beat) {
                if let Err((err, _)) = producer.send(BaseRecord::to(&topic).key(&me.instance).payload(&payload)) {
                    tracing::warn!(error = %err, "sending a heartbeat");
                }
            }
        };
        while !shutdown.is_cancelled() {
            send(false);
            let _ = producer.flush(every);
            let until = std::time::Instant::now() + every;
            while !shutdown.is_cancelled() && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        send(true);
        let _ = producer.flush(Duration::from_secs(5));
    })?;
    Ok(thread)
}

/// Follows the heartbeats topic from its beginning into `membership`.
pub fn follow(
    kafka: &KafkaConfig,
    topic: String,
    membership: std::sync::Arc<Membership>,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let poll = Duration::from_millis(100);
    let group = "tally-broker-membership";
    Ok(tally_shared::follow::follow(kafka, "broker-membership", group, &topic, poll, shutdown, Beats(membership))?)
}

struct Beats(std::sync::Arc<Membership>);

impl Follow for Beats {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        match BrokerHeartbeat::decode(payload) {
            Ok(heartbeat) => self.0.record(heartbeat),
            Err(err) => tracing::warn!(offset, error = %err, "ignoring a heartbeat this build cannot read"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(instance: &str, at_ms: i64, leaving: bool) -> BrokerHeartbeat {
        BrokerHeartbeat::new(instance.into(), format!("{instance}:1"), at_ms, leaving)
    }

    #[test]
    fn silent_and_leaving_brokers_are_gone() {
        let membership = Membership::default();
        membership.record(beat("a", 1_000, false));
        membership.record(beat("b", 1_000, false));
        membership.record(beat("c", 1_000, false));
        membership.record(beat("a", 5_000, false));
        membership.record(beat("a", 4_000, false)); // older, ignored
        membership.record(beat("b", 5_500, true));
        let live: Vec<String> = membership.live(6_000, 3_000).into_iter().map(|m| m.instance).collect();
        assert_eq!(live, vec!["a".to_string()]);
    }
}
