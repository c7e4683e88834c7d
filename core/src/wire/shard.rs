//! Shard records: what the ingester and other shards send a counter shard (increments,
//! totals, descendant changes), stamped with their position in their source.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::graph::{DescChange, DescChangeRef};
use crate::keys::Count;
pub use crate::position::{Source, Stamp};
use crate::records::{str_bound, INT_BOUND, WIDE_INT_BOUND};

/// One validated increment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Increment {
    pub entity: String,
    pub metric: String,
    pub delta: i64,
    /// Event time, ms since the epoch.
    pub ts: i64,
    /// The producer's idempotency key.
    pub id: Option<String>,
}

/// The bincode size of a [`Stamp`] at most (an entry's bound holds for both formats
/// of a shard record: [`ShardMessage::encode_increments`]).
pub(super) const STAMP_BOUND: usize = 2 * INT_BOUND;

/// What the shard-record encoders need of an increment, whichever form it has: owned
/// ([`Increment`]) or borrowed from the producer's message ([`IncrementCow`]).
pub trait IncrementFields {
    fn entity(&self) -> &str;
    fn metric(&self) -> &str;
    fn delta(&self) -> i64;
    fn ts(&self) -> i64;
    fn id(&self) -> Option<&str>;

    /// An upper bound of its encoded size with its stamp, in either format of a shard
    /// record, for [`crate::records::split_by_size`].
    fn size_bound(&self) -> usize {
        STAMP_BOUND
            + str_bound(self.entity())
            + str_bound(self.metric())
            + 2 * INT_BOUND
            + 1
            + self.id().map_or(0, str_bound)
    }
}

/// An [`Increment`] borrowing its names from the producer's message where it can (a
/// name with JSON escapes is owned): what the ingester parses and routes without an
/// allocation per name. Encodes exactly as [`Increment`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IncrementCow<'a> {
    pub entity: Cow<'a, str>,
    pub metric: Cow<'a, str>,
    pub delta: i64,
    pub ts: i64,
    pub id: Option<Cow<'a, str>>,
}

impl IncrementCow<'_> {
    pub fn into_owned(self) -> Increment {
        Increment {
            entity: self.entity.into_owned(),
            metric: self.metric.into_owned(),
            delta: self.delta,
            ts: self.ts,
            id: self.id.map(Cow::into_owned),
        }
    }
}

macro_rules! increment_fields {
    ($($form:ty),*) => {$(
        impl IncrementFields for $form {
            fn entity(&self) -> &str {
                &self.entity
            }
            fn metric(&self) -> &str {
                &self.metric
            }
            fn delta(&self) -> i64 {
                self.delta
            }
            fn ts(&self) -> i64 {
                self.ts
            }
            fn id(&self) -> Option<&str> {
                self.id.as_deref()
            }
        }
    )*};
}

increment_fields!(Increment, IncrementCow<'_>);

/// A change to a counter's total made by another shard: `delta` for one bucket of
/// one counter (`width_ms` 0 is all-time). `delta` is a sum of many increments, as
/// wide as a count; bincode writes integers by value, so one that fits in an i64 has
/// the bytes of an i64 field (older records decode unchanged).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TotalDelta {
    pub entity: String,
    pub metric: String,
    pub width_ms: i64,
    pub bucket: i64,
    pub delta: Count,
}

impl TotalDelta {
    /// An upper bound of its encoded size with its stamp.
    pub fn size_bound(&self) -> usize {
        STAMP_BOUND + str_bound(&self.entity) + str_bound(&self.metric) + 2 * INT_BOUND + WIDE_INT_BOUND
    }
}

/// Borrowed [`TotalDelta`]; same encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct TotalDeltaRef<'a> {
    pub entity: &'a str,
    pub metric: &'a str,
    pub width_ms: i64,
    pub bucket: i64,
    pub delta: Count,
}

/// A message on the shard topic, consumed by the counter that owns the partition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ShardMessage {
    /// Increments from one source, in source order.
    Increments { source: Source, entries: Vec<(Stamp, Increment)> },
    /// From `tally-graph`: new descendant sets of origins this shard owns.
    DescChanges { source: Source, entries: Vec<(Stamp, DescChange)> },
    /// From another shard: changes to totals of counters this shard owns.
    Totals { source: Source, entries: Vec<(Stamp, TotalDelta)> },
    /// From the router: each source's stamp up to which it has routed everything
    /// ([`Stamp::through`] a record), with or without entries for this shard; the
    /// receiver's high-water marks move there (what write tokens wait for).
    Marks { marks: Vec<(Source, Stamp)> },
}

/// The borrowed view of a [`ShardMessage`] the counter decodes: strings point into
/// the Kafka payload, so decoding a batch allocates once per message, not per field.
#[derive(Debug, Deserialize)]
pub enum ShardMessageRef<'a> {
    Increments {
        source: Source,
        #[serde(borrow)]
        entries: Vec<(Stamp, IncrementRef<'a>)>,
    },
    DescChanges {
        source: Source,
        #[serde(borrow)]
        entries: Vec<(Stamp, DescChangeRef<'a>)>,
    },
    Totals {
        source: Source,
        #[serde(borrow)]
        entries: Vec<(Stamp, TotalDeltaRef<'a>)>,
    },
    Marks {
        marks: Vec<(Source, Stamp)>,
    },
}

/// Borrowed [`Increment`]; same encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct IncrementRef<'a> {
    pub entity: &'a str,
    pub metric: &'a str,
    pub delta: i64,
    pub ts: i64,
    pub id: Option<&'a str>,
}

impl IncrementRef<'_> {
    pub fn into_owned(self) -> Increment {
        Increment {
            entity: self.entity.to_string(),
            metric: self.metric.to_string(),
            delta: self.delta,
            ts: self.ts,
            id: self.id.map(str::to_string),
        }
    }
}
