//! The graph algorithm: which entities' descendant sets a batch of edge updates
//! changes, and by how much (Quanta's eager propagation).
//!
//! desc(a) is every entity reachable from `a` by one or more edges, `a` excluded;
//! cycles are allowed. A batch of updates is applied to the graph as a whole and
//! yields, for every origin `a` whose descendant set changed, the net change
//! `added(a)` / `removed(a)` between the graph before and after the batch.
//!
//! Only the origins that reach a node whose out-edges changed can see their
//! descendant set change, and the ancestors of those nodes are the same before and
//! after the batch up to the nodes themselves (a path's first changed edge leaves a
//! changed node, and the path up to it is unchanged). So the batch computes
//! `T ∪ ancestors(T)` once on the old graph, each origin's descendants on the old
//! and the new graph, and their differences.
//!
//! Work is split by connected component (a union-find that only ever merges, so its
//! sets contain the true components): components are independent, and their
//! traversals run in parallel on scoped threads.

mod adjacency;
mod bounded;
mod names;

use adjacency::Adjacency;
pub use bounded::Refusal;
use names::Names;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};

/// `add_edge` or `remove_edge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EdgeOp {
    Add,
    Remove,
}

/// One validated graph update.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EdgeUpdate {
    pub op: EdgeOp,
    pub from: String,
    pub to: String,
}

/// The net change of one origin's descendant set; both lists sorted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DescChange {
    pub origin: String,
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

/// Borrowed [`DescChange`] (names point into the record); same encoding.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DescChangeRef<'a> {
    pub origin: &'a str,
    #[serde(borrow)]
    pub added: Vec<&'a str>,
    #[serde(borrow)]
    pub removed: Vec<&'a str>,
}

impl DescChangeRef<'_> {
    pub fn into_owned(self) -> DescChange {
        let owned = |names: Vec<&str>| names.into_iter().map(str::to_string).collect();
        DescChange { origin: self.origin.to_string(), added: owned(self.added), removed: owned(self.removed) }
    }
}

type NodeId = u32;

/// A directed graph over interned entity names, with out- and in-edges, held in
/// about 50 bytes per node of one parent ([`names`], [`adjacency`]).
#[derive(Debug, Default, Clone)]
pub struct Graph {
    names: Names,
    out: Adjacency,
    inn: Adjacency,
    /// Union-find parents: nodes ever joined by an edge share a root.
    parent: Vec<NodeId>,
    edges: usize,
    /// Visit stamps for a batch's traversals, one per thread it ran on, kept from
    /// batch to batch (4 bytes per node each) so a batch costs what it visits.
    stamps: Vec<Stamps>,
}

/// Threads a batch's groups run on, at most (each keeps its own [`Stamps`]).
const MAX_GROUP_THREADS: usize = 4;

impl Graph {
    fn intern(&mut self, name: &str) -> NodeId {
        // Past 2³¹ entities (a hundred GB of graph) ids would collide with the
        // adjacency's tags: stop loudly rather than mix nodes up.
        let Some((id, new)) = self.names.intern(name) else {
            panic!("no room for entity {name:?}: the graph holds {} entities, the most one graph can", self.names.len())
        };
        if new {
            self.out.push();
            self.inn.push();
            self.parent.push(id);
        }
        id
    }

    fn id(&self, name: &str) -> Option<NodeId> {
        self.names.id(name)
    }

    fn name(&self, id: NodeId) -> &str {
        self.names.name(id)
    }

    fn root(&self, mut id: NodeId) -> NodeId {
        while self.parent[id as usize] != id {
            id = self.parent[id as usize];
        }
        id
    }

    fn union(&mut self, a: NodeId, b: NodeId) {
        let (ra, rb) = (self.root(a), self.root(b));
        if ra != rb {
            self.parent[ra.max(rb) as usize] = ra.min(rb);
        }
        // Path compression for the two nodes just joined.
        let root = self.root(a);
        self.parent[a as usize] = root;
        self.parent[b as usize] = root;
    }

    /// Adds `from → to`; false when it already existed.
    pub fn add_edge(&mut self, from: &str, to: &str) -> bool {
        let (f, t) = (self.intern(from), self.intern(to));
        if !self.out.insert(f, t) {
            return false;
        }
        self.inn.insert(t, f);
        self.union(f, t);
        self.edges += 1;
        true
    }

    /// Removes `from → to`; false when it did not exist.
    pub fn remove_edge(&mut self, from: &str, to: &str) -> bool {
        let (Some(f), Some(t)) = (self.id(from), self.id(to)) else { return false };
        if !self.out.remove(f, t) {
            return false;
        }
        self.inn.remove(t, f);
        self.edges -= 1;
        true
    }

