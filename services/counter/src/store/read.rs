//! Answering reads from a shard store: windows, series and metric listings, each
//! request from one RocksDB snapshot.

use rocksdb::{Direction, IteratorMode, ReadOptions};
use tally_core::keys::{
    encode_count_key, encode_entity_prefix, encode_resolution_prefix, parse_count_key, Count, Counts, ALL_TIME_WIDTH,
};
use tally_core::segments::plain_metric;
use tally_core::time::Plan;
use tally_core::wire::{Kind, MetricTotals, ShardAnswer, ShardMetricsResponse, ShardQuery};

use crate::error::Result;
use crate::store::{ShardStore, CF_COUNTS};

/// Most metrics one listing page returns.
pub const MAX_METRICS_PAGE: usize = 1_000;

fn pick(counts: Counts, kind: Kind) -> Count {
    match kind {
        Kind::Total => counts.total,
        Kind::Direct => counts.direct,
    }
}

impl ShardStore {
    /// Answers `queries` at time `now`, in order.
    pub fn read(&self, queries: &[ShardQuery], now: i64) -> Result<Vec<ShardAnswer>> {
        let snapshot = self.store.db().snapshot();
        let mut answers = Vec::with_capacity(queries.len());
        for query in queries {
            let plan = match self.options.resolutions.plan(query.spec, now) {
                Ok(plan) => plan,
                Err(err) => {
                    answers.push(ShardAnswer::Error { code: "invalid_window".into(), message: err.to_string() });
                    continue;
                }
            };
            let counter = (query.entity.as_str(), query.metric.as_str(), query.kind);
            if let Some(selector) = &query.segments {
                answers.push(self.read_segments(&snapshot, counter, selector, &plan, now)?);
                continue;
            }
            let points = self.points(&snapshot, counter, &plan, now)?;
            let answer = match (&plan.resolution, query.spec) {
                (None, _) => ShardAnswer::Window { value: points[0], resolution: "all".into(), from: 0, to: plan.to },
                (Some(resolution), tally_core::time::WindowSpec::Series { .. }) => ShardAnswer::Series {
                    resolution: resolution.name.clone(),
                    points: points.iter().enumerate().map(|(i, v)| (plan.start + i as i64 * plan.step, *v)).collect(),
                },
                (Some(resolution), _) => ShardAnswer::Window {
                    value: points[0],
                    resolution: resolution.name.clone(),
                    from: plan.start,
                    to: plan.to,
                },
            };
            answers.push(answer);
        }
        Ok(answers)
    }

    /// The value of each point of `plan` for (entity, metric, kind), from `snapshot`:
    /// the all-time bucket's, or the sums of the retained buckets of the plan's
    /// resolution in each point's span.
    pub(crate) fn points(
        &self,
        snapshot: &rocksdb::Snapshot<'_>,
        (entity, metric, kind): (&str, &str, Kind),
        plan: &Plan,
        now: i64,
    ) -> Result<Vec<Count>> {
        let cf = self.cf(CF_COUNTS)?;
        let mut key = Vec::with_capacity(128);
        let Some(resolution) = &plan.resolution else {
            encode_count_key(&mut key, entity, metric, ALL_TIME_WIDTH, 0);
            let counts = snapshot.get_pinned_cf(cf, &key)?.map(|v| Counts::decode(&v)).transpose()?.unwrap_or_default();
            return Ok(vec![pick(counts, kind)]);
        };
        let end = plan.start + plan.step * plan.points as i64;
        let mut points: Vec<Count> = vec![0; plan.points as usize];
        encode_count_key(&mut key, entity, metric, resolution.width_ms, end);
        let mut read_options = ReadOptions::default();
        read_options.set_iterate_upper_bound(key.clone());
        key.clear();
        encode_count_key(&mut key, entity, metric, resolution.width_ms, plan.start);
        let mut prefix = Vec::with_capacity(key.len());
        encode_resolution_prefix(&mut prefix, entity, metric, resolution.width_ms);
        for item in snapshot.iterator_cf_opt(cf, read_options, IteratorMode::From(&key, Direction::Forward)) {
            let (stored_key, value) = item?;
            if !stored_key.starts_with(&prefix) {
                break;
            }
            let decoded = parse_count_key(&stored_key)?;
            if decoded.bucket >= end {
                break;
            }
            if !resolution.retains(decoded.bucket, now) {
                // Expired: whether compaction dropped it yet must not change answers.
                continue;
            }
            let index = ((decoded.bucket - plan.start) / plan.step) as usize;
            if let Some(point) = points.get_mut(index) {
                *point = point.saturating_add(pick(Counts::decode(&value)?, kind));
            }
        }
        Ok(points)
    }

