//! The compact encoding of a shard record of increments: binary record format
//! version 2 ([`crate::format::RECORD_V2`]).
//!
//! A shard record holds thousands of increments of one source, and under a Zipf load
//! the same few entities and metrics again and again; version 1 (bincode) wrote every
//! name with every increment and every stamp and event time in full, so the shard
//! topic carried about as many bytes as the producers' JSON — bytes the broker stores
//! and serves a second time. Version 2 writes each distinct name once, in a table,
//! and each entry as small integers: its stamp and event time as differences from the
//! entry before it.
//!
//! Layout after the record header (`[RECORD_MAGIC, 2]`); `varint` is unsigned LEB128
//! (at most 10 bytes), `zigzag` a signed value mapped onto it:
//! ```text
//! kind: u8 (0 = increments)   source.stream: u8   source.partition: varint
//! names: varint count, then each: varint length, UTF-8 bytes
//! entries: varint count, then each:
//!   zigzag (offset - previous entry's offset)   varint index
//!   varint entity name number                   varint metric name number
//!   zigzag delta                                zigzag (ts - previous entry's ts)
//!   varint id: 0 = none, n = an id of n - 1 bytes, which follow
//! ```
//! The first entry's differences are from 0; differences wrap (any `i64` encodes).
//! Decoding fails closed: a truncated varint or one over 64 bits, a name number out
//! of the table, invalid UTF-8, a count larger than the bytes could hold, an unknown
//! kind or trailing bytes are each a [`Error::Format`] naming the fault.

use rustc_hash::FxHashMap;

use super::shard::{IncrementFields, IncrementRef, Source, Stamp};
use crate::{Error, Result};

/// The only kind of version 2 record so far.
const KIND_INCREMENTS: u8 = 0;
/// The names a record's table has room for before it grows (a record of a few
/// entries allocates for those only).
const NAME_TABLE_START: usize = 1024;
/// The fewest bytes an entry takes (six one-byte integers and the id's tag).
const MIN_ENTRY_BYTES: usize = 7;

/// The bytes of a version 2 increments record, its header included, in a buffer of
/// exactly their size (a bound would over-allocate several times: names are written
/// once, not per entry).
pub fn encode_increments<T: IncrementFields>(source: Source, entries: &[(Stamp, T)]) -> Vec<u8> {
    // Names are numbered in the order of their first use; the size is counted on the way.
    let mut numbers: FxHashMap<&str, u32> =
        FxHashMap::with_capacity_and_hasher(entries.len().min(NAME_TABLE_START), Default::default());
    let mut names: Vec<&str> = Vec::new();
    let mut refs: Vec<(u32, u32)> = Vec::with_capacity(entries.len());
    // An entry's metric is mostly the one before's: compared, not hashed again.
    let mut last_metric: Option<(&str, u32)> = None;
    let (mut offset, mut ts) = (0i64, 0i64);
    let mut size = 4 + varint_len(u64::from(source.partition)) + varint_len(entries.len() as u64);
    for (stamp, increment) in entries {
        let mut number = |name| {
            *numbers.entry(name).or_insert_with(|| {
                names.push(name);
                (names.len() - 1) as u32
            })
        };
        let entity = number(increment.entity());
        let metric = match last_metric {
            Some((name, metric)) if name == increment.metric() => metric,
            _ => {
                let metric = number(increment.metric());
                last_metric = Some((increment.metric(), metric));
                metric
            }
        };
        refs.push((entity, metric));
        size += zigzag_len(stamp.offset.wrapping_sub(offset))
            + varint_len(u64::from(stamp.index))
            + varint_len(u64::from(entity))
            + varint_len(u64::from(metric))
            + zigzag_len(increment.delta())
            + zigzag_len(increment.ts().wrapping_sub(ts))
            + increment.id().map_or(1, |id| varint_len(id.len() as u64 + 1) + id.len());
        (offset, ts) = (stamp.offset, increment.ts());
    }
    size += varint_len(names.len() as u64) + names.iter().map(|n| varint_len(n.len() as u64) + n.len()).sum::<usize>();

    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&[crate::format::RECORD_MAGIC, crate::format::RECORD_V2, KIND_INCREMENTS, source.stream]);
    put_varint(&mut out, u64::from(source.partition));
    put_varint(&mut out, names.len() as u64);
    for name in &names {
        put_varint(&mut out, name.len() as u64);
        out.extend_from_slice(name.as_bytes());
    }
    put_varint(&mut out, entries.len() as u64);
    let (mut offset, mut ts) = (0i64, 0i64);
    for ((stamp, increment), (entity, metric)) in entries.iter().zip(refs) {
        put_zigzag(&mut out, stamp.offset.wrapping_sub(offset));
        put_varint(&mut out, u64::from(stamp.index));
        put_varint(&mut out, u64::from(entity));
        put_varint(&mut out, u64::from(metric));
        put_zigzag(&mut out, increment.delta());
        put_zigzag(&mut out, increment.ts().wrapping_sub(ts));
        (offset, ts) = (stamp.offset, increment.ts());
        match increment.id() {
            None => out.push(0),
            Some(id) => {
                put_varint(&mut out, id.len() as u64 + 1);
                out.extend_from_slice(id.as_bytes());
            }
        }
    }
    debug_assert_eq!(out.len(), size, "the counted size");
    out
}

