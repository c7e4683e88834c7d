//! `tally-broker`: a dequeue broker (Pinterest's Pacer on Kafka).
//!
//! - which brokers are alive: heartbeats on `tally.queue-brokers`
//!   ([`tally_shared::membership`]); every broker derives the same partition owners
//!   from it;
//! - [`fetcher`]: serves the partitions this broker owns: fetches them into bounded
//!   buffers and commits watermarks that never pass an unfinished job;
//! - [`state`]: the queues and their buffers: dequeue, ack, nack, extend, expiry,
//!   dead jobs;
//! - [`declarations`]: follows the declarations topic, so queues declared or
//!   changed while it runs are served without a restart;
//! - [`placement`]: which partition a keyed job lives in, and the unique keys a
//!   take-over replays;
//! - [`scheduler`]: enqueues the ticks of the queues' schedules, one job each;
//! - [`cancels`]: follows operators' cancellations, so a cancelled job never runs
//!   on any broker;
//! - [`lease`]: lease tokens no worker can forge (an HMAC under a per-process key);
//! - [`http`]: the worker API; [`cancel`]: cancelling a job; [`metrics`]: what it
//!   exports.

pub mod cancel;
pub mod cancels;
pub mod dead;
pub mod declarations;
pub mod error;
pub mod fetcher;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod placement;
pub mod scheduler;
pub mod state;

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use rdkafka::producer::FutureProducer;
use tally_core::assignment::Member;
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{unstamped_producer_config, wait_for_topic, TopicNames};
use tally_shared::membership::{self, Lease, Membership};
use tally_shared::telemetry::{serve_admin, Readiness};
use tally_shared::topics::Declarations;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::{Error, Result};

