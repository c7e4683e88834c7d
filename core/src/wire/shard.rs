//! Shard records: what the ingester and other shards send a counter shard (increments,
//! totals, descendant changes), stamped with their position in their source.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::codec::{bincode_config, decode, encode, encode_sized};
use crate::graph::{DescChange, DescChangeRef};
use crate::keys::Count;
use crate::records::{str_bound, INT_BOUND, WIDE_INT_BOUND};
use crate::{Error, Result};

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

/// A change to a counter's total made by another shard: `delta` for one bucket of
/// one counter (`width_ms` 0 is all-time). `delta` is a sum of many increments, as
/// wide as a count; bincode writes integers by value, so one that fits in an i64 has
/// the bytes it had when the field was an i64.
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

/// The deterministic position of one element within its source: the input record's
/// offset and the element's index in that record. Replays produce the same stamps,
/// so a receiver drops every stamp at or below its high-water mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    pub offset: i64,
    pub index: u32,
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

impl<'a> ShardMessageRef<'a> {
    /// Decodes a shard record of format version 1 or 2: increments are written in
    /// version 2 ([`crate::compact`]), everything else in version 1 (bincode). A
    /// version 3 record is unpacked first ([`crate::packed::unpack`]: what it holds
    /// has to live somewhere for the names to borrow from).
    pub fn decode(bytes: &'a [u8]) -> Result<Self> {
        if let [crate::format::RECORD_MAGIC, crate::format::RECORD_V3, ..] = bytes {
            return Err(Error::Format("shard record version 3: decoded only once unpacked".into()));
        }
        refuse_bundle(bytes)?;
        let (version, body) = crate::format::shard_record_body(bytes)?;
        if version == crate::format::RECORD_V2 {
            let (source, entries) = crate::compact::decode_increments(body)?;
            return Ok(ShardMessageRef::Increments { source, entries });
        }
        let (message, used) = bincode::serde::borrow_decode_from_slice(body, bincode_config())
            .map_err(|err| Error::Format(format!("shard record: {err}")))?;
        if used != body.len() {
            return Err(Error::Format(format!("shard record: {} trailing bytes", body.len() - used)));
        }
        Ok(message)
    }

    /// Decodes an unpacked shard record of any version into the messages it holds,
    /// each with its record time: a bundle's sections (version 4, [`crate::bundle`])
    /// with the times they carry, any other record alone with `record_time` (its
    /// Kafka header's).
    pub fn decode_sections(bytes: &'a [u8], record_time: i64) -> Result<Vec<(i64, Self)>> {
        if !crate::bundle::is_bundle(bytes) {
            return Ok(vec![(record_time, Self::decode(bytes)?)]);
        }
        crate::bundle::sections(bytes)?
            .into_iter()
            .map(|(time, section)| {
                let (source, entries) = crate::compact::decode_increments(section)?;
                Ok((time, ShardMessageRef::Increments { source, entries }))
            })
            .collect()
    }
}

/// The most bytes a version 2 record adds to its entries' size bounds
/// ([`ShardMessage::encode_increments`]).
pub const V2_RECORD_OVERHEAD: usize = 32;

/// Fails on a bundle (format 4): it holds several messages, read by
/// [`ShardMessageRef::decode_sections`], never as one.
fn refuse_bundle(bytes: &[u8]) -> Result<()> {
    match crate::bundle::is_bundle(bytes) {
        true => Err(Error::Format("shard record version 4: a bundle, decoded by its sections".into())),
        false => Ok(()),
    }
}

impl ShardMessage {
    pub fn encode(&self) -> Result<Vec<u8>> {
        match self {
            ShardMessage::Increments { source, entries } => {
                Self::encode_increments(*source, entries, crate::format::RECORD_V2)
            }
            other => encode(other),
        }
    }

