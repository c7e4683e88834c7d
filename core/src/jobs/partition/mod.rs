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
//! On a queue with concurrency limits ([`super::limits`]) a ready job whose key has
//! as many jobs in flight as its limit is parked — filed again when one of them
//! ends — and the partition never has more in flight than its slots (its share of
//! the queue's total), nor hands out anything while it is held after a take-over.
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

use super::limits::{AtLimit, Limits};
use super::schedule::RetrySchedule;
use super::unique::{OnDuplicate, UniqueKeys};
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
    /// Jobs in flight per concurrency key and in total ([`super::limits`]).
    pub limits: Limits,
    /// The longest window a unique job may hold its key for, and the default of
    /// one that names none (0: until it finishes) ([`super::unique`]).
    pub unique_for_ms: i64,
    /// What a job whose unique key is held does: refused, or taking the place of
    /// the key's waiting job ([`replace`]).
    pub on_duplicate: OnDuplicate,
    /// A debounced job waits this long after its enqueue time (`on_duplicate =
    /// "debounce"`).
    pub debounce_ms: i64,
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
            _ => match job.unique_for_ms {
                Some(_) if self.on_duplicate != OnDuplicate::Refuse => Err(format!(
                    "unique_for_ms: the queue's on_duplicate = \"{}\" holds a unique key while its job waits, \
                     for no window; leave unique_for_ms out",
                    self.on_duplicate.name()
                )),
                Some(ms) if ms > self.unique_for_ms => Err(format!(
                    "unique_for_ms: {ms} is past the queue's unique_for_ms ({}), the longest window it replays",
                    self.unique_for_ms
                )),
                _ => self.limits.key_of(job).map(|_| ()),
            },
        }
    }

    /// How long a unique job holds its key (0: until it finishes).
    pub fn unique_window(&self, job: &Job) -> i64 {
        job.unique_for_ms.unwrap_or(self.unique_for_ms)
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
            limits: Limits::default(),
            unique_for_ms: 0,
            on_duplicate: OnDuplicate::Refuse,
            debounce_ms: 0,
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
    /// Its concurrency key ([`Limits::key_of`]).
    ckey: Option<String>,
    /// Cancelled while it ran (why: [`CANCELLED`], [`SUPERSEDED`]): its attempt
    /// ends so, never retried.
    cancelled: Option<&'static str>,
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
    /// Its concurrency key ([`Limits::key_of`]).
    pub ckey: Option<String>,
}

/// The error a cancelled job ends with on the dead topic.
pub const CANCELLED: &str = "cancelled by an operator";

/// The error a running job cancelled by a newer job of its key ends with
/// (`limits.at_limit = "cancel_in_progress"`).
pub const SUPERSEDED: &str = "cancelled: a newer job of its concurrency key superseded it";

/// The error a failed attempt ends with, not retried, when a newer job of its
/// unique key waits (`on_duplicate = "replace"` or `"debounce"`).
pub const REPLACED: &str = "replaced: a newer job of its unique key waits";

/// What a cancelled job was doing (ordered: running is the more telling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cancelled {
    /// Ready, delayed or parked: it never runs.
    Waiting,
    /// Leased: its worker stops it on its next extend.
    Running,
}

/// A job in flight, as an operator sees it (and may cancel it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunningJob {
    pub id: String,
    pub partition: i32,
    pub offset: i64,
    /// 1 for the first try.
    pub attempt: u32,
    /// When its lease ends unless its worker extends it (ms since the epoch).
    pub lease_deadline_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// Cancelled: its worker is told at its next extend.
    pub cancelled: bool,
}

/// A lease extended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extended {
    pub deadline: i64,
    /// Its job was cancelled: the worker should stop it.
    pub cancelled: bool,
}