    pub fn has_edge(&self, from: &str, to: &str) -> bool {
        match (self.id(from), self.id(to)) {
            (Some(f), Some(t)) => self.out.contains(f, t),
            _ => false,
        }
    }

    /// How many edges the graph holds.
    pub fn edge_count(&self) -> usize {
        self.edges
    }

    /// Direct neighbours of `entity`, sorted: its out-edges (`descendants`
    /// direction) or in-edges (`ancestors`).
    pub fn neighbours(&self, entity: &str, outgoing: bool) -> Vec<&str> {
        let Some(id) = self.id(entity) else { return Vec::new() };
        let edges = if outgoing { &self.out } else { &self.inn };
        let mut names: Vec<&str> = edges.of(id).map(|n| self.name(n)).collect();
        names.sort_unstable();
        names
    }

    /// desc(entity), sorted.
    pub fn descendants(&self, entity: &str) -> Vec<String> {
        let Some(id) = self.id(entity) else { return Vec::new() };
        let mut reached = Vec::new();
        self.reach_into(&mut FxHashSet::default(), id, true, usize::MAX, &mut reached);
        let mut names: Vec<String> = reached.into_iter().map(|n| self.name(n).to_string()).collect();
        names.sort_unstable();
        names
    }

    /// Every entity that reaches `entity` (whose descendants hold it), `entity`
    /// excluded, sorted: the ancestors whose direct counts make up its total. At most
    /// `limit`; the walk stops there, and the flag says whether there were more.
    pub fn ancestors(&self, entity: &str, limit: usize) -> (Vec<&str>, bool) {
        let Some(id) = self.id(entity) else { return (Vec::new(), false) };
        let mut reached = Vec::new();
        self.reach_into(&mut FxHashSet::default(), id, false, limit.saturating_add(1), &mut reached);
        let more = reached.len() > limit;
        let mut names: Vec<&str> = reached.into_iter().map(|n| self.name(n)).collect();
        names.sort_unstable();
        names.truncate(limit);
        (names, more)
    }

    /// Appends to `reached` every node reachable from `start` by one or more edges
    /// (forward or backward), `start` excluded, stopping once `bound` nodes are
    /// appended; `visited` must not hold any of them yet.
    fn reach_into(
        &self,
        visited: &mut impl Visited,
        start: NodeId,
        forward: bool,
        bound: usize,
        reached: &mut Vec<NodeId>,
    ) {
        let first = reached.len();
        visited.first_visit(start);
        reached.push(start);
        self.walk(visited, forward, reached, first, bound.saturating_add(1));
        reached.swap_remove(first);
    }

    /// Breadth first from the nodes in `reached[from..]` (already visited): appends
    /// each node they reach that `visited` did not hold, until `reached[from..]`
    /// holds `bound` nodes. `reached` is the queue too: each node is expanded once.
    fn walk(&self, visited: &mut impl Visited, forward: bool, reached: &mut Vec<NodeId>, from: usize, bound: usize) {
        let adjacency = if forward { &self.out } else { &self.inn };
        let mut next = from;
        while next < reached.len() && reached.len() - from < bound {
            let node = reached[next];
            next += 1;
            for neighbour in adjacency.of(node) {
                if visited.first_visit(neighbour) {
                    reached.push(neighbour);
                    if reached.len() - from >= bound {
                        return;
                    }
                }
            }
        }
    }

    /// Applies `updates` in order and returns the net descendant-set change of every
    /// origin whose set changed, sorted by origin. No-op updates change nothing.
    pub fn apply_batch(&mut self, updates: &[EdgeUpdate]) -> Vec<DescChange> {
        self.apply_within(updates, usize::MAX).0
    }

