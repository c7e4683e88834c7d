//! Positions: where a message's content comes from ([`Source`]: an input stream and
//! partition) and where each element sits in it ([`Stamp`]). Every receiver keeps a
//! high-water stamp per source; the stores keep them with their state. [`token`]:
//! the positions writers are handed and readers wait for.

use serde::{Deserialize, Serialize};

/// Where an internal message's content comes from: the input stream and partition.
/// Receivers keep one high-water mark per source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Source {
    /// Which input stream ([`Source::INCREMENTS`]).
    pub stream: u8,
    pub partition: u32,
}

impl Source {
    /// The producer topic `tally.increments` (partition: the input partition).
    pub const INCREMENTS: u8 = 1;
    /// The producer topic `tally.graph` (partition: the input partition).
    pub const GRAPH: u8 = 2;
    /// `tally-graph`'s outbox (partition 0).
    pub const GRAPH_PROCESSOR: u8 = 3;
    /// A counter shard's outbox (partition: the sending shard).
    pub const SHARD: u8 = 4;
}

/// The deterministic position of one element within its source: the input record's
/// offset and the element's index in that record. Replays produce the same stamps,
/// so a receiver drops every stamp at or below its high-water mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    pub offset: i64,
    pub index: u32,
}

pub mod token;
