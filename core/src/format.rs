//! Format versions of everything tally keeps: internal Kafka records and RocksDB values.
//!
//! - A binary internal record (the shard topic, the graph-updates topic, the outboxes
//!   that hold them) starts with [`RECORD_MAGIC`] and its format version, then the
//!   body: bincode in version 1, the compact encoding of increments in version 2
//!   ([`RECORD_V2`]), a version 2 or 4 record compressed with zstd in version 3
//!   ([`RECORD_V3`]), several version 2 records for one shard, each with its
//!   record time, in version 4 ([`RECORD_V4`]). The magic byte tells a stray
//!   producer's bytes from tally's.
//! - A JSON record tally writes has a version field: `"v"` (shard owners, broker
//!   heartbeats, dead letters, dead jobs, rollups), `"version"` (queue declarations).
//! - Every RocksDB value starts with its format version byte; a store also keeps the
//!   version of its key layout under [`STORE_FORMAT_KEY`], checked when it opens.
//!
//! Decoders accept exactly the versions they know and fail with
//! [`Error::Format`] otherwise — never a default. The upgrade rule (ARCHITECTURE.md):
//! a change to a format adds a version and keeps the decoder of every older one until
//! no topic or store of a supported release can hold it; the golden bytes of each
//! version are committed (`core/tests/golden/`; queue declarations': in
//! `shared::topics`) and must keep decoding.

use crate::{Error, Result};

/// The first byte of every binary internal record.
pub const RECORD_MAGIC: u8 = 0xA7;
/// Version 1 of binary internal records: the bincode of the message. Every binary
/// record but a shard record of increments is still written in it.
pub const RECORD_V1: u8 = 1;
/// Version 2: a shard record of increments in the compact encoding
/// ([`crate::wire::compact`]: names once per record, small differences); for a read
/// request ([`crate::wire::ReadRequest`]), one whose queries may select segments.
pub const RECORD_V2: u8 = 2;
/// Version 3: a version 2 or version 4 record compressed whole with zstd
/// ([`crate::wire::packed`]; holding a version 4 record since version 4 exists). Counters
/// read versions 1 to 4 (a version 3 record is unpacked, [`crate::wire::packed::unpack`],
/// before it is decoded).
pub const RECORD_V3: u8 = 3;
/// Version 4: a bundle ([`crate::wire::bundle`]) of version 2 records of increments for
/// one shard, from several sources, each with the time of its input record. An
/// ingester writes one per shard per batch, packed into version 3.
pub const RECORD_V4: u8 = 4;
/// The version of RocksDB values.
pub const VALUE_V1: u8 = 1;
/// Version 2 of a counts value ([`crate::keys::Counts`]): counts beyond an i64's
/// range, as i128s. Every other value is in version 1.
pub const VALUE_V2: u8 = 2;
/// The current version of the JSON records tally writes (their `"v"`).
pub const JSON_V1: u32 = 1;
/// The key, in a store's default column family, of its key layout version.
pub const STORE_FORMAT_KEY: &[u8] = b"format";
/// The current key layout version of the stores.
pub const STORE_V1: u8 = 1;

/// The value of a key whose presence is the whole fact (an edge, a rollup mark).
pub const PRESENT: [u8; 1] = [VALUE_V1];

/// The Kafka header of a routed record (shard topic, graph-updates topic) holding the
/// time of the input record it came from — the receivers' dedupe clock — as 8
/// big-endian bytes (ms). The record's own Kafka timestamp is when it was routed, so
/// the topics' time-based retention counts from then, whatever time a producer gave
/// its input.
pub const RECORD_TIME_HEADER: &str = "tally.record-time.v1";

/// The Kafka header an ingester puts on the routed records of a batch that read its
/// input partitions to their end (as far as the broker last said): the load that
/// made them has, for now, stopped. A hint for when a receiver's batch may close
/// (the one consume loop, `tally_shared::consume`), never for what it counts; its
/// value is empty, and a record without it is one among more to come.
pub const INPUT_DRAINED_HEADER: &str = "tally.input-drained.v1";

/// `bytes` as lowercase hex: how tally writes ids, tags and hashes as text.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The value of [`RECORD_TIME_HEADER`].
pub fn record_time_value(ms: i64) -> [u8; 8] {
    ms.to_be_bytes()
}

/// Reads a [`RECORD_TIME_HEADER`] value.
pub fn parse_record_time(bytes: &[u8]) -> Result<i64> {
    let bytes: [u8; 8] = bytes
        .try_into()
        .map_err(|_| Error::Format(format!("record-time header: {} bytes, expected 8", bytes.len())))?;
    Ok(i64::from_be_bytes(bytes))
}

/// The header of a version 1 binary internal record.
pub const RECORD_HEADER: [u8; 2] = [RECORD_MAGIC, RECORD_V1];

