//! The graph's RocksDB and the batch step: edges, idempotency marks, the outbox of
//! descendant changes and the progress, always written together.
//!
//! Column families: `edges` (`from 0x00 to` → empty; the whole graph is loaded into
//! memory at start), `in_edges` (`to 0x00 from`, the same edges by target, for tools
//! that read the store without loading it), `dedupe` (`from 0x00 id` → its first record's time, dropped by a compaction
//! filter after the window, [`DedupeWindow`]), `outbox` (descendant changes for the counter shards,
//! deleted once relayed), `letters` (dead letters of refused updates, for the
//! dead-letter topic, deleted once relayed) and the default one for [`Progress`].

use std::path::Path;
use std::sync::RwLock;

use rocksdb::{ColumnFamily, ColumnFamilyDescriptor, Options, WriteBatch};
use tally_core::format::PRESENT;
use tally_core::graph::{DescChange, EdgeOp, EdgeUpdate, Graph, Refusal};
use tally_core::records::split_by_size;
use tally_core::sharding::shard_of;
use tally_core::wire::{
    desc_change_bound, split_desc_change, DeadLetter, GraphMessage, GraphUpdate, ShardMessage, Source, Stamp,
};
use tally_shared::dedupe::DedupeWindow;
use tally_shared::outbox::{outbox_key, OutboxEntry};
use tally_shared::progress::Progress;
use tally_shared::store::{Durability, Store};

use crate::error::Result;

const CF_EDGES: &str = "edges";
const CF_IN_EDGES: &str = "in_edges";
const CF_DEDUPE: &str = "dedupe";
const CF_OUTBOX: &str = "outbox";
const CF_LETTERS: &str = "letters";
/// Settings of the graph store.
#[derive(Debug, Clone)]
pub struct GraphOptions {
    /// Partitions of the shard topic: where each origin's changes go.
    pub shards: u32,
    pub dedupe_window_ms: i64,
    pub sync_writes: bool,
    /// The most bytes of one outbox record ([`tally_core::records`]).
    pub record_budget: usize,
    /// The most descendants one entity may have (`graph.max_descendants`): an add
    /// that would give one more is refused and dead-lettered.
    pub max_descendants: usize,
    /// The producers' graph topic: where a refused update came from.
    pub input_topic: String,
}

/// One record of the graph-updates topic.
#[derive(Debug, Clone, Copy)]
pub struct UpdateRecord<'a> {
    pub offset: i64,
    pub payload: &'a [u8],
    /// The time of the producer's record (set by the ingester); the dedupe window
    /// runs on it. `None`: the apply time.
    pub timestamp: Option<i64>,
}

/// What one batch did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    pub updates: u64,
    pub redelivered: u64,
    pub duplicate_ids: u64,
    /// The record that does not decode, and why: the batch stopped at it.
    pub undecodable: Option<(i64, String)>,
    /// `(next offset, offset found)`: the log skips records the store has not
    /// applied (deleted by retention, a recreated topic); the batch stopped there.
    pub gap: Option<(i64, i64)>,
    /// Origins whose descendant set changed.
    pub changes: u64,
    /// Adds refused for passing `max_descendants`, each dead-lettered.
    pub refused: u64,
    pub outbox_messages: u64,
}

/// What [`GraphStore::graph`]'s lock guards ([`tally_shared::lock`]).
pub const GRAPH: &str = "the graph";

pub struct GraphStore {
    /// The database and its progress ([`tally_shared::store`]).
    store: Store,
    options: GraphOptions,
    /// The graph in memory; readers take the read lock.
    pub graph: RwLock<Graph>,
    /// Idempotency marks live for this window of record time.
    dedupe: DedupeWindow,
}

