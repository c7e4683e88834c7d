//! One queue partition in a dequeue broker's memory: the jobs fetched from Kafka and
//! not yet finished, handed out to workers under leases.
//!
//! A job is *finished* when it is acked, or when it has failed `max_attempts` times
//! and its dead record is acknowledged by the dead topic. The commit watermark is the
//! lowest offset not finished: everything below it is done, so a broker that dies
//! and restarts from the committed offset loses nothing (and may run finished jobs
//! above the watermark again — at-least-once).
//!
//! Rules of [`PartitionQueue::dequeue`]: a job is handed out only when it is not
//! leased, its `ready_at` (its `run_at`, or the retry time after a failure) has come,
//! and — on a FIFO queue — no earlier unfinished job has the same key. Among those,
//! a job of a higher priority level goes first, then the lower offset. A ready job
//! starts at its own level (`Job::priority`, within the queue's levels) each time
//! it becomes ready and rises one level for every `priority_aging_ms` it waits
//! ready, so a stream of higher jobs delays a lower one, never starves it.
//!
//! Room ([`PartitionQueue::has_room`]) bounds what is held, so the consumer pauses
//! instead of buffering without end: jobs ready or running by `capacity`, jobs
//! waiting for a time (a `run_at`, a retry) by `delayed_capacity` apart — so a
//! buffer full of jobs due in an hour never holds back a ready one behind them —
//! and the bytes of each of the two by `max_bytes`.
//!
//! Lease numbers start at `tenure << 32`: a broker that takes a partition back
//! gives it a new tenure, so a stale lease from an earlier one is unknown, never
//! mistaken for a lease of the same number handed out since.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::schedule::RetrySchedule;
use super::Job;

/// The settings of a queue that the buffer applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuePolicy {
    pub max_attempts: u32,
    pub backoff: RetrySchedule,
    pub fifo: bool,
    /// Most jobs held that are ready, running or finishing (fetching pauses here).
    pub capacity: usize,
    /// Most jobs held while they wait for a time (`run_at`, a retry), apart from
    /// `capacity`.
    pub delayed_capacity: usize,
    /// Most bytes of jobs held, ready and delayed each.
    pub max_bytes: usize,
    /// Priority levels a job may name: `0..priority_levels` (1: no priorities).
    pub priority_levels: u8,
    /// A ready job rises one level for every this long it waits (0: never).
    pub priority_aging_ms: i64,
}

impl QueuePolicy {
    /// The most levels a queue may declare.
    pub const MAX_PRIORITY_LEVELS: u8 = 10;

    /// Whether the queue takes `job` as it is; the reason for its dead letter if not.
    pub fn check(&self, job: &Job) -> Result<(), String> {
        match job.priority {
            Some(level) if level >= self.priority_levels => Err(format!(
                "priority: {level} is past the queue's levels (0 to {})",
                self.priority_levels.saturating_sub(1)
            )),
            _ => Ok(()),
        }
    }

    /// The level `job` starts at when it becomes ready.
    fn level_of(&self, job: &Job) -> u8 {
        job.priority.unwrap_or(0).min(self.priority_levels.saturating_sub(1))
    }
}

impl Default for QueuePolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            backoff: RetrySchedule::default(),
            fifo: false,
            capacity: 10_000,
            delayed_capacity: 100_000,
            max_bytes: 64 << 20,
            priority_levels: 1,
            priority_aging_ms: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Leased {
        lease: u64,
        deadline: i64,
    },
    /// Gave up; waiting for the dead topic to acknowledge its record.
    Dying,
}

#[derive(Debug, Clone)]
struct Entry {
    job: Job,
    /// Attempts handed out so far.
    attempts: u32,
    ready_at: i64,
    state: State,
    /// Its priority level while ready (its own, risen by waiting).
    level: u8,
    /// When it rises a level next, while ready (an older entry of `aging` is stale).
    rises_at: Option<i64>,
    /// Since when it has been ready, while ready.
    ready_since: i64,
}

/// Where a ready job sits: higher levels first, then lower offsets.
type ReadyKey = (std::cmp::Reverse<u8>, i64);

/// A job handed to a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Handout {
    pub offset: i64,
    pub lease: u64,
    /// 1 for the first try.
    pub attempt: u32,
    pub deadline: i64,
    pub job: Job,
}

/// What became of a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Runs again at `at`.
    Retry { offset: i64, at: i64 },
    /// Out of attempts: publish it to the dead topic, then call
    /// [`PartitionQueue::finish_dead`].
    Dead { offset: i64, attempts: u32, error: String, job: Job },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("lease unknown or expired")]
    Unknown,
}

/// Counts for the stats endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PartitionStats {
    /// Waiting and ready now.
    pub ready: usize,
    /// Waiting for `run_at` or a retry time.
    pub delayed: usize,
    /// Of the delayed, those waiting for a retry (they failed before).
    pub retrying: usize,
    pub in_flight: usize,
    /// Held in memory, unfinished.
    pub held: usize,
    /// Since when the longest-waiting ready job has been ready (none ready: none).
    pub oldest_ready_since: Option<i64>,
}

