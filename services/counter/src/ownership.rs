//! Which shards this counter should own, from the counters' membership
//! ([`tally_shared::membership`]): balanced rendezvous hashing of the shards over
//! the live counters ([`balanced`]), fenced by this counter's lease.
//!
//! - A lease that lapsed (the counter was paused, or cut off from Kafka, for longer
//!   than it may hold shards) drops every shard at once; the counter then starts a
//!   new tenure and gets shards again like any member that joins.
//! - Otherwise an assignment is acted on once it has stayed the same for
//!   [`SETTLE`] (counters starting together do not pass shards around). Shards are
//!   dropped at once; a shard is taken only once the membership and the claims
//!   (shard-owners topic) were read to their ends, and no other live counter claims
//!   it: its previous owner released it — after it stopped serving it — or is gone,
//!   and then its lease has ended (the module docs of `membership` say why). So
//!   the log end the new owner catches up with before serving holds everything the
//!   previous owner ever served: reads never go back in time across a move.
//! - A counter that sees another one use its name (two processes, one name) logs
//!   it and names it in readiness; their newest heartbeats alternate, so neither
//!   settles on an assignment until one is gone: give each counter its own name.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use tally_core::assignment::{balanced, Member};
use tally_core::wire::ShardOwner;
use tally_shared::config::TallyConfig;
use tally_shared::follow::{follow, Follow};
use tally_shared::kafka::TopicNames;
use tally_shared::membership::{self, Lease, Membership};
use tokio_util::sync::CancellationToken;

use crate::error::Result;

/// Helper threads by name, watched by the consumer: one that ends before shutdown
/// (a panic) stops the counter.
pub type Watched = Vec<(&'static str, JoinHandle<()>)>;

/// How long an assignment must stay the same before it is acted on.
pub const SETTLE: Duration = Duration::from_millis(1_000);

/// The counters' claims, read from the shard-owners topic: per shard, the claim of
/// the newest epoch ([`ShardOwner::replaces`]; its address `None`: released).
#[derive(Default)]
pub struct Claims {
    claims: RwLock<HashMap<u32, ShardOwner>>,
    /// The offset after the last record read.
    read_to: AtomicI64,
}

impl Claims {
    fn record(&self, owner: ShardOwner) {
        let mut claims = self.claims.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        let current = claims.get(&owner.shard).map(|claim| (claim.addr.is_some(), claim.at_ms));
        if owner.replaces(current) {
            claims.insert(owner.shard, owner);
        }
    }

    /// The newest epoch read for `shard`.
    pub fn epoch(&self, shard: u32) -> Option<i64> {
        let claims = self.claims.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        claims.get(&shard).map(|claim| claim.at_ms)
    }

    /// Who claims `shard` now, if anyone.
    fn claimed_by(&self, shard: u32) -> Option<String> {
        let claims = self.claims.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        claims.get(&shard).and_then(|claim| claim.addr.clone())
    }

    /// Claims under this counter's read address `addr` that another process made
    /// (`instance` is this one's): a previous incarnation's, killed before it let
    /// go. Another counter would wait for their release forever (the address is a
    /// live member's), so this one releases them: `(shard, epoch)`.
    pub fn orphans(&self, addr: &str, instance: &str) -> Vec<(u32, i64)> {
        let claims = self.claims.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut orphans: Vec<(u32, i64)> = claims
            .values()
            .filter(|claim| claim.addr.as_deref() == Some(addr) && claim.instance != instance)
            .map(|claim| (claim.shard, claim.at_ms))
            .collect();
        orphans.sort_unstable();
        orphans
    }
}

/// Follows the shard-owners topic into [`Claims`].
pub struct FollowClaims(pub Arc<Claims>);

impl Follow for FollowClaims {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        match ShardOwner::decode(payload) {
            Ok(owner) => self.0.record(owner),
            Err(err) => tracing::warn!(offset, error = %err, "ignoring a shard-owner claim this build cannot read"),
        }
        self.0.read_to.fetch_max(offset + 1, Ordering::SeqCst);
    }
}

pub struct Ownership {
    pub membership: Arc<Membership>,
    pub claims: Arc<Claims>,
    /// The shard-owners topic.
    pub claims_topic: String,
    pub lease: Arc<Lease>,
    pub me: Member,
    /// The membership topic.
    pub topic: String,
    /// The shard topic: the namespace of the shards' scores.
    pub shard_topic: String,
    pub shard_count: u32,
    pub timeout_ms: u64,
    /// The assignment last computed, and since when it is the same.
    pending: Option<(Vec<u32>, i64)>,
    /// The name conflict last reported, not to repeat it every turn.
    conflict: Option<String>,
    /// When the topics' ends were last read for taking shards.
    last_take_check: i64,
    /// The ends read, waiting for the followers to reach them.
    take_check: Option<TakeCheck>,
    /// When this process joined.
    started_ms: i64,
}

