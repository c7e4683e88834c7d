//! Who is alive, for services that split partitions among their instances without
//! Kafka's group protocol: dequeue brokers (queue partitions) and counters (shards).
//!
//! Each member publishes a heartbeat on its membership topic every `heartbeat` and
//! follows the topic; a member silent for `timeout`, or one that said it is leaving,
//! is gone. Every member reads the same log, so all derive the same owners
//! ([`tally_core::assignment`]). (Kafka's group protocol could play this part on a
//! real Kafka; the local broker's group coordinator never evicts a member killed
//! with -9, and a paused member would keep its partitions in both, so tally keeps
//! this one simple membership and tests it with kill -9 and SIGSTOP.)
//!
//! **The lease** fences a member that stops — paused, partitioned, its clock
//! stalled: it holds its partitions only while its [`Lease`] is valid, which ends
//! `timeout - margin` after the send time of its newest heartbeat the broker
//! acknowledged *while the lease was still valid*. The others take a partition over
//! only once that member's newest heartbeat in the log is `timeout` old and they
//! have read the log to its end ([`Membership::caught_up`]), so every heartbeat
//! acknowledged before they decide is one they saw: the old holder's lease ended
//! `margin` before. A heartbeat acknowledged after its lease ended does not revive
//! it: the lease *lapses*, the member drops everything and starts a new tenure
//! ([`Lease::restart`]). `margin` covers clock skew between machines.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use tally_core::assignment::Member;
use tally_core::wire::Heartbeat;
use tokio_util::sync::CancellationToken;

use crate::config::KafkaConfig;
use crate::follow::Follow;
use crate::kafka::{now_ms, producer_config};
use crate::lock::{lock, read, write};
use crate::Result;

/// What [`Membership::latest`]'s and [`Lease::state`]'s locks guard ([`crate::lock`]).
const LATEST: &str = "the membership's heartbeats";
const LEASE: &str = "a membership lease";

/// How many membership timeouts a member's own heartbeats may be read back behind
/// the clock and still time the others ([`Membership::live_as_seen_by`]).
pub const MOST_LOG_LAG_TIMEOUTS: i64 = 5;

/// The members seen on a membership topic, and how far it was read.
#[derive(Default)]
pub struct Membership {
    /// instance → its latest heartbeat.
    latest: RwLock<BTreeMap<String, Heartbeat>>,
    /// The offset after the last record read.
    read_to: AtomicI64,
}

impl Membership {
    pub fn record(&self, heartbeat: Heartbeat) {
        let mut latest = write(&self.latest, LATEST);
        let newer = latest.get(&heartbeat.instance).is_none_or(|h| h.at_ms <= heartbeat.at_ms);
        if newer {
            latest.insert(heartbeat.instance.clone(), heartbeat);
        }
    }

    /// The members alive at `now`, sorted by instance.
    pub fn live(&self, now: i64, timeout_ms: u64) -> Vec<Member> {
        let latest = read(&self.latest, LATEST);
        latest
            .values()
            .filter(|h| !h.leaving && h.at_ms + timeout_ms as i64 > now)
            .map(|h| Member { instance: h.instance.clone(), addr: h.addr.clone() })
            .collect()
    }

    /// The members alive as `me` reads the log: gone once their newest heartbeat is
    /// `timeout_ms` older than `me`'s newest one read back (before that is read, than
    /// `now`). Time runs as the log does, so a log that falls behind — a slow
    /// cluster, a stalled fetch — makes nobody look dead, `me` least of all; a
    /// member that stops is gone once `me`'s own heartbeats have gone on for the
    /// timeout without it. A log [`MOST_LOG_LAG_TIMEOUTS`] timeouts behind the clock
    /// is a member cut off from it: the clock judges from there, `me` included. For
    /// members that fence nothing by lease (dequeue brokers), on a membership topic
    /// of one partition (one order for every heartbeat).
    pub fn live_as_seen_by(&self, me: &str, now: i64, timeout_ms: u64) -> Vec<Member> {
        let floor = now.saturating_sub(MOST_LOG_LAG_TIMEOUTS.saturating_mul(timeout_ms as i64));
        let log_now = self.heard_at(me).map_or(now, |mine| mine.max(floor).min(now));
        self.live(log_now, timeout_ms)
    }