    /// [`Self::apply_batch`], with each origin's new descendant set walked only as
    /// far as `max_descendants + 1` nodes: the second value is an origin whose set
    /// grew past `max_descendants` (the changes are then incomplete, and the caller
    /// undoes the batch, [`bounded`]). An origin already past the bound before the
    /// batch is walked in full, and counts only if it gained descendants.
    fn apply_within(&mut self, updates: &[EdgeUpdate], max_descendants: usize) -> (Vec<DescChange>, Option<NodeId>) {
        // Which nodes' out-edges may change; grouped by component after the adds join them.
        let mut touched: Vec<NodeId> = Vec::new();
        for update in updates {
            let effective = match update.op {
                EdgeOp::Add => !self.has_edge(&update.from, &update.to) && update.from != update.to,
                EdgeOp::Remove => self.has_edge(&update.from, &update.to),
            };
            if effective {
                let (f, t) = (self.intern(&update.from), self.intern(&update.to));
                if update.op == EdgeOp::Add {
                    self.union(f, t);
                }
                touched.push(f);
            }
        }
        if touched.is_empty() {
            return (Vec::new(), None);
        }
        let mut groups: FxHashMap<NodeId, Vec<NodeId>> = FxHashMap::default();
        for &node in &touched {
            groups.entry(self.root(node)).or_default().push(node);
        }
        let groups: Vec<Vec<NodeId>> = groups.into_values().collect();
        let mut stamps = std::mem::take(&mut self.stamps);

        // Before: each group's origins (its touched nodes and their ancestors) and
        // their descendant sets, each sorted.
        let before: Vec<DescSets> = self.per_group(&mut stamps, &groups, |graph, stamps, touched| {
            stamps.clear();
            let mut origins = Vec::new();
            for &node in touched {
                if stamps.first_visit(node) {
                    origins.push(node);
                }
            }
            graph.walk(stamps, false, &mut origins, 0, usize::MAX);
            let mut sets = DescSets { origins: Vec::with_capacity(origins.len()), nodes: Vec::new() };
            for origin in origins {
                stamps.clear();
                let start = sets.nodes.len();
                graph.reach_into(stamps, origin, true, usize::MAX, &mut sets.nodes);
                sets.nodes[start..].sort_unstable();
                sets.origins.push((origin, start..sets.nodes.len()));
            }
            sets
        });

        for update in updates {
            match update.op {
                EdgeOp::Add if update.from != update.to => {
                    self.add_edge(&update.from, &update.to);
                }
                EdgeOp::Add => {}
                EdgeOp::Remove => {
                    self.remove_edge(&update.from, &update.to);
                }
            }
        }

        // After: the same origins' new sets, and the differences.
        let bound = max_descendants.saturating_add(1);
        let per_group = self.per_group(&mut stamps, &before, |graph, stamps, sets| {
            let (mut changes, mut over) = (Vec::new(), None);
            let mut new = Vec::new();
            for (origin, range) in &sets.origins {
                stamps.clear();
                new.clear();
                let was_over = range.len() > max_descendants;
                graph.reach_into(stamps, *origin, true, if was_over { usize::MAX } else { bound }, &mut new);
                if new.len() > max_descendants && !was_over {
                    over = Some(*origin);
                    continue;
                }
                new.sort_unstable();
                let (mut added, mut removed) = (Vec::new(), Vec::new());
                for_each_difference(&sets.nodes[range.clone()], &new, |node, is_new| {
                    let name = graph.name(node).to_string();
                    if is_new {
                        added.push(name)
                    } else {
                        removed.push(name)
                    }
                });
                if added.is_empty() && removed.is_empty() {
                    continue;
                }
                if was_over && new.len() > max_descendants && !added.is_empty() {
                    over = Some(*origin);
                }
                added.sort_unstable();
                removed.sort_unstable();
                changes.push(DescChange { origin: graph.name(*origin).to_string(), added, removed });
            }
            (changes, over)
        });
        self.stamps = stamps;
        let over = per_group.iter().find_map(|(_, over)| *over);
        let mut changes: Vec<DescChange> = per_group.into_iter().flat_map(|(changes, _)| changes).collect();
        changes.sort_unstable_by(|a, b| a.origin.cmp(&b.origin));
        (changes, over)
    }

    /// Runs `work` on every group, on up to [`MAX_GROUP_THREADS`] scoped threads
    /// (at most the available cores) when there are several groups (the graph is
    /// only read); each thread has its own stamps from `pool`, grown to the graph.
    fn per_group<G: Sync, T: Send>(
        &self,
        pool: &mut Vec<Stamps>,
        groups: &[G],
        work: impl Fn(&Graph, &mut Stamps, &G) -> T + Sync,
    ) -> Vec<T> {
        // Asked only for several groups: it reads the cgroup's files each time.
        let threads = match groups.len() {
            0 | 1 => 1,
            groups => std::thread::available_parallelism().map_or(2, |n| n.get()).min(MAX_GROUP_THREADS).min(groups),
        };
        if pool.len() < threads {
            pool.resize_with(threads, Stamps::default);
        }
        for stamps in pool.iter_mut().take(threads) {
            stamps.cover(self.names.len());
        }
        if threads == 1 {
            return groups.iter().map(|group| work(self, &mut pool[0], group)).collect();
        }
        let chunk = groups.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .chunks(chunk)
                .zip(pool.iter_mut())
                .map(|(part, stamps)| {
                    let work = &work;
                    scope.spawn(move || part.iter().map(|group| work(self, stamps, group)).collect::<Vec<T>>())
                })
                .collect();
            // A panic in a group is the batch's, not a silently empty group.
            handles
                .into_iter()
                .flat_map(|handle| handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
                .collect()
        })
    }
}

