//! The consumer thread: owns the shards the counters' membership gives it (or every
//! shard, statically), applies batches, announces ownership, publishes rollups.
//!
//! It is a plain thread over a `BaseConsumer`, not an async task: applying a batch is
//! CPU and RocksDB work that must not block the async runtime. When a shard is
//! taken its store is opened (restored from a snapshot when there is none) and the
//! partition starts at the store's `next_offset` (the group's committed offset is
//! only advisory, for lag tooling); it is served once it caught up with the log.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientContext;
use tally_shared::announce::{Announcer, HEARTBEAT};
use tally_shared::config::TallyConfig;
use tally_shared::consume::{
    ahead_of_log, committed_offsets, drive, spawn_lag_reporter, unreplayable, AdvisoryCommits, BatchLimits, LogCheck,
    LoopSetup, Polled, Processor,
};
use tally_shared::failures::Failure;
use tally_shared::idle::HelperGauge;
use tally_shared::kafka::{now_ms, TopicNames};
use tally_shared::outbox::Relay;
use tally_shared::snapshot::{clear_restored_marker, restored_marker, SnapshotStore, Snapshotter};
use tally_shared::store::Durability;
use tally_shared::telemetry::Readiness;
use tokio_util::sync::CancellationToken;

use crate::apply::{ApplyReport, ShardRecord};
use crate::error::{Error, Result};
use crate::late::LateRecords;
use crate::metrics::Metrics;
use crate::ownership::{Change, Ownership, Watched};
use crate::relay::relay_outboxes;
use crate::rollups::Rollups;
use crate::shards::Shards;
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
    /// How the shard stores' commits survive a crash (from the config and the shard
    /// topic's retention: [`tally_shared::config::CounterConfig::durability`]).
    pub durability: Durability,
}

struct CounterContext {
    shards: Arc<Shards>,
    /// Stores stay open across rebalances: the same shard usually comes back.
    opened: Mutex<HashMap<u32, Arc<ShardStore>>>,
    data_dir: PathBuf,
    store_options: StoreOptions,
    /// Where a shard without a store restores from.
    snapshots: Option<SnapshotStore>,
    /// The shard topic (the snapshots' namespace).
    topic: String,
    metrics: Metrics,
}

impl CounterContext {
    /// The shard's store, and whether it was restored from a snapshot just now.
    fn open(&self, shard: u32) -> Result<(Arc<ShardStore>, bool)> {
        let mut opened = self.opened.lock().map_err(|_| Error::Consumer("store table poisoned".into()))?;
        if let Some(store) = opened.get(&shard) {
            return Ok((store.clone(), false));
        }
        let path = self.data_dir.join(store_dir(shard));
        if let Some(snapshots) = self.snapshots.as_ref().filter(|_| !path.exists()) {
            self.restore(snapshots, shard, &path)?;
        }
        // Restored just now, or by an operator (`tally restore`), or before a crash
        // that came before its wait was persisted: the mark says so until then.
        let restored = restored_marker(&path).exists();
        let store = Arc::new(ShardStore::open(shard, &path, self.store_options.clone())?);
        tracing::info!(shard, path = %path.display(), next_offset = ?store.next_offset(), restored, "opened shard store");
        opened.insert(shard, store.clone());
        Ok((store, restored))
    }

