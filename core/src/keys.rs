//! Byte layout of RocksDB keys and values in the stores (values are versioned,
//! [`crate::format`]).
//!
//! A count key is `entity 0x00 metric 0x00 width(u64 BE) bucket(i64 BE, sign-flipped)`.
//! Entities and metrics hold no NUL, so keys of one entity are contiguous and sorted
//! by metric, then resolution (the all-time bucket, width 0, first), then bucket time:
//! an entity's metrics and a counter's buckets are prefix scans.

use crate::position::{Source, Stamp};

/// Width used for the all-time bucket.
pub const ALL_TIME_WIDTH: i64 = 0;

const SEPARATOR: u8 = 0;
const SIGN_BIT: u64 = 1 << 63;

/// Appends the key of one bucket of one counter to `buf`.
pub fn encode_count_key(buf: &mut Vec<u8>, entity: &str, metric: &str, width_ms: i64, bucket: i64) {
    encode_resolution_prefix(buf, entity, metric, width_ms);
    buf.extend_from_slice(&((bucket as u64) ^ SIGN_BIT).to_be_bytes());
}

/// Appends the prefix shared by every bucket of one resolution of one counter.
pub fn encode_resolution_prefix(buf: &mut Vec<u8>, entity: &str, metric: &str, width_ms: i64) {
    encode_metric_prefix(buf, entity, metric);
    buf.extend_from_slice(&(width_ms as u64).to_be_bytes());
}

/// Appends the prefix shared by every key of one counter.
pub fn encode_metric_prefix(buf: &mut Vec<u8>, entity: &str, metric: &str) {
    encode_entity_prefix(buf, entity);
    buf.extend_from_slice(metric.as_bytes());
    buf.push(SEPARATOR);
}

/// Appends the prefix shared by every key of one entity.
pub fn encode_entity_prefix(buf: &mut Vec<u8>, entity: &str) {
    buf.extend_from_slice(entity.as_bytes());
    buf.push(SEPARATOR);
}

/// A decoded count key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountKey<'a> {
    pub entity: &'a str,
    pub metric: &'a str,
    pub width_ms: i64,
    pub bucket: i64,
}

/// Decodes a count key; `None` when the bytes are not one.
pub fn decode_count_key(key: &[u8]) -> Option<CountKey<'_>> {
    let entity_end = key.iter().position(|&b| b == SEPARATOR)?;
    let rest = &key[entity_end + 1..];
    let metric_end = rest.iter().position(|&b| b == SEPARATOR)?;
    let tail = &rest[metric_end + 1..];
    if tail.len() != 16 {
        return None;
    }
    let width = u64::from_be_bytes(tail[..8].try_into().ok()?);
    let bucket = u64::from_be_bytes(tail[8..].try_into().ok()?) ^ SIGN_BIT;
    Some(CountKey {
        entity: std::str::from_utf8(&key[..entity_end]).ok()?,
        metric: std::str::from_utf8(&rest[..metric_end]).ok()?,
        width_ms: width as i64,
        bucket: bucket as i64,
    })
}

/// Decodes a count key read from a store: bytes that are not one are corrupt.
pub fn parse_count_key(key: &[u8]) -> crate::Result<CountKey<'_>> {
    decode_count_key(key).ok_or_else(|| crate::Error::Format(format!("count key {key:?}: malformed")))
}

/// Appends the key of an idempotency mark: `entity 0x00 id`.
pub fn encode_dedupe_key(buf: &mut Vec<u8>, entity: &str, id: &str) {
    encode_entity_prefix(buf, entity);
    buf.extend_from_slice(id.as_bytes());
}

/// A sorted list of entity names (an origin's descendant view): the version byte,
/// then bincode.
pub fn encode_names(names: &[String]) -> crate::Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_names_into(names, &mut out)?;
    Ok(out)
}

/// [`encode_names`], appended to `out` (a buffer reused from view to view).
pub fn encode_names_into(names: &[String], out: &mut Vec<u8>) -> crate::Result<()> {
    out.push(crate::format::VALUE_V1);
    bincode::serde::encode_into_std_write(names, out, bincode::config::standard())
        .map_err(|err| crate::Error::Format(format!("descendant view: {err}")))?;
    Ok(())
}

/// Decodes [`encode_names`]; anything else is an error.
pub fn decode_names(bytes: &[u8]) -> crate::Result<Vec<String>> {
    let body = crate::format::value_body(bytes, "descendant view")?;
    match bincode::serde::decode_from_slice(body, bincode::config::standard()) {
        Ok((names, used)) if used == body.len() => Ok(names),
        Ok(_) => Err(crate::Error::Format("descendant view: trailing bytes".into())),
        Err(err) => Err(crate::Error::Format(format!("descendant view: {err}"))),
    }
}

