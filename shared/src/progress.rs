//! What a stateful consumer has applied, kept in its RocksDB next to its state:
//! the next input offset, the high-water stamp of every source, and the next
//! sequence number of what it sends. Written into the same write batch as the state
//! a batch changed, so it is never ahead of or behind the data. Values are versioned
//! ([`tally_core::format`]); a malformed one fails the load, it is never skipped.

use std::collections::hash_map::Entry;

use rocksdb::{WriteBatch, DB};
use rustc_hash::FxHashMap;

use crate::{Error, Result};
use tally_core::format::{decode_i64_value, i64_value, STORE_FORMAT_KEY, STORE_V1};
use tally_core::keys::{decode_stamp, encode_stamp};
use tally_core::wire::{Source, Stamp};

/// Checks the key layout version of the store in `db`, writing the current one into
/// a new store. A store of another version (or of none, yet holding progress) fails.
pub fn check_store_format(db: &DB) -> Result<()> {
    let rocks = Error::Rocks;
    match db.get(STORE_FORMAT_KEY).map_err(rocks)? {
        Some(version) if version == [STORE_V1] => Ok(()),
        Some(version) => Err(Error::corrupt(format!(
            "store format {version:?}, this build reads version {STORE_V1}: a newer tally wrote it, or it is corrupt"
        ))),
        None if db.get(KEY_NEXT_OFFSET).map_err(rocks)?.is_some() => {
            Err(Error::corrupt("the store has progress but no format version: written before versioned formats"))
        }
        None => db.put(STORE_FORMAT_KEY, [STORE_V1]).map_err(rocks),
    }
}

const KEY_NEXT_OFFSET: &[u8] = b"next_offset";
const KEY_NEXT_SEQUENCE: &[u8] = b"next_sequence";
const HWM_PREFIX: &[u8] = b"hwm/";

/// Mirrors the progress keys of the last committed write batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// The next input offset to apply; `None` before the first batch.
    pub next_offset: Option<i64>,
    /// The last applied stamp of every source (looked up for every increment a
    /// counter applies: FxHash, as sources are tally's own input partitions).
    pub high_water: FxHashMap<Source, Stamp>,
    /// The next sequence number of this consumer's own outgoing messages.
    pub next_sequence: i64,
}

impl Progress {
    /// Reads the progress from the default column family of `db`.
    pub fn load(db: &DB) -> Result<Self> {
        let rocks = Error::Rocks;
        let mut progress = Progress::default();
        if let Some(bytes) = db.get(KEY_NEXT_OFFSET).map_err(rocks)? {
            progress.next_offset = Some(decode_i64_value(&bytes, "next offset")?);
        }
        if let Some(bytes) = db.get(KEY_NEXT_SEQUENCE).map_err(rocks)? {
            progress.next_sequence = decode_i64_value(&bytes, "next sequence")?;
        }
        for item in db.prefix_iterator(HWM_PREFIX) {
            let (key, value) = item.map_err(rocks)?;
            if !key.starts_with(HWM_PREFIX) {
                break;
            }
            let source = decode_source(&key[HWM_PREFIX.len()..])
                .ok_or_else(|| Error::corrupt(format!("high-water key {key:?}: not a source")))?;
            progress.high_water.insert(source, decode_stamp(&value)?);
        }
        Ok(progress)
    }

    /// Adds to `batch` the keys that differ from `old`.
    pub fn write(&self, old: &Progress, batch: &mut WriteBatch) {
        if let Some(next) = self.next_offset {
            batch.put(KEY_NEXT_OFFSET, i64_value(next));
        }
        if self.next_sequence != old.next_sequence {
            batch.put(KEY_NEXT_SEQUENCE, i64_value(self.next_sequence));
        }
        for (source, stamp) in &self.high_water {
            if old.high_water.get(source) != Some(stamp) {
                batch.put(hwm_key(*source), encode_stamp(*stamp));
            }
        }
    }

    /// Moves `source`'s high-water mark to `stamp`; false when the stamp was
    /// already applied (a redelivery or a replay).
    pub fn advance(&mut self, source: Source, stamp: Stamp) -> bool {
        // One hash per entry (this runs for every increment a counter applies).
        match self.high_water.entry(source) {
            Entry::Occupied(high_water) if stamp <= *high_water.get() => false,
            Entry::Occupied(mut high_water) => {
                high_water.insert(stamp);
                true
            }
            Entry::Vacant(vacant) => {
                vacant.insert(stamp);
                true
            }
        }
    }
}

fn hwm_key(source: Source) -> Vec<u8> {
    let mut key = HWM_PREFIX.to_vec();
    key.push(source.stream);
    key.extend_from_slice(&source.partition.to_be_bytes());
    key
}

fn decode_source(bytes: &[u8]) -> Option<Source> {
    let (&stream, partition) = bytes.split_first()?;
    Some(Source { stream, partition: u32::from_be_bytes(partition.try_into().ok()?) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_round_trips_through_rocksdb() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = rocksdb::Options::default();
        options.create_if_missing(true);
        let source = Source { stream: Source::SHARD, partition: 3 };
        {
            let db = DB::open(&options, dir.path()).unwrap();
            let old = Progress::load(&db).unwrap();
            assert_eq!(old, Progress::default());
            let mut new = Progress { next_offset: Some(42), next_sequence: 9, ..Default::default() };
            assert!(new.advance(source, Stamp { offset: 7, index: 2 }));
            assert!(!new.advance(source, Stamp { offset: 7, index: 2 }));
            let mut batch = WriteBatch::default();
            new.write(&old, &mut batch);
            db.write(batch).unwrap();
        }
        let db = DB::open(&options, dir.path()).unwrap();
        let progress = Progress::load(&db).unwrap();
        assert_eq!((progress.next_offset, progress.next_sequence), (Some(42), 9));
        assert_eq!(progress.high_water[&source], Stamp { offset: 7, index: 2 });
    }

    #[test]
    fn a_malformed_progress_value_fails_the_load() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = rocksdb::Options::default();
        options.create_if_missing(true);
        let db = DB::open(&options, dir.path()).unwrap();
        check_store_format(&db).unwrap();
        check_store_format(&db).unwrap();
        db.put(hwm_key(Source { stream: Source::SHARD, partition: 1 }), [tally_core::format::VALUE_V1, 1, 2]).unwrap();
        let err = Progress::load(&db).unwrap_err().to_string();
        assert!(err.contains("high-water stamp: 2 bytes, expected 12"), "{err}");
        db.put(STORE_FORMAT_KEY, [9]).unwrap();
        assert!(check_store_format(&db).unwrap_err().to_string().contains("this build reads version 1"));
    }
}
