//! Rollups: the latest values of changed buckets, with their shard's position.

use serde::{Deserialize, Serialize};

use crate::keys::Count;
use crate::{Error, Result};

/// A record of `tally.rollups`: a bucket's values as its shard held them
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
