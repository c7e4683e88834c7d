//! `tally-counter`: owns counter shards, applies their increments, descendant changes
//! and remote totals to RocksDB exactly once, serves reads for them and publishes
//! rollups.
//!
//! - [`store`]: one shard's RocksDB (counts, idempotency marks, progress) and all
//!   that is done to it — `store::apply` (a batch of shard records → one atomic
//!   write batch), `store::read` (windows, series and metric listings from a
//!   snapshot), `store::rollup_book` (rollup pages and deadlines) — with
//!   [`operands`] (when a batch writes a count key's sum instead of a merge
//!   operand), [`direct`], [`views`] and [`marks`] (what it keeps in memory);
//! - [`consumer`]: the consumer thread that owns shards (taking and dropping them:
//!   [`context`]) and applies [`batch`]es, with [`late`] records joining them;
//! - [`snapshots`]: the serving shards' snapshots, on a thread of its own;
//! - [`flushes`]: flushing the stores that run without the WAL, on a thread of its own;
//! - [`ownership`]: which shards this counter owns among the live counters, fenced
//!   by its lease;
//! - [`relay`]: sends each shard's outbox of totals to the shards of descendants;
//! - [`rollups`]: publishes the latest values of changed buckets, on a thread of its own;
//! - [`http`]: the internal read API, and [`read_link`] its binary connection;
//!   [`metrics`]: what it exports.

pub mod batch;
pub mod consumer;
pub mod context;
pub mod direct;
pub mod error;
pub mod flushes;
pub mod freshness;
pub mod http;
pub mod late;
pub mod marks;
pub mod metrics;
pub mod operands;
pub mod ownership;
pub mod read_link;
pub mod relay;
pub mod rollups;
pub mod shards;
pub mod snapshots;
pub mod store;
pub mod views;

use std::sync::Arc;

use prometheus::Registry;
use tally_shared::config::TallyConfig;
use tally_shared::telemetry::{serve_admin, Readiness};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::{Error, Result};

/// Runs a counter until `shutdown` is cancelled: the batch in hand is persisted
/// before this returns.
pub async fn run(config: TallyConfig, shutdown: CancellationToken) -> Result<()> {
    let registry = Registry::new();
    let metrics = metrics::Metrics::new(&registry);
    let shard_topic = tally_shared::kafka::TopicNames::new(&config.kafka.topic_prefix).shards();
    let shard_count =
        tally_shared::kafka::wait_for_topic(&config.kafka, &shard_topic, std::time::Duration::from_secs(60)).await?;
    // Whether the shard topic may serve as the stores' journal (no WAL) depends on
    // how long it really keeps records.
    let shard_topic_settings = match tally_shared::topics::settings(&config.kafka, &shard_topic).await {
        Ok(settings) => Some(settings),
        Err(err) => {
            tracing::warn!(error = %err, "reading the shard topic's retention; the stores keep the WAL");
            None
        }
    };
    let durability = config.counter.durability(shard_topic_settings.as_ref());
    tracing::info!(?durability, "shard stores' commits survive a crash by");
    metrics.store_wal.set(i64::from(durability != tally_shared::store::Durability::InputLog));
    let readiness = Readiness::default();
    let lease = match config.counter.static_assignment {
        true => tally_shared::membership::Lease::forever(),
        false => {
            if config.counter.heartbeat_ms == 0 || config.counter.heartbeat_ms * 3 > config.counter.member_timeout_ms {
                return Err(Error::Consumer(format!(
                    "counter.member_timeout_ms ({}) must be at least 3 × counter.heartbeat_ms ({}, not 0)",
                    config.counter.member_timeout_ms, config.counter.heartbeat_ms
                )));
            }
            let members = tally_shared::kafka::TopicNames::new(&config.kafka.topic_prefix).counter_members();
            tally_shared::kafka::wait_for_topic(&config.kafka, &members, std::time::Duration::from_secs(60)).await?;
            tally_shared::membership::Lease::new(config.counter.member_timeout_ms)
        }
    };
    let shards = Arc::new(shards::Shards::new(Arc::new(lease)));

    let listener = TcpListener::bind(&config.counter.read_listen).await?;
    let bound = listener.local_addr()?;
    let read_addr = tally_shared::service::advertised_addr(bound, config.counter.advertise_host.as_deref());
    let admin =
        serve_admin(&config.counter.admin_listen, registry.clone(), readiness.clone(), shutdown.clone()).await?;
    tracing::info!(read_api = %read_addr, admin = %admin, data_dir = %config.counter.data_dir.display(), "tally-counter starting");

    let app = http::router(
        http::ReadState {
            shards: shards.clone(),
            metrics: metrics.clone(),
            snapshots: config.snapshots.enabled,
            shutdown: shutdown.clone(),
        },
        &config.auth,
    );
    tally_shared::http::spawn_serve("read API", listener, app, shutdown.clone());

    let snapshots = match config.snapshots.enabled {
        true => Some(tally_shared::snapshot::SnapshotStore::from_config(
            &config.snapshots,
            tokio::runtime::Handle::current(),
        )?),
        false => None,
    };
    let setup = consumer::ConsumerSetup {
        snapshots,
        registry,
        config,
        shards,
        metrics,
        readiness,
        shard_count,
        read_addr,
        durability,
    };
    let consumer_shutdown = shutdown.clone();
    let result =
        tally_shared::sched::spawn_background("counter-apply", move || consumer::run(setup, consumer_shutdown))
            .await
            .map_err(Error::Consumer)?;
    shutdown.cancel();
    result
}
