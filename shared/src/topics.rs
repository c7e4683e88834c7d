//! Declarative topics (`topics/topics.toml`) and `tally topics apply`.
//!
//! Applying is idempotent: missing topics are created, partition counts are raised
//! (never lowered — Kafka cannot), and everything else that differs is reported as
//! drift for an operator to decide on.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use rdkafka::admin::{
    AdminClient, AdminOptions, NewPartitions, NewTopic, OwnedResourceSpecifier, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::{Deserialize, Serialize};

use crate::config::KafkaConfig;
use crate::kafka::{client_config, TopicNames};
use crate::{Error, Result};

/// The declarations shipped with this release.
pub const BUILTIN: &str = include_str!("../../topics/topics.toml");

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicDecl {
    /// Name without the prefix.
    pub name: String,
    pub partitions: i32,
    /// `-1` keeps forever; absent leaves the broker default.
    #[serde(default)]
    pub retention_ms: Option<i64>,
    /// `delete`, `compact` or both (`compact,delete`: the newest record per key, and
    /// none older than the retention).
    pub cleanup_policy: String,
    /// Partition count must not change (routing depends on it).
    #[serde(default)]
    pub fixed_partitions: bool,
}

/// A job queue: its topic `jobs.<name>`, its dead topic `jobs.<name>.dead`
/// and how brokers serve it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueDecl {
    /// `[a-z0-9_-]{1,64}`.
    pub name: String,
    pub partitions: i32,
    /// Dequeues per second over all brokers' share of the queue; none = unlimited.
    #[serde(default)]
    pub rate_limit_per_sec: Option<u32>,
    /// Run one job of a key at a time, in order.
    #[serde(default)]
    pub fifo: bool,
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// First retry delay; doubles each attempt up to `backoff_max_ms`.
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: i64,
    #[serde(default = "default_backoff_max_ms")]
    pub backoff_max_ms: i64,
    /// Default lease of a dequeued job.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: i64,
    /// Most jobs ready or running a broker holds per partition.
    #[serde(default = "default_buffer")]
    pub buffer: usize,
    /// Most jobs waiting for their `run_at` (or a retry) a broker holds per
    /// partition, apart from `buffer`: delayed jobs never hold back ready ones
    /// until this many wait.
    #[serde(default = "default_delayed_buffer")]
    pub delayed_buffer: usize,
    /// Most bytes of jobs a broker holds per partition: of ready jobs, and as many
    /// of delayed ones.
    #[serde(default = "default_buffer_bytes")]
    pub buffer_bytes: usize,
    /// How long enqueued jobs stay in the topic.
    #[serde(default = "default_queue_retention_ms")]
    pub retention_ms: i64,
    /// The longest lease a worker may take at dequeue or ask for at extend; a
    /// longer one is refused (400): a lease holds its partition's committed offset.
    #[serde(default = "default_max_lease_ms", skip_serializing_if = "is_default_max_lease_ms")]
    pub max_lease_ms: i64,
    /// The longest delay a nack may ask before the retry (also capped below the
    /// topic's retention, [`QueueDecl::max_retry_ms`]); a longer one is refused (400).
    #[serde(default = "default_max_retry_ms", skip_serializing_if = "is_default_max_retry_ms")]
    pub max_retry_ms: i64,
    /// Priority levels a job may name: `"priority"` 0 (the lowest, and the default)
    /// to `priority_levels - 1`; a ready job of a higher level goes before any lower
    /// one of its partition. 1 (the default): no priorities.
    #[serde(default = "default_priority_levels", skip_serializing_if = "is_default_priority_levels")]
    pub priority_levels: u8,
    /// A ready job rises one level for every this long it waits, so a stream of
    /// higher jobs delays a lower one but never starves it (0: never rises).
    #[serde(default = "default_priority_aging_ms", skip_serializing_if = "is_default_priority_aging_ms")]
    pub priority_aging_ms: i64,
    /// How long a ready job may wait to be handed out before the queue is late: its
    /// objective, exported as `tally_jobs_wait_slo_seconds`, which the
    /// `TallyJobsWaiting` alert compares the oldest ready job's age with.
    #[serde(default = "default_wait_slo_ms", skip_serializing_if = "is_default_wait_slo_ms")]
    pub wait_slo_ms: i64,
    /// Jobs in flight per concurrency key and in total (`[queue.limits]`; none by
    /// default).
    #[serde(default, skip_serializing_if = "tally_core::jobs::limits::Limits::is_empty")]
    pub limits: tally_core::jobs::limits::Limits,
    /// The longest window a unique job may hold its key (`unique_for_ms` of a job,
    /// which defaults to this): a broker taking a partition replays this much of
    /// its log. 0 (the default): unique jobs hold their key until they finish.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unique_for_ms: i64,
    /// What a job whose unique key is held does: `refuse` (the default: a
    /// duplicate), `replace` (it takes the place of its key's waiting job) or
    /// `debounce` (as `replace`, and it waits `debounce_ms` after its enqueue, so
    /// a burst of a key runs once). A queue that replaces holds a key only while
    /// its job waits: `unique_for_ms` is then its schedules' window alone.
    #[serde(default, skip_serializing_if = "tally_core::jobs::unique::OnDuplicate::is_refuse")]
    pub on_duplicate: tally_core::jobs::unique::OnDuplicate,
    /// A debounced job's quiet period (`on_duplicate = "debounce"`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub debounce_ms: i64,
    /// Jobs enqueued on a cron schedule (`[[queue.schedule]]`), one per tick
    /// whatever the number of brokers.
    #[serde(rename = "schedule", default, skip_serializing_if = "Vec::is_empty")]
    pub schedules: Vec<crate::schedules::ScheduleDecl>,
}