    /// When `instance`'s newest heartbeat read was sent.
    pub fn heard_at(&self, instance: &str) -> Option<i64> {
        let latest = read(&self.latest, LATEST);
        latest.get(instance).map(|h| h.at_ms)
    }

    /// Whether every record before `high` (the topic's high watermark, fetched just
    /// now) was read: then no heartbeat acknowledged before it is missing here.
    pub fn caught_up(&self, high: i64) -> bool {
        self.read_to.load(Ordering::SeqCst) >= high
    }
}

/// How long a member may act as the holder of its partitions (see the module docs).
#[derive(Debug)]
pub struct Lease {
    state: Mutex<LeaseState>,
    /// Mirrors `state.until` for lock-free checks on the read path.
    until: AtomicI64,
    timeout_ms: i64,
    margin_ms: i64,
}

#[derive(Debug, Default)]
struct LeaseState {
    until: i64,
    /// No lease held yet in this tenure: the next acknowledged heartbeat starts one.
    fresh: bool,
    /// The lease ended before a heartbeat renewed it: the tenure is over.
    lapsed: bool,
}

impl Lease {
    /// A lease renewed by heartbeats, for members timed out after `timeout_ms`.
    pub fn new(timeout_ms: u64) -> Self {
        let timeout_ms = timeout_ms as i64;
        let margin_ms = (timeout_ms / 4).max(1);
        let state = LeaseState { until: 0, fresh: true, lapsed: false };
        Self { state: Mutex::new(state), until: AtomicI64::new(0), timeout_ms, margin_ms }
    }

    /// A lease that never ends: a single instance that owns everything statically.
    pub fn forever() -> Self {
        let state = LeaseState { until: i64::MAX, fresh: false, lapsed: false };
        Self { state: Mutex::new(state), until: AtomicI64::new(i64::MAX), timeout_ms: 0, margin_ms: 0 }
    }

    /// Whether the holder may act at `now`.
    pub fn valid(&self, now: i64) -> bool {
        now < self.until.load(Ordering::SeqCst)
    }

    /// A heartbeat sent at `sent_ms` was acknowledged at `now`.
    pub fn acknowledged(&self, sent_ms: i64, now: i64) {
        let mut state = lock(&self.state, LEASE);
        if state.lapsed || state.until == i64::MAX {
            return;
        }
        let renewed = sent_ms + self.timeout_ms - self.margin_ms;
        if state.fresh && renewed <= now {
            // Sent before a pause, acknowledged after it: it holds nothing.
            return;
        }
        if state.fresh || now < state.until {
            state.fresh = false;
            state.until = state.until.max(renewed);
            self.until.store(state.until, Ordering::SeqCst);
        } else {
            state.lapsed = true;
        }
    }

    /// Whether the lease ended while held (checked by the holder, which then drops
    /// everything and calls [`Lease::restart`]).
    pub fn lapsed(&self, now: i64) -> bool {
        let mut state = lock(&self.state, LEASE);
        if !state.fresh && now >= state.until {
            state.lapsed = true;
        }
        state.lapsed
    }

    /// Ends the lease at once (a member that stops): it acts as a holder no more,
    /// before it tells the others it is leaving.
    pub fn end(&self) {
        let mut state = lock(&self.state, LEASE);
        *state = LeaseState { until: 0, fresh: false, lapsed: true };
        self.until.store(0, Ordering::SeqCst);
    }

    /// A new tenure, after the holder dropped everything of the lapsed one.
    pub fn restart(&self) {
        let mut state = lock(&self.state, LEASE);
        *state = LeaseState { until: 0, fresh: true, lapsed: false };
        self.until.store(0, Ordering::SeqCst);
    }
}

