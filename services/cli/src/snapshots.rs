//! `tally snapshot list` and `tally restore`: the snapshots of the counter shards and
//! of the graph, and disaster recovery from them into an empty data directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Subcommand;
use indicatif::{ProgressBar, ProgressStyle};
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{now_ms, TopicNames};
use tally_shared::snapshot::{restore_in_parallel, Manifest, SnapshotStore};
use tally_shared::store_name::StoreName;

/// `tally snapshot`: asks every counter and tally-graph (found on the shard-owners
/// topic) to snapshot what it serves now, and waits until all are stored.
pub async fn take_now(config: &TallyConfig) -> anyhow::Result<()> {
    let claims = crate::shards::claims(config).await?;
    let graph = tally_core::wire::ShardOwner::GRAPH;
    let graph_addr = claims.iter().find(|(shard, _)| **shard == graph).and_then(|(_, addr)| addr.clone());
    let mut counters: Vec<String> =
        claims.into_iter().filter(|(shard, _)| *shard != graph).filter_map(|(_, addr)| addr).collect();
    counters.sort();
    counters.dedup();
    if counters.is_empty() && graph_addr.is_none() {
        bail!("no counter claims a shard and no graph processor runs right now");
    }
    let services: Vec<String> = counters.iter().cloned().chain(graph_addr.clone()).collect();
    let bar = ProgressBar::new(services.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("snapshots {bar:30} {pos}/{len} services {msg}")
            .context("progress bar template")?,
    );
    let mut stored = Vec::new();
    for service in &services {
        bar.set_message(service.clone());
        let nothing = serde_json::json!({});
        let body =
            crate::shards::post_internal(config, service, "/internal/v1/snapshots", &nothing, Duration::from_secs(660))
                .await?;
        let manifests: Vec<Manifest> =
            serde_json::from_value(body["snapshots"].clone()).context("the service's snapshots")?;
        stored.extend(manifests);
        bar.inc(1);
    }
    bar.finish_with_message("done");
    stored.sort_by(|a, b| a.name.cmp(&b.name));
    for manifest in &stored {
        let next = manifest.next_offset.map_or("-".to_string(), |o| o.to_string());
        println!("{}  {}  next offset {next}  {:.1} MB", manifest.name, manifest.id, manifest.bytes() as f64 / 1e6);
    }
    let graph_name = format!("{}/graph", TopicNames::new(&config.kafka.topic_prefix).graph_updates());
    let (graphs, shards): (Vec<&Manifest>, Vec<&Manifest>) = stored.iter().partition(|m| m.name == graph_name);
    println!("{} shard snapshots stored, from {} counters", shards.len(), counters.len());
    if graph_addr.is_some() {
        println!("{} graph snapshot stored", graphs.len());
    }
    Ok(())
}

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Every snapshot in the snapshot store (`[snapshots] url`, or `dir`), newest last per store.
    List,
}

#[derive(clap::Args)]
pub struct RestoreArgs {
    /// An empty data directory: the shards go to `<into>/counter/shard-NNNN`, the
    /// graph to `<into>/graph` (point `counter.data_dir` and `graph.data_dir` there).
    #[arg(long)]
    pub into: PathBuf,
}

/// The snapshots of every counter shard and of the graph, newest first, with the
/// store each restores and where it goes under `into`.
fn candidates(
    snapshots: &SnapshotStore,
    names: &TopicNames,
    into: &Path,
) -> anyhow::Result<Vec<(Vec<Manifest>, StoreName, PathBuf)>> {
    let mut found = Vec::new();
    for store in stores(snapshots, names)? {
        let dir = store.restore_dir(into);
        found.push((snapshots.list(&store.to_string())?, store, dir));
    }
    found.retain(|(manifests, _, _)| !manifests.is_empty());
    for (manifests, _, _) in &mut found {
        manifests.reverse();
    }
    Ok(found)
}

/// Every store the snapshot store holds snapshots of for the deployment `names`: the
/// counter shards listed under the shard topic, and the graph. A name there that
/// names no store is an error, not skipped: it is not tally's, or not this build's.
fn stores(snapshots: &SnapshotStore, names: &TopicNames) -> anyhow::Result<Vec<StoreName>> {
    let mut stores = Vec::new();
    for name in snapshots.names(&names.shards())? {
        stores.push(name.parse::<StoreName>().with_context(|| format!("the snapshot store ({name})"))?);
    }
    stores.push(StoreName::graph(names));
    Ok(stores)
}

