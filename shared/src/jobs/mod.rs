//! Job queues (SPEC §6): the pure parts of a dequeue broker and the job format.
//!
//! - [`schedule`]: the retry schedule (exponential backoff between attempts);
//! - [`partition`]: one queue partition's buffer: leases, retries, delays, the FIFO
//!   gate and the commit watermark that never passes an unfinished job.
//!
//! They know nothing of Kafka, HTTP or clocks: time is passed in, so the property
//! tests can drive them through any history.

pub mod api;
pub mod assignment;
pub mod partition;
pub mod schedule;
pub mod worker;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

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
}

impl PartialEq for Job {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
            && self.payload.get() == other.payload.get()
            && self.run_at == other.run_at
            && self.key == other.key
    }
}

impl Job {
    /// Parses and checks an enqueued job; the error is the reason for the dead-letter topic.
    pub fn parse(bytes: &[u8]) -> Result<Job, String> {
        let job: Job = serde_json::from_slice(bytes).map_err(|err| format!("job: {err}"))?;
        check_id(&job.id)?;
        if let Some(key) = &job.key {
            if key.is_empty() || key.len() > 256 {
                return Err("key: must be 1-256 bytes".into());
            }
        }
        if job.run_at.is_some_and(|at| at < 0) {
            return Err("run_at: must be milliseconds since the epoch (>= 0)".into());
        }
        Ok(job)
    }
}

/// A record of `tally.jobs.<queue>.dead`: the job and why it gave up.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeadJob {
    pub queue: String,
    pub partition: i32,
    pub offset: i64,
    pub attempts: u32,
    pub error: String,
    pub job: Job,
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
    }
}
