//! The counter's Kafka consumer context: which shard stores are open, and what
//! taking, restoring and dropping shards does as the assignment changes. A shard
//! taken gets its store (restored from the newest snapshot when it has none), its
//! store's topic id checked, and its partition positioned at the store's next
//! offset; the group's committed offsets are only advisory.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientContext;
use tally_shared::consume::{ahead_of_log, committed_offsets, unreplayable, LogCheck};
use tally_shared::failures::Failure;
use tally_shared::lock;
use tally_shared::snapshot::{clear_restored_marker, restore_in_parallel, restored_marker, SnapshotStore, Snapshotter};
use tally_shared::store_name::StoreName;

use crate::error::Result;
use crate::metrics::Metrics;
use crate::shards::{Roles, Shards};
use crate::store::{ShardStore, StoreOptions};

/// The context of the shard consumer ([`crate::consumer`]).
pub(crate) struct CounterContext {
    pub(crate) shards: Arc<Shards>,
    /// Stores stay open across rebalances: the same shard usually comes back.
    pub(crate) opened: Mutex<HashMap<u32, Arc<ShardStore>>>,
    pub(crate) data_dir: PathBuf,
    pub(crate) store_options: StoreOptions,
    /// Where a shard without a store restores from.
    pub(crate) snapshots: Option<SnapshotStore>,
    /// The shard topic (the snapshots' namespace).
    pub(crate) topic: String,
    pub(crate) metrics: Metrics,
}

impl CounterContext {
    /// The shard's store, and whether it was restored from a snapshot just now.
    fn open(&self, shard: u32) -> Result<(Arc<ShardStore>, bool)> {
        self.open_restoring(shard, true)
    }

    /// [`Self::open`], restoring the newest snapshot when there is no store only if
    /// `may_restore` (not when [`Self::restore_missing`] just tried).
    fn open_restoring(&self, shard: u32, may_restore: bool) -> Result<(Arc<ShardStore>, bool)> {
        let mut opened = lock::lock(&self.opened, "the counter's opened stores");
        if let Some(store) = opened.get(&shard) {
            return Ok((store.clone(), false));
        }
        let path = self.data_dir.join(store_name(&self.topic, shard).dir_name());
        if let Some(snapshots) = self.snapshots.as_ref().filter(|_| may_restore && !path.exists()) {
            self.restore(snapshots, shard, &path)?;
        }
        // Restored just now, or by an operator (`tally restore`), or before a crash
        // that came before its wait was persisted: the mark says so until then.
        let restored = restored_marker(&path).exists();
        let store = Arc::new(ShardStore::open(shard, &path, self.store_options.clone())?);
        tracing::info!(shard, path = %path.display(), next_offset = ?store.next_offset(), restored, "opened shard store");
        opened.insert(shard, store.clone());
        Ok((store, restored))
    }

    /// Replaces this process's copy of `shard` — kept from an earlier tenure, and
    /// behind what the log still holds — with the newest snapshot, if that one
    /// reaches offset `needed` and the copy is not in use; otherwise the copy stays
    /// (and is refused by the caller's check).
    fn restore_over(&self, shard: u32, needed: i64) -> Result<(Arc<ShardStore>, bool)> {
        let Some(snapshots) = self.snapshots.as_ref() else { return self.open(shard) };
        let newest = snapshots.latest(&store_name(&self.topic, shard).to_string())?;
        if newest.is_none_or(|manifest| manifest.next_offset.unwrap_or(0) < needed) {
            return self.open(shard);
        }
        {
            let mut opened = lock::lock(&self.opened, "the counter's opened stores");
            match opened.remove(&shard) {
                // Still used (a snapshot being taken): tried again at the next assignment.
                Some(copy) if Arc::strong_count(&copy) > 1 => {
                    opened.insert(shard, copy);
                    drop(opened);
                    return self.open(shard);
                }
                _ => {}
            }
        }
        let path = self.data_dir.join(store_name(&self.topic, shard).dir_name());
        tracing::info!(shard, path = %path.display(), needed, "replacing a copy of the shard the log no longer reaches with its newest snapshot");
        std::fs::remove_dir_all(&path)?;
        self.open(shard)
    }