#[derive(Debug)]
pub struct PartitionQueue {
    policy: QueuePolicy,
    entries: BTreeMap<i64, Entry>,
    leases: HashMap<u64, i64>,
    next_lease: u64,
    /// The offset after the last one pushed (where the watermark sits when empty).
    next_offset: i64,
    /// Waiting jobs whose time has come, by level (highest first), then offset.
    ready: BTreeSet<ReadyKey>,
    /// The unfinished jobs of each key, by offset: the first decides for the rest
    /// on a FIFO queue.
    by_key: HashMap<String, BTreeSet<i64>>,
    /// The ready jobs a FIFO queue may hand out: those without a key and those
    /// first among their key's unfinished jobs (a dequeue takes from here, never
    /// scanning the jobs held behind a running one).
    ready_heads: BTreeSet<ReadyKey>,
    /// When ready jobs rise a level: `(at, offset)` (see [`Entry::rises_at`]).
    aging: BTreeSet<(i64, i64)>,
    /// The ready jobs by `(ready_since, offset)`: the oldest first.
    ready_by_age: BTreeSet<(i64, i64)>,
    /// Waiting jobs whose time has not come yet, by `(ready_at, offset)`.
    timed: BTreeSet<(i64, i64)>,
    /// Offsets of malformed records whose dead letter is not acknowledged yet.
    rejected: BTreeSet<i64>,
    /// Bytes of the jobs held.
    held_bytes: usize,
    /// Bytes of the jobs in `timed` (part of `held_bytes`).
    timed_bytes: usize,
}

/// What a held job costs in memory, roughly.
fn job_bytes(job: &Job) -> usize {
    job.payload.get().len() + job.id.len() + job.key.as_ref().map_or(0, String::len) + 128
}

impl PartitionQueue {
    /// A partition whose next offset to fetch is `start` (the committed offset),
    /// served for the `tenure`-th time by this broker process.
    pub fn new(policy: QueuePolicy, start: i64, tenure: u32) -> Self {
        Self {
            policy,
            entries: BTreeMap::new(),
            leases: HashMap::new(),
            next_lease: (u64::from(tenure) << 32) | 1,
            next_offset: start,
            ready: BTreeSet::new(),
            by_key: HashMap::new(),
            ready_heads: BTreeSet::new(),
            aging: BTreeSet::new(),
            ready_by_age: BTreeSet::new(),
            timed: BTreeSet::new(),
            rejected: BTreeSet::new(),
            held_bytes: 0,
            timed_bytes: 0,
        }
    }

    pub fn policy(&self) -> &QueuePolicy {
        &self.policy
    }

    /// New settings of the queue (a changed declaration): they apply from now on;
    /// jobs held stay, and a FIFO gate turned on holds back keys already running.
    pub fn set_policy(&mut self, policy: QueuePolicy) {
        let refile = (policy.priority_levels, policy.priority_aging_ms)
            != (self.policy.priority_levels, self.policy.priority_aging_ms);
        self.policy = policy;
        if refile {
            // Every ready job starts over at its own level under the new levels, its
            // rises due from when it became ready (the next `promote` catches up).
            let ready: Vec<(i64, i64)> = self.ready_by_age.iter().copied().collect();
            self.ready.clear();
            self.ready_heads.clear();
            self.aging.clear();
            self.ready_by_age.clear();
            for (since, offset) in ready {
                self.make_ready(offset, since);
            }
        }
    }

    /// Whether another job fits at `now` (see the module doc).
    pub fn has_room(&mut self, now: i64) -> bool {
        self.promote(now);
        let waiting_for_time = self.timed.len();
        let others = self.entries.len() - waiting_for_time + self.rejected.len();
        others < self.policy.capacity
            && waiting_for_time < self.policy.delayed_capacity
            && self.held_bytes - self.timed_bytes < self.policy.max_bytes
            && self.timed_bytes < self.policy.max_bytes
    }

    fn bytes_at(&self, offset: i64) -> usize {
        self.entries.get(&offset).map_or(0, |entry| job_bytes(&entry.job))
    }

    /// Moves the waiting jobs whose time has come at `now` to the ready set, and
    /// raises the ready jobs that waited long enough a level.
    fn promote(&mut self, now: i64) {
        while let Some(&(at, offset)) = self.timed.first() {
            if at > now {
                break;
            }
            self.timed.pop_first();
            self.timed_bytes -= self.bytes_at(offset);
            self.make_ready(offset, at);
        }
        while let Some(&(at, offset)) = self.aging.first() {
            if at > now {
                break;
            }
            self.aging.pop_first();
            self.rise(offset, at);
        }
    }

    /// Files a waiting job as ready since `since` (and as a ready head when it is
    /// one), at its own level.
    fn make_ready(&mut self, offset: i64, since: i64) {
        let (top, aging) = (self.policy.priority_levels.saturating_sub(1), self.policy.priority_aging_ms);
        let Some(entry) = self.entries.get_mut(&offset) else { return };
        entry.level = self.policy.level_of(&entry.job);
        entry.rises_at = (aging > 0 && entry.level < top).then(|| since.saturating_add(aging));
        entry.ready_since = since;
        self.ready_by_age.insert((since, offset));
        let (key, rises_at) = ((std::cmp::Reverse(entry.level), offset), entry.rises_at);
        if let Some(at) = rises_at {
            self.aging.insert((at, offset));
        }
        self.ready.insert(key);
        if self.is_head(offset) {
            self.ready_heads.insert(key);
        }
    }

