//! The consumer thread: owns the shards the counters' membership gives it (or every
//! shard, statically), applies batches ([`crate::batch`]), announces ownership, and
//! starts and watches the counter's other threads.
//!
//! It is a plain thread over a `BaseConsumer`, not an async task: applying a batch is
//! CPU and RocksDB work that must not block the async runtime. Taking and dropping
//! shards is the consumer context's ([`crate::context`]); a shard is served once it
//! caught up with the log.
//!
//! **Threads.** `counter-apply` (this loop: polls, applies with up to
//! `counter.apply_threads - 1` helper threads per batch, relays outboxes, claims
//! and releases shards); `counter-membership`, `counter-claims` and `heartbeat`
//! (who owns what: [`crate::ownership`]); `counter-rollups` ([`crate::rollups`]);
//! `counter-lag` (lag per shard, a recreated topic); `counter-snapshots`
//! ([`crate::snapshots`]); `counter-flushes` ([`crate::flushes`]); and the read API's and
//! read link's runtime threads ([`crate::http`], [`crate::read_link`]). They
//! share state only through [`crate::shards::Shards`] and each shard's
//! [`crate::store::ShardStore`], whose doc comments give their lock order; every
//! lock is taken through [`tally_shared::lock`]. A watched thread that ends before
//! shutdown stops the counter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use tally_shared::announce::{Announcer, HEARTBEAT};
use tally_shared::config::TallyConfig;
use tally_shared::consume::{drive, AdvisoryCommits, BatchLimits, LoopSetup, Polled, Processor};
use tally_shared::failures::Failure;
use tally_shared::idle::HelperGauge;
use tally_shared::kafka::{now_ms, TopicNames};
use tally_shared::lag::{spawn_lag_reporter, Lag};
use tally_shared::outbox::Relay;
use tally_shared::snapshot::SnapshotStore;
use tally_shared::store::Durability;
use tally_shared::telemetry::Readiness;
use tokio_util::sync::CancellationToken;

use crate::batch::{apply_batch, batch_span};
use crate::context::CounterContext;
use crate::error::{Error, Result};
use crate::late::LateRecords;
use crate::metrics::Metrics;
use crate::ownership::{Change, Ownership, Watched};
use crate::relay::relay_outboxes;
use crate::rollups::Rollups;
use crate::shards::{Roles, Shards};
use crate::snapshots::{ShardSnapshots, SNAPSHOT_CHECK};
use crate::store::tables::BlockCache;
use crate::store::{ShardStore, StoreOptions};

/// Everything the consumer thread needs.
pub struct ConsumerSetup {
    pub config: TallyConfig,
    pub shards: Arc<Shards>,
    pub metrics: Metrics,
    /// Ready while this counter owns shards and has announced them.
    pub readiness: Readiness,
    /// Partitions of the shard topic: where a descendant's totals live.
    pub shard_count: u32,
    /// Announced as the read address of owned shards.
    pub read_addr: String,
    /// Where shard snapshots are kept (`None`: snapshots off).
    pub snapshots: Option<SnapshotStore>,
    /// The service's metrics registry (the snapshot gauges go in it).
    pub registry: prometheus::Registry,
    /// How the shard stores' commits survive a crash (from the config and the shard
    /// topic's retention: [`tally_shared::config::CounterConfig::durability`]).
    pub durability: Durability,
}

