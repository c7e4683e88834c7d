//! Control records: shard ownership claims and membership heartbeats.

use serde::{Deserialize, Serialize};

use crate::Result;

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
