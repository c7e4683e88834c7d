//! Unique jobs: a job naming a `unique_key` is accepted only when no job of that
//! key accepted before it holds the key — for `unique_for_ms` after its enqueue
//! time, or, without a window, until it finishes. A job refused is a duplicate
//! (the dead-letter topic says so); it never runs.
//!
//! Every job of a unique key lives in one partition ([`super::limits::partition_of`]),
//! and the decision is a function of that partition's log — the records' order
//! and enqueue timestamps — so a broker that takes the partition over makes the
//! same decisions: it replays the log from `unique_for_ms` before now up to the
//! committed offset (everything there is finished), then goes on as any broker.
//!
//! A queue may declare instead that a newer job replaces the waiting one of its
//! key, or debounces it ([`OnDuplicate`]).

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

/// What a job does whose unique key is held (a queue's `on_duplicate`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDuplicate {
    /// It is refused: a duplicate, for its key's window or until its job finishes.
    #[default]
    Refuse,
    /// It takes the place of its key's waiting job ([`super::partition`]'s
    /// `replace`).
    Replace,
    /// As `Replace`, and it waits the queue's `debounce_ms` after its enqueue.
    Debounce,
}

impl OnDuplicate {
    /// Its name in a declaration.
    pub fn name(self) -> &'static str {
        match self {
            Self::Refuse => "refuse",
            Self::Replace => "replace",
            Self::Debounce => "debounce",
        }
    }

    pub fn is_refuse(&self) -> bool {
        *self == Self::Refuse
    }
}

/// Who holds a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hold {
    /// Held by windows until this time: the latest end (enqueue time + window; ms)
    /// of the key's accepted jobs — kept when a job without a window takes the
    /// key, so a record enqueued earlier than it, arriving later, still meets them.
    until: i64,
    /// Held until it finishes by the job at this offset (a job without a window).
    job: Option<i64>,
}

/// The keys held in one partition.
#[derive(Debug, Default)]
pub struct UniqueKeys {
    held: HashMap<String, Hold>,
    /// Windows by their end, for pruning: `(until, key)`.
    ends: BTreeSet<(i64, String)>,
    /// The latest enqueue time seen.
    latest: i64,
}

impl UniqueKeys {
    /// Accepts the job at `offset` of `key` enqueued at `at` with `window_ms` (0:
    /// until it finishes), or says why it is a duplicate.
    pub fn admit(&mut self, key: &str, offset: i64, at: i64, window_ms: i64) -> Result<(), String> {
        self.prune(at);
        if let Some(hold) = self.held.get(key) {
            if let Some(job) = hold.job {
                return Err(format!(
                    "duplicate: unique_key {key:?} is held by the job at offset {job} until it finishes"
                ));
            }
            if hold.until > at {
                return Err(format!(
                    "duplicate: unique_key {key:?} is held until {} by a job enqueued within its unique_for_ms",
                    hold.until
                ));
            }
        }
        let before = self.held.get(key).map_or(i64::MIN, |hold| hold.until);
        let hold = if window_ms > 0 {
            let until = before.max(at.saturating_add(window_ms));
            self.ends.insert((until, key.to_string()));
            Hold { until, job: None }
        } else {
            Hold { until: before, job: Some(offset) }
        };
        self.held.insert(key.to_string(), hold);
        Ok(())
    }

    /// The job at `offset` of `key` finished: a key it holds until then is free
    /// (its windows still hold it).
    pub fn finish(&mut self, key: &str, offset: i64) {
        let Some(hold) = self.held.get_mut(key) else { return };
        if hold.job == Some(offset) {
            hold.job = None;
            if hold.until <= self.latest.saturating_sub(PRUNE_SLACK_MS) {
                self.held.remove(key);
            }
        }
    }

    /// Whether `key` is held for a job enqueued at `at`: until when (`i64::MAX`:
    /// until a job finishes).
    pub fn held_until(&self, key: &str, at: i64) -> Option<i64> {
        let hold = self.held.get(key)?;
        match hold.job {
            Some(_) => Some(i64::MAX),
            None => (hold.until > at).then_some(hold.until),
        }
    }

    /// Keys held now (windows not yet ended at the latest enqueue time, and jobs
    /// not finished).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Forgets the windows that ended before the latest enqueue time seen (a
    /// record enqueued earlier than that, arriving later, still finds the ones
    /// it could meet: they end after its own time only if they end after this).
    fn prune(&mut self, at: i64) {
        self.latest = self.latest.max(at);
        while let Some((until, _)) = self.ends.first() {
            if *until > self.latest.saturating_sub(PRUNE_SLACK_MS) {
                break;
            }
            let Some((until, key)) = self.ends.pop_first() else { break };
            if self.held.get(&key).is_some_and(|hold| hold.until == until && hold.job.is_none()) {
                self.held.remove(&key);
            }
        }
    }
}

/// How far out of order enqueue times may arrive and still meet an ended window:
/// producers' clocks and batching.
const PRUNE_SLACK_MS: i64 = 600_000;

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Step {
        Enqueue { key: u8, gap: i64, window: i64 },
        Finish(usize),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let enqueue = (0..4u8, -50i64..200, prop_oneof![Just(0i64), 1i64..500])
            .prop_map(|(key, gap, window)| Step::Enqueue { key, gap, window });
        proptest::collection::vec(prop_oneof![3 => enqueue, 1 => (0usize..30).prop_map(Step::Finish)], 0..120)
    }

    proptest! {
        /// Against a brute force over everything accepted so far: a job is
        /// accepted iff no accepted job of its key still holds it — unfinished and
        /// without a window, or within its window of the new job's enqueue time.
        #[test]
        fn a_key_is_taken_once_per_window_or_until_finished(steps in steps()) {
            let mut keys = UniqueKeys::default();
            // Accepted jobs: (key, offset, at, window, finished).
            let mut accepted: Vec<(u8, i64, i64, i64, bool)> = Vec::new();
            let mut at = 1_000_000i64;
            for (offset, step) in steps.into_iter().enumerate() {
                let offset = offset as i64;
                match step {
                    Step::Enqueue { key, gap, window } => {
                        at += gap;
                        let held = accepted.iter().any(|&(k, _, t, w, finished)| {
                            k == key && if w == 0 { !finished } else { t + w > at }
                        });
                        let answer = keys.admit(&format!("k{key}"), offset, at, window);
                        prop_assert_eq!(answer.is_err(), held, "{:?}", answer);
                        if answer.is_ok() {
                            accepted.push((key, offset, at, window, false));
                        }
                    }
                    Step::Finish(i) => {
                        if let Some(job) = accepted.get_mut(i) {
                            job.4 = true;
                            keys.finish(&format!("k{}", job.0), job.1);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn ended_windows_are_forgotten_once_far_behind() {
        let mut keys = UniqueKeys::default();
        keys.admit("a", 0, 0, 1_000).unwrap();
        keys.admit("b", 1, 0, 0).unwrap();
        assert_eq!(keys.len(), 2);
        keys.admit("c", 2, 1_000 + PRUNE_SLACK_MS + 1, 1).unwrap();
        assert_eq!(keys.len(), 2, "a's window is forgotten, b waits for its job");
        keys.finish("b", 1);
        assert_eq!(keys.len(), 1);
    }
}