    /// A ready job that waited since its last rise (`at`) rises a level.
    fn rise(&mut self, offset: i64, at: i64) {
        let (top, aging) = (self.policy.priority_levels.saturating_sub(1), self.policy.priority_aging_ms);
        let Some(entry) = self.entries.get_mut(&offset) else { return };
        if entry.rises_at != Some(at) {
            return; // handed out (or failed and ready again) since it was filed
        }
        let old = (std::cmp::Reverse(entry.level), offset);
        entry.level = entry.level.saturating_add(1).min(top);
        entry.rises_at = (aging > 0 && entry.level < top).then(|| at.saturating_add(aging));
        let (new, rises_at) = ((std::cmp::Reverse(entry.level), offset), entry.rises_at);
        if let Some(next) = rises_at {
            self.aging.insert((next, offset));
        }
        if self.ready.remove(&old) {
            self.ready.insert(new);
        }
        if self.ready_heads.remove(&old) {
            self.ready_heads.insert(new);
        }
    }

    /// Where the job at `offset` sits among the ready ones.
    fn ready_key(&self, offset: i64) -> ReadyKey {
        (std::cmp::Reverse(self.entries.get(&offset).map_or(0, |entry| entry.level)), offset)
    }

    /// Whether the job at `offset` has no key or is the first unfinished of its key.
    fn is_head(&self, offset: i64) -> bool {
        match self.entries.get(&offset).and_then(|entry| entry.job.key.as_deref()) {
            Some(key) => self.by_key.get(key).and_then(BTreeSet::first) == Some(&offset),
            None => true,
        }
    }

    /// Files a waiting job under ready or timed.
    fn wait(&mut self, offset: i64, ready_at: i64, now: i64) {
        if ready_at <= now {
            self.make_ready(offset, now);
        } else if self.timed.insert((ready_at, offset)) {
            self.timed_bytes += self.bytes_at(offset);
        }
    }

    /// Adds a job fetched at `now`. Offsets arrive in increasing order; one below
    /// the next expected (a re-fetch: held, or already finished) is ignored.
    pub fn push(&mut self, offset: i64, job: Job, now: i64) {
        if offset < self.next_offset {
            return;
        }
        let ready_at = job.run_at.unwrap_or(i64::MIN);
        self.held_bytes += job_bytes(&job);
        if let Some(key) = &job.key {
            self.by_key.entry(key.clone()).or_default().insert(offset);
        }
        let entry =
            Entry { job, attempts: 0, ready_at, state: State::Waiting, level: 0, rises_at: None, ready_since: 0 };
        self.entries.insert(offset, entry);
        self.wait(offset, ready_at, now);
        self.next_offset = self.next_offset.max(offset + 1);
    }

    /// Holds the offset of a record the broker will not run (a malformed record)
    /// until its dead letter is safely written: the watermark stays below it until
    /// [`PartitionQueue::finish_dead`].
    pub fn reject(&mut self, offset: i64) {
        if offset < self.next_offset {
            return;
        }
        self.rejected.insert(offset);
        self.next_offset = offset + 1;
    }

    /// Hands out up to `max` jobs at `now`, leased until `now + lease_ms`.
    pub fn dequeue(&mut self, max: usize, now: i64, lease_ms: i64) -> Vec<Handout> {
        self.promote(now);
        let mut handed = Vec::new();
        let mut chosen = Vec::new();
        if self.policy.fifo {
            // The first unfinished job of a key decides for all later ones.
            chosen.extend(self.ready_heads.iter().take(max).copied());
        } else {
            chosen.extend(self.ready.iter().take(max).copied());
        }
        for key in chosen {
            let offset = key.1;
            self.ready.remove(&key);
            self.ready_heads.remove(&key);
            let lease = self.next_lease;
            self.next_lease += 1;
            let deadline = now.saturating_add(lease_ms);
            let Some(entry) = self.entries.get_mut(&offset) else { continue };
            entry.attempts += 1;
            entry.state = State::Leased { lease, deadline };
            if let Some(at) = entry.rises_at.take() {
                self.aging.remove(&(at, offset));
            }
            self.ready_by_age.remove(&(entry.ready_since, offset));
            self.leases.insert(lease, offset);
            handed.push(Handout { offset, lease, attempt: entry.attempts, deadline, job: entry.job.clone() });
        }
        handed
    }

    /// The job is done: it is finished.
    pub fn ack(&mut self, lease: u64) -> Result<i64, LeaseError> {
        let offset = self.leases.remove(&lease).ok_or(LeaseError::Unknown)?;
        self.remove(offset);
        Ok(offset)
    }

    /// Drops a finished job (it is in no index: it was leased or dying).
    fn remove(&mut self, offset: i64) {
        let Some(entry) = self.entries.remove(&offset) else { return };
        self.held_bytes -= job_bytes(&entry.job);
        self.ready_heads.remove(&(std::cmp::Reverse(entry.level), offset));
        let Some(key) = entry.job.key else { return };
        let Some(offsets) = self.by_key.get_mut(&key) else { return };
        offsets.remove(&offset);
        // The key's next job heads it now: handed out once it is ready.
        match offsets.first().copied() {
            Some(next) if self.ready.contains(&self.ready_key(next)) => {
                let head = self.ready_key(next);
                self.ready_heads.insert(head);
            }
            Some(_) => {}
            None => {
                self.by_key.remove(&key);
            }
        }
    }

