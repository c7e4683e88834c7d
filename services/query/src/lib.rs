//! `tally-query`: the stateless HTTP front door for reads and the dashboard.
//!
//! It learns which counter owns which shard from the shard-owners topic ([`owners`]),
//! validates requests and shapes answers ([`api`], [`contributors`]), and sends each
//! request's queries to the counters that own their shards, one call per counter
//! ([`fanout`]). It serves the dashboard ([`dashboard`]) and its data: freshness
//! ([`status`]) and the jobs console's, asked of the dequeue brokers it finds on
//! their membership topic ([`jobs`]).

pub mod after;
pub mod api;
pub mod contributors;
pub mod dashboard;
pub mod error;
pub mod fanout;
pub mod freshness;
pub mod jobs;
pub mod metrics;
pub mod owners;
pub mod read_link;
pub mod segments;
pub mod standbys;
pub mod status;

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tally_shared::auth::Role;
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{wait_for_topic, TopicNames};
use tally_shared::membership::{self, Membership};
use tally_shared::telemetry::{serve_admin, Readiness};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::{Error, Result};

/// How long a call to a counter, the graph or a broker may take, all told.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the query service until `shutdown`.
pub async fn run(config: TallyConfig, shutdown: CancellationToken) -> Result<()> {
    let registry = Registry::new();
    let metrics = metrics::Metrics::new(&registry);
    let readiness = Readiness::default();
    let admin = serve_admin(&config.query.admin_listen, registry, readiness.clone(), shutdown.clone()).await?;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let shards = wait_for_topic(&config.kafka, &names.shards(), Duration::from_secs(60)).await?;

    let owners = Arc::new(tally_shared::claims::ClaimTable::default());
    let follower = owners::follow(&config.kafka, &names.shard_owners(), owners.clone(), shutdown.clone())?;
    let tracked =
        tokio::spawn(owners::track_readiness(owners.clone(), shards, readiness.clone(), shutdown.clone(), follower));
    // Every call to a counter, tally-graph or a broker carries the cluster token
    // (a broker's dead-job routes get the caller's operator token instead).
    let mut cluster = reqwest::header::HeaderMap::new();
    if let Some(bearer) = config.auth.bearer(Role::Cluster) {
        let value = reqwest::header::HeaderValue::from_str(&bearer).map_err(|err| Error::Internal(err.to_string()))?;
        cluster.insert(reqwest::header::AUTHORIZATION, value);
    }
    let client = reqwest::Client::builder()
        .default_headers(cluster)
        .timeout(CALL_TIMEOUT)
        .pool_max_idle_per_host(64)
        .build()
        .map_err(|err| Error::Internal(err.to_string()))?;
    // The dequeue brokers, for the jobs console (created by `tally topics apply`
    // with the other topics).
    wait_for_topic(&config.kafka, &names.queue_brokers(), Duration::from_secs(60)).await?;
    let membership = Arc::new(Membership::default());
    let broker_follower = membership::follow(
        &config.kafka,
        "query-brokers",
        &names.queue_brokers(),
        membership.clone(),
        shutdown.clone(),
    )?;
    let brokers = jobs::Brokers::new(membership, config.broker.member_timeout_ms);
    let standbys = Arc::new(standbys::Standbys::default());
    let seen = Arc::new(freshness::Seen::default());
    let watch = (seen.clone(), metrics.shard_staleness_seconds.clone());
    standbys.clone().refresh(owners.clone(), client.clone(), shards, watch, shutdown.clone());
    let state = Arc::new(api::ApiState {
        brokers,
        fanout: fanout::Fanout {
            owners,
            client,
            links: config
                .query
                .read_link
                .then(|| read_link::Links::new(CALL_TIMEOUT).authorized(config.auth.bearer(Role::Cluster))),
            shards,
            owner_wait: Duration::from_millis(config.query.owner_wait_ms),
            seen,
            ends: Some(after::LogEnds::new(&config.kafka, names.shards(), shards)?),
            token_waits: metrics.token_wait_seconds.clone(),
            standbys,
        },
        metrics,
        auth: config.auth.clone(),
        max_batch: config.query.max_batch,
        dimensions: config.counting.dimensions()?,
    });
    let listener = TcpListener::bind(&config.query.listen).await?;
    let addr = listener.local_addr()?;
    tracing::info!(api = %addr, admin = %admin, shards, "tally-query serving");
    tally_shared::http::serve(listener, api::router(state), shutdown.clone()).await?;
    shutdown.cancel();
    match tokio::task::spawn_blocking(move || broker_follower.join()).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => tracing::warn!("the dequeue brokers' follower panicked"),
        Err(err) => tracing::warn!(error = %err, "joining the dequeue brokers' follower"),
    }
    match tracked.await {
        Ok(false) => Ok(()),
        _ => Err(Error::Internal("the shard-owners follower stopped unexpectedly".into())),
    }
}
