//! The internal read APIs: counters' reads and metric listings, `tally-graph`'s
//! neighbours and ancestors.

use serde::{Deserialize, Serialize};

use super::codec::{decode, decode_body, encode, encode_version};
use crate::keys::Count;
use crate::segments::Selector;
use crate::time::WindowSpec;
use crate::Result;

/// `kind` of a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    #[default]
    Total,
    Direct,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Total => "total",
            Kind::Direct => "direct",
        }
    }
}

/// One question to a counter shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardQuery {
    pub entity: String,
    pub metric: String,
    pub kind: Kind,
    pub spec: WindowSpec,
    /// A segment query ([`crate::segments`]): answered with
    /// [`ShardAnswer::Segments`], the shard summing the combinations it selects.
    #[serde(default)]
    pub segments: Option<Selector>,
}

impl ShardQuery {
    /// A question about the counter itself, no segments.
    pub fn plain(entity: String, metric: String, kind: Kind, spec: WindowSpec) -> Self {
        Self { entity, metric, kind, spec, segments: None }
    }
}

/// A [`ShardQuery`] as version 1 of a read request holds it (no segments).
#[derive(Serialize, Deserialize)]
struct ShardQueryV1<E, M> {
    entity: E,
    metric: M,
    kind: Kind,
    spec: WindowSpec,
}

/// A [`ReadRequest`] in version 1.
#[derive(Serialize, Deserialize)]
struct ReadRequestV1<E, M> {
    now_ms: i64,
    shards: Vec<(u32, Vec<ShardQueryV1<E, M>>)>,
}

/// The internal read API tally-query uses: the questions for every shard one
/// counter owns, in one request (a batch of 100 over 8 shards is one round trip, not
/// eight). Each shard is answered from one snapshot of its store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    /// The clock of the request, so every answer of a batch uses the same `now`.
    pub now_ms: i64,
    pub shards: Vec<ShardQueries>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardQueries {
    pub shard: u32,
    pub queries: Vec<ShardQuery>,
}

/// One outcome per shard asked, in request order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadResponse {
    pub shards: Vec<ShardOutcome>,
}

/// A read's outcomes with how fresh each shard answered from was: what read
/// link version 2 carries back (version 1 carries [`ReadResponse`]), and the JSON
/// read route's answer (`as_of` is ignored by a reader that does not know it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreshReadResponse {
    pub shards: Vec<ShardOutcome>,
    /// For each outcome, in order: the freshness of the store its answers come
    /// from (none: no answers).
    #[serde(default)]
    pub as_of: Vec<Option<ShardAsOf>>,
}

/// How fresh a shard's store was when a read was answered from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardAsOf {
    /// The next offset of the shard's log it applies: everything below was in the
    /// answer.
    pub applied: i64,
    /// How much newer input it may be missing, in ms (none: not known yet).
    pub lag_ms: Option<i64>,
}

impl FreshReadResponse {
    /// The binary form read link version 2 carries, as [`ReadRequest::encode`].
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes, "read response")
    }

    /// The outcomes alone, for read link version 1.
    pub fn without_freshness(self) -> ReadResponse {
        ReadResponse { shards: self.shards }
    }
}

impl ReadRequest {
    /// The binary form the read link carries (`tally_shared::read_link`): the
    /// record header ([`crate::format`]), then bincode. Version 1 (what every
    /// counter reads) unless a query selects segments; then version 2, which adds
    /// each query's `segments` (a counter that reads only version 1 refuses it).
    pub fn encode(&self) -> Result<Vec<u8>> {
        if self.shards.iter().any(|shard| shard.queries.iter().any(|query| query.segments.is_some())) {
            return encode_version(self, crate::format::RECORD_V2);
        }
        let shards = self
            .shards
            .iter()
            .map(|shard| {
                let queries = shard
                    .queries
                    .iter()
                    .map(|q| ShardQueryV1 {
                        entity: q.entity.as_str(),
                        metric: q.metric.as_str(),
                        kind: q.kind,
                        spec: q.spec,
                    })
                    .collect();
                (shard.shard, queries)
            })
            .collect();
        encode(&ReadRequestV1 { now_ms: self.now_ms, shards })
    }