    /// The attempt failed: retry after `retry_in_ms` (default: the backoff), or give
    /// up after `max_attempts`.
    pub fn nack(&mut self, lease: u64, retry_in_ms: Option<i64>, error: &str, now: i64) -> Result<Failure, LeaseError> {
        let offset = self.leases.remove(&lease).ok_or(LeaseError::Unknown)?;
        Ok(self.fail(offset, retry_in_ms, error, now))
    }

    fn fail(&mut self, offset: i64, retry_in_ms: Option<i64>, error: &str, now: i64) -> Failure {
        let policy = &self.policy;
        let Some(entry) = self.entries.get_mut(&offset) else {
            return Failure::Retry { offset, at: now };
        };
        if entry.attempts >= policy.max_attempts {
            entry.state = State::Dying;
            return Failure::Dead {
                offset,
                attempts: entry.attempts,
                error: error.to_string(),
                job: entry.job.clone(),
            };
        }
        let wait = retry_in_ms.unwrap_or_else(|| policy.backoff.delay_ms(entry.attempts)).max(0);
        let at = now.saturating_add(wait);
        entry.state = State::Waiting;
        entry.ready_at = at;
        self.wait(offset, at, now);
        Failure::Retry { offset, at }
    }

    /// Moves a lease's deadline to `now + lease_ms`.
    pub fn extend(&mut self, lease: u64, lease_ms: i64, now: i64) -> Result<i64, LeaseError> {
        let offset = *self.leases.get(&lease).ok_or(LeaseError::Unknown)?;
        let entry = self.entries.get_mut(&offset).ok_or(LeaseError::Unknown)?;
        let deadline = now.saturating_add(lease_ms);
        entry.state = State::Leased { lease, deadline };
        Ok(deadline)
    }

    /// Fails every lease past its deadline at `now` ("lease expired"). Looks at the
    /// jobs in flight only, not at everything held.
    pub fn expire(&mut self, now: i64) -> Vec<Failure> {
        let mut expired: Vec<(u64, i64)> = self
            .leases
            .iter()
            .filter(|(_, offset)| {
                self.entries
                    .get(offset)
                    .is_some_and(|e| matches!(e.state, State::Leased { deadline, .. } if deadline <= now))
            })
            .map(|(&lease, &offset)| (lease, offset))
            .collect();
        expired.sort_unstable_by_key(|&(_, offset)| offset);
        expired
            .into_iter()
            .map(|(lease, offset)| {
                self.leases.remove(&lease);
                self.fail(offset, None, "lease expired", now)
            })
            .collect()
    }

    /// The dead record of `offset` (a dying job's, or a rejected record's dead
    /// letter) is safely written: it is finished.
    pub fn finish_dead(&mut self, offset: i64) {
        if self.entries.get(&offset).is_some_and(|e| e.state == State::Dying) {
            self.remove(offset);
        }
        self.rejected.remove(&offset);
    }

    /// The offset to commit: the lowest unfinished one.
    pub fn commit_offset(&self) -> i64 {
        let held = self.entries.keys().next().copied().unwrap_or(self.next_offset);
        self.rejected.first().map_or(held, |&rejected| rejected.min(held))
    }

    /// The next offset to fetch (everything below was pushed or skipped).
    pub fn fetched_until(&self) -> i64 {
        self.next_offset
    }

    /// The earliest time a waiting job becomes ready (for long polls).
    pub fn next_ready_at(&self) -> Option<i64> {
        if !self.ready.is_empty() {
            return Some(i64::MIN);
        }
        self.timed.first().map(|&(at, _)| at)
    }

