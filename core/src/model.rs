//! The brute-force model every test compares with: it keeps the raw event log and
//! recomputes any answer from it, with none of the cleverness of the real path.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::keys::Count;
use crate::segments::{plain_metric, Combination, Selected, Selector, DEFAULT_MAX_COMBINATIONS};
use crate::time::Plan;
use crate::wire::{Increment, Kind};

/// What tally must answer, recomputed from the accepted events and the final graph.
#[derive(Debug, Default, Clone)]
pub struct Model {
    events: Vec<Increment>,
    seen_ids: HashSet<(String, String)>,
    edges: BTreeSet<(String, String)>,
    seen_graph_ids: HashSet<(String, String)>,
    /// Each origin's combinations per metric, in order of first use.
    combinations: HashMap<(String, String), HashSet<String>>,
    /// How many combinations an origin's metric keeps (none: the default).
    max_combinations: Option<u32>,
}

/// A segment query's answer: per group, its points (groups whose points are all 0
/// left out, but the one group of a query without `by`), and the overflow's points.
pub type SegmentSums = (BTreeMap<String, Vec<Count>>, Vec<Count>);

impl Model {
    /// A model whose origins keep `max` combinations per metric.
    pub fn with_max_combinations(max: u32) -> Self {
        Self { max_combinations: Some(max), ..Self::default() }
    }

    /// Records an accepted increment; a repeated `(entity, id)` counts once. A
    /// combination past its origin's cap counts as its metric's overflow.
    pub fn apply(&mut self, mut increment: Increment) {
        if let Some(id) = &increment.id {
            if !self.seen_ids.insert((increment.entity.clone(), id.clone())) {
                return;
            }
        }
        if let Some(combination) = Combination::of(&increment.metric) {
            let max = self.max_combinations.unwrap_or(DEFAULT_MAX_COMBINATIONS) as usize;
            let known =
                self.combinations.entry((increment.entity.clone(), combination.metric.to_string())).or_default();
            if !known.contains(combination.full) && known.len() >= max {
                increment.metric = combination.overflow().to_string();
            } else {
                known.insert(combination.full.to_string());
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
        points(self.events.iter().filter(|e| plain_metric(&e.metric) == metric && origins.contains(&e.entity)), plan)
    }

    /// What a segment query of (entity, metric, kind) over `plan` answers: the
    /// events of the combinations `selector` selects, summed per group, and those of
    /// the overflow.
    pub fn segment_sums(
        &self,
        entity: &str,
        metric: &str,
        kind: Kind,
        plan: &Plan,
        selector: &Selector,
    ) -> SegmentSums {
        let origins = self.origins(entity, kind);
        let mut grouped: BTreeMap<String, Vec<&Increment>> = BTreeMap::new();
        let mut overflow = Vec::new();
        if selector.by.is_none() {
            grouped.insert(String::new(), Vec::new());
        }
        for event in self.events.iter().filter(|e| origins.contains(&e.entity)) {
            let Some(combination) = Combination::of(&event.metric).filter(|c| c.metric == metric) else { continue };
            match selector.select(&combination) {
                Some(Selected::Group(group)) => grouped.entry(group.to_string()).or_default().push(event),
                Some(Selected::Overflow) => overflow.push(event),
                None => {}
            }
        }
        let mut groups: BTreeMap<String, Vec<Count>> =
            grouped.into_iter().map(|(group, events)| (group, points(events.into_iter(), plan))).collect();
        if selector.by.is_some() {
            groups.retain(|_, points| points.iter().any(|v| *v != 0));
        }
        (groups, points(overflow.into_iter(), plan))
    }
}

/// The value of each point of `plan` summed over `events`.
fn points<'e>(events: impl Iterator<Item = &'e Increment>, plan: &Plan) -> Vec<Count> {
    let Some(resolution) = &plan.resolution else {
        return vec![events.map(|e| Count::from(e.delta)).sum()];
    };
    let mut points = vec![0; plan.points as usize];
    for event in events.filter(|e| resolution.retains(crate::time::bucket_start(e.ts, resolution.width_ms), plan.to)) {
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

impl Model {
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
            let slot = metrics.entry(plain_metric(&event.metric).to_string()).or_insert((0, 0));
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