fn is_zero(ms: &i64) -> bool {
    *ms == 0
}

fn default_priority_levels() -> u8 {
    1
}
fn is_default_priority_levels(levels: &u8) -> bool {
    *levels == default_priority_levels()
}
fn default_priority_aging_ms() -> i64 {
    60_000
}
fn is_default_priority_aging_ms(ms: &i64) -> bool {
    *ms == default_priority_aging_ms()
}

fn default_wait_slo_ms() -> i64 {
    300_000
}
fn is_default_wait_slo_ms(ms: &i64) -> bool {
    *ms == default_wait_slo_ms()
}

fn default_max_lease_ms() -> i64 {
    3_600_000
}
fn is_default_max_lease_ms(ms: &i64) -> bool {
    *ms == default_max_lease_ms()
}
fn default_max_retry_ms() -> i64 {
    86_400_000
}
fn is_default_max_retry_ms(ms: &i64) -> bool {
    *ms == default_max_retry_ms()
}

fn default_max_attempts() -> u32 {
    5
}
fn default_backoff_ms() -> i64 {
    1_000
}
fn default_backoff_max_ms() -> i64 {
    300_000
}
fn default_lease_ms() -> i64 {
    30_000
}
fn default_buffer() -> usize {
    10_000
}
fn default_delayed_buffer() -> usize {
    100_000
}
fn default_buffer_bytes() -> usize {
    64 << 20
}
fn default_queue_retention_ms() -> i64 {
    7 * 86_400_000
}

impl QueueDecl {
    /// The topic producers enqueue to, without the prefix.
    pub fn topic(&self) -> String {
        format!("jobs.{}", self.name)
    }

    /// Where jobs go after `max_attempts`, without the prefix.
    pub fn dead_topic(&self) -> String {
        format!("jobs.{}.dead", self.name)
    }

    /// The furthest a job's `run_at` may lie after its enqueue time: it must still
    /// be in the topic when it runs (and a while after, if it fails), so a job
    /// delayed beyond this is refused to the dead-letter topic rather than lost to
    /// retention on a broker's next restart.
    pub fn max_delay_ms(&self) -> i64 {
        if self.retention_ms <= 0 {
            return i64::MAX; // kept forever (Kafka's -1)
        }
        self.retention_ms - (self.retention_ms / 2).min(3_600_000)
    }

    /// The longest retry delay a nack may ask: the declared `max_retry_ms`, and never
    /// past [`QueueDecl::max_delay_ms`], where the job would leave the topic while it
    /// waits.
    pub fn max_retry_ms(&self) -> i64 {
        self.max_retry_ms.min(self.max_delay_ms())
    }

