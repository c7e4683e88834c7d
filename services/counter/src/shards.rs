//! Which shards this process owns right now, shared by the consumer thread (which
//! changes it on rebalance) and the read API (which serves only owned shards that
//! have caught up: a shard rebuilt from the log is not announced, read or rolled
//! up before it holds everything the log held when it was assigned).
//!
//! A shard that failed — a record it cannot decode, a corrupt value, a broken
//! invariant — stays owned but stops: it applies nothing more, its reads answer
//! `shard_failed`, readiness names it, and the other shards go on. An operator moves
//! past a failed record with `tally shards skip` ([`SkipRequest`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tokio::sync::oneshot;

use crate::store::ShardStore;

/// Why a shard stopped.
#[derive(Debug, Clone)]
pub struct ShardFailure {
    /// The shard-topic offset it stopped at: the record that failed, or the first
    /// one not applied when the failure was not a record's (`None`: before any).
    pub offset: Option<i64>,
    pub reason: String,
    /// The record's bytes when the record itself failed to decode: what
    /// `tally shards skip` sends to the dead-letter topic.
    pub record: Option<Arc<Vec<u8>>>,
}

impl ShardFailure {
    pub fn describe(&self, shard: u32) -> String {
        let skippable = if self.record.is_some() { "; `tally shards skip` moves past it" } else { "" };
        match self.offset {
            Some(offset) => format!("shard {shard} failed at offset {offset}: {}{skippable}", self.reason),
            None => format!("shard {shard} failed: {}", self.reason),
        }
    }
}

/// An operator's request to move a failed shard past the record at `offset`,
/// sending it to the dead-letter topic with `reason`; carried out by the consumer
/// thread, which answers on `done`.
pub struct SkipRequest {
    pub shard: u32,
    pub offset: i64,
    pub reason: String,
    pub done: oneshot::Sender<Result<(), String>>,
}

#[derive(Default)]
pub struct Shards {
    owned: RwLock<HashMap<u32, Arc<ShardStore>>>,
    failures: RwLock<BTreeMap<u32, ShardFailure>>,
    skips: Mutex<Vec<SkipRequest>>,
    /// Bumped on every assignment change; a batch collected across a change is
    /// discarded, since the consumer positions were reset from the stores.
    epoch: AtomicU64,
}

/// A lock whose holder panicked still guards consistent data here (plain maps
/// replaced whole), so it is used rather than turning ownership into "none".
fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shards {
    pub fn get(&self, shard: u32) -> Option<Arc<ShardStore>> {
        read(&self.owned).get(&shard).cloned()
    }

    pub fn owned(&self) -> Vec<u32> {
        let mut shards: Vec<u32> = read(&self.owned).keys().copied().collect();
        shards.sort_unstable();
        shards
    }

    /// The owned shards that have not failed and whose store has caught up with
    /// the log (see [`ShardStore::serving`]): the ones read and rolled up.
    pub fn serving(&self) -> Vec<u32> {
        let failures = read(&self.failures);
        let mut shards: Vec<u32> = read(&self.owned)
            .iter()
            .filter(|(shard, store)| store.serving() && !failures.contains_key(shard))
            .map(|(shard, _)| *shard)
            .collect();
        shards.sort_unstable();
        shards
    }

    /// The shards announced as this process's: the serving ones and the failed
    /// ones (whose reads must reach this process to learn they failed).
    pub fn announced(&self) -> Vec<u32> {
        let mut shards = self.serving();
        shards.extend(read(&self.failures).keys());
        shards.sort_unstable();
        shards.dedup();
        shards
    }

    pub fn failure(&self, shard: u32) -> Option<ShardFailure> {
        read(&self.failures).get(&shard).cloned()
    }

    pub fn failures(&self) -> Vec<(u32, ShardFailure)> {
        read(&self.failures).iter().map(|(shard, failure)| (*shard, failure.clone())).collect()
    }

    /// Stops `shard` (the consumer pauses it); logged loudly here.
    pub(crate) fn fail(&self, shard: u32, failure: ShardFailure) {
        tracing::error!(shard, offset = ?failure.offset, reason = %failure.reason, "shard failed: it applies nothing more until an operator acts");
        write(&self.failures).insert(shard, failure);
    }

    pub(crate) fn recover(&self, shard: u32) {
        write(&self.failures).remove(&shard);
    }

    /// Queues a skip for the consumer thread.
    pub fn request_skip(&self, request: SkipRequest) {
        self.skips.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(request);
    }

    pub(crate) fn take_skips(&self) -> Vec<SkipRequest> {
        std::mem::take(&mut *self.skips.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// A new assignment: `stores` are owned, `failures` those that failed to open.
    /// Failures of before are forgotten: a record that failed fails again.
    pub(crate) fn replace(&self, stores: HashMap<u32, Arc<ShardStore>>, failures: BTreeMap<u32, ShardFailure>) {
        *write(&self.owned) = stores;
        *write(&self.failures) = failures;
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }
}