/// The value of an idempotency mark first seen in a record of `source` at
/// `record_time`: the version byte, the time (8 bytes), the source's stream (1) and
/// partition (4), little-endian.
pub fn encode_mark(record_time: i64, source: Source) -> [u8; 14] {
    let mut mark = [crate::format::VALUE_V1; 14];
    mark[1..9].copy_from_slice(&record_time.to_le_bytes());
    mark[9] = source.stream;
    mark[10..].copy_from_slice(&source.partition.to_le_bytes());
    mark
}

/// The time and source of a stored mark; anything else is an error.
pub fn decode_mark(mark: &[u8]) -> crate::Result<(i64, Source)> {
    let body: [u8; 13] = crate::format::value_array(mark, "idempotency mark")?;
    let (mut time, mut partition) = ([0u8; 8], [0u8; 4]);
    time.copy_from_slice(&body[..8]);
    partition.copy_from_slice(&body[9..]);
    Ok((i64::from_le_bytes(time), Source { stream: body[8], partition: u32::from_le_bytes(partition) }))
}

/// A high-water stamp's value: the version byte, the offset (8 bytes) and the
/// index (4 bytes), little-endian.
pub fn encode_stamp(stamp: Stamp) -> [u8; 13] {
    let mut out = [crate::format::VALUE_V1; 13];
    out[1..9].copy_from_slice(&stamp.offset.to_le_bytes());
    out[9..].copy_from_slice(&stamp.index.to_le_bytes());
    out
}

/// Decodes [`encode_stamp`]; anything else is an error.
pub fn decode_stamp(bytes: &[u8]) -> crate::Result<Stamp> {
    let body: [u8; 12] = crate::format::value_array(bytes, "high-water stamp")?;
    let (mut offset, mut index) = ([0u8; 8], [0u8; 4]);
    offset.copy_from_slice(&body[..8]);
    index.copy_from_slice(&body[8..]);
    Ok(Stamp { offset: i64::from_le_bytes(offset), index: u32::from_le_bytes(index) })
}

/// An accumulated count: a sum of bounded deltas (|delta| ≤ 2^63, and at most the
/// ingesters' `max_abs_delta`, 2^53 by default), kept in 128 bits so that no number of
/// increments a deployment can make wraps it: reaching the bounds of an i128 takes
/// more than 2^64 increments of the largest delta.
pub type Count = i128;

/// Counts add up field by field. They cannot reach an i128's bounds ([`Count`]);
/// saturating rather than wrapping keeps even that impossible case from turning a sum
/// negative, and the merge associative for every sum that can occur.
impl std::ops::Add for Counts {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self { direct: self.direct.saturating_add(other.direct), total: self.total.saturating_add(other.total) }
    }
}

/// The bytes of an encoded [`Counts`], on the stack (one is written per merge).
#[derive(Debug, Clone, Copy)]
pub struct EncodedCounts {
    bytes: [u8; Counts::V2_LEN],
    len: usize,
}

impl AsRef<[u8]> for EncodedCounts {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl std::ops::Deref for EncodedCounts {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

/// The stored value of a bucket: its direct and total counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub direct: Count,
    pub total: Count,
}

impl Counts {
    /// What one increment of `delta` adds to its own entity's bucket.
    pub fn increment(delta: i64) -> Self {
        Self { direct: delta.into(), total: delta.into() }
    }

    /// What a descendant change of `delta` adds to a bucket: to its total only.
    pub fn descendant(delta: Count) -> Self {
        Self { direct: 0, total: delta }
    }

    /// A value in version 1: the version byte, then direct and total as i64s
    /// (little-endian) — what counts that fit in an i64 are written in.
    const V1_LEN: usize = 17;
    /// A value in version 2: the version byte, then direct and total as i128s
    /// (little-endian) — written only for counts beyond an i64's range.
    const V2_LEN: usize = 33;

    /// The value's bytes: version 1 while both counts fit in an i64, else version 2.
    /// Every value of a store written before counts were wider reads the same.
    pub fn encode(self) -> EncodedCounts {
        let mut bytes = [0u8; Self::V2_LEN];
        let len = match (i64::try_from(self.direct), i64::try_from(self.total)) {
            (Ok(direct), Ok(total)) => {
                bytes[0] = crate::format::VALUE_V1;
                bytes[1..9].copy_from_slice(&direct.to_le_bytes());
                bytes[9..17].copy_from_slice(&total.to_le_bytes());
                Self::V1_LEN
            }
            _ => {
                bytes[0] = crate::format::VALUE_V2;
                bytes[1..17].copy_from_slice(&self.direct.to_le_bytes());
                bytes[17..].copy_from_slice(&self.total.to_le_bytes());
                Self::V2_LEN
            }
        };
        EncodedCounts { bytes, len }
    }

