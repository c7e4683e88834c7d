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
//! - Standbys (`counter.standby_replicas`) are held at once: they serve nothing,
//!   so they need no fencing. A shard to be taken is held as a standby while the
//!   fencing checks run, so it is built meanwhile; one held as a standby already
//!   (its owner went) is taken without waiting for [`SETTLE`].
//! - A counter that sees another one use its name (two processes, one name) logs
//!   it and names it in readiness; their newest heartbeats alternate, so neither
//!   settles on an assignment until one is gone: give each counter its own name.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use tally_core::assignment::{balanced, standbys, Member};
use tally_shared::claims::ClaimTable;
use tally_shared::config::TallyConfig;
use tally_shared::follow::{follow, FAILOVER_FETCH_WAIT};
use tally_shared::kafka::TopicNames;
use tally_shared::membership::{self, Lease, Membership};
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::shards::Roles;

/// Helper threads by name, watched by the consumer: one that ends before shutdown
/// (a panic) stops the counter.
pub type Watched = Vec<(&'static str, JoinHandle<()>)>;

/// How long an assignment must stay the same before it is acted on.
pub const SETTLE: Duration = Duration::from_millis(1_000);

pub struct Ownership {
    pub membership: Arc<Membership>,
    pub claims: Arc<ClaimTable>,
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
    /// Standbys per shard.
    pub standby_replicas: usize,
    /// The assignment last computed, and since when it is the same.
    pending: Option<(Roles, i64)>,
    /// The live members this counter's roles were last computed for, and those.
    computed: Option<(Vec<Member>, Roles)>,
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
    /// Own exactly these shards, and hold these standbys, from now on.
    Own(Roles),
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
        let claims = Arc::new(ClaimTable::default());
        let every = Duration::from_millis(config.counter.heartbeat_ms);
        let kafka = &config.kafka;
        let beats = membership::heartbeat(kafka, topic.clone(), me.clone(), every, lease.clone(), leave.clone())?;
        let members = membership::follow(kafka, "counter-membership", &topic, membership.clone(), shutdown.clone())?;
        let (poll, group) = (Duration::from_millis(50), "tally-counter-claims");
        let read_claims = ClaimTable::follower(claims.clone());
        let claimed = follow(
            kafka,
            "counter-claims",
            group,
            &claims_topic,
            poll,
            FAILOVER_FETCH_WAIT,
            shutdown.clone(),
            read_claims,
        )?;
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
            standby_replicas: config.counter.standby_replicas as usize,
            pending: None,
            computed: None,
            conflict: None,
            last_take_check: 0,
            take_check: None,
            started_ms: tally_shared::kafka::now_ms(),
        };
        Ok((ownership, vec![("heartbeat", beats), ("membership", members), ("claims", claimed)]))
    }

    /// The change to make now to the shards `held`, if any; `catching_up` while an
    /// owned shard is not served yet (new standbys wait for it: opening one may
    /// restore a snapshot in the loop that shard needs).
    pub fn change<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        held: &Roles,
        catching_up: bool,
        now: i64,
    ) -> Option<Change> {
        if self.lease.lapsed(now) {
            self.pending = None;
            return Some(Change::Lapsed);
        }
        let live = self.membership.live(now, self.timeout_ms);
        let wanted: Roles = match live.iter().find(|m| m.instance == self.me.instance) {
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
                Roles::default()
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
        // A standby taking over its shard (its owner went) does not wait to settle.
        let taking = || wanted.owned.iter().filter(|shard| !held.owned.contains(shard));
        let promotions_only = taking().next().is_some() && taking().all(|shard| held.standby.contains(shard));
        if wanted == *held || (now - since < SETTLE.as_millis() as i64 && !promotions_only) {
            return None;
        }
        let kept: Vec<u32> = wanted.owned.iter().copied().filter(|shard| held.owned.contains(shard)).collect();
        if kept.len() == wanted.owned.len() {
            let opening =
                wanted.standby.iter().any(|shard| !held.standby.contains(shard) && !held.owned.contains(shard));
            if opening && catching_up {
                // Dropping shards waits too: nothing is lost by holding a store longer.
                return None;
            }
            return Some(Change::Own(wanted));
        }
        // Taking shards. First the ends of the membership and the claims are read
        // (at most every 200 ms: two watermark requests); once the followers have
        // read that far, liveness *as of then* decides — every heartbeat
        // acknowledged before then is in that view, so a member it finds gone had
        // its lease end a margin before — and a shard is taken only if no counter
        // alive then claims it. Meanwhile the shards to take are held as standbys.
        let meanwhile = self.holding(kept, &wanted, held, promotions_only);
        let unchanged = (meanwhile != *held).then_some(Change::Own(meanwhile));
        let check = match self.take_check {
            Some(check) if now - check.at < TAKE_CHECK_PATIENCE_MS => check,
            _ => {
                if now - self.last_take_check >= 200 {
                    self.last_take_check = now;
                    self.take_check = self.read_ends(consumer, now);
                }
                return unchanged;
            }
        };
        let members_read = self.membership.caught_up(check.members_end);
        if !members_read || self.claims.read_to() < check.claims_end {
            return unchanged;
        }
        self.take_check = None;
        let live = self.membership.live(check.at, self.timeout_ms);
        if !live.iter().any(|m| m.instance == self.me.instance) || self.assigned(&live) != wanted {
            self.pending = None;
            return unchanged;
        }
        let others: Vec<&str> =
            live.iter().filter(|m| m.instance != self.me.instance).map(|m| m.addr.as_str()).collect();
        let taken: Vec<u32> = wanted
            .owned
            .iter()
            .copied()
            .filter(|shard| {
                held.owned.contains(shard)
                    || self.claims.claimed_by(*shard).is_none_or(|addr| !others.contains(&addr.as_str()))
            })
            .collect();
        let roles = self.holding(taken, &wanted, held, promotions_only);
        (roles != *held).then_some(Change::Own(roles))
    }

    /// `owned`, and as standbys `wanted`'s and the shards it owns not yet in
    /// `owned`. But while standbys take over (`promoting`), no store is opened: only
    /// standbys `held` already stay, and new ones come with the next change.
    fn holding(&self, owned: Vec<u32>, wanted: &Roles, held: &Roles, promoting: bool) -> Roles {
        let waiting = wanted.owned.iter().copied().filter(|shard| !owned.contains(shard));
        let mut standby: Vec<u32> = wanted.standby.iter().copied().chain(waiting).collect();
        if promoting {
            standby.retain(|shard| held.standby.contains(shard));
        }
        standby.sort_unstable();
        Roles { owned, standby }
    }

    /// The name conflict, if one was seen and the other counter is still alive.
    pub fn conflict(&self) -> Option<String> {
        self.conflict.as_ref().map(|other| {
            format!("another counter ({other}) uses this counter's name {:?}: set counter.instance", self.me.instance)
        })
    }

    /// The shards balanced rendezvous hashing gives this counter among `live`, and
    /// those it is a standby of (computed again only when `live` changes).
    fn assigned(&mut self, live: &[Member]) -> Roles {
        self.conflict = None;
        if let Some((members, roles)) = &self.computed {
            if members == live {
                return roles.clone();
            }
        }
        let me = |member: &&Member| member.instance == self.me.instance;
        let owners = balanced(live, &self.shard_topic, self.shard_count);
        let chains = standbys(live, &self.shard_topic, self.shard_count, self.standby_replicas);
        let roles = Roles {
            owned: (0..self.shard_count).filter(|&shard| owners[shard as usize].as_ref().is_some_and(me)).collect(),
            standby: (0..self.shard_count).filter(|&shard| chains[shard as usize].iter().any(me)).collect(),
        };
        self.computed = Some((live.to_vec(), roles.clone()));
        roles
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
    fn every_shard_has_one_owner_among_the_live_counters() {
        let membership = Arc::new(Membership::default());
        for name in ["a", "b", "c"] {
            membership.record(Heartbeat::new(name.into(), format!("{name}:1"), 1_000, false));
        }
        let live = membership.live(2_000, 5_000);
        let (mut all, mut standbys) = (Vec::new(), Vec::new());
        for name in ["a", "b", "c"] {
            let me = Member { instance: name.into(), addr: format!("{name}:1") };
            let mut ownership = Ownership {
                membership: membership.clone(),
                claims: Arc::new(ClaimTable::default()),
                claims_topic: "o".into(),
                lease: Arc::new(Lease::new(5_000)),
                me,
                topic: "m".into(),
                shard_topic: "s".into(),
                shard_count: 8,
                timeout_ms: 5_000,
                standby_replicas: 1,
                pending: None,
                computed: None,
                conflict: None,
                last_take_check: 0,
                take_check: None,
                started_ms: 0,
            };
            let roles = ownership.assigned(&live);
            assert!((2..=3).contains(&roles.owned.len()), "{name} owns {roles:?} of 8");
            assert!(roles.standby.iter().all(|shard| !roles.owned.contains(shard)), "{name}: {roles:?}");
            all.extend(roles.owned);
            standbys.extend(roles.standby);
        }
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        standbys.sort();
        assert_eq!(standbys, (0..8).collect::<Vec<_>>(), "one standby each");
    }
}
