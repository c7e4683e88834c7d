//! The one configuration of a tally deployment.
//!
//! Every service reads the same TOML file (`tally.toml`), each using its own section
//! plus the common ones. Layers, later wins: built-in defaults → the file →
//! `TALLY__SECTION__KEY` environment variables. Unknown keys are errors, so a typo
//! never silently falls back to a default. Environment variables that name a section
//! this config does not have are ignored (they may belong to another tool).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::store::Durability;
use crate::{Error, Result};
use tally_core::time::{Resolution, Resolutions};

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "TALLY__";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TallyConfig {
    pub kafka: KafkaConfig,
    pub counting: CountingConfig,
    pub log: LogConfig,
    pub telemetry: TelemetryConfig,
    pub runtime: RuntimeConfig,
    pub ingester: IngesterConfig,
    pub counter: CounterConfig,
    pub graph: GraphConfig,
    pub snapshots: SnapshotsConfig,
    pub query: QueryConfig,
    pub broker: BrokerConfig,
    pub worker: WorkerConfig,
    pub auth: crate::auth::AuthConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerConfig {
    /// The worker API (dequeue, ack, nack, extend, stats).
    pub listen: String,
    /// Prometheus metrics and health endpoints.
    pub admin_listen: String,
    /// Host announced to workers when `listen` binds a wildcard address.
    pub advertise_host: Option<String>,
    /// Consumer group whose committed offsets hold each partition's watermark.
    pub group_id: String,
    /// A file of queue (and topic) declarations on top of the built-in ones — a
    /// file of `[[queue]]` entries is enough; relative to the config file. The same
    /// file drives `tally topics apply`, `tally up` and the brokers.
    pub declarations: Option<PathBuf>,
    /// How often a broker says it is alive.
    pub heartbeat_ms: u64,
    /// A broker silent this long is gone; its partitions move.
    pub member_timeout_ms: u64,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8090".into(),
            admin_listen: "127.0.0.1:9105".into(),
            advertise_host: None,
            group_id: "tally-broker".into(),
            declarations: None,
            heartbeat_ms: 1_000,
            member_timeout_ms: 6_000,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Any brokers' worker API URLs (`http://host:port`); the owners are found from them.
    pub brokers: Vec<String>,
    pub queue: String,
    /// Jobs run at once.
    pub concurrency: usize,
    /// Lease asked for each job (0: the queue's default); extended while a job runs.
    pub lease_ms: i64,
    /// POST each job's payload here: 2xx acks, anything else retries.
    pub webhook_url: Option<String>,
    /// Or run this program with the payload on stdin: exit 0 acks.
    pub command: Option<Vec<String>>,
    /// The worker's environment variables the command sees (when set): it runs
    /// with a cleared environment, so the worker's tokens never reach it.
    pub command_env: Vec<String>,
    /// A cancelled job's command gets SIGTERM, then SIGKILL after this long (never
    /// past its lease).
    pub stop_grace_ms: u64,
    /// Prometheus metrics and health endpoints.
    pub admin_listen: String,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            brokers: vec!["http://127.0.0.1:8090".into()],
            queue: "default".into(),
            concurrency: 8,
            lease_ms: 0,
            webhook_url: None,
            command: None,
            command_env: vec!["PATH".into(), "HOME".into(), "LANG".into()],
            stop_grace_ms: 10_000,
            admin_listen: "127.0.0.1:9106".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GraphConfig {
    /// Prometheus metrics and health endpoints.
    pub admin_listen: String,
    /// The internal graph read API `tally-query` calls; port 0 picks a free one,
    /// which is announced on the shard-owners topic.
    pub read_listen: String,
    /// Host announced for the read API when `read_listen` binds a wildcard address.
    pub advertise_host: Option<String>,
    /// The graph's RocksDB.
    pub data_dir: PathBuf,
    /// Most graph-update records handled in one batch.
    pub batch_max_records: usize,
    /// Longest wait for a batch to fill, in ms.
    pub batch_linger_ms: u64,
    /// fsync the RocksDB WAL on every batch.
    pub sync_writes: bool,
    /// The most descendants one entity may have: an edge that would give one more is
    /// refused (dead-lettered with its reason, the graph unchanged), so what one
    /// update costs stays bounded.
    pub max_descendants: usize,
}

impl Default for GraphConfig {
    fn default() -> Self {
        Self {
            admin_listen: "127.0.0.1:9104".into(),
            read_listen: "127.0.0.1:0".into(),
            advertise_host: None,
            data_dir: PathBuf::from("data/graph"),
            batch_max_records: 1_000,
            batch_linger_ms: 20,
            sync_writes: false,
            max_descendants: 1_000_000,
        }
    }
}

/// Snapshots of the counter shards' stores ([`crate::snapshot`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnapshotsConfig {
    /// Take snapshots and restore from them (a shard without a store otherwise
    /// rebuilds from the whole log).
    pub enabled: bool,
    /// The snapshot store: a local directory, unless `url` is set.
    pub dir: PathBuf,
    /// An S3-compatible object store instead: `s3://bucket/prefix`. Credentials come
    /// from the standard `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (and
    /// `AWS_SESSION_TOKEN`) variables, never from this file.
    pub url: String,
    /// The S3 endpoint for other S3-compatible stores (MinIO, Ceph…); empty: AWS.
    pub endpoint: String,
    pub region: String,
    /// Allow a plain-HTTP endpoint (a local test server).
    pub allow_http: bool,
    /// A shard is snapshot once this many records were applied since its last one…
    pub every_records: i64,
    /// …or this long after its last one, if it applied anything since.
    pub interval_ms: u64,
    /// Snapshots kept per shard (the newest; at least two).
    pub keep: usize,
    /// An upload that never got its manifest (its writer died) is deleted once it
    /// started this long ago, in ms.
    pub orphan_grace_ms: u64,
    /// How long the shard topic and graph-updates keep records, set when `tally
    /// topics apply` creates them (on existing topics a difference is reported as
    /// drift, to change by hand). 0: 7 days when snapshots go to a shared store
    /// (`url`), which every counter restores from; otherwise as declared ("forever":
    /// with snapshots on each counter's own disk, a shard that moves rebuilds from
    /// the log).
    pub log_retention_ms: u64,
}

impl SnapshotsConfig {
    /// The retention of the shard topic and graph-updates, when it is bounded.
    pub fn log_retention_ms(&self) -> Option<i64> {
        match self.log_retention_ms {
            ms if ms > 0 => Some(ms.min(i64::MAX as u64) as i64),
            _ if self.enabled && !self.url.trim().is_empty() => Some(7 * 86_400_000),
            _ => None,
        }
    }
}

impl Default for SnapshotsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: PathBuf::from("data/snapshots"),
            url: String::new(),
            endpoint: String::new(),
            region: "us-east-1".into(),
            allow_http: false,
            every_records: 1_000_000,
            interval_ms: 300_000,
            keep: 2,
            orphan_grace_ms: 3_600_000,
            log_retention_ms: 0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// `host:port,…`; empty means "start a local broker" for `tally up`.
    pub bootstrap_servers: String,
    /// Replaces `tally.` in every topic name.
    pub topic_prefix: String,
    /// Passed through to librdkafka as is (`security.protocol`, `sasl.*`, `ssl.*`…).
    pub client: BTreeMap<String, String>,
    /// The largest record the brokers accept (their `message.max.bytes`): every
    /// record tally writes is split or truncated to fit ([`tally_core::records`]).
    pub max_message_bytes: usize,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        Self {
            bootstrap_servers: String::new(),
            topic_prefix: "tally.".into(),
            client: BTreeMap::new(),
            max_message_bytes: tally_core::records::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

impl KafkaConfig {
    /// The bytes one record's payload may take: the broker's limit less room for
    /// the key, headers and framing.
    pub fn record_budget(&self) -> usize {
        self.max_message_bytes.saturating_sub(tally_core::records::RECORD_OVERHEAD_BYTES).max(1_024)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolutionConfig {
    /// Bucket width: `1m`, `1h`, `1d`.
    pub width: String,
    /// How long buckets are kept: `6h`, `35d`.
    pub retention: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CountingConfig {
    pub resolutions: Vec<ResolutionConfig>,
    /// How long an idempotency `id` is remembered.
    pub dedupe_window: String,
    /// The dimensions each metric's increments may carry as `segments`
    /// (`views = ["country", "state"]`); a metric not listed takes none.
    pub dimensions: BTreeMap<String, Vec<String>>,
    /// Combinations of segments one entity's metric keeps; later ones count under
    /// its overflow combination.
    pub max_segment_combinations: u32,
}

impl Default for CountingConfig {
    fn default() -> Self {
        let resolution = |w: &str, r: &str| ResolutionConfig { width: w.into(), retention: r.into() };
        Self {
            resolutions: vec![resolution("1m", "6h"), resolution("1h", "35d"), resolution("1d", "400d")],
            dedupe_window: "24h".into(),
            dimensions: BTreeMap::new(),
            max_segment_combinations: tally_core::segments::DEFAULT_MAX_COMBINATIONS,
        }
    }
}

impl CountingConfig {
    pub fn resolutions(&self) -> Result<Resolutions> {
        let list = self
            .resolutions
            .iter()
            .map(|r| Resolution::new(&r.width, &r.retention))
            .collect::<tally_core::Result<Vec<_>>>()?;
        Ok(Resolutions::new(list)?)
    }

    pub fn dedupe_window_ms(&self) -> Result<i64> {
        Ok(tally_core::time::parse_duration(&self.dedupe_window)? as i64)
    }

    /// The declared dimensions, checked.
    pub fn dimensions(&self) -> Result<tally_core::segments::Dimensions> {
        tally_core::segments::Dimensions::new(self.dimensions.clone())
            .map_err(|reason| Error::Config(format!("counting.dimensions: {reason}")))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A tracing filter: `info`, `tally_counter=debug,info`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::Text, level: "info".into() }
    }
}

/// Traces ([`crate::otel`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// An OTLP/HTTP collector's base URL (`http://otel-collector:4318`): spans go to
    /// its `/v1/traces` as protobuf. Unset (the default): no spans are made and no
    /// exporter runs; trace contexts that records carry are still passed on.
    pub otlp_endpoint: Option<String>,
}

/// The async runtime of each service binary.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Threads that run the service's async tasks (HTTP, Kafka glue), at least 1.
    /// Heavy work runs on threads of its own (applying batches, RocksDB, rollups),
    /// so one is the default: on a machine whose cores the services and the broker
    /// share, more threads per service only contend for them and lengthen the
    /// read tail (BENCHMARKS.md, "Reads"). Raise it for a
    /// service with cores of its own, e.g. a query pod with 4 CPUs: 4.
    pub worker_threads: usize,
    /// CPU time slice, in µs, that the service's request threads ask Linux for
    /// (6.12 or later; 100–100 000): a short one lets a thread that wakes for a
    /// request run at once on a busy core, which is most of a read's p99 on cores
    /// shared with other services and the broker ([`crate::sched`]). Backlog loops
    /// keep the kernel's default. 0: every thread keeps the kernel's default.
    pub latency_slice_us: u64,
}

impl RuntimeConfig {
    /// The slice request threads ask for ([`Duration::ZERO`]: the kernel's default).
    pub fn latency_slice(&self) -> Duration {
        Duration::from_micros(self.latency_slice_us)
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self { worker_threads: 1, latency_slice_us: 100 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IngesterConfig {
    /// Prometheus metrics and health endpoints.
    pub admin_listen: String,
    pub group_id: String,
    /// Most input records handled in one batch. A batch becomes one shard record per
    /// shard it touches (format 4; per input partition and shard in formats 1 to 3),
    /// so bigger batches hand the broker fewer, larger records (BENCHMARKS.md,
    /// "End to end: ingest").
    pub batch_max_records: usize,
    /// Most input payload bytes held in one batch (memory stays bounded whatever
    /// the records' sizes).
    pub batch_max_bytes: usize,
    /// Longest wait for a batch to fill, in ms; a batch whose input partitions are
    /// read to the end their last fetch reported closes at once.
    pub batch_linger_ms: u64,
    /// Consume every input partition without joining the consumer group (one
    /// instance only). For brokers whose group coordinator cannot evict a killed
    /// member, such as the local Tansu; offsets are still committed to the group.
    pub static_assignment: bool,
    /// The format version of the shard records of increments it writes: 4 (the
    /// default: one record per shard per batch, bundling every input partition's
    /// compact increments, packed with zstd), 3 (a record per input partition and
    /// shard, compact and packed), 2 (compact) or 1 — for counters of a release that
    /// reads only versions up to that one, until they are upgraded (README:
    /// "Upgrading").
    pub shard_record_format: u8,
    /// The largest `|delta|` an increment may carry; larger ones go to the
    /// dead-letter topic with a reason (counts never wrap).
    pub max_abs_delta: i64,
    /// How far ahead of the ingester's clock an increment's `ts` may lie, in ms;
    /// later ones go to the dead-letter topic, as do those older than the longest
    /// retention of `[counting] resolutions`.
    pub max_future_ms: i64,
    /// At most this often (ms) it tells every shard and the graph how far it has
    /// routed each input partition (a small record each): what reads with a write
    /// token (`after=`) wait for. 0 turns it off — only while counters or the graph
    /// run a release that does not read such records (README: "Upgrading").
    pub marks_every_ms: u64,
}

impl IngesterConfig {
    /// What increments' numbers must keep, with `counting`'s longest retention.
    pub fn limits(&self, counting: &CountingConfig) -> Result<tally_core::input::Limits> {
        if self.max_abs_delta < 1 {
            return Err(Error::Config(format!("ingester.max_abs_delta is {}: it is at least 1", self.max_abs_delta)));
        }
        if self.max_future_ms < 0 {
            return Err(Error::Config(format!("ingester.max_future_ms is {}: it is at least 0", self.max_future_ms)));
        }
        let limits = tally_core::input::Limits::new(&counting.resolutions()?);
        Ok(tally_core::input::Limits { max_abs_delta: self.max_abs_delta, max_future_ms: self.max_future_ms, ..limits })
    }
}

/// Refuses a shard-record format the ingester cannot write (`ingester.shard_record_format`):
/// at load, so `tally config check` says so before an ingester starts.
pub fn check_shard_record_format(version: u8) -> Result<()> {
    match version {
        tally_core::format::RECORD_V1
        | tally_core::format::RECORD_V2
        | tally_core::format::RECORD_V3
        | tally_core::format::RECORD_V4 => Ok(()),
        _ => Err(Error::Config(format!("ingester.shard_record_format is {version}: it is 1, 2, 3 or 4"))),
    }
}

impl Default for IngesterConfig {
    fn default() -> Self {
        Self {
            admin_listen: "127.0.0.1:9101".into(),
            group_id: "tally-ingester".into(),
            batch_max_records: 20_000,
            batch_max_bytes: 16 << 20,
            batch_linger_ms: 20,
            static_assignment: false,
            shard_record_format: tally_core::format::RECORD_V4,
            max_abs_delta: tally_core::input::Limits::DEFAULT_MAX_ABS_DELTA,
            max_future_ms: tally_core::input::Limits::DEFAULT_MAX_FUTURE_MS,
            marks_every_ms: 50,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CounterConfig {
    /// Prometheus metrics and health endpoints.
    pub admin_listen: String,
    /// The internal read API `tally-query` calls; port 0 picks a free one, which is
    /// announced on the shard-owners topic.
    pub read_listen: String,
    /// Host announced for the read API when `read_listen` binds a wildcard address.
    pub advertise_host: Option<String>,
    /// One RocksDB per shard under this directory.
    pub data_dir: PathBuf,
    pub group_id: String,
    /// Most shard records applied in one write batch.
    pub batch_max_records: usize,
    /// Most shard-record payload bytes in one batch, a packed record (format 3)
    /// counted as what it unpacks to (about 9 bytes an increment under a skewed load;
    /// while applied, a batch's increments take about 80 bytes each in memory). Large
    /// batches are what make a backlog fast: each hot bucket is written once.
    pub batch_max_bytes: usize,
    /// How long a batch waits to fill, in ms: under light load batches are small
    /// and reads see increments within about this long.
    pub batch_linger_ms: u64,
    /// Under load a batch waits as long as the one before took to apply, up to this
    /// many ms: the counter then applies at most about half the time, in bigger
    /// batches that cost less per increment, and reads see increments within about
    /// twice the apply time. Set at or below `batch_linger_ms`, batches are never
    /// stretched. After a full batch (a backlog) the next one is not held back, and a
    /// stretched batch closes once no record came for twice the fetch wait.
    pub batch_max_linger_ms: u64,
    /// How long the counter's fetches of the shard topic wait at the broker for
    /// records, in ms: the `fetch.wait.max.ms` of its shard consumer, in place of
    /// `kafka.client`'s and the data path's 100 ms (1 to 300000). A broker that holds
    /// every fetch for its whole wait (the local one) hands a record over one to two
    /// waits after it was written, so this bounds how soon counts follow the
    /// ingester. Each wait also costs such a broker a look at every shard, until the
    /// consumer rests (`shared::rest`: after 5 s without records); BENCHMARKS.md,
    /// "Freshness". A broker that answers as
    /// soon as records arrive (Kafka) makes it only the idle fetches' rhythm.
    pub fetch_wait_ms: u64,
    /// How much lower than the counter's other threads the thread that applies
    /// batches runs: 0 to 19, added to its nice value (0: the same). Under CPU
    /// contention the ingester and the broker then keep pace and batches grow, which
    /// costs less per increment; on an idle CPU it changes nothing.
    pub apply_nice: i32,
    /// At most how many threads apply a batch, each taking whole shards (every shard
    /// is a RocksDB of its own), as nice as the apply loop: the loop's own, and a
    /// helper for each further core that sat idle at least half the time while the
    /// batch gathered (`shared::idle`), so helpers take only CPU nothing else wanted
    /// — the end of a backlog, a counter on cores of its own. 2 by default; 1: the
    /// loop's thread alone. Always helping on 2 cores shared with the ingester and
    /// the broker made batch reads while ingesting slower (BENCHMARKS.md).
    pub apply_threads: usize,
    /// Publish the latest values of changed buckets to `tally.rollups`.
    pub rollups: bool,
    /// How often, at most, the changed buckets' values are published, in ms: a
    /// bucket changed many times meanwhile goes once, with its newest value.
    pub rollup_interval_ms: u64,
    /// fsync the RocksDB WAL on every batch (survives power loss, not just `kill -9`).
    pub sync_writes: bool,
    /// Write RocksDB's WAL (each batch twice: the WAL and the memtable). Off by
    /// default where the shard topic keeps its records an hour or more: it is the
    /// journal, and a counter killed with -9 replays what its stores had not flushed
    /// ([`CounterConfig::durability`]).
    pub write_ahead_log: bool,
    /// Bytes of origins' direct counts kept in memory per shard, so an edge change
    /// of origins changed lately moves their counts without reading RocksDB (0:
    /// none). An origin with many buckets takes more: a busy counter has a bucket per
    /// minute for 6 hours, per hour for 35 days and per day for 400 days.
    pub direct_cache_bytes: usize,
    /// Bytes of RocksDB's block cache, one for every shard store of the counter (owned
    /// and standby), at least [`MIN_BLOCK_CACHE_BYTES`]: the tables' data blocks and
    /// their index blocks alike, so what the tables hold in memory is this whatever
    /// their size on disk. Counted in it but never evicted: the top level of each
    /// table's index (a few hundred bytes per MiB of tables) and the whole index of
    /// each store's newest (level 0) tables (about 3.5 % of them: some 2 MiB for a
    /// store's usual four). Beside it each store has its memtables (up to 2 × 16 MiB
    /// of counts and 2 × 4 MiB of idempotency marks; the other families hold few
    /// records).
    pub block_cache_bytes: usize,
    /// Own every shard without the counters' membership (one instance only).
    pub static_assignment: bool,
    /// This counter's name among the counters: unique, and stable across restarts
    /// (a restarted counter gets back the shards whose stores it keeps). Empty:
    /// `<hostname>:<data_dir>`.
    pub instance: String,
    /// How often a counter says it is alive (`counter-members` topic).
    pub heartbeat_ms: u64,
    /// A counter silent this long is gone and its shards move; a paused one stops
    /// serving a quarter of this before (its lease).
    pub member_timeout_ms: u64,
    /// Standbys per shard (at most [`MAX_STANDBY_REPLICAS`]): other counters that
    /// apply its log into their own stores (read only by reads allowing staleness
    /// while the owner is silent), so that when its owner goes
    /// the first of them serves it without a restore (as many as there are other
    /// counters; 0: none, a new owner restores and replays).
    pub standby_replicas: u32,
}

/// The smallest `counter.block_cache_bytes`.
pub const MIN_BLOCK_CACHE_BYTES: usize = 1 << 20;

/// The most standbys a shard may have.
pub const MAX_STANDBY_REPLICAS: u32 = 4;

impl CounterConfig {
    /// [`CounterConfig::fetch_wait_ms`].
    pub fn fetch_wait(&self) -> Duration {
        Duration::from_millis(self.fetch_wait_ms)
    }

    /// [`CounterConfig::instance`], or `<hostname>:<data_dir>` when it is empty.
    pub fn member_name(&self) -> String {
        if !self.instance.trim().is_empty() {
            return self.instance.trim().to_string();
        }
        let host = std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into());
        let dir = std::fs::canonicalize(&self.data_dir).unwrap_or_else(|_| self.data_dir.clone());
        format!("{host}:{}", dir.display())
    }

    /// How a shard's commits survive a crash, given the shard topic's settings as
    /// the broker reports them (`None`: it could not): fsynced through the WAL
    /// (`sync_writes`), through the WAL (`write_ahead_log`, or unless the topic
    /// provably keeps its records far longer than a store waits between flushes),
    /// else through the shard topic alone, as a Kafka Streams changelog.
    pub fn durability(&self, shard_topic: Option<&HashMap<String, String>>) -> Durability {
        let setting = |name: &str| shard_topic.and_then(|settings| settings.get(name)).map(|v| v.trim().parse::<i64>());
        let kept_long = match (setting("retention.ms"), setting("retention.bytes")) {
            (Some(Ok(ms)), None | Some(Ok(-1))) => ms == -1 || ms >= MIN_JOURNAL_RETENTION_MS,
            _ => false,
        };
        if self.sync_writes {
            Durability::WalSynced
        } else if self.write_ahead_log || !kept_long {
            Durability::Wal
        } else {
            Durability::InputLog
        }
    }
}

/// The longest `counter.fetch_wait_ms`: librdkafka's bound on `fetch.wait.max.ms`.
pub const MAX_FETCH_WAIT_MS: u64 = 300_000;

/// The shortest retention of the shard topic under which a counter leaves the WAL
/// out: what a crash replays was applied since the store's last flush, which the log
/// must still hold (`tally-counter` flushes each store about every `PERSIST_EVERY`,
/// 30 s, however many it owns: within 35 s of its last flush, 60 s of opening).
pub const MIN_JOURNAL_RETENTION_MS: i64 = 3_600_000;

impl Default for CounterConfig {
    fn default() -> Self {
        Self {
            admin_listen: "127.0.0.1:9102".into(),
            read_listen: "127.0.0.1:0".into(),
            advertise_host: None,
            data_dir: PathBuf::from("data/counter"),
            group_id: "tally-counter".into(),
            batch_max_records: 20_000,
            batch_max_bytes: 16 << 20,
            batch_linger_ms: 20,
            batch_max_linger_ms: 250,
            fetch_wait_ms: 50,
            apply_nice: 5,
            apply_threads: 2,
            rollups: true,
            rollup_interval_ms: 1_000,
            sync_writes: false,
            write_ahead_log: false,
            direct_cache_bytes: 8 << 20,
            block_cache_bytes: 64 << 20,
            static_assignment: false,
            instance: String::new(),
            heartbeat_ms: 500,
            member_timeout_ms: 5_000,
            standby_replicas: 0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueryConfig {
    /// The public read API and dashboard.
    pub listen: String,
    /// Prometheus metrics and health endpoints.
    pub admin_listen: String,
    /// Most queries in one `POST /v1/query`.
    pub max_batch: usize,
    /// How long a read waits for a shard owner to appear, in ms.
    pub owner_wait_ms: u64,
    /// Reads go to the counters over their read links (one binary connection per
    /// counter, shared by concurrent reads); `false`: one JSON request per read over
    /// HTTP (the fallback: a proxy that drops upgrades falls back by itself).
    pub read_link: bool,
}

impl Default for QueryConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            admin_listen: "127.0.0.1:9103".into(),
            max_batch: 1_000,
            owner_wait_ms: 6_000,
            read_link: true,
        }
    }
}

impl TallyConfig {
    /// Loads defaults, then `path` (when given), then the environment.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        Self::load_with_env(path, std::env::vars())
    }

    /// [`TallyConfig::load`] with an explicit environment, for tests.
    pub fn load_with_env(path: Option<&Path>, env: impl IntoIterator<Item = (String, String)>) -> Result<Self> {
        let mut figment = Figment::from(Serialized::defaults(TallyConfig::default()));
        if let Some(path) = path {
            if !path.exists() {
                return Err(Error::Config(format!("config file {} does not exist", path.display())));
            }
            figment = figment.merge(Toml::file(path));
        }
        // The top-level sections, read off the struct so the list cannot drift.
        let defaults = serde_json::to_value(TallyConfig::default()).map_err(|err| Error::Config(err.to_string()))?;
        let sections: Vec<&str> =
            defaults.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
        let overrides: Vec<(String, String)> = env
            .into_iter()
            .filter_map(|(key, value)| {
                let rest = key.strip_prefix(ENV_PREFIX)?;
                let section = rest.split("__").next()?.to_ascii_lowercase();
                sections.contains(&section.as_str()).then(|| (rest.to_string(), value))
            })
            .collect();
        for (key, value) in overrides {
            let dotted = key.to_ascii_lowercase().replace("__", ".");
            if let Some(setting) = dotted.strip_prefix("kafka.client.") {
                // librdkafka's names have dots, which variable names cannot:
                // TALLY__KAFKA__CLIENT__SASL_PASSWORD sets "sasl.password".
                let setting = setting.replace('_', ".");
                let client = figment::value::Dict::from([(setting, figment::value::Value::from(value))]);
                figment = figment.merge(Serialized::global("kafka.client", client));
                continue;
            }
            let typed = env_value(default_at(&defaults, &dotted), &value);
            figment = figment.merge(Serialized::global(&dotted, typed));
        }
        let config: TallyConfig = figment.extract().map_err(|err| {
            // `section.key: what is wrong`, without figment's provider internals.
            let all: Vec<String> = err
                .into_iter()
                .map(|e| match e.path.is_empty() {
                    true => e.kind.to_string(),
                    false => format!("{}: {}", e.path.join("."), e.kind),
                })
                .collect();
            Error::Config(all.join("; "))
        })?;
        config.counting.resolutions()?;
        config.counting.dedupe_window_ms()?;
        config.counting.dimensions()?;
        if config.counting.max_segment_combinations == 0 {
            return Err(Error::Config("counting.max_segment_combinations: must be at least 1".into()));
        }
        if config.runtime.worker_threads == 0 {
            return Err(Error::Config("runtime.worker_threads: must be at least 1".into()));
        }
        let slice = config.runtime.latency_slice();
        if !slice.is_zero() && !(crate::sched::MIN_SLICE..=crate::sched::MAX_SLICE).contains(&slice) {
            return Err(Error::Config(
                "runtime.latency_slice_us: 0 (the kernel's default) or 100 to 100000 (what Linux grants)".into(),
            ));
        }
        if !(0..=crate::sched::MAX_NICE).contains(&config.counter.apply_nice) {
            return Err(Error::Config(format!(
                "counter.apply_nice: 0 to {} (added to a nice value)",
                crate::sched::MAX_NICE
            )));
        }
        if !(1..=MAX_FETCH_WAIT_MS).contains(&config.counter.fetch_wait_ms) {
            return Err(Error::Config(format!(
                "counter.fetch_wait_ms: 1 to {MAX_FETCH_WAIT_MS} (librdkafka's fetch.wait.max.ms; 0 would fetch without pause)"
            )));
        }
        if config.counter.apply_threads == 0 {
            return Err(Error::Config("counter.apply_threads: must be at least 1".into()));
        }
        if config.counter.block_cache_bytes < MIN_BLOCK_CACHE_BYTES {
            return Err(Error::Config(format!(
                "counter.block_cache_bytes: at least {MIN_BLOCK_CACHE_BYTES} (the tables' index blocks live there too; \
                 a smaller cache reads them again for every lookup)"
            )));
        }
        if config.counter.standby_replicas > MAX_STANDBY_REPLICAS {
            return Err(Error::Config(format!("counter.standby_replicas: 0 to {MAX_STANDBY_REPLICAS}")));
        }
        if config.snapshots.orphan_grace_ms < 60_000 {
            return Err(Error::Config(format!(
                "snapshots.orphan_grace_ms is {}: at least 60000, or an upload still under way (another counter's, \
                 a clock or two apart) could be collected",
                config.snapshots.orphan_grace_ms
            )));
        }
        if config.graph.max_descendants == 0 {
            return Err(Error::Config("graph.max_descendants: must be at least 1".into()));
        }
        check_shard_record_format(config.ingester.shard_record_format)?;
        if let Some(endpoint) = &config.telemetry.otlp_endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(Error::Config(format!(
                    "telemetry.otlp_endpoint is {endpoint:?}: an http:// or https:// URL (OTLP/HTTP, port 4318 by convention)"
                )));
            }
        }
        config.ingester.limits(&config.counting)?;
        config.auth.check()?;
        // A relative declarations file sits next to the config that names it (or,
        // named by the environment alone, in the working directory); kept absolute,
        // so a config written for a service elsewhere names the same file.
        let mut config = config;
        if let Some(declarations) = &config.broker.declarations {
            if declarations.is_relative() {
                let beside =
                    path.and_then(Path::parent).map_or_else(|| declarations.clone(), |dir| dir.join(declarations));
                config.broker.declarations = Some(std::path::absolute(&beside)?);
            }
        }
        Ok(config)
    }
}

/// What a redacted secret reads as.
pub const REDACTED: &str = "<redacted>";

impl TallyConfig {
    /// The effective config as a JSON value with every secret replaced by
    /// [`REDACTED`] (bearer tokens; Kafka client settings whose name says password,
    /// secret or key material) and unset options left out: what `tally config
    /// check` prints.
    pub fn redacted(&self) -> Result<serde_json::Value> {
        let mut value = serde_json::to_value(self).map_err(|err| Error::Config(err.to_string()))?;
        redact(&mut value, "");
        Ok(value)
    }
}

fn redact(value: &mut serde_json::Value, path: &str) {
    let serde_json::Value::Object(map) = value else { return };
    map.retain(|_, v| !v.is_null());
    for (key, v) in map.iter_mut() {
        let path = format!("{path}.{key}");
        let secret = (path.starts_with(".auth.") && key.ends_with("_token"))
            || (path.starts_with(".kafka.client.")
                && ["password", "secret", "key.pem", "keystore", "sasl.jaas"].iter().any(|s| key.contains(s)));
        if secret {
            *v = serde_json::Value::from(REDACTED);
        } else {
            redact(v, &path);
        }
    }
}

/// The default value at a dotted path (`auth.worker_token`), if the path exists.
fn default_at<'a>(defaults: &'a serde_json::Value, dotted: &str) -> Option<&'a serde_json::Value> {
    dotted.split('.').try_fold(defaults, |value, key| value.get(key))
}

/// An environment value typed by the key's default: a string field stays a string
/// whatever it looks like (a token `123456` is not a number), numbers and booleans
/// parse as such, lists come from JSON arrays (`["a","b"]`). Unset options (all
/// strings or lists of strings) are lists when the value is a JSON array of
/// strings, strings otherwise. An unknown key keeps the value as a string (and the
/// loader reports the key).
fn env_value(default: Option<&serde_json::Value>, value: &str) -> figment::value::Value {
    use figment::value::Value;
    use serde_json::Value as Json;
    let list = || serde_json::from_str::<Vec<String>>(value).ok().map(Value::from);
    let text = || Value::from(value.to_string());
    match default {
        Some(Json::Number(_)) => value
            .parse::<i64>()
            .map(Value::from)
            .or_else(|_| value.parse::<f64>().map(Value::from))
            .unwrap_or_else(|_| text()),
        Some(Json::Bool(_)) => match value {
            "true" => Value::from(true),
            "false" => Value::from(false),
            _ => text(),
        },
        Some(Json::Array(_)) | Some(Json::Null) => list().unwrap_or_else(text),
        _ => text(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_log_is_bounded_only_with_a_shared_snapshot_store_unless_configured() {
        let mut snapshots = SnapshotsConfig::default();
        assert_eq!(snapshots.log_retention_ms(), None, "snapshots on each counter's disk: the log is kept");
        snapshots.url = "s3://bucket/tally".into();
        assert_eq!(snapshots.log_retention_ms(), Some(7 * 86_400_000), "a shared store: 7 days");
        snapshots.enabled = false;
        assert_eq!(snapshots.log_retention_ms(), None, "snapshots off: the log is kept");
        snapshots.log_retention_ms = 3_600_000;
        assert_eq!(snapshots.log_retention_ms(), Some(3_600_000), "set: as set");
        let env = [("TALLY__SNAPSHOTS__LOG_RETENTION_MS".to_string(), "-1".to_string())];
        let refused = TallyConfig::load_with_env(None, env).unwrap_err().to_string();
        assert!(refused.contains("log_retention_ms"), "a negative retention is refused, not read as 0: {refused}");
    }

    #[test]
    fn a_counter_leaves_the_wal_out_only_while_the_shard_topic_covers_every_flush() {
        let topic = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let durability = |pairs: &[(&str, &str)], settings: Option<HashMap<String, String>>| {
            TallyConfig::load_with_env(None, env(pairs)).unwrap().counter.durability(settings.as_ref())
        };
        let forever = topic(&[("retention.ms", "3153600000000"), ("cleanup.policy", "delete")]);
        assert_eq!(durability(&[], Some(forever.clone())), Durability::InputLog, "the shard topic is the journal");
        let week = topic(&[("retention.ms", "604800000"), ("retention.bytes", "-1")]);
        assert_eq!(durability(&[], Some(week)), Durability::InputLog, "a week's log outlasts any flush");
        assert_eq!(durability(&[], Some(topic(&[("retention.ms", "-1")]))), Durability::InputLog, "unbounded");
        for short in [topic(&[("retention.ms", "3000")]), topic(&[("retention.ms", "3599999")])] {
            assert_eq!(durability(&[], Some(short)), Durability::Wal, "retention could outrun a flush");
        }
        let by_size = topic(&[("retention.ms", "-1"), ("retention.bytes", "1073741824")]);
        assert_eq!(durability(&[], Some(by_size)), Durability::Wal, "bounded by size: no telling how long");
        assert_eq!(durability(&[], Some(topic(&[]))), Durability::Wal, "retention not reported");
        assert_eq!(durability(&[], Some(topic(&[("retention.ms", "soon")]))), Durability::Wal, "not a number");
        assert_eq!(durability(&[], None), Durability::Wal, "the settings could not be read");
        let asked = ("TALLY__COUNTER__WRITE_AHEAD_LOG", "true");
        assert_eq!(durability(&[asked], Some(forever.clone())), Durability::Wal, "asked for");
        let synced = ("TALLY__COUNTER__SYNC_WRITES", "true");
        assert_eq!(durability(&[synced], Some(forever)), Durability::WalSynced, "fsynced, whatever else");
    }

    #[test]
    fn a_service_runs_one_runtime_thread_unless_configured_and_never_none() {
        assert_eq!(TallyConfig::load_with_env(None, env(&[])).unwrap().runtime.worker_threads, 1);
        let four = TallyConfig::load_with_env(None, env(&[("TALLY__RUNTIME__WORKER_THREADS", "4")])).unwrap();
        assert_eq!(four.runtime.worker_threads, 4);
        let refused =
            TallyConfig::load_with_env(None, env(&[("TALLY__RUNTIME__WORKER_THREADS", "0")])).unwrap_err().to_string();
        assert_eq!(refused, "config: runtime.worker_threads: must be at least 1");
    }

    #[test]
    fn request_threads_ask_for_a_100_us_slice_unless_configured_within_what_linux_grants() {
        let slice =
            |pairs: &[(&str, &str)]| TallyConfig::load_with_env(None, env(pairs)).map(|c| c.runtime.latency_slice());
        assert_eq!(slice(&[]).unwrap(), Duration::from_micros(100));
        for (value, want) in
            [("0", Duration::ZERO), ("100000", Duration::from_millis(100)), ("250", Duration::from_micros(250))]
        {
            assert_eq!(slice(&[("TALLY__RUNTIME__LATENCY_SLICE_US", value)]).unwrap(), want, "{value}");
        }
        for value in ["99", "100001"] {
            let refused = slice(&[("TALLY__RUNTIME__LATENCY_SLICE_US", value)]).unwrap_err().to_string();
            assert_eq!(
                refused,
                "config: runtime.latency_slice_us: 0 (the kernel's default) or 100 to 100000 (what Linux grants)",
                "{value}"
            );
        }
    }

    #[test]
    fn the_apply_loop_runs_5_nicer_unless_configured_within_0_to_19() {
        let nice = |pairs: &[(&str, &str)]| TallyConfig::load_with_env(None, env(pairs)).map(|c| c.counter.apply_nice);
        assert_eq!(nice(&[]).unwrap(), 5);
        for value in [0, 19] {
            assert_eq!(nice(&[("TALLY__COUNTER__APPLY_NICE", &value.to_string())]).unwrap(), value);
        }
        for value in ["-1", "20"] {
            let refused = nice(&[("TALLY__COUNTER__APPLY_NICE", value)]).unwrap_err().to_string();
            assert_eq!(refused, "config: counter.apply_nice: 0 to 19 (added to a nice value)", "{value}");
        }
    }

    #[test]
    fn the_counter_fetches_every_50_ms_unless_configured_within_librdkafkas_range() {
        let wait =
            |pairs: &[(&str, &str)]| TallyConfig::load_with_env(None, env(pairs)).map(|c| c.counter.fetch_wait());
        assert_eq!(wait(&[]).unwrap(), Duration::from_millis(50));
        for value in [1, 300_000] {
            let set = wait(&[("TALLY__COUNTER__FETCH_WAIT_MS", &value.to_string())]).unwrap();
            assert_eq!(set, Duration::from_millis(value), "{value}");
        }
        for value in ["0", "300001"] {
            let refused = wait(&[("TALLY__COUNTER__FETCH_WAIT_MS", value)]).unwrap_err().to_string();
            assert_eq!(
                refused,
                "config: counter.fetch_wait_ms: 1 to 300000 (librdkafka's fetch.wait.max.ms; 0 would fetch without pause)",
                "{value}"
            );
        }
    }

    #[test]
    fn batches_apply_on_up_to_two_threads_unless_configured_otherwise() {
        let threads =
            |pairs: &[(&str, &str)]| TallyConfig::load_with_env(None, env(pairs)).map(|c| c.counter.apply_threads);
        assert_eq!(threads(&[]).unwrap(), 2);
        for value in [1, 16] {
            assert_eq!(threads(&[("TALLY__COUNTER__APPLY_THREADS", &value.to_string())]).unwrap(), value);
        }
        let refused = threads(&[("TALLY__COUNTER__APPLY_THREADS", "0")]).unwrap_err().to_string();
        assert_eq!(refused, "config: counter.apply_threads: must be at least 1");
    }

    #[test]
    fn the_block_cache_is_64_mib_unless_configured_and_at_least_1_mib() {
        let cache =
            |pairs: &[(&str, &str)]| TallyConfig::load_with_env(None, env(pairs)).map(|c| c.counter.block_cache_bytes);
        assert_eq!(cache(&[]).unwrap(), 64 << 20);
        assert_eq!(cache(&[("TALLY__COUNTER__BLOCK_CACHE_BYTES", "1048576")]).unwrap(), 1 << 20);
        let refused = cache(&[("TALLY__COUNTER__BLOCK_CACHE_BYTES", "1048575")]).unwrap_err().to_string();
        assert_eq!(
            refused,
            "config: counter.block_cache_bytes: at least 1048576 (the tables' index blocks live there too; \
             a smaller cache reads them again for every lookup)"
        );
    }

    #[test]
    fn standbys_are_none_unless_configured_and_bounded() {
        let standbys =
            |pairs: &[(&str, &str)]| TallyConfig::load_with_env(None, env(pairs)).map(|c| c.counter.standby_replicas);
        assert_eq!(standbys(&[]).unwrap(), 0);
        assert_eq!(standbys(&[("TALLY__COUNTER__STANDBY_REPLICAS", "1")]).unwrap(), 1);
        let refused = standbys(&[("TALLY__COUNTER__STANDBY_REPLICAS", "5")]).unwrap_err().to_string();
        assert_eq!(refused, "config: counter.standby_replicas: 0 to 4");
    }

    #[test]
    fn only_a_shard_record_format_the_ingester_writes_loads() {
        for format in ["1", "2", "3", "4"] {
            let config = TallyConfig::load_with_env(None, env(&[("TALLY__INGESTER__SHARD_RECORD_FORMAT", format)]));
            assert_eq!(config.unwrap().ingester.shard_record_format.to_string(), format);
        }
        assert_eq!(TallyConfig::load_with_env(None, env(&[])).unwrap().ingester.shard_record_format, 4);
        let refused = TallyConfig::load_with_env(None, env(&[("TALLY__INGESTER__SHARD_RECORD_FORMAT", "5")]))
            .unwrap_err()
            .to_string();
        assert_eq!(refused, "config: ingester.shard_record_format is 5: it is 1, 2, 3 or 4");
    }

    #[test]
    fn lists_come_from_json_arrays_in_the_environment() {
        let config = TallyConfig::load_with_env(
            None,
            env(&[
                ("TALLY__WORKER__BROKERS", r#"["http://a:1","http://b:2"]"#),
                ("TALLY__WORKER__COMMAND", r#"["sh","-c","cat"]"#),
            ]),
        )
        .unwrap();
        assert_eq!(config.worker.brokers, vec!["http://a:1".to_string(), "http://b:2".to_string()]);
        assert_eq!(config.worker.command.unwrap(), vec!["sh", "-c", "cat"]);
    }

    #[test]
    fn kafka_client_settings_come_from_the_environment_with_their_dots() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tally.toml");
        std::fs::write(&path, "[kafka.client]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.username\" = \"u\"\n")
            .unwrap();
        let config = TallyConfig::load_with_env(
            Some(&path),
            env(&[("TALLY__KAFKA__CLIENT__SASL_PASSWORD", "0123"), ("TALLY__KAFKA__CLIENT__SSL_KEY_PASSWORD", "k")]),
        )
        .unwrap();
        let client: Vec<(&str, &str)> = config.kafka.client.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            client,
            vec![
                ("sasl.password", "0123"),
                ("sasl.username", "u"),
                ("security.protocol", "SASL_SSL"),
                ("ssl.key.password", "k")
            ]
        );
    }

    #[test]
    fn string_settings_stay_strings_whatever_they_look_like() {
        let config = TallyConfig::load_with_env(
            None,
            env(&[
                ("TALLY__AUTH__WORKER_TOKEN", "1234567890123456"),
                ("TALLY__GRAPH__ADVERTISE_HOST", "true"),
                ("TALLY__KAFKA__TOPIC_PREFIX", "42"),
                ("TALLY__WORKER__QUEUE", "007"),
                ("TALLY__COUNTER__BATCH_MAX_RECORDS", "12"),
                ("TALLY__COUNTER__SYNC_WRITES", "true"),
            ]),
        )
        .unwrap();
        assert_eq!(config.auth.worker_token.as_deref(), Some("1234567890123456"));
        assert_eq!(config.graph.advertise_host.as_deref(), Some("true"));
        assert_eq!((config.kafka.topic_prefix.as_str(), config.worker.queue.as_str()), ("42", "007"));
        assert_eq!((config.counter.batch_max_records, config.counter.sync_writes), (12, true));
        let err = TallyConfig::load_with_env(None, env(&[("TALLY__COUNTER__BATCH_MAX_RECORDS", "many")])).unwrap_err();
        assert!(err.to_string().contains("many"), "{err}");
    }

    #[test]
    fn redaction_hides_every_secret_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tally.toml");
        let client = "[kafka.client]\n\"sasl.password\" = \"p\"\n\"ssl.key.password\" = \"k\"\n\"security.protocol\" = \"SASL_SSL\"\n";
        std::fs::write(&path, format!("[auth]\nreader_token = \"reader-token-0123456789\"\n{client}")).unwrap();
        let worker = ("TALLY__AUTH__WORKER_TOKEN", "worker-token-0123456789");
        let config = TallyConfig::load_with_env(Some(&path), env(&[worker])).unwrap();
        let shown = config.redacted().unwrap();
        assert_eq!(shown["auth"]["reader_token"], REDACTED);
        assert_eq!(shown["auth"]["worker_token"], REDACTED);
        assert_eq!(shown["kafka"]["client"]["sasl.password"], REDACTED);
        assert_eq!(shown["kafka"]["client"]["ssl.key.password"], REDACTED);
        assert_eq!(shown["kafka"]["client"]["security.protocol"], "SASL_SSL");
        assert!(shown["auth"].get("cluster_token").is_none(), "unset options are left out");
        let text = shown.to_string();
        assert!(!text.contains("\"p\"") && !text.contains("0123456789"), "{text}");
        // Everything but the secrets is the effective config.
        assert_eq!(shown["counter"]["batch_max_records"], config.counter.batch_max_records);
    }

    #[test]
    fn defaults_load_without_a_file() {
        let config = TallyConfig::load_with_env(None, env(&[])).unwrap();
        assert_eq!(config.kafka.topic_prefix, "tally.");
        assert_eq!(config.counting.resolutions().unwrap(), Resolutions::default());
    }

    #[test]
    fn file_then_env_override() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tally.toml");
        std::fs::write(
            &path,
            "[kafka]\nbootstrap_servers = \"h:1\"\n[kafka.client]\n\"security.protocol\" = \"SASL_SSL\"\n[counter]\nbatch_max_records = 7\n",
        )
        .unwrap();
        let config = TallyConfig::load_with_env(
            Some(&path),
            env(&[
                ("TALLY__COUNTER__BATCH_MAX_RECORDS", "9"),
                ("TALLY__KAFKA__TOPIC_PREFIX", "t1."),
                ("TALLY__OTHER__X", "1"),
                ("HOME", "/"),
            ]),
        )
        .unwrap();
        assert_eq!(config.kafka.bootstrap_servers, "h:1");
        assert_eq!(config.kafka.client["security.protocol"], "SASL_SSL");
        assert_eq!(config.counter.batch_max_records, 9);
        assert_eq!(config.kafka.topic_prefix, "t1.");
    }

    #[test]
    fn unknown_keys_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tally.toml");
        std::fs::write(&path, "[counter]\nbatch_max_recrods = 7\n").unwrap();
        let err = TallyConfig::load_with_env(Some(&path), env(&[])).unwrap_err().to_string();
        assert!(err.contains("batch_max_recrods"), "{err}");
        let err = TallyConfig::load_with_env(None, env(&[("TALLY__QUERY__LISTN", "x")])).unwrap_err().to_string();
        assert!(err.contains("listn"), "{err}");
        let err = TallyConfig::load_with_env(None, env(&[("TALLY__COUNTING__DEDUPE_WINDOW", "forever")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("forever"), "{err}");
    }

    #[test]
    fn the_example_config_is_complete_and_valid() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tally.toml");
        std::fs::write(&path, include_str!("../../tally.example.toml")).unwrap();
        let config = TallyConfig::load_with_env(Some(&path), env(&[])).unwrap();
        assert_eq!(config.counting.resolutions().unwrap(), Resolutions::default());
        assert_eq!(config.query.max_batch, QueryConfig::default().max_batch);
    }

    /// Every `section.key` the example documents, set or commented out (`# key = …`);
    /// a free-form table (`[kafka.client]`) counts as one key.
    fn documented_keys(example: &str) -> std::collections::BTreeSet<String> {
        let mut keys = std::collections::BTreeSet::new();
        let mut section = String::new();
        for line in example.lines() {
            let line = line.trim();
            if let Some(header) = line.strip_prefix('[').and_then(|l| l.split(']').next()) {
                section = header.to_string();
                if section.contains('.') {
                    keys.insert(section.clone());
                }
                continue;
            }
            let line = line.strip_prefix('#').map_or(line, str::trim_start);
            let Some((key, _)) = line.split_once('=') else { continue };
            let key = key.trim();
            let plain = !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            if plain && !section.contains('.') {
                keys.insert(format!("{section}.{key}"));
            }
        }
        keys
    }

    #[test]
    fn the_example_config_documents_every_key_and_no_other() {
        let defaults = serde_json::to_value(TallyConfig::default()).unwrap();
        let mut known = std::collections::BTreeSet::new();
        for (section, table) in defaults.as_object().unwrap() {
            for key in table.as_object().unwrap().keys() {
                known.insert(format!("{section}.{key}"));
            }
        }
        let documented = documented_keys(include_str!("../../tally.example.toml"));
        assert_eq!(documented, known, "tally.example.toml and the config's keys differ");
        // The comparison can fail: a key missing from the example is noticed.
        let without = include_str!("../../tally.example.toml").replace("owner_wait_ms = 6000", "");
        assert_ne!(documented_keys(&without), known);
    }

    #[test]
    fn traces_are_off_unless_an_http_endpoint_is_named() {
        assert_eq!(TallyConfig::load_with_env(None, env(&[])).unwrap().telemetry.otlp_endpoint, None);
        let on = env(&[("TALLY__TELEMETRY__OTLP_ENDPOINT", "http://collector:4318")]);
        let config = TallyConfig::load_with_env(None, on).unwrap();
        assert_eq!(config.telemetry.otlp_endpoint.as_deref(), Some("http://collector:4318"));
        let grpc = env(&[("TALLY__TELEMETRY__OTLP_ENDPOINT", "collector:4317")]);
        let refused = TallyConfig::load_with_env(None, grpc).unwrap_err().to_string();
        assert!(
            refused.contains("telemetry.otlp_endpoint is \"collector:4317\": an http:// or https:// URL"),
            "{refused}"
        );
    }

    #[test]
    fn missing_file_is_an_error() {
        assert!(TallyConfig::load_with_env(Some(Path::new("/nonexistent/tally.toml")), env(&[])).is_err());
    }
}
