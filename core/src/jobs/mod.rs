//! Job queues: the pure parts of a dequeue broker and the job format.
//!
//! - [`schedule`]: the retry schedule (exponential backoff between attempts);
//! - [`partition`]: one queue partition's buffer: leases, retries, delays, the FIFO
//!   gate, priority levels with aging, and the commit watermark that never passes an
//!   unfinished job.
//!
//! They know nothing of Kafka, HTTP or clocks: time is passed in, so the property
//! tests can drive them through any history.

pub mod api;
pub mod cron;
pub mod limits;
pub mod partition;
pub mod schedule;
pub mod unique;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::records::{truncate_utf8, Truncated};
use crate::validate::check_id;

/// A job as producers enqueue it on `tally.jobs.<queue>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    pub id: String,
    /// Any JSON, handed to the worker as is.
    pub payload: Box<RawValue>,
    /// Not handed out before this time (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_at: Option<i64>,
    /// FIFO queues run one job of a key at a time, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Its level on a queue that declares priority levels: 0 (the default, lowest)
    /// to the queue's `priority_levels - 1`; a ready job of a higher level is handed
    /// out before any lower one of its partition ([`partition`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// Its concurrency key on a queue that limits jobs in flight per key
    /// ([`limits`]); the queue's `limits.key_field` of the payload when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key: Option<String>,
    /// Accepted once: a later job of this key is a duplicate while this one holds
    /// it ([`unique`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unique_key: Option<String>,
    /// How long the key is held after the enqueue (at most the queue's
    /// `unique_for_ms`, its default); 0: until the job finishes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unique_for_ms: Option<i64>,
    /// A tick of a queue's schedule, enqueued by a broker: unique by schedule and
    /// time; every tick of a schedule lives in one partition (the broker's
    /// `placement::schedule_partition`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tick: Option<Tick>,
    /// The trace its record carried (not part of the job's JSON: a header).
    #[serde(skip)]
    pub trace: Option<JobTrace>,
}

/// The trace an enqueued job belongs to: its record's `traceparent` and when it was
/// enqueued. A broker's span of each handout runs from then, a child of this context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobTrace {
    pub parent: crate::trace::TraceContext,
    pub enqueued_at_ms: i64,
}

/// Which schedule enqueued a job, for which time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tick {
    pub schedule: String,
    /// The time it fires for (ms since the epoch).
    pub at: i64,
}

impl Tick {
    /// The unique key of the tick's job.
    pub fn unique_key(&self) -> String {
        format!("schedule/{}/{}", self.schedule, self.at)
    }

    /// What decides the partition of every tick of `schedule` (unless its payload
    /// names a concurrency key on a per-key limited queue).
    pub fn partition_key(schedule: &str) -> String {
        format!("schedule/{schedule}")
    }
}

impl PartialEq for Job {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
            && self.payload.get() == other.payload.get()
            && self.run_at == other.run_at
            && self.key == other.key
            && self.priority == other.priority
            && self.concurrency_key == other.concurrency_key
            && self.unique_key == other.unique_key
            && self.unique_for_ms == other.unique_for_ms
            && self.tick == other.tick
    }
}

impl Job {
    /// The key that makes it unique: its own, or its tick's.
    pub fn unique_key(&self) -> Option<std::borrow::Cow<'_, str>> {
        match (&self.unique_key, &self.tick) {
            (Some(key), _) => Some(std::borrow::Cow::Borrowed(key)),
            (None, Some(tick)) => Some(std::borrow::Cow::Owned(tick.unique_key())),
            (None, None) => None,
        }
    }

    /// Parses and checks an enqueued job; the error is the reason for the dead-letter topic.
    pub fn parse(bytes: &[u8]) -> Result<Job, String> {
        let text = std::str::from_utf8(bytes).map_err(|err| format!("job: not UTF-8 ({err})"))?;
        let job: Job = crate::input::parse_naming_the_field(text, "job")?;
        check_id(&job.id)?;
        if job.key.as_ref().is_some_and(|key| key.is_empty() || key.len() > 256) {
            return Err("key: must be 1-256 bytes".into());
        }
        if job.concurrency_key.as_ref().is_some_and(|key| key.is_empty() || key.len() > limits::MAX_KEY_BYTES) {
            return Err(format!("concurrency_key: must be 1-{} bytes", limits::MAX_KEY_BYTES));
        }
        if job.unique_key.as_ref().is_some_and(|key| key.is_empty() || key.len() > limits::MAX_KEY_BYTES) {
            return Err(format!("unique_key: must be 1-{} bytes", limits::MAX_KEY_BYTES));
        }
        if job.unique_for_ms.is_some_and(|ms| ms < 0) {
            return Err("unique_for_ms: must not be negative (0: until the job finishes)".into());
        }
        if job.unique_for_ms.is_some() && job.unique_key.is_none() {
            return Err("unique_for_ms: needs a unique_key".into());
        }
        if let Some(tick) = &job.tick {
            check_id(&tick.schedule).map_err(|why| format!("tick.schedule: {why}"))?;
            if job.unique_key.is_some() {
                return Err("tick: a schedule's job is unique by its tick; it takes no unique_key".into());
            }
        }
        if job.run_at.is_some_and(|at| at < 0) {
            return Err("run_at: must be milliseconds since the epoch (>= 0)".into());
        }
        Ok(job)
    }
}