/// Runs a broker until `shutdown`: it stops serving, commits its watermarks and
/// tells the others it is leaving.
pub async fn run(config: TallyConfig, shutdown: CancellationToken) -> Result<()> {
    let registry = Registry::new();
    let metrics = metrics::Metrics::new(&registry);
    let readiness = Readiness::default();
    let admin = serve_admin(&config.broker.admin_listen, registry, readiness.clone(), shutdown.clone()).await?;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let mut declarations = Declarations::load(config.broker.declarations.as_deref())?;
    for decl in &mut declarations.queues {
        let topic = names.jobs(&decl.name);
        let partitions = wait_for_topic(&config.kafka, &topic, Duration::from_secs(60)).await.map_err(|err| {
            let file = config.broker.declarations.as_ref().map_or("the built-in declarations".into(), |p| p.display().to_string());
            Error::Broker(format!(
                "queue {}: {err}; it is declared in {file}: run `tally topics apply` with this config to create its topics",
                decl.name
            ))
        })?;
        // Every partition of the topic is served, whatever was declared.
        decl.partitions = decl.partitions.max(partitions as i32);
    }
    wait_for_topic(&config.kafka, &names.queue_brokers(), Duration::from_secs(60)).await?;

    let listener = TcpListener::bind(&config.broker.listen).await?;
    let addr = tally_shared::service::advertised_addr(listener.local_addr()?, config.broker.advertise_host.as_deref());
    let instance = format!("{:016x}", rand::random::<u64>());
    // Dead jobs carry no stamps and are retried until written.
    let dead_producer: FutureProducer = unstamped_producer_config(&config.kafka)?.create()?;
    let broker = Arc::new(state::Broker::new(instance.clone(), metrics, dead_producer, config.kafka.record_budget())?);
    for decl in declarations.queues {
        broker.declare(decl, &names);
    }
    let served: Vec<String> = broker.queues().iter().map(|q| q.name.clone()).collect();
    tracing::info!(api = %addr, admin = %admin, instance, queues = ?served, "tally-broker starting");

    let membership = Arc::new(Membership::default());
    let member = Member { instance: instance.clone(), addr };
    let every = Duration::from_millis(config.broker.heartbeat_ms.max(50));
    // Brokers fence nothing by lease: a partition's jobs are leased to workers, and a
    // job finished twice is what at-least-once allows.
    let lease = Arc::new(Lease::forever());
    let heartbeat =
        membership::heartbeat(&config.kafka, names.queue_brokers(), member, every, lease, shutdown.clone())?;
    let follower = membership::follow(
        &config.kafka,
        "broker-membership",
        &names.queue_brokers(),
        membership.clone(),
        shutdown.clone(),
    )?;
    wait_for_topic(&config.kafka, &names.queues(), Duration::from_secs(60)).await?;
    let declared = declarations::follow(&config.kafka, broker.clone(), names.clone(), shutdown.clone())?;
    // Every cancellation is known before the first job is fetched.
    wait_for_topic(&config.kafka, &names.jobs_cancelled(), Duration::from_secs(60)).await?;
    let cancels = {
        let (kafka, broker, names, shutdown) = (config.kafka.clone(), broker.clone(), names.clone(), shutdown.clone());
        tokio::task::spawn_blocking(move || cancels::load_and_follow(&kafka, broker, &names, shutdown))
            .await
            .map_err(|err| Error::Broker(err.to_string()))??
    };

    tokio::spawn(scheduler::run(broker.clone(), shutdown.clone()));
    let expiry_broker = broker.clone();
    let expiry_shutdown = shutdown.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        while !expiry_shutdown.is_cancelled() {
            tick.tick().await;
            expiry_broker.expire_leases();
        }
    });

    let dead = Arc::new(tally_shared::dead_jobs::DeadJobs::new(&config.kafka, names.clone())?);
    let http_client = reqwest::Client::builder().build().map_err(|err| Error::Broker(err.to_string()))?;
    let api = http::router(http::ApiState {
        broker: broker.clone(),
        auth: config.auth.clone(),
        dead,
        names: names.clone(),
        http: http_client,
    });
    tally_shared::http::spawn_serve("worker API", listener, api, shutdown.clone());
    let timeout_ms = config.broker.member_timeout_ms;
    let watched = [heartbeat, follower, declared, cancels];
    let watchdog = watch(watched, membership.clone(), instance, timeout_ms, readiness.clone(), shutdown.clone());

    let setup = fetcher::FetcherSetup { config, broker, membership };
    let fetcher_shutdown = shutdown.clone();
    let result = tally_shared::sched::spawn_background("broker-fetcher", move || fetcher::run(setup, fetcher_shutdown))
        .await
        .map_err(Error::Broker)?;
    shutdown.cancel();
    readiness.set(false);
    let died = watchdog.await.map_err(|err| Error::Broker(err.to_string()))?;
    tracing::info!("tally-broker stopped");
    match died {
        Some(thread) => Err(Error::Broker(format!("the {thread} thread stopped unexpectedly"))),
        None => result,
    }
}

/// Readiness from the broker's real state — it sees its own heartbeat among the
/// live members, and its heartbeat, membership, declarations and cancels threads run — and
/// a stop of the whole broker (with the thread's name) when one of those threads
/// ends before shutdown, a panic included. Joins them at shutdown.
fn watch(
    threads: [std::thread::JoinHandle<()>; 4],
    membership: Arc<Membership>,
    instance: String,
    timeout_ms: u64,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<Option<&'static str>> {
    const NAMES: [&str; 4] = ["heartbeat", "membership", "declarations", "cancels"];
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let died = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break None,
                _ = tick.tick() => {}
            }
            if let Some(index) = threads.iter().position(|thread| thread.is_finished()) {
                tracing::error!(thread = NAMES[index], "a broker thread stopped unexpectedly; stopping the broker");
                shutdown.cancel();
                break Some(NAMES[index]);
            }
            let now = tally_shared::kafka::now_ms();
            let live = membership.live_as_seen_by(&instance, now, timeout_ms);
            readiness.set(live.iter().any(|member| member.instance == instance));
        };
        readiness.set(false);
        let joined = tokio::task::spawn_blocking(move || {
            for (thread, name) in threads.into_iter().zip(NAMES) {
                if thread.join().is_err() {
                    tracing::error!(thread = name, "a broker thread panicked");
                }
            }
        })
        .await;
        if let Err(err) = joined {
            tracing::warn!(error = %err, "joining the broker threads");
        }
        died
    })
}
