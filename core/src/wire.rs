//! Messages that travel between tally services.
//!
//! Internal Kafka messages are bincode (compact and fast) behind a format header
//! ([`crate::format`]), but for shard records of increments: those are encoded in the
//! [`crate::compact`] encoding (format version 2), which an ingester bundles per shard
//! (format version 4, [`crate::bundle`]) and packs with zstd (format version 3,
//! [`crate::packed`]). Messages that humans or other
//! systems read — dead letters, rollups, shard ownership, the internal read API — are
//! JSON.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::graph::{DescChange, DescChangeRef, EdgeUpdate};
use crate::keys::Count;
use crate::records::{str_bound, truncate_utf8, Truncated, INT_BOUND, WIDE_INT_BOUND};
use crate::time::WindowSpec;
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
const STAMP_BOUND: usize = 2 * INT_BOUND;

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
}

impl GraphMessage {
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes, "graph-updates record")
    }
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

/// The format header, then the bincode of `value`.
fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    encode_sized(value, 64)
}

/// [`encode`] into a buffer of `capacity` bytes (the encoded size's bound, when known:
/// growing a record of a megabyte copied it several times).
fn encode_sized<T: Serialize>(value: &T, capacity: usize) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(capacity);
    out.extend_from_slice(&crate::format::RECORD_HEADER);
    bincode::serde::encode_into_std_write(value, &mut out, bincode_config())
        .map_err(|err| Error::Wire(err.to_string()))?;
    Ok(out)
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    let body = crate::format::record_body(bytes, what)?;
    let (message, used) = bincode::serde::decode_from_slice(body, bincode_config())
        .map_err(|err| Error::Format(format!("{what}: {err}")))?;
    if used != body.len() {
        return Err(Error::Format(format!("{what}: {} trailing bytes", body.len() - used)));
    }
    Ok(message)
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

fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
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

/// A record of `tally.dead-letter` (SPEC §4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Format version ([`crate::format::JSON_V1`]).
    pub v: u32,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// Position of the element in an array message; absent when the whole message
    /// was rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub reason: String,
    /// The original bytes, base64.
    pub payload: String,
    /// What was cut to fit the record under the broker's limit (`payload`: the
    /// original length in bytes); absent when the payload is whole.
    #[serde(default, skip_serializing_if = "Truncated::is_empty")]
    pub truncated: Truncated,
}

/// The longest reason a dead letter keeps.
const MAX_REASON_BYTES: usize = 1_024;

impl DeadLetter {
    /// The dead letter of `raw` (an element or a whole record at `topic`/`partition`/
    /// `offset`), encoded as JSON in at most `budget` bytes: a payload too big for
    /// that is cut, and the letter says so in `truncated`.
    pub fn encode(
        topic: &str,
        partition: i32,
        offset: i64,
        index: Option<u32>,
        reason: &str,
        raw: &[u8],
        budget: usize,
    ) -> Result<Vec<u8>> {
        let mut letter = DeadLetter {
            v: crate::format::JSON_V1,
            topic: topic.to_string(),
            partition,
            offset,
            index,
            reason: truncate_utf8(reason, MAX_REASON_BYTES).to_string(),
            payload: String::new(),
            truncated: Truncated::new(),
        };
        let json = |letter: &DeadLetter| serde_json::to_vec(letter).map_err(|err| Error::Wire(err.to_string()));
        let whole = base64_len(raw.len());
        // Room for the payload once the rest (and a `truncated` note) is written.
        let rest = json(&letter)?.len() + 64;
        let mut kept = raw.len();
        if rest + whole > budget {
            kept = budget.saturating_sub(rest) / 4 * 3;
            letter.truncated.insert("payload".into(), raw.len());
        }
        letter.payload = Self::payload_of(&raw[..kept.min(raw.len())]);
        json(&letter)
    }

    /// The `payload` field for rejected bytes: base64.
    pub fn payload_of(raw: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(raw)
    }
}

/// The length of `n` bytes in padded base64.
fn base64_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