    /// Replaces this process's copy of `shard` — kept from an earlier tenure, and
    /// behind what the log still holds — with the newest snapshot, if that one
    /// reaches offset `needed` and the copy is not in use; otherwise the copy stays
    /// (and is refused by the caller's check).
    fn restore_over(&self, shard: u32, needed: i64) -> Result<(Arc<ShardStore>, bool)> {
        let Some(snapshots) = self.snapshots.as_ref() else { return self.open(shard) };
        let newest = snapshots.latest(&snapshot_name(&self.topic, shard))?;
        if newest.is_none_or(|manifest| manifest.next_offset.unwrap_or(0) < needed) {
            return self.open(shard);
        }
        {
            let mut opened = self.opened.lock().map_err(|_| Error::Consumer("store table poisoned".into()))?;
            match opened.remove(&shard) {
                // Still used (a snapshot being taken): tried again at the next assignment.
                Some(copy) if Arc::strong_count(&copy) > 1 => {
                    opened.insert(shard, copy);
                    drop(opened);
                    return self.open(shard);
                }
                _ => {}
            }
        }
        let path = self.data_dir.join(store_dir(shard));
        tracing::info!(shard, path = %path.display(), needed, "replacing a copy of the shard the log no longer reaches with its newest snapshot");
        std::fs::remove_dir_all(&path)?;
        self.open(shard)
    }

    /// Restores the newest snapshot of `shard` into `path` (where no store is);
    /// whether there was one.
    fn restore(&self, snapshots: &SnapshotStore, shard: u32, path: &std::path::Path) -> Result<()> {
        if Snapshotter::restore_latest(snapshots, &snapshot_name(&self.topic, shard), path)?.is_some() {
            self.metrics.restored_shards.inc();
        }
        Ok(())
    }

    /// Takes exactly the shards `wanted`: opens their stores, positions each at its
    /// store's next offset, assigns them and publishes the new ownership. A store
    /// that does not open (corrupt, or of another format) fails its shard, not the
    /// process; a shard whose log end cannot be read now is left out (ownership
    /// asks again).
    fn assign(&self, consumer: &BaseConsumer<Self>, wanted: &[u32]) -> Result<()> {
        // Served in the assignment before (a shard that failed to open or to be
        // checked was not: it is gated like a new one when it comes back).
        let before = self.shards.owned();
        let committed = committed_offsets(consumer, &self.topic, wanted);
        let topic_id = tally_shared::topic_id::current(consumer.client(), &self.topic);
        let mut stores = HashMap::new();
        let mut failures = BTreeMap::new();
        let mut assigned = TopicPartitionList::new();
        for &shard in wanted {
            let partition = shard as i32;
            let (start, end) = match consumer.fetch_watermarks(&self.topic, partition, Duration::from_secs(10)) {
                Ok(watermarks) => watermarks,
                Err(err) => {
                    tracing::warn!(shard, error = %err, "reading the shard's log end; taking it later");
                    continue;
                }
            };
            let committed = committed.get(&shard).copied();
            let check = |store: &ShardStore| {
                unreplayable(LogCheck { next: store.next_offset(), log_start: start, log_end: end, committed })
            };
            let opened = self.open(shard).and_then(|(store, restored)| {
                if check(&store).is_none() || before.contains(&shard) {
                    return Ok((store, restored));
                }
                // A copy kept from an earlier tenure that the log no longer reaches:
                // the newest snapshot may.
                drop(store);
                self.restore_over(shard, start.max(committed.unwrap_or(0)))
            });
            let (store, restored) = match opened {
                Ok(opened) => opened,
                Err(err) => {
                    let reason = format!("opening its store: {err}");
                    failures.insert(shard, Failure { offset: None, reason, record: None });
                    continue;
                }
            };
            if let Some((offset, reason)) = check(&store).or_else(|| ahead_of_log(store.next_offset(), end)) {
                failures.insert(shard, Failure { offset: Some(offset), reason, record: None });
                continue;
            }
            match tally_shared::topic_id::check_store(&store.store, &self.topic, topic_id.as_deref()) {
                Ok(None) => {}
                Ok(Some(reason)) => {
                    failures.insert(shard, Failure { offset: store.next_offset(), reason, record: None });
                    continue;
                }
                Err(err) => {
                    let reason = format!("checking its store's topic id: {err}");
                    failures.insert(shard, Failure { offset: None, reason, record: None });
                    continue;
                }
            }
            if !before.contains(&shard) || store.next_offset().is_none() || restored {
                // Newly taken — built from scratch, restored from a snapshot, or kept
                // from an earlier tenure — or restarted: not served until it caught up
                // with the log as it is now, so it never answers older than its
                // previous owner did (nor partially).
                store.rebuild_until(end)?;
                // The wait is persisted: an operator's restore mark has done its job.
                clear_restored_marker(&self.data_dir.join(store_dir(shard)))?;
                if store.next_offset().is_none_or(|next| next < end) {
                    tracing::info!(shard, end, next_offset = ?store.next_offset(), "catching up with the shard's log; served once caught up");
                }
            }
            let offset = store.next_offset().map_or(Offset::Beginning, Offset::Offset);
            assigned.add_partition_offset(&self.topic, partition, offset)?;
            stores.insert(shard, store);
        }
        consumer.assign(&assigned)?;
        // librdkafka keeps a partition paused across assignments; a shard that
        // failed before comes back unpaused (and fails again if its record does).
        consumer.resume(&assigned)?;
        tracing::info!(shards = ?stores.keys().collect::<std::collections::BTreeSet<_>>(), "shards assigned");
        self.shards.replace(stores, failures);
        Ok(())
    }
}

