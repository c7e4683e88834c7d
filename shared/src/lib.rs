//! tally's runtime: what every binary needs to run as a well-behaved service, over
//! the pure [`tally_core`].
//!
//! [`snapshot`] (checkpoints of a store kept in an object store, restored instead of
//! replaying the whole log), [`store_name`] (each store's one name: directory,
//! snapshots, restore), [`consume`] (the consuming side of every log processor: bounded batches, positions
//! from the store, paused failed partitions, lag on its own thread), [`store`] (the
//! RocksDB skeleton whose state commits only with its progress), [`announce`] (claims
//! on the shard-owners topic, fenced by epochs), [`claims`] (those claims read into
//! the one table every reader uses), [`lock`] (the one way to take a lock: a
//! poisoned one stops the process), [`membership`] (heartbeats, leases:
//! who owns which partition without Kafka's group protocol), [`follow`] (following a
//! control topic),
//! [`config`] (figment: defaults → TOML → `TALLY__` env, unknown keys rejected),
//! [`telemetry`] (tracing, Prometheus, `/metrics` `/healthz` `/readyz`), [`otel`] (trace
//! contexts in record headers, spans exported over OTLP),
//! [`shutdown`], [`service`], [`kafka`] (client settings, producers that never leave
//! a gap, reading a topic to its end), [`topics`] (declarations and `tally topics
//! apply`), [`progress`] (offsets and high-water stamps kept in a store),
//! [`dedupe`] (idempotency marks that expire by the records' own time), [`outbox`]
//! (relaying what a store wrote with its state), [`failures`] (a partition that
//! fails stops, visibly, until an operator skips), [`auth`] (roles and their
//! tokens: the one auth layer), [`http`] (the one error format), [`read_link`] (tally-query's binary connection to a counter),
//! [`sched`] (short CPU slices for request threads, the default for backlog loops),
//! [`local_broker`] (install/start/stop Tansu) and [`harness`] (how `tally up`, the
//! benchmarks and the e2e kit start services: typed configs, restarts, graceful stops).

pub mod allocator;
pub mod announce;
pub mod auth;
pub mod claims;
pub mod config;
pub mod consume;
pub mod dead_jobs;
pub mod dedupe;
pub mod error;
pub mod failures;
pub mod follow;
pub mod harness;
pub mod http;
pub mod idle;
pub mod kafka;
pub mod lag;
pub mod local_broker;
pub mod lock;
pub mod membership;
pub mod otel;
pub mod outbox;
pub mod progress;
pub mod read_link;
pub mod rest;
pub mod sched;
pub mod schedules;
pub mod service;
pub mod shutdown;
pub mod snapshot;
pub mod store;
pub mod store_name;
pub mod telemetry;
pub mod topic_id;
pub mod topics;

pub use error::{Error, Result};
