//! Reads at or after a write: `after=<token>[,<token>…]` with `max_wait_ms`. The
//! read waits until every shard it touches holds the written records' effects,
//! graph propagation included, or answers 504 `not_fresh_enough` saying how far it
//! got. Tokens of a job's record constrain no counter read.
//!
//! What "holds" means, stage by stage (each store's positions from
//! `POST /internal/v1/positions`, polled):
//! - an increment reaches its entity's shard through the ingester, which marks
//!   every shard with how far it routed each input partition: a `direct` read waits
//!   for its shards' marks to pass the token ([`WriteToken::covered_by`]);
//! - a `total` also holds what other shards relayed: every shard's mark passes the
//!   token, then every shard has relayed (its outbox acknowledged) what it applied
//!   up to then, then the read's shards apply their log up to its end as read after
//!   that (so every relayed record is in);
//! - an edge reaches the graph, which relays descendant changes to the shards, which
//!   relay totals: the graph's mark passes the token and it relayed what it applied;
//!   then every shard applies its log to the end read after that, and relays what it
//!   applied; then the read's shards apply theirs to the end, as above.
//!
//! A store answers only while it serves (a shard caught up after a take-over): one
//! never answers older than it did, so a read sent after the wait holds the writes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use futures::future::join_all;
use rdkafka::consumer::{BaseConsumer, Consumer};
use tally_core::position::token::{TokenTopic, WriteToken, MAX_TOKEN_LEN};
use tally_core::wire::{Kind, Positions, PositionsRequest, PositionsResponse, ShardOwner, Source, StorePositions};

use crate::error::ApiError;
use crate::fanout::Fanout;

/// The most tokens one read takes.
pub const MAX_TOKENS: usize = 64;
/// The longest a read may wait for its tokens.
pub const MAX_WAIT_MS: i64 = 60_000;
/// How long a read with tokens waits when it does not say.
pub const DEFAULT_WAIT_MS: i64 = 10_000;
/// The longest pause between two looks at a store that does not answer.
const MAX_POLL: Duration = Duration::from_millis(20);
/// The least time between two looks at the shard topic's ends (the broker's cost
/// of one grows with its log).
const LOOK_SPACING: Duration = Duration::from_millis(20);
/// How long a counter holds a look that has seen everything asked, for a change.
const LONG_POLL_MS: u64 = 500;
/// The longest one look at a store may take: a paused owner is asked again, or its
/// successor, soon.
const LOOK_TIMEOUT: Duration = Duration::from_secs(1);

/// The writes a read must include.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct After {
    /// By source, the last offset the read must hold.
    sources: BTreeMap<Source, i64>,
    pub max_wait: Duration,
}

/// A read's `after` and `max_wait_ms`, checked (`None`: read at once).
pub fn parse(after: Option<&str>, max_wait_ms: Option<i64>) -> Result<Option<After>, ApiError> {
    let max_wait_ms = match max_wait_ms {
        Some(ms) if !(1..=MAX_WAIT_MS).contains(&ms) => {
            return Err(ApiError::bad_request("invalid_max_wait", format!("max_wait_ms: must be 1 to {MAX_WAIT_MS}")))
        }
        Some(_) if after.is_none() => {
            return Err(ApiError::bad_request("invalid_max_wait", "max_wait_ms: only with after=<token>"))
        }
        ms => ms.unwrap_or(DEFAULT_WAIT_MS),
    };
    let Some(after) = after else { return Ok(None) };
    let tokens: Vec<&str> = after.split(',').collect();
    if tokens.len() > MAX_TOKENS || after.len() > MAX_TOKENS * (MAX_TOKEN_LEN + 1) {
        return Err(ApiError::bad_request("invalid_token", format!("after: at most {MAX_TOKENS} tokens")));
    }
    let mut sources = BTreeMap::new();
    for token in tokens {
        let token =
            WriteToken::decode(token).map_err(|err| ApiError::bad_request("invalid_token", format!("after: {err}")))?;
        if let Some(source) = token.source() {
            let offset = sources.entry(source).or_insert(token.offset);
            *offset = (*offset).max(token.offset);
        }
    }
    Ok(Some(After { sources, max_wait: Duration::from_millis(max_wait_ms as u64) }))
}

