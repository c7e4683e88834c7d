//! Edge updates under a bound on descendant sets (`graph.max_descendants`): an add
//! that would grow some origin's set past the bound is refused and leaves the graph
//! as it was, so what one later update costs stays bounded too.
//!
//! A run of adds is applied whole first (`Graph::apply_within`, its walks cut at the
//! bound). Only when some set would pass it is the run undone and applied again add
//! by add, refusing (and undoing) each add that passes it; the changes of the
//! updates kept are composed into one net change per origin, as the whole batch
//! would have made. Which adds are refused follows from the log alone.

use std::collections::{BTreeMap, BTreeSet};

use super::{DescChange, EdgeOp, EdgeUpdate, Graph};

/// An update of a batch refused: its place in the batch and the origin whose
/// descendant set it would have grown past the bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub index: usize,
    pub origin: String,
}

impl Graph {
    /// Applies `updates` in order, refusing each add that would grow a descendant set
    /// past `max_descendants` (a set already past it may keep what it has and lose
    /// some). Returns the net changes of the updates kept, as
    /// [`Graph::apply_batch`] does, and the refusals in batch order.
    ///
    /// Adds only grow sets: a run of adds that ends within the bound stayed within
    /// it all along, so each run is applied whole; removes between runs could have
    /// hidden a set passing the bound halfway, so runs are bounded one by one.
    pub fn apply_bounded(&mut self, updates: &[EdgeUpdate], max_descendants: usize) -> (Vec<DescChange>, Vec<Refusal>) {
        let mut refused = Vec::new();
        let mut runs = Vec::new();
        let mut start = 0;
        for run in updates.chunk_by(|a, b| a.op == b.op) {
            runs.push(match run[0].op {
                EdgeOp::Add => self.apply_adds(run, start, max_descendants, &mut refused),
                EdgeOp::Remove => self.apply_within(run, usize::MAX).0,
            });
            start += run.len();
        }
        if runs.len() == 1 {
            return (runs.pop().unwrap_or_default(), refused);
        }
        let mut net = NetChanges::default();
        runs.into_iter().for_each(|changes| net.compose(changes));
        (net.finish(), refused)
    }

    /// Applies a run of adds (the first at `start` in its batch): whole when it stays
    /// within the bound, else undone and applied again one by one, each add that
    /// passes the bound undone and refused.
    fn apply_adds(
        &mut self,
        adds: &[EdgeUpdate],
        start: usize,
        max_descendants: usize,
        refused: &mut Vec<Refusal>,
    ) -> Vec<DescChange> {
        let before = self.present(adds);
        let (changes, over) = self.apply_within(adds, max_descendants);
        if over.is_none() {
            return changes;
        }
        self.undo(adds, &before);
        let mut net = NetChanges::default();
        for (offset, add) in adds.iter().enumerate() {
            let one = std::slice::from_ref(add);
            let before = self.present(one);
            match self.apply_within(one, max_descendants) {
                (changes, None) => net.compose(changes),
                (_, Some(origin)) => {
                    self.undo(one, &before);
                    refused.push(Refusal { index: start + offset, origin: self.name(origin).to_string() });
                }
            }
        }
        net.finish()
    }

    /// Whether each add's edge is there now (a hash look-up each: this runs before
    /// every run of adds, whether or not it passes the bound).
    fn present(&self, adds: &[EdgeUpdate]) -> Vec<bool> {
        adds.iter().map(|add| self.has_edge(&add.from, &add.to)).collect()
    }

    /// Removes the edges `adds` added that were not there before (`present`, taken
    /// before them; an edge added twice is removed once). Nodes and the components'
    /// union-find keep what the undone adds made of them: a component found joined
    /// only groups more work together.
    fn undo(&mut self, adds: &[EdgeUpdate], present: &[bool]) {
        for (add, &was_there) in adds.iter().zip(present) {
            if !was_there {
                self.remove_edge(&add.from, &add.to);
            }
        }
    }
}

/// Net changes composed from consecutive ones, by origin.
#[derive(Default)]
struct NetChanges {
    origins: BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)>,
}

impl NetChanges {
    fn compose(&mut self, changes: Vec<DescChange>) {
        for change in changes {
            let (added, removed) = self.origins.entry(change.origin).or_default();
            for node in change.added {
                if !removed.remove(&node) {
                    added.insert(node);
                }
            }
            for node in change.removed {
                if !added.remove(&node) {
                    removed.insert(node);
                }
            }
        }
    }

