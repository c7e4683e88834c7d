//! The brute-force model every test compares with: it keeps the raw event log and
//! recomputes any answer from it, with none of the cleverness of the real path.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::keys::Count;
use crate::time::Plan;
use crate::wire::{Increment, Kind};

/// What tally must answer, recomputed from the accepted events and the final graph.
#[derive(Debug, Default, Clone)]
pub struct Model {
    events: Vec<Increment>,
    seen_ids: HashSet<(String, String)>,
    edges: BTreeSet<(String, String)>,
    seen_graph_ids: HashSet<(String, String)>,
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

    /// Records a graph update; a repeated `(from, id)` takes effect once.
    pub fn apply_edge(&mut self, add: bool, from: &str, to: &str, id: Option<&str>) {
        if let Some(id) = id {
            if !self.seen_graph_ids.insert((from.to_string(), id.to_string())) {
                return;
            }
        }
        let edge = (from.to_string(), to.to_string());
        if add && from != to {
            self.edges.insert(edge);
        } else if !add {
            self.edges.remove(&edge);
        }
    }

    /// The edges of the final graph.
    pub fn edges(&self) -> &BTreeSet<(String, String)> {
        &self.edges
    }

    /// desc(origin) on the final graph, by brute force.
    pub fn descendants(&self, origin: &str) -> BTreeSet<String> {
        let mut reached = BTreeSet::new();
        let mut frontier = vec![origin.to_string()];
        while let Some(node) = frontier.pop() {
            for (from, to) in &self.edges {
                if *from == node && to != origin && reached.insert(to.clone()) {
                    frontier.push(to.clone());
                }
            }
        }
        reached
    }

    /// The origins whose events count in `entity`'s `kind`: itself, plus for `total`
    /// every entity that reaches it.
    fn origins(&self, entity: &str, kind: Kind) -> BTreeSet<String> {
        let mut origins = BTreeSet::from([entity.to_string()]);
        if kind == Kind::Total {
            let candidates: BTreeSet<&String> = self.events.iter().map(|e| &e.entity).collect();
            for origin in candidates {
                if self.descendants(origin).contains(entity) {
                    origins.insert(origin.clone());
                }
            }
        }
        origins
    }

    /// The value of each point of `plan` for (entity, metric, kind): the sum of the
    /// deltas whose event time falls in the point's span and whose bucket is still
    /// retained at `plan.to` (all of them for all-time).
    pub fn sums(&self, entity: &str, metric: &str, kind: Kind, plan: &Plan) -> Vec<Count> {
        let origins = self.origins(entity, kind);
        let own = self.events.iter().filter(|e| e.metric == metric && origins.contains(&e.entity));
        let Some(resolution) = &plan.resolution else {
            return vec![own.map(|e| Count::from(e.delta)).sum()];
        };
        let mut points = vec![0; plan.points as usize];
        for event in own.filter(|e| resolution.retains(crate::time::bucket_start(e.ts, resolution.width_ms), plan.to)) {
            let offset = event.ts - plan.start;
            if offset < 0 {
                continue;
            }
            if let Some(point) = points.get_mut((offset / plan.step) as usize) {
                *point += Count::from(event.delta);
            }
        }
        points
    }

    /// The contributors of (entity, metric) over `plan`'s single point: every other
    /// entity that reaches `entity`, with its direct sum, the nonzero ones only,
    /// largest first (ties by name). `direct + Σ values = total`.
    pub fn contributors(&self, entity: &str, metric: &str, plan: &Plan) -> Vec<(String, Count)> {
        let mut contributors: Vec<(String, Count)> = self
            .origins(entity, Kind::Total)
            .into_iter()
            .filter(|origin| origin != entity)
            .map(|origin| {
                let value = self.sums(&origin, metric, Kind::Direct, plan)[0];
                (origin, value)
            })
            .filter(|(_, value)| *value != 0)
            .collect();
        contributors.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        contributors
    }

    /// Every metric counted on `entity` (directly or through the graph) with its
    /// all-time `(direct, total)`, sorted by metric.
    pub fn metrics(&self, entity: &str) -> BTreeMap<String, (Count, Count)> {
        let origins = self.origins(entity, Kind::Total);
        let mut metrics = BTreeMap::new();
        for event in self.events.iter().filter(|e| origins.contains(&e.entity)) {
            let slot = metrics.entry(event.metric.clone()).or_insert((0, 0));
            if event.entity == entity {
                slot.0 += Count::from(event.delta);
            }
            slot.1 += Count::from(event.delta);
        }
        metrics
    }

    /// The accepted events, in order.
    pub fn events(&self) -> &[Increment] {
        &self.events
    }
}
