//! Code the tally services share.
//!
//! The pure parts — [`validate`], [`input`], [`time`], [`keys`], [`counting`],
//! [`graph`], [`propagation`], [`jobs`] (but its worker library), [`sharding`],
//! [`records`], [`wire`] and the brute-force [`model`] — know nothing of Kafka, RocksDB or tokio
//! and are proved with property tests. The glue — [`config`], [`telemetry`],
//! [`shutdown`], [`service`], [`kafka`], [`outbox`], [`progress`], [`dedupe`], [`topics`],
//! [`jobs::worker`] and [`local_broker`] — is what every binary needs to run as a
//! well-behaved service.

pub mod config;
pub mod counting;
pub mod dedupe;
pub mod error;
pub mod failures;
pub mod format;
pub mod graph;
pub mod http;
pub mod input;
pub mod jobs;
pub mod kafka;
pub mod keys;
pub mod local_broker;
pub mod model;
pub mod outbox;
pub mod progress;
pub mod propagation;
pub mod records;
pub mod service;
pub mod sharding;
pub mod shutdown;
pub mod telemetry;
pub mod time;
pub mod topics;
pub mod validate;
pub mod wire;

pub use error::{Error, Result};
