//! How a counter's stores hold their tables in memory: one block cache for every store
//! of the process, sized by config (`counter.block_cache_bytes`), holding data blocks
//! and the tables' index blocks alike.
//!
//! RocksDB keeps each table's index (and filter) outside the block cache by default, for
//! as long as the table is open (about 3.5 % of a table of counts), and gives every
//! column family a cache of its own: a counter's memory would grow with its stores' size
//! and their number. Here the index of each table is partitioned: its top level (an
//! entry per 4 KiB of index) stays pinned in the cache, the partitions come and go with
//! the data blocks; the index of level-0 tables, the newest, which every read looks
//! at, stays pinned too. Pinned blocks count in the cache's capacity but are never
//! evicted: a few hundred bytes per MiB of tables for the top levels, some 2 MiB per
//! store for its level-0 tables' indexes. What a counter's stores hold in memory is
//! then the cache and each store's memtables (bounded per column family).

use std::fmt;
use std::sync::Arc;

use rocksdb::{BlockBasedIndexType, BlockBasedOptions, Cache, Options};

use crate::error::Result;

/// The table settings every column family of a counter's stores shares, with their
/// one block cache. Cloning shares the cache.
#[derive(Clone)]
pub struct BlockCache {
    tables: Arc<BlockBasedOptions>,
    capacity: usize,
}

impl BlockCache {
    /// A block cache of `capacity` bytes, for every store opened with it.
    pub fn new(capacity: usize) -> Result<Self> {
        Ok(Self::with(&Cache::new_lru_cache(capacity)?, capacity))
    }

    /// Tables read through `cache`, whose capacity is `capacity` bytes (told apart:
    /// RocksDB's handle does not say).
    pub fn with(cache: &Cache, capacity: usize) -> Self {
        let mut tables = BlockBasedOptions::default();
        tables.set_block_cache(cache);
        tables.set_cache_index_and_filter_blocks(true);
        tables.set_pin_l0_filter_and_index_blocks_in_cache(true);
        tables.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
        tables.set_pin_top_level_index_and_filter(true);
        Self { tables: Arc::new(tables), capacity }
    }

    /// `options` read their tables through this cache.
    pub fn apply_to(&self, options: &mut Options) {
        options.set_block_based_table_factory(&self.tables);
    }
}

impl fmt::Debug for BlockCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockCache").field("capacity", &self.capacity).finish()
    }
}

#[cfg(test)]
mod tests {
    use rocksdb::WriteBatch;
    use tally_core::keys::{encode_count_key, Counts};
    use tally_shared::progress::Progress;

    use super::*;
    use crate::store::{ShardStore, StoreOptions};

    /// A store several times the cache's size, read whole: the cache stays within its
    /// capacity and the tables keep next to nothing outside it (their indexes are in
    /// the cache), so memory is the config's, not the store's.
    #[test]
    fn a_store_larger_than_its_cache_keeps_its_tables_in_the_cache() {
        const CAPACITY: usize = 1 << 20;
        const COUNTERS: usize = 80_000;
        const BUCKETS: i64 = 8;
        let cache = Cache::new_lru_cache(CAPACITY).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions { block_cache: BlockCache::with(&cache, CAPACITY), ..StoreOptions::default() };
        let store = ShardStore::open(0, dir.path(), options).unwrap();
        let cf = store.counts_family().unwrap();
        let key = |counter: usize, bucket: i64| {
            let mut key = Vec::new();
            encode_count_key(&mut key, &format!("entity:{counter}"), "views", 60_000, bucket * 60_000);
            key
        };
        // Four tables of counts, flushed one by one.
        for (table, counters) in (0..COUNTERS).collect::<Vec<_>>().chunks(COUNTERS / 4).enumerate() {
            let mut batch = WriteBatch::default();
            for &counter in counters {
                for bucket in 0..BUCKETS {
                    batch.merge_cf(cf, key(counter, bucket), Counts::increment(counter as i64 + bucket).encode());
                }
            }
            store.commit(batch, Progress { next_offset: Some(table as i64 + 1), ..Default::default() }).unwrap();
            store.persist().unwrap();
        }
        let db = store.rocks().db();
        let sst_bytes = db.property_int_value_cf(cf, "rocksdb.total-sst-files-size").unwrap().unwrap();
        assert!(sst_bytes as usize > 2 * CAPACITY, "the store ({sst_bytes} B) outgrows the cache");

        for counter in 0..COUNTERS {
            let keys: Vec<Vec<u8>> = (0..BUCKETS).map(|bucket| key(counter, bucket)).collect();
            let expected: Vec<Counts> = (0..BUCKETS).map(|bucket| Counts::increment(counter as i64 + bucket)).collect();
            assert_eq!(store.get_counts(&keys).unwrap(), expected, "counter {counter}");
        }
        let outside = db.property_int_value_cf(cf, "rocksdb.estimate-table-readers-mem").unwrap().unwrap();
        let usage = cache.get_usage();
        assert!(usage <= CAPACITY, "the cache holds {usage} B of {CAPACITY}");
        assert!(usage > CAPACITY / 2, "reads went through the cache ({usage} B)");
        // RocksDB's default (a whole index per table, outside the cache) holds 3.5 % of
        // the tables' bytes here, 220 KB; what is left is each table's properties.
        assert!(outside < 4 << 10, "{outside} B of the tables held outside the cache ({sst_bytes} B on disk)");
    }