/// A record of `tally.rollups` (SPEC §4): a bucket's values as its shard held them
/// at `position`. A consumer keeps, per key, the record of the newest position
/// ([`crate::rollups::LatestRollups`]); an expired bucket's last record is a
/// tombstone (no payload) whose position is in its [`ROLLUP_POSITION_HEADER`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollup {
    /// Format version: [`Rollup::V2`] (with a position); version 1 had none.
    pub v: u32,
    pub entity: String,
    pub metric: String,
    /// A resolution name such as `1h`, or `all`.
    pub resolution: String,
    pub bucket: i64,
    pub total: Count,
    pub direct: Count,
    /// Where the shard stood when these values were read (none in version 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<RollupPosition>,
    /// When the bucket expires (ms; none for `all`, and in version 1): from then on
    /// it is gone, whether or not its tombstone has come yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
}

/// The Kafka header of every rollup record, tombstones included: its
/// [`RollupPosition`] as JSON.
pub const ROLLUP_POSITION_HEADER: &str = "tally.position.v1";

/// Where a shard stood when a rollup was read: every record of its shard-topic
/// partition before `offset` applied, none after. A bucket belongs to one shard,
/// whose every owner applies the same log, so of two records of a bucket the one
/// of the higher offset holds the newer values (equal offsets, equal values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RollupPosition {
    pub shard: u32,
    pub offset: i64,
}

impl RollupPosition {
    /// The value of a record's [`ROLLUP_POSITION_HEADER`].
    pub fn header_value(&self) -> Vec<u8> {
        // Two integers: serialising cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes a [`ROLLUP_POSITION_HEADER`] value.
    pub fn from_header(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes).map_err(|err| Error::Format(format!("{ROLLUP_POSITION_HEADER}: {err}")))
    }
}

impl Rollup {
    /// The format version written now.
    pub const V2: u32 = 2;

    /// Decodes a rollup of version 1 (no position) or 2 (with one).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let rollup: Self = serde_json::from_slice(bytes).map_err(|err| Error::Format(format!("rollup: {err}")))?;
        match (rollup.v, rollup.position) {
            (crate::format::JSON_V1, None) | (Self::V2, Some(_)) => Ok(rollup),
            (Self::V2, None) => Err(Error::Format("rollup: version 2 without a position".into())),
            (v, _) => Err(Error::Format(format!("rollup: format version {v}, this build reads versions 1 and 2"))),
        }
    }

    /// The record's key: `entity/metric/resolution/bucket`.
    pub fn key(&self) -> String {
        format!("{}/{}/{}/{}", self.entity, self.metric, self.resolution, self.bucket)
    }
}

/// A counter's claim on a shard, on the shard-owners topic: where to send reads,
/// fenced by its epoch ([`ShardOwner::at_ms`]).
/// `tally-graph` announces its read address on the same topic under
/// [`ShardOwner::GRAPH`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardOwner {
    /// Format version ([`crate::format::JSON_V1`]).
    pub v: u32,
    pub shard: u32,
    /// `host:port` of the owner's internal read API; `None` when it let go of the shard.
    pub addr: Option<String>,
    /// A random id per counter process, to tell owners apart.
    pub instance: String,
    /// The claim's epoch: wall-clock ms when this owner first announced the shard
    /// in its tenure (above every epoch it read for the shard), the same in every
    /// repeat of the claim and in its release. A reader keeps the claim of the
    /// newest epoch (log order between equal ones) and ignores an older one —
    /// unless the shard has no owner (then a stale claim answers `not_owner`) — so a
    /// paused or partitioned owner that comes back cannot take reads back with late
    /// claims or releases (it sends them under the epoch of its lost tenure).
    pub at_ms: i64,
}

impl ShardOwner {
    /// The `shard` of `tally-graph`'s claim.
    pub const GRAPH: u32 = u32::MAX;

    /// A claim of the current format.
    pub fn new(shard: u32, addr: Option<String>, instance: String, at_ms: i64) -> Self {
        Self { v: crate::format::JSON_V1, shard, addr, instance, at_ms }
    }

