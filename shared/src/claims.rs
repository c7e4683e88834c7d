//! Who owns which shard: the shard-owners topic read into one table, the one view
//! tally-query, the counters and the CLI all read claims through.
//!
//! Per shard the table keeps the claim of the newest epoch ([`ShardOwner::replaces`];
//! log order between equal ones): a claim or release of an older epoch — a paused
//! owner's, sent late — is ignored, unless the shard has no owner at all (then any
//! claim is a better guess than none, and a stale one answers `not_owner`). Services
//! follow the topic for as long as they run ([`ClaimTable::follower`]: a record this
//! build cannot read is a newer owner's, logged and skipped, and the table says how
//! far it read); the CLI reads it once ([`ClaimTable::read_once`]) and refuses a
//! record it cannot read, naming it, rather than act on a table missing a claim.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tally_core::wire::ShardOwner;
use tokio::sync::Notify;

use crate::config::KafkaConfig;
use crate::follow::Follow;
use crate::lock;
use crate::{Error, Result};

/// What the table's lock guards, for [`lock::poisoned`].
const CLAIMS: &str = "the shard claims";

/// A shard's claim as the table keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The owner's read address; `None`: released.
    pub addr: Option<String>,
    /// The owner's epoch.
    pub epoch: i64,
    /// The process that made it.
    pub instance: String,
    /// Its position in the owners log (the offset after it): a newer claim has a
    /// higher one.
    pub version: u64,
}

/// The newest claim of every shard, and how far the topic was read.
pub struct ClaimTable {
    claims: RwLock<HashMap<u32, Claim>>,
    /// The offset after the last record read.
    read_to: AtomicI64,
    changed: Notify,
}

impl Default for ClaimTable {
    fn default() -> Self {
        Self { claims: RwLock::default(), read_to: AtomicI64::new(0), changed: Notify::new() }
    }
}

impl ClaimTable {
    /// Takes `owner` (read at `offset`) if it replaces the shard's claim; whether it did.
    pub fn record(&self, owner: ShardOwner, offset: i64) -> bool {
        let taken = {
            let mut claims = lock::write(&self.claims, CLAIMS);
            let current = claims.get(&owner.shard);
            let taken = owner.replaces(current.map(|c| (c.addr.is_some(), c.epoch)));
            if !taken {
                tracing::info!(shard = owner.shard, addr = ?owner.addr, epoch = owner.at_ms, "ignoring a claim of an older epoch");
            } else {
                if current.is_none_or(|c| c.addr != owner.addr) {
                    tracing::info!(shard = owner.shard, addr = ?owner.addr, epoch = owner.at_ms, "shard owner changed");
                }
                let claim = Claim {
                    addr: owner.addr,
                    epoch: owner.at_ms,
                    instance: owner.instance,
                    version: offset as u64 + 1,
                };
                claims.insert(owner.shard, claim);
            }
            taken
        };
        self.read_to.fetch_max(offset + 1, Ordering::SeqCst);
        self.changed.notify_waiters();
        taken
    }

    /// The claim of `shard`, if any.
    pub fn get(&self, shard: u32) -> Option<Claim> {
        lock::read(&self.claims, CLAIMS).get(&shard).cloned()
    }

    /// The newest epoch read for `shard`.
    pub fn epoch(&self, shard: u32) -> Option<i64> {
        lock::read(&self.claims, CLAIMS).get(&shard).map(|claim| claim.epoch)
    }

    /// Who claims `shard` now, if anyone.
    pub fn claimed_by(&self, shard: u32) -> Option<String> {
        lock::read(&self.claims, CLAIMS).get(&shard).and_then(|claim| claim.addr.clone())
    }

    /// Every shard's owner address (`None`: released).
    pub fn owners(&self) -> HashMap<u32, Option<String>> {
        lock::read(&self.claims, CLAIMS).iter().map(|(shard, claim)| (*shard, claim.addr.clone())).collect()
    }

    /// Claims under the read address `addr` that another process made (`instance` is
    /// this one's): a previous incarnation's, killed before it let go. Another
    /// counter would wait for their release forever (the address is a live
    /// member's), so this one releases them: `(shard, epoch)`.
    pub fn orphans(&self, addr: &str, instance: &str) -> Vec<(u32, i64)> {
        let mut orphans: Vec<(u32, i64)> = lock::read(&self.claims, CLAIMS)
            .iter()
            .filter(|(_, claim)| claim.addr.as_deref() == Some(addr) && claim.instance != instance)
            .map(|(shard, claim)| (*shard, claim.epoch))
            .collect();
        orphans.sort_unstable();
        orphans
    }

    /// The offset after the last record read (every claim before it is in the table).
    pub fn read_to(&self) -> i64 {
        self.read_to.load(Ordering::SeqCst)
    }