impl GraphStore {
    /// Opens (creating when missing) the store at `path` and loads the graph.
    pub fn open(path: &Path, options: GraphOptions) -> Result<Self> {
        let mut dedupe = Options::default();
        let dedupe_window = DedupeWindow::new(options.dedupe_window_ms);
        dedupe.set_compaction_filter("tally_graph_dedupe_ttl", dedupe_window.compaction_filter());
        let families = vec![
            ColumnFamilyDescriptor::new(CF_EDGES, Options::default()),
            ColumnFamilyDescriptor::new(CF_IN_EDGES, Options::default()),
            ColumnFamilyDescriptor::new(CF_DEDUPE, dedupe),
            ColumnFamilyDescriptor::new(CF_OUTBOX, Options::default()),
            ColumnFamilyDescriptor::new(CF_LETTERS, Options::default()),
        ];
        let durability = if options.sync_writes { Durability::WalSynced } else { Durability::Wal };
        let store = Store::open(path, Options::default(), families, durability)?;
        let mut graph = Graph::default();
        {
            for item in store.db().iterator_cf(store.cf(CF_EDGES)?, rocksdb::IteratorMode::Start) {
                let (key, value) = item?;
                tally_core::format::check_present(&value, "edge")?;
                let (from, to) = decode_edge(&key)
                    .ok_or_else(|| tally_core::Error::Format(format!("edge key {key:?}: malformed")))?;
                graph.add_edge(from, to);
            }
        }
        tracing::info!(edges = graph.edge_count(), next_offset = ?store.next_offset(), "graph loaded");
        Ok(Self { store, options, graph: RwLock::new(graph), dedupe: dedupe_window })
    }

    fn cf(&self, name: &str) -> Result<&ColumnFamily> {
        Ok(self.store.cf(name)?)
    }

    /// The database and its progress (for snapshots).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// A copy of the committed progress.
    pub fn progress(&self) -> Progress {
        self.store.progress()
    }

    /// The committed next graph-updates offset.
    pub fn next_offset(&self) -> Option<i64> {
        self.store.next_offset()
    }