impl ClientContext for CounterContext {}

impl ConsumerContext for CounterContext {}

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
    let ConsumerSetup { config, shards, metrics, readiness, read_addr, shard_count, snapshots, durability } = setup;
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
            let all: Vec<u32> = (0..shard_count).collect();
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

    let letters = Relay::unstamped(&config.kafka, names.dead_letter())?;
    let lag_shards = shards.clone();
    let lag_shards_reported = shards.clone();
    let lag_metrics = metrics.clone();
    let lag_failures = shards.failures.clone();
    let lag_reporter = spawn_lag_reporter(
        &config.kafka,
        "counter-lag",
        shard_topic.clone(),
        HEARTBEAT,
        shutdown.clone(),
        move || {
            let owned = lag_shards.owned().into_iter();
            owned.filter_map(|shard| Some((shard, lag_shards.get(shard)?.next_offset().unwrap_or(0)))).collect()
        },
        move |shard, lag| {
            lag_metrics.consumer_lag.with_label_values(&[&shard.to_string()]).set(lag);
            lag_shards_reported.record_lag(shard, lag);
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
        let snapshotter = ShardSnapshots::new(snapshots, &config, shards.clone(), metrics.clone());
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
            payload_bytes: tally_core::packed::unpacked_len,
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
        epoch: shards.epoch(),
        helpers: HelperGauge::new(config.counter.apply_threads.saturating_sub(1)),
        shards: shards.clone(),
        metrics,
        readiness,
        announcer,
        rollups,
        relay: Relay::new(&config.kafka, shard_topic.clone())?,
        topic: shard_topic.clone(),
        serving: Vec::new(),
        outbox_written: 0,
        advisory: AdvisoryCommits::default(),
        threads,
        ownership,
        shard_count,
        shutdown: shutdown.clone(),
        leave,
        late_budget: config.counter.batch_max_bytes,
        repositioned: false,
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
    /// The group's offsets, committed now and then for lag tooling.
    advisory: AdvisoryCommits,
    /// Watched: one that ends before shutdown (a panic) stops the counter.
    threads: Watched,
    /// Which shards to own (`None`: every shard, statically).
    ownership: Option<Ownership>,
    shard_count: u32,
    shutdown: CancellationToken,
    /// Tells the heartbeat to say this counter leaves ([`Counter::stop`]).
    leave: CancellationToken,
    /// Bytes (unpacked) a batch may poll while it applies ([`LateRecords`]).
    late_budget: usize,
    /// The last turn assigned shards anew ([`Processor::repositioned`]).
    repositioned: bool,
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
        let owned = self.shards.owned().into_iter();
        owned.filter_map(|shard| Some((shard, self.shards.get(shard)?.next_offset()?))).collect()
    }

    fn apply(
        &mut self,
        consumer: &BaseConsumer<CounterContext>,
        batch: &[Polled],
        carried: &mut Vec<Polled>,
    ) -> Vec<u32> {
        let threads = 1 + self.helpers.starting();
        let shards_in_batch = batch.iter().map(|polled| polled.partition as u32);
        let late = LateRecords::new(consumer, shards_in_batch, self.late_budget, tally_core::packed::unpacked_len);
        let helpers = &mut self.helpers;
        let (written, failed) = apply_batch(
            batch,
            Some(&late),
            &self.shards,
            &self.metrics,
            self.rollups.is_some(),
            (threads, |running| helpers.joining(running)),
        );
        *carried = late.into_carried();
        self.helpers.done();
        self.outbox_written += written;
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
            self.metrics.owned_shards.set(self.shards.owned().len() as i64);
        }
        let announced = self.shards.announced();
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
        // Right after a batch that wrote totals for other shards; and with every
        // heartbeat, for what a store still held after a restart or a new assignment.
        if self.outbox_written > 0 || heartbeat {
            self.outbox_written = 0;
            if let Err(err) = relay_outboxes(&self.relay, &self.shards, &self.metrics) {
                tracing::warn!(error = %err, "relaying the outbox");
            }
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
            let relays = std::iter::once(&self.relay).chain(rollup_relay).find_map(Relay::fatal);
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
    /// Takes and drops shards as ownership says: at once when the lease lapsed
    /// (every shard, then a new tenure); statically, every shard (those whose log
    /// end could not be read are tried again with each heartbeat).
    fn reassign(&mut self, consumer: &BaseConsumer<CounterContext>, heartbeat: bool) -> Result<()> {
        let context = consumer.context();
        let held = self.shards.held();
        let Some(ownership) = self.ownership.as_mut() else {
            if heartbeat && held.len() < self.shard_count as usize {
                context.assign(consumer, &(0..self.shard_count).collect::<Vec<_>>())?;
            }
            return Ok(());
        };
        match ownership.change(consumer, &held, now_ms()) {
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
                context.assign(consumer, &[])?;
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
        if let Err(err) = relay_outboxes(&self.relay, &self.shards, &self.metrics) {
            tracing::warn!(error = %err, "relaying the outbox before stopping; the next owner sends it");
        }
        for shard in self.shards.owned() {
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
    let mut failures = shards.failures.descriptions();
    metrics.failed_shards.set(failures.len() as i64);
    failures.extend(conflict);
    readiness.set_failures(failures);
    let serving = shards.serving();
    let ready = match member {
        false => !serving.is_empty(),
        true => shards.lease.valid(now_ms()) && serving == shards.owned(),
    };
    readiness.set(ready);
}

/// Applies a polled batch, each shard's records in offset order, on up to
/// `threads` threads that take whole shards, the biggest first (each shard is a
/// RocksDB of its own, and only this batch writes it); returns how many outbox
/// messages it wrote and the shards that failed in it. A failed shard applies
/// nothing more (records of it polled before it was paused are dropped: its
/// store's offset stays at the failure); the others go on.
///
/// `helpers`: how many threads start on it, and how many more join, asked between
/// the loop's shards given how many run. The helper threads run as nice as the
/// apply loop; the loop starts them only while cores sat idle as the batch gathered,
/// or joins them once cores fell idle as it was applied ([`HelperGauge`]): on 2
/// cores shared with the ingester and the broker, helpers in every batch applied a
/// backlog sooner but made batch reads while ingesting slower (BENCHMARKS.md, "Two
/// apply threads, as nice as the loop"; "Helpers only on idle cores"; "Helpers that
/// join a batch").
///
/// With `late`, records that arrived meanwhile join each shard as it starts
/// ([`crate::late`]).
fn apply_batch<C: ConsumerContext>(
    batch: &[Polled],
    late: Option<&LateRecords<'_, C>>,
    shards: &Shards,
    metrics: &Metrics,
    mark_rollups: bool,
    (threads, join): (usize, impl FnMut(usize) -> usize),
) -> (u64, Vec<u32>) {
    let mut by_shard: BTreeMap<u32, Vec<ShardRecord<'_>>> = BTreeMap::new();
    for polled in batch {
        by_shard.entry(polled.partition as u32).or_default().push(shard_record(polled));
    }
    let mut work: Vec<(u32, Vec<ShardRecord<'_>>)> = by_shard.into_iter().collect();
    for (_, records) in &mut work {
        records.sort_by_key(|r| r.offset);
    }
    // The biggest first, so that the threads finish about together.
    work.sort_by_cached_key(|(shard, records)| {
        (Reverse(records.iter().map(|r| r.payload.len()).sum::<usize>()), *shard)
    });
    let now = now_ms();
    let taken = AtomicUsize::new(0);
    let apply_next = || {
        let (shard, records) = work.get(taken.fetch_add(1, Ordering::Relaxed))?;
        let late = late.map(|late| late.start(*shard)).unwrap_or_default();
        metrics.late_records.inc_by(late.len() as u64);
        let records = match late.is_empty() {
            true => Cow::Borrowed(records),
            false => Cow::Owned(records.iter().copied().chain(late.iter().map(shard_record)).collect()),
        };
        let (written, failed) = apply_shard(*shard, &records, shards, metrics, mark_rollups, now);
        Some((written, failed.then_some(*shard)))
    };
    let (applied, ran) = tally_shared::sched::on_threads(threads.min(work.len()), "counter-apply+", join, apply_next);
    // A helper that could not start is not counted.
    if ran > 1 {
        metrics.helped_batches.inc();
    }
    let written = applied.iter().map(|(written, _)| written).sum();
    (written, applied.into_iter().filter_map(|(_, failed)| failed).collect())
}

fn shard_record(polled: &Polled) -> ShardRecord<'_> {
    ShardRecord { offset: polled.offset, payload: &polled.payload, timestamp: polled.timestamp }
}

/// Applies one shard's records of a batch (in offset order) at `now` (the batch's
/// wall-clock time, for retention and records without a time): the outbox messages
/// it wrote (those of the records before a failure are committed too), and whether
/// the shard failed (recorded on the failure board).
fn apply_shard(
    shard: u32,
    records: &[ShardRecord<'_>],
    shards: &Shards,
    metrics: &Metrics,
    mark_rollups: bool,
    now: i64,
) -> (u64, bool) {
    let Some(store) = shards.get(shard).filter(|_| !shards.failures.is_failed(shard)) else { return (0, false) };
    let started = Instant::now();
    let report = match store.apply(records, now, mark_rollups) {
        Ok(report) => report,
        Err(err) => {
            let offset = store.next_offset();
            shards.failures.fail(shard, Failure { offset, reason: err.to_string(), record: None });
            return (0, true);
        }
    };
    metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
    record_metrics(metrics, &report);
    let mut failed = false;
    if let Some((next, found)) = report.gap {
        let reason = format!("the log has no records {next}..{found} the store has not applied (deleted by retention, or the topic was recreated): restore or rebuild the shard");
        shards.failures.fail(shard, Failure { offset: Some(next), reason, record: None });
        failed = true;
    }
    if let Some((offset, reason)) = &report.undecodable {
        let record = records.iter().find(|r| r.offset == *offset).map(|r| Arc::new(r.payload.to_vec()));
        shards.failures.fail(shard, Failure { offset: Some(*offset), reason: reason.clone(), record });
        metrics.undecodable_records.inc();
        failed = true;
    }
    (report.outbox_messages, failed)
}

fn record_metrics(metrics: &Metrics, report: &ApplyReport) {
    metrics.applied_increments.inc_by(report.increments);
    metrics.duplicates.with_label_values(&["redelivered"]).inc_by(report.redelivered);
    metrics.duplicates.with_label_values(&["id"]).inc_by(report.duplicate_ids);
    metrics.batch_records.observe(report.records as f64);
    metrics.batch_keys.observe(report.keys as f64);
    metrics.graph_entries.with_label_values(&["desc_change"]).inc_by(report.desc_changes);
    metrics.graph_entries.with_label_values(&["remote_total"]).inc_by(report.totals_received);
}

/// The directory of a shard's store.
fn store_dir(shard: u32) -> String {
    format!("shard-{shard:04}")
}

/// The name of a shard's snapshots: under its topic's name, so a store never
/// restores another topic's shard.
fn snapshot_name(topic: &str, shard: u32) -> String {
    format!("{topic}/{}", store_dir(shard))
}

/// How often the snapshotter looks at the shards.
const SNAPSHOT_CHECK: Duration = Duration::from_secs(2);

/// Snapshots the serving shards when due ([`Snapshotter`]), on a thread of its own:
/// the checkpoint is taken under the store's commit lock (moments), the upload runs
/// beside the consumer.
struct ShardSnapshots {
    snapshotter: Snapshotter,
    shards: Arc<Shards>,
    metrics: Metrics,
    /// The shard topic (the snapshots' namespace).
    topic: String,
}

impl ShardSnapshots {
    fn new(snapshots: SnapshotStore, config: &TallyConfig, shards: Arc<Shards>, metrics: Metrics) -> Self {
        let scratch = config.counter.data_dir.join(".checkpoints");
        let snapshotter = Snapshotter::new(snapshots, &config.snapshots, scratch);
        Self { snapshotter, shards, metrics, topic: TopicNames::new(&config.kafka.topic_prefix).shards() }
    }

    fn run(mut self) -> impl FnMut() + Send + 'static {
        move || {
            let serving: Vec<(String, Arc<ShardStore>)> = (self.shards.serving().into_iter())
                .filter_map(|shard| Some((snapshot_name(&self.topic, shard), self.shards.get(shard)?)))
                .collect();
            let stores: Vec<(String, &tally_shared::store::Store)> =
                serving.iter().map(|(name, store)| (name.clone(), &store.store)).collect();
            let (taken, failed) = self.snapshotter.round(&self.shards.snapshot_requests, &stores);
            self.metrics.snapshots_taken.inc_by(taken);
            self.metrics.snapshot_failures.inc_by(failed);
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;
    use tally_core::time::WindowSpec;
    use tally_core::wire::{Increment, Kind, ShardAnswer, ShardMessage, ShardQuery, Source, Stamp};

    use super::*;

    const NOW: i64 = 1_763_776_800_000;
    const SHARDS: u32 = 5;

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

    /// A shard record of increments of `views`, one per (entity, delta).
    fn increments(shard: u32, offset: i64, events: &[(&str, i64)]) -> Polled {
        let entries = events
            .iter()
            .enumerate()
            .map(|(index, &(entity, delta))| {
                let increment = Increment { entity: entity.into(), metric: "views".into(), delta, ts: NOW, id: None };
                (Stamp { offset, index: index as u32 }, increment)
            })
            .collect();
        let source = Source { stream: Source::INCREMENTS, partition: shard };
        let payload = ShardMessage::Increments { source, entries }.encode().unwrap();
        Polled { partition: shard as i32, offset, timestamp: Some(NOW), payload, drained: false }
    }

    /// A shard's next offset and the all-time totals of some entities.
    type ShardState = (Option<i64>, Vec<tally_core::keys::Count>);

    /// Every shard's state after applying `batch` on `threads` threads, and what
    /// `apply_batch` returned.
    fn applied(batch: &[Polled], entities: &[&str], threads: usize) -> ((u64, Vec<u32>), Vec<ShardState>) {
        applied_with(batch, None::<&LateRecords<'_, rdkafka::consumer::DefaultConsumerContext>>, entities, threads)
    }

    /// [`applied`], with records that arrive meanwhile taken from `late`.
    fn applied_with<C: ConsumerContext>(
        batch: &[Polled],
        late: Option<&LateRecords<'_, C>>,
        entities: &[&str],
        threads: usize,
    ) -> ((u64, Vec<u32>), Vec<ShardState>) {
        let dir = tempfile::tempdir().unwrap();
        let stores = (0..SHARDS)
            .map(|shard| {
                let options = StoreOptions { shards: SHARDS, ..StoreOptions::default() };
                (shard, Arc::new(ShardStore::open(shard, &dir.path().join(store_dir(shard)), options).unwrap()))
            })
            .collect();
        let shards = Shards::default();
        shards.replace(stores, BTreeMap::new());
        let mut returned = apply_batch(batch, late, &shards, &Metrics::new(&Registry::new()), true, (threads, |_| 0));
        returned.1.sort();
        let states = (0..SHARDS)
            .map(|shard| {
                let store = shards.get(shard).unwrap();
                let queries: Vec<ShardQuery> = entities
                    .iter()
                    .map(|entity| ShardQuery {
                        entity: entity.to_string(),
                        metric: "views".into(),
                        kind: Kind::Total,
                        spec: WindowSpec::All,
                    })
                    .collect();
                let totals = store.read(&queries, NOW).unwrap().into_iter().map(|answer| match answer {
                    ShardAnswer::Window { value, .. } => value,
                    other => panic!("{other:?}"),
                });
                (store.next_offset(), totals.collect())
            })
            .collect();
        (returned, states)
    }

    /// Records that came while the batch was applied join the shard it had not
    /// started (a copy of one the batch holds is skipped by its offset); those of a
    /// shard not in the batch are carried to the next.
    #[test]
    fn late_records_are_applied_with_their_shard_and_the_rest_carried() {
        use rdkafka::mocking::MockCluster;
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("shards", SHARDS as i32, 1).unwrap();
        let kafka =
            tally_shared::config::KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let (first, later) = (increments(1, 0, &[("e1", 2)]), increments(1, 1, &[("e1", 3), ("e6", 4)]));
        let other = increments(2, 0, &[("e2", 5)]);
        let producer: BaseProducer = tally_shared::kafka::client_config(&kafka).unwrap().create().unwrap();
        for record in [&first, &later, &other] {
            let to = BaseRecord::<(), _>::to("shards").partition(record.partition).payload(&record.payload);
            producer.send(to).unwrap();
        }
        producer.flush(Duration::from_secs(5)).unwrap();
        let mut config = tally_shared::kafka::consumer_config(&kafka).unwrap();
        config.set("group.id", "late-apply-test").set("enable.auto.commit", "false");
        let consumer: BaseConsumer = config.create().unwrap();
        let mut assignment = TopicPartitionList::new();
        for partition in [1, 2] {
            assignment.add_partition_offset("shards", partition, Offset::Beginning).unwrap();
        }
        consumer.assign(&assignment).unwrap();

        let late = LateRecords::new(&consumer, [1], usize::MAX, tally_shared::consume::as_fetched);
        let all = [&first, &later, &other].iter().map(|record| record.payload.len()).sum();
        let deadline = Instant::now() + Duration::from_secs(10);
        while late.polled_bytes() < all && Instant::now() < deadline {
            assert_eq!(late.start(99).len(), 0, "shard 99 is not in the batch");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (returned, states) = applied_with(std::slice::from_ref(&first), Some(&late), &["e1", "e2", "e6"], 1);
        assert_eq!(returned, (0, vec![]));
        assert_eq!(states[1], (Some(2), vec![5, 0, 4]), "the batch's record and the late one, once each");
        assert_eq!(states[2], (None, vec![0, 0, 0]), "shard 2 was not in the batch");
        let carried: Vec<(i32, i64)> = late.into_carried().iter().map(|r| (r.partition, r.offset)).collect();
        assert_eq!(carried, [(2, 0)]);
    }

    /// Each nice value of this process's threads named `rocksdb:*`.
    fn rocksdb_threads_nice() -> Vec<(String, i32)> {
        let mut threads = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
            // `tid (comm) state ...`: nice is the 19th field, the 17th after the name.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
            let name = &stat[open + 1..close];
            let nice = stat[close + 2..].split(' ').nth(16).and_then(|field| field.parse().ok());
            if let (true, Some(nice)) = (name.starts_with("rocksdb:"), nice) {
                threads.push((name.to_string(), nice));
            }
        }
        threads.sort();
        threads
    }

    /// RocksDB's shared threads keep the counter's priority though the apply loop,
    /// which opens the stores of shards as they come, runs nicer. In a process of
    /// its own (this test binary again, running this test alone): the threads are
    /// the process's, started by whichever test opens a store first.
    #[test]
    fn rocksdb_threads_keep_the_counters_priority_when_the_nicer_loop_opens_stores() {
        const ALONE: &str = "TALLY_TEST_ROCKSDB_THREADS_ALONE";
        let name = "consumer::tests::rocksdb_threads_keep_the_counters_priority_when_the_nicer_loop_opens_stores";
        if std::env::var_os(ALONE).is_none() {
            let run = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", name, "--nocapture", "--test-threads", "1"])
                .env(ALONE, "1")
                .output()
                .unwrap();
            let out = String::from_utf8_lossy(&run.stdout);
            assert!(
                run.status.success() && out.contains("test result: ok. 1 passed"),
                "{out}{}",
                String::from_utf8_lossy(&run.stderr)
            );
            return;
        }
        assert_eq!(rocksdb_threads_nice(), [], "no store opened yet in this process");
        let base = tally_shared::sched::nice().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let nicer = std::thread::spawn(move || {
            ShardStore::start_background_threads().unwrap();
            let nicer = tally_shared::sched::lower_priority(5).unwrap();
            let store = ShardStore::open(0, &path, StoreOptions::default()).unwrap();
            drop(store);
            nicer
        })
        .join()
        .unwrap();
        assert_eq!(nicer, base + 5);
        let threads = rocksdb_threads_nice();
        let expected: Vec<(String, i32)> =
            ["rocksdb:high", "rocksdb:low"].into_iter().map(|name| (name.to_string(), base)).collect();
        assert_eq!(threads, expected);
    }

    /// Each shard's records apply in offset order, however they were polled and
    /// however many threads share the shards; a shard with a bad record stops at
    /// it, the others apply all of theirs.
    #[test]
    fn a_batch_applies_shard_by_shard_in_offset_order_and_a_bad_record_stops_its_shard_only() {
        let mut bad = increments(2, 1, &[("c", 1)]);
        bad.payload.truncate(bad.payload.len() / 2);
        // Out of offset order within shards, as several fetches can hand them over.
        let batch = vec![
            increments(0, 1, &[("a", 2), ("b", 3)]),
            increments(1, 0, &[("a", 5)]),
            increments(0, 0, &[("a", 7)]),
            bad,
            increments(2, 0, &[("c", 11), ("c", 13)]),
            increments(3, 0, &[("d", 17)]),
            increments(2, 2, &[("c", 19)]),
            increments(3, 1, &[("d", 23), ("a", 29)]),
        ];
        let entities = ["a", "b", "c", "d"];
        let expected = (
            (0, vec![2]),
            vec![
                (Some(2), vec![9, 3, 0, 0]),
                (Some(1), vec![5, 0, 0, 0]),
                (Some(1), vec![0, 0, 24, 0]),
                (Some(2), vec![29, 0, 0, 40]),
                (None, vec![0, 0, 0, 0]),
            ],
        );
        for threads in [1, 2, 8] {
            assert_eq!(applied(&batch, &entities, threads), expected, "{threads} threads");
        }
    }
}