/// The format version (1 or 2) and body of a shard record.
pub fn shard_record_body(bytes: &[u8]) -> Result<(u8, &[u8])> {
    match bytes {
        [RECORD_MAGIC, version @ (RECORD_V1 | RECORD_V2), body @ ..] => Ok((*version, body)),
        _ => record_body(bytes, "shard record").map(|body| (RECORD_V1, body)),
    }
}

/// The body of a version 1 binary internal record named `what`, after checking its
/// header.
pub fn record_body<'a>(bytes: &'a [u8], what: &str) -> Result<&'a [u8]> {
    match bytes {
        [RECORD_MAGIC, RECORD_V1, body @ ..] => Ok(body),
        [RECORD_MAGIC, version, ..] => Err(unknown(what, *version)),
        _ => Err(Error::Format(format!("{what}: not a tally record (no format header)"))),
    }
}

/// `body` prefixed with the current value version.
pub fn value(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 1);
    out.push(VALUE_V1);
    out.extend_from_slice(body);
    out
}

/// The body of a RocksDB value named `what`, after checking its version.
pub fn value_body<'a>(bytes: &'a [u8], what: &str) -> Result<&'a [u8]> {
    match bytes {
        [VALUE_V1, body @ ..] => Ok(body),
        [version, ..] => Err(unknown(what, *version)),
        [] => Err(Error::Format(format!("{what}: empty value"))),
    }
}

/// The body of a fixed-size RocksDB value named `what`.
pub fn value_array<const N: usize>(bytes: &[u8], what: &str) -> Result<[u8; N]> {
    let body = value_body(bytes, what)?;
    body.try_into().map_err(|_| Error::Format(format!("{what}: {} bytes, expected {N}", body.len())))
}

/// Checks a [`PRESENT`] value.
pub fn check_present(bytes: &[u8], what: &str) -> Result<()> {
    match value_body(bytes, what)? {
        [] => Ok(()),
        body => Err(Error::Format(format!("{what}: {} unexpected bytes", body.len()))),
    }
}

/// A versioned little-endian i64 value.
pub fn i64_value(value: i64) -> [u8; 9] {
    let mut out = [VALUE_V1; 9];
    out[1..].copy_from_slice(&value.to_le_bytes());
    out
}

/// Decodes an [`i64_value`].
pub fn decode_i64_value(bytes: &[u8], what: &str) -> Result<i64> {
    value_array::<8>(bytes, what).map(i64::from_le_bytes)
}

/// Decodes a JSON record named `what` whose version (`version(&record)`) must be
/// [`JSON_V1`]: anything else is an error.
pub fn decode_json<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str, version: impl Fn(&T) -> u32) -> Result<T> {
    let record: T = serde_json::from_slice(bytes).map_err(|err| Error::Format(format!("{what}: {err}")))?;
    check_json_version(version(&record), JSON_V1, what)?;
    Ok(record)
}

/// Checks a JSON record's `"v"`: only `known` is accepted.
pub fn check_json_version(found: u32, known: u32, what: &str) -> Result<()> {
    if found == known {
        Ok(())
    } else {
        Err(Error::Format(format!("{what}: format version {found}, this build reads version {known}")))
    }
}

fn unknown(what: &str, version: u8) -> Error {
    Error::Format(format!("{what}: unknown format version {version} (a newer tally wrote it, or it is corrupt)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_versions_are_checked() {
        assert_eq!(record_body(&[RECORD_MAGIC, RECORD_V1, 7, 8], "r").unwrap(), &[7, 8]);
        let newer = record_body(&[RECORD_MAGIC, 3, 7], "graph-updates record").unwrap_err().to_string();
        assert!(newer.contains("unknown format version 3"), "{newer}");
        assert_eq!(shard_record_body(&[RECORD_MAGIC, RECORD_V2, 9]).unwrap(), (RECORD_V2, &[9u8][..]));
        assert_eq!(shard_record_body(&[RECORD_MAGIC, RECORD_V1, 9]).unwrap(), (RECORD_V1, &[9u8][..]));
        let newer = shard_record_body(&[RECORD_MAGIC, 3, 7]).unwrap_err().to_string();
        assert!(newer.contains("shard record: unknown format version 3"), "{newer}");
        assert!(record_body(&[1, 2, 3], "r").unwrap_err().to_string().contains("not a tally record"));
        assert!(record_body(&[], "r").is_err());

        assert_eq!(decode_i64_value(&i64_value(-5), "n").unwrap(), -5);
        assert!(decode_i64_value(&(-5i64).to_le_bytes(), "n").is_err(), "an unversioned value");
        assert!(decode_i64_value(&[VALUE_V1, 1, 2], "n").unwrap_err().to_string().contains("2 bytes, expected 8"));
        assert!(value_body(&[], "v").is_err());
        assert_eq!(value_body(&value(b"ab"), "v").unwrap(), b"ab");
        assert!(check_json_version(2, 1, "owner").is_err());
        assert!(check_json_version(1, 1, "owner").is_ok());
    }
}