    /// Decodes a claim of the current format.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        crate::format::decode_json(bytes, "shard-owner claim", |claim: &Self| claim.v)
    }

    /// Whether this claim, read after `current` (the claim held for its shard: whether
    /// it names an owner, and its epoch), replaces it: one of the same or a newer
    /// epoch does; an older one only when the shard has no owner.
    pub fn replaces(&self, current: Option<(bool, i64)>) -> bool {
        current.is_none_or(|(owned, epoch)| !owned || self.at_ms >= epoch)
    }
}

/// What a counter holds and how fresh it is (`GET /internal/v1/status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterStatus {
    pub shards: Vec<ShardStatus>,
}

/// One held shard of a counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardStatus {
    pub shard: u32,
    pub state: ShardState,
    /// Records of the shard's log not applied yet, when last measured (about once
    /// a second), and when.
    pub lag: Option<i64>,
    pub lag_at_ms: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardState {
    /// Caught up with the log and answering reads.
    Serving,
    /// Newly taken: applying the log up to where it ended at assignment.
    CatchingUp,
    /// Stopped by a failure until an operator acts.
    Failed,
}

/// A member's heartbeat on a membership topic: dequeue brokers on `queue-brokers`,
/// counters on `counter-members` (`tally_shared::membership`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Format version ([`crate::format::JSON_V1`]).
    pub v: u32,
    pub instance: String,
    /// `host:port` where it is reached (a broker's worker API, a counter's read API).
    pub addr: String,
    pub at_ms: i64,
    /// Sent once on a clean stop: hand its partitions over at once.
    #[serde(default)]
    pub leaving: bool,
}

impl Heartbeat {
    /// A heartbeat of the current format.
    pub fn new(instance: String, addr: String, at_ms: i64, leaving: bool) -> Self {
        Self { v: crate::format::JSON_V1, instance, addr, at_ms, leaving }
    }

    /// Decodes a heartbeat of the current format.
    pub fn decode(bytes: &[u8]) -> crate::Result<Self> {
        crate::format::decode_json(bytes, "member heartbeat", |beat: &Self| beat.v)
    }
}

/// `kind` of a read (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    #[default]
    Total,
    Direct,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Total => "total",
            Kind::Direct => "direct",
        }
    }
}

/// One question to a counter shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardQuery {
    pub entity: String,
    pub metric: String,
    pub kind: Kind,
    pub spec: WindowSpec,
}

/// The internal read API tally-query uses: the questions for every shard one
/// counter owns, in one request (a batch of 100 over 8 shards is one round trip, not
/// eight). Each shard is answered from one snapshot of its store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    /// The clock of the request, so every answer of a batch uses the same `now`.
    pub now_ms: i64,
    pub shards: Vec<ShardQueries>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardQueries {
    pub shard: u32,
    pub queries: Vec<ShardQuery>,
}

/// One outcome per shard asked, in request order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadResponse {
    pub shards: Vec<ShardOutcome>,
}

impl ReadRequest {
    /// The binary form the read link carries (`tally_shared::read_link`): the
    /// record header ([`crate::format`], version 1), then bincode.
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes, "read request")
    }
}

