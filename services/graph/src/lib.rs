//! `tally-graph`: keeps the entity graph and tells counter shards how each origin's
//! descendant set changes.
//!
//! - [`store`]: the graph's RocksDB, loaded into a [`Graph`](tally_core::graph::Graph)
//!   in memory; a batch of updates → net descendant changes in the outbox, with the
//!   edges and the progress, in one write batch;
//! - [`processor`]: the thread that consumes graph updates and relays the outbox;
//! - [`http`]: the internal neighbours API; [`metrics`]: what it exports.
//!
//! One instance owns the whole graph (the graph-updates topic has one partition).

pub mod error;
pub mod http;
pub mod metrics;
pub mod processor;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tally_shared::config::TallyConfig;
use tally_shared::failures::FailureBoard;
use tally_shared::kafka::{wait_for_topic, TopicNames};
use tally_shared::snapshot::{snapshot_router, SnapshotRequests, SnapshotStore, Snapshotter};
use tally_shared::telemetry::{serve_admin, Readiness};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::{Error, Result};

/// Runs the graph processor until `shutdown`.
pub async fn run(config: TallyConfig, shutdown: CancellationToken) -> Result<()> {
    let registry = Registry::new();
    let metrics = metrics::Metrics::new(&registry);
    let readiness = Readiness::default();
    let admin = serve_admin(&config.graph.admin_listen, registry.clone(), readiness.clone(), shutdown.clone()).await?;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let shards = wait_for_topic(&config.kafka, &names.shards(), Duration::from_secs(60)).await?;
    wait_for_topic(&config.kafka, &names.graph_updates(), Duration::from_secs(60)).await?;
    let options = store::GraphOptions {
        shards,
        dedupe_window_ms: config.counting.dedupe_window_ms()?,
        sync_writes: config.graph.sync_writes,
        record_budget: config.kafka.record_budget(),
        max_descendants: config.graph.max_descendants,
        input_topic: tally_shared::kafka::TopicNames::new(&config.kafka.topic_prefix).graph(),
    };
    let data_dir = config.graph.data_dir.clone();
    let snapshots = match config.snapshots.enabled {
        true => Some(SnapshotStore::from_config(&config.snapshots, tokio::runtime::Handle::current())?),
        false => None,
    };
    let snapshot_name = processor::snapshot_name(&names);
    let restore_from = snapshots.clone();
    let (restored_metric, restore_seconds) = (metrics.restored.clone(), metrics.restore_seconds.clone());
    // On a thread at the kernel's default slice: RocksDB starts its background
    // threads here, and they inherit it.
    let store = Arc::new(
        tally_shared::sched::spawn_background("graph-open", move || {
            // A graph without a store (a new disk) restores the newest snapshot
            // and replays the log after it.
            if let Some(snapshots) = restore_from.filter(|_| !data_dir.exists()) {
                let started = std::time::Instant::now();
                if Snapshotter::restore_latest(&snapshots, &snapshot_name, &data_dir)?.is_some() {
                    restored_metric.inc();
                    restore_seconds.observe(started.elapsed().as_secs_f64());
                }
            }
            let opened = store::GraphStore::open(&data_dir, options)?;
            // The graph is announced only once it caught up with the log it found at
            // start, restored or not: a restore's mark has nothing more to hold.
            tally_shared::snapshot::clear_restored_marker(&data_dir)?;
            Ok::<_, Error>(opened)
        })
        .await
        .map_err(Error::Processor)??,
    );

    let listener = TcpListener::bind(&config.graph.read_listen).await?;
    let bound = listener.local_addr()?;
    let read_addr = tally_shared::service::advertised_addr(bound, config.graph.advertise_host.as_deref());
    tracing::info!(read_api = %read_addr, admin = %admin, data_dir = %config.graph.data_dir.display(), "tally-graph starting");
    let failures = Arc::new(FailureBoard::new(|partition| format!("the graph (graph-updates partition {partition})")));
    let requests = snapshots.as_ref().map(|_| Arc::new(SnapshotRequests::default()));
    let app = http::router(store.clone(), failures.clone(), &config.auth)
        .merge(snapshot_router(requests.clone(), &config.auth));
    tally_shared::http::spawn_serve("graph read API", listener, app, shutdown.clone());

    let snapshots = snapshots.zip(requests);
    let setup =
        processor::ProcessorSetup { config, store, failures, metrics, registry, readiness, read_addr, snapshots };
    let processor_shutdown = shutdown.clone();
    let result =
        tally_shared::sched::spawn_background("graph-apply", move || processor::run(setup, processor_shutdown))
            .await
            .map_err(Error::Processor)?;
    shutdown.cancel();
    result
}