    /// The metrics of `entity` after `after` (exclusive) with their all-time counts,
    /// sorted by name, at most `limit`.
    pub fn metrics(&self, entity: &str, after: Option<&str>, limit: usize) -> Result<ShardMetricsResponse> {
        let limit = limit.clamp(1, MAX_METRICS_PAGE);
        let cf = self.cf(CF_COUNTS)?;
        let snapshot = self.store.db().snapshot();
        let mut prefix = Vec::new();
        encode_entity_prefix(&mut prefix, entity);
        let mut seek = prefix.clone();
        if let Some(after) = after {
            // Just past every key of metric `after`: its keys continue with 0x00, its
            // segment combinations' with 0x01.
            seek.extend_from_slice(after.as_bytes());
            seek.push(0x02);
        }
        let mut iterator = snapshot.raw_iterator_cf(cf);
        iterator.seek(&seek);
        let mut metrics = Vec::new();
        while iterator.valid() {
            let Some(stored_key) = iterator.key() else { break };
            if !stored_key.starts_with(&prefix) {
                break;
            }
            let decoded = parse_count_key(stored_key)?;
            if metrics.len() == limit {
                return Ok(ShardMetricsResponse { metrics, more: true });
            }
            let metric = plain_metric(decoded.metric).to_string();
            if decoded.width_ms == ALL_TIME_WIDTH && metric.len() == decoded.metric.len() {
                let counts = iterator.value().map(Counts::decode).transpose()?.unwrap_or_default();
                metrics.push(MetricTotals { metric: metric.clone(), total: counts.total, direct: counts.direct });
            }
            let mut next = prefix.clone();
            next.extend_from_slice(metric.as_bytes());
            next.push(0x02);
            iterator.seek(&next);
        }
        iterator.status()?;
        Ok(ShardMetricsResponse { metrics, more: false })
    }
}

#[cfg(test)]
mod tests {
    use tally_core::time::WindowSpec;
    use tally_core::wire::{Increment, ShardMessage, Source, Stamp};

    use super::*;
    use crate::store::apply::ShardRecord;
    use crate::store::StoreOptions;

    const NOW: i64 = 1_763_780_000_000;

