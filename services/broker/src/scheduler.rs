//! Enqueues the ticks of every queue's schedules (`[[queue.schedule]]`).
//!
//! Every tick of a schedule lives in one partition
//! ([`crate::placement::schedule_partition`]: its concurrency key's on a per-key
//! limited queue, else the schedule's own), so the broker serving that partition
//! alone enqueues them, into it. Each tick's job is unique by its tick
//! for the queue's `unique_for_ms`: a tick written twice — by an owner that died
//! after writing it and by the next, or by two brokers while a partition moves —
//! runs once, the second write being a duplicate. The owner starts after the
//! latest tick the partition holds (replayed at take-over, then fetched) — or a
//! minute back when it holds none — and acts only once its fetch has reached the
//! end of the topic as it was when the broker took the partition; ticks more
//! than [`GRACE_MS`] late (an outage) are missed: the latest is enqueued once, or
//! none, as declared.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::producer::FutureRecord;
use tally_shared::kafka::now_ms;
use tally_shared::lock::lock;
use tally_shared::schedules::{Missed, Schedule, ScheduleDecl};
use tokio_util::sync::CancellationToken;

use crate::state::{Broker, QueueRuntime, BUFFER, LAG};

/// A tick enqueued up to this late is on time (a failover's ticks are each
/// enqueued, late); later, it was missed.
pub const GRACE_MS: i64 = 60_000;
/// How often due ticks are looked for.
const EVERY: Duration = Duration::from_millis(200);
/// The most ticks one round enqueues per schedule.
const MOST_PER_ROUND: usize = 1_000;

/// What this broker knows of one schedule it enqueues.
struct Enqueuing {
    schedule: Schedule,
    /// Where it started when the partition held no tick of it: a minute back,
    /// so a failover's ticks are enqueued, never further.
    origin: i64,
    /// The partition's fetch position to reach before the first tick is written
    /// (the end of the topic when this broker first saw it serve the partition):
    /// the ticks written before are known by then.
    catch_up: Option<i64>,
    /// Ticks written by this broker and not yet seen fetched.
    written: BTreeSet<i64>,
    /// Ticks up to here were sorted into on time and missed.
    sorted_until: i64,
    /// The latest missed tick still to enqueue (`missed = "once"`).
    missed: Option<i64>,
}

/// Runs until `shutdown`.
pub async fn run(broker: Arc<Broker>, shutdown: CancellationToken) {
    let mut known: HashMap<(String, String), Enqueuing> = HashMap::new();
    let mut tick = tokio::time::interval(EVERY);
    while !shutdown.is_cancelled() {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        let mut seen = BTreeSet::new();
        for queue in broker.queues() {
            let schedules = queue.decl().schedules.clone();
            for decl in schedules {
                let key = (queue.name.clone(), decl.name.clone());
                seen.insert(key.clone());
                enqueue_due(&broker, &queue, decl, &mut known, key).await;
            }
        }
        known.retain(|key, _| seen.contains(key));
    }
}

async fn enqueue_due(
    broker: &Broker,
    queue: &QueueRuntime,
    decl: ScheduleDecl,
    known: &mut HashMap<(String, String), Enqueuing>,
    key: (String, String),
) {
    let partition = {
        let queue = queue.decl();
        crate::placement::schedule_partition(&queue.limits, &decl, queue.partitions)
    };
    // Only the partition's owner, once its fetch has caught up.
    let Some(buffer) = queue.partition(partition) else {
        known.remove(&key);
        return;
    };
    // The topic's end as last measured (after this broker took the partition).
    let Some(end) = lock(&queue.ends, LAG).get(&partition).copied() else { return };
    let now = now_ms();
    let (latest, fetched) = {
        let buffer = lock(&buffer, BUFFER);
        (buffer.latest_tick(&decl.name), buffer.fetched_until())
    };
    // A tick "from the future" (a producer's record) does not stop the schedule.
    let latest = latest.filter(|at| *at <= now + GRACE_MS);
    let stale = known.get(&key).is_some_and(|known| known.schedule.decl != decl);
    if stale {
        known.remove(&key);
    }
    let enqueuing = match known.entry(key) {
        std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::hash_map::Entry::Vacant(entry) => match Schedule::new(decl) {
            Ok(schedule) => entry.insert(Enqueuing {
                schedule,
                origin: now - GRACE_MS,
                catch_up: None,
                written: BTreeSet::new(),
                sorted_until: i64::MIN,
                missed: None,
            }),
            Err(err) => {
                tracing::error!(queue = %queue.name, error = %err, "a schedule this broker cannot run");
                return;
            }
        },
    };
    let target = *enqueuing.catch_up.get_or_insert(end);
    if fetched < target {
        return;
    }
    let from = latest.unwrap_or(enqueuing.origin);
    enqueuing.written.retain(|at| latest.is_none_or(|latest| *at > latest));
    // Ticks that became late since the last round: the latest of them is missed.
    let late = now - GRACE_MS;
    if late > enqueuing.sorted_until {
        let mut at = from.max(enqueuing.sorted_until);
        while let Some(next) = enqueuing.schedule.next_after(at).filter(|next| *next <= late) {
            if enqueuing.schedule.decl.missed == Missed::Once {
                enqueuing.missed = Some(next);
            }
            at = next;
        }
        enqueuing.sorted_until = late;
    }
    let mut writes: Vec<i64> = enqueuing.missed.filter(|at| *at > from).into_iter().collect();
    writes.extend(enqueuing.schedule.ticks(from.max(late), now, MOST_PER_ROUND));
    for at in writes {
        if enqueuing.written.contains(&at) {
            continue;
        }
        let job = enqueuing.schedule.job(at);
        let Ok(payload) = serde_json::to_vec(&job) else { continue };
        let record = FutureRecord::to(&queue.topic).partition(partition).key(&job.id).payload(&payload);
        match broker.dead_producer.send(record, Duration::from_secs(5)).await {
            Ok(_) => {
                enqueuing.written.insert(at);
                if at <= late {
                    tracing::info!(queue = %queue.name, job = %job.id, "enqueued the latest tick missed");
                }
            }
            Err((err, _)) => {
                tracing::warn!(queue = %queue.name, job = %job.id, error = %err, "enqueueing a tick; trying again");
                break;
            }
        }
    }
}