/// Renews the lease from each heartbeat's delivery report: acknowledged at most a
/// lease's length after it was sent still counts (a slow broker is not a dead one).
struct Beats {
    lease: Arc<Lease>,
}

impl ClientContext for Beats {}

impl ProducerContext for Beats {
    /// The heartbeat's send time.
    type DeliveryOpaque = Box<i64>;

    fn delivery(&self, result: &DeliveryResult<'_>, sent: Box<i64>) {
        match result {
            Ok(_) => self.lease.acknowledged(*sent, now_ms()),
            Err((err, _)) => tracing::warn!(error = %err, "a heartbeat was not delivered"),
        }
    }
}

/// Publishes `me`'s heartbeats on `topic` every `every` until `leave`, then one
/// saying it is leaving; each acknowledged heartbeat renews `lease`. A member that
/// acts on what it holds cancels `leave` only once it stopped doing so (and ended
/// its lease): the others take its partitions when they read that it left. The
/// thread ends early — and the member must stop — if the producer fails for good.
pub fn heartbeat(
    kafka: &KafkaConfig,
    topic: String,
    me: Member,
    every: Duration,
    lease: Arc<Lease>,
    leave: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let producer: ThreadedProducer<Beats> = producer_config(kafka)?.create_with_context(Beats { lease })?;
    let thread = std::thread::Builder::new().name("heartbeat".into()).spawn(move || {
        // The first heartbeat then goes at once, not after the id's 0.5–1 s.
        crate::kafka::request_producer_id(&producer);
        let send = |leaving: bool| {
            let sent = now_ms();
            let beat = Heartbeat::new(me.instance.clone(), me.addr.clone(), sent, leaving);
            let Ok(payload) = serde_json::to_vec(&beat) else { return };
            let record = BaseRecord::with_opaque_to(&topic, Box::new(sent)).key(&me.instance).payload(&payload);
            if let Err((err, _)) = producer.send(record) {
                tracing::warn!(error = %err, "sending a heartbeat");
            }
        };
        while !leave.is_cancelled() {
            if let Some(fatal) = producer.client().fatal_error() {
                tracing::error!(error = ?fatal, "the heartbeat producer failed for good");
                return;
            }
            send(false);
            crate::shutdown::sleep_unless(&leave, every);
        }
        send(true);
        if let Err(err) = producer.flush(Duration::from_secs(5)) {
            // The others see it leave when its heartbeats time out instead.
            tracing::warn!(error = %err, "the last heartbeat (leaving) was not flushed");
        }
    })?;
    Ok(thread)
}

/// Follows the membership topic from its beginning into `membership`.
pub fn follow(
    kafka: &KafkaConfig,
    name: &str,
    topic: &str,
    membership: Arc<Membership>,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let group = format!("tally-{name}");
    let (poll, wait) = (Duration::from_millis(50), crate::follow::FAILOVER_FETCH_WAIT);
    crate::follow::follow(kafka, name, &group, topic, poll, wait, shutdown, Read(membership))
}

struct Read(Arc<Membership>);