    /// Every family of every store opened with one `BlockCache`, the default one
    /// included, reads through that one cache (RocksDB's own default would be a cache
    /// of 8 MiB per family).
    #[test]
    fn every_family_of_every_store_shares_the_one_cache() {
        use crate::store::{segments, CF_DEDUPE, CF_DESC, CF_DESC_LOG, CF_OUTBOX, CF_ROLLUPS, CF_ROLLUP_DEADLINES};
        const CAPACITY: usize = 3 << 20;
        const FAMILIES: [&str; 9] = [
            crate::store::CF_COUNTS,
            CF_DEDUPE,
            CF_DESC,
            CF_DESC_LOG,
            CF_OUTBOX,
            CF_ROLLUPS,
            CF_ROLLUP_DEADLINES,
            segments::CF_SEGMENTS,
            segments::CF_LETTERS,
        ];
        let cache = Cache::new_lru_cache(CAPACITY).unwrap();
        let options = StoreOptions { block_cache: BlockCache::with(&cache, CAPACITY), ..StoreOptions::default() };
        let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        let stores: Vec<ShardStore> = dirs
            .iter()
            .enumerate()
            .map(|(n, dir)| ShardStore::open(n as u32, dir.path(), options.clone()).unwrap())
            .collect();
        let capacity = CAPACITY as u64;
        for store in &stores {
            let db = store.rocks().db();
            let mut capacities: Vec<(&str, Option<u64>)> = FAMILIES
                .iter()
                .map(|&family| {
                    (family, db.property_int_value_cf(store.cf(family).unwrap(), BLOCK_CACHE_CAPACITY).unwrap())
                })
                .collect();
            capacities.push(("default", db.property_int_value(BLOCK_CACHE_CAPACITY).unwrap()));
            let want: Vec<(&str, Option<u64>)> =
                FAMILIES.iter().copied().chain(["default"]).map(|family| (family, Some(capacity))).collect();
            assert_eq!(capacities, want, "shard {}", store.shard);
        }
        // What each store reads lands in the one cache.
        let mut usage = cache.get_usage();
        for store in &stores {
            let cf = store.counts_family().unwrap();
            let mut batch = WriteBatch::default();
            let mut key = Vec::new();
            encode_count_key(&mut key, &format!("entity:{}", store.shard), "views", 0, 0);
            batch.merge_cf(cf, &key, Counts::increment(5).encode());
            store.commit(batch, Progress { next_offset: Some(1), ..Default::default() }).unwrap();
            store.persist().unwrap();
            assert_eq!(store.get_counts(&[&key]).unwrap(), [Counts::increment(5)]);
            let now = cache.get_usage();
            assert!(now > usage, "shard {}'s read: {now} B in the cache, {usage} B before", store.shard);
            usage = now;
        }
    }

    const BLOCK_CACHE_CAPACITY: &str = "rocksdb.block-cache-capacity";
}
