//! How many merge operands each count key has stacked up since its value was last
//! written whole, so that a batch writes a popular key's sum instead of adding yet
//! another operand.
//!
//! Counts are written as merge operands (the write path reads nothing), and a read
//! of a key collects and sums every operand down to its last whole value. Under a
//! backlog the popular keys, the ones read most, get an operand in every batch:
//! bounded, batches of 100 reads while ingesting answer sooner (BENCHMARKS.md,
//! "Reads"). RocksDB's own bound
//! (`max_successive_merges`) counts a key's operands with a seek into the memtable at
//! every merge write, a second skiplist search next to the insert's; here the count
//! is a slot of a fixed table indexed by the key's hash, so a write costs a hash.
//!
//! A write batch writes each count key once (its increments coalesced), so a key has
//! at most one operand per batch. A slot therefore counts the *batches* that wrote
//! any of its keys, once each, not the writes: however many keys share it, none has
//! stacked more operands than its slot counted, and a batch of millions of distinct
//! keys (a uniform backlog) counts each slot once and reads none of them (a slot
//! counting writes would fill up within such a batch, and turn the rest of its writes
//! into reads of cold keys).
//!
//! Like RocksDB's, the bound counts a key's operands in the mutable memtable only: the
//! table starts over when the memtable is switched for a new one, so a key written a
//! few times per memtable is never read on the write path (a sum is a read, from the
//! files too). Once a slot has counted [`MAX_OPERANDS`] batches, every write of a
//! key in it in a later batch is a sum until the memtable is switched: whichever keys
//! share a slot, none stacks more than the bound in the memtable (a count that started
//! over at each sum could land every sum on one key and leave another unbounded). A
//! hot key's sums then read it from the memtable, where its last value is, much as
//! RocksDB's seek did.
//!
//! The table only decides when a key is summed, never what a sum is. It is
//! approximate: the memtable is seen switched between batches (a batch that fills one
//! may add an operand or so past the bound), a flushed memtable followed by a bigger
//! batch goes unseen (keys are then summed sooner), and the table starts empty when a
//! store opens, so a key may stack up to the bound more after a restart. A sum of a
//! stored value that does not decode fails its batch; the slot stays full, so the
//! batch fails again when retried, until the memtable is switched (the merge operand
//! written then makes every read of the key fail instead: never a zero).

use std::hash::Hasher;

use rustc_hash::FxHasher;

/// The most merge operands a count key stacks up before the write that would add
/// another writes its sum instead.
pub const MAX_OPERANDS: u8 = 8;

/// Slots of the table: 1 MiB per shard, allocated lazily by the kernel.
const SLOT_BITS: u32 = 18;

/// A slot's low byte: the batches it counted; the rest: the last batch it counted.
const COUNT_BITS: u32 = 8;
const COUNT_MASK: u32 = (1 << COUNT_BITS) - 1;
/// Batch numbers wrap after this many (then every slot's last batch is forgotten).
const BATCHES: u32 = 1 << (32 - COUNT_BITS);

/// Write batches counted per count key's slot since the key was last summed.
pub struct OperandTally {
    slots: Box<[u32]>,
    /// The number of the write batch being counted, 1 and up (a slot's 0: none).
    batch: u32,
    /// Entries in the mutable memtable when last told.
    memtable_entries: u64,
}

impl Default for OperandTally {
    fn default() -> Self {
        Self { slots: vec![0; 1 << SLOT_BITS].into_boxed_slice(), batch: 1, memtable_entries: 0 }
    }
}

impl OperandTally {
    /// A new write batch begins: each slot counts it once, whatever its keys.
    pub fn begin_batch(&mut self) {
        self.batch += 1;
        if self.batch == BATCHES {
            // Numbers wrap: a slot counted long ago must not pass for this batch's.
            // Its count stays; its last batch becomes none (0).
            self.slots.iter_mut().for_each(|slot| *slot &= COUNT_MASK);
            self.batch = 1;
        }
    }

    /// How many entries the mutable memtable holds now: fewer than when last told
    /// means it was switched for an empty one, and every count starts over.
    pub fn memtable_holds(&mut self, entries: u64) {
        if entries < self.memtable_entries {
            self.slots.fill(0);
        }
        self.memtable_entries = entries;
    }