/// The shard consumer's settings: the data path's ([`tally_shared::kafka::consumer_config`])
/// with the counter's own group, offsets it stores itself, and its own fetch wait
/// (`counter.fetch_wait_ms`, over `kafka.client`'s): how soon it sees what the
/// ingester wrote, on a broker that holds every fetch for its whole wait.
fn shard_consumer_config(config: &TallyConfig) -> Result<rdkafka::ClientConfig> {
    let mut consumer_config = tally_shared::kafka::consumer_config(&config.kafka)?;
    consumer_config
        .set("group.id", &config.counter.group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", config.counter.fetch_wait_ms.to_string());
    Ok(consumer_config)
}

/// Runs until `shutdown`; finishes and persists the batch in hand before returning.
pub fn run(setup: ConsumerSetup, shutdown: CancellationToken) -> Result<()> {
    let ConsumerSetup { config, shards, metrics, readiness, read_addr, shard_count, snapshots, registry, durability } =
        setup;
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let shard_topic = names.shards();
    let resolutions = config.counting.resolutions()?;
    let context = CounterContext {
        shards: shards.clone(),
        opened: Mutex::new(HashMap::new()),
        data_dir: config.counter.data_dir.clone(),
        store_options: StoreOptions {
            resolutions: resolutions.clone(),
            dedupe_window_ms: config.counting.dedupe_window_ms()?,
            durability,
            shards: shard_count,
            record_budget: config.kafka.record_budget(),
            direct_cache_bytes: config.counter.direct_cache_bytes,
            max_segment_combinations: config.counting.max_segment_combinations,
            increments_topic: names.increments(),
            block_cache: BlockCache::new(config.counter.block_cache_bytes)?,
            ..StoreOptions::default()
        },
        snapshots: snapshots.clone(),
        topic: shard_topic.clone(),
        metrics: metrics.clone(),
    };
    let consumer: BaseConsumer<CounterContext> = shard_consumer_config(&config)?.create_with_context(context)?;
    let mut threads = Vec::new();
    // Cancelled once this counter stopped acting as an owner: then it says it leaves.
    let leave = CancellationToken::new();
    let ownership = match config.counter.static_assignment {
        true => {
            let all = Roles { owned: (0..shard_count).collect(), standby: Vec::new() };
            consumer.context().assign(&consumer, &all)?;
            None
        }
        false => {
            let joined = Ownership::join(&config, &read_addr, shards.lease.clone(), shard_count, &leave, &shutdown)?;
            threads.extend(joined.1);
            Some(joined.0)
        }
    };
    let announcer = Announcer::new(&config.kafka, names.shard_owners(), read_addr)?;
    let rollups = match config.counter.rollups {
        true => {
            let interval = Duration::from_millis(config.counter.rollup_interval_ms);
            let rollups = Arc::new(Rollups::new(&config.kafka, names.rollups(), resolutions.clone(), interval)?);
            let thread = rollups.clone().spawn(shards.clone(), metrics.clone(), shutdown.clone())?;
            threads.push(("rollups", thread));
            Some(rollups)
        }
        false => None,
    };

    let letters = Arc::new(Relay::unstamped(&config.kafka, names.dead_letter())?);
    let lag_shards = shards.clone();
    let lag_shards_reported = shards.clone();
    let lag_metrics = metrics.clone();
    let lag_group = config.counter.group_id.clone();
    let lag_failures = shards.failures.clone();
    let lag_reporter = spawn_lag_reporter(
        &config.kafka,
        "counter-lag",
        shard_topic.clone(),
        HEARTBEAT,
        shutdown.clone(),
        move || {
            let held = lag_shards.stores().into_iter();
            held.filter_map(|shard| Some((shard, lag_shards.get(shard)?.next_offset().unwrap_or(0)))).collect()
        },
        // Owned shards only (a standby's store is watched for a recreated topic, not
        // reported): a shard moved away meanwhile is not set again.
        move |shard, lag: Lag| {
            if lag_shards_reported.standbys().contains(&shard) || lag_shards_reported.get(shard).is_none() {
                return;
            }
            let shard_label = shard.to_string();
            lag_metrics.consumer_lag.with_label_values(&[&shard_label]).set(lag.records);
            if let Some(seconds) = lag.seconds {
                lag_metrics.consumer_lag_seconds.with_label_values(&[&lag_group, &shard_label]).set(seconds);
            }
            lag_shards_reported.record_lag(shard, lag.records);
        },
        // A shard topic deleted and recreated under the counter: the shard stops.
        move |shard, offset, reason| {
            if !lag_failures.is_failed(shard) {
                lag_failures.fail(shard, Failure { offset: Some(offset), reason, record: None });
            }
        },
    )?;
    threads.push(("lag reporter", lag_reporter));
    if let Some(snapshots) = snapshots {
        let snapshotter = ShardSnapshots::new(snapshots, &config, shards.clone(), metrics.clone(), &registry);
        let every =
            tally_shared::shutdown::every("counter-snapshots", SNAPSHOT_CHECK, shutdown.clone(), snapshotter.run());
        threads.push(("snapshots", every?));
    }
    // Flushes wait for RocksDB and hold a store's commit lock: off this loop.
    if let Some(flushes) =
        crate::flushes::spawn(shards.clone(), metrics.clone(), durability, HEARTBEAT, shutdown.clone())?
    {
        threads.push(("flushes", flushes));
    }
    let setup = LoopSetup {
        topic: &shard_topic,
        limits: BatchLimits {
            max_records: config.counter.batch_max_records,
            max_bytes: config.counter.batch_max_bytes,
            // A packed record counts as what it unpacks to: the bound is on memory.
            payload_bytes: tally_core::wire::packed::unpacked_len,
            linger: Duration::from_millis(config.counter.batch_linger_ms),
            max_linger: Duration::from_millis(config.counter.batch_max_linger_ms),
            quiet: BatchLimits::quiet_for(config.counter.fetch_wait()),
        },
        failures: &shards.failures,
        letters: &letters,
        record_budget: config.kafka.record_budget(),
        heartbeat: HEARTBEAT,
        resting: metrics.fetch_resting.clone(),
    };
    let mut counter = Counter {
        group: config.counter.group_id.clone(),
        epoch: shards.epoch(),
        helpers: HelperGauge::new(config.counter.apply_threads.saturating_sub(1)),
        shards: shards.clone(),
        metrics,
        readiness,
        announcer,
        rollups,
        relay: Relay::new(&config.kafka, shard_topic.clone())?,
        letters: letters.clone(),
        topic: shard_topic.clone(),
        serving: Vec::new(),
        outbox_written: 0,
        moved: false,
        advisory: AdvisoryCommits::default(),
        threads,
        ownership,
        shard_count,
        shutdown: shutdown.clone(),
        leave,
        late_budget: config.counter.batch_max_bytes,
        repositioned: false,
        freshness_sampled: std::time::Instant::now(),
    };
    // Only this loop runs nicer: the helpers started above (the membership's
    // heartbeats among them), the Kafka clients and RocksDB's threads (started here
    // when no store was opened yet) keep their priority.
    ShardStore::start_background_threads()?;
    match tally_shared::sched::lower_priority(config.counter.apply_nice) {
        Ok(nice) => tracing::info!(nice, "applying batches"),
        Err(err) => tracing::warn!(error = %err, "the apply thread keeps its priority"),
    }
    let result = drive(&consumer, &setup, &mut counter, &shutdown);
    // Stopping for good (also after an error): the helper threads end with it.
    shutdown.cancel();
    counter.stop();
    result
}

/// The counter's part of the consume loop ([`drive`]): applying batches shard by
/// shard, and with the turns its claims, readiness, outbox relays and rollups.
struct Counter {
    shards: Arc<Shards>,
    metrics: Metrics,
    readiness: Readiness,
    announcer: Announcer,
    /// Published by a thread of their own; here for its producer's health.
    rollups: Option<Arc<Rollups>>,
    /// Sends the shards' outboxes (totals for other shards).
    relay: Relay,
    /// Sends owned shards' dead letters (and skipped records, from the consume loop).
    letters: Arc<Relay>,
    topic: String,
    /// The assignment last seen ([`Shards::epoch`]).
    epoch: u64,
    /// How many helper threads apply a batch's shards beside the loop: up to
    /// `counter.apply_threads - 1`, as cores sat idle while the batch gathered.
    helpers: HelperGauge,
    /// The shards last announced.
    serving: Vec<u32>,
    /// Outbox messages written since the last relay.
    outbox_written: u64,
    /// Whether a store moved since readers waiting for positions were last woken
    /// (a batch applied, an outbox relayed, shards taken or served).
    moved: bool,
    /// The group's offsets, committed now and then for lag tooling.
    advisory: AdvisoryCommits,
    /// Watched: one that ends before shutdown (a panic) stops the counter.
    threads: Watched,
    /// Which shards to own (`None`: every shard, statically).
    ownership: Option<Ownership>,
    shard_count: u32,
    /// The consumer group (a label of the lag in seconds).
    group: String,
    shutdown: CancellationToken,
    /// Tells the heartbeat to say this counter leaves ([`Counter::stop`]).
    leave: CancellationToken,
    /// Bytes (unpacked) a batch may poll while it applies ([`LateRecords`]).
    late_budget: usize,
    /// The last turn assigned shards anew ([`Processor::repositioned`]).
    repositioned: bool,
    /// When the shards' freshness was last sampled for the histogram.
    freshness_sampled: std::time::Instant,
}

impl Processor<CounterContext> for Counter {
    type Error = Error;

    fn positions_reset(&self) -> bool {
        self.shards.epoch() != self.epoch
    }

    fn repositioned(&mut self) -> bool {
        std::mem::take(&mut self.repositioned)
    }

    fn next_offsets(&self) -> Vec<(u32, i64)> {
        let held = self.shards.stores().into_iter();
        held.filter_map(|shard| Some((shard, self.shards.get(shard)?.next_offset()?))).collect()
    }

    fn apply(
        &mut self,
        consumer: &BaseConsumer<CounterContext>,
        batch: &[Polled],
        carried: &mut Vec<Polled>,
    ) -> Vec<u32> {
        let threads = 1 + self.helpers.starting();
        let shards_in_batch = batch.iter().map(|polled| polled.partition as u32);
        let late =
            LateRecords::new(consumer, shards_in_batch, self.late_budget, tally_core::wire::packed::unpacked_len);
        let helpers = &mut self.helpers;
        let started = tally_core::trace::now_unix_nanos();
        let (written, failed) = apply_batch(
            batch,
            Some(&late),
            &self.shards,
            &self.metrics,
            self.rollups.is_some(),
            (threads, |running| helpers.joining(running)),
        );
        *carried = late.into_carried();
        if tally_shared::otel::enabled() {
            if let Some(span) = batch_span(&self.topic, &self.group, started, batch, &failed) {
                tally_shared::otel::record(span);
            }
        }
        self.helpers.done();
        self.outbox_written += written;
        self.moved = true;
        failed
    }

    fn skip_record(&mut self, shard: u32, offset: i64) -> tally_shared::Result<()> {
        let store = self
            .shards
            .get(shard)
            .ok_or_else(|| tally_shared::Error::Skip(format!("shard {shard} is not owned here")))?;
        store.store.skip_record(offset)
    }

    fn turn(&mut self, consumer: &BaseConsumer<CounterContext>, skipped: u64, heartbeat: bool) -> Result<()> {
        self.metrics.skipped_records.inc_by(skipped);
        self.reassign(consumer, heartbeat)?;
        let reassigned = self.shards.epoch() != self.epoch;
        if reassigned {
            self.repositioned = true;
            self.epoch = self.shards.epoch();
            let owned = self.shards.owned();
            self.metrics.owned_shards.set(owned.len() as i64);
            // The lag of shards not owned here any more is another counter's to say.
            for shard in (0..self.shard_count).filter(|shard| !owned.contains(shard)) {
                let shard = shard.to_string();
                self.metrics.consumer_lag.remove_label_values(&[&shard]).ok();
                self.metrics.consumer_lag_seconds.remove_label_values(&[&self.group, &shard]).ok();
            }
        }
        let announced = self.shards.announced();
        self.moved |= reassigned || announced != self.serving;
        if reassigned || announced != self.serving {
            // A new assignment, a rebuilt shard that caught up, one that failed or
            // recovered: announced now, not at the next heartbeat.
            self.serving = announced;
            let newest_seen = self.newest_epochs();
            self.announcer.announce(&self.serving, true, newest_seen);
        }
        let conflict = self.ownership.as_ref().and_then(Ownership::conflict);
        report_state(&self.shards, &self.readiness, &self.metrics, conflict, self.ownership.is_some());
        // After a batch or an idle poll, so the last offsets of a load go too.
        self.advisory.commit(consumer, &self.topic, self.next_offsets());
        self.learn_ends(consumer);
        // Right after a batch that wrote totals for other shards; and with every
        // heartbeat, for what a store still held after a restart or a new assignment.
        if self.outbox_written > 0 || heartbeat {
            self.outbox_written = 0;
            self.moved = true;
            if let Err(err) = relay_outboxes((&self.relay, &self.letters), &self.shards, &self.metrics) {
                tracing::warn!(error = %err, "relaying the outbox");
            }
        }
        if std::mem::take(&mut self.moved) {
            self.shards.changed.notify_waiters();
        }
        if heartbeat {
            if let Some((name, _)) = self.threads.iter().find(|(_, thread)| thread.is_finished()) {
                if !self.shutdown.is_cancelled() {
                    return Err(Error::Consumer(format!("the {name} thread stopped unexpectedly")));
                }
            }
            // A producer that hit a fatal error delivers nothing more: stop loudly
            // (the stores hold everything; the next start relays it).
            let rollup_relay = self.rollups.as_ref().map(|r| r.relay());
            let relays = [&self.relay, &*self.letters].into_iter().chain(rollup_relay).find_map(Relay::fatal);
            if let Some(fatal) = relays.or_else(|| self.announcer.fatal()) {
                return Err(Error::Consumer(format!("a producer failed for good: {fatal}")));
            }
            let newest_seen = self.newest_epochs();
            self.announcer.announce(&self.serving, false, newest_seen);
            if let Some(ownership) = &self.ownership {
                for (shard, epoch) in ownership.claims.orphans(&ownership.me.addr, self.announcer.instance()) {
                    self.announcer.release_orphan(shard, epoch);
                }
            }
        }
        Ok(())
    }
}

impl Counter {
    /// Each owned shard's log end as the consumer's last fetch said it
    /// ([`crate::freshness`]), and once a second their lags in the histogram.
    fn learn_ends(&mut self, consumer: &BaseConsumer<CounterContext>) {
        let now = now_ms();
        let sample = self.freshness_sampled.elapsed() >= std::time::Duration::from_secs(1);
        if sample {
            self.freshness_sampled = std::time::Instant::now();
        }
        let standbys = self.shards.standbys();
        for shard in self.shards.stores() {
            let Some(store) = self.shards.get(shard) else { continue };
            if let Some(end) = tally_shared::kafka::cached_high_watermark(consumer, &self.topic, shard as i32) {
                store.freshness.learned_end(end, now);
            }
            if let Some(lag_ms) = store.freshness.as_of(now).lag_ms.filter(|_| sample && !standbys.contains(&shard)) {
                let seconds = lag_ms as f64 / 1000.0;
                self.metrics.freshness_lag.with_label_values(&[&shard.to_string()]).observe(seconds);
            }
        }
    }

    /// Takes and drops shards as ownership says: at once when the lease lapsed
    /// (every shard, then a new tenure); statically, every shard (those whose log
    /// end could not be read are tried again with each heartbeat).
    fn reassign(&mut self, consumer: &BaseConsumer<CounterContext>, heartbeat: bool) -> Result<()> {
        let context = consumer.context();
        let held = self.shards.held();
        let Some(ownership) = self.ownership.as_mut() else {
            if heartbeat && held.owned.len() < self.shard_count as usize {
                let every = Roles { owned: (0..self.shard_count).collect(), standby: Vec::new() };
                context.assign(consumer, &every)?;
            }
            return Ok(());
        };
        let serving = self.shards.serving();
        let catching_up =
            held.owned.iter().any(|shard| !serving.contains(shard) && !self.shards.failures.is_failed(*shard));
        match ownership.change(consumer, &held, catching_up, now_ms()) {
            None => Ok(()),
            Some(Change::Own(wanted)) => {
                tracing::info!(from = ?held, to = ?wanted, "ownership changed");
                context.assign(consumer, &wanted)
            }
            Some(Change::Lapsed) => {
                tracing::warn!(
                    shards = ?held,
                    "this counter's lease lapsed (paused, or cut off from Kafka, too long): dropping every shard, joining again"
                );
                context.assign(consumer, &Roles::default())?;
                // What it queued of the lapsed tenure is not sent: the shards' new
                // owners publish newer values (a record already on the wire carries
                // its older position, and consumers keep the newest).
                if let Some(rollups) = &self.rollups {
                    rollups.relay().purge();
                }
                self.metrics.lapsed_leases.inc();
                ownership.lease.restart();
                Ok(())
            }
        }
    }

    /// The newest claim epoch read for a shard (none with static assignment).
    fn newest_epochs(&self) -> impl Fn(u32) -> Option<i64> {
        let claims = self.ownership.as_ref().map(|ownership| ownership.claims.clone());
        move |shard| claims.as_ref().and_then(|claims| claims.epoch(shard))
    }

    /// After the loop: the outboxes relayed (what fails goes with the next owner),
    /// the lease ended (no more reads or rollups), the shards released, and only
    /// then the heartbeat says this counter leaves.
    fn stop(&mut self) {
        if let Err(err) = relay_outboxes((&self.relay, &self.letters), &self.shards, &self.metrics) {
            tracing::warn!(error = %err, "relaying the outbox before stopping; the next owner sends it");
        }
        for shard in self.shards.stores() {
            if let Some(Err(err)) = self.shards.get(shard).map(|store| store.persist()) {
                tracing::warn!(shard, error = %err, "flushing the store before stopping; the next start replays the log");
            }
        }
        tracing::info!("counter consumer stopping: batch persisted, releasing shards");
        self.readiness.set(false);
        self.shards.lease.end();
        self.announcer.release_all();
        self.leave.cancel();
        for (name, thread) in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!(thread = name, "a counter thread panicked");
            }
        }
    }
}

