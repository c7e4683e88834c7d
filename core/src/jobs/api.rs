//! The HTTP API of a dequeue broker, as types shared by `tally-broker`,
//! the worker library and the CLI.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// Longest long poll a dequeue may ask for.
pub const MAX_WAIT_MS: u64 = 30_000;
/// Most jobs one dequeue hands out.
pub const MAX_DEQUEUE: usize = 1_000;
/// Most bytes of a nack's error text; a longer one is refused (the worker library
/// cuts its own to fit).
pub const MAX_ERROR_BYTES: usize = 64 << 10;

/// `text` cut to at most [`MAX_ERROR_BYTES`], at a character boundary.
pub fn error_text(text: &str) -> &str {
    let mut end = text.len().min(MAX_ERROR_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DequeueRequest {
    #[serde(default = "default_max")]
    pub max: usize,
    /// Lease length; the queue's `lease_ms` when absent.
    #[serde(default)]
    pub lease_ms: Option<i64>,
    /// Long-poll up to this long when nothing is ready.
    #[serde(default)]
    pub wait_ms: u64,
}

fn default_max() -> usize {
    10
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DequeuedJob {
    pub id: String,
    pub payload: Box<RawValue>,
    /// 1 for the first try.
    pub attempt: u32,
    /// Ack, nack or extend with this.
    pub lease: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The level it was enqueued at (on a queue with priority levels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// The key its queue's concurrency limits count it under (its own, or its
    /// payload's `limits.key_field`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key: Option<String>,
    /// When the lease ends unless extended (ms since the epoch).
    pub lease_deadline: i64,
    /// Where the job is in its queue's topic: the same for every attempt, so a
    /// worker can tell a rerun (same place) from another job of the same id.
    #[serde(default)]
    pub partition: i32,
    #[serde(default)]
    pub offset: i64,
    /// The W3C `traceparent` a worker's span of the job descends from, when its record
    /// carried a trace context: the broker's span of this handout when the broker
    /// exports spans, else the record's own context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DequeueResponse {
    pub jobs: Vec<DequeuedJob>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AckRequest {
    pub leases: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AckResponse {
    pub acked: usize,
    /// Leases this broker does not know (expired, already acked, or from another broker).
    pub unknown: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NackRequest {
    pub lease: String,
    /// Retry after this long; the queue's backoff when absent.
    #[serde(default)]
    pub retry_in_ms: Option<i64>,
    #[serde(default)]
    pub error: Option<String>,
}

/// `POST /v1/queues/{queue}/cancel` (and `/held/cancel`, one broker's part).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    pub id: String,
}

/// One broker's answer to `/held/cancel`: what the job was doing there (none: not
/// held there), how many records of its partitions it has not fetched yet, and which
/// partitions it looked in (none from a broker before they were said: then nobody
/// may answer that the job is unknown).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeldCancel {
    pub state: Option<super::partition::Cancelled>,
    pub unfetched: i64,
    #[serde(default)]
    pub served: Vec<i32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtendRequest {
    pub lease: String,
    pub lease_ms: i64,
}

/// One partition in the stats.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionInfo {
    pub partition: i32,
    /// The broker that serves it (`host:port`), from the shared membership.
    pub owner: Option<String>,
    /// Counts below are known for the partitions the answering broker owns.
    pub owned_here: bool,
    pub ready: usize,
    pub delayed: usize,
    /// Of the delayed, those waiting for a retry.
    #[serde(default)]
    pub retrying: usize,
    pub in_flight: usize,
    /// Records in the topic not yet fetched.
    pub lag: i64,
    /// How long its longest-waiting ready job has waited (none ready: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_ready_age_ms: Option<i64>,
    /// On a limited queue: its share of the queue's `limits.total`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<usize>,
    /// On a limited queue just taken over: nothing is handed out before this time
    /// (ms since the epoch), when the previous owner's leases have all ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_until: Option<i64>,
}

/// A concurrency key's jobs in flight, against its limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInFlight {
    pub key: String,
    pub in_flight: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueStats {
    pub queue: String,
    /// Jobs waiting: ready and delayed in memory, plus not yet fetched.
    pub depth: i64,
    pub in_flight: usize,
    pub delayed: usize,
    /// Of the delayed, those waiting for a retry.
    #[serde(default)]
    pub retrying: usize,
    /// How long the longest-waiting ready job of the partitions answered for has
    /// waited (Sidekiq's "latency"; none ready: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_ready_age_ms: Option<i64>,
    /// Jobs sent to the dead topic by this broker since it started.
    pub dead: u64,
    /// Of those, the jobs cancelled by an operator.
    #[serde(default)]
    pub cancelled: u64,
    /// Jobs replaced by a newer one of their unique key (`on_duplicate =
    /// "replace"` or `"debounce"`) by this broker since it started.
    #[serde(default)]
    pub replaced: u64,
    /// Dequeues per second handed out by this broker, recently.
    pub rate: f64,
    pub rate_limit_per_sec: Option<u32>,
    pub fifo: bool,
    /// The queue's concurrency limits (empty: none).
    #[serde(default, skip_serializing_if = "super::limits::Limits::is_empty")]
    pub limits: super::limits::Limits,
    /// The concurrency keys with the most jobs in flight (at most
    /// [`TOP_KEYS`], most first) of the partitions answered for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top_keys: Vec<KeyInFlight>,
    /// The queue's schedules and their next runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub schedules: Vec<ScheduleInfo>,
    pub partitions: Vec<PartitionInfo>,
}

pub use super::partition::RunningJob;

/// The jobs in flight of a queue: the first `limit` by partition and offset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningJobs {
    pub running: Vec<RunningJob>,
    /// How many are in flight in all.
    pub total: usize,
}

/// The most jobs in flight one listing shows.
pub const MAX_RUNNING_LISTED: usize = 1_000;

/// A schedule of a queue, and when it fires next.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleInfo {
    pub name: String,
    pub cron: String,
    pub time_zone: String,
    /// `once` or `skip`: what an outage's missed ticks become.
    pub missed: String,
    /// The next tick (ms since the epoch; none: never again).
    pub next_at: Option<i64>,
}

/// How many concurrency keys the stats list.
pub const TOP_KEYS: usize = 10;
