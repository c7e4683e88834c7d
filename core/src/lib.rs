//! tally's pure core: what the services compute and the formats they keep, with no
//! Kafka, RocksDB or tokio (its dependency list enforces it), proved with property
//! tests against the brute-force [`model`].
//!
//! - [`validate`] (naming rules) and [`input`] (producer JSON → increments, graph
//!   updates or rejections with reasons);
//! - [`time`] (durations, buckets, retention, planning of window and series reads),
//!   [`counting`] (coalescing a batch into per-bucket deltas), [`sharding`];
//! - [`graph`] (the batch algorithm: edge updates → net descendant-set changes) and
//!   [`propagation`] (the rule a shard applies);
//! - [`jobs`]: the job format and a queue partition's buffer; [`assignment`]: which
//!   live member (dequeue broker, counter) owns which partition;
//! - [`format`] (versions of everything kept), [`wire`] (internal messages; shard
//!   records of increments in the [`compact`] encoding),
//!   [`keys`] (RocksDB keys and values), [`records`] (every record fits the broker);
//! - [`rollups`]: what a consumer of the rollups topic keeps (the newest by position);
//! - [`segments`]: segmented counters (an increment's dimensions, their combinations
//!   as segmented metrics, what a segment query selects);
//! - [`model`]: the brute-force model every test compares with;
//! - [`trace`]: the W3C trace context records carry and the spans services report.

pub mod assignment;
pub mod counting;
pub mod error;
pub mod format;
pub mod graph;
pub mod input;
pub mod jobs;
pub mod keys;
pub mod model;
pub mod position;
pub mod propagation;
pub mod records;
pub mod rollups;
pub mod segments;
pub mod sharding;
pub mod time;
pub mod trace;
pub mod validate;
pub mod wire;

pub use error::{Error, Result};
