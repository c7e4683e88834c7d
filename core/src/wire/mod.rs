//! Messages that travel between tally services, one module per protocol: `shard`
//! records (what a counter shard consumes), `graph` updates, dead `letters`,
//! `rollup`s, `control` records (ownership claims, heartbeats), a counter's `status`
//! and the internal `read` APIs. Every message type is re-exported here.
//!
//! Internal Kafka messages are bincode (`codec`) behind a format header
//! ([`crate::format`]); messages that humans or other systems read — dead letters,
//! rollups, shard ownership, the internal read API — are JSON. Shard records have
//! four encodings, each a leaf that knows none of the others: bincode (version 1),
//! [`compact`] increments (2), [`packed`] with zstd (3) and [`bundle`]s of several
//! sources (4); `shard_codec` alone picks one by version, above them.

pub mod bundle;
mod codec;
pub mod compact;
mod control;
mod graph;
mod letters;
pub mod packed;
mod read;
mod rollup;
mod shard;
mod shard_codec;
mod status;

pub use control::*;
pub use graph::*;
pub use letters::*;
pub use read::*;
pub use rollup::*;
pub use shard::*;
pub use shard_codec::V2_RECORD_OVERHEAD;
pub use status::*;

#[cfg(test)]
mod tests;