    /// Decodes version 1 or 2.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        const WHAT: &str = "read request";
        if let [crate::format::RECORD_MAGIC, crate::format::RECORD_V2, body @ ..] = bytes {
            return decode_body(body, WHAT);
        }
        let v1: ReadRequestV1<String, String> = decode(bytes, WHAT)?;
        let shards = v1
            .shards
            .into_iter()
            .map(|(shard, queries)| ShardQueries {
                shard,
                queries: queries.into_iter().map(|q| ShardQuery::plain(q.entity, q.metric, q.kind, q.spec)).collect(),
            })
            .collect();
        Ok(Self { now_ms: v1.now_ms, shards })
    }
}

impl ReadResponse {
    /// The binary form the read link carries, as [`ReadRequest::encode`].
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        decode(bytes, "read response")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardOutcome {
    /// Answers in the order of the shard's queries.
    Answers { answers: Vec<ShardAnswer> },
    /// Not served here now (another owner, catching up, lease lapsed): ask the owner
    /// of a newer claim.
    NotOwner,
    /// Stopped by a failure until an operator acts.
    Failed { message: String },
    /// Could not be read now (a storage error).
    Unavailable { message: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardAnswer {
    Window {
        value: Count,
        resolution: String,
        from: i64,
        to: i64,
    },
    Series {
        resolution: String,
        points: Vec<(i64, Count)>,
    },
    Error {
        code: String,
        message: String,
    },
    /// A segment query's sums: per group (the value of its `by` dimension, or one
    /// group "" without), one count per point — a window's one, a series' each, the
    /// points `step` apart from `from` — and what its metric's overflow combination
    /// holds over the same points (counts past the cap of combinations, of any segment).
    Segments {
        resolution: String,
        from: i64,
        to: i64,
        step: i64,
        groups: Vec<(String, Vec<Count>)>,
        overflow: Vec<Count>,
    },
}

/// The internal metrics-listing API of a shard.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardMetricsRequest {
    pub shard: u32,
    pub entity: String,
    /// List metrics strictly after this one.
    pub after: Option<String>,
    pub limit: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricTotals {
    pub metric: String,
    pub total: Count,
    pub direct: Count,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardMetricsResponse {
    pub metrics: Vec<MetricTotals>,
    /// Whether more metrics follow the last one returned.
    pub more: bool,
}

/// The internal neighbours API of `tally-graph`: one page of an entity's direct
/// neighbours, sorted, strictly after `after`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphNeighboursRequest {
    pub entity: String,
    /// Out-edges (`descendants` direction) when true, in-edges otherwise.
    pub outgoing: bool,
    pub after: Option<String>,
    pub limit: usize,
}

/// `tally-graph`'s ancestors of an entity (`POST /internal/v1/graph/ancestors`):
/// every entity that reaches it, sorted, at most `limit` (`more` says when there are
/// more). Answered with a [`GraphNeighboursResponse`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphAncestorsRequest {
    pub entity: String,
    /// At most [`GraphAncestorsRequest::MAX_LIMIT`].
    pub limit: usize,
}

impl GraphAncestorsRequest {
    /// The longest walk `tally-graph` takes for one request (a contributors listing
    /// ranks at most this many ancestors).
    pub const MAX_LIMIT: usize = 100_000;
}

impl GraphNeighboursRequest {
    /// The largest page of neighbours `tally-graph` answers.
    pub const MAX_LIMIT: usize = 1_000;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphNeighboursResponse {
    pub entities: Vec<String>,
    /// Whether more neighbours follow the last one returned.
    pub more: bool,
}
