//! Which count keys are known to carry a rollup mark, so a batch does not write the
//! same mark again.
//!
//! Under load the same buckets change batch after batch while their marks wait for
//! the next round of rollups (at most one a second): writing each mark again would be
//! a third of the counter's CPU per increment (BENCHMARKS.md). A batch writes a mark
//! only for a key not in this set; the set holds a key only while its mark is in the
//! store.
//!
//! The rule that keeps every change published: a key is in the set only while its
//! mark is committed and not yet removed. A batch holds the set's lock from the
//! moment it looks a key up until its write batch is committed, and unmarking takes
//! the same lock before the store's commit lock, so a mark cannot be removed between
//! a batch's "already marked" and its commit. Keys enter the set only after their
//! marks are committed, and leave it with their marks. The set starts empty when a
//! store opens (every key is then marked again once: harmless) and is bounded: a key
//! that does not fit is simply marked every time.
//!
//! Keys are held as 128-bit hashes (two SipHash-1-3 with random keys): a collision
//! would skip a mark, and at 2^-128 per pair it is not a risk worth a key's bytes.
//! The set uses the hash's own low bits as its bucket hash (no third hashing).

use std::collections::HashSet;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};

/// At most this many keys per shard (16 bytes each; the set takes about 9 MB full).
pub const MAX_MARKED: usize = 256 * 1024;

/// Count keys whose rollup marks are committed.
pub struct MarkedKeys {
    hashes: HashSet<u128, BuildHasherDefault<AlreadyHashed>>,
    halves: (RandomState, RandomState),
    capacity: usize,
}

impl MarkedKeys {
    pub fn new(capacity: usize) -> Self {
        Self { hashes: HashSet::default(), halves: (RandomState::new(), RandomState::new()), capacity }
    }

    pub fn hash(&self, key: &[u8]) -> u128 {
        (u128::from(self.halves.0.hash_one(key)) << 64) | u128::from(self.halves.1.hash_one(key))
    }

    pub fn contains(&self, hash: u128) -> bool {
        self.hashes.contains(&hash)
    }

    /// Records marks just committed (those that fit).
    pub fn insert_committed(&mut self, hashes: impl IntoIterator<Item = u128>) {
        for hash in hashes {
            if self.hashes.len() >= self.capacity {
                return;
            }
            self.hashes.insert(hash);
        }
    }

    /// Forgets a key whose mark was removed.
    pub fn remove(&mut self, key: &[u8]) {
        let hash = self.hash(key);
        self.hashes.remove(&hash);
    }

    pub fn count(&self) -> usize {
        self.hashes.len()
    }
}

/// The set's hasher: its values are SipHash outputs already, so their low 64 bits
/// serve as they are.
#[derive(Default)]
struct AlreadyHashed(u64);

impl Hasher for AlreadyHashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u128s are hashed here (`write_u128`); anything else still spreads.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u128(&mut self, value: u128) {
        self.0 = value as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_committed_keys_up_to_its_capacity_and_forgets_removed_ones() {
        let mut marked = MarkedKeys::new(2);
        let (a, b, c) = (marked.hash(b"a"), marked.hash(b"b"), marked.hash(b"c"));
        assert_eq!(marked.hash(b"a"), a, "the same key hashes the same");
        assert!(a != b && b != c && a != c);
        marked.insert_committed([a, b, c]);
        assert_eq!((marked.contains(a), marked.contains(b), marked.contains(c)), (true, true, false), "c did not fit");
        assert_eq!(marked.count(), 2);
        marked.remove(b"a");
        assert!(!marked.contains(a));
        marked.insert_committed([c]);
        assert_eq!((marked.contains(b), marked.contains(c), marked.count()), (true, true, 2));
    }
}