    /// Applies a batch of records (in offset order) at wall-clock `now`: the net
    /// descendant changes of the whole batch go into the outbox, with the edges and
    /// the progress, in one write batch.
    pub fn apply(&self, records: &[UpdateRecord<'_>], now: i64) -> Result<BatchReport> {
        let mut report = BatchReport::default();
        let mut progress = self.progress();
        let mut batch = WriteBatch::default();
        let dedupe_cf = self.cf(CF_DEDUPE)?;
        let mut ids_in_batch = std::collections::HashSet::new();
        let mut applied_times = Vec::new();
        for record in records {
            if progress.next_offset.is_some_and(|next| record.offset < next) {
                continue;
            }
            if let Some(next) = progress.next_offset.filter(|next| record.offset > *next) {
                report.gap = Some((next, record.offset));
                break;
            }
            let (source, entries) = match GraphMessage::decode(record.payload) {
                Ok(GraphMessage::Updates { source, entries }) => (source, entries),
                // How far the router has routed: what write tokens wait for.
                Ok(GraphMessage::Marks { marks }) => {
                    progress.next_offset = Some(record.offset + 1);
                    for (source, stamp) in marks {
                        progress.advance(source, stamp);
                    }
                    continue;
                }
                Err(err) => {
                    // Stop here: what came before commits, the offset stays at it.
                    report.undecodable = Some((record.offset, err.to_string()));
                    break;
                }
            };
            progress.next_offset = Some(record.offset + 1);
            let record_time = record.timestamp.unwrap_or(now);
            applied_times.push((source, record_time));
            let mut updates: Vec<EdgeUpdate> = Vec::with_capacity(entries.len());
            let mut origins: Vec<(Stamp, Option<String>)> = Vec::with_capacity(entries.len());
            // Idempotency marks of the record's updates, written once the step kept them.
            let mut marks: Vec<(usize, Vec<u8>)> = Vec::new();
            for (stamp, update) in entries {
                if !progress.advance(source, stamp) {
                    report.redelivered += 1;
                    continue;
                }
                if let Some(id) = &update.id {
                    let key = dedupe_key(&update.edge.from, id);
                    if !ids_in_batch.insert(key.clone()) || self.seen_recently(&key, record_time)? {
                        report.duplicate_ids += 1;
                        continue;
                    }
                    marks.push((updates.len(), key));
                }
                report.updates += 1;
                updates.push(update.edge);
                origins.push((stamp, update.id));
            }
            // One step of the algorithm per record, stamped with the record's offset:
            // what a record emits depends only on the log before it, never on where a
            // batch happened to end, so rebuilding the graph from the log (a lost
            // disk) emits the very same stamps and the counters drop what they have.
            let (changes, refused) = self.step(&updates, &mut batch)?;
            // A refused update took no effect: its id stays free for a retry (after
            // the bound is raised, say).
            for (index, key) in marks {
                if refused.iter().any(|refusal| refusal.index == index) {
                    ids_in_batch.remove(&key);
                } else {
                    batch.put_cf(dedupe_cf, &key, DedupeWindow::mark(record_time, source));
                }
            }
            report.changes += changes.len() as u64;
            report.refused += refused.len() as u64;
            self.put_letters(&mut batch, record.offset, source, &updates, &origins, refused)?;
            report.outbox_messages += self.put_outbox(&mut batch, record.offset, changes)?;
        }
        self.store.commit(batch, progress)?;
        for (source, record_time) in applied_times {
            self.dedupe.advance(source, record_time);
        }
        Ok(report)
    }

    /// Applies one record's updates to the graph and the edge column families;
    /// returns the net descendant changes and the adds refused.
    fn step(&self, updates: &[EdgeUpdate], batch: &mut WriteBatch) -> Result<(Vec<DescChange>, Vec<Refusal>)> {
        if updates.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut graph = tally_shared::lock::write(&self.graph, GRAPH);
        let (changes, refused) = graph.apply_bounded(updates, self.options.max_descendants);
        let (edges_cf, in_edges_cf) = (self.cf(CF_EDGES)?, self.cf(CF_IN_EDGES)?);
        for update in updates {
            let (key, in_key) = (encode_edge(&update.from, &update.to), encode_edge(&update.to, &update.from));
            if graph.has_edge(&update.from, &update.to) {
                batch.put_cf(edges_cf, &key, PRESENT);
                batch.put_cf(in_edges_cf, &in_key, PRESENT);
            } else {
                batch.delete_cf(edges_cf, &key);
                batch.delete_cf(in_edges_cf, &in_key);
            }
        }
        Ok((changes, refused))
    }

    /// The dead letters of a record's refused updates, into `letters` with the
    /// batch: each names the producer's record it came from (its stamp) and why.
    fn put_letters(
        &self,
        batch: &mut WriteBatch,
        offset: i64,
        source: Source,
        updates: &[EdgeUpdate],
        origins: &[(Stamp, Option<String>)],
        refused: Vec<Refusal>,
    ) -> Result<()> {
        let letters_cf = self.cf(CF_LETTERS)?;
        for (chunk, refusal) in refused.into_iter().enumerate() {
            let (update, (stamp, id)) = (&updates[refusal.index], &origins[refusal.index]);
            let reason = format!(
                "add_edge {} -> {}: {}'s descendants would pass {} (graph.max_descendants); the graph is unchanged",
                update.from, update.to, refusal.origin, self.options.max_descendants
            );
            let element = GraphUpdate { edge: update.clone(), id: id.clone() };
            let letter = DeadLetter::encode(
                &self.options.input_topic,
                source.partition as i32,
                stamp.offset,
                Some(stamp.index),
                &reason,
                &graph_element(&element),
                self.options.record_budget,
            )?;
            batch.put_cf(letters_cf, outbox_key(offset, 0, chunk as u32), letter);
        }
        Ok(())
    }

    /// Each change goes to the shard that owns its origin, stamped (offset of the
    /// graph-updates record, index) so a counter drops what it already applied. A change too big
    /// for one record is split into several of the same origin, and a shard's
    /// changes into as many records as their size needs.
    fn put_outbox(&self, batch: &mut WriteBatch, offset: i64, changes: Vec<DescChange>) -> Result<u64> {
        let outbox_cf = self.cf(CF_OUTBOX)?;
        let budget = self.options.record_budget;
        let mut per_shard: std::collections::BTreeMap<u32, Vec<(Stamp, DescChange)>> = Default::default();
        let pieces = changes.into_iter().flat_map(|change| split_desc_change(change, budget));
        for (index, change) in pieces.enumerate() {
            let stamp = Stamp { offset, index: index as u32 };
            per_shard.entry(shard_of(&change.origin, self.options.shards)).or_default().push((stamp, change));
        }
        let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
        let mut messages = 0;
        for (shard, entries) in per_shard {
            for (chunk, part) in split_by_size(&entries, budget, |(_, c)| desc_change_bound(c)).into_iter().enumerate()
            {
                let payload = ShardMessage::DescChanges { source, entries: part.to_vec() }.encode()?;
                batch.put_cf(outbox_cf, outbox_key(offset, shard, chunk as u32), payload);
                messages += 1;
            }
        }
        Ok(messages)
    }

    fn seen_recently(&self, key: &[u8], record_time: i64) -> Result<bool> {
        Ok(match self.store.db().get_pinned_cf(self.cf(CF_DEDUPE)?, key)? {
            Some(mark) => self.dedupe.repeats(&mark, record_time)?,
            None => false,
        })
    }

    /// The outbox in send order: what [`GraphStore::relay_outbox`] sends (a
    /// benchmark without counters reads and drops it instead).
    pub fn outbox(&self) -> Result<Vec<OutboxEntry>> {
        Ok(self.store.outbox(CF_OUTBOX)?)
    }

    /// Drops relayed outbox entries.
    pub fn delete_outbox(&self, entries: &[OutboxEntry]) -> Result<()> {
        Ok(self.store.delete_outbox(CF_OUTBOX, entries)?)
    }

    /// Relays the outbox to the shards ([`Store::relay_outbox`]); returns how many
    /// entries went.
    pub fn relay_outbox(&self, relay: &tally_shared::outbox::Relay) -> Result<u64> {
        Ok(self.store.relay_outbox(CF_OUTBOX, relay, "graph")?)
    }

    /// How far it applied, relayed and took each of `sources` ([`Store::positions`]).
    pub fn positions(&self, sources: &[Source]) -> Result<tally_core::wire::Positions> {
        Ok(self.store.positions(CF_OUTBOX, sources)?)
    }

    /// The dead letters not yet relayed, in order (each for partition 0).
    pub fn letters(&self) -> Result<Vec<OutboxEntry>> {
        Ok(self.store.outbox(CF_LETTERS)?)
    }

    /// Drops relayed dead letters.
    pub fn delete_letters(&self, entries: &[OutboxEntry]) -> Result<()> {
        Ok(self.store.delete_outbox(CF_LETTERS, entries)?)
    }
}

fn encode_edge(from: &str, to: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(from.len() + to.len() + 1);
    key.extend_from_slice(from.as_bytes());
    key.push(0);
    key.extend_from_slice(to.as_bytes());
    key
}

fn decode_edge(key: &[u8]) -> Option<(&str, &str)> {
    let split = key.iter().position(|&b| b == 0)?;
    Some((std::str::from_utf8(&key[..split]).ok()?, std::str::from_utf8(&key[split + 1..]).ok()?))
}

/// A graph update as a producer writes it (`{"op","from","to","id"}`).
fn graph_element(update: &GraphUpdate) -> Vec<u8> {
    let op = match update.edge.op {
        EdgeOp::Add => "add_edge",
        EdgeOp::Remove => "remove_edge",
    };
    let mut element = serde_json::json!({"op": op, "from": update.edge.from, "to": update.edge.to});
    if let Some(id) = &update.id {
        element["id"] = serde_json::Value::String(id.clone());
    }
    element.to_string().into_bytes()
}

fn dedupe_key(from: &str, id: &str) -> Vec<u8> {
    encode_edge(from, id)
}

#[cfg(test)]
mod tests {
    use tally_core::wire::{Positions, ShardMessageRef};