/// The ends of the membership and the claims topics when they were read (`at`).
#[derive(Debug, Clone, Copy)]
struct TakeCheck {
    at: i64,
    members_end: i64,
    claims_end: i64,
}

/// How long the followers may take to reach the ends read before they are read
/// again.
const TAKE_CHECK_PATIENCE_MS: i64 = 5_000;

/// What the counter should do with its shards.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// Own exactly these shards from now on.
    Own(Vec<u32>),
    /// The lease lapsed: drop every shard, then start a new tenure.
    Lapsed,
}

impl Ownership {
    /// Joins the counters as `read_addr`: starts the heartbeat (until `leave`) and
    /// the followers of the membership and the claims (until `shutdown`); returns
    /// the ownership and those threads, to be watched.
    pub fn join(
        config: &TallyConfig,
        read_addr: &str,
        lease: Arc<Lease>,
        shard_count: u32,
        leave: &CancellationToken,
        shutdown: &CancellationToken,
    ) -> Result<(Self, Watched)> {
        let names = TopicNames::new(&config.kafka.topic_prefix);
        let me = Member { instance: config.counter.member_name(), addr: read_addr.to_string() };
        tracing::info!(instance = %me.instance, "joining the counters");
        let (topic, claims_topic) = (names.counter_members(), names.shard_owners());
        let membership = Arc::new(Membership::default());
        let claims = Arc::new(Claims::default());
        let every = Duration::from_millis(config.counter.heartbeat_ms);
        let kafka = &config.kafka;
        let beats = membership::heartbeat(kafka, topic.clone(), me.clone(), every, lease.clone(), leave.clone())?;
        let members = membership::follow(kafka, "counter-membership", &topic, membership.clone(), shutdown.clone())?;
        let (poll, group) = (Duration::from_millis(50), "tally-counter-claims");
        let read_claims = FollowClaims(claims.clone());
        let claimed = follow(kafka, "counter-claims", group, &claims_topic, poll, shutdown.clone(), read_claims)?;
        let ownership = Self {
            membership,
            claims,
            claims_topic,
            lease,
            me,
            topic,
            shard_topic: names.shards(),
            shard_count,
            timeout_ms: config.counter.member_timeout_ms,
            pending: None,
            conflict: None,
            last_take_check: 0,
            take_check: None,
            started_ms: tally_shared::kafka::now_ms(),
        };
        Ok((ownership, vec![("heartbeat", beats), ("membership", members), ("claims", claimed)]))
    }