/// The shards a read touches, by what it reads there.
#[derive(Debug, Default, Clone)]
pub struct Touches {
    /// Shards read for direct counts alone.
    pub direct: BTreeSet<u32>,
    /// Shards read for totals (or descendants and ancestors).
    pub total: BTreeSet<u32>,
}

impl Touches {
    pub fn add(&mut self, shard: u32, kind: Kind) {
        match kind {
            Kind::Direct => self.direct.insert(shard),
            Kind::Total => self.total.insert(shard),
        };
    }
}

/// For `as_of`: per shard read, the last record of each source named by the
/// read's tokens that its answer holds, as a token.
pub type Reached = HashMap<u32, Vec<String>>;

/// The ends of the shard topic's partitions, read from the broker: every
/// partition in one request, one request at a time, shared by every read that
/// asked for ends no earlier than it began (many waiting reads cost the broker one
/// look, not one each).
pub struct LogEnds {
    consumer: Arc<BaseConsumer>,
    topic: String,
    partitions: u32,
    /// The last look: when it began, and what it found.
    last: tokio::sync::Mutex<Option<(Instant, BTreeMap<u32, i64>)>>,
}

impl LogEnds {
    pub fn new(kafka: &tally_shared::config::KafkaConfig, topic: String, partitions: u32) -> crate::Result<Self> {
        let mut config = tally_shared::kafka::consumer_config(kafka)?;
        // Never joins the group: it only asks for ends.
        config.set("group.id", "tally-query-ends").set("enable.auto.commit", "false");
        Ok(Self { consumer: Arc::new(config.create()?), topic, partitions, last: Default::default() })
    }

    /// Every partition's end (the next offset to be written) as read by a look
    /// that began at `since` or later.
    async fn ends_since(&self, since: Instant) -> Result<BTreeMap<u32, i64>, ApiError> {
        let mut last = self.last.lock().await;
        if let Some((_, ends)) = last.as_ref().filter(|(began, _)| *began >= since) {
            return Ok(ends.clone());
        }
        // Looks at least `LOOK_SPACING` apart: readers arriving meanwhile share the next.
        if let Some((began, _)) = last.as_ref() {
            tokio::time::sleep(LOOK_SPACING.saturating_sub(began.elapsed())).await;
        }
        let began = Instant::now();
        let (consumer, topic, partitions) = (self.consumer.clone(), self.topic.clone(), self.partitions);
        let asked = tokio::task::spawn_blocking(move || {
            let mut latest = rdkafka::TopicPartitionList::new();
            for partition in 0..partitions {
                // As a timestamp, `End` (-1) asks for the end.
                latest
                    .add_partition_offset(&topic, partition as i32, rdkafka::Offset::End)
                    .map_err(|err| err.to_string())?;
            }
            let found = consumer.offsets_for_times(latest, Duration::from_secs(2)).map_err(|err| err.to_string())?;
            let mut ends = BTreeMap::new();
            for element in found.elements() {
                match element.offset() {
                    rdkafka::Offset::Offset(end) => drop(ends.insert(element.partition() as u32, end)),
                    other => return Err(format!("partition {}: the broker answered {other:?}", element.partition())),
                }
            }
            Ok(ends)
        });
        let ends = match asked.await {
            Ok(Ok(ends)) => ends,
            Ok(Err(err)) => return Err(ApiError::unavailable(format!("reading the shard topic's ends: {err}"))),
            Err(err) => return Err(ApiError::unavailable(format!("reading the shard topic's ends: {err}"))),
        };
        *last = Some((began, ends.clone()));
        Ok(ends)
    }
}

/// What a shard must show before a stage is done with it.
type Condition<'a> = &'a (dyn Fn(u32, &Positions) -> Option<String> + Sync);

