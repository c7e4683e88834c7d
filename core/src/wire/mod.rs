//! Messages that travel between tally services.
//!
//! Internal Kafka messages are bincode (compact and fast) behind a format header
//! ([`crate::format`]), but for shard records of increments: those are encoded in the
//! [`crate::compact`] encoding (format version 2), which an ingester bundles per shard
//! (format version 4, [`crate::bundle`]) and packs with zstd (format version 3,
//! [`crate::packed`]). Messages that humans or other
//! systems read — dead letters, rollups, shard ownership, the internal read API — are
//! JSON.
//!
//! One module per protocol: `shard` records, `graph` updates, dead `letters`,
//! `rollup`s, `control` records (ownership claims, heartbeats), a counter's
//! `status`, and the internal `read` APIs; `codec` is the bincode layer under the
//! binary ones. Every type is re-exported here.

mod codec;
mod control;
mod graph;
mod letters;
mod read;
mod rollup;
mod shard;
mod status;

pub use control::*;
pub use graph::*;
pub use letters::*;
pub use read::*;
pub use rollup::*;
pub use shard::*;
pub use status::*;

#[cfg(test)]
mod tests;