pub async fn list(config: &TallyConfig) -> anyhow::Result<()> {
    let config = config.clone();
    tokio::task::spawn_blocking(move || {
        let snapshots = SnapshotStore::from_config(&config.snapshots, tokio::runtime::Handle::current())?;
        let names = TopicNames::new(&config.kafka.topic_prefix);
        let (mut count, mut unreadable) = (0, 0);
        for name in stores(&snapshots, &names)? {
            let listing = snapshots.listing(&name.to_string())?;
            for skipped in &listing.unreadable {
                unreadable += 1;
                println!("{}  UNREADABLE (skipped by restores): {}", skipped.folder, skipped.reason);
            }
            for manifest in listing.manifests {
                count += 1;
                let age = Duration::from_millis((now_ms() - manifest.created_ms).max(0) as u64);
                println!(
                    "{name}  {}  next offset {}  {:.1} MB  {} s old",
                    manifest.id,
                    manifest.next_offset.map_or("-".to_string(), |o| o.to_string()),
                    manifest.bytes() as f64 / 1e6,
                    age.as_secs()
                );
            }
        }
        let place = match config.snapshots.url.as_str() {
            "" => config.snapshots.dir.display().to_string(),
            url => url.to_string(),
        };
        match unreadable {
            0 => println!("{count} snapshots in {place}"),
            n => println!("{count} snapshots in {place}; {n} manifests this build cannot read"),
        }
        anyhow::Ok(())
    })
    .await?
}

pub async fn restore(config: &TallyConfig, args: RestoreArgs) -> anyhow::Result<()> {
    let config = config.clone();
    tokio::task::spawn_blocking(move || {
        let snapshots = SnapshotStore::from_config(&config.snapshots, tokio::runtime::Handle::current())?;
        let names = TopicNames::new(&config.kafka.topic_prefix);
        let found = candidates(&snapshots, &names, &args.into)?;
        if found.is_empty() {
            bail!("no snapshots in the snapshot store ({} {})", config.snapshots.url, config.snapshots.dir.display());
        }
        if let Some((_, _, dir)) = found.iter().find(|(_, _, dir)| dir.exists()) {
            bail!("{} exists: restore needs an empty data directory", dir.display());
        }
        let total: u64 = found.iter().map(|(manifests, _, _)| manifests[0].bytes()).sum();
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("{msg:24} [{bar:40}] {bytes}/{total_bytes} {eta}")
                .context("progress bar template")?
                .progress_chars("=> "),
        );
        bar.set_message(format!("{} stores", found.len()));
        // A few stores at a time: their downloads overlap, each in bounded memory.
        // The newest snapshot that restores whole; one with a file missing or
        // damaged is passed over for the next older (marked beside it, so the
        // service serves it only once caught up).
        let chosen = restore_in_parallel(&found, |(manifests, _, dir)| {
            std::fs::create_dir_all(dir.parent().unwrap_or(Path::new(".")))?;
            let passed_over = |manifest: &Manifest, reason: &str| {
                bar.println(format!("{}: {reason}; trying the next older snapshot", manifest.name));
            };
            Ok::<_, anyhow::Error>(
                snapshots.restore_first(manifests, dir, |bytes| bar.inc(bytes), passed_over)?.cloned(),
            )
        });
        let mut restored = Vec::new();
        for ((_, store, dir), chosen) in found.iter().zip(chosen) {
            restored.push((store.to_string(), chosen?, dir));
        }
        bar.finish_with_message("restored");
        for (name, manifest, dir) in &restored {
            match manifest {
                Some(manifest) => {
                    let next = manifest.next_offset.map_or("-".to_string(), |o| o.to_string());
                    println!("{name}: snapshot {} (next offset {next}) → {}", manifest.id, dir.display());
                }
                None => println!("{name}: no snapshot restores whole; the service rebuilds it from the log"),
            }
        }
        anyhow::Ok(())
    })
    .await?
}