/// What became of a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Runs again at `at`.
    Retry { offset: i64, at: i64 },
    /// Out of attempts: publish it to the dead topic, then call
    /// [`PartitionQueue::finish_dead`].
    Dead { offset: i64, attempts: u32, error: String, job: Box<Job> },
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
    /// Jobs in flight per concurrency key (a key with none is absent).
    running: HashMap<String, u32>,
    /// Ready jobs of each concurrency key at its limit, met by a dequeue or filed
    /// while it was: filed in `ready` again when one of the key's jobs in flight
    /// ends. Parking is lazy — a job is parked only when a dequeue meets it — so
    /// a key's other jobs cost nothing while they are not next.
    parked: HashMap<String, BTreeSet<ReadyKey>>,
    /// How many jobs are parked.
    parked_len: usize,
    /// Most jobs of this partition in flight at once: its share of the queue's
    /// `limits.total`.
    slots: Option<usize>,
    /// Nothing is handed out before this time ([`PartitionQueue::hold_until`]).
    hold_until: i64,
    /// Jobs ended without running (dropped at their key's limit, cancelled while
    /// waiting), for the broker to write to the dead topic.
    ended: Vec<Failure>,
    /// Let go ([`PartitionQueue::retire`]): nothing is handed out or extended.
    retired: bool,
    /// The unique keys held ([`super::unique`]).
    unique: UniqueKeys,
    /// The latest tick accepted of each schedule whose ticks live here.
    latest_ticks: HashMap<String, i64>,
    /// On a queue that replaces or debounces: the latest job of each unique key
    /// held, `(enqueue time, offset)` (replaced by a newer one while it waits).
    waiting_unique: HashMap<String, (i64, i64)>,
    /// Offsets admitted as already replaced: finished as they are pushed.
    stale: BTreeSet<i64>,
}

