//! What a stateful consumer has applied, kept in its RocksDB next to its state:
//! the next input offset, the high-water stamp of every source, and the next
//! sequence number of what it sends. Written into the same write batch as the state
//! a batch changed, so it is never ahead of or behind the data.

use std::collections::HashMap;

use rocksdb::{WriteBatch, DB};

use crate::wire::{Source, Stamp};
use crate::{Error, Result};

const KEY_NEXT_OFFSET: &[u8] = b"next_offset";
const KEY_NEXT_SEQUENCE: &[u8] = b"next_sequence";
const HWM_PREFIX: &[u8] = b"hwm/";

/// Mirrors the progress keys of the last committed write batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// The next input offset to apply; `None` before the first batch.
    pub next_offset: Option<i64>,
    /// The last applied stamp of every source.
    pub high_water: HashMap<Source, Stamp>,
    /// The next sequence number of this consumer's own outgoing messages.
    pub next_sequence: i64,
}

impl Progress {
    /// Reads the progress from the default column family of `db`.
    pub fn load(db: &DB) -> Result<Self> {
        let rocks = |err: rocksdb::Error| Error::Store(err.to_string());
        let mut progress = Progress::default();
        if let Some(bytes) = db.get(KEY_NEXT_OFFSET).map_err(rocks)? {
            progress.next_offset = Some(decode_i64(&bytes));
        }
        if let Some(bytes) = db.get(KEY_NEXT_SEQUENCE).map_err(rocks)? {
            progress.next_sequence = decode_i64(&bytes);
        }
        for item in db.prefix_iterator(HWM_PREFIX) {
            let (key, value) = item.map_err(rocks)?;
            if !key.starts_with(HWM_PREFIX) {
                break;
            }
            if let (Some(source), Some(stamp)) = (decode_source(&key[HWM_PREFIX.len()..]), decode_stamp(&value)) {
                progress.high_water.insert(source, stamp);
            }
        }
        Ok(progress)
    }

    /// Adds to `batch` the keys that differ from `old`.
    pub fn write(&self, old: &Progress, batch: &mut WriteBatch) {
        if let Some(next) = self.next_offset {
            batch.put(KEY_NEXT_OFFSET, next.to_le_bytes());
        }
        if self.next_sequence != old.next_sequence {
            batch.put(KEY_NEXT_SEQUENCE, self.next_sequence.to_le_bytes());
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
        if self.high_water.get(&source).is_some_and(|high_water| stamp <= *high_water) {
            return false;
        }
        self.high_water.insert(source, stamp);
        true
    }
}

/// A little-endian i64 (0 when malformed).
pub fn decode_i64(bytes: &[u8]) -> i64 {
    bytes.try_into().map(i64::from_le_bytes).unwrap_or(0)
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

fn encode_stamp(stamp: Stamp) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..8].copy_from_slice(&stamp.offset.to_le_bytes());
    out[8..].copy_from_slice(&stamp.index.to_le_bytes());
    out
}

fn decode_stamp(bytes: &[u8]) -> Option<Stamp> {
    if bytes.len() != 12 {
        return None;
    }
    Some(Stamp {
        offset: i64::from_le_bytes(bytes[..8].try_into().ok()?),
        index: u32::from_le_bytes(bytes[8..].try_into().ok()?),
    })
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
}
