//! The batches the ingester has sent but not yet committed: each input position is
//! committed once every output record of its batch *and of every batch before it*
//! is acknowledged — in order, never before — while later batches are already being
//! consumed, routed and produced.

use std::collections::{BTreeMap, VecDeque};

/// An input partition: (index of its topic among the inputs, partition).
pub type InputPartition = (usize, i32);

#[derive(Debug)]
struct Batch {
    seq: u64,
    /// Output records not yet acknowledged.
    remaining: usize,
    /// The next offset of every input partition the batch read.
    next: Vec<(InputPartition, i64)>,
}

/// Batches in the order they were sent.
#[derive(Debug, Default)]
pub struct InFlight {
    batches: VecDeque<Batch>,
    next_seq: u64,
    /// Positions of acknowledged batches not yet handed out for a commit.
    committable: BTreeMap<InputPartition, i64>,
}

impl InFlight {
    /// Records a batch that read up to `next` (exclusive) and sent `outputs` records;
    /// returns its sequence number, which every acknowledgement of those records names.
    pub fn open(&mut self, next: Vec<(InputPartition, i64)>, outputs: usize) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.batches.push_back(Batch { seq, remaining: outputs, next });
        self.settle();
        seq
    }

    /// One output record of batch `seq` was acknowledged.
    pub fn acknowledged(&mut self, seq: u64) {
        let Some(front) = self.batches.front() else { return };
        let Some(batch) = self.batches.get_mut(seq.wrapping_sub(front.seq) as usize) else { return };
        debug_assert_eq!(batch.seq, seq);
        batch.remaining = batch.remaining.saturating_sub(1);
        self.settle();
    }

    /// Moves the acknowledged prefix into the committable positions.
    fn settle(&mut self) {
        while self.batches.front().is_some_and(|b| b.remaining == 0) {
            let Some(batch) = self.batches.pop_front() else { break };
            for (partition, next) in batch.next {
                let entry = self.committable.entry(partition).or_insert(next);
                *entry = (*entry).max(next);
            }
        }
    }

    /// The positions safe to commit since the last call (every record before them
    /// acknowledged); empty when there are none.
    pub fn take_committable(&mut self) -> BTreeMap<InputPartition, i64> {
        std::mem::take(&mut self.committable)
    }

    /// Batches sent and not yet wholly acknowledged.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn positions_are_committed_in_order_once_everything_before_is_acknowledged() {
        let mut in_flight = InFlight::default();
        let first = in_flight.open(vec![((0, 0), 10), ((0, 1), 4)], 2);
        let second = in_flight.open(vec![((0, 0), 20)], 1);
        let empty = in_flight.open(vec![((1, 0), 3)], 0);
        in_flight.acknowledged(second);
        assert_eq!(in_flight.take_committable(), BTreeMap::new(), "the first batch is still in flight");
        in_flight.acknowledged(first);
        assert_eq!(in_flight.take_committable(), BTreeMap::new(), "one of its two records is");
        assert_eq!(in_flight.len(), 3);
        in_flight.acknowledged(first);
        assert_eq!(in_flight.take_committable(), BTreeMap::from([((0, 0), 20), ((0, 1), 4), ((1, 0), 3)]));
        assert!(in_flight.is_empty());
        assert_eq!(in_flight.take_committable(), BTreeMap::new(), "handed out once");
        in_flight.acknowledged(empty);
        assert_eq!(in_flight.take_committable(), BTreeMap::new(), "a stray acknowledgement changes nothing");
    }

    /// Whatever order acknowledgements come in, a committed position never passes
    /// an output record that is not acknowledged.
    #[test]
    fn random_acknowledgement_orders_never_commit_past_an_unacknowledged_record() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..200 {
            let mut in_flight = InFlight::default();
            // Batch i reads partition 0 up to (i + 1) * 10 and sends a few records.
            let mut pending: Vec<(u64, usize)> = Vec::new();
            let batches = rng.random_range(1..12);
            for i in 0..batches {
                let outputs = rng.random_range(0..4);
                let seq = in_flight.open(vec![((0, 0), (i as i64 + 1) * 10)], outputs);
                pending.extend((0..outputs).map(|_| (seq, i)));
            }
            pending.shuffle(&mut rng);
            let mut committed = in_flight.take_committable().get(&(0, 0)).copied().unwrap_or(0);
            let mut acknowledged = vec![0usize; batches];
            let mut outputs = vec![0usize; batches];
            for (_, batch) in &pending {
                outputs[*batch] += 1;
            }
            let leading_empty = outputs.iter().take_while(|n| **n == 0).count();
            assert_eq!(committed, leading_empty as i64 * 10, "batches without records commit at once");
            for (seq, batch) in pending {
                in_flight.acknowledged(seq);
                acknowledged[batch] += 1;
                if let Some(next) = in_flight.take_committable().get(&(0, 0)) {
                    assert!(*next > committed, "positions only move forward");
                    committed = *next;
                }
                let done_prefix = (0..batches).take_while(|b| acknowledged[*b] == outputs[*b]).count();
                assert_eq!(committed, done_prefix as i64 * 10, "exactly the acknowledged prefix");
            }
            assert!(in_flight.is_empty());
            assert_eq!(committed, batches as i64 * 10);
        }
    }
}