impl Fanout {
    /// Waits until every shard `touches` names holds the writes of `after`, at most
    /// its `max_wait`: how far each read shard got, or 504 `not_fresh_enough`.
    pub async fn wait_after(&self, after: &After, touches: &Touches) -> Result<Reached, ApiError> {
        if after.sources.is_empty() {
            // Only jobs' tokens: nothing a counter holds.
            return Ok(Reached::new());
        }
        let mut waiting = String::new();
        let started = Instant::now();
        let waited = tokio::time::timeout(after.max_wait, self.wait_stages(after, touches, &mut waiting)).await;
        let outcome = match &waited {
            Ok(Ok(_)) => "held",
            Ok(Err(_)) => "refused",
            Err(_) => "not_fresh_enough",
        };
        self.token_waits.with_label_values(&[outcome]).observe(started.elapsed().as_secs_f64());
        waited.unwrap_or_else(|_| {
            tracing::info!(
                waited_ms = started.elapsed().as_millis() as u64,
                waiting,
                "a read's write tokens were not held in time"
            );
            Err(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "not_fresh_enough",
                format!(
                    "not every shard held the writes after {} ms (max_wait_ms): {waiting}; retry, or wait longer",
                    started.elapsed().as_millis()
                ),
            ))
        })
    }

    async fn wait_stages(&self, after: &After, touches: &Touches, waiting: &mut String) -> Result<Reached, ApiError> {
        let sources: Vec<Source> = after.sources.keys().copied().collect();
        let increments: Vec<(usize, WriteToken)> = token_of(&after.sources, Source::INCREMENTS);
        let graph: Vec<(usize, WriteToken)> = token_of(&after.sources, Source::GRAPH);
        let read: Vec<u32> = touches.direct.union(&touches.total).copied().collect();
        let mut graph_reached = Vec::new();
        // What every shard held of the increments when it was seen holding them: what
        // the totals it relayed hold at least.
        let mut relayed_floor = None;
        if !touches.total.is_empty() {
            let all: Vec<u32> = (0..self.shards).collect();
            let mut log_ends = BTreeMap::new();
            if !graph.is_empty() {
                let held = |_: u32, p: &Positions| uncovered("the graph", &graph, p);
                let at = self.poll_graph(&sources, &held, waiting).await?;
                graph_reached = reached_tokens(&sources, &at.high_water, &graph);
                let applied = at.applied;
                let relayed = |_: u32, p: &Positions| relayed_past("the graph", applied, p);
                self.poll_graph(&sources, &relayed, waiting).await?;
                log_ends = self.log_ends(waiting).await?;
            }
            let held = |shard: u32, p: &Positions| {
                uncovered(&format!("shard {shard}"), &increments, p).or_else(|| applied_to(shard, &log_ends, p))
            };
            let at = self.poll(&all, &sources, &held, waiting).await?;
            relayed_floor = Some(floor(&sources, at.values(), &increments));
            let relayed = |shard: u32, p: &Positions| relayed_past(&format!("shard {shard}"), at[&shard].applied, p);
            self.poll(&all, &sources, &relayed, waiting).await?;
            let ends = self.log_ends(waiting).await?;
            let applied = |shard: u32, p: &Positions| applied_to(shard, &ends, p);
            self.poll(&touches.total.iter().copied().collect::<Vec<_>>(), &sources, &applied, waiting).await?;
        }
        let held = |shard: u32, p: &Positions| uncovered(&format!("shard {shard}"), &increments, p);
        let at = self.poll(&read, &sources, &held, waiting).await?;
        Ok(at
            .into_iter()
            .map(|(shard, p)| {
                let mut tokens = match (&relayed_floor, touches.total.contains(&shard)) {
                    (Some(floor), true) => floor.clone(),
                    _ => reached_tokens(&sources, &p.high_water, &increments),
                };
                tokens.extend(graph_reached.iter().cloned());
                (shard, tokens)
            })
            .collect())
    }

    /// Polls `shards` until `done` holds for each (served by its owner): the
    /// positions each showed when it did.
    async fn poll(
        &self,
        shards: &[u32],
        sources: &[Source],
        done: Condition<'_>,
        waiting: &mut String,
    ) -> Result<BTreeMap<u32, Positions>, ApiError> {
        let mut met = BTreeMap::new();
        // What each shard last said: a look that saw them all again waits at its
        // owner for a change (a long poll) instead of asking again and again.
        let mut seen: HashMap<u32, (i64, i64)> = HashMap::new();
        let mut pause = Duration::from_millis(1);
        loop {
            let pending: Vec<u32> = shards.iter().copied().filter(|shard| !met.contains_key(shard)).collect();
            if pending.is_empty() {
                return Ok(met);
            }
            *waiting = format!("the owner of shard {} has not said where it stands", pending[0]);
            let found = self.positions(&pending, sources, &seen).await?;
            let all_answered = found.len() == pending.len();
            if !all_answered {
                let answered: BTreeSet<u32> = found.iter().map(|(shard, _)| *shard).collect();
                if let Some(shard) = pending.iter().find(|shard| !answered.contains(shard)) {
                    *waiting = format!("shard {shard} has no owner serving it");
                }
            }
            for (shard, positions) in found {
                seen.insert(shard, (positions.applied, positions.relayed));
                match done(shard, &positions) {
                    None => drop(met.insert(shard, positions)),
                    Some(why) => *waiting = why,
                }
            }
            // A shard nobody serves is asked again after a pause; the owners of the
            // others answered as soon as something moved.
            let rest = if all_answered { Duration::from_millis(1) } else { pause };
            tokio::time::sleep(rest).await;
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    /// [`Fanout::poll`] of the graph.
    async fn poll_graph(
        &self,
        sources: &[Source],
        done: Condition<'_>,
        waiting: &mut String,
    ) -> Result<Positions, ApiError> {
        let mut pause = Duration::from_millis(1);
        loop {
            *waiting = "the graph has not said where it stands".into();
            match self.graph_positions(sources).await? {
                Some(positions) => match done(ShardOwner::GRAPH, &positions) {
                    None => return Ok(positions),
                    Some(why) => *waiting = why,
                },
                None => *waiting = "the graph has no owner serving it".into(),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    /// The shard topic's ends, read after now (asked again while the broker fails
    /// to say, within the read's wait).
    async fn log_ends(&self, waiting: &mut String) -> Result<BTreeMap<u32, i64>, ApiError> {
        let ends = self.ends.as_ref().ok_or_else(|| ApiError::unavailable("the shard topic's ends are not known"))?;
        let since = Instant::now();
        *waiting = "reading the shard topic's ends".into();
        loop {
            match ends.ends_since(since).await {
                Ok(ends) => return Ok(ends),
                Err(err) => *waiting = err.message,
            }
            tokio::time::sleep(MAX_POLL).await;
        }
    }

    /// The positions of those of `shards` their owners serve now (one call per
    /// owner, in parallel); an owner that does not answer leaves its shards out.
    async fn positions(
        &self,
        shards: &[u32],
        sources: &[Source],
        seen: &HashMap<u32, (i64, i64)>,
    ) -> Result<Vec<(u32, Positions)>, ApiError> {
        let mut by_owner: HashMap<String, Vec<u32>> = HashMap::new();
        for &shard in shards {
            if let Some(addr) = self.owners.get(shard).and_then(|claim| claim.addr) {
                by_owner.entry(addr).or_default().push(shard);
            }
        }
        let calls = by_owner.into_iter().map(|(addr, shards)| async move {
            let seen: Vec<Option<(i64, i64)>> = shards.iter().map(|shard| seen.get(shard).copied()).collect();
            // Held at the owner only when it has nothing new to say of any of them.
            let wait_ms = if seen.iter().all(Option::is_some) { LONG_POLL_MS } else { 0 };
            let request = PositionsRequest { shards: shards.clone(), sources: sources.to_vec(), seen, wait_ms };
            let answer =
                self.post::<_, PositionsResponse>(&addr, "/internal/v1/positions", &request, Some(LOOK_TIMEOUT)).await;
            (shards, answer)
        });
        let mut found = Vec::new();
        for (shards, answer) in join_all(calls).await {
            let response = match answer {
                Ok(Ok(response)) => response,
                Ok(Err(refused)) if refused.code == "not_owner" => continue,
                Ok(Err(refused)) => return Err(refused),
                Err(_) => continue,
            };
            for (shard, positions) in shards.into_iter().zip(response.positions) {
                match positions {
                    StorePositions::Served(positions) => found.push((shard, positions)),
                    StorePositions::NotOwner => {}
                    StorePositions::Failed { message } => return Err(ApiError::shard_failed(message)),
                }
            }
        }
        Ok(found)
    }

    /// The graph's positions, when an owner serves it and answers.
    async fn graph_positions(&self, sources: &[Source]) -> Result<Option<Positions>, ApiError> {
        let Some(addr) = self.owners.get(ShardOwner::GRAPH).and_then(|claim| claim.addr) else { return Ok(None) };
        let request = PositionsRequest { shards: Vec::new(), sources: sources.to_vec(), seen: Vec::new(), wait_ms: 0 };
        match self.post::<_, PositionsResponse>(&addr, "/internal/v1/positions", &request, Some(LOOK_TIMEOUT)).await {
            Ok(Ok(mut response)) => match response.positions.pop() {
                Some(StorePositions::Served(positions)) => Ok(Some(positions)),
                Some(StorePositions::Failed { message }) => Err(ApiError::shard_failed(message)),
                _ => Ok(None),
            },
            Ok(Err(refused)) => Err(refused),
            Err(_) => Ok(None),
        }
    }
}

/// The tokens of `stream` among `sources`, with their index there.
fn token_of(sources: &BTreeMap<Source, i64>, stream: u8) -> Vec<(usize, WriteToken)> {
    sources
        .iter()
        .enumerate()
        .filter(|(_, (source, _))| source.stream == stream)
        .filter_map(|(index, (source, offset))| {
            let topic = TokenTopic::of_stream(stream)?;
            Some((index, WriteToken { topic, partition: source.partition, offset: *offset }))
        })
        .collect()
}

/// Why `positions` do not hold every token of `tokens` yet (`None`: they do).
fn uncovered(who: &str, tokens: &[(usize, WriteToken)], positions: &Positions) -> Option<String> {
    tokens.iter().find_map(|(index, token)| {
        let high_water = positions.high_water.get(*index).copied().flatten();
        (!token.covered_by(high_water)).then(|| {
            let topic = token.topic.name();
            let holds = high_water
                .and_then(|stamp| WriteToken::reached(token.source()?, stamp))
                .map_or("nothing".to_string(), |reached| format!("up to offset {}", reached.offset));
            format!("{who} holds {holds} of {topic} partition {}, not yet offset {}", token.partition, token.offset)
        })
    })
}

/// Why `positions` have not relayed what was applied before `applied` (`None`: they have).
fn relayed_past(who: &str, applied: i64, positions: &Positions) -> Option<String> {
    (positions.relayed < applied).then(|| {
        format!("{who} has relayed what it applied below offset {}, not yet below {applied}", positions.relayed)
    })
}

/// Why `shard` has not applied its log up to its end in `ends` (`None`: it has, or no end asked).
fn applied_to(shard: u32, ends: &BTreeMap<u32, i64>, positions: &Positions) -> Option<String> {
    let end = *ends.get(&shard)?;
    (positions.applied < end)
        .then(|| format!("shard {shard} applied its log to offset {}, not yet {end}", positions.applied))
}

/// The tokens of the last records of `tokens`' sources that every one of `stores`
/// holds (the lowest of their high-water stamps).
fn floor<'a>(
    sources: &[Source],
    stores: impl Iterator<Item = &'a Positions>,
    tokens: &[(usize, WriteToken)],
) -> Vec<String> {
    let mut lowest: Vec<Option<tally_core::wire::Stamp>> = vec![None; sources.len()];
    let mut first = true;
    for positions in stores {
        for (index, _) in tokens {
            let stamp = positions.high_water.get(*index).copied().flatten();
            lowest[*index] = if first { stamp } else { lowest[*index].min(stamp) };
        }
        first = false;
    }
    reached_tokens(sources, &lowest, tokens)
}

/// The tokens of the last records of `tokens`' sources `high_water` holds.
fn reached_tokens(
    sources: &[Source],
    high_water: &[Option<tally_core::wire::Stamp>],
    tokens: &[(usize, WriteToken)],
) -> Vec<String> {
    tokens
        .iter()
        .filter_map(|(index, _)| {
            let stamp = high_water.get(*index).copied().flatten()?;
            WriteToken::reached(sources[*index], stamp).map(|token| token.encode())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::wire::Stamp;

    fn token(topic: TokenTopic, partition: u32, offset: i64) -> String {
        WriteToken { topic, partition, offset }.encode()
    }

    #[test]
    fn after_keeps_each_sources_furthest_token_and_ignores_jobs() {
        let tokens = [
            token(TokenTopic::Increments, 0, 5),
            token(TokenTopic::Increments, 0, 9),
            token(TokenTopic::Graph, 1, 3),
            token(TokenTopic::Jobs("emails".into()), 0, 100),
        ]
        .join(",");
        let after = parse(Some(&tokens), Some(200)).unwrap().unwrap();
        let want = BTreeMap::from([
            (Source { stream: Source::INCREMENTS, partition: 0 }, 9),
            (Source { stream: Source::GRAPH, partition: 1 }, 3),
        ]);
        assert_eq!(after, After { sources: want, max_wait: Duration::from_millis(200) });
        assert_eq!(parse(None, None).unwrap(), None);
        let defaulted = parse(Some(&token(TokenTopic::Graph, 0, 0)), None).unwrap().unwrap();
        assert_eq!(defaulted.max_wait, Duration::from_millis(DEFAULT_WAIT_MS as u64));
    }

    #[test]
    fn bad_tokens_and_waits_are_refused_with_their_reason() {
        let good = token(TokenTopic::Increments, 0, 1);
        let many = vec![good.as_str(); MAX_TOKENS + 1].join(",");
        let cases: [(Option<&str>, Option<i64>, &str, &str); 6] = [
            (Some("nope!"), None, "invalid_token", "not a tally write token"),
            (Some(""), None, "invalid_token", "must be 1 to"),
            (Some(&many), None, "invalid_token", "at most 64 tokens"),
            (Some(&good), Some(0), "invalid_max_wait", "must be 1 to 60000"),
            (Some(&good), Some(MAX_WAIT_MS + 1), "invalid_max_wait", "must be 1 to 60000"),
            (None, Some(100), "invalid_max_wait", "only with after"),
        ];
        for (after, wait, code, why) in cases {
            let err = parse(after, wait).unwrap_err();
            assert_eq!((err.status, err.code), (StatusCode::BAD_REQUEST, code), "{after:?} {wait:?}");
            assert!(err.message.contains(why), "{}", err.message);
        }
    }

    #[test]
    fn stages_say_what_they_wait_for() {
        let tokens = vec![(0, WriteToken { topic: TokenTopic::Increments, partition: 2, offset: 10 })];
        let at =
            |high_water: Option<Stamp>, applied, relayed| Positions { applied, relayed, high_water: vec![high_water] };
        assert_eq!(
            uncovered("shard 1", &tokens, &at(Some(Stamp { offset: 7, index: 0 }), 5, 5)).unwrap(),
            "shard 1 holds up to offset 6 of increments partition 2, not yet offset 10"
        );
        assert_eq!(
            uncovered("shard 1", &tokens, &at(None, 5, 5)).unwrap(),
            "shard 1 holds nothing of increments partition 2, not yet offset 10"
        );
        assert_eq!(uncovered("shard 1", &tokens, &at(Some(Stamp::through(10)), 5, 5)), None);
        assert_eq!(
            relayed_past("the graph", 8, &at(None, 9, 7)).unwrap(),
            "the graph has relayed what it applied below offset 7, not yet below 8"
        );
        assert_eq!(relayed_past("the graph", 8, &at(None, 9, 8)), None);
        let ends = BTreeMap::from([(3, 40)]);
        assert_eq!(applied_to(3, &ends, &at(None, 39, 0)).unwrap(), "shard 3 applied its log to offset 39, not yet 40");
        assert_eq!(applied_to(3, &ends, &at(None, 40, 0)), None);
        assert_eq!(applied_to(4, &ends, &at(None, 0, 0)), None, "no end asked of it");
        let sources = [Source { stream: Source::INCREMENTS, partition: 2 }];
        assert_eq!(
            reached_tokens(&sources, &[Some(Stamp::through(12))], &tokens),
            vec![token(TokenTopic::Increments, 2, 12)]
        );
    }
}