    /// What the broker's buffer applies.
    pub fn policy(&self) -> tally_core::jobs::partition::QueuePolicy {
        tally_core::jobs::partition::QueuePolicy {
            max_attempts: self.max_attempts.max(1),
            backoff: tally_core::jobs::schedule::RetrySchedule {
                base_ms: self.backoff_ms,
                max_ms: self.backoff_max_ms,
            },
            fifo: self.fifo,
            capacity: self.buffer.max(1),
            delayed_capacity: self.delayed_buffer.max(1),
            max_bytes: self.buffer_bytes.max(1),
            priority_levels: self.priority_levels.max(1),
            priority_aging_ms: self.priority_aging_ms.max(0),
            limits: self.limits.clone(),
            unique_for_ms: self.unique_for_ms,
            on_duplicate: self.on_duplicate,
            debounce_ms: self.debounce_ms,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Declarations {
    #[serde(rename = "topic", default)]
    pub topics: Vec<TopicDecl>,
    /// Job queues; each also adds its two topics to `topics`.
    #[serde(rename = "queue", default)]
    pub queues: Vec<QueueDecl>,
}

/// A queue's schedules: each valid, their names distinct, and the queue holding
/// a tick's unique key long enough for a failover (`unique_for_ms`).
fn check_schedules(queue: &QueueDecl) -> Result<()> {
    let fail = |why: String| Err(Error::Topics(format!("queue {}: {why}", queue.name)));
    if queue.schedules.is_empty() {
        return Ok(());
    }
    if queue.schedules.len() > crate::schedules::MAX_SCHEDULES {
        return fail(format!("at most {} schedules", crate::schedules::MAX_SCHEDULES));
    }
    if queue.unique_for_ms < 60_000 {
        return fail(
            "schedules need unique_for_ms of at least 60000: a tick's job holds its tick for that long, so no \
             broker enqueues it twice (and a missed tick is caught up only while its last run is that recent)"
                .into(),
        );
    }
    let mut names = std::collections::BTreeSet::new();
    for decl in &queue.schedules {
        if let Err(why) = crate::schedules::Schedule::new(decl.clone()) {
            return fail(why);
        }
        if !names.insert(&decl.name) {
            return fail(format!("schedule {:?} is declared twice", decl.name));
        }
        if decl.priority.is_some_and(|level| level >= queue.priority_levels.max(1)) {
            return fail(format!("schedule {}: priority is past the queue's priority_levels", decl.name));
        }
    }
    Ok(())
}

/// A debounced queue's quiet period: given, and within what the topic keeps.
fn check_on_duplicate(queue: &QueueDecl) -> Result<()> {
    use tally_core::jobs::unique::OnDuplicate;
    let debounce = queue.on_duplicate == OnDuplicate::Debounce;
    if debounce && !(1..=queue.max_delay_ms()).contains(&queue.debounce_ms) {
        return Err(Error::Topics(format!(
            "queue {}: on_duplicate = \"debounce\" needs debounce_ms, 1 to {} (the queue's retention less a margin)",
            queue.name,
            queue.max_delay_ms()
        )));
    }
    if !debounce && queue.debounce_ms != 0 {
        return Err(Error::Topics(format!(
            "queue {}: debounce_ms is the quiet period of on_duplicate = \"debounce\"; declare that, or leave \
             debounce_ms out",
            queue.name
        )));
    }
    Ok(())
}

impl Declarations {
    /// Parses one file of declarations as it is (no built-in ones added).
    pub fn parse(text: &str) -> Result<Self> {
        Self::build(toml_from_str(text)?)
    }

    /// Checks declarations and adds each queue's two topics.
    fn build(mut decls: Declarations) -> Result<Self> {
        for queue in &decls.queues {
            let valid = |b: u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-');
            if queue.name.is_empty() || queue.name.len() > 64 || !queue.name.bytes().all(valid) {
                return Err(Error::Topics(format!("queue {:?}: name must match [a-z0-9_-]{{1,64}}", queue.name)));
            }
            if queue.lease_ms < 1 || queue.backoff_ms < 0 || queue.backoff_max_ms < queue.backoff_ms {
                return Err(Error::Topics(format!(
                    "queue {}: lease_ms must be positive, 0 <= backoff_ms <= backoff_max_ms",
                    queue.name
                )));
            }
            if queue.max_lease_ms < queue.lease_ms || queue.max_retry_ms < 0 {
                return Err(Error::Topics(format!(
                    "queue {}: max_lease_ms must be at least lease_ms, max_retry_ms not negative",
                    queue.name
                )));
            }
            if queue.rate_limit_per_sec == Some(0) {
                return Err(Error::Topics(format!(
                    "queue {}: rate_limit_per_sec must be at least 1 (leave it out for no limit)",
                    queue.name
                )));
            }
            queue
                .limits
                .check(queue.partitions)
                .map_err(|err| Error::Topics(format!("queue {}: {err}", queue.name)))?;
            check_schedules(queue)?;
            if !(0..=queue.max_delay_ms()).contains(&queue.unique_for_ms) {
                return Err(Error::Topics(format!(
                    "queue {}: unique_for_ms must be 0 (until a job finishes) to {} (the queue's retention less a \
                     margin: a take-over replays that much of the log)",
                    queue.name,
                    queue.max_delay_ms()
                )));
            }
            check_on_duplicate(queue)?;
            let most = tally_core::jobs::partition::QueuePolicy::MAX_PRIORITY_LEVELS;
            if !(1..=most).contains(&queue.priority_levels) || queue.priority_aging_ms < 0 {
                return Err(Error::Topics(format!(
                    "queue {}: priority_levels must be 1 to {most} (1: no priorities), priority_aging_ms not negative (0: jobs never rise)",
                    queue.name
                )));
            }
            if queue.wait_slo_ms <= 0 {
                return Err(Error::Topics(format!(
                    "queue {}: wait_slo_ms is {}: how long a ready job may wait, in ms (at least 1)",
                    queue.name, queue.wait_slo_ms
                )));
            }
        }
        let queue_topics: Vec<TopicDecl> = decls
            .queues
            .iter()
            .flat_map(|queue| {
                [
                    TopicDecl {
                        name: queue.topic(),
                        partitions: queue.partitions,
                        retention_ms: Some(queue.retention_ms),
                        cleanup_policy: "delete".into(),
                        fixed_partitions: false,
                    },
                    TopicDecl {
                        name: queue.dead_topic(),
                        partitions: 1,
                        retention_ms: Some(30 * 86_400_000),
                        cleanup_policy: "delete".into(),
                        fixed_partitions: false,
                    },
                ]
            })
            .collect();
        decls.topics.extend(queue_topics);
        for topic in &decls.topics {
            if topic.partitions < 1 {
                return Err(Error::Topics(format!("{}: partitions must be at least 1", topic.name)));
            }
            if !matches!(topic.cleanup_policy.as_str(), "delete" | "compact" | "compact,delete") {
                return Err(Error::Topics(format!(
                    "{}: cleanup_policy must be delete, compact or compact,delete",
                    topic.name
                )));
            }
        }
        Ok(decls)
    }

    /// The built-in declarations, with a user's file (`broker.declarations`) on top:
    /// its queues and topics are added, and replace built-in ones of the same name.
    /// A file of `[[queue]]` entries alone is enough.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        let mut decls: Declarations = toml_from_str(BUILTIN)?;
        if let Some(path) = path {
            let text = std::fs::read_to_string(path)
                .map_err(|err| Error::Topics(format!("reading the declarations {}: {err}", path.display())))?;
            let own: Declarations =
                toml_from_str(&text).map_err(|err| Error::Topics(format!("declarations {}: {err}", path.display())))?;
            for topic in own.topics {
                decls.topics.retain(|t| t.name != topic.name);
                decls.topics.push(topic);
            }
            for queue in own.queues {
                decls.queues.retain(|q| q.name != queue.name);
                decls.queues.push(queue);
            }
        }
        Self::build(decls)
    }

    /// Bounds the shard topic's and graph-updates' retention to `ms`, if given
    /// ([`crate::config::SnapshotsConfig::log_retention_ms`]).
    pub fn with_log_retention(mut self, ms: Option<i64>) -> Self {
        if let Some(ms) = ms {
            for topic in self.topics.iter_mut().filter(|t| t.name == "shards" || t.name == "graph-updates") {
                topic.retention_ms = Some(ms);
            }
        }
        self
    }

    pub fn get(&self, name: &str) -> Option<&TopicDecl> {
        self.topics.iter().find(|t| t.name == name)
    }

    pub fn queue(&self, name: &str) -> Option<&QueueDecl> {
        self.queues.iter().find(|q| q.name == name)
    }
}

fn toml_from_str<T: serde::de::DeserializeOwned>(text: &str) -> Result<T> {
    use figment::providers::{Format, Toml};
    figment::Figment::from(Toml::string(text)).extract().map_err(|err| Error::Topics(err.to_string()))
}

/// What applying will do to one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Create {
        topic: String,
        partitions: i32,
    },
    RaisePartitions {
        topic: String,
        from: i32,
        to: i32,
    },
    Unchanged {
        topic: String,
    },
    /// A difference left for an operator.
    Drift {
        topic: String,
        what: String,
    },
}