    use super::*;

    const NOW: i64 = 1_763_780_000_000;

    fn options() -> GraphOptions {
        GraphOptions {
            shards: 4,
            dedupe_window_ms: 86_400_000,
            sync_writes: false,
            record_budget: 900_000,
            max_descendants: 1_000,
            input_topic: "tally.graph".into(),
        }
    }

    fn record(offset: i64, updates: &[(bool, &str, &str, Option<&str>)]) -> Vec<u8> {
        let source = Source { stream: Source::GRAPH, partition: 0 };
        let entries = updates
            .iter()
            .enumerate()
            .map(|(index, &(add, from, to, id))| {
                let op = if add { EdgeOp::Add } else { EdgeOp::Remove };
                let edge = EdgeUpdate { op, from: from.into(), to: to.into() };
                (Stamp { offset, index: index as u32 }, GraphUpdate { edge, id: id.map(Into::into) })
            })
            .collect();
        GraphMessage::Updates { source, entries }.encode().unwrap()
    }

    fn changes(store: &GraphStore) -> Vec<DescChange> {
        let mut all = Vec::new();
        for entry in store.outbox().unwrap() {
            let ShardMessageRef::DescChanges { entries, .. } = ShardMessageRef::decode(&entry.payload).unwrap() else {
                panic!("the graph only sends descendant changes");
            };
            for (_, change) in entries {
                assert_eq!(entry.partition, shard_of(change.origin, 4));
                all.push(change.into_owned());
            }
        }
        all.sort_by(|a, b| a.origin.cmp(&b.origin));
        all
    }