impl Follow for Read {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        match Heartbeat::decode(payload) {
            Ok(heartbeat) => self.0.record(heartbeat),
            Err(err) => tracing::warn!(offset, error = %err, "ignoring a heartbeat this build cannot read"),
        }
        self.0.read_to.fetch_max(offset + 1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(instance: &str, at_ms: i64, leaving: bool) -> Heartbeat {
        Heartbeat::new(instance.into(), format!("{instance}:1"), at_ms, leaving)
    }

    #[test]
    fn silent_and_leaving_members_are_gone() {
        let membership = Membership::default();
        membership.record(beat("a", 1_000, false));
        membership.record(beat("b", 1_000, false));
        membership.record(beat("c", 1_000, false));
        membership.record(beat("a", 5_000, false));
        membership.record(beat("a", 4_000, false)); // older, ignored
        membership.record(beat("b", 5_500, true));
        let live: Vec<String> = membership.live(6_000, 3_000).into_iter().map(|m| m.instance).collect();
        assert_eq!(live, vec!["a".to_string()]);
    }

    #[test]
    fn a_log_that_falls_behind_makes_nobody_look_dead_a_silent_member_is_gone_as_the_log_goes_on() {
        let membership = Membership::default();
        let names = |members: Vec<Member>| members.into_iter().map(|m| m.instance).collect::<Vec<_>>();
        assert_eq!(names(membership.live_as_seen_by("a", 1_000, 3_000)), Vec::<String>::new());
        membership.record(beat("a", 1_000, false));
        membership.record(beat("b", 1_000, false));
        // Nothing read for 12 s: the log lags, nobody is dead.
        assert_eq!(names(membership.live_as_seen_by("a", 13_000, 3_000)), ["a", "b"]);
        assert_eq!(names(membership.live(13_000, 3_000)), Vec::<String>::new(), "by the wall clock");
        // a's heartbeats go on, b's stopped at 1 000.
        membership.record(beat("a", 3_900, false));
        assert_eq!(names(membership.live_as_seen_by("a", 13_000, 3_000)), ["a", "b"]);
        membership.record(beat("a", 4_000, false));
        assert_eq!(names(membership.live_as_seen_by("a", 13_000, 3_000)), ["a"]);
        // Its own heartbeats 5 timeouts behind: a is cut off, the clock judges.
        assert_eq!(names(membership.live_as_seen_by("a", 21_999, 3_000)), ["a"]);
        assert_eq!(names(membership.live_as_seen_by("a", 22_000, 3_000)), Vec::<String>::new());
        // Before its own first heartbeat is read, a member sees by its clock.
        assert_eq!(names(membership.live_as_seen_by("c", 6_000, 3_000)), ["a"]);
        assert_eq!(names(membership.live_as_seen_by("c", 7_000, 3_000)), Vec::<String>::new());
        // A clock behind its own heartbeats: never ahead of the wall clock.
        assert_eq!(names(membership.live_as_seen_by("a", 2_000, 3_000)), ["a", "b"]);
    }

    #[test]
    fn a_lease_that_ended_is_not_revived_by_a_late_acknowledgement() {
        let lease = Lease::new(4_000); // margin 1 000
        assert!(!lease.valid(0), "no heartbeat acknowledged yet");
        lease.acknowledged(1_000, 1_010);
        assert!(lease.valid(3_999) && !lease.valid(4_000), "sent at 1 000: valid until 4 000");
        lease.acknowledged(2_000, 2_100);
        assert!(lease.valid(4_999) && !lease.valid(5_000), "renewed by the next one");
        assert!(!lease.lapsed(4_000));
        // Paused: the next acknowledgement comes after the lease ended.
        lease.acknowledged(4_900, 20_000);
        assert!(!lease.valid(20_001), "a late acknowledgement does not renew");
        assert!(lease.lapsed(20_001));
        lease.acknowledged(20_100, 20_110);
        assert!(!lease.valid(20_200), "nothing renews a lapsed lease");
        // The holder dropped everything: a new tenure.
        lease.restart();
        assert!(!lease.lapsed(20_300));
        lease.acknowledged(20_400, 20_410);
        assert!(lease.valid(23_000) && !lease.valid(23_400));
        // A lease that ends with no acknowledgement at all lapses too.
        assert!(lease.lapsed(23_400));
        // After a restart, a heartbeat sent before the pause starts nothing.
        lease.restart();
        lease.acknowledged(20_000, 30_000);
        assert!(!lease.valid(30_000) && !lease.lapsed(30_000));
        lease.acknowledged(30_100, 30_110);
        assert!(lease.valid(33_000));
        // Ended by a member that stops: at once, for good.
        lease.end();
        assert!(!lease.valid(30_200) && lease.lapsed(30_200));
        lease.acknowledged(30_300, 30_310);
        assert!(!lease.valid(30_400));
    }

    #[test]
    fn a_static_lease_never_ends() {
        let lease = Lease::forever();
        lease.acknowledged(0, i64::MAX - 1);
        assert!(lease.valid(i64::MAX - 1) && !lease.lapsed(i64::MAX - 1));
    }
}