/// A group's origins and their descendant sets, each set a sorted range of `nodes`
/// (one allocation for the group, not one per origin).
struct DescSets {
    origins: Vec<(NodeId, std::ops::Range<usize>)>,
    nodes: Vec<NodeId>,
}

/// Calls `each(node, true)` for every node only in `new` and `each(node, false)` for
/// every node only in `old`; both sorted.
fn for_each_difference(old: &[NodeId], new: &[NodeId], mut each: impl FnMut(NodeId, bool)) {
    let (mut i, mut j) = (0, 0);
    while i < old.len() && j < new.len() {
        match old[i].cmp(&new[j]) {
            std::cmp::Ordering::Less => {
                each(old[i], false);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                each(new[j], true);
                j += 1;
            }
            std::cmp::Ordering::Equal => (i, j) = (i + 1, j + 1),
        }
    }
    old[i..].iter().for_each(|&node| each(node, false));
    new[j..].iter().for_each(|&node| each(node, true));
}

/// The nodes a traversal has visited.
trait Visited {
    /// Marks `node` visited; false when it already was.
    fn first_visit(&mut self, node: NodeId) -> bool;
}

/// For one traversal: grows with what it visits.
impl Visited for FxHashSet<NodeId> {
    fn first_visit(&mut self, node: NodeId) -> bool {
        self.insert(node)
    }
}

/// For many traversals of one graph (a batch, and the next): each node is stamped
/// with the number of the traversal that visited it, so the next traversal starts by
/// counting on (no hashing, no per-traversal reset; a full reset once every 2³²).
#[derive(Debug, Clone)]
struct Stamps {
    stamps: Vec<u32>,
    /// The running traversal's number; never 0, the stamp of a node never visited.
    current: u32,
}

impl Default for Stamps {
    fn default() -> Self {
        Stamps { stamps: Vec::new(), current: 1 }
    }
}

impl Stamps {
    /// Grows to `nodes` nodes; the new ones unvisited.
    fn cover(&mut self, nodes: usize) {
        if self.stamps.len() < nodes {
            self.stamps.resize(nodes, 0);
        }
    }

    /// Forgets every visit.
    fn clear(&mut self) {
        self.current = self.current.wrapping_add(1);
        if self.current == 0 {
            self.stamps.fill(0);
            self.current = 1;
        }
    }
}

impl Visited for Stamps {
    fn first_visit(&mut self, node: NodeId) -> bool {
        let stamp = &mut self.stamps[node as usize];
        let first = *stamp != self.current;
        *stamp = self.current;
        first
    }
}

