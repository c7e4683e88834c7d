//! The brute-force model every test compares with: it keeps the raw event log and
//! recomputes any answer from it, with none of the cleverness of the real path.

use std::collections::{BTreeMap, HashSet};

use crate::time::Plan;
use crate::wire::Increment;

/// What tally must answer, recomputed from the accepted events.
#[derive(Debug, Default, Clone)]
pub struct Model {
    events: Vec<Increment>,
    seen_ids: HashSet<(String, String)>,
}

impl Model {
    /// Records an accepted increment; a repeated `(entity, id)` counts once.
    pub fn apply(&mut self, increment: Increment) {
        if let Some(id) = &increment.id {
            if !self.seen_ids.insert((increment.entity.clone(), id.clone())) {
                return;
            }
        }
        self.events.push(increment);
    }

    /// The value of each point of `plan` for (entity, metric): the sum of the deltas
    /// whose event time falls in the point's span (all of them for all-time).
    pub fn sums(&self, entity: &str, metric: &str, plan: &Plan) -> Vec<i64> {
        let own = self.events.iter().filter(|e| e.entity == entity && e.metric == metric);
        if plan.resolution.is_none() {
            return vec![own.map(|e| e.delta).sum()];
        }
        let mut points = vec![0i64; plan.points as usize];
        for event in own {
            let offset = event.ts - plan.start;
            if offset < 0 {
                continue;
            }
            if let Some(point) = points.get_mut((offset / plan.step) as usize) {
                *point += event.delta;
            }
        }
        points
    }

    /// Every metric of `entity` with its all-time sum, sorted by metric.
    pub fn metrics(&self, entity: &str) -> BTreeMap<String, i64> {
        let mut metrics = BTreeMap::new();
        for event in self.events.iter().filter(|e| e.entity == entity) {
            *metrics.entry(event.metric.clone()).or_insert(0) += event.delta;
        }
        metrics
    }

    /// The accepted events, in order.
    pub fn events(&self) -> &[Increment] {
        &self.events
    }
}
