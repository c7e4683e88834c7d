//! Kafka glue: topic names, client configuration and small metadata helpers.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::producer::{Producer, ProducerContext};
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

    /// Producer increments.
    pub fn increments(&self) -> String {
        self.name("increments")
    }

    /// Rejected input with reasons.
    pub fn dead_letter(&self) -> String {
        self.name("dead-letter")
    }

    /// Internal: validated increments routed to counter shards, one partition per shard.
    pub fn shards(&self) -> String {
        self.name("shards")
    }

    /// Latest bucket values for downstream consumers.
    pub fn rollups(&self) -> String {
        self.name("rollups")
    }

    /// Producer graph updates.
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

    /// The counters' heartbeats (their membership).
    pub fn counter_members(&self) -> String {
        self.name("counter-members")
    }

    /// A job queue's topic.
    pub fn jobs(&self, queue: &str) -> String {
        self.name(&format!("jobs.{queue}"))
    }

    /// A job queue's dead topic.
    pub fn dead_jobs(&self, queue: &str) -> String {
        self.name(&format!("jobs.{queue}.dead"))
    }

    /// Operators' decisions about dead jobs (requeued, discarded), compacted.
    pub fn dead_jobs_resolved(&self) -> String {
        self.name("dead-jobs-resolved")
    }

    /// Operators' cancellations of jobs, compacted: every broker follows it.
    pub fn jobs_cancelled(&self) -> String {
        self.name("jobs-cancelled")
    }

    /// Internal: the queue declarations running brokers follow (compacted).
    pub fn queues(&self) -> String {
        self.name("queues")
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

/// How long a data-path fetch may wait at the broker for data, unless
/// `kafka.client` says. librdkafka's 500 ms costs nothing on a broker that answers
/// as soon as data arrives, but some brokers (the local one) hold a fetch for the
/// whole wait, which caps a consumer at one fetch per wait (`tally-bench ingest`:
/// 2.7× the raw rate of 100-increment messages at 500 ms). Shorter waits cost idle fetches: at 100 ms the
/// local broker spends 18 % of a core on an idle `tally up` (8 % at 500 ms, 43 % at
/// 25 ms), so the followers of small internal topics keep librdkafka's default. A
/// counter's shard consumer has a wait of its own (`counter.fetch_wait_ms`).
pub const FETCH_WAIT_MS: &str = "100";

/// How long a data-path consumer's fetches wait at the broker: `fetch.wait.max.ms`
/// of `kafka.client`, else [`FETCH_WAIT_MS`] (a value librdkafka would refuse
/// anyway reads as the default).
pub fn fetch_wait(kafka: &KafkaConfig) -> Duration {
    let ms = kafka.client.get("fetch.wait.max.ms").map_or(FETCH_WAIT_MS, String::as_str);
    Duration::from_millis(ms.trim().parse().or_else(|_| FETCH_WAIT_MS.parse()).unwrap_or_default())
}

/// The configuration of a data-path consumer (the ingester's, the graph's, a
/// counter's, which sets a wait of its own): [`client_config`] with
/// [`FETCH_WAIT_MS`]; the caller sets its group and offsets.
pub fn consumer_config(kafka: &KafkaConfig) -> Result<ClientConfig> {
    let mut config = client_config(kafka)?;
    if !kafka.client.contains_key("fetch.wait.max.ms") {
        config.set("fetch.wait.max.ms", FETCH_WAIT_MS);
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

/// How long [`request_producer_id`] waits for each metadata answer.
const PRODUCER_ID_WAIT: Duration = Duration::from_secs(5);

/// Has an idempotent `producer` ask for its producer id now, not at librdkafka's
/// next try, so its first records need not wait for it. librdkafka asks for the id
/// when a metadata answer comes in, or else on a 500 ms timer; right after a
/// producer is created its first try finds no connection up (the bootstrap one is
/// dropped once the answer to it names the broker), so the id comes 0.5–1 s after
/// the producer was created unless it is asked for (then 0.05–0.07 s). The relays, the shard claims and the
/// heartbeats ask when their producer is created (their first records go at once);
/// the ingester does not, measured. The requests name no topic: a producer's request
/// for a topic asks the broker to create it when missing (librdkafka's
/// `allow.auto.create.topics` is on for producers), which would make a topic `tally
/// topics apply` has not declared yet with the broker's defaults. Blocks up to twice
/// `PRODUCER_ID_WAIT` (5 s); best effort: unanswered, the id comes by librdkafka's own retry.
pub fn request_producer_id<C: ProducerContext>(producer: &impl Producer<C>) {
    // Twice: the first answer may come over the bootstrap connection, which is
    // dropped as that answer names the broker; the second goes over the broker's own.
    for _ in 0..2 {
        if let Err(err) = producer.client().fetch_metadata(None, PRODUCER_ID_WAIT) {
            tracing::debug!(error = %err, "metadata for the producer id: not answered");
            return;
        }
    }
}

/// Settings of a producer of records without stamps (dead letters, dead jobs),
/// which a sender may simply send again: [`producer_config`] without the gapless
/// guarantee, so a permanent error fails that record instead of the producer.
pub fn unstamped_producer_config(kafka: &KafkaConfig) -> Result<ClientConfig> {
    let mut config = producer_config(kafka)?;
    config.set("enable.gapless.guarantee", "false");
    Ok(config)
}

/// Settings of a producer of records that carry their own order (rollups, by
/// their positions): acknowledged by every replica, retried, but not idempotent —
/// a repeat or a reordering is harmless to them, and a purge of what it queued
/// (a lapsed lease) leaves no gap in sequence numbers for a broker to refuse.
pub fn positioned_producer_config(kafka: &KafkaConfig) -> Result<ClientConfig> {
    let mut config = producer_config(kafka)?;
    config.set("enable.idempotence", "false").set("enable.gapless.guarantee", "false");
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

/// A consumer of a one-partition internal topic from its beginning, assigned (no
/// group membership): how services follow heartbeats, owners and declarations.
pub fn follower(kafka: &KafkaConfig, group: &str, topic: &str, fetch_wait: Duration) -> Result<BaseConsumer> {
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
    let mut config = client_config(kafka)?;
    config.set("group.id", group).set("enable.auto.commit", "false");
    if !kafka.client.contains_key("fetch.wait.max.ms") {
        config.set("fetch.wait.max.ms", fetch_wait.as_millis().to_string());
    }
    let consumer: BaseConsumer = config.create()?;
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(topic, 0, Offset::Beginning)?;
    consumer.assign(&assignment)?;
    Ok(consumer)
}

/// Wall-clock milliseconds since the epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// The high watermark of `topic`'s `partition` as the consumer's last fetch from it
/// reported (librdkafka's cache: no broker round trip), or `None` while no fetch has
/// said. A consumer whose next offset reaches it had read everything the partition
/// held when that fetch was answered.
pub fn cached_high_watermark<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partition: i32,
) -> Option<i64> {
    let topic = std::ffi::CString::new(topic).ok()?;
    let (mut low, mut high) = (-1i64, -1i64);
    // SAFETY: the client lives as long as `consumer`; librdkafka reads the name and
    // writes the two offsets only during the call.
    let err = unsafe {
        rdkafka::bindings::rd_kafka_get_watermark_offsets(
            consumer.client().native_ptr(),
            topic.as_ptr(),
            partition,
            &mut low,
            &mut high,
        )
    };
    (err == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0).then_some(high)
}

/// Every record of `topic` up to its end when called (all partitions, from the
/// beginning): for tools that list a topic, like `tally jobs dead`.
pub fn read_to_end(kafka: &KafkaConfig, topic: &str, timeout: Duration) -> Result<Vec<Vec<u8>>> {
    Ok(read_to_end_at(kafka, topic, timeout)?.into_iter().map(|(_, payload)| payload).collect())
}

/// [`read_to_end`] with each record's offset (a compacted topic has gaps).
pub fn read_to_end_at(kafka: &KafkaConfig, topic: &str, timeout: Duration) -> Result<Vec<(i64, Vec<u8>)>> {
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
    while !remaining.is_empty() {
        if std::time::Instant::now() >= deadline {
            return Err(Error::Topics(format!("{topic}: could not read to its end within {timeout:?}")));
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                records.push((message.offset(), message.payload().unwrap_or_default().to_vec()));
                if remaining.get(&message.partition()).is_some_and(|high| message.offset() + 1 >= *high) {
                    remaining.remove(&message.partition());
                }
            }
            Some(Err(err)) => tracing::warn!(topic, error = %err, "reading to the end"),
            None => {}
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Instant;

    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
    use rdkafka::ClientContext;

    use super::*;

    #[test]
    fn the_fetch_wait_is_the_clients_setting_or_the_data_paths_default() {
        let mut kafka = KafkaConfig::default();
        assert_eq!(fetch_wait(&kafka), Duration::from_millis(100));
        kafka.client.insert("fetch.wait.max.ms".into(), "40".into());
        assert_eq!(fetch_wait(&kafka), Duration::from_millis(40));
        kafka.client.insert("fetch.wait.max.ms".into(), "soon".into());
        assert_eq!(fetch_wait(&kafka), Duration::from_millis(100));
    }

    /// Records which stamps were acknowledged and which failed.
    #[derive(Default)]
    struct Deliveries(Mutex<Vec<(u32, bool)>>);

    impl ClientContext for Deliveries {}

    impl ProducerContext for Deliveries {
        type DeliveryOpaque = Box<u32>;

        fn delivery(&self, result: &DeliveryResult<'_>, stamp: Box<u32>) {
            if let Ok(mut seen) = self.0.lock() {
                seen.push((*stamp, result.is_ok()));
            }
        }
    }

    /// Queues stamps in order, keyed alike (one partition).
    fn send(producer: &BaseProducer<Deliveries>, topic: &str, stamps: &[u32]) {
        for &stamp in stamps {
            let payload = stamp.to_le_bytes();
            let record = BaseRecord::with_opaque_to(topic, Box::new(stamp)).key("k").payload(&payload[..]);
            producer.send(record).map_err(|(err, _)| err).expect("queued");
        }
    }

    fn poll_for(producer: &BaseProducer<Deliveries>, wait: Duration) {
        let until = Instant::now() + wait;
        while Instant::now() < until {
            producer.poll(Duration::from_millis(50));
        }
    }

    /// What a receiver keeping a high-water stamp applies from the topic, in log order.
    fn applied(kafka: &KafkaConfig, topic: &str) -> Vec<u32> {
        let mut high_water: Option<u32> = None;
        let mut applied = Vec::new();
        for record in read_to_end(kafka, topic, Duration::from_secs(10)).unwrap() {
            let stamp = u32::from_le_bytes(record[..4].try_into().unwrap());
            if high_water.is_none_or(|hw| stamp > hw) {
                high_water = Some(stamp);
                applied.push(stamp);
            }
        }
        applied
    }

    /// The broker is unreachable for 31 s while record 1 waits and record 2 is sent
    /// 5 s after it: with a local message timeout, 1 would fail and 2 land after a
    /// bumped epoch — a gap the sender's replay (1, 2 again) cannot fill, since the
    /// receiver drops every stamp at or below 2. With tally's producers nothing
    /// times out locally: 1 and 2 land in order, and nothing is lost.
    #[test]
    fn an_unreachable_broker_never_leaves_a_gap_in_what_is_sent() {
        let cluster = MockCluster::new(1).unwrap();
        let topic = "gaps";
        cluster.create_topic(topic, 1, 1).unwrap();
        let mut kafka = KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        kafka.client.insert("reconnect.backoff.max.ms".into(), "500".into());
        let producer: BaseProducer<Deliveries> =
            producer_config(&kafka).unwrap().create_with_context(Deliveries::default()).unwrap();
        send(&producer, topic, &[0]);
        producer.flush(Duration::from_secs(10)).unwrap();

        cluster.broker_down(1).unwrap();
        send(&producer, topic, &[1]);
        poll_for(&producer, Duration::from_secs(5));
        send(&producer, topic, &[2]);
        poll_for(&producer, Duration::from_secs(26));
        cluster.broker_up(1).unwrap();
        // Records still undelivered show as such in the reports below.
        producer.flush(Duration::from_secs(20)).ok();
        let reports = producer.context().0.lock().unwrap().clone();
        if reports.iter().any(|(_, ok)| !ok) {
            // What the ingester and every relay do on a failed delivery: send again
            // from the last position acknowledged in full.
            let replay: BaseProducer<Deliveries> =
                producer_config(&kafka).unwrap().create_with_context(Deliveries::default()).unwrap();
            send(&replay, topic, &[1, 2]);
            replay.flush(Duration::from_secs(20)).unwrap();
        }
        assert_eq!(applied(&kafka, topic), vec![0, 1, 2], "nothing lost behind a gap");
        assert_eq!(reports, vec![(0, true), (1, true), (2, true)], "every record acknowledged, in order");
    }
}
