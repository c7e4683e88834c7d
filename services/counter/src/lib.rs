//! `tally-counter`: owns counter shards, applies their increments to RocksDB exactly
//! once, serves reads for them and publishes rollups.

pub mod apply;
pub mod error;
pub mod read;
pub mod store;

pub use error::{Error, Result};