/// Decodes the body of a version 2 record (after its header); names and ids borrow
/// from `body`.
pub fn decode_increments(body: &[u8]) -> Result<(Source, Vec<(Stamp, IncrementRef<'_>)>)> {
    let mut reader = Reader::new(body, LABEL);
    let kind = reader.byte("kind")?;
    if kind != KIND_INCREMENTS {
        return Err(fault(format!("unknown record kind {kind}")));
    }
    let stream = reader.byte("source")?;
    let partition = reader.u32("source partition")?;
    let name_count = reader.count("names", 1)?;
    let mut names: Vec<&str> = Vec::with_capacity(name_count);
    for _ in 0..name_count {
        let len = reader.count("name length", 1)?;
        names.push(reader.str(len, "name")?);
    }
    let entry_count = reader.count("entries", MIN_ENTRY_BYTES)?;
    let mut entries = Vec::with_capacity(entry_count);
    let (mut offset, mut ts) = (0i64, 0i64);
    let name = |number: u32, what: &str| {
        names
            .get(number as usize)
            .copied()
            .ok_or_else(|| fault(format!("{what} name number {number} is out of the table of {} names", names.len())))
    };
    for _ in 0..entry_count {
        offset = offset.wrapping_add(reader.zigzag("offset")?);
        let index = reader.u32("index")?;
        let entity = name(reader.u32("entity")?, "entity")?;
        let metric = name(reader.u32("metric")?, "metric")?;
        let delta = reader.zigzag("delta")?;
        ts = ts.wrapping_add(reader.zigzag("ts")?);
        let id = match reader.count("id length", 0)? {
            0 => None,
            len => Some(reader.str(len - 1, "id")?),
        };
        entries.push((Stamp { offset, index }, IncrementRef { entity, metric, delta, ts, id }));
    }
    reader.finish()?;
    Ok((Source { stream, partition }, entries))
}

/// What a fault of a version 2 record is called in its error.
const LABEL: &str = "shard record (format version 2)";

fn fault(what: String) -> Error {
    Error::Format(format!("{LABEL}: {what}"))
}

pub(crate) fn varint_len(value: u64) -> usize {
    (64 - value.leading_zeros() as usize).div_ceil(7).max(1)
}

fn zigzag(value: i64) -> u64 {
    ((value << 1) ^ (value >> 63)) as u64
}

pub(crate) fn zigzag_len(value: i64) -> usize {
    varint_len(zigzag(value))
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

pub(crate) fn put_zigzag(out: &mut Vec<u8>, value: i64) {
    put_varint(out, zigzag(value));
}

/// Reads the varints of a record, failing closed with errors that start with the
/// record's `label`.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    label: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8], label: &'static str) -> Self {
        Self { bytes, at: 0, label }
    }

    pub(crate) fn fault(&self, what: String) -> Error {
        Error::Format(format!("{}: {what}", self.label))
    }

    /// Fails unless every byte was read.
    pub(crate) fn finish(&self) -> Result<()> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            left => Err(self.fault(format!("{left} trailing bytes"))),
        }
    }

    fn byte(&mut self, what: &str) -> Result<u8> {
        let byte = *self.bytes.get(self.at).ok_or_else(|| self.fault(format!("ends before its {what}")))?;
        self.at += 1;
        Ok(byte)
    }

    pub(crate) fn varint(&mut self, what: &str) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.byte(what)?;
            let bits = u64::from(byte & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(self.fault(format!("{what} overflows 64 bits")));
            }
            value |= bits << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.fault(format!("{what} overflows 64 bits")))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let value = self.varint(what)?;
        u32::try_from(value).map_err(|_| self.fault(format!("{what} {value} overflows 32 bits")))
    }

    pub(crate) fn zigzag(&mut self, what: &str) -> Result<i64> {
        let value = self.varint(what)?;
        Ok((value >> 1) as i64 ^ -((value & 1) as i64))
    }

    /// A count of items of at least `min_bytes` each (0: a byte length, or an id's
    /// tag): never more than the bytes left could hold, so a corrupt count cannot
    /// ask for a huge allocation.
    pub(crate) fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let value = self.varint(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        let most = if min_bytes == 0 { left + 1 } else { left / min_bytes as u64 };
        if value > most {
            return Err(self.fault(format!("{what} {value} is more than the {left} bytes left can hold")));
        }
        Ok(value as usize)
    }

    /// The next `len` bytes.
    pub(crate) fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(len).filter(|&end| end <= self.bytes.len());
        let end = end.ok_or_else(|| self.fault(format!("ends inside a {what}")))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn str(&mut self, len: usize, what: &str) -> Result<&'a str> {
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|err| self.fault(format!("{what}: {err}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Increment;

    fn entry(
        offset: i64,
        index: u32,
        entity: &str,
        metric: &str,
        delta: i64,
        ts: i64,
        id: Option<&str>,
    ) -> (Stamp, Increment) {
        let increment =
            Increment { entity: entity.into(), metric: metric.into(), delta, ts, id: id.map(str::to_string) };
        (Stamp { offset, index }, increment)
    }

    /// The body (after the record header) of the entries' version 2 record.
    fn encoded(entries: &[(Stamp, Increment)]) -> Vec<u8> {
        let record = encode_increments(Source { stream: Source::INCREMENTS, partition: 300 }, entries);
        assert_eq!(record[..2], [crate::format::RECORD_MAGIC, crate::format::RECORD_V2]);
        record[2..].to_vec()
    }

    #[test]
    fn writes_each_name_once_and_small_differences() {
        let entries = vec![
            entry(1000, 0, "user:1", "views", 1, 1_700_000_000_000, None),
            entry(1000, 1, "user:2", "views", 1, 1_700_000_000_000, None),
            entry(1001, 0, "user:1", "views", -1, 1_700_000_000_005, Some("r")),
        ];
        let bytes = encoded(&entries);
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[KIND_INCREMENTS, Source::INCREMENTS, 0xac, 0x02][..],              // kind, stream, partition 300
            &[3, 6], b"user:1", &[5], b"views", &[6], b"user:2",                  // the names, in first use
            &[3],                                                                // entries
            &[0xd0, 0x0f, 0, 0, 1, 2, 0x80, 0xa0, 0xab, 0xfe, 0xf9, 0x62, 0],       // offset 1000, ts in full
            &[0, 1, 2, 1, 2, 0, 0],                                              // same offset and ts
            &[2, 0, 0, 1, 1, 10, 2], b"r",                                       // +1, delta -1, ts +5, id "r"
        ]
        .concat();
        assert_eq!(bytes, expected);
        let (source, decoded) = decode_increments(&bytes).unwrap();
        assert_eq!(source, Source { stream: Source::INCREMENTS, partition: 300 });
        let owned: Vec<(Stamp, Increment)> = decoded.into_iter().map(|(s, i)| (s, i.into_owned())).collect();
        assert_eq!(owned, entries);
    }

    #[test]
    fn extreme_values_round_trip() {
        let entries = vec![
            entry(i64::MAX, u32::MAX, "", "m", i64::MIN, i64::MIN, Some("")),
            entry(i64::MIN, 0, "ü", "", i64::MAX, i64::MAX, None),
            entry(0, 7, "ü", "m", 0, 0, Some("x".repeat(300).as_str())),
        ];
        let bytes = encoded(&entries);
        let (_, decoded) = decode_increments(&bytes).unwrap();
        let owned: Vec<(Stamp, Increment)> = decoded.into_iter().map(|(s, i)| (s, i.into_owned())).collect();
        assert_eq!(owned, entries);
    }

    #[test]
    fn every_fault_is_an_error_naming_it() {
        let good = encoded(&[entry(5, 0, "user:1", "views", 1, 10, Some("id"))]);
        let error = |bytes: &[u8]| decode_increments(bytes).unwrap_err().to_string();
        // Every truncation fails (never a shorter record read as whole).
        for len in 0..good.len() {
            assert!(decode_increments(&good[..len]).is_err(), "{len} of {} bytes decoded", good.len());
        }
        assert!(error(&[good.clone(), vec![0]].concat()).contains("1 trailing bytes"));
        let mut kind = good.clone();
        kind[0] = 9;
        assert!(error(&kind).contains("unknown record kind 9"));
        // The entity's name number (after the offset and index bytes) points past the table.
        let at = good.len() - 7;
        assert_eq!(good[at], 0, "the entity's number");
        let mut number = good.clone();
        number[at] = 2;
        assert!(error(&number).contains("entity name number 2 is out of the table of 2 names"), "{}", error(&number));
        let mut utf8 = good.clone();
        utf8[6] = 0xff; // inside "user:1"
        assert!(error(&utf8).contains("name: invalid utf-8"), "{}", error(&utf8));
        let huge_count = [KIND_INCREMENTS, 1, 0, 0xff, 0xff, 0xff, 0xff, 0x0f];
        assert!(
            error(&huge_count).contains("names 4294967295 is more than the 0 bytes left"),
            "{}",
            error(&huge_count)
        );
        let over_64_bits = [KIND_INCREMENTS, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f];
        assert!(error(&over_64_bits).contains("overflows 64 bits"), "{}", error(&over_64_bits));
        let eleven_bytes = [KIND_INCREMENTS, 1, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x81, 0];
        assert!(error(&eleven_bytes).contains("overflows 64 bits"), "{}", error(&eleven_bytes));
        let wide_partition = [KIND_INCREMENTS, 1, 0x80, 0x80, 0x80, 0x80, 0x10, 0, 0];
        assert!(error(&wide_partition).contains("overflows 32 bits"), "{}", error(&wide_partition));
    }
}
