//! Binary record format version 4 ([`RECORD_V4`]): a bundle of version 2 shard
//! records of increments ([`crate::wire::compact`]) for one shard, each with the time of
//! its input record.
//!
//! An ingester's batch holds records of every input partition it reads. With a
//! Kafka record per (input partition, shard), a batch over 8 input partitions made
//! 64 records for 8 shards, and a broker that pays per record (the local Tansu
//! inserts each into SQLite and reads each one's headers back with a query of its
//! own, all on one task that the input's reads wait behind) paid that 64 times. A
//! bundle carries a batch's sections for one shard in one Kafka record: 8 per batch.
//! Each section is exactly what a record per partition held — a whole version 2
//! record of one source, in input order — with its own record time (the dedupe
//! clock a record per partition carried in its Kafka header), so a counter applies
//! a bundle's sections as it applied those records, one after the other.
//!
//! Layout after the record header (`[RECORD_MAGIC, 4]`); `varint` and `zigzag` as in
//! version 2:
//! ```text
//! sections: varint count (at least 1), then each:
//!   zigzag record time (ms)   varint length   a version 2 record of that length, its header included
//! ```
//! Decoding ([`sections`]) fails closed: no sections, a truncated or overlong
//! integer, a length past the end, a section that is not a version 2 record, or
//! trailing bytes are each an [`Error::Format`] naming the fault. The sections'
//! own contents are decoded by [`crate::wire::compact::decode_increments`].

use super::compact::{put_varint, put_zigzag, varint_len, zigzag_len, Reader};
use crate::format::{RECORD_MAGIC, RECORD_V2, RECORD_V4};
use crate::{Error, Result};

/// What a fault of a version 4 record is called in its error.
const LABEL: &str = "shard record (format version 4)";
/// The fewest bytes a section takes: a one-byte time and length, and the smallest
/// version 2 record (header, kind, source, three counts).
const MIN_SECTION_BYTES: usize = 2 + 7;
/// The most bytes a section adds to its version 2 record: its time and length.
pub const SECTION_OVERHEAD: usize = 20;
/// The most bytes a bundle adds to its sections: the header and the count.
pub const BUNDLE_OVERHEAD: usize = 12;

/// The bytes of a version 4 record of `sections` — each the time of its input
/// record and a version 2 record — header included, in a buffer of their size.
pub fn encode<R: AsRef<[u8]>>(sections: &[(i64, R)]) -> Vec<u8> {
    debug_assert!(!sections.is_empty(), "a bundle has sections");
    debug_assert!(sections.iter().all(|(_, record)| record.as_ref().starts_with(&[RECORD_MAGIC, RECORD_V2])));
    let size = 2
        + varint_len(sections.len() as u64)
        + sections
            .iter()
            .map(|(time, record)| {
                let len = record.as_ref().len();
                zigzag_len(*time) + varint_len(len as u64) + len
            })
            .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&[RECORD_MAGIC, RECORD_V4]);
    put_varint(&mut out, sections.len() as u64);
    for (time, record) in sections {
        let record = record.as_ref();
        put_zigzag(&mut out, *time);
        put_varint(&mut out, record.len() as u64);
        out.extend_from_slice(record);
    }
    debug_assert_eq!(out.len(), size, "the counted size");
    out
}

/// Whether `record` is a version 4 record (unpacked).
pub fn is_bundle(record: &[u8]) -> bool {
    record.starts_with(&[RECORD_MAGIC, RECORD_V4])
}

