//! Unique keys on a queue that replaces or debounces (`on_duplicate`): a key is
//! held by its latest job while that job waits — ready, delayed, parked or waiting
//! for a retry. A newer job of the key takes its place: the waiting one is
//! finished without running. A job of a key whose latest job runs (or ended) is
//! accepted and waits; should the running one fail, it is not retried
//! ([`super::REPLACED`]): at most one job of a key waits, and the newest payload
//! is the last to run. Debounced jobs also wait `debounce_ms` after their
//! enqueue time, so a burst of a key runs once, its last job after the burst's
//! quiet period.
//!
//! Newer is by enqueue time (then offset): a job forwarded to its key's partition
//! keeps its enqueue time, so one arriving after a newer job of its key is
//! finished at once — while that newer job is held; one arriving after it
//! finished runs as its own. The decision is the log's: a broker taking the
//! partition over fetches every unfinished job again as waiting, so a newer job
//! replaces an older one that ran on the broker that died (it would have run
//! again anyway).

#[cfg(test)]
use super::Failure;
use super::{PartitionQueue, State};
use crate::jobs::unique::OnDuplicate;
use crate::jobs::Job;

impl PartitionQueue {
    /// Whether the job at `offset`, running, has a newer job of its unique key
    /// waiting: a failed attempt of it then ends, never retried.
    pub(super) fn replaced_while_running(&self, offset: i64) -> bool {
        let Some(entry) = self.entries.get(&offset) else { return false };
        if self.policy.on_duplicate == OnDuplicate::Refuse || entry.job.tick.is_some() {
            return false;
        }
        let Some(key) = entry.job.unique_key() else { return false };
        self.waiting_unique.get(key.as_ref()).is_some_and(|&(_, latest)| latest != offset)
    }

