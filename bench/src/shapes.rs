//! The shapes of `tally-bench ingest`'s backlogs: how the increments spread over the
//! entities, and the hierarchy they feed. Each shape's cost per increment is compared
//! with the plain Zipf backlog's in the same run.

use std::time::Duration;

use rdkafka::consumer::BaseConsumer;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_core::graph::DescChange;
use tally_core::sharding::shard_of;
use tally_core::wire::{ShardMessage, Source, Stamp};
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{client_config, partition_count, producer_config, TopicNames};

/// How a backlog's increments spread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    /// Zipf(1.1) over the entities, as producers' traffic is: the baseline.
    Zipf,
    /// A hot key: half of all increments on one entity (`user:0`), the rest Zipf.
    Hot,
    /// A hot ancestor: Zipf, every entity a child of one ancestor ([`ANCESTOR`]),
    /// whose total every increment also feeds (through other shards' outboxes for
    /// the entities not on its shard).
    Subtree,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Shape::Zipf => "zipf",
            Shape::Hot => "hot",
            Shape::Subtree => "subtree",
        })
    }
}

/// The one ancestor of every entity in [`Shape::Subtree`].
pub const ANCESTOR: &str = "team:0";

/// Descendant changes per shard record.
const CHANGES_PER_RECORD: usize = 2_000;

/// Writes to the shard topic what tally-graph writes for the edges `user:i →`
/// [`ANCESTOR`], `i` below `entities`: each entity's change of ancestors, on the
/// entity's shard. A counter started after it routes every entity's increments to
/// the ancestor too.
pub async fn write_subtree(config: &TallyConfig, names: &TopicNames, entities: usize) -> anyhow::Result<()> {
    let topic = names.shards();
    let client: BaseConsumer = client_config(&config.kafka)?.create()?;
    // At least one: no partitions is an error.
    let shards = partition_count(&client, &topic, Duration::from_secs(10))? as usize;
    let mut by_shard: Vec<Vec<DescChange>> = vec![Vec::new(); shards];
    for i in 0..entities {
        let origin = format!("user:{i}");
        let shard = shard_of(&origin, shards as u32) as usize;
        by_shard[shard].push(DescChange { origin, added: vec![ANCESTOR.to_string()], removed: Vec::new() });
    }
    let producer: FutureProducer = producer_config(&config.kafka)?.create()?;
    let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
    let mut offset = 0i64;
    for (shard, changes) in by_shard.iter().enumerate() {
        for chunk in changes.chunks(CHANGES_PER_RECORD) {
            let entries =
                chunk.iter().enumerate().map(|(i, c)| (Stamp { offset, index: i as u32 }, c.clone())).collect();
            let payload = ShardMessage::DescChanges { source, entries }.encode()?;
            let record = FutureRecord::<(), _>::to(&topic).partition(shard as i32).payload(&payload);
            producer.send(record, Duration::from_secs(60)).await.map_err(|(err, _)| anyhow::anyhow!("{err}"))?;
            offset += 1;
        }
    }
    Ok(())
}
