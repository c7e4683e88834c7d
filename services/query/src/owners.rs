//! Which counter serves which shard, learned from the shard-owners topic.
//!
//! A background thread reads the topic from the beginning and keeps, per shard, the
//! claim of the newest epoch ([`ShardOwner::at_ms`]; log order between equal ones):
//! a claim or release of an older epoch — a paused owner's, sent late — is ignored,
//! unless the shard has no owner at all (then any claim is a better guess than none,
//! and a stale one answers `not_owner`). Readers that find a claim stale — the owner
//! answered `not_owner` or did not answer — wait for a newer one.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tally_core::wire::ShardOwner;
use tally_shared::config::KafkaConfig;
use tally_shared::follow::Follow;
use tally_shared::telemetry::Readiness;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::error::Result;

/// A claim: the read address and its position in the owners log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub addr: Option<String>,
    pub version: u64,
    /// The owner's epoch.
    pub epoch: i64,
}

#[derive(Default)]
pub struct Owners {
    claims: RwLock<HashMap<u32, Claim>>,
    changed: Notify,
}

impl Owners {
    pub fn get(&self, shard: u32) -> Option<Claim> {
        self.claims.read().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&shard).cloned()
    }

    pub fn record(&self, owner: ShardOwner, version: u64) {
        {
            let mut claims = self.claims.write().unwrap_or_else(|poisoned| poisoned.into_inner());
            let current = claims.get(&owner.shard);
            if !owner.replaces(current.map(|c| (c.addr.is_some(), c.epoch))) {
                tracing::info!(shard = owner.shard, addr = ?owner.addr, epoch = owner.at_ms, "ignoring a claim of an older epoch");
                return;
            }
            if current.is_none_or(|c| c.addr != owner.addr) {
                tracing::info!(shard = owner.shard, addr = ?owner.addr, epoch = owner.at_ms, "shard owner changed");
            }
            claims.insert(owner.shard, Claim { addr: owner.addr, version, epoch: owner.at_ms });
        }
        self.changed.notify_waiters();
    }

    /// Waits up to `timeout` for a claim of `shard` newer than `than` (any claim
    /// with an address when `than` is `None`).
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
}

/// Keeps `readiness` true while every one of `shards` has an owner to read from and
/// the `follower` thread follows the claims; a follower that ends before `shutdown`
/// (a panic) stops the service. Returns whether it did, once the follower is joined.
pub async fn track_readiness(
    owners: Arc<Owners>,
    shards: u32,
    readiness: Readiness,
    shutdown: CancellationToken,
    follower: std::thread::JoinHandle<()>,
) -> bool {
    let mut died = false;
    while !shutdown.is_cancelled() {
        if follower.is_finished() {
            tracing::error!("the shard-owners follower stopped unexpectedly; stopping");
            died = true;
            shutdown.cancel();
            break;
        }
        readiness.set((0..shards).all(|shard| owners.get(shard).is_some_and(|claim| claim.addr.is_some())));
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    readiness.set(false);
    let joined = tokio::task::spawn_blocking(move || follower.join()).await;
    died || !matches!(joined, Ok(Ok(())))
}

pub fn follow(
    kafka: &KafkaConfig,
    topic: &str,
    owners: Arc<Owners>,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let group = format!("tally-query-{:016x}", rand::random::<u64>());
    Ok(tally_shared::follow::follow(
        kafka,
        "owners",
        &group,
        topic,
        Duration::from_millis(200),
        shutdown,
        Claims(owners),
    )?)
}

/// Records every claim read; one of another format is not this build's to follow
/// (it belongs to a newer owner, whose reads then wait for a claim this build reads).
struct Claims(Arc<Owners>);

impl Follow for Claims {
    fn record(&mut self, offset: i64, payload: &[u8]) {
        match ShardOwner::decode(payload) {
            Ok(owner) => self.0.record(owner, offset as u64 + 1),
            Err(err) => tracing::warn!(offset, error = %err, "ignoring a shard-owner claim this build cannot read"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(shard: u32, addr: Option<&str>, epoch: i64) -> ShardOwner {
        ShardOwner::new(shard, addr.map(String::from), "i".into(), epoch)
    }

    #[test]
    fn a_claim_or_release_of_an_older_epoch_is_ignored() {
        let owners = Owners::default();
        owners.record(claim(3, Some("a:1"), 100), 1);
        owners.record(claim(3, Some("b:1"), 200), 2); // b took the shard over
        owners.record(claim(3, Some("a:1"), 100), 3); // a paused owner's late claim
        owners.record(claim(3, None, 100), 4); // …and its late release
        assert_eq!(owners.get(3), Some(Claim { addr: Some("b:1".into()), version: 2, epoch: 200 }));
        owners.record(claim(3, Some("b:1"), 200), 5); // b repeats its claim
        owners.record(claim(3, None, 200), 6); // b lets go
        assert_eq!(owners.get(3), Some(Claim { addr: None, version: 6, epoch: 200 }));
        // No owner: a claim of any epoch is taken (a stale one answers not_owner).
        owners.record(claim(3, Some("a:1"), 150), 7);
        assert_eq!(owners.get(3), Some(Claim { addr: Some("a:1".into()), version: 7, epoch: 150 }));
        owners.record(claim(3, Some("c:1"), 300), 8);
        assert_eq!(owners.get(3).map(|c| c.addr), Some(Some("c:1".into())));
    }
}