/// What a held job costs in memory, roughly.
fn job_bytes(job: &Job) -> usize {
    let keys = job.key.as_ref().map_or(0, String::len) + job.concurrency_key.as_ref().map_or(0, String::len);
    job.payload.get().len() + job.id.len() + keys + 128
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
            running: HashMap::new(),
            parked: HashMap::new(),
            parked_len: 0,
            slots: None,
            hold_until: i64::MIN,
            ended: Vec::new(),
            retired: false,
            unique: UniqueKeys::default(),
            latest_ticks: HashMap::new(),
            waiting_unique: HashMap::new(),
            stale: BTreeSet::new(),
        }
    }

    /// Decides whether the job at `offset`, enqueued at `at`, is a duplicate
    /// (the reason) before it is pushed; a job without a unique key is never one.
    /// On a queue that replaces or debounces ([`OnDuplicate`]) no job is one: it
    /// takes the place of its key's waiting job (the offset of the job it
    /// replaced, which is finished), and a debounced one waits out its quiet
    /// period from `at` ([`replace`]).
    pub fn admit_unique(&mut self, offset: i64, job: &mut Job, at: i64) -> Result<Option<i64>, String> {
        let Some(key) = job.unique_key() else { return Ok(None) };
        if job.tick.is_some() || self.policy.on_duplicate == OnDuplicate::Refuse {
            self.unique.admit(&key, offset, at, self.policy.unique_window(job))?;
            self.saw_tick(job);
            return Ok(None);
        }
        let key = key.into_owned();
        Ok(self.replace_waiting(key, offset, job, at))
    }

    /// The latest tick of `schedule` accepted here (fetched, or replayed).
    pub fn latest_tick(&self, schedule: &str) -> Option<i64> {
        self.latest_ticks.get(schedule).copied()
    }

    fn saw_tick(&mut self, job: &Job) {
        if let Some(tick) = &job.tick {
            let latest = self.latest_ticks.entry(tick.schedule.clone()).or_insert(tick.at);
            *latest = (*latest).max(tick.at);
        }
    }

    /// Until when `key` is held for a job enqueued at `at` (`i64::MAX`: until a
    /// job finishes); none: free.
    pub fn unique_held_until(&self, key: &str, at: i64) -> Option<i64> {
        self.unique.held_until(key, at)
    }

    /// Replays a finished job below the committed offset (a take-over): it holds
    /// its key for its window, as it did when it was enqueued.
    pub fn replay_unique(&mut self, offset: i64, job: &Job, at: i64) {
        if job.tick.is_none() && self.policy.on_duplicate != OnDuplicate::Refuse {
            return; // its key was held only while it waited
        }
        if let Some(key) = job.unique_key() {
            if self.unique.admit(&key, offset, at, self.policy.unique_window(job)).is_ok() {
                self.unique.finish(&key, offset);
                self.saw_tick(job);
            }
        }
    }

    /// Hands out nothing before `until` (ms since the epoch): the broker that takes
    /// a limited queue's partition waits out the leases its previous owner may
    /// have handed out, which still count against the limits.
    pub fn hold_until(&mut self, until: i64) {
        self.hold_until = until;
    }

    /// Until when nothing is handed out (none: not held).
    pub fn held_until(&self, now: i64) -> Option<i64> {
        (self.hold_until > now).then_some(self.hold_until)
    }

    /// This partition's share of the queue's total limit (none: no total).
    pub fn set_slots(&mut self, slots: Option<usize>) {
        self.slots = slots;
    }

    pub fn slots(&self) -> Option<usize> {
        self.slots
    }

    /// Lets the partition go: from now on it hands out and extends nothing (its
    /// leases end by their deadlines; the next owner waits them out).
    pub fn retire(&mut self) {
        self.retired = true;
    }

    /// The jobs in flight of each concurrency key that has some.
    pub fn keys_in_flight(&self) -> impl Iterator<Item = (&str, u32)> {
        self.running.iter().map(|(key, n)| (key.as_str(), *n))
    }

    /// The jobs in flight, lowest offset first, as in `partition`.
    pub fn running(&self, partition: i32) -> Vec<RunningJob> {
        let mut running: Vec<RunningJob> = self
            .leases
            .values()
            .filter_map(|&offset| {
                let entry = self.entries.get(&offset)?;
                let State::Leased { deadline, .. } = entry.state else { return None };
                Some(RunningJob {
                    id: entry.job.id.clone(),
                    partition,
                    offset,
                    attempt: entry.attempts,
                    lease_deadline_ms: deadline,
                    concurrency_key: entry.ckey.clone(),
                    priority: entry.job.priority,
                    cancelled: entry.cancelled.is_some(),
                })
            })
            .collect();
        running.sort_unstable_by_key(|job| job.offset);
        running
    }

    /// The jobs ended without running since the last call — dropped at their
    /// key's limit, or cancelled while waiting: each is [`Failure::Dead`], to be
    /// written to the dead topic and finished ([`PartitionQueue::finish_dead`]).
    pub fn take_ended(&mut self) -> Vec<Failure> {
        std::mem::take(&mut self.ended)
    }

    /// Cancels the job `id` if this partition holds it: one waiting (ready,
    /// delayed, parked) ends at once as cancelled ([`PartitionQueue::take_ended`]);
    /// one running is told on its next extend, and its attempt ends as cancelled
    /// (a nack or an expiry never retries it). What it was; none when not held
    /// (finished, dying, or not fetched).
    pub fn cancel(&mut self, id: &str) -> Option<Cancelled> {
        // Every copy held (a producer's retry, a job forwarded twice), running first.
        let offsets: Vec<i64> =
            self.entries.iter().filter(|(_, entry)| entry.job.id == id).map(|(offset, _)| *offset).collect();
        offsets.into_iter().filter_map(|offset| self.cancel_at(offset)).max()
    }

    fn cancel_at(&mut self, offset: i64) -> Option<Cancelled> {
        let entry = self.entries.get_mut(&offset)?;
        match entry.state {
            State::Dying => None,
            State::Leased { .. } => {
                entry.cancelled = Some(CANCELLED);
                Some(Cancelled::Running)
            }
            State::Waiting => {
                let failure = Failure::Dead {
                    offset,
                    attempts: entry.attempts,
                    error: CANCELLED.to_string(),
                    job: Box::new(entry.job.clone()),
                };
                self.take_out_waiting(offset);
                if let Some(entry) = self.entries.get_mut(&offset) {
                    entry.state = State::Dying;
                }
                self.ended.push(failure);
                Some(Cancelled::Waiting)
            }
        }
    }

    /// Takes a waiting job out of every index that files it (timed, ready, parked,
    /// aging); it stays held.
    fn take_out_waiting(&mut self, offset: i64) {
        let Some(entry) = self.entries.get_mut(&offset) else { return };
        let (ready_at, since, rises_at) = (entry.ready_at, entry.ready_since, entry.rises_at.take());
        if self.timed.remove(&(ready_at, offset)) {
            self.timed_bytes -= self.bytes_at(offset);
        } else {
            self.unfile(self.ready_key(offset));
            self.ready_by_age.remove(&(since, offset));
            if let Some(at) = rises_at {
                self.aging.remove(&(at, offset));
            }
        }
    }

    pub fn policy(&self) -> &QueuePolicy {
        &self.policy
    }

    /// New settings of the queue (a changed declaration): they apply from now on;
    /// jobs held stay, and a FIFO gate turned on holds back keys already running.
    pub fn set_policy(&mut self, policy: QueuePolicy) {
        let refile = (policy.priority_levels, policy.priority_aging_ms, &policy.limits)
            != (self.policy.priority_levels, self.policy.priority_aging_ms, &self.policy.limits);
        self.policy = policy;
        if refile {
            // Every ready job starts over at its own level under the new levels, its
            // rises due from when it became ready (the next `promote` catches up),
            // parked if its key is at a new limit.
            let ready: Vec<(i64, i64)> = self.ready_by_age.iter().copied().collect();
            self.ready.clear();
            self.ready_heads.clear();
            self.parked.clear();
            self.parked_len = 0;
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
    /// one), at its own level — or, a new job whose key is at its limit on a
    /// `drop_newest` queue, drops it.
    fn make_ready(&mut self, offset: i64, since: i64) {
        let (top, aging) = (self.policy.priority_levels.saturating_sub(1), self.policy.priority_aging_ms);
        let Some(entry) = self.entries.get(&offset) else { return };
        if self.policy.limits.at_limit == AtLimit::DropNewest && entry.attempts == 0 {
            if let Some(key) = entry.ckey.as_deref().filter(|key| self.at_limit(key)) {
                let limit = self.policy.limits.limit_of(key).unwrap_or(0);
                let error = format!(
                    "dropped: its concurrency key {key:?} had {limit} jobs in flight, its limit \
                     (the queue's limits.at_limit = \"drop_newest\")"
                );
                let failure = Failure::Dead { offset, attempts: 0, error, job: Box::new(entry.job.clone()) };
                self.ended.push(failure);
                if let Some(entry) = self.entries.get_mut(&offset) {
                    entry.state = State::Dying;
                }
                return;
            }
        }
        if self.policy.limits.at_limit == AtLimit::CancelInProgress && entry.attempts == 0 {
            if let Some(key) = entry.ckey.clone().filter(|key| self.at_limit(key)) {
                self.supersede(&key);
            }
        }
        let Some(entry) = self.entries.get_mut(&offset) else { return };
        entry.level = self.policy.level_of(&entry.job);
        entry.rises_at = (aging > 0 && entry.level < top).then(|| since.saturating_add(aging));
        entry.ready_since = since;
        self.ready_by_age.insert((since, offset));
        let (key, rises_at) = ((std::cmp::Reverse(entry.level), offset), entry.rises_at);
        if let Some(at) = rises_at {
            self.aging.insert((at, offset));
        }
        self.file(key);
    }

    /// Cancels the jobs of `key` in flight: a newer one waits for their slots.
    fn supersede(&mut self, key: &str) {
        for offset in self.leases.values() {
            if let Some(entry) = self.entries.get_mut(offset) {
                if entry.ckey.as_deref() == Some(key) && entry.cancelled.is_none() {
                    entry.cancelled = Some(SUPERSEDED);
                }
            }
        }
    }

    /// Whether `key` has as many jobs in flight as its limit allows.
    fn at_limit(&self, key: &str) -> bool {
        self.policy.limits.limit_of(key).is_some_and(|limit| self.running.get(key).copied().unwrap_or(0) >= limit)
    }

    /// Files a ready job where a dequeue finds it (and as a ready head when it is
    /// one), or parks it while its key is at its limit.
    fn file(&mut self, ready: ReadyKey) {
        let offset = ready.1;
        let key = self.entries.get(&offset).and_then(|entry| entry.ckey.as_deref());
        if let Some(key) = key.filter(|key| self.at_limit(key)) {
            let key = key.to_string();
            self.park(key, ready);
            return;
        }
        self.ready.insert(ready);
        if self.is_head(offset) {
            self.ready_heads.insert(ready);
        }
    }

    fn park(&mut self, key: String, ready: ReadyKey) {
        if self.parked.entry(key).or_default().insert(ready) {
            self.parked_len += 1;
        }
    }

    /// Takes a ready job out of wherever it is filed; whether it was.
    fn unfile(&mut self, ready: ReadyKey) -> bool {
        self.ready_heads.remove(&ready);
        if self.ready.remove(&ready) {
            return true;
        }
        let Some(key) = self.entries.get(&ready.1).and_then(|entry| entry.ckey.as_deref()) else { return false };
        let Some(of_key) = self.parked.get_mut(key) else { return false };
        let parked = of_key.remove(&ready);
        if of_key.is_empty() {
            self.parked.remove(key);
        }
        self.parked_len -= usize::from(parked);
        parked
    }

    /// A job of `key` was handed out.
    fn start_running(&mut self, key: &str) {
        match self.running.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                self.running.insert(key.to_string(), 1);
            }
        }
    }

    /// A lease of the job at `offset` ended (acked, failed or expired): its key's
    /// parked jobs are filed again when it falls below its limit.
    fn stop_running(&mut self, offset: i64) {
        let Some(key) = self.entries.get(&offset).and_then(|entry| entry.ckey.as_deref()) else { return };
        match self.running.get_mut(key) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                self.running.remove(key);
            }
        }
        if !self.parked.contains_key(key) || self.at_limit(key) {
            return;
        }
        let parked = self.parked.remove(key).unwrap_or_default();
        self.parked_len -= parked.len();
        for ready in parked {
            self.ready.insert(ready);
            if self.is_head(ready.1) {
                self.ready_heads.insert(ready);
            }
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
        if self.unfile(old) {
            self.file(new);
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
        if self.stale.remove(&offset) {
            // Replaced as it was admitted: finished.
            self.next_offset = offset + 1;
            return;
        }
        let ready_at = job.run_at.unwrap_or(i64::MIN);
        self.held_bytes += job_bytes(&job);
        if let Some(key) = &job.key {
            self.by_key.entry(key.clone()).or_default().insert(offset);
        }
        let ckey = self.policy.limits.key_of(&job).ok().flatten().map(std::borrow::Cow::into_owned);
        let state = State::Waiting;
        let entry = Entry {
            job,
            attempts: 0,
            ready_at,
            state,
            level: 0,
            rises_at: None,
            ready_since: 0,
            ckey,
            cancelled: None,
        };
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
    /// A job whose key is at its limit waits (parked), and the partition hands out
    /// no more than its slots allow in flight, nothing while it is held.
    pub fn dequeue(&mut self, max: usize, now: i64, lease_ms: i64) -> Vec<Handout> {
        self.promote(now);
        let mut handed = Vec::new();
        if now < self.hold_until || self.retired {
            return handed;
        }
        let room = self.slots.map_or(max, |slots| slots.saturating_sub(self.leases.len()).min(max));
        while handed.len() < room {
            // On a FIFO queue the first unfinished job of a key decides for all later ones.
            let source = if self.policy.fifo { &self.ready_heads } else { &self.ready };
            let Some(&key) = source.first() else { break };
            let offset = key.1;
            self.unfile(key);
            let ckey = self.entries.get(&offset).and_then(|entry| entry.ckey.as_deref());
            if let Some(ckey) = ckey.filter(|ckey| self.at_limit(ckey)) {
                // Its key is at its limit: it waits apart until one of the key's ends.
                let ckey = ckey.to_string();
                self.park(ckey, key);
                continue;
            }
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
            let ckey = entry.ckey.clone();
            handed.push(Handout {
                offset,
                lease,
                attempt: entry.attempts,
                deadline,
                job: entry.job.clone(),
                ckey: ckey.clone(),
            });
            if let Some(ckey) = ckey {
                self.start_running(&ckey);
            }
        }
        handed
    }

    /// The job is done: it is finished.
    pub fn ack(&mut self, lease: u64) -> Result<i64, LeaseError> {
        let offset = self.leases.remove(&lease).ok_or(LeaseError::Unknown)?;
        self.stop_running(offset);
        self.remove(offset);
        Ok(offset)
    }

    /// Drops a finished job (it is in no index: it was leased or dying).
    fn remove(&mut self, offset: i64) {
        let Some(entry) = self.entries.remove(&offset) else { return };
        self.held_bytes -= job_bytes(&entry.job);
        if let Some(key) = entry.job.unique_key() {
            self.unique.finish(&key, offset);
            if self.waiting_unique.get(key.as_ref()).is_some_and(|&(_, latest)| latest == offset) {
                self.waiting_unique.remove(key.as_ref());
            }
        }
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
        self.stop_running(offset);
        Ok(self.fail(offset, retry_in_ms, error, now))
    }

    fn fail(&mut self, offset: i64, retry_in_ms: Option<i64>, error: &str, now: i64) -> Failure {
        let replaced = self.replaced_while_running(offset);
        let policy = &self.policy;
        let Some(entry) = self.entries.get_mut(&offset) else {
            return Failure::Retry { offset, at: now };
        };
        if entry.attempts >= policy.max_attempts || entry.cancelled.is_some() || replaced {
            entry.state = State::Dying;
            let error = entry.cancelled.or(replaced.then_some(REPLACED)).unwrap_or(error).to_string();
            return Failure::Dead { offset, attempts: entry.attempts, error, job: Box::new(entry.job.clone()) };
        }
        let wait = retry_in_ms.unwrap_or_else(|| policy.backoff.delay_ms(entry.attempts)).max(0);
        let at = now.saturating_add(wait);
        entry.state = State::Waiting;
        entry.ready_at = at;
        self.wait(offset, at, now);
        Failure::Retry { offset, at }
    }

    /// Moves a lease's deadline to `now + lease_ms`; says whether its job was
    /// cancelled (its worker stops it, then nacks: it ends as cancelled).
    pub fn extend(&mut self, lease: u64, lease_ms: i64, now: i64) -> Result<Extended, LeaseError> {
        if self.retired {
            return Err(LeaseError::Unknown);
        }
        let offset = *self.leases.get(&lease).ok_or(LeaseError::Unknown)?;
        let entry = self.entries.get_mut(&offset).ok_or(LeaseError::Unknown)?;
        let deadline = now.saturating_add(lease_ms);
        entry.state = State::Leased { lease, deadline };
        Ok(Extended { deadline, cancelled: entry.cancelled.is_some() })
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
                self.stop_running(offset);
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
            ready: self.ready.len() + self.parked_len + due,
            delayed: self.timed.len() - due,
            retrying,
            in_flight: self.leases.len(),
            held: self.entries.len(),
            oldest_ready_since: [oldest_due, oldest_ready].into_iter().flatten().min(),
        }
    }
}

mod replace;
#[cfg(test)]
mod tests;
