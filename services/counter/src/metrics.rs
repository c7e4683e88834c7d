//! The counter's Prometheus metrics, declared once.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use tally_shared::telemetry::{long_duration_histogram, register};

#[derive(Clone)]
pub struct Metrics {
    pub applied_increments: IntCounter,
    pub duplicates: IntCounterVec,
    /// Increments counted under their metric's overflow combination (an origin's
    /// combinations at `counting.max_segment_combinations`).
    pub segment_overflows: IntCounter,
    pub batch_records: Histogram,
    pub batch_keys: Histogram,
    pub apply_seconds: Histogram,
    /// Batches the loop applied with helper threads beside it (`counter.apply_threads`).
    pub helped_batches: IntCounter,
    /// Records that arrived while a batch was applied and joined it ([`crate::late`]).
    pub late_records: IntCounter,
    /// 1 while the shard stores write RocksDB's WAL, 0 while the shard topic is
    /// their journal ([`tally_shared::store::Durability`]).
    pub store_wal: IntGauge,
    /// Flushes of stores without the WAL ([`crate::flushes`]): how long each held
    /// its store's commit lock, and those that failed (the journal then has to hold
    /// more than the flush interval for a crash to replay).
    pub store_flush_seconds: Histogram,
    pub store_flush_failures: IntCounter,
    pub undecodable_records: IntCounter,
    /// Shards stopped by a failure, waiting for an operator.
    pub failed_shards: IntGauge,
    /// Records an operator skipped (`tally shards skip`), sent to the dead-letter topic.
    pub skipped_records: IntCounter,
    pub consumer_lag: IntGaugeVec,
    pub consumer_lag_seconds: prometheus::GaugeVec,
    pub freshness_lag: prometheus::HistogramVec,
    /// Shards restored from a snapshot instead of replaying their whole log.
    pub restored_shards: IntCounter,
    /// How long each restore from a snapshot took.
    pub restore_seconds: Histogram,
    /// How long a shard taken (restored, rebuilt or kept from before) took to catch
    /// up with its log and serve.
    pub catch_up_seconds: Histogram,
    pub snapshots_taken: IntCounter,
    pub snapshot_failures: IntCounter,
    pub owned_shards: IntGauge,
    /// 1 while the shard consumer rests: nothing new, no fetches ([`tally_shared::rest`]).
    pub fetch_resting: IntGauge,
    /// Leases that lapsed (the counter paused or cut off too long): every shard dropped.
    pub lapsed_leases: IntCounter,
    pub reads: IntCounter,
    pub rollups_published: IntCounter,
    /// Of those, tombstones of expired buckets.
    pub rollup_tombstones: IntCounter,
    /// Rounds of rollups not acknowledged (they stay marked and go again).
    pub rollups_failed: IntCounter,
    /// Descendant-set changes applied, totals received from other shards.
    pub graph_entries: IntCounterVec,
    pub outbox_relayed: IntCounter,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let sizes = vec![1.0, 10.0, 100.0, 1_000.0, 10_000.0, 100_000.0];
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| {
            register(
                registry,
                Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid histogram options"),
            )
        };
        Self {
            applied_increments: register(
                registry,
                IntCounter::new(
                    "tally_counter_applied_increments_total",
                    "Increments applied to shard stores, standbys' copies included (duplicates not): a counter whose \
                     rate fell to 0 while its consumer lag grows is stuck, see its log (TallyConsumerLagHigh)",
                )
                .expect("valid metric"),
            ),
            duplicates: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "tally_counter_duplicates_total",
                        "Increments dropped as duplicates, by reason: redelivered (an ingester's replay after a \
                         restart or rebalance) or id (a producer's retry of an entity and id seen within \
                         counting.dedupe_window). Expected after restarts and retries; a steady id rate: producers \
                         retry often, or reuse ids for different events (those are not counted) — check them",
                    ),
                    &["reason"],
                )
                .expect("valid metric"),
            ),
            segment_overflows: register(
                registry,
                IntCounter::new(
                    "tally_counter_segment_overflows_total",
                    "Segmented increments counted under their metric's overflow combination: their entity's metric \
                     already had counting.max_segment_combinations combinations, so filters and breakdowns miss \
                     them (breakdowns report them as overflow). A producer is sending a dimension of unbounded \
                     values (ids, timestamps): fix it, or raise the cap if the combinations are real",
                )
                .expect("valid metric"),
            ),
            batch_records: histogram(
                "tally_counter_batch_records",
                "Shard records applied per shard and batch (standbys' included): large while a backlog drains",
                sizes.clone(),
            ),
            batch_keys: histogram(
                "tally_counter_batch_keys",
                "Distinct bucket keys written per shard and batch: each is written once however many increments \
                 of the batch it holds",
                sizes,
            ),
            apply_seconds: histogram(
                "tally_counter_apply_seconds",
                "Time to apply one shard's records of a batch and commit them to its store: rising with the consumer \
                 lag, the counter is short of CPU or disk — give it more, or add counters (TallyConsumerLagHigh)",
                prometheus::exponential_buckets(0.0001, 4.0, 9).expect("valid buckets"),
            ),
            store_flush_seconds: histogram(
                "tally_counter_store_flush_seconds",
                "Time to flush one shard store that runs without the WAL (its commits wait meanwhile): long \
                 flushes hold up that shard's batches — a slow disk",
                prometheus::exponential_buckets(0.001, 4.0, 8).expect("valid buckets"),
            ),
            store_flush_failures: register(
                registry,
                IntCounter::new(
                    "tally_counter_store_flush_failures_total",
                    "Flushes of shard stores that failed (their commits stay to be replayed from the shard topic): \
                     rising, a crash replays ever more of the topic, and cannot past its retention — the counter's \
                     log names the store's error",
                )
                .expect("valid metric"),
            ),
            helped_batches: register(
                registry,
                IntCounter::new(
                    "tally_counter_helped_batches_total",
                    "Batches applied with helper threads (counter.apply_threads, while cores sat idle)",
                )
                .expect("valid metric"),
            ),
            late_records: register(
                registry,
                IntCounter::new(
                    "tally_counter_late_records_total",
                    "Records that arrived while a batch was applied and joined it, their shard not started yet",
                )
                .expect("valid metric"),
            ),
            store_wal: register(
                registry,
                IntGauge::new(
                    "tally_counter_store_wal",
                    "1: the shard stores write RocksDB's WAL; 0: the shard topic is their journal (a crash replays it)",
                )
                .expect("valid metric"),
            ),
            undecodable_records: register(
                registry,
                IntCounter::new(
                    "tally_counter_undecodable_records_total",
                    "Shard records that could not be decoded: each stops its shard — see TallyShardFailed (fix \
                     the producer writing to the shard topic, then tally shards skip)",
                )
                .expect("valid metric"),
            ),
            failed_shards: register(
                registry,
                IntGauge::new(
                    "tally_counter_failed_shards",
                    "Shards this counter holds (owned or standby) stopped by a failure: /readyz names an owned one's \
                     shard, offset and reason, the log a standby's. Above 0: see TallyShardFailed",
                )
                .expect("valid metric"),
            ),
            skipped_records: register(
                registry,
                IntCounter::new(
                    "tally_counter_skipped_records_total",
                    "Shard records an operator skipped (tally shards skip) to the dead-letter topic: what they held \
                     is not counted",
                )
                .expect("valid metric"),
            ),
            restored_shards: register(
                registry,
                IntCounter::new(
                    "tally_counter_restored_shards_total",
                    "Shards restored from a snapshot instead of replaying their whole log (taken with no usable store \
                     here)",
                )
                .expect("valid metric"),
            ),
            restore_seconds: long_duration_histogram(
                registry,
                "tally_counter_restore_seconds",
                "Time to restore a shard's store from its newest snapshot (download and checks). Long: the object \
                 store is slow or far, or the stores are large; a shard is dark for this long when it moves without a \
                 standby (counter.standby_replicas)",
            ),
            catch_up_seconds: long_duration_histogram(
                registry,
                "tally_counter_shard_catch_up_seconds",
                "Time from taking a shard (restored, rebuilt from the log or kept from before) until it caught up with \
                 its log and served. Long: snapshots trail far (a restore replays everything since) or the counter \
                 applies slowly; standbys take over without it",
            ),
            lapsed_leases: register(
                registry,
                IntCounter::new(
                    "tally_counter_lapsed_leases_total",
                    "Times this counter's lease lapsed and it dropped every shard: 3 or more in 30 minutes fire \
                     TallyLeaseLapsing — raise counter.member_timeout_ms, or give the broker and the counter more \
                     room",
                )
                .expect("valid metric"),
            ),
            snapshots_taken: register(
                registry,
                IntCounter::new(
                    "tally_counter_snapshots_total",
                    "Shard snapshots stored: a shard's once snapshots.every_records records or snapshots.interval_ms \
                     passed since its last one (if it applied anything), or on request (tally snapshot)",
                )
                .expect("valid metric"),
            ),
            snapshot_failures: register(
                registry,
                IntCounter::new(
                    "tally_counter_snapshot_failures_total",
                    "Shard snapshots that failed (tried again): any in 30 minutes fires TallySnapshotsFailing — \
                     check the object store (credentials, bucket, network) in the counter's log",
                )
                .expect("valid metric"),
            ),
            consumer_lag: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "tally_counter_consumer_lag_records",
                        "Shard-topic records not yet applied, per owned shard: growing, the counter falls behind \
                         (see TallyConsumerLagHigh)",
                    ),
                    &["shard"],
                )
                .expect("valid metric"),
            ),
            consumer_lag_seconds: register(
                registry,
                prometheus::GaugeVec::new(
                    Opts::new(
                        "tally_counter_consumer_lag_seconds",
                        "How old the oldest shard-topic record not yet applied is (0: none), per consumer group and \
                         owned shard: over 60 s for 5 minutes fires TallyConsumerLagHigh (reads with max_staleness_ms \
                         answer 503) — add counters if the load outgrew them, read the log of one that stopped",
                    ),
                    &["group", "shard"],
                )
                .expect("valid metric"),
            ),
            freshness_lag: register(
                registry,
                prometheus::HistogramVec::new(
                    HistogramOpts::new(
                        "tally_freshness_lag_seconds",
                        "How much newer input a shard's counts may be missing, sampled every second per owned \
                         shard: up to when it was last seen caught up with its log, else the age of the newest \
                         input it applied. Reads with a max_staleness_ms below it answer 503 too_stale: when its upper \
                         quantiles rise, see TallyConsumerLagHigh",
                    )
                    .buckets(vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0]),
                    &["shard"],
                )
                .expect("valid metric"),
            ),
            owned_shards: register(
                registry,
                IntGauge::new(
                    "tally_counter_owned_shards",
                    "Shards this counter owns, standbys not counted: it changes as counters join, leave or lose \
                     their lease (see TallyLeaseLapsing)",
                )
                .expect("valid metric"),
            ),
            fetch_resting: register(
                registry,
                IntGauge::new(
                    "tally_counter_fetch_resting",
                    "1 while the shard consumer rests: its shards' logs had nothing new for 5 s, no fetches until a \
                     look at their ends (every 100 ms) finds records; normal while no input comes",
                )
                .expect("valid metric"),
            ),
            reads: register(
                registry,
                IntCounter::new(
                    "tally_counter_read_queries_total",
                    "Count queries answered from this counter's shards, owned or standby: one per entity, metric, \
                     kind and window (or series) a read asks",
                )
                .expect("valid metric"),
            ),
            rollups_published: register(
                registry,
                IntCounter::new(
                    "tally_counter_rollups_published_total",
                    "Rollup records published to the rollups topic: changed buckets' newest values",
                )
                .expect("valid metric"),
            ),
            rollup_tombstones: register(
                registry,
                IntCounter::new(
                    "tally_counter_rollup_tombstones_total",
                    "Rollup records published as tombstones of expired buckets",
                )
                .expect("valid metric"),
            ),
            rollups_failed: register(
                registry,
                IntCounter::new(
                    "tally_counter_rollups_failed_total",
                    "Rounds of rollups not acknowledged by the broker (published again later): rising, rollup \
                     consumers see values late — the counter's log names the broker's error",
                )
                .expect("valid metric"),
            ),
            graph_entries: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "tally_counter_graph_entries_total",
                        "Graph entries applied, by kind: desc_change (descendant-set changes from tally-graph) or \
                         remote_total (totals other shards relayed)",
                    ),
                    &["kind"],
                )
                .expect("valid metric"),
            ),
            outbox_relayed: register(
                registry,
                IntCounter::new(
                    "tally_counter_outbox_relayed_total",
                    "Totals messages relayed from this counter's shards to other shards through the shard topic",
                )
                .expect("valid metric"),
            ),
        }
    }
}