impl ReadResponse {
    /// The binary form the read link carries, as [`ReadRequest::encode`].
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes, "read response")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardOutcome {
    /// Answers in the order of the shard's queries.
    Answers { answers: Vec<ShardAnswer> },
    /// Not served here now (another owner, catching up, lease lapsed): ask the owner
    /// of a newer claim.
    NotOwner,
    /// Stopped by a failure until an operator acts.
    Failed { message: String },
    /// Could not be read now (a storage error).
    Unavailable { message: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardAnswer {
    Window { value: Count, resolution: String, from: i64, to: i64 },
    Series { resolution: String, points: Vec<(i64, Count)> },
    Error { code: String, message: String },
}

/// The internal metrics-listing API of a shard.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardMetricsRequest {
    pub shard: u32,
    pub entity: String,
    /// List metrics strictly after this one.
    pub after: Option<String>,
    pub limit: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricTotals {
    pub metric: String,
    pub total: Count,
    pub direct: Count,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardMetricsResponse {
    pub metrics: Vec<MetricTotals>,
    /// Whether more metrics follow the last one returned.
    pub more: bool,
}

/// The internal neighbours API of `tally-graph`: one page of an entity's direct
/// neighbours, sorted, strictly after `after`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphNeighboursRequest {
    pub entity: String,
    /// Out-edges (`descendants` direction) when true, in-edges otherwise.
    pub outgoing: bool,
    pub after: Option<String>,
    pub limit: usize,
}

/// `tally-graph`'s ancestors of an entity (`POST /internal/v1/graph/ancestors`):
/// every entity that reaches it, sorted, at most `limit` (`more` says when there are
/// more). Answered with a [`GraphNeighboursResponse`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphAncestorsRequest {
    pub entity: String,
    /// At most [`GraphAncestorsRequest::MAX_LIMIT`].
    pub limit: usize,
}

impl GraphAncestorsRequest {
    /// The longest walk `tally-graph` takes for one request (a contributors listing
    /// ranks at most this many ancestors).
    pub const MAX_LIMIT: usize = 100_000;
}

impl GraphNeighboursRequest {
    /// The largest page of neighbours `tally-graph` answers.
    pub const MAX_LIMIT: usize = 1_000;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphNeighboursResponse {
    pub entities: Vec<String>,
    /// Whether more neighbours follow the last one returned.
    pub more: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn shard_messages_round_trip(
            partition in any::<u32>(),
            entries in proptest::collection::vec(
                (any::<i64>(), any::<u32>(), "\\PC{1,20}", "[a-z]{1,8}", any::<i64>(), any::<i64>(), proptest::option::of("[a-z0-9]{1,10}")),
                0..20,
            ),
        ) {
            let message = ShardMessage::Increments {
                source: Source { stream: Source::INCREMENTS, partition },
                entries: entries.into_iter().map(|(offset, index, entity, metric, delta, ts, id)| {
                    (Stamp { offset, index }, Increment { entity, metric, delta, ts, id })
                }).collect(),
            };
            let bytes = message.encode().unwrap();
            let ShardMessageRef::Increments { source, entries } = ShardMessageRef::decode(&bytes).unwrap() else {
                panic!("decoded another variant");
            };
            let ShardMessage::Increments { source: want_source, entries: want } = &message else { unreachable!() };
            prop_assert_eq!(&source, want_source);
            prop_assert_eq!(entries.len(), want.len());
            for ((stamp, got), (want_stamp, want)) in entries.iter().zip(want) {
                prop_assert_eq!(stamp, want_stamp);
                prop_assert_eq!((got.entity, got.metric, got.delta, got.ts, got.id), (want.entity.as_str(), want.metric.as_str(), want.delta, want.ts, want.id.as_deref()));
            }
            prop_assert_eq!(ShardMessage::decode(&bytes).unwrap(), message);
        }
    }

    #[test]
    fn graph_and_totals_messages_round_trip_borrowed() {
        let source = Source { stream: Source::SHARD, partition: 3 };
        let delta = TotalDelta {
            entity: "user:7".into(),
            metric: "views".into(),
            width_ms: 60_000,
            bucket: -60_000,
            delta: -4,
        };
        let totals = ShardMessage::Totals { source, entries: vec![(Stamp { offset: 9, index: 2 }, delta)] };
        let bytes = totals.encode().unwrap();
        assert_eq!(ShardMessage::decode(&bytes).unwrap(), totals);
        let Ok(ShardMessageRef::Totals { entries, .. }) = ShardMessageRef::decode(&bytes) else { panic!("totals") };
        assert_eq!((entries[0].1.entity, entries[0].1.bucket, entries[0].1.delta), ("user:7", -60_000, -4));

        let change = DescChange { origin: "a".into(), added: vec!["b".into()], removed: vec![] };
        let changes =
            ShardMessage::DescChanges { source, entries: vec![(Stamp { offset: 1, index: 0 }, change.clone())] };
        let bytes = changes.encode().unwrap();
        let Ok(ShardMessageRef::DescChanges { entries, .. }) = ShardMessageRef::decode(&bytes) else {
            panic!("changes")
        };
        assert_eq!(entries[0].1.clone().into_owned(), change);

        let edge = EdgeUpdate { op: crate::graph::EdgeOp::Remove, from: "a".into(), to: "b".into() };
        let graph = GraphMessage::Updates {
            source,
            entries: vec![(Stamp { offset: 1, index: 0 }, GraphUpdate { edge, id: None })],
        };
        assert_eq!(GraphMessage::decode(&graph.encode().unwrap()).unwrap(), graph);
    }

    #[test]
    fn sections_of_several_sources_read_back_with_their_times() {
        let increment =
            |entity: &str, ts| Increment { entity: entity.into(), metric: "m".into(), delta: 1, ts, id: None };
        let first: Vec<(Stamp, Increment)> =
            (0..300).map(|i| (Stamp { offset: 10 + i / 3, index: i as u32 % 3 }, increment("a", 5))).collect();
        let second = vec![(Stamp { offset: 4, index: 0 }, increment("b", 6))];
        let (p0, p5) =
            (Source { stream: Source::INCREMENTS, partition: 0 }, Source { stream: Source::INCREMENTS, partition: 5 });
        let v2 = |source, entries: &[(Stamp, Increment)]| {
            ShardMessage::encode_increments(source, entries, crate::format::RECORD_V2).unwrap()
        };
        let sections = [(100, v2(p0, &first)), (90, v2(p5, &second))];
        let bytes = ShardMessage::bundle(&sections).unwrap();
        assert_eq!(bytes[..2], [crate::format::RECORD_MAGIC, crate::format::RECORD_V3], "packed: it shrinks");
        let want = vec![
            (100, ShardMessage::Increments { source: p0, entries: first.clone() }),
            (90, ShardMessage::Increments { source: p5, entries: second.clone() }),
        ];
        assert_eq!(ShardMessage::decode_sections(&bytes, 7).unwrap(), want);
        let unpacked = crate::packed::unpack(&bytes).unwrap();
        let borrowed = ShardMessageRef::decode_sections(&unpacked, 7).unwrap();
        let summary: Vec<(i64, u32, usize)> = borrowed
            .iter()
            .map(|(time, message)| match message {
                ShardMessageRef::Increments { source, entries } => (*time, source.partition, entries.len()),
                _ => (*time, u32::MAX, 0),
            })
            .collect();
        assert_eq!(summary, vec![(100, 0, 300), (90, 5, 1)]);
        // A bundle is only read by its sections; any other record is one message with
        // the time it is given.
        assert!(ShardMessageRef::decode(&unpacked).unwrap_err().to_string().contains("a bundle"));
        assert!(ShardMessage::decode(&bytes).unwrap_err().to_string().contains("a bundle"));
        let single = ShardMessage::Increments { source: p5, entries: second };
        assert_eq!(ShardMessage::decode_sections(&single.encode().unwrap(), 7).unwrap(), vec![(7, single)]);
        assert!(ShardMessage::bundle(&[]).is_err());
        let packed = ShardMessage::encode_increments(p5, &first, crate::format::RECORD_V3).unwrap();
        assert!(ShardMessage::bundle(&[(1, packed)]).unwrap_err().to_string().contains("version 2 records only"));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(ShardMessage::decode(&[0xff; 7]).is_err());
        assert!(ShardMessage::decode(&[]).is_err());
        let mut bytes =
            ShardMessage::Increments { source: Source { stream: 1, partition: 0 }, entries: vec![] }.encode().unwrap();
        bytes.push(0);
        assert!(ShardMessage::decode(&bytes).is_err());
    }

    #[test]
    fn size_bounds_hold_for_encoded_messages() {
        let source = Source { stream: Source::INCREMENTS, partition: u32::MAX };
        let entries: Vec<(Stamp, Increment)> = (0..50)
            .map(|i| {
                // Every name new, every difference as wide as it gets (offsets and
                // times swing between the extremes): the compact format's worst case.
                let extreme = if i % 2 == 0 { i64::MIN } else { i64::MAX };
                let increment = Increment {
                    entity: "é".repeat(i * 3),
                    metric: "m".repeat(i),
                    delta: i64::MIN,
                    ts: extreme,
                    id: (i % 2 == 0).then(|| "x".repeat(i)),
                };
                (Stamp { offset: extreme, index: u32::MAX }, increment)
            })
            .collect();
        let bound: usize = entries.iter().map(|(_, inc)| inc.size_bound()).sum();
        let encoded = ShardMessage::encode_increments(source, &entries, crate::format::RECORD_V2).unwrap();
        assert!(encoded.len() <= bound + 32, "{} > {bound}", encoded.len());
        let v1 = ShardMessage::encode_increments(source, &entries, crate::format::RECORD_V1).unwrap();
        assert!(v1.len() <= bound + 32, "{} > {bound}", v1.len());
        assert_eq!(v1[..2], crate::format::RECORD_HEADER);
        assert_eq!(ShardMessage::decode(&v1).unwrap(), ShardMessage::decode(&encoded).unwrap());
        let v3 = ShardMessage::encode_increments(source, &entries, crate::format::RECORD_V3).unwrap();
        assert!(v3.len() <= encoded.len(), "{} > {}", v3.len(), encoded.len());
        assert_eq!(ShardMessage::decode(&v3).unwrap(), ShardMessage::decode(&encoded).unwrap());
        assert!(ShardMessage::encode_increments(source, &entries, 4).is_err());
        // A bundle of such records (times as wide as they get, and packing that
        // cannot shrink them much) stays within their lengths and the overheads.
        let halves = entries.split_at(25);
        let sections = [
            (i64::MIN, ShardMessage::encode_increments(source, halves.0, crate::format::RECORD_V2).unwrap()),
            (i64::MAX, ShardMessage::encode_increments(source, halves.1, crate::format::RECORD_V2).unwrap()),
        ];
        let bundle = ShardMessage::bundle(&sections).unwrap();
        let bound: usize =
            sections.iter().map(|(_, record)| record.len() + crate::bundle::SECTION_OVERHEAD).sum::<usize>()
                + crate::bundle::BUNDLE_OVERHEAD;
        assert!(bundle.len() <= bound, "{} > {bound}", bundle.len());
        let unpacked = crate::packed::unpack(&bundle).unwrap();
        assert!(unpacked.len() <= bound, "{} > {bound}", unpacked.len());
        // The borrowed form the ingester routes encodes to the same bytes.
        let borrowed: Vec<(Stamp, IncrementCow<'_>)> = entries
            .iter()
            .map(|(stamp, inc)| {
                let cow = IncrementCow {
                    entity: Cow::Borrowed(inc.entity.as_str()),
                    metric: Cow::Owned(inc.metric.clone()),
                    delta: inc.delta,
                    ts: inc.ts,
                    id: inc.id.as_deref().map(Cow::Borrowed),
                };
                assert_eq!(cow.size_bound(), inc.size_bound());
                (*stamp, cow)
            })
            .collect();
        assert_eq!(ShardMessage::encode_increments(source, &borrowed, crate::format::RECORD_V2).unwrap(), encoded);
        assert_eq!(ShardMessage::encode_increments(source, &borrowed, crate::format::RECORD_V1).unwrap(), v1);
        assert_eq!(borrowed.into_iter().map(|(s, c)| (s, c.into_owned())).collect::<Vec<_>>(), entries);

        let change = DescChange {
            origin: "o".into(),
            added: (0..3_000).map(|i| format!("added-{i:0>40}")).collect(),
            removed: (0..1_000).map(|i| format!("removed-{i:0>40}")).collect(),
        };
        let pieces = split_desc_change(change.clone(), 20_000);
        assert!(pieces.len() > 5);
        let mut added: Vec<String> = pieces.iter().flat_map(|p| p.added.clone()).collect();
        let mut removed: Vec<String> = pieces.iter().flat_map(|p| p.removed.clone()).collect();
        added.sort();
        removed.sort();
        assert_eq!((added, removed), (change.added.clone(), change.removed.clone()));
        for piece in &pieces {
            let message =
                ShardMessage::DescChanges { source, entries: vec![(Stamp { offset: 1, index: 1 }, piece.clone())] };
            assert!(message.encode().unwrap().len() <= 20_000 + 32);
            assert!(desc_change_bound(piece) <= 20_000);
        }
    }

    #[test]
    fn dead_letters_fit_the_budget_and_say_what_was_cut() {
        use base64::Engine;
        let raw = vec![b'x'; 800_000];
        let bytes = DeadLetter::encode("t.increments", 3, 9, None, "not json", &raw, 500_000).unwrap();
        assert!(bytes.len() <= 500_000, "{}", bytes.len());
        let letter: DeadLetter = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(letter.truncated, Truncated::from([("payload".to_string(), 800_000)]));
        let kept = base64::engine::general_purpose::STANDARD.decode(&letter.payload).unwrap();
        assert!(kept.len() > 300_000 && raw.starts_with(&kept), "{}", kept.len());

        let small = DeadLetter::encode("t.increments", 3, 9, Some(2), "bad", b"{}", 500_000).unwrap();
        let letter: DeadLetter = serde_json::from_slice(&small).unwrap();
        assert!(letter.truncated.is_empty());
        assert_eq!(base64::engine::general_purpose::STANDARD.decode(&letter.payload).unwrap(), b"{}");
        assert!(!String::from_utf8(small).unwrap().contains("truncated"));
    }

    #[test]
    fn stamps_order_by_offset_then_index() {
        assert!(Stamp { offset: 1, index: 9 } < Stamp { offset: 2, index: 0 });
        assert!(Stamp { offset: 2, index: 0 } < Stamp { offset: 2, index: 1 });
    }

    /// Counts past an i64 travel exactly, in bincode and in JSON; a count within an
    /// i64 keeps the bytes it had when these fields were i64s.
    #[test]
    fn wide_counts_travel_exactly() {
        let wide: Count = (1 << 65) + 7;
        let response = ReadResponse {
            shards: vec![ShardOutcome::Answers {
                answers: vec![
                    ShardAnswer::Window { value: -wide, resolution: "all".into(), from: 0, to: 9 },
                    ShardAnswer::Series { resolution: "1h".into(), points: vec![(0, wide), (1, 2)] },
                ],
            }],
        };
        assert_eq!(ReadResponse::decode(&response.encode().unwrap()).unwrap(), response);
        let json = serde_json::to_string(&response).unwrap();
        assert!(json.contains("-36893488147419103239"), "{json}");
        assert_eq!(serde_json::from_str::<ReadResponse>(&json).unwrap(), response);

        #[derive(Serialize)]
        struct Narrow {
            entity: String,
            metric: String,
            width_ms: i64,
            bucket: i64,
            delta: i64,
        }
        for delta in [0, -1, 300, i64::MIN, i64::MAX] {
            let narrow = Narrow { entity: "e".into(), metric: "m".into(), width_ms: 60_000, bucket: 5, delta };
            let total =
                TotalDelta { entity: "e".into(), metric: "m".into(), width_ms: 60_000, bucket: 5, delta: delta.into() };
            assert_eq!(encode(&total).unwrap(), encode(&narrow).unwrap(), "{delta}");
        }
        let total = TotalDelta { entity: "e".into(), metric: "m".into(), width_ms: 0, bucket: 0, delta: -wide };
        assert!(encode(&total).unwrap().len() <= 2 + total.size_bound());
        assert_eq!(decode::<TotalDelta>(&encode(&total).unwrap(), "total").unwrap(), total);
    }
}