/// Readiness and the failure gauge from the shards' state; `/readyz` names each
/// failure (and a name another counter uses too). Owning every shard statically:
/// ready while it serves shards and none failed. Among several counters: while its
/// lease holds and every shard it owns is served (none, when the others hold
/// them all, is fine).
fn report_state(shards: &Shards, readiness: &Readiness, metrics: &Metrics, conflict: Option<String>, member: bool) {
    // A failed standby is counted, not a reason to stop taking reads.
    let board = &shards.failures;
    let (failed, standbys) = (board.failed(), shards.standbys());
    metrics.failed_shards.set(failed.len() as i64);
    let mut failures: Vec<String> = (failed.into_iter())
        .filter(|shard| !standbys.contains(shard))
        .filter_map(|shard| Some(board.describe(shard, &board.failure(shard)?)))
        .collect();
    failures.extend(conflict);
    readiness.set_failures(failures);
    let serving = shards.serving();
    for store in shards.stores().into_iter().filter_map(|shard| shards.get(shard)) {
        if let Some(took) = store.take_caught_up() {
            metrics.catch_up_seconds.observe(took.as_secs_f64());
        }
    }
    let ready = match member {
        false => !serving.is_empty(),
        true => shards.lease.valid(now_ms()) && serving == shards.owned(),
    };
    readiness.set(ready);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shard_consumer_waits_the_counters_fetch_wait_over_the_clients() {
        let mut config = TallyConfig::default();
        config.kafka.bootstrap_servers = "127.0.0.1:9".into();
        let wait =
            |config: &TallyConfig| shard_consumer_config(config).unwrap().get("fetch.wait.max.ms").map(String::from);
        assert_eq!(wait(&config), Some("50".to_string()));
        config.kafka.client.insert("fetch.wait.max.ms".into(), "500".into());
        config.counter.fetch_wait_ms = 20;
        assert_eq!(wait(&config), Some("20".to_string()));
        // The other data-path consumers keep the client's.
        let data_path = tally_shared::kafka::consumer_config(&config.kafka).unwrap();
        assert_eq!(data_path.get("fetch.wait.max.ms"), Some("500"));
    }
}
