//! Which shards this process owns right now, shared by the consumer thread (which
//! changes it on rebalance) and the read API (which serves only owned shards that
//! have caught up: a shard rebuilt from the log is not announced, read or rolled
//! up before it holds everything the log held when it was assigned).
//!
//! A counter also holds **standbys** (`counter.standby_replicas`): stores of shards
//! other counters own, applied from the log like owned ones (and relaying their
//! outboxes: the stamps make the copies harmless) but never announced, rolled up
//! or snapshotted, and read only by reads that allow staleness while the owner is
//! silent ([`Shards::standby_served`]). When the owner goes, the first standby takes the
//! shard without a restore: it only catches up with the log's end.
//!
//! A shard that failed — a record it cannot decode, a corrupt value, a broken
//! invariant — stays owned but stops: it applies nothing more, its reads answer
//! `shard_failed`, readiness names it, and the other shards go on. An operator moves
//! past a failed record with `tally shards skip` ([`tally_shared::failures`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tally_shared::failures::{Failure, FailureBoard};
use tally_shared::kafka::now_ms;
use tally_shared::lock;
use tally_shared::membership::Lease;
use tally_shared::snapshot::SnapshotRequests;

use tally_core::wire::{ShardState, ShardStatus};

use crate::freshness::AsOf;
use crate::store::ShardStore;

/// The owned shards, shared by every thread of the counter.
///
/// **Lock order.** `stores` before `lags`; the failure board's lock is taken after
/// `stores` (read) or alone, never the other way round. No shard store's lock is
/// taken while `stores` is held for writing ([`ShardStore`] has its own order).
pub struct Shards {
    stores: RwLock<Held>,
    /// Operators' requests to snapshot every serving shard now.
    pub snapshot_requests: Arc<SnapshotRequests>,
    /// Failed shards and the skips operators asked for.
    pub failures: Arc<FailureBoard>,
    /// While it is valid this counter may act as the owner of its shards: read,
    /// roll up, announce ([`tally_shared::membership`]). Static assignment: forever.
    pub lease: Arc<Lease>,
    /// Bumped on every assignment change; a batch collected across a change is
    /// discarded, since the consumer positions were reset from the stores.
    epoch: AtomicU64,
    /// Each owned shard's last measured lag: (records behind the log's end, when).
    lags: RwLock<HashMap<u32, (i64, i64)>>,
    /// Woken after a turn of the loop in which a store moved (a batch applied, an
    /// outbox relayed, shards taken or served): readers waiting for positions look
    /// again.
    pub changed: tokio::sync::Notify,
}

/// Every held store, owned or standby, and which of them are standbys.
#[derive(Default)]
struct Held {
    stores: HashMap<u32, Arc<ShardStore>>,
    standby: BTreeSet<u32>,
}

/// What the two locks guard, for [`lock::poisoned`].
const STORES: &str = "the counter's shard stores";
const LAGS: &str = "the counter's shard lags";

impl Default for Shards {
    /// Shards owned statically: the lease never ends.
    fn default() -> Self {
        Self::new(Arc::new(Lease::forever()))
    }
}

