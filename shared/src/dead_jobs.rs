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

pub struct DeadJobs {
    kafka: KafkaConfig,
    names: TopicNames,
    producer: FutureProducer,
}

impl DeadJobs {
    pub fn new(kafka: &KafkaConfig, names: TopicNames) -> Result<Self> {
        let producer = unstamped_producer_config(kafka)?.create()?;
        Ok(Self { kafka: kafka.clone(), names, producer })
    }

    /// The queue's dead jobs without a decision. Blocking: reads two topics.
    pub fn undecided(&self, queue: &str) -> Result<Listing> {
        let decided: HashSet<(i32, i64)> = read_to_end(&self.kafka, &self.names.dead_jobs_resolved(), WAIT)?
            .iter()
            .filter_map(|record| match DeadJobDecision::decode(record) {
                Ok(decision) if decision.queue == queue => Some((decision.partition, decision.offset)),
                Ok(_) => None,
                Err(err) => {
                    tracing::warn!(error = %err, "a dead-job decision this build cannot read: ignored");
                    None
                }
            })
            .collect();
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

    /// Records `action` for `job`; a requeued job is enqueued again first (keyed
    /// like the original: its ordering key, else its id), so a crash in between
    /// leaves it listed — requeued twice at worst, which at-least-once allows. A job
    /// whose payload was cut to fit the dead topic is not the job that was
    /// enqueued: it can be discarded, never requeued.
    pub async fn decide(&self, job: &DeadJob, action: DeadJobAction) -> Result<()> {
        if action == DeadJobAction::Requeued {
            if job.truncated.contains_key("payload") {
                return Err(Error::Topics(format!(
                    "job {} cannot be requeued: its payload was cut to fit the dead topic",
                    job.job.id
                )));
            }
            let bytes = serde_json::to_vec(&job.job).map_err(|err| Error::Topics(err.to_string()))?;
            let key = job.job.key.as_deref().unwrap_or(&job.job.id);
            self.send(&self.names.jobs(&job.queue), key, &bytes).await?;
        }
        let decision = DeadJobDecision::new(&job.queue, job.partition, job.offset, action, now_ms());
        let bytes = serde_json::to_vec(&decision).map_err(|err| Error::Topics(err.to_string()))?;
        let key = DeadJobDecision::key(&job.queue, job.partition, job.offset);
        self.send(&self.names.dead_jobs_resolved(), &key, &bytes).await
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