    /// Restores the newest snapshot of `shard` into `path` (where no store is);
    /// whether there was one.
    fn restore(&self, snapshots: &SnapshotStore, shard: u32, path: &std::path::Path) -> Result<()> {
        let started = std::time::Instant::now();
        if Snapshotter::restore_latest(snapshots, &store_name(&self.topic, shard).to_string(), path)?.is_some() {
            self.metrics.restored_shards.inc();
            self.metrics.restore_seconds.observe(started.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// Restores, [`PARALLEL_RESTORES`](tally_shared::snapshot::PARALLEL_RESTORES) at a time, the newest snapshots of the
    /// `shards` this process has no store of (a counter that lost its disk, or
    /// taking over shards new to it), so their opening one by one does not wait for
    /// each download in turn. Returns the shards it tried (restored, or with no
    /// snapshot that restores whole); one whose restore failed otherwise is logged
    /// and left out, for its opening to try once more (and fail the shard).
    fn restore_missing(&self, shards: &[u32]) -> HashSet<u32> {
        let Some(snapshots) = self.snapshots.as_ref() else { return HashSet::new() };
        let missing: Vec<(u32, PathBuf)> = {
            let opened = lock::lock(&self.opened, "the counter's opened stores");
            (shards.iter().filter(|shard| !opened.contains_key(shard)))
                .map(|&shard| (shard, self.data_dir.join(store_name(&self.topic, shard).dir_name())))
                .filter(|(_, path)| !path.exists())
                .collect()
        };
        let restored = restore_in_parallel(&missing, |(shard, path)| match self.restore(snapshots, *shard, path) {
            Ok(()) => Some(*shard),
            Err(err) => {
                tracing::warn!(shard, error = %err, "restoring the shard's snapshot; trying again as it opens");
                None
            }
        });
        restored.into_iter().flatten().collect()
    }

    /// Holds exactly the shards `wanted` (owned and standby): opens their stores,
    /// positions each at its store's next offset, assigns them and publishes the
    /// new ownership. A store that does not open (corrupt, or of another format)
    /// fails its shard, not the process; a shard whose log end cannot be read now is
    /// left out (ownership asks again).
    pub(crate) fn assign(&self, consumer: &BaseConsumer<Self>, roles: &Roles) -> Result<()> {
        // Served in the assignment before (a shard that failed to open or to be
        // checked was not, nor a standby: it is gated like a new one when owned).
        let before = self.shards.owned();
        let mut wanted: Vec<u32> = roles.owned.iter().chain(&roles.standby).copied().collect();
        wanted.sort_unstable();
        let wanted = &wanted;
        let committed = committed_offsets(consumer, &self.topic, wanted);
        let topic_id = tally_shared::topic_id::current(consumer.client(), &self.topic);
        let mut stores = HashMap::new();
        let mut failures = BTreeMap::new();
        let mut assigned = TopicPartitionList::new();
        let standby_before = self.shards.standbys();
        let tried = self.restore_missing(wanted);
        for &shard in wanted {
            let partition = shard as i32;
            // Owned before and still, or a standby before and still (or owned before
            // and a standby now): the store goes on from where it is, unchecked again.
            // A standby becoming the owner is checked and caught up like a new shard.
            let kept = before.contains(&shard) || (standby_before.contains(&shard) && roles.standby.contains(&shard));
            if let Some(store) = self.shards.get(shard).filter(|_| kept) {
                // A failure stays until an operator's skip: nothing checked it again.
                if let Some(failure) = self.shards.failures.failure(shard) {
                    failures.insert(shard, failure);
                }
                let offset = store.next_offset().map_or(Offset::Beginning, Offset::Offset);
                assigned.add_partition_offset(&self.topic, partition, offset)?;
                stores.insert(shard, store);
                continue;
            }
            let (start, end) = match consumer.fetch_watermarks(&self.topic, partition, Duration::from_secs(10)) {
                Ok(watermarks) => watermarks,
                Err(err) => {
                    tracing::warn!(shard, error = %err, "reading the shard's log end; taking it later");
                    continue;
                }
            };
            let committed = committed.get(&shard).copied();
            let check = |store: &ShardStore| {
                unreplayable(LogCheck { next: store.next_offset(), log_start: start, log_end: end, committed })
            };
            let opened = self.open_restoring(shard, !tried.contains(&shard)).and_then(|(store, restored)| {
                if check(&store).is_none() || before.contains(&shard) {
                    return Ok((store, restored));
                }
                // A copy kept from an earlier tenure that the log no longer reaches:
                // the newest snapshot may.
                drop(store);
                self.restore_over(shard, start.max(committed.unwrap_or(0)))
            });
            let (store, restored) = match opened {
                Ok(opened) => opened,
                Err(err) => {
                    let reason = format!("opening its store: {err}");
                    failures.insert(shard, Failure { offset: None, reason, record: None });
                    continue;
                }
            };
            if let Some((offset, reason)) = check(&store).or_else(|| ahead_of_log(store.next_offset(), end)) {
                failures.insert(shard, Failure { offset: Some(offset), reason, record: None });
                continue;
            }
            match tally_shared::topic_id::check_store(&store.store, &self.topic, topic_id.as_deref()) {
                Ok(None) => {}
                Ok(Some(reason)) => {
                    failures.insert(shard, Failure { offset: store.next_offset(), reason, record: None });
                    continue;
                }
                Err(err) => {
                    let reason = format!("checking its store's topic id: {err}");
                    failures.insert(shard, Failure { offset: None, reason, record: None });
                    continue;
                }
            }
            if !before.contains(&shard) || store.next_offset().is_none() || restored {
                // Newly taken — built from scratch, restored from a snapshot, or kept
                // from an earlier tenure — or restarted: not served until it caught up
                // with the log as it is now, so it never answers older than its
                // previous owner did (nor partially).
                store.rebuild_until(end)?;
                // The wait is persisted: an operator's restore mark has done its job.
                clear_restored_marker(&self.data_dir.join(store_name(&self.topic, shard).dir_name()))?;
                if store.next_offset().is_none_or(|next| next < end) {
                    tracing::info!(shard, end, next_offset = ?store.next_offset(), "catching up with the shard's log; served once caught up");
                }
            }
            let offset = store.next_offset().map_or(Offset::Beginning, Offset::Offset);
            assigned.add_partition_offset(&self.topic, partition, offset)?;
            stores.insert(shard, store);
        }
        consumer.assign(&assigned)?;
        // librdkafka keeps a partition paused across assignments; a shard that
        // failed before comes back unpaused: taken anew, it fails again if its record
        // does; kept, it kept its failure and the loop pauses it again.
        consumer.resume(&assigned)?;
        // A standby left out (its log's end unread) is not held: ownership asks again.
        let standby: BTreeSet<u32> = (roles.standby.iter().copied())
            .filter(|shard| stores.contains_key(shard) || failures.contains_key(shard))
            .collect();
        let owned: BTreeSet<&u32> = stores.keys().filter(|shard| !standby.contains(shard)).collect();
        tracing::info!(shards = ?owned, standbys = ?standby, "shards assigned");
        self.shards.replace(stores, standby, failures);
        Ok(())
    }
}

impl ClientContext for CounterContext {}

impl ConsumerContext for CounterContext {}

/// The name of `shard`'s store: its directory under the data directory and its
/// snapshots' name (under the shard topic's name, so a store never restores another
/// topic's shard).
pub(crate) fn store_name(topic: &str, shard: u32) -> StoreName {
    StoreName::Shard { topic: topic.to_string(), shard }
}
