//! Binary record format version 3 ([`RECORD_V3`]): a version 2 shard record of
//! increments ([`crate::wire::compact`]), or a version 4 bundle of them
//! ([`crate::wire::bundle`]), compressed whole with zstd.
//!
//! Every byte of the shard topic is written once and read back at least once by the
//! broker; on the local broker (SQLite) those bytes are most of what tally's path
//! costs it beyond serving the producers' input, and its writes hold up its reads.
//! Version 2 records of a Zipf load compress to about 37 % at zstd's level 1 (names
//! sharing prefixes, small integers in runs): 9.2 → 3.4 bytes per increment in
//! `tally-bench ingest` (BENCHMARKS.md).
//!
//! Layout: `[RECORD_MAGIC, 3]`, then one zstd frame that states its content size,
//! holds a whole version 2 or version 4 record, header included (its own header says
//! which), and ends with zstd's checksum of it. A record that would not come out
//! smaller, or one over [`MAX_UNPACKED`], stays as it was ([`pack`]). [`unpack`] fails
//! closed: anything but one whole frame, a frame without its size or over
//! [`MAX_UNPACKED`], one that does not decompress to exactly its size and checksum,
//! or that holds anything but a version 2 or 4 record is an [`Error::Format`] naming
//! it. (A counter of a release before version 4 refuses a packed version 4 record
//! the same way: it stops the shard rather than misread it.)

use std::borrow::Cow;
use std::cell::RefCell;

use crate::format::{RECORD_MAGIC, RECORD_V2, RECORD_V3, RECORD_V4};
use crate::{Error, Result};

/// zstd's level for shard records: its fastest positive level (level 3 saves 1 % more).
const LEVEL: i32 = 1;
/// The most bytes a packed record may unpack to (a version 2 record is at most the
/// broker's `message.max.bytes`, a megabyte by default).
pub const MAX_UNPACKED: u64 = 64 << 20;

thread_local! {
    static COMPRESSOR: RefCell<zstd_safe::CCtx<'static>> = RefCell::new(compressor());
    static DECOMPRESSOR: RefCell<zstd_safe::DCtx<'static>> = RefCell::new(zstd_safe::DCtx::create());
}

/// A compression context at [`LEVEL`] whose frames state their size and end with a
/// checksum of what they hold (a record corrupted anywhere fails to unpack).
fn compressor() -> zstd_safe::CCtx<'static> {
    let mut cctx = zstd_safe::CCtx::create();
    for parameter in [
        zstd_safe::CParameter::CompressionLevel(LEVEL),
        zstd_safe::CParameter::ContentSizeFlag(true),
        zstd_safe::CParameter::ChecksumFlag(true),
    ] {
        // Valid parameters of the linked zstd (1.4 or later): cannot fail.
        let set = cctx.set_parameter(parameter);
        debug_assert!(set.is_ok(), "zstd refused a compression parameter");
    }
    cctx
}

/// Whether `record` is of a version that version 3 may hold (2 or 4).
fn packable(record: &[u8]) -> bool {
    matches!(record, [RECORD_MAGIC, RECORD_V2 | RECORD_V4, ..])
}

/// The version 3 form of the version 2 or 4 record `record`, or `record` itself when packing
/// would not make it smaller (so a packed record is never bigger than it was) or `record`
/// is bigger than [`MAX_UNPACKED`] (a broker's `message.max.bytes` set that high).
pub fn pack(record: Vec<u8>) -> Vec<u8> {
    debug_assert!(packable(&record), "only version 2 and 4 records are packed");
    if record.len() as u64 > MAX_UNPACKED {
        return record;
    }
    let mut out = vec![0u8; 2 + zstd_safe::compress_bound(record.len())];
    out[..2].copy_from_slice(&[RECORD_MAGIC, RECORD_V3]);
    let written = COMPRESSOR.with(|cctx| cctx.borrow_mut().compress2(&mut out[2..], &record));
    match written {
        Ok(written) if 2 + written < record.len() => {
            out.truncate(2 + written);
            out
        }
        // Not smaller, or zstd failed (it cannot with a buffer of its bound): as it was.
        _ => record,
    }
}

/// How many bytes `bytes` takes once unpacked: a version 3 record's stated size
/// (its length when it states none, or too much: [`unpack`] refuses it), any other
/// record's length.
pub fn unpacked_len(bytes: &[u8]) -> usize {
    match bytes {
        [RECORD_MAGIC, RECORD_V3, frame @ ..] => stated_size(frame).unwrap_or(bytes.len()),
        _ => bytes.len(),
    }
}

