//! The graph's interned entity names: every name's bytes once, one after another in
//! a single arena, found through a hash table of node ids (4 bytes a name).
//!
//! A name's end is kept relative to its block of [`BLOCK`] ids, so a block's offsets
//! fit 32 bits while the arena grows past 4 GiB.

use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::NodeId;

/// Ids per block of relative offsets.
const BLOCK: usize = 1 << 16;

/// The most nodes one graph holds: ids stay below the adjacency's tag bit, and so do
/// its sets' indexes, one per node at most, so a tagged index never reads as its
/// empty slot ([`super::adjacency`]).
pub(super) const MAX_NODES: usize = (1 << 31) - 1;

/// Interned names, ids in the order they came.
#[derive(Debug, Default, Clone)]
pub(super) struct Names {
    bytes: String,
    /// Where each name ends, from its block's base.
    ends: Vec<u32>,
    /// Where each block starts in `bytes`.
    bases: Vec<u64>,
    ids: HashTable<NodeId>,
    /// Seeded per process: names come from producers, who must not pick collisions.
    hasher: foldhash::fast::RandomState,
}

impl Names {
    pub(super) fn len(&self) -> usize {
        self.ends.len()
    }

    /// The id of `name`, if interned.
    pub(super) fn id(&self, name: &str) -> Option<NodeId> {
        self.find(self.hasher.hash_one(name), name)
    }

    fn find(&self, hash: u64, name: &str) -> Option<NodeId> {
        self.ids.find(hash, |&id| self.name(id) == name).copied()
    }

    /// The id of `name`, interned now if it was not (and whether it was new); `None`
    /// when it is new and the graph holds [`MAX_NODES`] already, or its block's
    /// names would pass 4 GiB (entity names are at most 256 bytes: never).
    pub(super) fn intern(&mut self, name: &str) -> Option<(NodeId, bool)> {
        let hash = self.hasher.hash_one(name);
        if let Some(id) = self.find(hash, name) {
            return Some((id, false));
        }
        let id = self.len();
        let base = match id % BLOCK {
            0 => self.bytes.len() as u64,
            _ => self.bases[id / BLOCK],
        };
        let end = u32::try_from(self.bytes.len() as u64 + name.len() as u64 - base).ok();
        let end = end.filter(|_| id < MAX_NODES)?;
        if id.is_multiple_of(BLOCK) {
            self.bases.push(base);
        }
        self.bytes.push_str(name);
        self.ends.push(end);
        let id = id as NodeId;
        let (bytes, ends, bases, hasher) = (&self.bytes, &self.ends, &self.bases, &self.hasher);
        self.ids.insert_unique(hash, id, |&known| hasher.hash_one(slice(bytes, ends, bases, known)));
        Some((id, true))
    }

    pub(super) fn name(&self, id: NodeId) -> &str {
        slice(&self.bytes, &self.ends, &self.bases, id)
    }
}

fn slice<'a>(bytes: &'a str, ends: &[u32], bases: &[u64], id: NodeId) -> &'a str {
    let id = id as usize;
    let base = bases[id / BLOCK] as usize;
    let start = if id.is_multiple_of(BLOCK) { 0 } else { ends[id - 1] as usize };
    &bytes[base + start..base + ends[id] as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_back_by_id_and_ids_by_name_across_blocks() {
        let mut names = Names::default();
        let all: Vec<String> = (0..BLOCK * 2 + 7).map(|i| format!("entity:{i}")).collect();
        for (i, name) in all.iter().enumerate() {
            assert_eq!(names.intern(name), Some((i as NodeId, true)));
        }
        assert_eq!(names.intern("entity:5"), Some((5, false)), "interned once");
        assert_eq!(names.len(), all.len());
        for (i, name) in all.iter().enumerate() {
            assert_eq!((names.name(i as NodeId), names.id(name)), (name.as_str(), Some(i as NodeId)));
        }
        assert_eq!(names.id("entity:unknown"), None);
        assert!(names.intern("").is_some_and(|(id, new)| new && names.name(id).is_empty()));
    }
}
