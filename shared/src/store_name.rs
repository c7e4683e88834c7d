//! The one name of each store tally keeps — a counter shard's or the graph's — from
//! which its directory, its snapshots' name and where `tally restore` puts it all
//! follow. Snapshots are named under the topic the store applies
//! (`t.shards/shard-0003`, `t.graph-updates/graph`), so a store never restores
//! another topic's state.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::kafka::TopicNames;
use crate::Error;

/// A store: counter shard `shard` of the shard topic `topic`, or the graph of the
/// graph-updates topic `topic`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StoreName {
    Shard { topic: String, shard: u32 },
    Graph { topic: String },
}

/// A shard's directory: `shard-` and its number in four digits (more past 9999).
const SHARD_PREFIX: &str = "shard-";
/// The graph's name within its topic.
const GRAPH: &str = "graph";

impl StoreName {
    /// Counter shard `shard` of the deployment `names`.
    pub fn shard(names: &TopicNames, shard: u32) -> Self {
        Self::Shard { topic: names.shards(), shard }
    }

    /// The graph of the deployment `names`.
    pub fn graph(names: &TopicNames) -> Self {
        Self::Graph { topic: names.graph_updates() }
    }

    /// Its directory's name: `shard-0003` (under the counter's data directory) or
    /// `graph` (the graph's data directory is its own).
    pub fn dir_name(&self) -> String {
        match self {
            Self::Shard { shard, .. } => format!("{SHARD_PREFIX}{shard:04}"),
            Self::Graph { .. } => GRAPH.to_string(),
        }
    }

    /// Where `tally restore --into` puts it: `<into>/counter/shard-0003`, `<into>/graph`.
    pub fn restore_dir(&self, into: &Path) -> PathBuf {
        match self {
            Self::Shard { .. } => into.join("counter").join(self.dir_name()),
            Self::Graph { .. } => into.join(GRAPH),
        }
    }

    /// The topic whose records it applies.
    pub fn topic(&self) -> &str {
        match self {
            Self::Shard { topic, .. } | Self::Graph { topic } => topic,
        }
    }
}

/// Its snapshots' name: `<topic>/shard-0003` or `<topic>/graph`.
impl fmt::Display for StoreName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.topic(), self.dir_name())
    }
}

impl FromStr for StoreName {
    type Err = Error;

    /// A snapshot name as [`Display`](fmt::Display) writes it (a trailing `/`, as an
    /// object store lists folders, is allowed).
    fn from_str(name: &str) -> Result<Self, Error> {
        let refuse = || Error::Snapshot(format!("`{name}` names no store: <topic>/shard-NNNN or <topic>/graph"));
        let (topic, last) = name.trim_end_matches('/').rsplit_once('/').ok_or_else(refuse)?;
        if topic.is_empty() {
            return Err(refuse());
        }
        let topic = topic.to_string();
        if last == GRAPH {
            return Ok(Self::Graph { topic });
        }
        let digits = last.strip_prefix(SHARD_PREFIX).ok_or_else(refuse)?;
        let shard: u32 = digits.parse().map_err(|_| refuse())?;
        // One spelling per shard: `shard-3` or `shard-00003` would be another name.
        if format!("{shard:04}") != digits {
            return Err(refuse());
        }
        Ok(Self::Shard { topic, shard })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_reads_back_as_the_store_it_names() {
        let names = TopicNames::new("t.");
        for store in [StoreName::shard(&names, 3), StoreName::shard(&names, 12_345), StoreName::graph(&names)] {
            let written = store.to_string();
            assert_eq!(written.parse::<StoreName>().expect("parses"), store, "{written}");
            assert_eq!(format!("{written}/").parse::<StoreName>().expect("parses"), store);
        }
        assert_eq!(StoreName::shard(&names, 3).to_string(), "t.shards/shard-0003");
        assert_eq!(StoreName::graph(&names).to_string(), "t.graph-updates/graph");
        let into = Path::new("/r");
        assert_eq!(StoreName::shard(&names, 3).restore_dir(into), Path::new("/r/counter/shard-0003"));
        assert_eq!(StoreName::graph(&names).restore_dir(into), Path::new("/r/graph"));
    }

    #[test]
    fn a_name_of_no_store_is_refused() {
        for name in ["shard-0001", "/shard-0001", "t.shards/shard-1", "t.shards/shard-x", "t.shards/other", "t.shards/"]
        {
            assert!(name.parse::<StoreName>().is_err(), "{name}");
        }
    }
}
