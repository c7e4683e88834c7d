//! An example downstream consumer of `tally.rollups`: it reads every partition from
//! the beginning, keeps the newest record of every bucket by its shard position
//! ([`LatestRollups`]) — not the last one delivered — and prints each change it
//! keeps as a JSON line on stdout:
//!
//! ```text
//! {"op":"upsert","key":"user:7/views/1h/1763776800000","rollup":{"v":2,...}}
//! {"op":"delete","key":"user:7/views/1m/1763776800000"}
//! ```
//!
//! A record older than the one kept (a late delivery from a counter that lost its
//! shard) is skipped; a bucket past its `expires_at` is deleted without waiting for
//! its tombstone; a record it cannot decode stops it, naming the record.
//! Replace the printing with writes to your own table: the rule is the same.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Parser;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tally_core::rollups::LatestRollups;
use tally_core::wire::ROLLUP_POSITION_HEADER;

/// How often buckets past their expiry are dropped.
const EXPIRE_EVERY: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(about = "Follows tally.rollups, keeping the newest value of every bucket")]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// The rollups topic.
    #[arg(long, default_value = "tally.rollups")]
    topic: String,
    /// More librdkafka settings, `name=value` (TLS, SASL…); repeatable.
    #[arg(short = 'X', value_parser = setting)]
    settings: Vec<(String, String)>,
    /// Stop once nothing new came for this long (ms); by default follow for ever.
    #[arg(long)]
    exit_when_idle_ms: Option<u64>,
}

fn setting(text: &str) -> Result<(String, String), String> {
    text.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{text}: not name=value"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &args.bootstrap)
        .set("group.id", "tally-rollups-consumer")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    for (name, value) in &args.settings {
        config.set(name, value);
    }
    let consumer: BaseConsumer = config.create().context("creating the consumer")?;
    // Every partition from the beginning: the table is built in memory, whole.
    let metadata = consumer.fetch_metadata(Some(&args.topic), Duration::from_secs(10))?;
    let partitions = metadata.topics().first().map(|t| t.partitions().len()).unwrap_or(0);
    if partitions == 0 {
        bail!("topic {} not found", args.topic);
    }
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions as i32 {
        assignment.add_partition_offset(&args.topic, partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;

    let mut latest = LatestRollups::new();
    let mut last_news = Instant::now();
    let mut last_expiry = Instant::now();
    loop {
        // Buckets past their expiry go without waiting for their tombstones.
        if last_expiry.elapsed() >= EXPIRE_EVERY {
            last_expiry = Instant::now();
            let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as i64;
            for key in latest.expire(now) {
                println!(r#"{{"op":"delete","key":{}}}"#, serde_json::to_string(&key)?);
            }
        }
        if args.exit_when_idle_ms.is_some_and(|ms| last_news.elapsed() >= Duration::from_millis(ms)) {
            return Ok(());
        }
        let Some(message) = consumer.poll(Duration::from_millis(100)) else { continue };
        let message = message.context("reading the rollups topic")?;
        last_news = Instant::now();
        let position = message
            .headers()
            .and_then(|headers| headers.iter().find(|h| h.key == ROLLUP_POSITION_HEADER).and_then(|h| h.value));
        let key = message.key().unwrap_or_default();
        let at = format!("partition {} offset {}", message.partition(), message.offset());
        match latest.offer_record(key, message.payload(), position) {
            Ok(false) => {}
            Ok(true) => {
                let key = String::from_utf8_lossy(key);
                // Written, not built as a `serde_json::Value`: counts may exceed 64 bits.
                let quoted = serde_json::to_string(&key)?;
                match latest.get(&key) {
                    Some(rollup) => {
                        println!(r#"{{"op":"upsert","key":{quoted},"rollup":{}}}"#, serde_json::to_string(rollup)?)
                    }
                    None => println!(r#"{{"op":"delete","key":{quoted}}}"#),
                }
            }
            // A record this consumer cannot read (another format, a stray
            // producer) may hold a bucket's newest value: stop, rather than keep
            // an older one as the newest.
            Err(err) => bail!("the record at {at}: {err}"),
        }
    }
}
