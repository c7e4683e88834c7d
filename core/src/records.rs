//! Records that fit the broker: every producer path of tally builds its records
//! through here, so no record is ever refused for its size.
//!
//! A broker refuses a record over its limit (`message.max.bytes`, 1 MB by default),
//! and a producer that cannot deliver a record cannot move past it: the service
//! stalls. So internal messages are *split* into several records by an upper bound
//! of their encoded size ([`split_by_size`]), and records that hold something a
//! user gave us — a rejected payload, a job and its error — are *truncated* to fit,
//! the truncation stated in the record itself ([`Truncated`]).

use std::collections::BTreeMap;

/// The broker's default limit on one record (Kafka's `message.max.bytes`).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;

/// Room kept in every record for its key, headers and the framing around it.
pub const RECORD_OVERHEAD_BYTES: usize = 4_096;

/// An upper bound of the encoded size of a string (a varint length, then the bytes),
/// in bincode and in the compact encoding of shard records alike.
pub fn str_bound(s: &str) -> usize {
    s.len() + 9
}

/// An upper bound of the encoded size of any 64-bit integer (a varint, in either
/// encoding).
pub const INT_BOUND: usize = 10;
/// The most bytes one 128-bit integer ([`crate::keys::Count`]) takes in bincode's
/// variable-length encoding (a tag byte, then 16).
pub const WIDE_INT_BOUND: usize = 17;

/// Splits `entries` into consecutive runs whose bounds (`size_of`) add up to at most
/// `budget`. An entry bigger than the budget on its own makes a run of its own
/// (callers keep single entries well under it).
pub fn split_by_size<T>(entries: &[T], budget: usize, size_of: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut runs = Vec::new();
    let (mut start, mut used) = (0, 0usize);
    for (i, entry) in entries.iter().enumerate() {
        let size = size_of(entry);
        if i > start && used + size > budget {
            runs.push(&entries[start..i]);
            (start, used) = (i, 0);
        }
        used += size;
    }
    if start < entries.len() {
        runs.push(&entries[start..]);
    }
    runs
}

/// What a record had to leave out to fit: field name → its original size in bytes.
/// Serialized as `"truncated": {"payload": 800000}`; absent when nothing was cut.
pub type Truncated = BTreeMap<String, usize>;

/// The longest prefix of `s` of at most `max` bytes that ends on a char boundary.
pub fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Runs cover every entry once, in order, and stay within the budget unless a
        /// single entry is bigger than it.
        #[test]
        fn runs_cover_everything_within_the_budget(sizes in proptest::collection::vec(0usize..300, 0..200), budget in 1usize..1_000) {
            let runs = split_by_size(&sizes, budget, |s| *s);
            let flat: Vec<usize> = runs.iter().flat_map(|r| r.iter().copied()).collect();
            prop_assert_eq!(&flat, &sizes);
            for run in &runs {
                prop_assert!(!run.is_empty());
                let sum: usize = run.iter().sum();
                prop_assert!(sum <= budget || run.len() == 1, "run {:?} over {}", run, budget);
            }
        }
    }

    #[test]
    fn truncation_keeps_whole_chars() {
        assert_eq!(truncate_utf8("héllo", 2), "h");
        assert_eq!(truncate_utf8("héllo", 3), "hé");
        assert_eq!(truncate_utf8("abc", 10), "abc");
    }
}