    /// Counts a write of `key` in the current batch: true when this write is to store
    /// the key's sum (its stored value plus the write's delta), false when it is to
    /// add a merge operand.
    pub fn write_sum(&mut self, key: &[u8]) -> bool {
        let mut hasher = FxHasher::default();
        hasher.write(key);
        // The product's high bits are the well-mixed ones.
        let slot = &mut self.slots[(hasher.finish() >> (64 - SLOT_BITS)) as usize];
        let (last, counted) = (*slot >> COUNT_BITS, *slot & COUNT_MASK);
        if last == self.batch {
            return false; // counted for this batch already, by another of its keys
        }
        if counted >= u32::from(MAX_OPERANDS) {
            return true;
        }
        *slot = (self.batch << COUNT_BITS) | (counted + 1);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_stacks_the_bound_then_every_write_is_a_sum() {
        let mut tally = OperandTally::default();
        let pattern: Vec<bool> = (0..3 * (MAX_OPERANDS as usize + 1))
            .map(|_| {
                tally.begin_batch();
                tally.write_sum(b"hot")
            })
            .collect();
        let mut want = vec![false; MAX_OPERANDS as usize];
        want.resize(pattern.len(), true);
        assert_eq!(pattern, want);
    }

    /// Two keys forced into one slot (the same hash bits are what a shared slot is).
    #[test]
    fn keys_sharing_a_slot_never_stack_more_than_the_bound_between_them() {
        let mut tally = OperandTally::default();
        let (a, b) = shared_slot_pair();
        // `a` in every round, `b` every other: a count that started over at each sum
        // would land every ninth write on `b` and never sum `a`.
        let mut stacked = [0u32; 2];
        for round in 0..200 {
            tally.begin_batch();
            for (n, key) in [(0, &a), (1, &b)] {
                if n == 1 && round % 2 == 1 {
                    continue;
                }
                match tally.write_sum(key.as_bytes()) {
                    true => stacked[n] = 0,
                    false => stacked[n] += 1,
                }
                assert!(stacked[n] <= u32::from(MAX_OPERANDS), "round {round}: {stacked:?}");
            }
        }
        assert_eq!(stacked, [0, 0], "both are summed at every write now");
    }

    /// Two distinct keys whose hashes fall in the same slot.
    fn shared_slot_pair() -> (String, String) {
        let slot = |key: &str| {
            let mut hasher = FxHasher::default();
            hasher.write(key.as_bytes());
            hasher.finish() >> (64 - SLOT_BITS)
        };
        let mut seen = std::collections::HashMap::new();
        for n in 0.. {
            let key = format!("user:{n}");
            if let Some(other) = seen.insert(slot(&key), key.clone()) {
                return (other, key);
            }
        }
        unreachable!()
    }

    #[test]
    fn keys_in_other_slots_count_on_their_own() {
        let mut tally = OperandTally::default();
        for _ in 0..MAX_OPERANDS {
            tally.begin_batch();
            assert!(!tally.write_sum(b"hot"));
        }
        // Other keys (in other slots: the hash is fixed) have stacked nothing yet.
        let others: Vec<String> = (0..100).map(|n| format!("cold-{n}")).collect();
        let summed: Vec<&String> = others.iter().filter(|key| tally.write_sum(key.as_bytes())).collect();
        assert_eq!(summed, Vec::<&String>::new());
        tally.begin_batch();
        assert!(tally.write_sum(b"hot"), "the hot key's ninth write is its sum");
    }

    #[test]
    fn counts_start_over_with_a_new_memtable() {
        let mut tally = OperandTally::default();
        tally.memtable_holds(10);
        for _ in 0..MAX_OPERANDS {
            tally.begin_batch();
            assert!(!tally.write_sum(b"hot"));
        }
        tally.memtable_holds(10 + u64::from(MAX_OPERANDS));
        tally.memtable_holds(3);
        let after: Vec<bool> = (0..=MAX_OPERANDS)
            .map(|_| {
                tally.begin_batch();
                tally.write_sum(b"hot")
            })
            .collect();
        let mut want = vec![false; MAX_OPERANDS as usize];
        want.push(true);
        assert_eq!(after, want, "a new memtable: the bound again, from zero");
    }

    /// A batch writes each key once: a slot counts the batch once, however many of
    /// its keys the batch writes, so a batch of more distinct keys than the table
    /// holds writes no sum, and the batches after it stack to the bound as before.
    #[test]
    fn a_batch_of_many_distinct_keys_counts_each_slot_once() {
        let mut tally = OperandTally::default();
        let keys: Vec<String> = (0..(MAX_OPERANDS as usize + 2) << SLOT_BITS).map(|n| format!("user:{n}")).collect();
        tally.begin_batch();
        let summed = keys.iter().filter(|key| tally.write_sum(key.as_bytes())).count();
        assert_eq!(summed, 0, "one batch: one operand per key at most");
        for batch in 1..MAX_OPERANDS {
            tally.begin_batch();
            assert!(!tally.write_sum(b"user:0"), "batch {batch}");
        }
        tally.begin_batch();
        assert!(tally.write_sum(b"user:0"), "its slot counted the bound's batches");
    }

    /// Batch numbers wrap: a slot counted in the batch that had the new batch's
    /// number counts it again, and keeps what it counted.
    #[test]
    fn wrapped_batch_numbers_count_again_and_keep_the_counts() {
        let mut tally = OperandTally { batch: BATCHES - MAX_OPERANDS as u32, ..OperandTally::default() };
        for _ in 1..MAX_OPERANDS {
            tally.begin_batch();
            assert!(!tally.write_sum(b"hot"));
        }
        tally.batch = 0;
        tally.begin_batch(); // batch 1, the number before the wrap's first
        assert!(!tally.write_sum(b"hot"), "the bound's last operand");
        tally.batch = BATCHES - 1;
        tally.begin_batch(); // wraps to 1 again
        assert!(tally.write_sum(b"hot"), "counted the bound's batches: a sum, not a batch 1 already counted");
    }
}
