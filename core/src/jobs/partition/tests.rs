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
        concurrency_key: None,
        unique_key: None,
        unique_for_ms: None,
        tick: None,
        trace: None,
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
            // An operator's listing of the jobs in flight is the workers' leases.
            let mut leased: Vec<(String, i32, i64, u32, i64, bool)> =
                out.iter().map(|o| (o.job.id.clone(), 7, o.offset, o.attempt, o.deadline, false)).collect();
            leased.sort_by_key(|job| job.2);
            let listed: Vec<(String, i32, i64, u32, i64, bool)> = queue.running(7).into_iter()
                .map(|r| (r.id, r.partition, r.offset, r.attempt, r.lease_deadline_ms, r.cancelled)).collect();
            prop_assert_eq!(listed, leased);
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
    let policy =
        QueuePolicy { max_attempts: 2, backoff: RetrySchedule { base_ms: 100, max_ms: 1_000 }, ..Default::default() };
    let mut queue = PartitionQueue::new(policy, 0, 0);
    queue.push(0, job(0, None, None), 0);
    let first = queue.dequeue(10, 0, 50).remove(0);
    assert_eq!(queue.extend(first.lease, 500, 40).map(|e| e.deadline), Ok(540));
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
    let want = PartitionStats { ready: 1, delayed: 0, retrying: 0, in_flight: 0, held: 1, oldest_ready_since: Some(0) };
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

#[derive(Debug, Clone)]
enum LimitStep {
    Push { ckey: Option<u8>, fifo_key: Option<u8>, delay: Option<i64>, level: u8 },
    Dequeue(usize),
    Ack(usize),
    Nack(usize, i64),
    Tick(i64),
    Hold(i64),
    Relimit(u32),
    FinishDead,
    Cancel(usize),
}

fn limit_steps() -> impl Strategy<Value = Vec<LimitStep>> {
    let push = (proptest::option::of(0..4u8), proptest::option::of(0..2u8), proptest::option::of(0i64..300), 0..3u8)
        .prop_map(|(ckey, fifo_key, delay, level)| LimitStep::Push { ckey, fifo_key, delay, level });
    let step = prop_oneof![
        5 => push,
        4 => (1usize..5).prop_map(LimitStep::Dequeue),
        3 => (0usize..8).prop_map(LimitStep::Ack),
        1 => ((0usize..8), (0i64..300)).prop_map(|(i, ms)| LimitStep::Nack(i, ms)),
        2 => (1i64..400).prop_map(LimitStep::Tick),
        1 => (0i64..500).prop_map(LimitStep::Hold),
        1 => (1u32..4).prop_map(LimitStep::Relimit),
        1 => Just(LimitStep::FinishDead),
        2 => (0usize..40).prop_map(LimitStep::Cancel),
    ];
    proptest::collection::vec(step, 0..200)
}

/// What the brute force knows of a job in the limits test.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Held {
    Waiting { at: i64, tried: bool },
    Out { lease: u64, deadline: i64 },
    Dying,
    Done,
}

/// A job's place in the limits test: its state, and whether it was cancelled.
fn was_cancelled(cancelled: &BTreeSet<usize>, offset: i64) -> bool {
    cancelled.contains(&(offset as usize))
}