/// Compares declarations with what exists (`name` → partition count).
pub fn plan(decls: &Declarations, names: &TopicNames, existing: &HashMap<String, i32>) -> Vec<Action> {
    decls
        .topics
        .iter()
        .map(|decl| {
            let topic = names.name(&decl.name);
            match existing.get(&topic).copied() {
                None => Action::Create { topic, partitions: decl.partitions },
                Some(have) if have == decl.partitions => Action::Unchanged { topic },
                Some(have) if have < decl.partitions && !decl.fixed_partitions => {
                    Action::RaisePartitions { topic, from: have, to: decl.partitions }
                }
                Some(have) if decl.fixed_partitions => Action::Drift {
                    topic,
                    what: format!(
                        "has {have} partitions, declared {}; this count cannot change without resharding",
                        decl.partitions
                    ),
                },
                Some(have) => Action::Drift {
                    topic,
                    what: format!(
                        "has {have} partitions, declared {} (Kafka cannot lower a partition count)",
                        decl.partitions
                    ),
                },
            }
        })
        .collect()
}

/// The topic settings `tally topics apply` declares, as the broker names them.
fn declared_configs(decl: &TopicDecl) -> Vec<(&'static str, String)> {
    let mut configs = vec![("cleanup.policy", decl.cleanup_policy.clone())];
    if let Some(ms) = decl.retention_ms {
        configs.push(("retention.ms", ms.to_string()));
    }
    configs
}

/// Compares the declared settings of existing topics with the broker's
/// (`topic` → setting → value): one drift per differing setting. Settings are left
/// for an operator: changing retention or compaction of a live topic can lose data.
pub fn config_drift(
    decls: &Declarations,
    names: &TopicNames,
    existing: &HashMap<String, HashMap<String, String>>,
) -> Vec<Action> {
    let mut drift = Vec::new();
    for decl in &decls.topics {
        let topic = names.name(&decl.name);
        let Some(have) = existing.get(&topic) else { continue };
        for (setting, want) in declared_configs(decl) {
            match have.get(setting) {
                Some(value) if *value == want => {}
                value => drift.push(Action::Drift {
                    topic: topic.clone(),
                    what: format!("{setting} is {}, declared {want}", value.map_or("unset", String::as_str)),
                }),
            }
        }
    }
    drift
}