    /// The change to make now to the shards `owned`, if any.
    pub fn change<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        owned: &[u32],
        now: i64,
    ) -> Option<Change> {
        if self.lease.lapsed(now) {
            self.pending = None;
            return Some(Change::Lapsed);
        }
        let live = self.membership.live(now, self.timeout_ms);
        let wanted: Vec<u32> = match live.iter().find(|m| m.instance == self.me.instance) {
            // Not seen yet (just started, or a new tenure): nothing to decide.
            None => return None,
            // The last heartbeats of a previous process of this name (restarted
            // quickly): this one's own come next.
            Some(seen)
                if seen.addr != self.me.addr
                    && self.membership.heard_at(&seen.instance).is_some_and(|at| at <= self.started_ms) =>
            {
                return None
            }
            Some(seen) if seen.addr != self.me.addr => {
                if self.conflict.as_deref() != Some(&seen.addr) {
                    tracing::error!(
                        instance = %self.me.instance, other = %seen.addr, addr = %self.me.addr,
                        "another counter uses this counter's name (counter.instance): owning no shards until it is gone"
                    );
                    self.conflict = Some(seen.addr.clone());
                }
                Vec::new()
            }
            Some(_) => self.assigned(&live),
        };
        let since = match &self.pending {
            Some((pending, since)) if *pending == wanted => *since,
            _ => {
                self.pending = Some((wanted, now));
                return None;
            }
        };
        if wanted == owned || now - since < SETTLE.as_millis() as i64 {
            return None;
        }
        let kept: Vec<u32> = wanted.iter().copied().filter(|shard| owned.contains(shard)).collect();
        if kept.len() == wanted.len() {
            return Some(Change::Own(wanted));
        }
        // Taking shards. First the ends of the membership and the claims are read
        // (at most every 200 ms: two watermark requests); once the followers have
        // read that far, liveness *as of then* decides — every heartbeat
        // acknowledged before then is in that view, so a member it finds gone had
        // its lease end a margin before — and a shard is taken only if no counter
        // alive then claims it.
        let drop_only = (kept.len() < owned.len()).then_some(Change::Own(kept));
        let check = match self.take_check {
            Some(check) if now - check.at < TAKE_CHECK_PATIENCE_MS => check,
            _ => {
                if now - self.last_take_check >= 200 {
                    self.last_take_check = now;
                    self.take_check = self.read_ends(consumer, now);
                }
                return drop_only;
            }
        };
        let members_read = self.membership.caught_up(check.members_end);
        if !members_read || self.claims.read_to.load(Ordering::SeqCst) < check.claims_end {
            return drop_only;
        }
        self.take_check = None;
        let live = self.membership.live(check.at, self.timeout_ms);
        if !live.iter().any(|m| m.instance == self.me.instance) || self.assigned(&live) != wanted {
            self.pending = None;
            return drop_only;
        }
        let others: Vec<&str> =
            live.iter().filter(|m| m.instance != self.me.instance).map(|m| m.addr.as_str()).collect();
        let taken: Vec<u32> = wanted
            .iter()
            .copied()
            .filter(|shard| {
                owned.contains(shard)
                    || self.claims.claimed_by(*shard).is_none_or(|addr| !others.contains(&addr.as_str()))
            })
            .collect();
        (taken != owned).then_some(Change::Own(taken))
    }

    /// The name conflict, if one was seen and the other counter is still alive.
    pub fn conflict(&self) -> Option<String> {
        self.conflict.as_ref().map(|other| {
            format!("another counter ({other}) uses this counter's name {:?}: set counter.instance", self.me.instance)
        })
    }

    /// The shards balanced rendezvous hashing gives this counter among `live`.
    fn assigned(&mut self, live: &[Member]) -> Vec<u32> {
        self.conflict = None;
        let owners = balanced(live, &self.shard_topic, self.shard_count);
        (0..self.shard_count)
            .filter(|&shard| owners[shard as usize].is_some_and(|m| m.instance == self.me.instance))
            .collect()
    }

    /// The ends of the membership and the claims as of `now`.
    fn read_ends<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, now: i64) -> Option<TakeCheck> {
        let end = |topic: &str| match consumer.fetch_watermarks(topic, 0, Duration::from_secs(2)) {
            Ok((_, high)) => Some(high),
            Err(err) => {
                tracing::warn!(topic, error = %err, "reading a topic's end; taking shards later");
                None
            }
        };
        Some(TakeCheck { at: now, members_end: end(&self.topic)?, claims_end: end(&self.claims_topic)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::wire::Heartbeat;

    #[test]
    fn claims_keep_the_newest_epoch_and_name_a_previous_incarnations_orphans() {
        let claims = Claims::default();
        let claim = |shard, addr: Option<&str>, instance: &str, epoch| {
            ShardOwner::new(shard, addr.map(String::from), instance.into(), epoch)
        };
        claims.record(claim(1, Some("me:1"), "old", 100)); // a killed incarnation's
        claims.record(claim(2, Some("me:1"), "old", 100));
        claims.record(claim(2, Some("b:1"), "b", 200)); // taken over since
        claims.record(claim(2, Some("me:1"), "old", 100)); // late: ignored
        claims.record(claim(3, Some("me:1"), "new", 300)); // this process's own
        claims.record(claim(4, Some("me:1"), "old", 100));
        claims.record(claim(4, None, "old", 100)); // released
        assert_eq!(claims.claimed_by(2), Some("b:1".to_string()));
        assert_eq!(claims.claimed_by(4), None);
        assert_eq!(claims.orphans("me:1", "new"), vec![(1, 100)]);
    }

    #[test]
    fn every_shard_has_one_owner_among_the_live_counters() {
        let membership = Arc::new(Membership::default());
        for name in ["a", "b", "c"] {
            membership.record(Heartbeat::new(name.into(), format!("{name}:1"), 1_000, false));
        }
        let live = membership.live(2_000, 5_000);
        let mut all = Vec::new();
        for name in ["a", "b", "c"] {
            let me = Member { instance: name.into(), addr: format!("{name}:1") };
            let mut ownership = Ownership {
                membership: membership.clone(),
                claims: Arc::new(Claims::default()),
                claims_topic: "o".into(),
                lease: Arc::new(Lease::new(5_000)),
                me,
                topic: "m".into(),
                shard_topic: "s".into(),
                shard_count: 8,
                timeout_ms: 5_000,
                pending: None,
                conflict: None,
                last_take_check: 0,
                take_check: None,
                started_ms: 0,
            };
            let shards = ownership.assigned(&live);
            assert!((2..=3).contains(&shards.len()), "{name} owns {shards:?} of 8");
            all.extend(shards);
        }
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
    }
}
