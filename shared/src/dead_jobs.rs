//! Dead jobs as operators handle them (the jobs console through the brokers, and
//! `tally jobs dead`): a queue's dead jobs nobody decided about yet, and requeueing
//! or discarding them. A decision is a record on the compacted `dead-jobs-resolved`
//! topic keyed by the job's place in its queue; the dead topic itself is never
//! rewritten, so its downstream readers still see every job that died.
//!
//! Listing reads the queue's dead topic and the decisions to their ends on every
//! call: meant for the hundreds or thousands of dead jobs an operator looks at, not
//! for millions.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_core::jobs::{DeadJob, DeadJobAction, DeadJobDecision};

use crate::config::KafkaConfig;
use crate::kafka::{now_ms, read_to_end, unstamped_producer_config, TopicNames};
use crate::{Error, Result};

/// How long reading a topic to its end or producing one record may take.
const WAIT: Duration = Duration::from_secs(15);

/// The undecided dead jobs of a queue, by their place in the queue (partition,
/// offset); a job that died twice at the same place (its broker was killed before
/// it committed) is listed once.
#[derive(Debug, Default)]
pub struct Listing {
    pub jobs: Vec<DeadJob>,
    /// Records of the dead topic this build cannot read: counted, never hidden.
    pub unreadable: usize,
}

/// What [`DeadJobs::decide_all`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decided {
    pub decided: usize,
    /// Places with no undecided dead job (never dead, or decided already).
    pub not_found: Vec<(i32, i64)>,
    /// Jobs that cannot take the action, and why.
    pub refused: Vec<((i32, i64), String)>,
    /// Why deciding stopped before the end (Kafka failing), after `decided` jobs.
    pub failed: Option<String>,
}

pub struct DeadJobs {
    kafka: KafkaConfig,
    names: TopicNames,
    producer: FutureProducer,
    deciding: tokio::sync::Mutex<()>,
}

impl DeadJobs {
    pub fn new(kafka: &KafkaConfig, names: TopicNames) -> Result<Self> {
        let producer = unstamped_producer_config(kafka)?.create()?;
        Ok(Self { kafka: kafka.clone(), names, producer, deciding: tokio::sync::Mutex::new(()) })
    }

    /// The queue's dead jobs without a decision. Blocking: reads two topics.
    pub fn undecided(&self, queue: &str) -> Result<Listing> {
        let mut decided: HashSet<(i32, i64)> = HashSet::new();
        for (position, record) in read_to_end(&self.kafka, &self.names.dead_jobs_resolved(), WAIT)?.iter().enumerate() {
            if record.is_empty() {
                continue; // a tombstone: an operator removed a decision on purpose
            }
            // Fails closed: a decision skipped would list its job as undecided
            // again, and a requeued job could be requeued twice.
            let decision = DeadJobDecision::decode(record).map_err(|err| {
                Error::Topics(format!(
                    "record {position} of {} is not a decision this build reads ({err}); upgrade, or remove it (a tombstone for its key)",
                    self.names.dead_jobs_resolved()
                ))
            })?;
            if decision.queue == queue {
                decided.insert((decision.partition, decision.offset));
            }
        }
        let mut listing = Listing::default();
        let mut by_place = BTreeMap::new();
        for record in read_to_end(&self.kafka, &self.names.dead_jobs(queue), WAIT)? {
            match DeadJob::decode(&record) {
                Ok(job) if !decided.contains(&(job.partition, job.offset)) => {
                    by_place.insert((job.partition, job.offset), job);
                }
                Ok(_) => {}
                Err(_) => listing.unreadable += 1,
            }
        }
        listing.jobs = by_place.into_values().collect();
        Ok(listing)
    }

    /// Decides `action` for the dead jobs of `queue` at `places` (their places in
    /// the queue; repeats count once), one decision at a time per process: each job
    /// is looked up among the undecided ones under the lock, so two requests racing
    /// for one job decide it once. (Operators' consoles reach one broker, the first
    /// live one; two processes deciding the same job at the same moment could
    /// still both act on it.)
    pub async fn decide_all(
        self: &std::sync::Arc<Self>,
        queue: &str,
        places: &[(i32, i64)],
        action: DeadJobAction,
    ) -> Result<Decided> {
        let _one_at_a_time = self.deciding.lock().await;
        let reader = self.clone();
        let listed = queue.to_string();
        let listing = tokio::task::spawn_blocking(move || reader.undecided(&listed))
            .await
            .map_err(|err| Error::Topics(err.to_string()))??;
        let mut report = Decided::default();
        let mut seen = HashSet::new();
        for &place in places.iter().filter(|place| seen.insert(**place)) {
            match listing.jobs.iter().find(|job| (job.partition, job.offset) == place) {
                None => report.not_found.push(place),
                Some(job) => match self.decide(job, action).await {
                    Ok(None) => report.decided += 1,
                    Ok(Some(reason)) => report.refused.push((place, reason)),
                    Err(err) => {
                        report.failed =
                            Some(format!("at job {} (partition {}, offset {}): {err}", job.job.id, place.0, place.1));
                        break;
                    }
                },
            }
        }
        Ok(report)
    }

    /// Records `action` for `job`, or says why not (`Some(reason)`); a requeued job
    /// is enqueued again first (keyed like the original: its ordering key, else its
    /// id), so a crash in between leaves it listed — requeued twice at worst, which
    /// at-least-once allows. A job whose payload was cut to fit the dead topic is not
    /// the job that was enqueued: it can be discarded, never requeued.
    async fn decide(&self, job: &DeadJob, action: DeadJobAction) -> Result<Option<String>> {
        if action == DeadJobAction::Requeued {
            if job.truncated.contains_key("payload") {
                return Ok(Some(format!(
                    "job {} cannot be requeued: its payload was cut to fit the dead topic",
                    job.job.id
                )));
            }
            if job.error == tally_core::jobs::partition::CANCELLED {
                // Written before the job, so a broker fetching it has read this first.
                let revoke = tally_core::jobs::JobCancel::revoke(&job.queue, &job.job.id, now_ms());
                let bytes = serde_json::to_vec(&revoke).map_err(|err| Error::Topics(err.to_string()))?;
                self.send(&self.names.jobs_cancelled(), &revoke.key(), &bytes).await?;
            }
            let bytes = serde_json::to_vec(&job.job).map_err(|err| Error::Topics(err.to_string()))?;
            let key = job.job.key.as_deref().unwrap_or(&job.job.id);
            self.send(&self.names.jobs(&job.queue), key, &bytes).await?;
        }
        let decision = DeadJobDecision::new(&job.queue, job.partition, job.offset, action, now_ms());
        let bytes = serde_json::to_vec(&decision).map_err(|err| Error::Topics(err.to_string()))?;
        let key = DeadJobDecision::key(&job.queue, job.partition, job.offset);
        self.send(&self.names.dead_jobs_resolved(), &key, &bytes).await.map(|()| None)
    }

    async fn send(&self, topic: &str, key: &str, payload: &[u8]) -> Result<()> {
        let record = FutureRecord::to(topic).key(key).payload(payload);
        match tokio::time::timeout(WAIT, self.producer.send(record, WAIT)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((err, _))) => Err(Error::Kafka(err)),
            Err(_) => Err(Error::Topics(format!("{topic}: not acknowledged within {WAIT:?}"))),
        }
    }
}
