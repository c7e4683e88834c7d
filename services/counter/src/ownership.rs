//! Which shards this counter should own, from the counters' membership
//! ([`tally_shared::membership`]): rendezvous hashing of the shards over the live
//! counters, fenced by this counter's lease.
//!
//! - A lease that lapsed (the counter was paused, or cut off from Kafka, for longer
//!   than it may hold shards) drops every shard at once; the counter then starts a
//!   new tenure and gets shards again like any member that joins.
//! - Otherwise an assignment is acted on once it has stayed the same for
//!   [`SETTLE`] (counters starting together do not pass shards around), and shards
//!   are taken only once the membership was read to its end: their previous owner's
//!   lease has ended by then (the module docs of `membership` say why).
//! - A counter that sees another one use its name (two processes, one name) owns
//!   nothing and says so: its shards would be held twice.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use tally_core::assignment::{owner, Member};
use tally_shared::membership::{Lease, Membership};

/// How long an assignment must stay the same before it is acted on.
pub const SETTLE: Duration = Duration::from_millis(1_000);

pub struct Ownership {
    pub membership: Arc<Membership>,
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
}

/// What the counter should do with its shards.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// Own exactly these shards from now on.
    Own(Vec<u32>),
    /// The lease lapsed: drop every shard, then start a new tenure.
    Lapsed,
}

impl Ownership {
    pub fn new(
        membership: Arc<Membership>,
        lease: Arc<Lease>,
        me: Member,
        topic: String,
        shard_topic: String,
        shard_count: u32,
        timeout_ms: u64,
    ) -> Self {
        Self { membership, lease, me, topic, shard_topic, shard_count, timeout_ms, pending: None, conflict: None }
    }

    /// The change to make now to the shards `owned`, if any.
    pub fn change<C: ConsumerContext>(&mut self, consumer: &BaseConsumer<C>, owned: &[u32], now: i64) -> Option<Change> {
        if self.lease.lapsed(now) {
            self.pending = None;
            return Some(Change::Lapsed);
        }
        let live = self.membership.live(now, self.timeout_ms);
        let wanted = match live.iter().find(|m| m.instance == self.me.instance) {
            // Not seen yet (just started, or a new tenure): nothing to decide.
            None => return None,
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
        let gains = wanted.iter().any(|shard| !owned.contains(shard));
        if gains && !self.read_to_end(consumer) {
            return None;
        }
        Some(Change::Own(wanted))
    }

    /// The name conflict, if one was seen and the other counter is still alive.
    pub fn conflict(&self) -> Option<String> {
        self.conflict.as_ref().map(|other| {
            format!("another counter ({other}) uses this counter's name {:?}: set counter.instance", self.me.instance)
        })
    }

    /// The shards rendezvous hashing gives this counter among `live`.
    fn assigned(&mut self, live: &[Member]) -> Vec<u32> {
        self.conflict = None;
        (0..self.shard_count)
            .filter(|&shard| {
                owner(live, &self.shard_topic, shard as i32).is_some_and(|m| m.instance == self.me.instance)
            })
            .collect()
    }

    /// Whether the membership was read up to the topic's end as of now.
    fn read_to_end<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) -> bool {
        match consumer.fetch_watermarks(&self.topic, 0, Duration::from_secs(2)) {
            Ok((_, high)) => self.membership.caught_up(high),
            Err(err) => {
                tracing::warn!(error = %err, "reading the membership's end; taking shards later");
                false
            }
        }
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
        let mut all = Vec::new();
        for name in ["a", "b", "c"] {
            let me = Member { instance: name.into(), addr: format!("{name}:1") };
            let mut ownership =
                Ownership::new(membership.clone(), Arc::new(Lease::new(5_000)), me, "m".into(), "s".into(), 24, 5_000);
            let shards = ownership.assigned(&live);
            assert!(!shards.is_empty(), "{name} owns shards");
            all.extend(shards);
        }
        all.sort();
        assert_eq!(all, (0..24).collect::<Vec<_>>());
    }
}
