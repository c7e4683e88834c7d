//! The broker's Prometheus metrics, declared once; every family is labelled by queue.

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use tally_shared::telemetry::register;

#[derive(Clone)]
pub struct Metrics {
    pub dequeued: IntCounterVec,
    pub acked: IntCounterVec,
    pub nacked: IntCounterVec,
    pub expired: IntCounterVec,
    pub dead: IntCounterVec,
    pub dropped: IntCounterVec,
    pub cancelled: IntCounterVec,
    pub replaced: IntCounterVec,
    pub held_partitions: IntGaugeVec,
    pub depth: IntGaugeVec,
    pub in_flight: IntGaugeVec,
    pub delayed: IntGaugeVec,
    pub retrying: IntGaugeVec,
    pub oldest_ready_age: GaugeVec,
    pub wait_slo: GaugeVec,
    pub consumer_lag: IntGaugeVec,
    /// Per consumer group, queue and partition: records not yet fetched, and how old
    /// the oldest of them is.
    pub lag_records_by_partition: IntGaugeVec,
    pub lag_seconds_by_partition: GaugeVec,
    pub dequeue_seconds: HistogramVec,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| {
            register(registry, IntCounterVec::new(Opts::new(name, help), &["queue"]).expect("valid metric"))
        };
        let gauge = |name: &str, help: &str| {
            register(registry, IntGaugeVec::new(Opts::new(name, help), &["queue"]).expect("valid metric"))
        };
        Self {
            dequeued: counter("tally_broker_dequeued_total", "Jobs handed to workers, each attempt once"),
            acked: counter("tally_broker_acked_total", "Jobs acked by workers (done): the queue's throughput"),
            nacked: counter(
                "tally_broker_nacked_total",
                "Attempts nacked by workers (failed: retried later, dead after max_attempts): rising, jobs \
                 fail — read the errors in the workers' logs or on dead jobs (tally jobs dead)",
            ),
            expired: counter(
                "tally_broker_lease_expired_total",
                "Job leases that expired before an ack or nack (the job runs again, or is dead after \
                 max_attempts): workers extend a running job's lease, so a rise means workers died, lost the \
                 broker or abandoned jobs — look at their logs",
            ),
            dead: counter(
                "tally_broker_dead_total",
                "Jobs sent to the dead topic: out of attempts, dropped or cancelled. Rising beyond \
                 tally_broker_dropped_total and tally_broker_cancelled_total, jobs fail every attempt — read \
                 their errors (tally jobs dead), fix the cause, then requeue them",
            ),
            dropped: counter(
                "tally_broker_dropped_total",
                "Jobs dropped at their concurrency key's limit (limits.at_limit = \"drop_newest\"), written to \
                 the dead topic: when it grows, producers enqueue faster than a key may run",
            ),
            cancelled: counter(
                "tally_broker_cancelled_total",
                "Jobs cancelled by an operator and written to the dead topic (never retried)",
            ),
            replaced: counter(
                "tally_broker_replaced_total",
                "Waiting jobs replaced by a newer job of their unique key (on_duplicate = \"replace\" or \
                 \"debounce\"): finished without running",
            ),
            held_partitions: gauge(
                "tally_broker_held_partitions",
                "Partitions of a limited queue taken over and waiting out their previous owner's leases (they \
                 hand out nothing): a hold lasts at most max_lease_ms plus member_timeout_ms — keep a limited \
                 queue's max_lease_ms short",
            ),
            depth: gauge(
                "tally_broker_depth_jobs",
                "Jobs waiting in the partitions this broker serves: ready, delayed and not yet fetched. \
                 Growing while tally_broker_delayed_jobs does not: workers fall behind (see TallyJobsWaiting)",
            ),
            in_flight: gauge(
                "tally_broker_in_flight_jobs",
                "Jobs leased to workers and not yet acked, nacked or expired: summed over brokers, steady at the \
                 workers' total concurrency while jobs wait, workers are the bottleneck — add workers or concurrency",
            ),
            delayed: gauge("tally_broker_delayed_jobs", "Jobs waiting for run_at or a retry"),
            retrying: gauge(
                "tally_broker_retrying_jobs",
                "Jobs waiting for a retry after a failed attempt: when it grows, look at the workers' errors",
            ),
            oldest_ready_age: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "tally_jobs_oldest_ready_age_seconds",
                        "Age of the oldest job ready and not yet handed out, of the partitions this broker owns \
                         (0: none waits; on a FIFO queue, jobs held behind their key count too, and a rate \
                         limit holds jobs back by design): when it grows, workers fall behind — add workers \
                         or concurrency",
                    ),
                    &["queue"],
                )
                .expect("valid metric"),
            ),
            wait_slo: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "tally_jobs_wait_slo_seconds",
                        "The queue's declared wait_slo_ms in seconds: how long a ready job may wait to be handed \
                         out; TallyJobsWaiting fires while the oldest ready job waits longer",
                    ),
                    &["queue"],
                )
                .expect("valid metric"),
            ),
            consumer_lag: gauge(
                "tally_broker_consumer_lag_records",
                "Queue records not yet fetched, over the partitions this broker serves (per partition: \
                 tally_broker_partition_lag_records)",
            ),
            lag_records_by_partition: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "tally_broker_partition_lag_records",
                        "Queue records not yet fetched, per consumer group, queue and partition: a broker fetches \
                         while its buffer has room, so a lag that stays means full buffers (workers behind)",
                    ),
                    &["group", "queue", "partition"],
                )
                .expect("valid metric"),
            ),
            lag_seconds_by_partition: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "tally_broker_consumer_lag_seconds",
                        "How old the oldest queue record not yet fetched is (0: none), per consumer group, queue and \
                         partition: growing, the broker's buffers are full — add workers, or raise the queue's \
                         buffer",
                    ),
                    &["group", "queue", "partition"],
                )
                .expect("valid metric"),
            ),
            dequeue_seconds: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "tally_broker_dequeue_seconds",
                        "Time to hand out jobs for a dequeue that got some (a long poll's wait not included)",
                    )
                    .buckets(prometheus::exponential_buckets(0.00005, 2.0, 16).expect("valid buckets")),
                    &["queue"],
                )
                .expect("valid metric"),
            ),
        }
    }
}
