//! Kafka glue: topic names, client configuration and small metadata helpers.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::ClientConfig;

use crate::config::KafkaConfig;
use crate::{Error, Result};

/// The names of tally's topics under the configured prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicNames {
    pub prefix: String,
}

impl TopicNames {
    pub fn new(prefix: &str) -> Self {
        Self { prefix: prefix.to_string() }
    }

    /// `<prefix><short>`, e.g. `tally.increments`.
    pub fn name(&self, short: &str) -> String {
        format!("{}{short}", self.prefix)
    }

    /// Producer increments (SPEC §4).
    pub fn increments(&self) -> String {
        self.name("increments")
    }

    /// Rejected input with reasons (SPEC §4).
    pub fn dead_letter(&self) -> String {
        self.name("dead-letter")
    }

    /// Internal: validated increments routed to counter shards, one partition per shard.
    pub fn shards(&self) -> String {
        self.name("shards")
    }

    /// Latest bucket values for downstream consumers (SPEC §4).
    pub fn rollups(&self) -> String {
        self.name("rollups")
    }

    /// Producer graph updates (SPEC §4).
    pub fn graph(&self) -> String {
        self.name("graph")
    }

    /// Internal: validated graph updates for `tally-graph`.
    pub fn graph_updates(&self) -> String {
        self.name("graph-updates")
    }

    /// Internal: dequeue brokers' heartbeats.
    pub fn queue_brokers(&self) -> String {
        self.name("queue-brokers")
    }

    /// A job queue's topic (SPEC §6).
    pub fn jobs(&self, queue: &str) -> String {
        self.name(&format!("jobs.{queue}"))
    }

    /// A job queue's dead topic.
    pub fn dead_jobs(&self, queue: &str) -> String {
        self.name(&format!("jobs.{queue}.dead"))
    }

    /// Internal: which counter process serves reads for which shard.
    pub fn shard_owners(&self) -> String {
        self.name("shard-owners")
    }
}

/// A client configuration with the bootstrap servers and the pass-through settings.
pub fn client_config(kafka: &KafkaConfig) -> Result<ClientConfig> {
    if kafka.bootstrap_servers.trim().is_empty() {
        return Err(Error::Config(
            "kafka.bootstrap_servers is empty (set it or use `tally up`, which starts a local broker)".into(),
        ));
    }
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka.bootstrap_servers);
    for (key, value) in &kafka.client {
        config.set(key, value);
    }
    Ok(config)
}

/// Settings of a producer whose writes are idempotent, ordered and gapless per
/// partition: a retried send never duplicates or reorders, and no record lands after
/// one that failed — which the stamps rely on (a receiver drops every stamp at or
/// below the highest it has applied, so a gap would be lost for good).
///
/// librdkafka leaves a gap when a record times out locally and a later one is sent
/// under a bumped epoch, and `enable.gapless.guarantee` does not cover timeouts; so
/// records never time out locally (`message.timeout.ms = 0`: retried until delivered),
/// and any other error that could leave a gap is fatal to the producer. A caller
/// that stops waiting (shutdown) replays from its last committed position.
pub fn producer_config(kafka: &KafkaConfig) -> Result<ClientConfig> {
    let mut config = client_config(kafka)?;
    config
        .set("enable.idempotence", "true")
        .set("enable.gapless.guarantee", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("message.timeout.ms", "0");
    if !kafka.client.contains_key("message.max.bytes") {
        config.set("message.max.bytes", kafka.max_message_bytes.to_string());
    }
    Ok(config)
}

/// The number of partitions of `topic`, or an error when it does not exist.
pub fn partition_count<X: ConsumerContext>(consumer: &BaseConsumer<X>, topic: &str, timeout: Duration) -> Result<u32> {
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len())
        .unwrap_or(0);
    if partitions == 0 {
        return Err(Error::Topics(format!("topic {topic} does not exist; run `tally topics apply`")));
    }
    Ok(partitions as u32)
}

/// Waits until `topic` exists with at least one partition, up to `timeout`; returns
/// its partition count. The metadata calls block, so they run off the async runtime.
pub async fn wait_for_topic(kafka: &KafkaConfig, topic: &str, timeout: Duration) -> Result<u32> {
    let consumer: BaseConsumer = client_config(kafka)?.create()?;
    let topic = topic.to_string();
    let waited = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match partition_count(&consumer, &topic, Duration::from_secs(5)) {
                Ok(n) => return Ok(n),
                Err(err) if std::time::Instant::now() >= deadline => return Err(err),
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    })
    .await;
    waited.map_err(|err| Error::Topics(format!("waiting for a topic: {err}")))?
}

/// Wall-clock milliseconds since the epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// Every record of `topic` up to its end when called (all partitions, from the
/// beginning): for tools that list a topic, like `tally jobs dead`.
pub fn read_to_end(kafka: &KafkaConfig, topic: &str, timeout: Duration) -> Result<Vec<Vec<u8>>> {
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
    use rdkafka::Message;
    let mut config = client_config(kafka)?;
    config.set("group.id", "tally-reader").set("enable.auto.commit", "false");
    let consumer: BaseConsumer = config.create()?;
    let partitions = partition_count(&consumer, topic, timeout)?;
    let mut assignment = TopicPartitionList::new();
    let mut remaining = std::collections::HashMap::new();
    for partition in 0..partitions as i32 {
        let (low, high) = consumer.fetch_watermarks(topic, partition, timeout)?;
        if high > low {
            remaining.insert(partition, high);
            assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
        }
    }
    let mut records = Vec::new();
    if remaining.is_empty() {
        return Ok(records);
    }
    consumer.assign(&assignment)?;
    let deadline = std::time::Instant::now() + timeout;
    while !remaining.is_empty() && std::time::Instant::now() < deadline {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) {
            records.push(message.payload().unwrap_or_default().to_vec());
            if remaining.get(&message.partition()).is_some_and(|high| message.offset() + 1 >= *high) {
                remaining.remove(&message.partition());
            }
        }
    }
    Ok(records)
}