    /// The bytes of `ShardMessage::Increments { source, entries }` without building
    /// it, so the ingester encodes its entries in place instead of cloning them, in
    /// record format `version`: [`RECORD_V3`](crate::format::RECORD_V3) (version 2
    /// packed with zstd, [`crate::packed`]; what an ingester writes),
    /// [`RECORD_V2`](crate::format::RECORD_V2) (compact, [`crate::compact`]; what
    /// [`ShardMessage::encode`] writes) or [`RECORD_V1`](crate::format::RECORD_V1)
    /// (bincode) — the older two for counters of a release that reads only those,
    /// while an upgrade is under way. None exceeds the entries' size bounds plus 32
    /// bytes (a packed record is never bigger than its version 2 form).
    pub fn encode_increments<T: IncrementFields + Serialize>(
        source: Source,
        entries: &[(Stamp, T)],
        version: u8,
    ) -> Result<Vec<u8>> {
        /// Same shape as [`ShardMessage`] (bincode writes the variant's index, not its name).
        #[derive(Serialize)]
        enum Borrowed<'a, T> {
            Increments { source: Source, entries: &'a [(Stamp, T)] },
        }
        match version {
            crate::format::RECORD_V3 => Ok(crate::packed::pack(crate::compact::encode_increments(source, entries))),
            crate::format::RECORD_V2 => Ok(crate::compact::encode_increments(source, entries)),
            crate::format::RECORD_V1 => {
                let bound: usize = entries.iter().map(|(_, increment)| increment.size_bound()).sum();
                // Header, variant, source and length: well under 32 bytes.
                encode_sized(&Borrowed::Increments { source, entries }, bound + 32)
            }
            other => Err(Error::Wire(format!("shard records have no format version {other}"))),
        }
    }

    /// The bytes of one shard record bundling `records` — version 2 records of
    /// increments ([`Self::encode_increments`]), each with the time of its input
    /// record — in record format version 4 ([`crate::bundle`]), packed into version 3
    /// when that makes it smaller. Never more than the records' lengths plus
    /// [`SECTION_OVERHEAD`](crate::bundle::SECTION_OVERHEAD) each, plus
    /// [`BUNDLE_OVERHEAD`](crate::bundle::BUNDLE_OVERHEAD).
    pub fn bundle(records: &[(i64, Vec<u8>)]) -> Result<Vec<u8>> {
        if records.is_empty() {
            return Err(Error::Wire("a bundle has at least one record".into()));
        }
        if let Some((_, stray)) = records
            .iter()
            .find(|(_, record)| !record.starts_with(&[crate::format::RECORD_MAGIC, crate::format::RECORD_V2]))
        {
            return Err(Error::Wire(format!("a bundle holds version 2 records only, not {:?}", stray.get(..2))));
        }
        Ok(crate::packed::pack(crate::bundle::encode(records)))
    }

    /// Decodes a shard record of any format version into its messages with their
    /// record times ([`ShardMessageRef::decode_sections`], a version 3 record
    /// unpacked first; `record_time` is a record's own when it is not a bundle).
    pub fn decode_sections(bytes: &[u8], record_time: i64) -> Result<Vec<(i64, Self)>> {
        let unpacked = crate::packed::unpack(bytes)?;
        if !crate::bundle::is_bundle(&unpacked) {
            return Ok(vec![(record_time, Self::decode(&unpacked)?)]);
        }
        crate::bundle::sections(&unpacked)?
            .into_iter()
            .map(|(time, section)| {
                let (source, entries) = crate::compact::decode_increments(section)?;
                let entries = entries.into_iter().map(|(stamp, increment)| (stamp, increment.into_owned())).collect();
                Ok((time, ShardMessage::Increments { source, entries }))
            })
            .collect()
    }

    /// Decodes a shard record of any format version but 4 ([`ShardMessageRef::decode`],
    /// a version 3 record unpacked first; a bundle by [`Self::decode_sections`]).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bytes = &crate::packed::unpack(bytes)?[..];
        refuse_bundle(bytes)?;
        match crate::format::shard_record_body(bytes)? {
            (crate::format::RECORD_V2, body) => {
                let (source, entries) = crate::compact::decode_increments(body)?;
                let entries = entries.into_iter().map(|(stamp, increment)| (stamp, increment.into_owned())).collect();
                Ok(ShardMessage::Increments { source, entries })
            }
            _ => decode(bytes, "shard record"),
        }
    }
}
