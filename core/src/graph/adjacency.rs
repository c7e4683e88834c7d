//! Each node's neighbours in one direction, in 4 bytes per node while it has at most
//! one: a slot holds no neighbour, the one neighbour's id, or (tagged with the top
//! bit) the index of a hash set of them. Most entities of a counting graph have one
//! parent, so most slots never allocate.

use rustc_hash::FxHashSet;

use super::NodeId;

/// A slot without neighbours.
const NONE: u32 = u32::MAX;
/// The tag of a slot holding a set's index (node ids stay below it: [`super::names::MAX_NODES`]).
const SET: u32 = 1 << 31;

#[derive(Debug, Default, Clone)]
pub(super) struct Adjacency {
    slots: Vec<u32>,
    sets: Vec<FxHashSet<NodeId>>,
    /// Sets emptied back into single slots, reused first.
    free: Vec<u32>,
}

impl Adjacency {
    /// A new node, without neighbours.
    pub(super) fn push(&mut self) {
        self.slots.push(NONE);
    }

    /// Adds `neighbour` to `node`'s; false when it was there.
    pub(super) fn insert(&mut self, node: NodeId, neighbour: NodeId) -> bool {
        let slot = self.slots[node as usize];
        match slot {
            NONE => self.slots[node as usize] = neighbour,
            _ if slot & SET != 0 => return self.sets[(slot & !SET) as usize].insert(neighbour),
            _ if slot == neighbour => return false,
            _ => {
                let set: FxHashSet<NodeId> = [slot, neighbour].into_iter().collect();
                let index = match self.free.pop() {
                    Some(index) => {
                        self.sets[index as usize] = set;
                        index
                    }
                    None => {
                        self.sets.push(set);
                        (self.sets.len() - 1) as u32
                    }
                };
                self.slots[node as usize] = SET | index;
            }
        }
        true
    }

    /// Removes `neighbour` from `node`'s; false when it was not there.
    pub(super) fn remove(&mut self, node: NodeId, neighbour: NodeId) -> bool {
        let slot = self.slots[node as usize];
        match slot {
            NONE => false,
            _ if slot & SET != 0 => {
                let index = slot & !SET;
                let set = &mut self.sets[index as usize];
                if !set.remove(&neighbour) {
                    return false;
                }
                if set.len() == 1 {
                    let last = set.iter().next().copied().unwrap_or(NONE);
                    self.sets[index as usize] = FxHashSet::default();
                    self.free.push(index);
                    self.slots[node as usize] = last;
                }
                true
            }
            _ if slot == neighbour => {
                self.slots[node as usize] = NONE;
                true
            }
            _ => false,
        }
    }

    pub(super) fn contains(&self, node: NodeId, neighbour: NodeId) -> bool {
        let slot = self.slots[node as usize];
        match slot {
            NONE => false,
            _ if slot & SET != 0 => self.sets[(slot & !SET) as usize].contains(&neighbour),
            _ => slot == neighbour,
        }
    }

    /// `node`'s neighbours, in no particular order.
    pub(super) fn of(&self, node: NodeId) -> Neighbours<'_> {
        let slot = self.slots[node as usize];
        match slot {
            NONE => Neighbours::One(None),
            _ if slot & SET != 0 => Neighbours::Set(self.sets[(slot & !SET) as usize].iter()),
            _ => Neighbours::One(Some(slot)),
        }
    }
}

/// The iterator of [`Adjacency::of`].
pub(super) enum Neighbours<'a> {
    One(Option<NodeId>),
    Set(std::collections::hash_set::Iter<'a, NodeId>),
}

impl Iterator for Neighbours<'_> {
    type Item = NodeId;

    fn next(&mut self) -> Option<NodeId> {
        match self {
            Neighbours::One(one) => one.take(),
            Neighbours::Set(set) => set.next().copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Random inserts and removes on a few nodes: every answer, and every node's
        /// neighbours, equal a map of sets.
        #[test]
        fn an_adjacency_holds_what_a_map_of_sets_holds(steps in prop::collection::vec((any::<bool>(), 0u32..4, 0u32..6), 0..200)) {
            let mut adjacency = Adjacency::default();
            (0..4).for_each(|_| adjacency.push());
            let mut model: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
            for (add, node, neighbour) in steps {
                let expected = match add {
                    true => model.entry(node).or_default().insert(neighbour),
                    false => model.entry(node).or_default().remove(&neighbour),
                };
                let done = if add { adjacency.insert(node, neighbour) } else { adjacency.remove(node, neighbour) };
                prop_assert_eq!(done, expected);
                for node in 0..4 {
                    let held: BTreeSet<u32> = adjacency.of(node).collect();
                    prop_assert_eq!(&held, &model.get(&node).cloned().unwrap_or_default());
                    for neighbour in 0..6 {
                        prop_assert_eq!(adjacency.contains(node, neighbour), held.contains(&neighbour));
                    }
                }
            }
            let live = adjacency.sets.iter().filter(|set| !set.is_empty()).count();
            prop_assert_eq!(live, model.values().filter(|set| set.len() > 1).count(), "a set per node of two or more");
        }
    }
}