    pub fn stats(&self, now: i64) -> PartitionStats {
        let due = self.timed.range(..=(now, i64::MAX)).count();
        let retrying = self
            .timed
            .range((now, i64::MAX)..)
            .filter(|(_, offset)| self.entries.get(offset).is_some_and(|entry| entry.attempts > 0))
            .count();
        // A job due but not yet moved to the ready set has been ready since it was due.
        let oldest_due = self.timed.first().map(|&(at, _)| at).filter(|at| *at <= now);
        let oldest_ready = self.ready_by_age.first().map(|&(since, _)| since);
        PartitionStats {
            ready: self.ready.len() + due,
            delayed: self.timed.len() - due,
            retrying,
            in_flight: self.leases.len(),
            held: self.entries.len(),
            oldest_ready_since: [oldest_due, oldest_ready].into_iter().flatten().min(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn job(id: usize, key: Option<u8>, run_at: Option<i64>) -> Job {
        Job {
            id: format!("j{id}"),
            payload: serde_json::value::to_raw_value(&id).unwrap(),
            run_at,
            key: key.map(|k| format!("k{k}")),
            priority: None,
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Push { key: Option<u8>, delay: Option<i64> },
        Dequeue(usize),
        Ack(usize),
        Nack(usize),
        Tick(i64),
        FinishDead,
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let step = prop_oneof![
            3 => (proptest::option::of(0..3u8), proptest::option::of(0i64..500)).prop_map(|(key, delay)| Step::Push { key, delay }),
            3 => (1usize..4).prop_map(Step::Dequeue),
            3 => (0usize..8).prop_map(Step::Ack),
            1 => (0usize..8).prop_map(Step::Nack),
            2 => (1i64..400).prop_map(Step::Tick),
            1 => Just(Step::FinishDead),
        ];
        proptest::collection::vec(step, 0..150)
    }

    proptest! {
        /// Whatever workers do: the watermark never passes an unfinished job, a job
        /// never runs before `run_at`, no job is leased twice at once, a FIFO key
        /// never has two jobs out at once nor runs a later job before an earlier one
        /// is finished, and every job ends acked or dead.
        #[test]
        fn the_buffer_keeps_its_promises(steps in steps(), fifo in any::<bool>()) {
            let policy = QueuePolicy { max_attempts: 3, backoff: RetrySchedule { base_ms: 50, max_ms: 200 }, fifo, capacity: 1_000, ..Default::default() };
            let mut queue = PartitionQueue::new(policy, 100, 0);
            let mut now = 1_000i64;
            let mut next_offset = 100i64;
            let mut pushed: BTreeMap<i64, Job> = BTreeMap::new();
            let mut finished: BTreeSet<i64> = BTreeSet::new();
            let mut out: Vec<Handout> = Vec::new();
            let mut dying: Vec<i64> = Vec::new();
            let mut committed = 100i64;

            let mut check = |queue: &PartitionQueue, finished: &BTreeSet<i64>, pushed: &BTreeMap<i64, Job>| -> Result<(), TestCaseError> {
                let watermark = queue.commit_offset();
                for offset in pushed.keys().filter(|o| **o < watermark) {
                    prop_assert!(finished.contains(offset), "watermark {} passed unfinished {}", watermark, offset);
                }
                prop_assert!(watermark >= committed);
                committed = watermark;
                Ok(())
            };
            for step in steps {
                match step {
                    Step::Push { key, delay } => {
                        let j = job(next_offset as usize, key, delay.map(|d| now + d));
                        pushed.insert(next_offset, j.clone());
                        queue.push(next_offset, j, now);
                        next_offset += 1;
                    }
                    Step::Dequeue(max) => {
                        for handout in queue.dequeue(max, now, 300) {
                            prop_assert!(handout.job.run_at.is_none_or(|at| at <= now), "ran before run_at");
                            prop_assert!(!out.iter().any(|o| o.offset == handout.offset), "leased twice");
                            prop_assert!(!finished.contains(&handout.offset));
                            if fifo {
                                if let Some(key) = &handout.job.key {
                                    prop_assert!(!out.iter().any(|o| o.job.key.as_ref() == Some(key)), "two of {} at once", key);
                                    let earlier_unfinished = pushed.range(..handout.offset)
                                        .any(|(o, j)| j.key.as_ref() == Some(key) && !finished.contains(o));
                                    prop_assert!(!earlier_unfinished, "{} ran before an earlier job of {}", handout.offset, key);
                                }
                            }
                            out.push(handout);
                        }
                    }
                    Step::Ack(i) if i < out.len() => {
                        let handout = out.remove(i);
                        prop_assert_eq!(queue.ack(handout.lease), Ok(handout.offset));
                        prop_assert_eq!(queue.ack(handout.lease), Err(LeaseError::Unknown), "acked twice");
                        finished.insert(handout.offset);
                    }
                    Step::Nack(i) if i < out.len() => {
                        let handout = out.remove(i);
                        match queue.nack(handout.lease, None, "boom", now).unwrap() {
                            Failure::Dead { offset, attempts, .. } => {
                                prop_assert_eq!(attempts, 3);
                                dying.push(offset);
                            }
                            Failure::Retry { at, .. } => prop_assert!(at > now),
                        }
                    }
                    Step::Ack(_) | Step::Nack(_) => {}
                    Step::Tick(ms) => {
                        now += ms;
                        for failure in queue.expire(now) {
                            let offset = match &failure { Failure::Dead { offset, .. } | Failure::Retry { offset, .. } => *offset };
                            let position = out.iter().position(|o| o.offset == offset);
                            prop_assert!(position.is_some_and(|p| out[p].deadline <= now), "expired a live lease");
                            out.remove(position.unwrap());
                            if let Failure::Dead { offset, .. } = failure {
                                dying.push(offset);
                            }
                        }
                    }
                    Step::FinishDead => {
                        for offset in dying.drain(..) {
                            queue.finish_dead(offset);
                            finished.insert(offset);
                        }
                    }
                }
                check(&queue, &finished, &pushed)?;
            }
            // Drain: workers ack everything from now on; every job ends finished.
            for offset in dying.drain(..) {
                queue.finish_dead(offset);
                finished.insert(offset);
            }
            for handout in out.drain(..) {
                queue.ack(handout.lease).unwrap();
                finished.insert(handout.offset);
            }
            for _ in 0..100 {
                now += 1_000;
                for handout in queue.dequeue(100, now, 300) {
                    queue.ack(handout.lease).unwrap();
                    finished.insert(handout.offset);
                }
            }
            prop_assert_eq!(finished.len(), pushed.len());
            prop_assert_eq!(queue.commit_offset(), next_offset);
        }
    }

    /// What the brute force knows of a job in the priority test.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Modelled {
        /// Ready once `now` reaches `at`, and ready since then.
        Waiting {
            at: i64,
        },
        Out {
            lease: u64,
        },
        Done,
    }

    #[derive(Debug, Clone)]
    enum PriorityStep {
        Push { level: u8, key: Option<u8> },
        Dequeue,
        Ack(usize),
        Retry(usize, i64),
        Tick(i64),
    }

    fn priority_steps() -> impl Strategy<Value = Vec<PriorityStep>> {
        let step = prop_oneof![
            4 => (0..4u8, proptest::option::of(0..3u8)).prop_map(|(level, key)| PriorityStep::Push { level, key }),
            4 => Just(PriorityStep::Dequeue),
            2 => (0usize..6).prop_map(PriorityStep::Ack),
            1 => ((0usize..6), (0i64..300)).prop_map(|(i, ms)| PriorityStep::Retry(i, ms)),
            3 => (1i64..250).prop_map(PriorityStep::Tick),
        ];
        proptest::collection::vec(step, 0..150)
    }

    proptest! {
        /// Every dequeue hands out what a brute force picks: among the ready jobs
        /// (on a FIFO queue, the first unfinished of each key) the highest level —
        /// its own, plus one for every `aging` it waited ready, at most the top —
        /// then the lowest offset; and after every step the counts by state and the
        /// oldest ready job's age are the model's.
        #[test]
        fn dequeues_follow_priorities_with_aging_and_stats_match_the_model(
            steps in priority_steps(),
            fifo in any::<bool>(),
            levels in 1..5u8,
            aging in prop_oneof![Just(0i64), 50i64..400],
        ) {
            let policy = QueuePolicy { fifo, priority_levels: levels, priority_aging_ms: aging, max_attempts: u32::MAX, ..Default::default() };
            let mut queue = PartitionQueue::new(policy, 0, 0);
            let mut jobs: Vec<(Job, Modelled)> = Vec::new();
            let mut tried: BTreeSet<usize> = BTreeSet::new();
            let mut now = 1_000i64;
            let top = levels - 1;
            for step in steps {
                match step {
                    PriorityStep::Push { level, key } => {
                        let mut j = job(jobs.len(), key, None);
                        j.priority = Some(level.min(top));
                        queue.push(jobs.len() as i64, j.clone(), now);
                        jobs.push((j, Modelled::Waiting { at: now }));
                    }
                    PriorityStep::Dequeue => {
                        let unfinished_before = |offset: usize, key: &Option<String>| {
                            jobs[..offset].iter().any(|(j, state)| key.is_some() && j.key == *key && *state != Modelled::Done)
                        };
                        let effective = |j: &Job, since: i64| {
                            let risen = if aging > 0 { (now - since) / aging } else { 0 };
                            (i64::from(j.priority.unwrap_or(0)) + risen).min(i64::from(top))
                        };
                        let want = jobs
                            .iter()
                            .enumerate()
                            .filter_map(|(offset, (j, state))| match state {
                                Modelled::Waiting { at } if *at <= now && !(fifo && unfinished_before(offset, &j.key)) => {
                                    Some((effective(j, *at), offset))
                                }
                                _ => None,
                            })
                            .max_by_key(|&(level, offset)| (level, std::cmp::Reverse(offset)))
                            .map(|(_, offset)| offset as i64);
                        let handed = queue.dequeue(1, now, 10_000);
                        prop_assert_eq!(handed.first().map(|h| h.offset), want, "at {}", now);
                        if let Some(handout) = handed.first() {
                            jobs[handout.offset as usize].1 = Modelled::Out { lease: handout.lease };
                            tried.insert(handout.offset as usize);
                        }
                    }
                    PriorityStep::Ack(i) | PriorityStep::Retry(i, _) => {
                        let out: Vec<(usize, u64)> = jobs.iter().enumerate()
                            .filter_map(|(offset, (_, state))| match state { Modelled::Out { lease } => Some((offset, *lease)), _ => None })
                            .collect();
                        let Some(&(offset, lease)) = out.get(i) else { continue };
                        if let PriorityStep::Retry(_, ms) = step {
                            prop_assert_eq!(queue.nack(lease, Some(ms), "again", now), Ok(Failure::Retry { offset: offset as i64, at: now + ms }));
                            jobs[offset].1 = Modelled::Waiting { at: now + ms };
                        } else {
                            prop_assert_eq!(queue.ack(lease), Ok(offset as i64));
                            jobs[offset].1 = Modelled::Done;
                        }
                    }
                    PriorityStep::Tick(ms) => now += ms,
                }
                // The counts and the oldest ready job's age, against the model.
                let waiting = |offset: &usize, state: &Modelled| match state {
                    Modelled::Waiting { at } => Some((*offset, *at)),
                    _ => None,
                };
                let ready: Vec<i64> = jobs.iter().enumerate().filter_map(|(o, (_, s))| waiting(&o, s)).filter(|(_, at)| *at <= now).map(|(_, at)| at).collect();
                let delayed: Vec<usize> = jobs.iter().enumerate().filter_map(|(o, (_, s))| waiting(&o, s)).filter(|(_, at)| *at > now).map(|(o, _)| o).collect();
                let out = jobs.iter().filter(|(_, s)| matches!(s, Modelled::Out { .. })).count();
                let want = PartitionStats {
                    ready: ready.len(),
                    delayed: delayed.len(),
                    retrying: delayed.iter().filter(|o| tried.contains(o)).count(),
                    in_flight: out,
                    held: jobs.iter().filter(|(_, s)| *s != Modelled::Done).count(),
                    oldest_ready_since: ready.iter().min().copied(),
                };
                prop_assert_eq!(queue.stats(now), want, "at {}", now);
                // Only ready jobs are indexed by age and wait to rise.
                prop_assert_eq!(queue.ready_by_age.len(), queue.ready.len());
                prop_assert!(queue.aging.len() <= queue.ready.len(), "{} rises for {} ready jobs", queue.aging.len(), queue.ready.len());
            }
        }
    }

    /// New levels or aging apply to the jobs already ready, as if they had been
    /// declared when those became ready.
    #[test]
    fn changed_levels_and_aging_refile_the_ready_jobs() {
        let mut queue = PartitionQueue::new(QueuePolicy::default(), 0, 0);
        for offset in 0..3 {
            queue.push(offset, job(offset as usize, None, None), 0);
        }
        let mut high = job(3, None, None);
        high.priority = Some(2);
        queue.push(3, high, 0);
        let ranked = QueuePolicy { priority_levels: 3, priority_aging_ms: 0, ..Default::default() };
        queue.set_policy(ranked.clone());
        assert_eq!(queue.dequeue(1, 10, 100).remove(0).offset, 3, "the high job, ranked once levels exist");
        let mut late = job(4, None, None);
        late.priority = Some(2);
        queue.push(4, late, 2_000);
        // Aging turned on: the low jobs ready since 0 have risen twice by 2 000.
        queue.set_policy(QueuePolicy { priority_aging_ms: 1_000, ..ranked });
        let order: Vec<i64> = queue.dequeue(4, 2_000, 100).iter().map(|h| h.offset).collect();
        assert_eq!(order, vec![0, 1, 2, 4]);
        assert!(queue.aging.is_empty() && queue.ready.is_empty());
    }

    #[test]
    fn a_high_job_goes_before_a_backlog_of_low_ones_and_aging_lifts_the_low_ones() {
        let policy = QueuePolicy { priority_levels: 3, priority_aging_ms: 1_000, ..Default::default() };
        let mut queue = PartitionQueue::new(policy, 0, 0);
        for offset in 0..100 {
            queue.push(offset, job(offset as usize, None, None), 0);
        }
        let mut high = job(100, None, None);
        high.priority = Some(2);
        queue.push(100, high, 500);
        let first: Vec<i64> = queue.dequeue(2, 600, 10).iter().map(|h| h.offset).collect();
        assert_eq!(first, vec![100, 0], "the high job first, then the oldest low one");
        // Two seconds on, the low jobs have risen to the top level: a new high job
        // waits behind them (in offset order among equals).
        let mut later = job(101, None, None);
        later.priority = Some(2);
        queue.push(101, later, 2_000);
        let next: Vec<i64> = queue.dequeue(2, 2_000, 10).iter().map(|h| h.offset).collect();
        assert_eq!(next, vec![1, 2]);
        // A level past the queue's is refused (its dead letter says why).
        let mut past = job(102, None, None);
        past.priority = Some(3);
        assert_eq!(queue.policy().check(&past), Err("priority: 3 is past the queue's levels (0 to 2)".into()));
    }

    #[test]
    fn failures_back_off_then_go_dead_and_extend_keeps_a_lease() {
        let policy = QueuePolicy {
            max_attempts: 2,
            backoff: RetrySchedule { base_ms: 100, max_ms: 1_000 },
            ..Default::default()
        };
        let mut queue = PartitionQueue::new(policy, 0, 0);
        queue.push(0, job(0, None, None), 0);
        let first = queue.dequeue(10, 0, 50).remove(0);
        assert_eq!(queue.extend(first.lease, 500, 40), Ok(540));
        assert!(queue.expire(100).is_empty(), "extended");
        assert_eq!(queue.nack(first.lease, None, "x", 100), Ok(Failure::Retry { offset: 0, at: 200 }));
        assert!(queue.dequeue(10, 150, 50).is_empty(), "backing off");
        let second = queue.dequeue(10, 200, 50).remove(0);
        assert_eq!(second.attempt, 2);
        let dead = queue.expire(250);
        assert!(matches!(&dead[..], [Failure::Dead { offset: 0, attempts: 2, error, .. }] if error == "lease expired"));
        assert_eq!(queue.commit_offset(), 0, "not finished until the dead topic has it");
        queue.finish_dead(0);
        assert_eq!(queue.commit_offset(), 1);
    }

    #[test]
    fn a_refetched_offset_is_not_run_again() {
        let mut queue = PartitionQueue::new(QueuePolicy::default(), 5, 0);
        queue.push(4, job(4, None, None), 0);
        assert_eq!(queue.stats(0).held, 0, "below the committed offset");
        queue.push(5, job(5, None, None), 0);
        let handout = queue.dequeue(1, 0, 10).remove(0);
        queue.ack(handout.lease).unwrap();
        queue.push(5, job(5, None, None), 0);
        assert!(queue.dequeue(1, 0, 10).is_empty(), "finished, fetched again, not run again");
        assert_eq!(queue.commit_offset(), 6);
    }

    #[test]
    fn capacity_bounds_the_buffer() {
        let mut queue = PartitionQueue::new(QueuePolicy { capacity: 2, ..Default::default() }, 0, 0);
        queue.push(0, job(0, None, None), 0);
        assert!(queue.has_room(0));
        queue.push(1, job(1, None, None), 0);
        assert!(!queue.has_room(0));
        let handout = queue.dequeue(1, 0, 10).remove(0);
        queue.ack(handout.lease).unwrap();
        assert!(queue.has_room(0));
        let want =
            PartitionStats { ready: 1, delayed: 0, retrying: 0, in_flight: 0, held: 1, oldest_ready_since: Some(0) };
        assert_eq!(queue.stats(0), want);
    }

    #[test]
    fn delayed_jobs_do_not_take_the_room_of_ready_ones() {
        let policy = QueuePolicy { capacity: 2, delayed_capacity: 3, ..Default::default() };
        let mut queue = PartitionQueue::new(policy, 0, 0);
        for offset in 0..3 {
            queue.push(offset, job(offset as usize, None, Some(60_000)), 0);
        }
        assert!(!queue.has_room(0), "the delayed jobs' own room is full");
        let policy = QueuePolicy { capacity: 2, delayed_capacity: 1_000, ..Default::default() };
        let mut queue = PartitionQueue::new(policy, 0, 0);
        for offset in 0..500 {
            queue.push(offset, job(offset as usize, None, Some(60_000)), 0);
        }
        assert!(queue.has_room(0), "500 delayed jobs leave the ready room free");
        queue.push(500, job(500, None, None), 0);
        let handed: Vec<i64> = queue.dequeue(10, 0, 10).iter().map(|h| h.offset).collect();
        assert_eq!(handed, vec![500], "the ready job runs at once");
        let want =
            PartitionStats { ready: 0, delayed: 500, retrying: 0, in_flight: 1, held: 501, oldest_ready_since: None };
        assert_eq!(queue.stats(0), want);
        assert_eq!(queue.commit_offset(), 0, "the delayed jobs are unfinished");
        // When they come due they count as ready, and pause fetching.
        assert!(!queue.has_room(60_000));
        assert_eq!(queue.stats(60_000).ready, 500);
    }

    #[test]
    fn bytes_bound_the_buffer() {
        let mut queue = PartitionQueue::new(QueuePolicy { max_bytes: 10_000, ..Default::default() }, 0, 0);
        let mut big = job(0, None, None);
        big.payload = serde_json::value::to_raw_value(&"x".repeat(12_000)).unwrap();
        queue.push(0, big, 0);
        assert!(!queue.has_room(0));
        let handout = queue.dequeue(1, 0, 10).remove(0);
        queue.ack(handout.lease).unwrap();
        assert!(queue.has_room(0));
    }

    #[test]
    fn delayed_bytes_do_not_take_the_room_of_ready_ones() {
        let mut queue = PartitionQueue::new(QueuePolicy { max_bytes: 10_000, ..Default::default() }, 0, 0);
        let big = |offset: usize, run_at: Option<i64>| {
            let mut job = job(offset, None, run_at);
            job.payload = serde_json::value::to_raw_value(&"x".repeat(6_000)).unwrap();
            job
        };
        queue.push(0, big(0, Some(60_000)), 0);
        assert!(queue.has_room(0), "6 KB delayed of 10 KB");
        queue.push(1, big(1, Some(60_000)), 0);
        assert!(!queue.has_room(0), "the delayed jobs' bytes are full");
        let mut queue = PartitionQueue::new(QueuePolicy { max_bytes: 10_000, ..Default::default() }, 0, 0);
        queue.push(0, big(0, Some(60_000)), 0);
        queue.push(1, big(1, None), 0);
        assert!(queue.has_room(0), "6 KB ready and 6 KB delayed fit, each within 10 KB");
        queue.push(2, big(2, None), 0);
        assert!(!queue.has_room(0));
        assert!(!queue.has_room(60_000), "due: 18 KB ready");
    }

    #[test]
    fn leases_of_an_earlier_tenure_are_unknown() {
        let mut first = PartitionQueue::new(QueuePolicy::default(), 0, 1);
        first.push(0, job(0, None, None), 0);
        let stale = first.dequeue(1, 0, 1_000).remove(0);
        // The broker lets go of the partition and takes it back: a new tenure.
        let mut again = PartitionQueue::new(QueuePolicy::default(), 0, 2);
        again.push(0, job(0, None, None), 0);
        let current = again.dequeue(1, 0, 1_000).remove(0);
        assert_ne!(stale.lease, current.lease);
        assert_eq!(again.ack(stale.lease), Err(LeaseError::Unknown));
        assert_eq!(again.stats(0).in_flight, 1, "the running job is still leased");
        assert_eq!(again.ack(current.lease), Ok(0));
    }

    #[test]
    fn a_rejected_record_holds_the_watermark_until_its_dead_letter_is_written() {
        let mut queue = PartitionQueue::new(QueuePolicy::default(), 0, 0);
        queue.reject(0);
        queue.push(1, job(1, None, None), 0);
        let handout = queue.dequeue(1, 0, 10).remove(0);
        queue.ack(handout.lease).unwrap();
        assert_eq!(queue.commit_offset(), 0);
        queue.finish_dead(0);
        assert_eq!(queue.commit_offset(), 2);
    }
}