/// Applies a change to a sorted descendant list, keeping it sorted.
pub fn apply_change<S: AsRef<str>>(desc: &mut Vec<String>, added: &[S], removed: &[S]) {
    desc.retain(|d| removed.binary_search_by(|r| r.as_ref().cmp(d)).is_err());
    for d in added {
        if let Err(at) = desc.binary_search_by(|known| known.as_str().cmp(d.as_ref())) {
            desc.insert(at, d.as_ref().to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    /// Brute force: reachability by repeated relaxation over an edge set.
    fn brute_desc(edges: &BTreeSet<(String, String)>, origin: &str) -> Vec<String> {
        let mut reached: BTreeSet<String> = BTreeSet::new();
        let mut frontier = vec![origin.to_string()];
        while let Some(node) = frontier.pop() {
            for (from, to) in edges {
                if *from == node && to != origin && reached.insert(to.clone()) {
                    frontier.push(to.clone());
                }
            }
        }
        reached.into_iter().collect()
    }

    fn updates() -> impl Strategy<Value = Vec<Vec<EdgeUpdate>>> {
        let update = (any::<bool>(), 0..8u8, 0..8u8).prop_map(|(add, f, t)| EdgeUpdate {
            op: if add { EdgeOp::Add } else { EdgeOp::Remove },
            from: format!("n{f}"),
            to: format!("n{t}"),
        });
        proptest::collection::vec(proptest::collection::vec(update, 0..12), 1..8)
    }

    proptest! {
        /// Applying each batch's changes to every origin's descendant list keeps the
        /// lists equal to brute-force reachability on the current graph — with
        /// diamonds, chains, cycles, self-loops, removals and re-adds.
        #[test]
        fn changes_track_reachability(batches in updates()) {
            let mut graph = Graph::default();
            let mut edges: BTreeSet<(String, String)> = BTreeSet::new();
            let mut views: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for batch in &batches {
                for update in batch {
                    let edge = (update.from.clone(), update.to.clone());
                    match update.op {
                        EdgeOp::Add if update.from != update.to => { edges.insert(edge); }
                        EdgeOp::Add => {}
                        EdgeOp::Remove => { edges.remove(&edge); }
                    }
                }
                let changes = graph.apply_batch(batch);
                let mut origins = BTreeSet::new();
                for change in &changes {
                    prop_assert!(origins.insert(change.origin.clone()), "one change per origin");
                    prop_assert!(!change.added.contains(&change.origin) && !change.removed.contains(&change.origin));
                    apply_change(views.entry(change.origin.clone()).or_default(), &change.added, &change.removed);
                }
                for n in 0..8 {
                    let origin = format!("n{n}");
                    let view = views.get(&origin).cloned().unwrap_or_default();
                    prop_assert_eq!(&view, &brute_desc(&edges, &origin), "origin {}", origin);
                    prop_assert_eq!(graph.descendants(&origin), view);
                    let ancestors: Vec<String> = (0..8)
                        .map(|a| format!("n{a}"))
                        .filter(|a| brute_desc(&edges, a).contains(&origin))
                        .collect();
                    prop_assert_eq!(graph.ancestors(&origin, 8), (ancestors.iter().map(String::as_str).collect(), false), "ancestors of {}", origin);
                    if !ancestors.is_empty() {
                        let (bounded, more) = graph.ancestors(&origin, ancestors.len() - 1);
                        prop_assert!(more && bounded.len() == ancestors.len() - 1, "bounded ancestors of {}", origin);
                    }
                }
                prop_assert_eq!(graph.edge_count(), edges.len());
            }
        }
    }

    #[test]
    fn stamps_forget_every_visit_when_their_count_wraps() {
        let mut stamps = Stamps::default();
        stamps.cover(3);
        assert!(stamps.first_visit(1) && !stamps.first_visit(1));
        stamps.clear();
        assert!(stamps.first_visit(1) && stamps.first_visit(2));
        stamps.current = u32::MAX;
        assert!(stamps.first_visit(0) && !stamps.first_visit(0));
        stamps.clear();
        assert!(stamps.first_visit(0) && stamps.first_visit(1));
        // Node 2 held stamp 2 before the wrap: the traversal after next
        // (number 2) must not take it for visited.
        stamps.clear();
        assert_eq!(stamps.current, 2);
        assert!(stamps.first_visit(2), "a stamp from before the wrap reads as visited");
        // Nodes added later start unvisited.
        stamps.cover(5);
        assert!(stamps.first_visit(4) && !stamps.first_visit(4));
    }

    #[test]
    fn differences_of_sorted_sets() {
        let mut seen = Vec::new();
        for_each_difference(&[1, 3, 5, 9], &[2, 3, 9, 10, 11], |node, is_new| seen.push((node, is_new)));
        assert_eq!(seen, vec![(1, false), (2, true), (5, false), (10, true), (11, true)]);
        seen.clear();
        for_each_difference(&[4], &[], |node, is_new| seen.push((node, is_new)));
        assert_eq!(seen, vec![(4, false)]);
    }

    #[test]
    fn no_op_updates_change_nothing() {
        let mut graph = Graph::default();
        let add = |f: &str, t: &str| EdgeUpdate { op: EdgeOp::Add, from: f.into(), to: t.into() };
        let remove = |f: &str, t: &str| EdgeUpdate { op: EdgeOp::Remove, from: f.into(), to: t.into() };
        assert_eq!(graph.apply_batch(&[add("a", "b")]).len(), 1);
        assert!(graph.apply_batch(&[add("a", "b"), remove("x", "y"), add("c", "c")]).is_empty());
        // Add then remove within one batch nets to nothing.
        assert!(graph.apply_batch(&[add("b", "c"), remove("b", "c")]).is_empty());
    }

    #[test]
    fn independent_components_are_processed_together() {
        let mut graph = Graph::default();
        let batch: Vec<EdgeUpdate> =
            (0..50).map(|i| EdgeUpdate { op: EdgeOp::Add, from: format!("a{i}"), to: format!("u{i}") }).collect();
        let changes = graph.apply_batch(&batch);
        assert_eq!(changes.len(), 50);
        assert!(changes.iter().all(|c| c.added.len() == 1 && c.removed.is_empty()));
        assert_eq!(graph.neighbours("u7", false), vec!["a7"]);
    }
}