    /// Waits up to `timeout` for a claim of `shard` with an address and newer than
    /// `than` (any such claim when `than` is `None`).
    pub async fn wait_newer(&self, shard: u32, than: Option<u64>, timeout: Duration) -> Option<Claim> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if let Some(claim) = self.get(shard) {
                if claim.addr.is_some() && than.is_none_or(|v| claim.version > v) {
                    return Some(claim);
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// What follows the topic into `table` for a service: a record this build cannot
    /// read belongs to a newer owner (a rolling upgrade) and is logged and skipped.
    pub fn follower(table: Arc<Self>) -> impl Follow {
        Following(table)
    }

    /// The table as the topic holds it now, read once to its end (the CLI's view). A
    /// record this build cannot read is an error naming it: a table without it could
    /// send an operator's action to an owner that lost the shard.
    pub fn read_once(kafka: &KafkaConfig, topic: &str, timeout: Duration) -> Result<Self> {
        let table = Self::default();
        for (offset, payload) in crate::kafka::read_to_end_at(kafka, topic, timeout)? {
            table.record_readable(offset, &payload)?;
        }
        Ok(table)
    }

    /// Records the claim `payload` read at `offset`; an error when it is not one.
    fn record_readable(&self, offset: i64, payload: &[u8]) -> Result<()> {
        let owner = ShardOwner::decode(payload).map_err(|err| {
            Error::Claims(format!(
                "the shard-owners record at offset {offset} is not a claim this build reads ({err}); \
                 a newer tally wrote it? use a tally of the same release"
            ))
        })?;
        self.record(owner, offset);
        Ok(())
    }
}

struct Following(Arc<ClaimTable>);

impl Follow for Following {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        if let Err(err) = self.0.record_readable(offset, payload) {
            tracing::warn!(offset, error = %err, "ignoring a shard-owner claim this build cannot read");
            self.0.read_to.fetch_max(offset + 1, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(shard: u32, addr: Option<&str>, instance: &str, epoch: i64) -> ShardOwner {
        ShardOwner::new(shard, addr.map(String::from), instance.into(), epoch)
    }

    #[test]
    fn a_claim_or_release_of_an_older_epoch_is_ignored() {
        let table = ClaimTable::default();
        let at = |addr: Option<&str>, version, epoch| Claim {
            addr: addr.map(String::from),
            epoch,
            instance: "i".into(),
            version,
        };
        table.record(claim(3, Some("a:1"), "i", 100), 0);
        table.record(claim(3, Some("b:1"), "i", 200), 1); // b took the shard over
        table.record(claim(3, Some("a:1"), "i", 100), 2); // a paused owner's late claim
        table.record(claim(3, None, "i", 100), 3); // …and its late release
        assert_eq!(table.get(3), Some(at(Some("b:1"), 2, 200)));
        table.record(claim(3, Some("b:1"), "i", 200), 4); // b repeats its claim
        table.record(claim(3, None, "i", 200), 5); // b lets go
        assert_eq!(table.get(3), Some(at(None, 6, 200)));
        // No owner: a claim of any epoch is taken (a stale one answers not_owner).
        table.record(claim(3, Some("a:1"), "i", 150), 6);
        assert_eq!(table.get(3), Some(at(Some("a:1"), 7, 150)));
        table.record(claim(3, Some("c:1"), "i", 300), 7);
        assert_eq!(table.claimed_by(3), Some("c:1".into()));
        assert_eq!(table.read_to(), 8);
    }

    #[test]
    fn claims_name_a_previous_incarnations_orphans() {
        let table = ClaimTable::default();
        table.record(claim(1, Some("me:1"), "old", 100), 0); // a killed incarnation's
        table.record(claim(2, Some("me:1"), "old", 100), 1);
        table.record(claim(2, Some("b:1"), "b", 200), 2); // taken over since
        table.record(claim(2, Some("me:1"), "old", 100), 3); // late: ignored
        table.record(claim(3, Some("me:1"), "new", 300), 4); // this process's own
        table.record(claim(4, Some("me:1"), "old", 100), 5);
        table.record(claim(4, None, "old", 100), 6); // released
        assert_eq!(table.claimed_by(2), Some("b:1".to_string()));
        assert_eq!(table.claimed_by(4), None);
        assert_eq!(table.orphans("me:1", "new"), vec![(1, 100)]);
        let owners = table.owners();
        let expected: HashMap<u32, Option<String>> =
            [(1, Some("me:1".to_string())), (2, Some("b:1".to_string())), (3, Some("me:1".to_string())), (4, None)]
                .into();
        assert_eq!(owners, expected);
    }

    /// A service follows past a record it cannot read (and counts it read); the
    /// one-shot view refuses it, naming its offset.
    #[test]
    fn an_unreadable_record_is_skipped_by_a_follower_and_refused_once() {
        let table = Arc::new(ClaimTable::default());
        let mut follower = ClaimTable::follower(table.clone());
        follower.record(0, &serde_json::to_vec(&claim(1, Some("a:1"), "a", 100)).expect("encodes"));
        follower.record(1, b"{\"v\":99}");
        follower.record(2, &serde_json::to_vec(&claim(2, Some("b:1"), "b", 100)).expect("encodes"));
        assert_eq!(table.owners().len(), 2);
        assert_eq!(table.read_to(), 3);
        let once = ClaimTable::default();
        let refused = once.record_readable(1, b"{\"v\":99}").expect_err("refused");
        assert!(refused.to_string().contains("offset 1 is not a claim this build reads"), "{refused}");
    }
}