    fn finish(self) -> Vec<DescChange> {
        self.origins
            .into_iter()
            .filter(|(_, (added, removed))| !added.is_empty() || !removed.is_empty())
            .map(|(origin, (added, removed))| DescChange {
                origin,
                added: added.into_iter().collect(),
                removed: removed.into_iter().collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    type Edges = BTreeSet<(String, String)>;

    /// desc(origin) by brute force.
    fn descendants(edges: &Edges, origin: &str) -> BTreeSet<String> {
        let mut reached = BTreeSet::new();
        let mut frontier = vec![origin.to_string()];
        while let Some(node) = frontier.pop() {
            for (from, to) in edges {
                if *from == node && to != origin && reached.insert(to.clone()) {
                    frontier.push(to.clone());
                }
            }
        }
        reached
    }

    fn all_sets(edges: &Edges, nodes: &BTreeSet<String>) -> BTreeMap<String, BTreeSet<String>> {
        nodes.iter().map(|n| (n.clone(), descendants(edges, n))).collect()
    }

    fn update() -> impl Strategy<Value = EdgeUpdate> {
        (prop::bool::weighted(0.75), 0..7u8, 0..7u8).prop_map(|(add, f, t)| EdgeUpdate {
            op: if add { EdgeOp::Add } else { EdgeOp::Remove },
            from: format!("n{f}"),
            to: format!("n{t}"),
        })
    }

    proptest! {
        /// Against the brute-force model: each add, in order, is refused exactly when
        /// afterwards some set holds more than the bound and gained a node; the edges
        /// and the net changes of every batch are the model's. The bound changes from
        /// batch to batch (lowered, sets already past it stay).
        #[test]
        fn adds_past_the_bound_are_refused_and_change_nothing(
            batches in proptest::collection::vec((proptest::collection::vec(update(), 1..6), 0usize..5), 1..8),
        ) {
            let nodes: BTreeSet<String> = (0..7).map(|n| format!("n{n}")).collect();
            let mut graph = Graph::default();
            let mut edges = Edges::new();
            for (batch, max) in batches {
                let before = all_sets(&edges, &nodes);
                let mut want_refused = Vec::new();
                for (index, update) in batch.iter().enumerate() {
                    let edge = (update.from.clone(), update.to.clone());
                    if update.op == EdgeOp::Remove || update.from == update.to {
                        if update.op == EdgeOp::Remove {
                            edges.remove(&edge);
                        }
                        continue;
                    }
                    let sets = all_sets(&edges, &nodes);
                    let fresh = edges.insert(edge.clone());
                    let after = all_sets(&edges, &nodes);
                    let passes = nodes.iter().any(|n| after[n].len() > max && !after[n].is_subset(&sets[n]));
                    if passes {
                        assert!(fresh);
                        edges.remove(&edge);
                        want_refused.push(index);
                    }
                }
                let (changes, refused) = graph.apply_bounded(&batch, max);
                prop_assert_eq!(refused.iter().map(|r| r.index).collect::<Vec<_>>(), want_refused);
                for refusal in &refused {
                    prop_assert!(nodes.contains(&refusal.origin));
                }
                let after = all_sets(&edges, &nodes);
                let want: Vec<DescChange> = nodes
                    .iter()
                    .filter_map(|n| {
                        let added: Vec<String> = after[n].difference(&before[n]).cloned().collect();
                        let removed: Vec<String> = before[n].difference(&after[n]).cloned().collect();
                        (!added.is_empty() || !removed.is_empty())
                            .then(|| DescChange { origin: n.clone(), added, removed })
                    })
                    .collect();
                prop_assert_eq!(changes, want);
                let mut kept: Vec<(String, String)> = Vec::new();
                for n in &nodes {
                    kept.extend(graph.neighbours(n, true).into_iter().map(|t| (n.clone(), t.to_string())));
                }
                prop_assert_eq!(kept.into_iter().collect::<Edges>(), edges.clone());
                prop_assert_eq!(graph.edge_count(), edges.len());
            }
        }
    }

    #[test]
    fn the_edge_that_would_pass_the_bound_names_the_origin() {
        let mut graph = Graph::default();
        let chain: Vec<EdgeUpdate> =
            (0..5).map(|i| EdgeUpdate { op: EdgeOp::Add, from: format!("c{i}"), to: format!("c{}", i + 1) }).collect();
        let (_, refused) = graph.apply_bounded(&chain, 4);
        assert_eq!(refused, vec![Refusal { index: 4, origin: "c0".into() }]);
        assert!(!graph.has_edge("c4", "c5"));
        assert_eq!(graph.descendants("c0"), vec!["c1", "c2", "c3", "c4"]);
    }
}
