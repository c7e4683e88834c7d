//! What a downstream consumer of `tally.rollups` keeps: per bucket, the record of
//! the newest shard position — not the last one delivered.
//!
//! A counter publishes rollups at least once, and a counter paused past its lease
//! (or cut off from Kafka) may deliver records it queued after the shard's new
//! owner delivered newer ones. Each record carries its shard's position
//! ([`RollupPosition`]; in the payload and, tombstones included, in the
//! [`ROLLUP_POSITION_HEADER`]), so the consumer keeps per key the record of the
//! highest position, in any order of delivery:
//!
//! - a higher offset wins; at an equal offset a tombstone wins over values (a
//!   bucket expires with time, which only moves forward), and between two values
//!   the later delivered (equal offsets read equal values);
//! - a record without a position (format version 1, from a build before positions)
//!   ranks below every positioned one;
//! - a tombstone removes the bucket but its position is kept, so a late value from
//!   before the expiry cannot bring it back;
//! - a record carries when its bucket expires: [`LatestRollups::expire`] drops the
//!   buckets past it without waiting for their tombstones.

use std::collections::HashMap;

use crate::wire::{Rollup, RollupPosition, ROLLUP_POSITION_HEADER};
use crate::{Error, Result};

/// The newest record of every rollup key seen.
#[derive(Debug, Default, Clone)]
pub struct LatestRollups {
    kept: HashMap<String, Kept>,
}

#[derive(Debug, Clone)]
struct Kept {
    rank: Rank,
    /// `None`: a tombstone.
    rollup: Option<Rollup>,
}

/// How records of one key are ordered: by position (none lowest), then a
/// tombstone above values.
type Rank = (Option<i64>, bool);

impl LatestRollups {
    pub fn new() -> Self {
        Self::default()
    }

    /// Offers a record of `key` read at `position` (`rollup` none: a tombstone).
    /// Returns whether it is now the key's newest.
    pub fn offer(&mut self, key: &str, position: Option<RollupPosition>, rollup: Option<Rollup>) -> bool {
        let rank = (position.map(|p| p.offset), rollup.is_none());
        match self.kept.get_mut(key) {
            Some(kept) if kept.rank > rank => false,
            Some(kept) => {
                *kept = Kept { rank, rollup };
                true
            }
            None => {
                self.kept.insert(key.to_string(), Kept { rank, rollup });
                true
            }
        }
    }

    /// Offers a record as read from the topic: its key, payload (none: a
    /// tombstone) and the value of its [`ROLLUP_POSITION_HEADER`] header, if any.
    /// An undecodable record is an error and changes nothing.
    pub fn offer_record(&mut self, key: &[u8], payload: Option<&[u8]>, position: Option<&[u8]>) -> Result<bool> {
        let key = std::str::from_utf8(key).map_err(|_| Error::Format("rollup key: not UTF-8".into()))?;
        let header = position.map(RollupPosition::from_header).transpose()?;
        let rollup = payload.map(Rollup::decode).transpose()?;
        if let Some(rollup) = &rollup {
            if rollup.key() != key {
                return Err(Error::Format(format!("rollup of {} under key {key}", rollup.key())));
            }
            if header.is_some() && rollup.position != header {
                return Err(Error::Format(format!("rollup {key}: header and payload positions differ")));
            }
        } else if header.is_none() {
            return Err(Error::Format(format!("rollup tombstone {key}: no {ROLLUP_POSITION_HEADER} header")));
        }
        let position = header.or_else(|| rollup.as_ref().and_then(|r| r.position));
        Ok(self.offer(key, position, rollup))
    }

    /// Treats every bucket whose `expires_at` is not after `now` as expired, as
    /// its tombstone would (which may come later); returns their keys.
    pub fn expire(&mut self, now: i64) -> Vec<String> {
        let mut expired = Vec::new();
        for (key, kept) in &mut self.kept {
            if kept.rollup.as_ref().and_then(|r| r.expires_at).is_some_and(|at| at <= now) {
                (kept.rollup, kept.rank.1) = (None, true);
                expired.push(key.clone());
            }
        }
        expired
    }