/// Applies the declarations and returns what was done.
pub async fn apply(kafka: &KafkaConfig, decls: &Declarations) -> Result<Vec<Action>> {
    let names = TopicNames::new(&kafka.topic_prefix);
    let admin: AdminClient<DefaultClientContext> = client_config(kafka)?.create()?;
    let metadata = admin.inner().fetch_metadata(None, Duration::from_secs(10))?;
    let existing: HashMap<String, i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none() && !t.partitions().is_empty())
        .map(|t| (t.name().to_string(), t.partitions().len() as i32))
        .collect();
    let actions = plan(decls, &names, &existing);
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));

    // `plan` yields one action per declaration, in order.
    let retention: Vec<Option<String>> = decls.topics.iter().map(|d| d.retention_ms.map(|ms| ms.to_string())).collect();
    let mut new_topics = Vec::new();
    for ((action, decl), retention_ms) in actions.iter().zip(&decls.topics).zip(&retention) {
        if let Action::Create { topic, partitions } = action {
            let mut new_topic = NewTopic::new(topic, *partitions, TopicReplication::Fixed(-1))
                .set("cleanup.policy", &decl.cleanup_policy);
            if let Some(ms) = retention_ms {
                new_topic = new_topic.set("retention.ms", ms);
            }
            new_topics.push(new_topic);
        }
    }
    if !new_topics.is_empty() {
        for result in admin.create_topics(&new_topics, &options).await? {
            match result {
                Ok(_) => {}
                Err((topic, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {
                    tracing::info!(topic, "topic appeared concurrently");
                }
                Err((topic, code)) => return Err(Error::Topics(format!("creating {topic}: {code}"))),
            }
        }
    }
    let raises: Vec<(String, usize)> = actions
        .iter()
        .filter_map(|a| match a {
            Action::RaisePartitions { topic, to, .. } => Some((topic.clone(), *to as usize)),
            _ => None,
        })
        .collect();
    let raises: Vec<NewPartitions> = raises.iter().map(|(topic, to)| NewPartitions::new(topic, *to)).collect();
    let mut actions = actions;
    if !raises.is_empty() {
        match admin.create_partitions(&raises, &options).await {
            Ok(results) => {
                for result in results {
                    if let Err((topic, code)) = result {
                        return Err(Error::Topics(format!("raising partitions of {topic}: {code}")));
                    }
                }
            }
            // Some Kafka-protocol brokers (Tansu 0.6) cannot add partitions.
            Err(rdkafka::error::KafkaError::AdminOp(rdkafka::types::RDKafkaErrorCode::UnsupportedFeature)) => {
                for action in &mut actions {
                    if let Action::RaisePartitions { topic, from, to } = action {
                        let what = format!("has {from} partitions, declared {to}; this broker cannot add partitions");
                        *action = Action::Drift { topic: std::mem::take(topic), what };
                    }
                }
            }
            Err(err) => return Err(err.into()),
        }
    }
    wait_until_visible(&admin, &actions).await;
    actions.extend(config_drift(decls, &names, &existing_configs(&admin, &actions, &options).await?));
    publish_queues(kafka, decls, &existing).await?;
    Ok(actions)
}

/// The version of [`QueueRecord`], the format of the declarations topic.
pub const QUEUE_RECORD_VERSION: u32 = 1;

/// A record of the compacted declarations topic (`tally.queues`, keyed by queue
/// name): what running brokers follow to serve a queue declared, or changed, since
/// they started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRecord {
    pub version: u32,
    pub queue: QueueDecl,
}

impl QueueRecord {
    pub fn encode(queue: &QueueDecl) -> Result<Vec<u8>> {
        let record = QueueRecord { version: QUEUE_RECORD_VERSION, queue: queue.clone() };
        serde_json::to_vec(&record).map_err(|err| Error::Topics(err.to_string()))
    }

    /// A declaration, or an error for bytes that are not one of a version this
    /// release reads.
    pub fn decode(bytes: &[u8]) -> Result<QueueDecl> {
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let Versioned { version } =
            serde_json::from_slice(bytes).map_err(|err| Error::Topics(format!("queue declaration: {err}")))?;
        if version != QUEUE_RECORD_VERSION {
            return Err(Error::Topics(format!(
                "queue declaration of version {version}; this release reads version {QUEUE_RECORD_VERSION}"
            )));
        }
        let record: QueueRecord =
            serde_json::from_slice(bytes).map_err(|err| Error::Topics(format!("queue declaration: {err}")))?;
        Ok(record.queue)
    }
}

/// Writes every queue declaration to the declarations topic, for running brokers —
/// but one that declares fewer partitions than its topic has (`existing`, before
/// this apply): brokers would stop serving the partitions above it while producers
/// still write to them. That drift is reported, and left for an operator.
async fn publish_queues(kafka: &KafkaConfig, decls: &Declarations, existing: &HashMap<String, i32>) -> Result<()> {
    let names = TopicNames::new(&kafka.topic_prefix);
    let topic = names.queues();
    let producer: FutureProducer = crate::kafka::producer_config(kafka)?.create()?;
    let mut records: Vec<(String, Vec<u8>)> = Vec::new();
    for queue in &decls.queues {
        match existing.get(&names.jobs(&queue.name)) {
            Some(&have) if have > queue.partitions => tracing::warn!(
                queue = %queue.name, have, declared = queue.partitions,
                "not publishing a declaration with fewer partitions than the queue's topic has"
            ),
            _ => records.push((queue.name.clone(), QueueRecord::encode(queue)?)),
        }
    }
    let sends = records.iter().map(|(key, payload)| {
        producer.send(FutureRecord::to(&topic).key(key).payload(payload), Duration::from_secs(10))
    });
    let wait = Duration::from_secs(30);
    let results = tokio::time::timeout(wait, futures::future::join_all(sends)).await.map_err(|_| {
        Error::Topics(format!("publishing queue declarations to {topic}: not acknowledged in {wait:?}"))
    })?;
    for result in results {
        result.map_err(|(err, _)| Error::Topics(format!("publishing queue declarations to {topic}: {err}")))?;
    }
    Ok(())
}