/// The sections of the version 4 record `record` (its header included), in order:
/// each one's record time and the body of its version 2 record (after that record's
/// header, which is checked: what [`crate::wire::compact::decode_increments`] reads),
/// borrowed.
pub fn sections(record: &[u8]) -> Result<Vec<(i64, &[u8])>> {
    let [RECORD_MAGIC, RECORD_V4, body @ ..] = record else {
        return Err(Error::Format(format!("{LABEL}: not a version 4 record")));
    };
    let mut reader = Reader::new(body, LABEL);
    let count = reader.count("sections", MIN_SECTION_BYTES)?;
    if count == 0 {
        return Err(reader.fault("no sections".into()));
    }
    let mut sections = Vec::with_capacity(count);
    for number in 0..count {
        let time = reader.zigzag("record time")?;
        let len = reader.count("section length", 1)?;
        let [RECORD_MAGIC, RECORD_V2, v2_body @ ..] = reader.take(len, "section")? else {
            return Err(reader.fault(format!("section {number} is not a version 2 record")));
        };
        sections.push((time, v2_body));
    }
    reader.finish()?;
    Ok(sections)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::wire::compact::{decode_increments, encode_increments};
    use crate::wire::{Increment, Source, Stamp};

    fn record(partition: u32, offset: i64) -> Vec<u8> {
        let increment = Increment { entity: "user:1".into(), metric: "views".into(), delta: 2, ts: 9, id: None };
        encode_increments(Source { stream: Source::INCREMENTS, partition }, &[(Stamp { offset, index: 0 }, increment)])
    }

    #[test]
    fn writes_each_section_with_its_time_and_length() {
        let (first, second) = (record(0, 5), record(3, 7));
        let bytes = encode(&[(1_700_000_000_000, &first), (-1, &second)]);
        let expected: Vec<u8> = [
            &[RECORD_MAGIC, RECORD_V4, 2][..],
            &[0x80, 0xa0, 0xab, 0xfe, 0xf9, 0x62],
            &[first.len() as u8],
            &first,
            &[1, second.len() as u8],
            &second,
        ]
        .concat();
        assert_eq!(bytes, expected);
        let read = sections(&bytes).unwrap();
        assert_eq!(read, vec![(1_700_000_000_000, &first[2..]), (-1, &second[2..])]);
        let (source, entries) = decode_increments(read[1].1).unwrap();
        assert_eq!((source.partition, entries.len(), entries[0].0.offset), (3, 1, 7));
    }

    #[test]
    fn every_fault_is_an_error_naming_it() {
        let good = encode(&[(10, record(0, 5)), (11, record(1, 6))]);
        let error = |bytes: &[u8]| sections(bytes).unwrap_err().to_string();
        for len in 0..good.len() {
            assert!(sections(&good[..len]).is_err(), "{len} of {} bytes read", good.len());
        }
        assert!(error(&[good.clone(), vec![0]].concat()).ends_with("version 4): 1 trailing bytes"));
        assert!(
            error(&[RECORD_MAGIC, RECORD_V4, 0]).ends_with("no sections"),
            "{}",
            error(&[RECORD_MAGIC, RECORD_V4, 0])
        );
        assert!(error(&record(0, 5)).ends_with("not a version 4 record"));
        let mut stray = good.clone();
        stray[5] = 0x55; // the first section's magic byte
        assert!(error(&stray).ends_with("section 0 is not a version 2 record"), "{}", error(&stray));
        let long = [RECORD_MAGIC, RECORD_V4, 1, 2, 0x7f, RECORD_MAGIC, RECORD_V2, 0, 0, 0, 0, 0];
        assert!(error(&long).contains("section length 127 is more than the 7 bytes left"), "{}", error(&long));
        let many = [RECORD_MAGIC, RECORD_V4, 0xff, 0x01, 0, 0];
        assert!(error(&many).contains("sections 255 is more than the 2 bytes left"), "{}", error(&many));
    }

    proptest! {
        /// Whatever the sections, they read back in order, times and bytes whole.
        #[test]
        fn sections_round_trip(parts in proptest::collection::vec((any::<i64>(), 0u32..64, any::<i64>()), 1..20)) {
            let records: Vec<(i64, Vec<u8>)> =
                parts.iter().map(|&(time, partition, offset)| (time, record(partition, offset))).collect();
            let bytes = encode(&records);
            let read = sections(&bytes).unwrap();
            let want: Vec<(i64, &[u8])> = records.iter().map(|(time, record)| (*time, &record[2..])).collect();
            prop_assert_eq!(read, want);
        }
    }
}