    /// The newest values of `key`, unless it expired (or was never seen).
    pub fn get(&self, key: &str) -> Option<&Rollup> {
        self.kept.get(key).and_then(|kept| kept.rollup.as_ref())
    }

    /// Every key whose newest record holds values, with them.
    pub fn live(&self) -> impl Iterator<Item = (&str, &Rollup)> {
        self.kept.iter().filter_map(|(key, kept)| Some((key.as_str(), kept.rollup.as_ref()?)))
    }

    /// Every key whose newest record is a tombstone.
    pub fn expired(&self) -> impl Iterator<Item = &str> {
        self.kept.iter().filter(|(_, kept)| kept.rollup.is_none()).map(|(key, _)| key.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// The record a shard at `offset` publishes for bucket `bucket` of `e`: its
    /// values depend on the offset alone (equal offsets, equal values), as a shard's
    /// do; `expired` makes it a tombstone.
    fn published(bucket: i64, offset: i64, expired: bool) -> (String, RollupPosition, Option<Rollup>) {
        let position = RollupPosition { shard: 0, offset };
        let rollup = Rollup {
            v: Rollup::V2,
            entity: "e".into(),
            metric: "m".into(),
            resolution: "1h".into(),
            bucket,
            total: i128::from(offset) * 3,
            direct: i128::from(offset),
            position: Some(position),
            expires_at: Some(bucket + 1_000),
        };
        (rollup.key(), position, (!expired).then_some(rollup))
    }

    proptest! {
        /// Whatever the order of delivery, and with repeats, what is kept of each
        /// key is what a brute force finds: the record of the highest position, a
        /// tombstone above values at the same position.
        #[test]
        fn keeps_the_newest_record_of_every_key_in_any_delivery_order(
            records in prop::collection::vec((0i64..4, 0i64..20, prop::bool::weighted(0.2)), 1..60),
            order in prop::collection::vec(any::<prop::sample::Index>(), 0..120),
        ) {
            let all: Vec<_> = records.iter().map(|&(bucket, offset, expired)| published(bucket, offset, expired)).collect();
            // Every record once, then repeats in any order.
            let mut deliveries: Vec<usize> = (0..all.len()).rev().collect();
            deliveries.extend(order.iter().map(|index| index.index(all.len())));
            let mut latest = LatestRollups::new();
            for &at in &deliveries {
                let (key, position, rollup) = all[at].clone();
                latest.offer(&key, Some(position), rollup);
            }
            let mut want: BTreeMap<String, (i64, bool)> = BTreeMap::new();
            for (key, position, rollup) in &all {
                let rank = (position.offset, rollup.is_none());
                let best = want.entry(key.clone()).or_insert(rank);
                *best = (*best).max(rank);
            }
            let want_live: BTreeMap<String, Rollup> = want
                .iter()
                .filter(|(_, (_, expired))| !expired)
                .map(|(key, &(offset, _))| {
                    let bucket = all.iter().find(|(k, _, _)| k == key).and_then(|(_, _, r)| r.as_ref().map(|r| r.bucket));
                    let bucket = bucket.unwrap_or_else(|| key.rsplit('/').next().unwrap().parse().unwrap());
                    (key.clone(), published(bucket, offset, false).2.unwrap())
                })
                .collect();
            let got: BTreeMap<String, Rollup> = latest.live().map(|(k, r)| (k.to_string(), r.clone())).collect();
            prop_assert_eq!(got, want_live);
            let want_expired: Vec<&String> = want.iter().filter(|(_, (_, expired))| *expired).map(|(k, _)| k).collect();
            let mut got_expired: Vec<&str> = latest.expired().collect();
            got_expired.sort();
            prop_assert_eq!(got_expired, want_expired);
        }
    }

    #[test]
    fn buckets_past_their_expiry_are_dropped_before_their_tombstones() {
        let mut latest = LatestRollups::new();
        for bucket in [0, 10_000] {
            let (key, position, rollup) = published(bucket, 5, false);
            latest.offer(&key, Some(position), rollup);
        }
        let (first, _, _) = published(0, 5, false);
        assert_eq!(latest.expire(999), Vec::<String>::new());
        assert_eq!(latest.expire(1_000), vec![first.clone()]);
        assert_eq!(latest.expired().collect::<Vec<_>>(), vec![first.as_str()]);
        assert_eq!(latest.live().count(), 1);
        // Its value again, late, at the same position: still gone.
        let (key, position, rollup) = published(0, 5, false);
        assert!(!latest.offer(&key, Some(position), rollup));
    }

    #[test]
    fn a_record_from_before_positions_never_replaces_a_positioned_one() {
        let (key, position, rollup) = published(0, 5, false);
        let mut old = rollup.clone().unwrap();
        (old.v, old.position, old.total) = (crate::format::JSON_V1, None, 1);
        let mut latest = LatestRollups::new();
        assert!(latest.offer(&key, None, Some(old.clone())));
        assert!(latest.offer(&key, Some(position), rollup.clone()));
        assert!(!latest.offer(&key, None, Some(old)));
        assert_eq!(latest.get(&key), rollup.as_ref());
    }

    #[test]
    fn records_are_read_from_the_topic_with_their_headers() {
        let (key, position, rollup) = published(0, 5, false);
        let payload = serde_json::to_vec(&rollup).unwrap();
        let header = position.header_value();
        let mut latest = LatestRollups::new();
        assert!(latest.offer_record(key.as_bytes(), Some(&payload), Some(&header)).unwrap());
        // A late record of an older position, then a tombstone of a newer one.
        let (_, old_position, old) = published(0, 4, false);
        let old_payload = serde_json::to_vec(&old).unwrap();
        assert!(!latest.offer_record(key.as_bytes(), Some(&old_payload), Some(&old_position.header_value())).unwrap());
        assert_eq!(latest.get(&key), rollup.as_ref());
        let newer = RollupPosition { shard: 0, offset: 9 }.header_value();
        assert!(latest.offer_record(key.as_bytes(), None, Some(&newer)).unwrap());
        assert_eq!((latest.get(&key), latest.expired().collect::<Vec<_>>()), (None, vec![key.as_str()]));

        // Refused, each with its reason, and nothing changes.
        let refusals = [
            (b"other/m/1h/0".as_slice(), Some(payload.as_slice()), Some(header.as_slice()), "under key"),
            (key.as_bytes(), Some(payload.as_slice()), Some(newer.as_slice()), "positions differ"),
            (key.as_bytes(), None, None, "no tally.position.v1 header"),
            (key.as_bytes(), Some(b"{}".as_slice()), None, "rollup: missing field"),
            (key.as_bytes(), None, Some(b"7".as_slice()), "tally.position.v1: invalid type"),
        ];
        for (key, payload, header, reason) in refusals {
            let err = latest.offer_record(key, payload, header).unwrap_err().to_string();
            assert!(err.contains(reason), "{err}");
        }
        assert_eq!(latest.expired().count() + latest.live().count(), 1);
    }

    #[test]
    fn rollups_of_other_versions_are_refused() {
        let (_, _, rollup) = published(0, 5, false);
        let mut rollup = rollup.unwrap();
        rollup.v = 3;
        let err = Rollup::decode(&serde_json::to_vec(&rollup).unwrap()).unwrap_err().to_string();
        assert!(err.contains("format version 3, this build reads versions 1 and 2"), "{err}");
        rollup.v = Rollup::V2;
        rollup.position = None;
        let err = Rollup::decode(&serde_json::to_vec(&rollup).unwrap()).unwrap_err().to_string();
        assert!(err.contains("version 2 without a position"), "{err}");
    }
}