    /// Admits the job at `offset` of unique `key`, enqueued at `at`: the offset of
    /// the job it replaced — its key's waiting job, or itself when its key's
    /// latest job held was enqueued after it (a forwarded job can arrive after a
    /// newer one; it never runs then).
    pub(super) fn replace_waiting(&mut self, key: String, offset: i64, job: &mut Job, at: i64) -> Option<i64> {
        if self.policy.on_duplicate == OnDuplicate::Debounce {
            let quiet_until = at.saturating_add(self.policy.debounce_ms);
            job.run_at = Some(job.run_at.map_or(quiet_until, |run_at| run_at.max(quiet_until)));
        }
        match self.waiting_unique.get(&key) {
            Some(&(latest_at, _)) if latest_at > at => {
                self.stale.insert(offset);
                Some(offset)
            }
            _ => {
                let (_, previous) = self.waiting_unique.insert(key, (at, offset))?;
                if !self.entries.get(&previous).is_some_and(|entry| entry.state == State::Waiting) {
                    return None;
                }
                self.take_out_waiting(previous);
                self.remove(previous);
                Some(previous)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::{Handout, QueuePolicy};
    use super::*;
    use crate::jobs::schedule::RetrySchedule;

    #[derive(Debug, Clone)]
    enum Step {
        Enqueue { key: u8, gap: i64, skew: i64, delay: Option<i64> },
        Dequeue(usize),
        Ack(usize),
        Nack(usize),
        Tick(i64),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let enqueue = (0..3u8, 0i64..150, 0i64..80, proptest::option::of(0i64..400))
            .prop_map(|(key, gap, skew, delay)| Step::Enqueue { key, gap, skew, delay });
        let step = prop_oneof![
            4 => enqueue,
            3 => (1usize..3).prop_map(Step::Dequeue),
            2 => (0usize..4).prop_map(Step::Ack),
            1 => (0usize..4).prop_map(Step::Nack),
            2 => (1i64..300).prop_map(Step::Tick),
        ];
        proptest::collection::vec(step, 0..120)
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Model {
        Waiting,
        Running,
        Done,
        Replaced,
    }

    type Jobs = Vec<(u8, i64, Option<i64>, Model)>;

    fn done(model: &mut Jobs, latest: &mut std::collections::HashMap<u8, usize>, offset: i64) {
        let (key, .., state) = &mut model[offset as usize];
        *state = Model::Done;
        if latest.get(key) == Some(&(offset as usize)) {
            latest.remove(key);
        }
    }

    fn job(offset: i64, key: u8, run_at: Option<i64>) -> Job {
        Job {
            id: format!("j{offset}"),
            payload: serde_json::value::to_raw_value(&offset).unwrap(),
            run_at,
            key: None,
            priority: None,
            concurrency_key: None,
            unique_key: Some(format!("u{key}")),
            unique_for_ms: None,
            tick: None,
            trace: None,
        }
    }

    proptest! {
        /// Against a model of every job enqueued, their enqueue times out of order:
        /// a job replaces exactly its key's latest job held when that one waits
        /// and is older (never one running or ended), and is replaced itself when
        /// that one is newer; a running job that fails while a newer one of its
        /// key waits is not retried; a replaced job is never handed out (again), a
        /// debounced one never before its quiet period ends, and every job not
        /// replaced runs and finishes.
        #[test]
        fn the_latest_job_of_a_key_replaces_its_waiting_one(steps in steps(), debounce in any::<bool>()) {
            let on_duplicate = if debounce { OnDuplicate::Debounce } else { OnDuplicate::Replace };
            let policy = QueuePolicy {
                max_attempts: 1_000,
                backoff: RetrySchedule { base_ms: 30, max_ms: 30 },
                on_duplicate,
                debounce_ms: 200,
                ..Default::default()
            };
            let mut queue = PartitionQueue::new(policy, 0, 0);
            let mut now = 1_000i64;
            // Every job enqueued: (key, enqueue time, run_at, state); the latest
            // job of each key until it is done.
            let mut model: Jobs = Vec::new();
            let mut latest: std::collections::HashMap<u8, usize> = Default::default();
            let mut out: Vec<Handout> = Vec::new();
            let handle = |handed: Vec<Handout>, now: i64, model: &mut Jobs, out: &mut Vec<Handout>| {
                for handout in handed {
                    let (_, at, run_at, state) = &mut model[handout.offset as usize];
                    prop_assert_eq!(*state, Model::Waiting, "handed out: {:?}", handout.offset);
                    prop_assert!(run_at.is_none_or(|run_at| run_at <= now));
                    prop_assert!(!debounce || *at + 200 <= now, "debounced job {} ran early", handout.offset);
                    *state = Model::Running;
                    out.push(handout);
                }
                Ok(())
            };
            for step in steps {
                match step {
                    Step::Enqueue { key, gap, skew, delay } => {
                        // Enqueued a while before it is fetched: out of order.
                        now += gap;
                        let at = now - skew;
                        let offset = model.len() as i64;
                        let run_at = delay.map(|delay| now + delay);
                        let expected = match latest.get(&key).copied() {
                            Some(i) if model[i].1 > at => Some(offset as usize),
                            Some(i) if model[i].3 == Model::Waiting => {
                                model[i].3 = Model::Replaced;
                                latest.insert(key, offset as usize);
                                Some(i)
                            }
                            _ => {
                                latest.insert(key, offset as usize);
                                None
                            }
                        };
                        let mut job = job(offset, key, run_at);
                        let replaced = queue.admit_unique(offset, &mut job, at);
                        prop_assert_eq!(replaced, Ok(expected.map(|i| i as i64)));
                        queue.push(offset, job, now);
                        let stale = expected == Some(offset as usize);
                        model.push((key, at, run_at, if stale { Model::Replaced } else { Model::Waiting }));
                    }
                    Step::Dequeue(n) => handle(queue.dequeue(n, now, 1_000_000), now, &mut model, &mut out)?,
                    Step::Ack(i) if i < out.len() => {
                        let handout = out.remove(i);
                        prop_assert_eq!(queue.ack(handout.lease), Ok(handout.offset));
                        done(&mut model, &mut latest, handout.offset);
                    }
                    Step::Nack(i) if i < out.len() => {
                        let handout = out.remove(i);
                        let failure = queue.nack(handout.lease, None, "failed", now);
                        let key = model[handout.offset as usize].0;
                        let newer_waits = latest.get(&key).is_some_and(|&j| j != handout.offset as usize);
                        if newer_waits {
                            // Not retried: the newer job of its key runs instead.
                            let replaced = matches!(&failure, Ok(Failure::Dead { error, .. }) if error == super::super::REPLACED);
                            prop_assert!(replaced, "{:?}", failure);
                            queue.finish_dead(handout.offset);
                            model[handout.offset as usize].3 = Model::Replaced;
                        } else {
                            prop_assert!(matches!(failure, Ok(Failure::Retry { .. })), "{:?}", failure);
                            model[handout.offset as usize].3 = Model::Waiting;
                        }
                    }
                    Step::Tick(ms) => now += ms,
                    Step::Ack(_) | Step::Nack(_) => {}
                }
            }
            // Workers drain the rest.
            for _ in 0..model.len() + 1 {
                now += 1_000;
                handle(queue.dequeue(usize::MAX, now, 1_000_000), now, &mut model, &mut out)?;
                for handout in out.drain(..) {
                    prop_assert_eq!(queue.ack(handout.lease), Ok(handout.offset));
                    done(&mut model, &mut latest, handout.offset);
                }
            }
            let ended: Vec<Model> = model.iter().map(|(.., state)| *state).collect();
            prop_assert!(ended.iter().all(|state| matches!(state, Model::Done | Model::Replaced)), "{:?}", ended);
            prop_assert_eq!(queue.commit_offset(), model.len() as i64, "every job finished");
        }
    }
}