proptest! {
    /// Against a brute force: no dequeue hands out a job whose key is at its limit
    /// (an override's, else `per_key`, changed at any time), more than the
    /// partition's slots in flight, or anything while held; a dequeue that hands
    /// out fewer than asked leaves no job a worker could have had (none stays
    /// parked once its key has room); `drop_newest` drops only new jobs of a key at
    /// its limit; a job cancelled while waiting never runs, one cancelled while
    /// running is told on its next extend and is never retried; and every job ends
    /// finished.
    #[test]
    fn limits_and_cancels_hold_and_never_strand_a_job(
        steps in limit_steps(),
        fifo in any::<bool>(),
        per_key in 1u32..3,
        slots in proptest::option::of(1usize..6),
        drop_newest in any::<bool>(),
        levels in 1..4u8,
    ) {
        use crate::jobs::limits::{KeyOverride, Limits};
        let limits_of = |per_key: u32| Limits {
            per_key: Some(per_key),
            overrides: vec![KeyOverride { pattern: "c0*".into(), per_key: per_key + 1 }],
            at_limit: if drop_newest { AtLimit::DropNewest } else { AtLimit::Wait },
            ..Default::default()
        };
        let policy = |per_key| QueuePolicy {
            fifo, max_attempts: 3, priority_levels: levels, priority_aging_ms: 100, limits: limits_of(per_key),
            backoff: RetrySchedule { base_ms: 50, max_ms: 200 }, ..Default::default()
        };
        let mut limits = limits_of(per_key);
        let mut queue = PartitionQueue::new(policy(per_key), 0, 0);
        queue.set_slots(slots);
        let mut jobs: Vec<(Job, Held)> = Vec::new();
        let mut cancelled: BTreeSet<usize> = BTreeSet::new();
        let (mut now, mut hold) = (1_000i64, i64::MIN);
        let out_of = |jobs: &[(Job, Held)], key: &str| {
            jobs.iter().filter(|(job, held)| matches!(held, Held::Out { .. }) && job.concurrency_key.as_deref() == Some(key)).count() as u32
        };
        let out_total = |jobs: &[(Job, Held)]| jobs.iter().filter(|(_, held)| matches!(held, Held::Out { .. })).count();
        for step in steps {
            match step {
                LimitStep::Push { ckey, fifo_key, delay, level } => {
                    let id = jobs.len();
                    let mut new = job(id, fifo_key, delay.map(|d| now + d));
                    new.concurrency_key = ckey.map(|k| format!("c{k}"));
                    new.priority = Some(level.min(levels - 1));
                    queue.push(id as i64, new.clone(), now);
                    jobs.push((new, Held::Waiting { at: delay.map_or(i64::MIN, |d| now + d), tried: false }));
                    for dropped in queue.take_ended() {
                        let Failure::Dead { offset, job, .. } = dropped else { panic!("a drop is dead") };
                        prop_assert_eq!(offset, id as i64, "only the job pushed becomes ready");
                        let key = job.concurrency_key.unwrap();
                        prop_assert!(drop_newest && out_of(&jobs, &key) >= limits.limit_of(&key).unwrap());
                        jobs[id].1 = Held::Dying;
                    }
                }
                LimitStep::Dequeue(max) => {
                    let before: Vec<Held> = jobs.iter().map(|(_, held)| *held).collect();
                    let handed = queue.dequeue(max, now, 300);
                    for dropped in queue.take_ended() {
                        let Failure::Dead { offset, attempts, job, .. } = dropped else { panic!("a drop is dead") };
                        let key = job.concurrency_key.clone().unwrap();
                        prop_assert!(drop_newest && attempts == 0);
                        let out_before = jobs.iter().zip(&before).filter(|((j, _), held)| matches!(held, Held::Out { .. }) && j.concurrency_key.as_deref() == Some(key.as_str())).count() as u32;
                        prop_assert!(out_before >= limits.limit_of(&key).unwrap(), "dropped {} below its limit", key);
                        jobs[offset as usize].1 = Held::Dying;
                    }
                    prop_assert!(handed.is_empty() || now >= hold, "handed out while held");
                    for handout in &handed {
                        prop_assert!(!was_cancelled(&cancelled, handout.offset), "a cancelled job ran");
                        prop_assert!(slots.is_none_or(|slots| out_total(&jobs) < slots), "over the slots");
                        let (job, held) = &mut jobs[handout.offset as usize];
                        prop_assert!(matches!(held, Held::Waiting { at, .. } if *at <= now), "not ready: {:?}", held);
                        *held = Held::Out { lease: handout.lease, deadline: handout.deadline };
                        let key = job.concurrency_key.clone();
                        prop_assert_eq!(&handout.ckey, &key);
                        if let Some(key) = key {
                            prop_assert!(out_of(&jobs, &key) <= limits.limit_of(&key).unwrap(), "{} over its limit", key);
                        }
                    }
                    let room = slots.is_none_or(|slots| out_total(&jobs) < slots);
                    if handed.len() < max && now >= hold && room {
                        // Nothing left that a worker could have had.
                        let unfinished = |job: &Job, upto: usize| jobs[..upto].iter().any(|(j, held)| j.key.is_some() && j.key == job.key && !matches!(held, Held::Done));
                        let eligible = jobs.iter().enumerate().find(|(i, (job, held))| {
                            matches!(held, Held::Waiting { at, .. } if *at <= now)
                                && job.concurrency_key.as_deref().is_none_or(|key| out_of(&jobs, key) < limits.limit_of(key).unwrap())
                                && !(fifo && unfinished(job, *i))
                        });
                        prop_assert!(eligible.is_none(), "job {:?} stranded", eligible.map(|(i, _)| i));
                    }
                }
                LimitStep::Ack(i) => {
                    let out: Vec<usize> = (0..jobs.len()).filter(|&j| matches!(jobs[j].1, Held::Out { .. })).collect();
                    if let Some(&j) = out.get(i) {
                        let Held::Out { lease, .. } = jobs[j].1 else { unreachable!() };
                        prop_assert_eq!(queue.ack(lease), Ok(j as i64));
                        jobs[j].1 = Held::Done;
                    }
                }
                LimitStep::Nack(i, ms) => {
                    let out: Vec<usize> = (0..jobs.len()).filter(|&j| matches!(jobs[j].1, Held::Out { .. })).collect();
                    if let Some(&j) = out.get(i) {
                        let Held::Out { lease, .. } = jobs[j].1 else { unreachable!() };
                        jobs[j].1 = match queue.nack(lease, Some(ms), "boom", now).unwrap() {
                            Failure::Retry { at, .. } => {
                                prop_assert!(!cancelled.contains(&j), "a cancelled job is retried");
                                Held::Waiting { at, tried: true }
                            }
                            Failure::Dead { error, .. } => {
                                prop_assert_eq!(error == CANCELLED, cancelled.contains(&j));
                                Held::Dying
                            }
                        };
                    }
                }
                LimitStep::Tick(ms) => {
                    now += ms;
                    for failure in queue.expire(now) {
                        match failure {
                            Failure::Retry { offset, at } => {
                                prop_assert!(!was_cancelled(&cancelled, offset), "a cancelled job is retried");
                                jobs[offset as usize].1 = Held::Waiting { at, tried: true };
                            }
                            Failure::Dead { offset, error, .. } => {
                                prop_assert!(!was_cancelled(&cancelled, offset) || error == CANCELLED);
                                jobs[offset as usize].1 = Held::Dying;
                            }
                        }
                    }
                    for (_, held) in &jobs {
                        prop_assert!(!matches!(held, Held::Out { deadline, .. } if *deadline <= now), "a lease outlived its deadline");
                    }
                }
                LimitStep::Hold(ms) => {
                    hold = now + ms;
                    queue.hold_until(hold);
                    prop_assert_eq!(queue.held_until(now), (ms > 0).then_some(hold));
                }
                LimitStep::Relimit(per_key) => {
                    limits = limits_of(per_key);
                    queue.set_policy(policy(per_key));
                    for dropped in queue.take_ended() {
                        let Failure::Dead { offset, .. } = dropped else { panic!("a drop is dead") };
                        let was_new = matches!(jobs[offset as usize].1, Held::Waiting { tried: false, .. });
                        prop_assert!(was_new, "dropped a retried job");
                        jobs[offset as usize].1 = Held::Dying;
                    }
                }
                LimitStep::Cancel(i) if i < jobs.len() => {
                    let id = jobs[i].0.id.clone();
                    let answer = queue.cancel(&id);
                    let expected = match jobs[i].1 {
                        Held::Waiting { .. } => Some(Cancelled::Waiting),
                        Held::Out { lease, .. } => {
                            let extended = queue.extend(lease, 300, now).unwrap();
                            prop_assert!(extended.cancelled, "the worker is told");
                            jobs[i].1 = Held::Out { lease, deadline: extended.deadline };
                            Some(Cancelled::Running)
                        }
                        Held::Dying | Held::Done => None,
                    };
                    prop_assert_eq!(answer, expected);
                    if answer.is_some() {
                        cancelled.insert(i);
                    }
                    for ended in queue.take_ended() {
                        let Failure::Dead { offset, error, .. } = ended else { panic!("an end is dead") };
                        prop_assert_eq!((offset, error.as_str()), (i as i64, CANCELLED));
                        jobs[i].1 = Held::Dying;
                    }
                }
                LimitStep::Cancel(_) => {}
                LimitStep::FinishDead => {
                    for (offset, (_, held)) in jobs.iter_mut().enumerate() {
                        if *held == Held::Dying {
                            queue.finish_dead(offset as i64);
                            *held = Held::Done;
                        }
                    }
                }
            }
            let in_flight: usize = queue.keys_in_flight().map(|(_, n)| n as usize).sum();
            let keyed_out = jobs.iter().filter(|(job, held)| matches!(held, Held::Out { .. }) && job.concurrency_key.is_some()).count();
            prop_assert_eq!(in_flight, keyed_out);
        }
        // Drain: every job ends finished.
        for _ in 0..200 {
            now += 500;
            for dropped in queue.take_ended() {
                let Failure::Dead { offset, .. } = dropped else { panic!("a drop is dead") };
                jobs[offset as usize].1 = Held::Dying;
            }
            for (offset, (_, held)) in jobs.iter_mut().enumerate() {
                match *held {
                    Held::Out { lease, .. } => { queue.ack(lease).unwrap(); *held = Held::Done; }
                    Held::Dying => { queue.finish_dead(offset as i64); *held = Held::Done; }
                    _ => {}
                }
            }
            for handout in queue.dequeue(100, now, 300) {
                jobs[handout.offset as usize].1 = Held::Out { lease: handout.lease, deadline: handout.deadline };
            }
        }
        prop_assert!(jobs.iter().all(|(_, held)| *held == Held::Done), "{:?}", jobs.iter().map(|(_, h)| h).collect::<Vec<_>>());
        prop_assert_eq!(queue.commit_offset(), jobs.len() as i64);
    }
}

