//! How many merge operands each count key has stacked up since its value was last
//! written whole, so that a batch writes a popular key's sum instead of adding yet
//! another operand.
//!
//! Counts are written as merge operands (the write path reads nothing), and a read
//! of a key collects and sums every operand down to its last whole value. Under a
//! backlog the popular keys, the ones read most, get an operand in every batch:
//! bounding them took batches of 100 reads while ingesting from p50 2.3–2.7 to
//! 1.6–2.0 ms (BENCHMARKS.md, "Merge operands"). RocksDB's own bound
//! (`max_successive_merges`) counts a key's operands with a seek into the memtable at
//! every merge write, a second skiplist search next to the insert's; here the count
//! is a byte in a fixed table indexed by the key's hash, so a write costs a hash.
//!
//! Like RocksDB's, the bound counts a key's operands in the mutable memtable only: the
//! table starts over when the memtable is switched for a new one, so a key written a
//! few times per memtable is never read on the write path (a sum is a read, from the
//! files too). The table only decides when a key is summed, never what a sum is: keys
//! that share a slot are summed sooner (a read each), and the table starts empty when
//! a store opens, so a key may stack up to [`MAX_OPERANDS`] more after a restart.

use std::hash::Hasher;

use rustc_hash::FxHasher;

/// The most merge operands a count key stacks up before the write that would add
/// another writes its sum instead.
pub const MAX_OPERANDS: u8 = 8;

/// Slots of the table: 256 KiB per shard, allocated lazily by the kernel.
const SLOT_BITS: u32 = 18;

/// Operands written per count key (by hash slot) since its value was last summed.
pub struct OperandTally {
    slots: Box<[u8]>,
    /// Entries in the mutable memtable when last told.
    memtable_entries: u64,
}

impl Default for OperandTally {
    fn default() -> Self {
        Self { slots: vec![0; 1 << SLOT_BITS].into_boxed_slice(), memtable_entries: 0 }
    }
}

impl OperandTally {
    /// How many entries the mutable memtable holds now: fewer than when last told
    /// means it was switched for an empty one, and every count starts over.
    pub fn memtable_holds(&mut self, entries: u64) {
        if entries < self.memtable_entries {
            self.slots.fill(0);
        }
        self.memtable_entries = entries;
    }

    /// Counts a write of `key`: true when this write is to store the key's sum (its
    /// stored value plus the write's delta), after which the count starts over;
    /// false when it is to add a merge operand.
    pub fn write_sum(&mut self, key: &[u8]) -> bool {
        let mut hasher = FxHasher::default();
        hasher.write(key);
        // The product's high bits are the well-mixed ones.
        let slot = &mut self.slots[(hasher.finish() >> (64 - SLOT_BITS)) as usize];
        match *slot >= MAX_OPERANDS {
            true => {
                *slot = 0;
                true
            }
            false => {
                *slot += 1;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_stacks_the_bound_then_is_summed_and_starts_over() {
        let mut tally = OperandTally::default();
        let pattern: Vec<bool> = (0..3 * (MAX_OPERANDS as usize + 1)).map(|_| tally.write_sum(b"hot")).collect();
        let mut want = vec![false; MAX_OPERANDS as usize];
        want.push(true);
        assert_eq!(pattern, want.repeat(3));
    }

    #[test]
    fn keys_in_other_slots_count_on_their_own() {
        let mut tally = OperandTally::default();
        for _ in 0..MAX_OPERANDS {
            assert!(!tally.write_sum(b"hot"));
        }
        // Other keys (in other slots: the hash is fixed) have stacked nothing yet.
        let others: Vec<String> = (0..100).map(|n| format!("cold-{n}")).collect();
        let summed: Vec<&String> = others.iter().filter(|key| tally.write_sum(key.as_bytes())).collect();
        assert_eq!(summed, Vec::<&String>::new());
        assert!(tally.write_sum(b"hot"), "the hot key's ninth write is its sum");
    }

    #[test]
    fn counts_start_over_with_a_new_memtable() {
        let mut tally = OperandTally::default();
        tally.memtable_holds(10);
        for _ in 0..MAX_OPERANDS {
            assert!(!tally.write_sum(b"hot"));
        }
        tally.memtable_holds(10 + u64::from(MAX_OPERANDS));
        tally.memtable_holds(3);
        let after: Vec<bool> = (0..=MAX_OPERANDS).map(|_| tally.write_sum(b"hot")).collect();
        let mut want = vec![false; MAX_OPERANDS as usize];
        want.push(true);
        assert_eq!(after, want, "a new memtable: the bound again, from zero");
    }
}
