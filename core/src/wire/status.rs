//! What a counter holds and how fresh it is.

use serde::{Deserialize, Serialize};

/// What a counter holds and how fresh it is (`GET /internal/v1/status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterStatus {
    pub shards: Vec<ShardStatus>,
}

/// One held shard of a counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardStatus {
    pub shard: u32,
    pub state: ShardState,
    /// Records of the shard's log not applied yet, when last measured (about once
    /// a second), and when.
    pub lag: Option<i64>,
    pub lag_at_ms: Option<i64>,
    /// The next offset of the shard's log it applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<i64>,
    /// How much newer input it may be missing, in ms: 0 up to when it was last
    /// seen caught up with its log, else the age of the newest input it applied
    /// (none: not known yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_ms: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardState {
    /// Caught up with the log and answering reads.
    Serving,
    /// Newly taken: applying the log up to where it ended at assignment.
    CatchingUp,
    /// Stopped by a failure until an operator acts.
    Failed,
    /// Applying the log of a shard another counter owns, to take over without a
    /// restore: answering only reads that allow staleness while the owner is silent.
    Standby,
}

/// `POST /internal/v1/positions` on a counter (its `shards`) or on the graph (no
/// shards): how far each has applied its log, relayed what that sent on, and taken
/// each of `sources` — what a read with a write token waits for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PositionsRequest {
    #[serde(default)]
    pub shards: Vec<u32>,
    pub sources: Vec<crate::position::Source>,
    /// What the asker last saw of each shard, in order (`applied`, `relayed`): the
    /// answer waits up to `wait_ms` for one of them to move (a long poll).
    #[serde(default)]
    pub seen: Vec<Option<(i64, i64)>>,
    #[serde(default)]
    pub wait_ms: u64,
}

impl PositionsRequest {
    /// The most shards one request names.
    pub const MAX_SHARDS: usize = 4096;
    /// The most sources one request names (a read takes at most as many tokens).
    pub const MAX_SOURCES: usize = 64;
    /// The longest a request may wait for a change.
    pub const MAX_WAIT_MS: u64 = 1_000;

    /// Refuses a request past the bounds, saying which.
    pub fn check(&self) -> Result<(), String> {
        if self.shards.len() > Self::MAX_SHARDS {
            return Err(format!("{} shards: at most {} in one request", self.shards.len(), Self::MAX_SHARDS));
        }
        if self.sources.len() > Self::MAX_SOURCES {
            return Err(format!("{} sources: at most {} in one request", self.sources.len(), Self::MAX_SOURCES));
        }
        if self.seen.len() > self.shards.len() || self.wait_ms > Self::MAX_WAIT_MS {
            return Err(format!("seen: at most one per shard; wait_ms: at most {}", Self::MAX_WAIT_MS));
        }
        Ok(())
    }
}

/// The answer to a [`PositionsRequest`]: one per shard asked (one for the graph).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PositionsResponse {
    pub positions: Vec<StorePositions>,
}

/// Where one store stands, or why it cannot say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorePositions {
    Served(Positions),
    /// Not served here (not owned, or still catching up): ask its owner.
    NotOwner,
    Failed {
        message: String,
    },
}

/// One store's positions: `applied` and `high_water` from one committed state,
/// `relayed` read after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Positions {
    /// The next offset of its log to apply.
    pub applied: i64,
    /// Everything it sent on (its outbox) because of records before this offset is
    /// acknowledged by the broker.
    pub relayed: i64,
    /// Its high-water stamp of each source asked, in the order asked.
    pub high_water: Vec<Option<crate::position::Stamp>>,
}