    /// What the graph emits depends on the log alone: a store rebuilt from the log
    /// in other batches (after losing its disk) emits the same stamped records, so
    /// the counters drop what they already applied.
    #[test]
    fn emissions_do_not_depend_on_batch_boundaries() {
        let log = [
            record(0, &[(true, "a", "b", None), (true, "b", "c", None)]),
            record(1, &[(true, "c", "d", Some("x")), (false, "a", "b", None)]),
            record(2, &[(true, "a", "b", None), (true, "d", "a", None)]),
            record(3, &[(false, "b", "c", None), (true, "c", "d", Some("x"))]),
        ];
        let records: Vec<UpdateRecord<'_>> = log
            .iter()
            .enumerate()
            .map(|(offset, payload)| UpdateRecord { offset: offset as i64, payload, timestamp: Some(NOW) })
            .collect();
        let emitted = |batches: &[&[UpdateRecord<'_>]]| {
            let dir = tempfile::tempdir().unwrap();
            let store = GraphStore::open(dir.path(), options()).unwrap();
            for batch in batches {
                store.apply(batch, NOW).unwrap();
            }
            store.outbox().unwrap().into_iter().map(|e| (e.key, e.partition, e.payload)).collect::<Vec<_>>()
        };
        let at_once = emitted(&[&records]);
        assert!(at_once.len() >= 4);
        assert_eq!(emitted(&[&records[..1], &records[1..3], &records[3..]]), at_once);
        assert_eq!(emitted(&[&records[..3], &records[3..]]), at_once);
    }

    /// The router's marks move the graph's high water over records it had no
    /// updates in; positions say what it applied, and relayed once the outbox
    /// holds nothing of it.
    #[test]
    fn marks_and_relays_show_in_the_positions() {
        let dir = tempfile::tempdir().unwrap();
        let store = GraphStore::open(dir.path(), options()).unwrap();
        let source = Source { stream: Source::GRAPH, partition: 0 };
        let edge = record(3, &[(true, "a", "b", None)]);
        let marks = GraphMessage::Marks { marks: vec![(source, Stamp::through(8))] }.encode().unwrap();
        let replayed = record(5, &[(true, "x", "y", None)]);
        let log = [
            UpdateRecord { offset: 0, payload: &edge, timestamp: None },
            UpdateRecord { offset: 1, payload: &marks, timestamp: None },
            UpdateRecord { offset: 2, payload: &replayed, timestamp: None },
        ];
        let report = store.apply(&log, NOW).unwrap();
        assert_eq!((report.updates, report.redelivered), (1, 1), "an update below the mark is a replay");
        let marked = Positions { applied: 3, relayed: 0, high_water: vec![Some(Stamp::through(8))] };
        assert_eq!(store.positions(&[source]).unwrap(), marked);
        store.delete_outbox(&store.outbox().unwrap()).unwrap();
        assert_eq!(store.positions(&[source]).unwrap(), Positions { relayed: 3, ..marked });
    }

    #[test]
    fn batches_persist_edges_changes_and_progress_together() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = GraphStore::open(dir.path(), options()).unwrap();
            let first = record(0, &[(true, "a", "b", Some("g1")), (true, "b", "c", None)]);
            let report = store.apply(&[UpdateRecord { offset: 0, payload: &first, timestamp: None }], NOW).unwrap();
            assert_eq!((report.updates, report.changes), (2, 2));
            let got = changes(&store);
            assert_eq!(got[0], DescChange { origin: "a".into(), added: vec!["b".into(), "c".into()], removed: vec![] });
            assert_eq!(got[1], DescChange { origin: "b".into(), added: vec!["c".into()], removed: vec![] });
            store.delete_outbox(&store.outbox().unwrap()).unwrap();
        }
        let store = GraphStore::open(dir.path(), options()).unwrap();
        assert_eq!(store.graph.read().unwrap().descendants("a"), vec!["b".to_string(), "c".to_string()]);
        let in_edges: Vec<Vec<u8>> = store
            .store
            .db()
            .iterator_cf(store.cf(CF_IN_EDGES).unwrap(), rocksdb::IteratorMode::Start)
            .map(|item| item.unwrap().0.to_vec())
            .collect();
        assert_eq!(in_edges, vec![b"b\0a".to_vec(), b"c\0b".to_vec()], "in-edges are stored too");
        assert_eq!(store.progress().next_offset, Some(1));
        // A redelivered record, a retried id and a fresh removal.
        let again = record(0, &[(true, "a", "b", Some("g1"))]);
        let retry = record(1, &[(false, "a", "b", Some("g1")), (false, "b", "c", None)]);
        let records = [
            UpdateRecord { offset: 0, payload: &again, timestamp: None },
            UpdateRecord { offset: 1, payload: &retry, timestamp: None },
        ];
        let report = store.apply(&records, NOW).unwrap();
        assert_eq!((report.updates, report.duplicate_ids), (1, 1));
        let got = changes(&store);
        assert_eq!(got[0], DescChange { origin: "a".into(), added: vec![], removed: vec!["c".into()] });
        assert_eq!(got[1], DescChange { origin: "b".into(), added: vec![], removed: vec!["c".into()] });
    }

