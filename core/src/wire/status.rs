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
}
