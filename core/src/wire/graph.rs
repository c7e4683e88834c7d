//! Graph updates: what the ingester sends `tally-graph`, and how a descendant change
//! is bounded and split to fit a record.

use serde::{Deserialize, Serialize};

use super::codec::{decode, encode};
use super::shard::{Source, Stamp, STAMP_BOUND};
use crate::graph::{DescChange, EdgeUpdate};
use crate::records::{str_bound, INT_BOUND};
use crate::Result;

/// One validated graph update with the producer's idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphUpdate {
    pub edge: EdgeUpdate,
    pub id: Option<String>,
}

impl GraphUpdate {
    /// An upper bound of its encoded size with its stamp.
    pub fn size_bound(&self) -> usize {
        STAMP_BOUND
            + INT_BOUND
            + str_bound(&self.edge.from)
            + str_bound(&self.edge.to)
            + 1
            + self.id.as_deref().map_or(0, str_bound)
    }
}

/// An upper bound of a descendant change's encoded size with its stamp.
pub fn desc_change_bound(change: &DescChange) -> usize {
    let names = |list: &[String]| INT_BOUND + list.iter().map(|n| str_bound(n)).sum::<usize>();
    STAMP_BOUND + str_bound(&change.origin) + names(&change.added) + names(&change.removed)
}

/// Splits a descendant change whose encoding would exceed `budget` into several
/// changes of the same origin. Applied one after the other they do what the whole
/// change does: `added` and `removed` are disjoint, and each piece moves the
/// origin's counts into (out of) its own part of them.
pub fn split_desc_change(change: DescChange, budget: usize) -> Vec<DescChange> {
    if desc_change_bound(&change) <= budget {
        return vec![change];
    }
    let room = budget.saturating_sub(STAMP_BOUND + str_bound(&change.origin) + 2 * INT_BOUND).max(1);
    let mut pieces = Vec::new();
    for (list, added) in [(&change.added, true), (&change.removed, false)] {
        for run in crate::records::split_by_size(list, room, |name| str_bound(name)) {
            let (added, removed) = if added { (run.to_vec(), vec![]) } else { (vec![], run.to_vec()) };
            pieces.push(DescChange { origin: change.origin.clone(), added, removed });
        }
    }
    pieces
}

/// A message on the internal graph-updates topic, consumed by `tally-graph`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GraphMessage {
    /// Graph updates from one source, in source order.
    Updates { source: Source, entries: Vec<(Stamp, GraphUpdate)> },
    /// From the router: each source's stamp up to which it has routed everything
    /// ([`Stamp::through`] a record); the graph's high-water marks move there.
    Marks { marks: Vec<(Source, Stamp)> },
}

impl GraphMessage {
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes, "graph-updates record")
    }
}