    /// An add that would pass `max_descendants` changes nothing — no edge, no
    /// descendant change — and leaves one dead letter naming the producer's record
    /// and why; the adds around it in the same record apply.
    #[test]
    fn adds_past_max_descendants_are_dead_lettered_and_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = GraphStore::open(dir.path(), GraphOptions { max_descendants: 2, ..options() }).unwrap();
        let log = record(
            7,
            &[(true, "a", "b", None), (true, "b", "c", None), (true, "c", "d", Some("k")), (true, "x", "y", None)],
        );
        let report = store.apply(&[UpdateRecord { offset: 7, payload: &log, timestamp: None }], NOW).unwrap();
        assert_eq!((report.updates, report.refused), (4, 1));
        let graph = store.graph.read().unwrap();
        assert_eq!(
            (graph.descendants("a"), graph.has_edge("c", "d"), graph.edge_count()),
            (vec!["b".into(), "c".into()], false, 3)
        );
        drop(graph);
        let got = changes(&store);
        let origins: Vec<&str> = got.iter().map(|c| c.origin.as_str()).collect();
        assert_eq!(origins, ["a", "b", "x"]);
        let letters = store.letters().unwrap();
        assert_eq!(letters.len(), 1);
        let letter: DeadLetter = serde_json::from_slice(&letters[0].payload).unwrap();
        let payload = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &letter.payload).unwrap();
        assert_eq!(
            (letter.topic.as_str(), letter.offset, letter.index, letter.reason.as_str(), payload),
            (
                "tally.graph",
                7,
                Some(2),
                "add_edge c -> d: a's descendants would pass 2 (graph.max_descendants); the graph is unchanged",
                br#"{"from":"c","id":"k","op":"add_edge","to":"d"}"#.to_vec()
            )
        );
        store.delete_letters(&letters).unwrap();
        assert!(store.letters().unwrap().is_empty());
        // Its id took no effect: sent again, it is refused again, not dropped as a repeat.
        let retry = record(8, &[(true, "c", "d", Some("k"))]);
        let report = store.apply(&[UpdateRecord { offset: 8, payload: &retry, timestamp: None }], NOW).unwrap();
        assert_eq!((report.updates, report.duplicate_ids, report.refused), (1, 0, 1));
    }
}