/// The size a zstd frame states for what it holds, if it states one within
/// [`MAX_UNPACKED`]; else what is wrong.
fn stated_size(frame: &[u8]) -> std::result::Result<usize, String> {
    match zstd_safe::get_frame_content_size(frame) {
        Ok(Some(size)) if size <= MAX_UNPACKED => Ok(size as usize),
        Ok(Some(size)) => Err(format!("unpacks to {size} bytes, more than {MAX_UNPACKED}")),
        Ok(None) => Err("the zstd frame does not state its size".into()),
        Err(_) => Err("not a zstd frame".into()),
    }
}

/// The record to decode: a version 3 record's version 2 or 4 record, unpacked into a
/// buffer of its own; any other record as it is.
pub fn unpack(bytes: &[u8]) -> Result<Cow<'_, [u8]>> {
    let [RECORD_MAGIC, RECORD_V3, frame @ ..] = bytes else {
        return Ok(Cow::Borrowed(bytes));
    };
    let fault = |what: String| Error::Format(format!("shard record version 3: {what}"));
    let size = stated_size(frame).map_err(fault)?;
    // One frame and nothing after it (zstd would read on into further frames, and
    // step over skippable ones).
    if zstd_safe::find_frame_compressed_size(frame).ok() != Some(frame.len()) {
        return Err(fault("not one whole zstd frame".into()));
    }
    let mut out = vec![0u8; size];
    let unpacked = DECOMPRESSOR.with(|dctx| dctx.borrow_mut().decompress(&mut out[..], frame));
    match unpacked {
        Ok(written) if written == size => {}
        Ok(written) => return Err(fault(format!("unpacked {written} bytes, its frame states {size}"))),
        Err(code) => return Err(fault(format!("zstd: {}", zstd_safe::get_error_name(code)))),
    }
    if !packable(&out) {
        return Err(fault("does not hold a version 2 or 4 record".into()));
    }
    Ok(Cow::Owned(out))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::wire::{Increment, ShardMessage, Source, Stamp};

    proptest! {
        /// Any record of increments reads back the same in version 3 as in version
        /// 2, and is never bigger.
        #[test]
        fn a_record_reads_back_the_same_packed(
            draws in proptest::collection::vec((0u8..40, 0u8..3, -5i64..5, 0i64..10_000, any::<bool>()), 0..400),
        ) {
            let source = Source { stream: Source::INCREMENTS, partition: 3 };
            let entries: Vec<(Stamp, Increment)> = draws
                .iter()
                .enumerate()
                .map(|(i, &(entity, metric, delta, ts, id))| {
                    let increment = Increment {
                        entity: format!("entity-{entity}"),
                        metric: format!("metric-{metric}"),
                        delta,
                        ts: 1_700_000_000_000 + ts,
                        id: id.then(|| format!("id-{i}")),
                    };
                    (Stamp { offset: i as i64 / 7, index: i as u32 % 7 }, increment)
                })
                .collect();
            let v2 = ShardMessage::encode_increments(source, &entries, RECORD_V2).unwrap();
            let v3 = ShardMessage::encode_increments(source, &entries, RECORD_V3).unwrap();
            prop_assert!(v3.len() <= v2.len());
            let want = ShardMessage::Increments { source, entries };
            prop_assert_eq!(ShardMessage::decode(&v2).unwrap(), want.clone());
            prop_assert_eq!(ShardMessage::decode(&v3).unwrap(), want);
        }
    }

    fn v2_record(len: usize) -> Vec<u8> {
        let mut record = vec![RECORD_MAGIC, RECORD_V2];
        record.extend((0..len).map(|i| (i % 7) as u8));
        record
    }

    #[test]
    fn a_packed_record_unpacks_to_the_version_2_record_it_holds() {
        let v2 = v2_record(10_000);
        let packed = pack(v2.clone());
        assert_eq!(&packed[..2], &[RECORD_MAGIC, RECORD_V3]);
        assert!(packed.len() < v2.len() / 10, "{} bytes", packed.len());
        assert_eq!(unpack(&packed).unwrap(), Cow::<[u8]>::Owned(v2.clone()));
        // Anything else is decoded as it is.
        assert!(matches!(unpack(&v2).unwrap(), Cow::Borrowed(bytes) if bytes == &v2[..]));
        assert!(matches!(unpack(b"").unwrap(), Cow::Borrowed(b"")));
        // A bundle of version 2 records packs and unpacks the same way.
        let bundle = crate::wire::bundle::encode(&[(5, v2_record(4_000)), (6, v2_record(6_000))]);
        let packed = pack(bundle.clone());
        assert_eq!(&packed[..2], &[RECORD_MAGIC, RECORD_V3]);
        assert!(packed.len() < bundle.len() / 10, "{} bytes", packed.len());
        assert_eq!(unpack(&packed).unwrap(), Cow::<[u8]>::Owned(bundle));
    }

    #[test]
    fn a_record_packing_would_not_shrink_stays_version_2() {
        let v2 = vec![RECORD_MAGIC, RECORD_V2, 1, 2, 3];
        assert_eq!(pack(v2.clone()), v2);
    }

    #[test]
    fn a_broken_packed_record_fails_closed_naming_the_fault() {
        let packed = pack(v2_record(10_000));
        let err = |bytes: &[u8]| unpack(bytes).unwrap_err().to_string();
        // Cut short: the frame states more than it holds.
        assert!(err(&packed[..packed.len() - 3]).contains("zstd"), "{}", err(&packed[..packed.len() - 3]));
        assert!(err(&[RECORD_MAGIC, RECORD_V3, 1, 2, 3, 4]).contains("not a zstd frame"));
        // A frame without its size (streamed).
        let mut unsized_frame = vec![RECORD_MAGIC, RECORD_V3];
        let mut cctx = zstd_safe::CCtx::create();
        cctx.set_parameter(zstd_safe::CParameter::ContentSizeFlag(false)).unwrap();
        let v2 = v2_record(100);
        let mut body = vec![0u8; zstd_safe::compress_bound(v2.len())];
        let written = cctx.compress2(&mut body[..], &v2).unwrap();
        unsized_frame.extend_from_slice(&body[..written]);
        assert!(err(&unsized_frame).contains("does not state its size"), "{}", err(&unsized_frame));
        // A frame of something else than a version 2 or 4 record.
        let mut other = vec![RECORD_MAGIC, RECORD_V3];
        let mut body = vec![0u8; zstd_safe::compress_bound(100)];
        let written = zstd_safe::compress(&mut body[..], &[7u8; 100], 1).unwrap();
        other.extend_from_slice(&body[..written]);
        assert!(err(&other).contains("does not hold a version 2 or 4 record"), "{}", err(&other));
        // Any bit flipped anywhere (literals too: the checksum) fails to unpack, or
        // unpacks to the same record (a bit zstd's frame header leaves unused); half
        // the record pseudo-random bytes so that it has literals, half repeats so that
        // it packs.
        let mut state = 7u32;
        let mut v2 = vec![RECORD_MAGIC, RECORD_V2];
        v2.extend((0..600).map(|i| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            if i % 2 == 0 {
                (state >> 16) as u8
            } else {
                0
            }
        }));
        let packed = pack(v2.clone());
        assert_eq!(packed[1], RECORD_V3);
        let mut refused = 0;
        for at in 2..packed.len() {
            for bit in 0..8 {
                let mut flipped = packed.clone();
                flipped[at] ^= 1 << bit;
                match unpack(&flipped) {
                    Ok(unpacked) => assert_eq!(unpacked, &v2[..], "bit {bit} of byte {at} unpacked to other content"),
                    Err(_) => refused += 1,
                }
            }
        }
        assert!(refused >= 8 * (packed.len() - 2) - 8, "{refused} of {} flips refused", 8 * (packed.len() - 2));
        // A frame followed by anything: a skippable frame, an empty frame, a byte.
        let skippable = [0x50, 0x2A, 0x4D, 0x18, 0, 0, 0, 0];
        let mut empty = vec![0u8; zstd_safe::compress_bound(0)];
        let written = zstd_safe::compress(&mut empty[..], &[], 1).unwrap();
        for tail in [&skippable[..], &empty[..written], &[0u8][..]] {
            let mut longer = packed.clone();
            longer.extend_from_slice(tail);
            assert!(err(&longer).contains("not one whole zstd frame"), "{}", err(&longer));
        }
        // The size it unpacks to, read from the frame; other records' own length.
        assert_eq!((unpacked_len(&packed), unpacked_len(&v2), unpacked_len(b"xy")), (v2.len(), v2.len(), 2));
    }

    #[test]
    fn a_record_over_the_cap_is_neither_packed_nor_unpacked() {
        let oversized = v2_record(MAX_UNPACKED as usize);
        let packed = pack(oversized.clone());
        assert!(packed == oversized, "stays version 2 (came out in {} bytes)", packed.len());
        // A frame stating more than the cap (zeros pack to almost nothing): refused
        // before anything is allocated, and counted as its own length.
        let mut bomb = vec![RECORD_MAGIC, RECORD_V3];
        let zeros = vec![0u8; MAX_UNPACKED as usize + 1];
        let mut body = vec![0u8; zstd_safe::compress_bound(zeros.len())];
        let written = zstd_safe::compress(&mut body[..], &zeros, 1).unwrap();
        bomb.extend_from_slice(&body[..written]);
        let err = unpack(&bomb).unwrap_err().to_string();
        assert!(err.contains(&format!("unpacks to {} bytes, more than {MAX_UNPACKED}", MAX_UNPACKED + 1)), "{err}");
        assert_eq!(unpacked_len(&bomb), bomb.len());
    }
}
