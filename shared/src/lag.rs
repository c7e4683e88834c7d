//! Consumer lag per partition, in records and in seconds, measured on a thread and
//! clients of its own: records are the partition's high watermark minus the next
//! offset the consumer will process; seconds are how old the oldest record not yet
//! processed is (now minus its timestamp, read from the log; 0 with nothing to
//! process) — what an operator compares with how stale the counts may be, whatever
//! the records' sizes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use tokio_util::sync::CancellationToken;

use crate::config::KafkaConfig;
use crate::consume::ahead_of_log;
use crate::kafka::{client_config, now_ms};
use crate::Result;

/// One partition's lag.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lag {
    pub records: i64,
    /// Now minus the timestamp of the oldest record not yet processed (0 when there
    /// is none); none when it could not be read this time (a reporter keeps what it
    /// said last). Records stamped with their event time (an input whose producers
    /// set it) make this the age of that event.
    pub seconds: Option<f64>,
}

/// How long a look at the oldest records not yet processed may take.
const PEEK_WAIT: Duration = Duration::from_secs(1);

/// Reports, every `period`, the lag of each partition `positions()` names (with
/// the next offset the consumer will process) through `report(partition, lag)`,
/// and `ahead(partition, next offset, reason)` when that is past the log's end
/// ([`ahead_of_log`]; positions are read before the log's end, so a store that
/// moved on meanwhile is never taken for one ahead).
#[allow(clippy::too_many_arguments)]
pub fn spawn_lag_reporter(
    kafka: &KafkaConfig,
    name: &str,
    topic: String,
    period: Duration,
    shutdown: CancellationToken,
    positions: impl Fn() -> Vec<(u32, i64)> + Send + 'static,
    report: impl Fn(u32, Lag) + Send + 'static,
    ahead: impl Fn(u32, i64, String) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>> {
    let client: BaseConsumer = client_config(kafka)?.create()?;
    let peek = Peek::new(kafka)?;
    Ok(crate::shutdown::every(name, period, shutdown, move || {
        let mut lags = Vec::new();
        for (partition, next) in positions() {
            if let Ok((_, high)) = client.fetch_watermarks(&topic, partition as i32, Duration::from_secs(1)) {
                if let Some((offset, reason)) = ahead_of_log(Some(next), high) {
                    ahead(partition, offset, reason);
                }
                lags.push((partition, next, (high - next).max(0)));
            }
        }
        let seconds = peek.seconds(&topic, &lags);
        for (partition, _, records) in lags {
            report(partition, Lag { records, seconds: seconds.get(&partition).copied().flatten() });
        }
    })?)
}

/// A consumer that reads single records at given offsets: how old the oldest
/// records not yet processed are.
pub struct Peek {
    consumer: BaseConsumer,
}

impl Peek {
    pub fn new(kafka: &KafkaConfig) -> Result<Self> {
        let mut config = client_config(kafka)?;
        // It commits nothing and wants one record per partition, not a prefetch.
        config
            .set("group.id", "tally-lag-peek")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("queued.min.messages", "1")
            .set("fetch.max.bytes", "1048576")
            .set("max.partition.fetch.bytes", "65536");
        if !kafka.client.contains_key("fetch.wait.max.ms") {
            config.set("fetch.wait.max.ms", "10");
        }
        Ok(Self { consumer: config.create()? })
    }

    /// The lag in seconds of each (partition, next offset, records behind) of
    /// `topic`: 0 with none behind, else how old the record at the next offset is
    /// (`None` when a look did not find it).
    pub fn seconds(&self, topic: &str, lags: &[(u32, i64, i64)]) -> HashMap<u32, Option<f64>> {
        let behind: Vec<(u32, i64)> =
            lags.iter().filter(|lag| lag.2 > 0).map(|&(partition, next, _)| (partition, next)).collect();
        let times = self.timestamps(topic, &behind);
        let now = now_ms();
        let seconds = |&(partition, _, records): &(u32, i64, i64)| match records {
            0 => Some(0.0),
            _ => times.get(&partition).map(|at| (now - at).max(0) as f64 / 1000.0),
        };
        lags.iter().map(|lag| (lag.0, seconds(lag))).collect()
    }

    /// The timestamp of the record at each (partition, offset) of `topic`, as far as
    /// a look of at most [`PEEK_WAIT`] finds them (none for a record gone meanwhile).
    pub fn timestamps(&self, topic: &str, at: &[(u32, i64)]) -> HashMap<u32, i64> {
        let mut found = HashMap::new();
        if at.is_empty() {
            return found;
        }
        let mut assignment = TopicPartitionList::new();
        for &(partition, offset) in at {
            if assignment.add_partition_offset(topic, partition as i32, Offset::Offset(offset)).is_err() {
                return found;
            }
        }
        if let Err(err) = self.consumer.assign(&assignment) {
            tracing::debug!(topic, error = %err, "looking at the oldest records not processed");
            return found;
        }
        let deadline = Instant::now() + PEEK_WAIT;
        while found.len() < at.len() && Instant::now() < deadline {
            if let Some(Ok(message)) = self.consumer.poll(Duration::from_millis(50)) {
                if let Some(at) = message.timestamp().to_millis() {
                    found.entry(message.partition() as u32).or_insert(at);
                }
            }
        }
        if let Err(err) = self.consumer.unassign() {
            tracing::debug!(topic, error = %err, "unassigning the lag look");
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

    use super::*;

    /// The look finds each asked record's own timestamp, on librdkafka's mock
    /// cluster (the counters' e2e `fail_closed` checks the whole reporter on a real
    /// broker).
    #[test]
    fn a_look_reads_the_timestamp_of_the_record_at_each_offset() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("t", 2, 1).unwrap();
        let kafka = KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let producer: BaseProducer = client_config(&kafka).unwrap().create().unwrap();
        for (partition, timestamps) in [(0, [1_000i64, 2_000, 3_000]), (1, [5_000, 6_000, 7_000])] {
            for at in timestamps {
                let record = BaseRecord::<(), [u8]>::to("t").partition(partition).payload(b"x").timestamp(at);
                producer.send(record).map_err(|(err, _)| err).unwrap();
            }
        }
        producer.flush(Duration::from_secs(10)).unwrap();
        let peek = Peek::new(&kafka).unwrap();
        let found = peek.timestamps("t", &[(0, 1), (1, 2)]);
        assert_eq!(found, HashMap::from([(0, 2_000), (1, 7_000)]));
        assert_eq!(peek.timestamps("t", &[(0, 0)]), HashMap::from([(0, 1_000)]), "looked at again, elsewhere");
        assert_eq!(peek.timestamps("t", &[]), HashMap::new());
    }
}