    fn store_with(events: &[(&str, &str, i64, i64)]) -> (tempfile::TempDir, ShardStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), StoreOptions::default()).unwrap();
        let payload = ShardMessage::Increments {
            source: Source { stream: Source::INCREMENTS, partition: 0 },
            entries: events
                .iter()
                .enumerate()
                .map(|(i, &(entity, metric, delta, ts))| {
                    (
                        Stamp { offset: i as i64, index: 0 },
                        Increment { entity: entity.into(), metric: metric.into(), delta, ts, id: None },
                    )
                })
                .collect(),
        }
        .encode()
        .unwrap();
        store.apply(&[ShardRecord { offset: 0, payload: &payload, timestamp: None }], NOW, false).unwrap();
        (dir, store)
    }

    fn query(entity: &str, metric: &str, spec: WindowSpec) -> ShardQuery {
        ShardQuery::plain(entity.into(), metric.into(), Kind::Total, spec)
    }

    #[test]
    fn windows_series_and_all_time() {
        let (_dir, store) = store_with(&[
            ("e", "v", 1, NOW),
            ("e", "v", 2, NOW - 120_000),
            ("e", "v", 4, NOW - 7_200_000),
            ("e", "w", 8, NOW),
            ("f", "v", 16, NOW),
        ]);
        let answers = store
            .read(
                &[
                    query("e", "v", WindowSpec::All),
                    query("e", "v", WindowSpec::Last { window_ms: 600_000 }),
                    query("e", "v", WindowSpec::Last { window_ms: 86_400_000 }),
                    query("e", "v", WindowSpec::Series { step_ms: 3_600_000, range_ms: 3 * 3_600_000 }),
                    query("nobody", "v", WindowSpec::All),
                    query("e", "v", WindowSpec::Last { window_ms: 1000 * 86_400_000 }),
                ],
                NOW,
            )
            .unwrap();
        assert!(matches!(answers[0], ShardAnswer::Window { value: 7, .. }));
        assert!(matches!(&answers[1], ShardAnswer::Window { value: 3, resolution, .. } if resolution == "1m"));
        assert!(matches!(&answers[2], ShardAnswer::Window { value: 7, resolution, .. } if resolution == "1h"));
        let ShardAnswer::Series { points, .. } = &answers[3] else { panic!("{:?}", answers[3]) };
        assert_eq!(points.iter().map(|p| p.1).sum::<tally_core::keys::Count>(), 7);
        assert_eq!(points.len(), 3);
        assert!(matches!(answers[4], ShardAnswer::Window { value: 0, .. }));
        assert!(matches!(&answers[5], ShardAnswer::Error { code, .. } if code == "invalid_window"));
    }

    #[test]
    fn buckets_past_retention_read_as_gone_before_compaction_drops_them() {
        // A 7 min step over 6 h at the 1 min resolution (kept 6 h): the oldest point
        // reaches 5 min further back than the range, past the retention.
        let step = 420_000;
        let read_at = NOW / step * step + 300_000;
        let oldest = read_at - 362 * 60_000;
        let (dir, applied_at) = (tempfile::tempdir().unwrap(), read_at - 120_000);
        let store = ShardStore::open(0, dir.path(), StoreOptions::default()).unwrap();
        let payload = ShardMessage::Increments {
            source: Source { stream: Source::INCREMENTS, partition: 0 },
            entries: [(1, oldest), (2, read_at - 60_000)]
                .into_iter()
                .enumerate()
                .map(|(i, (delta, ts))| {
                    let increment = Increment { entity: "e".into(), metric: "v".into(), delta, ts, id: None };
                    (Stamp { offset: i as i64, index: 0 }, increment)
                })
                .collect(),
        }
        .encode()
        .unwrap();
        store.apply(&[ShardRecord { offset: 0, payload: &payload, timestamp: None }], applied_at, false).unwrap();
        let series = WindowSpec::Series { step_ms: step as u64, range_ms: 6 * 3_600_000 };
        let at = |now| {
            let answers = store.read(&[query("e", "v", series)], now).unwrap();
            let ShardAnswer::Series { points, resolution } = &answers[0] else { panic!("{:?}", answers[0]) };
            assert_eq!((resolution.as_str(), points[0].0), ("1m", oldest));
            points.iter().map(|p| p.1).collect::<Vec<tally_core::keys::Count>>()
        };
        let mut want = vec![0; 52];
        (want[0], want[51]) = (1, 2);
        assert_eq!(at(applied_at), want, "still retained");
        want[0] = 0;
        assert_eq!(at(read_at), want, "expired a minute ago, though still stored");
    }

    #[test]
    fn metrics_paginate_in_name_order() {
        let events: Vec<(&str, &str, i64, i64)> = vec![
            ("e", "c", 3, NOW),
            ("e", "a", 1, NOW),
            ("e", "b", 2, NOW),
            ("e", "b", 2, NOW - 3_600_000),
            ("e2", "a", 9, NOW),
        ];
        let (_dir, store) = store_with(&events);
        let page = store.metrics("e", None, 2).unwrap();
        assert_eq!(
            page.metrics.iter().map(|m| (m.metric.as_str(), m.total)).collect::<Vec<_>>(),
            vec![("a", 1), ("b", 4)]
        );
        assert!(page.more);
        let page = store.metrics("e", Some("b"), 2).unwrap();
        assert_eq!(page.metrics.iter().map(|m| m.metric.as_str()).collect::<Vec<_>>(), vec!["c"]);
        assert!(!page.more);
        assert!(store.metrics("nobody", None, 10).unwrap().metrics.is_empty());
    }
}