#[test]
fn a_retired_partition_hands_out_and_extends_nothing() {
    let mut queue = PartitionQueue::new(QueuePolicy::default(), 0, 1);
    for offset in 0..3 {
        queue.push(offset, job(offset as usize, None, None), 0);
    }
    let first = queue.dequeue(1, 0, 1_000).remove(0);
    assert_eq!(queue.extend(first.lease, 2_000, 20).map(|e| e.deadline), Ok(2_020));
    queue.retire();
    assert_eq!(queue.dequeue(1, 30, 1_000), vec![]);
    assert_eq!(queue.extend(first.lease, 9_000, 30), Err(LeaseError::Unknown));
    assert_eq!(queue.stats(30).ready, 2, "the rest stay for the next owner");
}

#[test]
fn a_new_job_of_a_busy_key_supersedes_the_running_one_when_declared() {
    use crate::jobs::limits::Limits;
    let run = |at_limit: AtLimit| {
        let limits = Limits { per_key: Some(1), at_limit, ..Default::default() };
        let mut queue = PartitionQueue::new(QueuePolicy { limits, ..Default::default() }, 0, 1);
        let keyed = |offset: usize| Job { concurrency_key: Some("k".into()), ..job(offset, None, None) };
        queue.push(0, keyed(0), 0);
        let first = queue.dequeue(5, 0, 1_000).remove(0);
        queue.push(1, keyed(1), 10);
        let told = queue.extend(first.lease, 1_000, 20).map(|e| e.cancelled);
        let waiting = queue.dequeue(5, 20, 1_000).len();
        let ended = queue.nack(first.lease, None, "stopped", 30).map(|failure| match failure {
            Failure::Dead { error, .. } => error,
            Failure::Retry { .. } => "retried".to_string(),
        });
        let next: Vec<i64> = queue.dequeue(5, 40_000, 1_000).iter().map(|h| h.offset).collect();
        (told, waiting, ended, next)
    };
    assert_eq!(run(AtLimit::CancelInProgress), (Ok(true), 0, Ok(SUPERSEDED.to_string()), vec![1]));
    assert_eq!(run(AtLimit::Wait), (Ok(false), 0, Ok("retried".to_string()), vec![0]));
}