/// An operator's cancellation of a job, on the compacted `tally.jobs-cancelled`
/// keyed by [`JobCancel::key`]: every broker follows it, so a job cancelled
/// before it is fetched never runs either. A revoked one (written when the
/// cancelled job is requeued) cancels nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobCancel {
    /// Format version ([`crate::format::JSON_V1`]).
    pub v: u32,
    pub queue: String,
    pub id: String,
    pub at_ms: i64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub revoked: bool,
}

impl JobCancel {
    pub fn new(queue: &str, id: &str, at_ms: i64) -> Self {
        Self { v: crate::format::JSON_V1, queue: queue.to_string(), id: id.to_string(), at_ms, revoked: false }
    }

    /// Takes the cancellation of job `id` back: a job of this id runs again.
    pub fn revoke(queue: &str, id: &str, at_ms: i64) -> Self {
        Self { revoked: true, ..Self::new(queue, id, at_ms) }
    }

    /// The record key: one cancellation per job survives compaction.
    pub fn key(&self) -> String {
        format!("{}/{}", self.queue, self.id)
    }

    /// Decodes a cancellation of the current format.
    pub fn decode(bytes: &[u8]) -> crate::Result<Self> {
        crate::format::decode_json(bytes, "job cancellation", |cancel: &Self| cancel.v)
    }
}

/// A record of `tally.jobs.<queue>.dead`: the job and why it gave up.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeadJob {
    /// Format version ([`crate::format::JSON_V1`]).
    pub v: u32,
    pub queue: String,
    pub partition: i32,
    pub offset: i64,
    pub attempts: u32,
    pub error: String,
    pub job: Job,
    /// What was cut to fit the broker's record limit (`error`, or the job's
    /// `payload`, which is then a string of its first bytes): field → original
    /// length in bytes. A job whose payload was cut cannot be requeued as it was.
    #[serde(default, skip_serializing_if = "Truncated::is_empty")]
    pub truncated: Truncated,
}

/// What an operator decided about a dead job, on the compacted
/// `tally.dead-jobs-resolved` topic keyed by [`DeadJobDecision::key`]: a decided
/// job is no longer listed as dead (the dead topic itself is never rewritten).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadJobDecision {
    /// Format version ([`crate::format::JSON_V1`]).
    pub v: u32,
    pub queue: String,
    /// The dead job's place in `tally.jobs.<queue>` (what identifies it).
    pub partition: i32,
    pub offset: i64,
    pub action: DeadJobAction,
    pub at_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadJobAction {
    /// Enqueued again on `tally.jobs.<queue>` (attempts start over).
    Requeued,
    /// Dropped for good.
    Discarded,
}

impl DeadJobDecision {
    pub fn new(queue: &str, partition: i32, offset: i64, action: DeadJobAction, at_ms: i64) -> Self {
        Self { v: crate::format::JSON_V1, queue: queue.to_string(), partition, offset, action, at_ms }
    }

    /// The record key: one decision per dead job survives compaction.
    pub fn key(queue: &str, partition: i32, offset: i64) -> String {
        format!("{queue}/{partition}/{offset}")
    }

    /// Decodes a decision of the current format.
    pub fn decode(bytes: &[u8]) -> crate::Result<Self> {
        crate::format::decode_json(bytes, "dead-job decision", |decision: &Self| decision.v)
    }
}

impl DeadJob {
    /// Decodes a dead job of the current format.
    pub fn decode(bytes: &[u8]) -> crate::Result<Self> {
        crate::format::decode_json(bytes, "dead job", |dead: &Self| dead.v)
    }

    /// The JSON record in at most `budget` bytes: the error is cut first, then —
    /// only if the job alone is too big — its payload.
    pub fn encode(mut self, budget: usize) -> serde_json::Result<Vec<u8>> {
        let whole = serde_json::to_vec(&self)?;
        if whole.len() <= budget {
            return Ok(whole);
        }
        let error = std::mem::take(&mut self.error);
        self.truncated.insert("error".into(), error.len());
        let without_error = serde_json::to_vec(&self)?.len();
        if without_error + 64 < budget {
            self.error = fit(&error, budget - without_error, |text| {
                serde_json::to_vec(&serde_json::Value::from(text)).map(|v| v.len()).unwrap_or(usize::MAX)
            })
            .to_string();
            return serde_json::to_vec(&self);
        }
        self.error = fit(&error, 1_024, |text| text.len() * 6 + 2).to_string();
        let payload = self.job.payload.get().to_string();
        self.truncated.insert("payload".into(), payload.len());
        self.job.payload = serde_json::value::to_raw_value("")?;
        let rest = serde_json::to_vec(&self)?.len();
        let kept = fit(&payload, budget.saturating_sub(rest + 64), |text| {
            serde_json::to_vec(&serde_json::Value::from(text)).map(|v| v.len()).unwrap_or(usize::MAX)
        });
        self.job.payload = serde_json::value::to_raw_value(kept)?;
        serde_json::to_vec(&self)
    }
}

