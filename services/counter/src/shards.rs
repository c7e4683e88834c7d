//! Which shards this process owns right now, shared by the consumer thread (which
//! changes it on rebalance) and the read API (which serves only owned shards that
//! have caught up: a shard rebuilt from the log is not announced, read or rolled
//! up before it holds everything the log held when it was assigned).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::store::ShardStore;

#[derive(Default)]
pub struct Shards {
    owned: RwLock<HashMap<u32, Arc<ShardStore>>>,
    /// Bumped on every assignment change; a batch collected across a change is
    /// discarded, since the consumer positions were reset from the stores.
    epoch: AtomicU64,
}

impl Shards {
    pub fn get(&self, shard: u32) -> Option<Arc<ShardStore>> {
        self.owned.read().ok()?.get(&shard).cloned()
    }

    pub fn owned(&self) -> Vec<u32> {
        let mut shards: Vec<u32> = self.owned.read().map(|o| o.keys().copied().collect()).unwrap_or_default();
        shards.sort_unstable();
        shards
    }

    /// The owned shards whose store has caught up with the log (see
    /// [`ShardStore::serving`]): the ones announced, read and rolled up.
    pub fn serving(&self) -> Vec<u32> {
        let owned = self.owned.read();
        let mut shards: Vec<u32> = owned
            .map(|o| o.iter().filter(|(_, store)| store.serving()).map(|(shard, _)| *shard).collect())
            .unwrap_or_default();
        shards.sort_unstable();
        shards
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    pub(crate) fn replace(&self, stores: HashMap<u32, Arc<ShardStore>>) {
        if let Ok(mut owned) = self.owned.write() {
            *owned = stores;
        }
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }
}
