//! The one place that knows every encoding of a shard record and picks one by its
//! version: version 1 (bincode, [`super::codec`]), 2 (increments, compact:
//! [`super::compact`]), 3 (2 packed with zstd: [`super::packed`]) and 4 (several
//! sources' version 2 records bundled: [`super::bundle`]). The leaf encodings know
//! nothing of each other; the rest of tally decodes and encodes through here.

use serde::Serialize;

use super::codec::{bincode_config, decode, encode, encode_sized};
use super::shard::{IncrementFields, ShardMessage, ShardMessageRef, Source, Stamp};
use super::{bundle, compact, packed};
use crate::format::{self, RECORD_MAGIC, RECORD_V1, RECORD_V2, RECORD_V3};
use crate::{Error, Result};

impl<'a> ShardMessageRef<'a> {
    /// Decodes a shard record of format version 1 or 2: increments are written in
    /// version 2 ([`compact`]), everything else in version 1 (bincode). A
    /// version 3 record is unpacked first ([`packed::unpack`]: what it holds
    /// has to live somewhere for the names to borrow from).
    pub fn decode(bytes: &'a [u8]) -> Result<Self> {
        if let [RECORD_MAGIC, RECORD_V3, ..] = bytes {
            return Err(Error::Format("shard record version 3: decoded only once unpacked".into()));
        }
        refuse_bundle(bytes)?;
        let (version, body) = format::shard_record_body(bytes)?;
        if version == RECORD_V2 {
            let (source, entries) = compact::decode_increments(body)?;
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
    /// each with its record time: a bundle's sections (version 4, [`bundle`])
    /// with the times they carry, any other record alone with `record_time` (its
    /// Kafka header's).
    pub fn decode_sections(bytes: &'a [u8], record_time: i64) -> Result<Vec<(i64, Self)>> {
        if !bundle::is_bundle(bytes) {
            return Ok(vec![(record_time, Self::decode(bytes)?)]);
        }
        bundle::sections(bytes)?
            .into_iter()
            .map(|(time, section)| {
                let (source, entries) = compact::decode_increments(section)?;
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
    match bundle::is_bundle(bytes) {
        true => Err(Error::Format("shard record version 4: a bundle, decoded by its sections".into())),
        false => Ok(()),
    }
}

impl ShardMessage {
    pub fn encode(&self) -> Result<Vec<u8>> {
        match self {
            ShardMessage::Increments { source, entries } => Self::encode_increments(*source, entries, RECORD_V2),
            other => encode(other),
        }
    }

    /// The bytes of `ShardMessage::Increments { source, entries }` without building
    /// it, so the ingester encodes its entries in place instead of cloning them, in
    /// record format `version`: [`RECORD_V3`](RECORD_V3) (version 2
    /// packed with zstd, [`packed`]; what an ingester writes),
    /// [`RECORD_V2`](RECORD_V2) (compact, [`compact`]; what
    /// [`ShardMessage::encode`] writes) or [`RECORD_V1`](RECORD_V1)
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
            RECORD_V3 => Ok(packed::pack(compact::encode_increments(source, entries))),
            RECORD_V2 => Ok(compact::encode_increments(source, entries)),
            RECORD_V1 => {
                let bound: usize = entries.iter().map(|(_, increment)| increment.size_bound()).sum();
                // Header, variant, source and length: well under 32 bytes.
                encode_sized(&Borrowed::Increments { source, entries }, bound + 32)
            }
            other => Err(Error::Wire(format!("shard records have no format version {other}"))),
        }
    }

    /// The bytes of one shard record bundling `records` — version 2 records of
    /// increments ([`Self::encode_increments`]), each with the time of its input
    /// record — in record format version 4 ([`bundle`]), packed into version 3
    /// when that makes it smaller. Never more than the records' lengths plus
    /// [`SECTION_OVERHEAD`](bundle::SECTION_OVERHEAD) each, plus
    /// [`BUNDLE_OVERHEAD`](bundle::BUNDLE_OVERHEAD).
    pub fn bundle(records: &[(i64, Vec<u8>)]) -> Result<Vec<u8>> {
        if records.is_empty() {
            return Err(Error::Wire("a bundle has at least one record".into()));
        }
        if let Some((_, stray)) = records.iter().find(|(_, record)| !record.starts_with(&[RECORD_MAGIC, RECORD_V2])) {
            return Err(Error::Wire(format!("a bundle holds version 2 records only, not {:?}", stray.get(..2))));
        }
        Ok(packed::pack(bundle::encode(records)))
    }

    /// Decodes a shard record of any format version into its messages with their
    /// record times ([`ShardMessageRef::decode_sections`], a version 3 record
    /// unpacked first; `record_time` is a record's own when it is not a bundle).
    pub fn decode_sections(bytes: &[u8], record_time: i64) -> Result<Vec<(i64, Self)>> {
        let unpacked = packed::unpack(bytes)?;
        if !bundle::is_bundle(&unpacked) {
            return Ok(vec![(record_time, Self::decode(&unpacked)?)]);
        }
        bundle::sections(&unpacked)?
            .into_iter()
            .map(|(time, section)| {
                let (source, entries) = compact::decode_increments(section)?;
                let entries = entries.into_iter().map(|(stamp, increment)| (stamp, increment.into_owned())).collect();
                Ok((time, ShardMessage::Increments { source, entries }))
            })
            .collect()
    }

    /// Decodes a shard record of any format version but 4 ([`ShardMessageRef::decode`],
    /// a version 3 record unpacked first; a bundle by [`Self::decode_sections`]).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bytes = &packed::unpack(bytes)?[..];
        refuse_bundle(bytes)?;
        match format::shard_record_body(bytes)? {
            (RECORD_V2, body) => {
                let (source, entries) = compact::decode_increments(body)?;
                let entries = entries.into_iter().map(|(stamp, increment)| (stamp, increment.into_owned())).collect();
                Ok(ShardMessage::Increments { source, entries })
            }
            _ => decode(bytes, "shard record"),
        }
    }
}