impl Shards {
    pub fn new(lease: Arc<Lease>) -> Self {
        Self {
            stores: RwLock::default(),
            snapshot_requests: Arc::default(),
            failures: Arc::new(FailureBoard::new(|shard| format!("shard {shard}"))),
            lease,
            epoch: AtomicU64::new(0),
            lags: RwLock::default(),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// Records that `shard` was `lag` records behind its log's end just now.
    pub fn record_lag(&self, shard: u32, lag: i64) {
        lock::write(&self.lags, LAGS).insert(shard, (lag, now_ms()));
    }

    /// What this counter holds and how fresh it is: every held shard's state and
    /// last measured lag (`GET /internal/v1/status`, the dashboard's freshness).
    pub fn status(&self) -> Vec<ShardStatus> {
        let (serving, held, standbys) = (self.serving(), self.held(), self.standbys());
        let held: BTreeSet<u32> = held.owned.into_iter().chain(standbys.iter().copied()).collect();
        // Before the lags: `stores` comes first in the lock order.
        let now = now_ms();
        let as_of: HashMap<u32, AsOf> =
            held.iter().filter_map(|&shard| Some((shard, self.get(shard)?.freshness.as_of(now)))).collect();
        let lags = lock::read(&self.lags, LAGS);
        held.into_iter()
            .map(|shard| {
                let state = if self.failures.is_failed(shard) {
                    ShardState::Failed
                } else if standbys.contains(&shard) {
                    ShardState::Standby
                } else if serving.contains(&shard) {
                    ShardState::Serving
                } else {
                    ShardState::CatchingUp
                };
                let lag = lags.get(&shard).copied();
                let as_of = as_of.get(&shard);
                ShardStatus {
                    shard,
                    state,
                    lag: lag.map(|l| l.0),
                    lag_at_ms: lag.map(|l| l.1),
                    applied: as_of.map(|as_of| as_of.applied),
                    lag_ms: as_of.and_then(|as_of| as_of.lag_ms),
                }
            })
            .collect()
    }

    /// The store of a held shard, owned or standby.
    pub fn get(&self, shard: u32) -> Option<Arc<ShardStore>> {
        lock::read(&self.stores, STORES).stores.get(&shard).cloned()
    }

    /// Every shard whose store is held, owned or standby: what the consumer applies,
    /// relays and flushes.
    pub fn stores(&self) -> Vec<u32> {
        let mut shards: Vec<u32> = lock::read(&self.stores, STORES).stores.keys().copied().collect();
        shards.sort_unstable();
        shards
    }

    /// The shards owned (with a store): the held ones that are no standbys.
    pub fn owned(&self) -> Vec<u32> {
        let held = lock::read(&self.stores, STORES);
        let mut shards: Vec<u32> = held.stores.keys().copied().filter(|shard| !held.standby.contains(shard)).collect();
        shards.sort_unstable();
        shards
    }

    /// The shards held as standbys (whether their store opened or failed).
    pub fn standbys(&self) -> BTreeSet<u32> {
        lock::read(&self.stores, STORES).standby.clone()
    }

    /// The store of `shard` if it is served now: see [`Shards::serving`].
    pub fn served(&self, shard: u32) -> Option<Arc<ShardStore>> {
        let held = lock::read(&self.stores, STORES);
        let store = held.stores.get(&shard).filter(|_| !held.standby.contains(&shard))?;
        (store.serving() && self.lease.valid(now_ms())).then(|| store.clone())
    }

    /// The store of `shard` if it is held as a standby that caught up with the log
    /// once, while the lease holds: what a read allowing staleness may fall back on
    /// while the owner is silent (its answer may be older than the owner's).
    pub fn standby_served(&self, shard: u32) -> Option<Arc<ShardStore>> {
        let held = lock::read(&self.stores, STORES);
        let store = held.stores.get(&shard).filter(|_| held.standby.contains(&shard))?;
        (store.serving() && self.lease.valid(now_ms())).then(|| store.clone())
    }

    /// The owned shards that have not failed and whose store has caught up with
    /// the log (see [`ShardStore::serving`]), while the lease holds: the ones read
    /// and rolled up.
    pub fn serving(&self) -> Vec<u32> {
        if !self.lease.valid(now_ms()) {
            return Vec::new();
        }
        let held = lock::read(&self.stores, STORES);
        let mut shards: Vec<u32> = (held.stores.iter())
            .filter(|(shard, store)| {
                store.serving() && !held.standby.contains(shard) && !self.failures.is_failed(**shard)
            })
            .map(|(shard, _)| *shard)
            .collect();
        shards.sort_unstable();
        shards
    }

    /// The shards last assigned: the owned ones and those that failed (also those
    /// that failed to open), and the standbys — what ownership compares with what
    /// it wants.
    pub fn held(&self) -> Roles {
        let standby = self.standbys();
        let mut owned = self.owned();
        owned.extend(self.failures.failed().into_iter().filter(|shard| !standby.contains(shard)));
        owned.sort_unstable();
        owned.dedup();
        Roles { owned, standby: standby.into_iter().collect() }
    }

    /// The shards announced as this process's: the serving ones and the failed
    /// owned ones (whose reads must reach this process to learn they failed).
    pub fn announced(&self) -> Vec<u32> {
        if !self.lease.valid(now_ms()) {
            return Vec::new();
        }
        let standbys = self.standbys();
        let mut shards = self.serving();
        shards.extend(self.failures.failed().into_iter().filter(|shard| !standbys.contains(shard)));
        shards.sort_unstable();
        shards.dedup();
        shards
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// A new assignment: `stores` are held (those in `standby` as standbys, the
    /// others owned), `failures` those that failed to open. Failures of before are
    /// forgotten: a record that failed fails again.
    pub(crate) fn replace(
        &self,
        stores: HashMap<u32, Arc<ShardStore>>,
        standby: BTreeSet<u32>,
        failures: BTreeMap<u32, Failure>,
    ) {
        {
            // A lag measured in an earlier tenure says nothing of a shard taken again.
            let mut held = lock::write(&self.stores, STORES);
            lock::write(&self.lags, LAGS)
                .retain(|shard, _| held.stores.contains_key(shard) && stores.contains_key(shard));
            *held = Held { stores, standby };
        }
        self.failures.reset(failures);
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }
}

/// The shards a counter owns and those it holds as standbys (sorted, disjoint).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Roles {
    pub owned: Vec<u32>,
    pub standby: Vec<u32>,
}

/// Shards owning shard 0 only: a store in `dir` that applied `events` (entity,
/// `views` delta, event time) at `now` as one shard record, marking rollups when
/// `rollups`.
#[cfg(test)]
pub(crate) fn one_shard_with(
    dir: &std::path::Path,
    events: &[(&str, i64, i64)],
    now: i64,
    rollups: bool,
) -> Arc<Shards> {
    use tally_core::wire::{Increment, ShardMessage, Source, Stamp};

    let store = ShardStore::open(0, dir, crate::store::StoreOptions::default()).unwrap();
    let entries = events
        .iter()
        .enumerate()
        .map(|(i, &(entity, delta, ts))| {
            let increment = Increment { entity: entity.into(), metric: "views".into(), delta, ts, id: None };
            (Stamp { offset: i as i64, index: 0 }, increment)
        })
        .collect();
    let source = Source { stream: Source::INCREMENTS, partition: 0 };
    let payload = ShardMessage::Increments { source, entries }.encode().unwrap();
    let record = crate::store::apply::ShardRecord { offset: 0, payload: &payload, timestamp: None };
    store.apply(&[record], now, rollups).unwrap();
    let shards = Arc::new(Shards::default());
    shards.replace(HashMap::from([(0, Arc::new(store))]), BTreeSet::new(), BTreeMap::new());
    shards
}