    /// Decodes a value of either version; malformed bytes are an error, never zero.
    pub fn decode(bytes: &[u8]) -> crate::Result<Self> {
        const WHAT: &str = "counts value";
        if let [crate::format::VALUE_V2, body @ ..] = bytes {
            let body: [u8; 32] = body
                .try_into()
                .map_err(|_| crate::Error::Format(format!("{WHAT} (version 2): {} bytes, expected 32", body.len())))?;
            let (mut direct, mut total) = ([0u8; 16], [0u8; 16]);
            direct.copy_from_slice(&body[..16]);
            total.copy_from_slice(&body[16..]);
            return Ok(Self { direct: i128::from_le_bytes(direct), total: i128::from_le_bytes(total) });
        }
        let body: [u8; 16] = crate::format::value_array(bytes, WHAT)?;
        let (mut direct, mut total) = ([0u8; 8], [0u8; 8]);
        direct.copy_from_slice(&body[..8]);
        total.copy_from_slice(&body[8..]);
        Ok(Self { direct: i64::from_le_bytes(direct).into(), total: i64::from_le_bytes(total).into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(entity: &str, metric: &str, width: i64, bucket: i64) -> Vec<u8> {
        let mut buf = Vec::new();
        encode_count_key(&mut buf, entity, metric, width, bucket);
        buf
    }

    #[test]
    fn all_time_sorts_first_within_a_metric() {
        assert!(key("e", "m", ALL_TIME_WIDTH, 0) < key("e", "m", 60_000, -5));
        assert!(key("e", "m", 60_000, 1) < key("e", "m2", ALL_TIME_WIDTH, 0));
        assert!(key("e", "z", 60_000, 1) < key("e2", "a", ALL_TIME_WIDTH, 0));
    }

    proptest! {
        #[test]
        fn count_keys_round_trip(entity in "[^\\x00]{1,40}", metric in "[a-z0-9_.:-]{1,64}", width in 0i64..i64::MAX, bucket in any::<i64>()) {
            let bytes = key(&entity, &metric, width, bucket);
            let decoded = decode_count_key(&bytes).unwrap();
            prop_assert_eq!(decoded, CountKey { entity: &entity, metric: &metric, width_ms: width, bucket });
        }

        #[test]
        fn buckets_sort_in_time_order(a in any::<i64>(), b in any::<i64>()) {
            prop_assert_eq!(key("e", "m", 60_000, a).cmp(&key("e", "m", 60_000, b)), a.cmp(&b));
        }

        #[test]
        fn keys_of_an_entity_share_its_prefix(entity in "[a-z:0-9]{1,10}", other in "[a-z:0-9]{1,10}", metric in "[a-z]{1,5}") {
            let mut prefix = Vec::new();
            encode_entity_prefix(&mut prefix, &entity);
            prop_assert!(key(&entity, &metric, 0, 0).starts_with(&prefix));
            prop_assert_eq!(key(&other, &metric, 0, 0).starts_with(&prefix), other == entity);
        }

        #[test]
        fn counts_round_trip_and_add(d in any::<i64>(), t in any::<i64>(), d2 in any::<i64>(), wide in any::<i128>()) {
            let a = Counts { direct: d.into(), total: t.into() };
            prop_assert_eq!(a.encode().len(), 17, "counts within an i64 keep version 1");
            prop_assert_eq!(Counts::decode(&a.encode()).unwrap(), a);
            let b = Counts { direct: d2.into(), total: wide };
            prop_assert_eq!(Counts::decode(&b.encode()).unwrap(), b);
            prop_assert_eq!(a + b, b + a);
        }

        #[test]
        fn sums_of_bounded_deltas_are_exact(deltas in proptest::collection::vec(any::<i64>(), 1..64)) {
            let sum = deltas.iter().fold(Counts::default(), |sum, &d| sum + Counts { direct: d.into(), total: d.into() });
            let exact: i128 = deltas.iter().map(|&d| i128::from(d)).sum();
            prop_assert_eq!(sum, Counts { direct: exact, total: exact });
            prop_assert_eq!(Counts::decode(&sum.encode()).unwrap(), sum);
        }
    }

    #[test]
    fn garbage_keys_do_not_decode() {
        assert!(decode_count_key(b"no separators").is_none());
        assert!(decode_count_key(b"e\0m\0short").is_none());
        assert!(Counts::decode(b"bad").is_err());
        assert!(Counts::decode(&[0; 16]).is_err(), "unversioned");
        assert!(Counts::decode(&[2; 17]).is_err(), "version 2 of the wrong length");
        assert!(Counts::decode(&[3; 33]).is_err(), "a newer version");
    }
}