/// The current settings of the topics that existed before this apply.
async fn existing_configs(
    admin: &AdminClient<DefaultClientContext>,
    actions: &[Action],
    options: &AdminOptions,
) -> Result<HashMap<String, HashMap<String, String>>> {
    let topics: Vec<&str> = actions
        .iter()
        .filter_map(|action| match action {
            Action::Unchanged { topic } | Action::RaisePartitions { topic, .. } | Action::Drift { topic, .. } => {
                Some(topic.as_str())
            }
            Action::Create { .. } => None,
        })
        .collect();
    let (configs, failure) = describe(admin, &topics, options).await?;
    if let Some(code) = failure {
        tracing::warn!(%code, "cannot read topic settings; config drift not checked");
    }
    Ok(configs)
}

/// The settings of `topics` as the broker reports them, and the error of one it
/// could not describe, if any.
async fn describe(
    admin: &AdminClient<DefaultClientContext>,
    topics: &[&str],
    options: &AdminOptions,
) -> Result<(HashMap<String, HashMap<String, String>>, Option<rdkafka::types::RDKafkaErrorCode>)> {
    let mut configs = HashMap::new();
    if topics.is_empty() {
        return Ok((configs, None));
    }
    let specifiers: Vec<ResourceSpecifier<'_>> = topics.iter().map(|topic| ResourceSpecifier::Topic(topic)).collect();
    let mut failure = None;
    for result in admin.describe_configs(&specifiers, options).await? {
        match result {
            Ok(resource) => {
                let OwnedResourceSpecifier::Topic(topic) = resource.specifier else { continue };
                let values =
                    resource.entries.into_iter().filter_map(|entry| Some((entry.name, entry.value?))).collect();
                configs.insert(topic, values);
            }
            Err(code) => failure = Some(code),
        }
    }
    Ok((configs, failure))
}

/// One topic's settings as the broker reports them (`retention.ms`, …).
pub async fn settings(kafka: &KafkaConfig, topic: &str) -> Result<HashMap<String, String>> {
    let admin: AdminClient<DefaultClientContext> = client_config(kafka)?.create()?;
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    match describe(&admin, &[topic], &options).await? {
        (mut configs, None) => {
            configs.remove(topic).ok_or_else(|| Error::Topics(format!("{topic}: no settings reported")))
        }
        (_, Some(code)) => Err(Error::Topics(format!("{topic}: settings not described: {code}"))),
    }
}