/// The longest prefix of `text` whose encoded size (`size_of`) is within `room`.
fn fit(text: &str, room: usize, size_of: impl Fn(&str) -> usize) -> &str {
    let mut keep = room.min(text.len());
    loop {
        let candidate = truncate_utf8(text, keep);
        let size = size_of(candidate);
        if size <= room || keep == 0 {
            return candidate;
        }
        // Escapes make the encoding longer than the text: shrink in proportion.
        let scaled = (keep as u128 * room as u128 / size as u128) as usize;
        keep = scaled.min(keep.saturating_sub(16));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_parse_and_bad_ones_say_why() {
        let job = Job::parse(br#"{"id":"job-1","payload":{"to":"a@b"},"run_at":5,"key":"user:7"}"#).unwrap();
        assert_eq!(
            (job.id.as_str(), job.payload.get(), job.run_at, job.key.as_deref()),
            ("job-1", r#"{"to":"a@b"}"#, Some(5), Some("user:7"))
        );
        assert!(Job::parse(br#"{"payload":1}"#).unwrap_err().contains("missing field `id`"));
        assert_eq!(Job::parse(br#"{"id":"","payload":1}"#).unwrap_err(), "id: must be 1-128 bytes");
        assert!(Job::parse(br#"{"id":"j","payload":1,"colour":2}"#).unwrap_err().contains("unknown field"));
        assert!(Job::parse(br#"{"id":"j","payload":1,"run_at":-1}"#).is_err());
        assert!(Job::parse(b"not json").is_err());
        let level = |text: &str| Job::parse(format!(r#"{{"id":"j","payload":1,"priority":{text}}}"#).as_bytes());
        assert_eq!(level("2").unwrap().priority, Some(2));
        assert!(level("256").unwrap_err().contains("priority"), "past a byte");
        assert!(level("-1").unwrap_err().contains("priority"));
        assert!(level(r#""high""#).unwrap_err().contains("priority"));
        assert!(Job::parse(b"\xff").unwrap_err().starts_with("job: not UTF-8"));
    }

    fn dead(payload_bytes: usize, error_bytes: usize) -> DeadJob {
        let payload = serde_json::json!({"blob": "p\n".repeat(payload_bytes / 2)});
        DeadJob {
            v: crate::format::JSON_V1,
            queue: "q".into(),
            partition: 1,
            offset: 2,
            attempts: 3,
            error: "e\"".repeat(error_bytes / 2),
            job: Job {
                id: "j".into(),
                payload: serde_json::value::to_raw_value(&payload).unwrap(),
                run_at: None,
                key: None,
                priority: None,
                concurrency_key: None,
                unique_key: None,
                unique_for_ms: None,
                tick: None,
                trace: None,
            },
            truncated: Truncated::new(),
        }
    }

    #[test]
    fn dead_jobs_fit_the_budget_cutting_the_error_first() {
        let small = dead(100, 100);
        let bytes = small.clone().encode(10_000).unwrap();
        let back: DeadJob = serde_json::from_slice(&bytes).unwrap();
        assert_eq!((back.error, back.truncated), (small.error, Truncated::new()));

        let long_error = dead(20_000, 2_000_000);
        let payload = long_error.job.payload.get().to_string();
        let bytes = long_error.encode(100_000).unwrap();
        assert!(bytes.len() <= 100_000, "{}", bytes.len());
        let back: DeadJob = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back.job.payload.get(), payload, "the job is whole");
        assert_eq!(back.truncated, Truncated::from([("error".to_string(), 2_000_000)]));
        assert!(bytes.len() > 95_000, "the error keeps what fits: {}", bytes.len());
        assert!(back.error.starts_with("e\"e\""), "{}", &back.error[..10]);

        let huge_job = dead(400_000, 10);
        let bytes = huge_job.encode(100_000).unwrap();
        assert!(bytes.len() <= 100_000, "{}", bytes.len());
        let back: DeadJob = serde_json::from_slice(&bytes).unwrap();
        assert!(back.truncated.contains_key("payload"));
        assert!(back.job.payload.get().starts_with("\"{\\\"blob\\\""), "{}", &back.job.payload.get()[..20]);
    }
}