/// Metadata of new topics can lag behind their creation; wait a little for it.
async fn wait_until_visible(admin: &AdminClient<DefaultClientContext>, actions: &[Action]) {
    for action in actions {
        let Action::Create { topic, partitions } = action else { continue };
        for _ in 0..40 {
            let visible = admin
                .inner()
                .fetch_metadata(Some(topic), Duration::from_secs(5))
                .map(|m| m.topics().iter().any(|t| t.name() == topic && t.partitions().len() == *partitions as usize))
                .unwrap_or(false);
            if visible {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_declarations_parse() {
        let decls = Declarations::parse(BUILTIN).unwrap();
        for name in ["increments", "dead-letter", "shards", "rollups", "shard-owners"] {
            assert!(decls.get(name).is_some(), "{name} is declared");
        }
        let shards = decls.get("shards").unwrap();
        assert!(shards.fixed_partitions);
        // Kept "forever" unless bounded by the config, never -1 (which the local
        // broker's retention sweep reads as "delete everything").
        let forever = Some(3_153_600_000_000);
        assert_eq!((shards.retention_ms, decls.get("graph-updates").unwrap().retention_ms), (forever, forever));
        let bounded = decls.clone().with_log_retention(Some(5));
        let retention = |name| bounded.get(name).unwrap().retention_ms;
        assert_eq!(
            (retention("shards"), retention("graph-updates"), retention("increments")),
            (Some(5), Some(5), Some(604_800_000))
        );
    }

    #[test]
    fn queue_records_carry_a_version_and_round_trip() {
        let decls = Declarations::load(None).unwrap();
        let queue = decls.queue("default").unwrap();
        let bytes = QueueRecord::encode(queue).unwrap();
        assert_eq!(&QueueRecord::decode(&bytes).unwrap(), queue);
        // Golden bytes of version 1: a change that breaks old records fails here.
        let golden = br#"{"version":1,"queue":{"name":"q","partitions":2,"rate_limit_per_sec":5,"fifo":true,"max_attempts":3,"backoff_ms":10,"backoff_max_ms":20,"lease_ms":30,"buffer":40,"delayed_buffer":50,"buffer_bytes":60,"retention_ms":70}}"#;
        let decoded = QueueRecord::decode(golden).unwrap();
        assert_eq!(
            (decoded.name.as_str(), decoded.partitions, decoded.rate_limit_per_sec, decoded.buffer_bytes),
            ("q", 2, Some(5), 60)
        );
        assert_eq!(QueueRecord::encode(&decoded).unwrap(), golden.to_vec());
        let newer = br#"{"version":2,"queue":{}}"#;
        assert!(QueueRecord::decode(newer).unwrap_err().to_string().contains("version 2"));
        assert!(QueueRecord::decode(b"junk").is_err());
    }

    #[test]
    fn a_file_of_queues_alone_adds_to_the_builtin_declarations() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("queues.toml");
        std::fs::write(&path, "[[queue]]\nname = \"emails\"\npartitions = 2\nfifo = true\n[[queue]]\nname = \"default\"\npartitions = 9\n").unwrap();
        let decls = Declarations::load(Some(&path)).unwrap();
        let builtin = Declarations::load(None).unwrap();
        for topic in ["shards", "increments", "rollups", "jobs.emails", "jobs.emails.dead", "jobs.default"] {
            assert!(decls.get(topic).is_some(), "{topic}");
        }
        assert_eq!(decls.topics.len(), builtin.topics.len() + 2);
        let names: Vec<&str> = decls.queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(names, vec!["emails", "default"]);
        assert_eq!(decls.queue("default").unwrap().partitions, 9, "the file's queue replaces the built-in one");
        assert_eq!(decls.get("jobs.default").unwrap().partitions, 9);
        assert!(decls.queue("emails").unwrap().fifo);
        std::fs::write(&path, "[[queue]]\nname = \"x\"\npartitons = 2\n").unwrap();
        let err = Declarations::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("queues.toml") && err.contains("partitons"), "{err}");
    }

    #[test]
    fn queues_add_their_topics_and_policies() {
        let decls = Declarations::parse(
            "[[topic]]\nname='a'\npartitions=1\ncleanup_policy='delete'\n\
             [[queue]]\nname='emails'\npartitions=4\nfifo=true\nrate_limit_per_sec=50\nmax_attempts=3\n",
        )
        .unwrap();
        let queue = decls.queue("emails").unwrap();
        assert_eq!((queue.partitions, queue.lease_ms, queue.buffer), (4, 30_000, 10_000));
        assert!(queue.policy().fifo);
        assert_eq!(queue.policy().max_attempts, 3);
        assert_eq!(decls.get("jobs.emails").unwrap().partitions, 4);
        assert_eq!(decls.get("jobs.emails.dead").unwrap().partitions, 1);
        assert!(Declarations::parse(
            "[[topic]]\nname='a'\npartitions=1\ncleanup_policy='delete'\n[[queue]]\nname='Bad Name'\npartitions=1\n"
        )
        .is_err());
        assert!(Declarations::parse("[[topic]]\nname='a'\npartitions=1\ncleanup_policy='delete'\n[[queue]]\nname='q'\npartitions=1\nlease_ms=0\n").is_err());
        let zero_rate = "[[topic]]\nname='a'\npartitions=1\ncleanup_policy='delete'\n[[queue]]\nname='q'\npartitions=1\nrate_limit_per_sec=0\n";
        assert!(Declarations::parse(zero_rate)
            .unwrap_err()
            .to_string()
            .contains("rate_limit_per_sec must be at least 1"));
    }

    #[test]
    fn priority_levels_are_declared_within_bounds() {
        let queue = |extra: &str| format!("[[queue]]\nname='q'\npartitions=1\n{extra}");
        let ranked = Declarations::parse(&queue("priority_levels=3\npriority_aging_ms=5000\n")).unwrap();
        let policy = ranked.queue("q").unwrap().policy();
        assert_eq!((policy.priority_levels, policy.priority_aging_ms), (3, 5_000));
        let plain = Declarations::parse(&queue("")).unwrap().queue("q").unwrap().policy();
        assert_eq!((plain.priority_levels, plain.priority_aging_ms), (1, 60_000));
        for bad in ["priority_levels=0\n", "priority_levels=11\n", "priority_aging_ms=-1\n"] {
            let err = Declarations::parse(&queue(bad)).unwrap_err().to_string();
            assert!(err.contains("queue q: priority_levels must be 1 to 10"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_queues_wait_objective_is_five_minutes_unless_declared() {
        let queue = |extra: &str| format!("[[queue]]\nname='q'\npartitions=1\n{extra}");
        let slo = |extra: &str| Declarations::parse(&queue(extra)).map(|d| d.queue("q").unwrap().wait_slo_ms);
        assert_eq!(slo("").unwrap(), 300_000);
        assert_eq!(slo("wait_slo_ms=1200000\n").unwrap(), 1_200_000);
        for bad in ["wait_slo_ms=0\n", "wait_slo_ms=-5\n"] {
            let err = slo(bad).unwrap_err().to_string();
            assert!(err.contains("queue q: wait_slo_ms is"), "{bad}: {err}");
        }
        // Left out when written with the default (older brokers read it).
        let written = serde_json::to_value(Declarations::parse(&queue("")).unwrap().queue("q").unwrap()).unwrap();
        assert!(written.get("wait_slo_ms").is_none(), "{written}");
    }

    #[test]
    fn duplicates_are_refused_replaced_or_debounced_as_declared() {
        use tally_core::jobs::unique::OnDuplicate;
        let queue = |extra: &str| format!("[[queue]]\nname='q'\npartitions=1\n{extra}");
        let policy = |extra: &str| Declarations::parse(&queue(extra)).unwrap().queue("q").unwrap().policy();
        let of = |extra: &str| (policy(extra).on_duplicate, policy(extra).debounce_ms);
        assert_eq!(of(""), (OnDuplicate::Refuse, 0));
        assert_eq!(of("on_duplicate='replace'\n"), (OnDuplicate::Replace, 0));
        assert_eq!(of("on_duplicate='debounce'\ndebounce_ms=5000\n"), (OnDuplicate::Debounce, 5_000));
        for (bad, why) in [
            ("on_duplicate='debounce'\n", "on_duplicate = \"debounce\" needs debounce_ms, 1 to"),
            ("on_duplicate='debounce'\ndebounce_ms=-1\n", "needs debounce_ms"),
            ("on_duplicate='debounce'\ndebounce_ms=999999999999\n", "needs debounce_ms"),
            ("debounce_ms=5000\n", "debounce_ms is the quiet period of on_duplicate = \"debounce\""),
            ("on_duplicate='replace'\ndebounce_ms=5000\n", "debounce_ms is the quiet period"),
            ("on_duplicate='drop'\n", "found `drop`, expected `one of `refuse`, `replace`, `debounce``"),
        ] {
            let err = Declarations::parse(&queue(bad)).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_declarations_are_rejected() {
        assert!(Declarations::parse("[[topic]]\nname='a'\npartitions=0\ncleanup_policy='delete'\n").is_err());
        assert!(Declarations::parse("[[topic]]\nname='a'\npartitions=1\ncleanup_policy='keep'\n").is_err());
        assert!(Declarations::parse("[[topic]]\nname='a'\npartitions=1\ncleanup_policy='compact,keep'\n").is_err());
        let both = Declarations::parse("[[topic]]\nname='a'\npartitions=1\ncleanup_policy='compact,delete'\n");
        assert_eq!(both.unwrap().topics[0].cleanup_policy, "compact,delete");
        assert!(Declarations::parse("[[topic]]\nname='a'\npartitions=1\ncleanup_policy='delete'\ncolour=1\n").is_err());
    }

    #[test]
    fn plan_creates_raises_and_reports_drift() {
        let decls = Declarations::parse(
            "[[topic]]\nname='new'\npartitions=2\ncleanup_policy='delete'\n\
             [[topic]]\nname='same'\npartitions=2\ncleanup_policy='delete'\n\
             [[topic]]\nname='grow'\npartitions=4\ncleanup_policy='delete'\n\
             [[topic]]\nname='shrink'\npartitions=1\ncleanup_policy='delete'\n\
             [[topic]]\nname='fixed'\npartitions=8\ncleanup_policy='delete'\nfixed_partitions=true\n",
        )
        .unwrap();
        let names = TopicNames::new("p.");
        let existing: HashMap<String, i32> = [("p.same", 2), ("p.grow", 2), ("p.shrink", 3), ("p.fixed", 4)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let actions = plan(&decls, &names, &existing);
        assert_eq!(actions[0], Action::Create { topic: "p.new".into(), partitions: 2 });
        assert_eq!(actions[1], Action::Unchanged { topic: "p.same".into() });
        assert_eq!(actions[2], Action::RaisePartitions { topic: "p.grow".into(), from: 2, to: 4 });
        assert!(matches!(&actions[3], Action::Drift { what, .. } if what.contains("cannot lower")));
        assert!(matches!(&actions[4], Action::Drift { what, .. } if what.contains("resharding")));
    }

    #[test]
    fn config_drift_names_each_differing_setting() {
        let decls = Declarations::parse(
            "[[topic]]\nname='kept'\npartitions=1\ncleanup_policy='delete'\nretention_ms=100\n\
             [[topic]]\nname='wrong'\npartitions=1\ncleanup_policy='compact'\nretention_ms=100\n\
             [[topic]]\nname='absent'\npartitions=1\ncleanup_policy='delete'\n",
        )
        .unwrap();
        let names = TopicNames::new("p.");
        let settings = |policy: &str, retention: &str| -> HashMap<String, String> {
            [("cleanup.policy", policy), ("retention.ms", retention)].map(|(k, v)| (k.into(), v.into())).into()
        };
        let existing: HashMap<String, HashMap<String, String>> =
            [("p.kept".to_string(), settings("delete", "100")), ("p.wrong".to_string(), settings("delete", "-1"))]
                .into();
        let drift = config_drift(&decls, &names, &existing);
        assert_eq!(
            drift,
            vec![
                Action::Drift { topic: "p.wrong".into(), what: "cleanup.policy is delete, declared compact".into() },
                Action::Drift { topic: "p.wrong".into(), what: "retention.ms is -1, declared 100".into() },
            ]
        );
    }
}
