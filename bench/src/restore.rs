//! `tally-bench restore`: how long a shard that lost its disk takes until it can
//! serve again — restored from its newest snapshot (download, open, replay the log
//! after it) against replaying its whole log — at several sizes of history, in one
//! run, on the same data.

use std::path::Path;
use std::time::Instant;

use tally_shared::snapshot::{SnapshotStore, Snapshotter};

use crate::counter_apply::{batches_of, workload, BenchOptions};
use tally_counter::error::Result;
use tally_counter::store::apply::{ApplyReport, ShardRecord};
use tally_counter::store::{ShardStore, StoreOptions};

/// The shape of the bench.
#[derive(Debug, Clone)]
pub struct RestoreBenchOptions {
    /// Increments of history before the snapshot, one run each.
    pub histories: Vec<usize>,
    /// Increments after the snapshot: the tail a restore replays.
    pub tail: usize,
    /// The workload (entities, skew, packing, batch size).
    pub workload: BenchOptions,
}

/// One history size's figures.
#[derive(Debug, Clone)]
pub struct RestoreFigures {
    pub history: usize,
    /// Seconds to rebuild the shard from its whole log (history and tail).
    pub replay_seconds: f64,
    /// Seconds to restore the snapshot, open it and replay the tail.
    pub restore_seconds: f64,
    /// Of those, the download's.
    pub download_seconds: f64,
    pub snapshot_bytes: u64,
    /// The snapshot's largest file: what a download holding a file in memory whole
    /// would hold at least.
    pub largest_file_bytes: u64,
    /// How far the process's resident memory rose, at its peak during the download,
    /// above where it stood before it (from `/proc/self/status`), if this system tells.
    pub download_rss_bytes: Option<u64>,
}

impl RestoreFigures {
    pub fn ratio(&self) -> f64 {
        self.replay_seconds / self.restore_seconds.max(f64::MIN_POSITIVE)
    }
}

/// A line of `/proc/self/status` (`VmRSS:`, `VmHWM:`), in KiB.
pub(crate) fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with(field))?;
    line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// Resets the process's peak resident memory to what it holds now (Linux's
/// `clear_refs`); that, in KiB, if this system allows it.
fn reset_peak_rss() -> Option<u64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    status_kib("VmRSS:")
}

/// What [`lose_and_restore`] measured.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SnapshotTrip {
    pub snapshot_seconds: f64,
    pub snapshot_bytes: u64,
    /// The download, from disk and not from the page cache, and the open.
    pub restore_seconds: f64,
}

/// A store that lost its disk: snapshots `store` (its RocksDB through `rocks`) into a
/// local-directory snapshot store under `dir` as `name`, drops it and deletes `path`,
/// then restores the snapshot into a directory of its own and opens it with `reopen`,
/// timed from once the snapshot's files left the page cache; `check` then looks at
/// what opened (untimed), and everything restored is deleted.
pub(crate) fn lose_and_restore<S, R>(
    store: S,
    rocks: fn(&S) -> &tally_shared::store::Store,
    path: &Path,
    (name, dir): (&str, &Path),
    runtime: &tokio::runtime::Handle,
    reopen: impl FnOnce(&Path) -> anyhow::Result<R>,
    check: impl FnOnce(&R) -> anyhow::Result<()>,
) -> anyhow::Result<SnapshotTrip> {
    let snapshots = SnapshotStore::local(&dir.join("snapshots"), runtime.clone())?;
    let started = Instant::now();
    let manifest = snapshots.take(rocks(&store), name, dir)?;
    let snapshot_seconds = started.elapsed().as_secs_f64();
    drop(store);
    std::fs::remove_dir_all(path)?;
    let restored = dir.join(format!("restored-{}", name.replace('/', "-")));
    uncache(&dir.join("snapshots"))?;
    let started = Instant::now();
    anyhow::ensure!(Snapshotter::restore_latest(&snapshots, name, &restored)?.is_some(), "no snapshot of {name}");
    let opened = reopen(&restored)?;
    let restore_seconds = started.elapsed().as_secs_f64();
    check(&opened)?;
    drop(opened);
    std::fs::remove_dir_all(&restored)?;
    std::fs::remove_file(tally_shared::snapshot::restored_marker(&restored))?;
    std::fs::remove_dir_all(dir.join("snapshots"))?;
    Ok(SnapshotTrip { snapshot_seconds, snapshot_bytes: manifest.bytes(), restore_seconds })
}

/// Drops every file under `dir` from the page cache (written to disk first).
pub(crate) fn uncache(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            uncache(&path)?;
            continue;
        }
        let file = std::fs::File::open(&path)?;
        file.sync_all()?;
        // SAFETY: a valid descriptor of an open file; advice only.
        unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(())
}

/// Applies `records` (shard-topic offsets from `first`) in the consumer's batches;
/// what each batch did.
pub(crate) fn apply_log(
    store: &ShardStore,
    records: &[Vec<u8>],
    first: i64,
    batch_max_bytes: usize,
    now: i64,
) -> Result<Vec<ApplyReport>> {
    let mut offset = first;
    let mut reports = Vec::new();
    for chunk in batches_of(records, batch_max_bytes) {
        let batch: Vec<ShardRecord<'_>> = chunk
            .iter()
            .map(|payload| {
                offset += 1;
                ShardRecord { offset: offset - 1, payload, timestamp: None }
            })
            .collect();
        reports.push(store.apply(&batch, now, false)?);
    }
    Ok(reports)
}

/// Runs every history size in `dir` (a scratch directory), the snapshot store a
/// local directory in it; `runtime` runs the snapshot store's I/O.
pub fn run(options: &RestoreBenchOptions, dir: &Path, runtime: tokio::runtime::Handle) -> Result<Vec<RestoreFigures>> {
    let snapshots = SnapshotStore::local(&dir.join("snapshots"), runtime)?;
    let batch = options.workload.batch_max_bytes;
    let mut figures = Vec::new();
    for &history in &options.histories {
        let now = tally_shared::kafka::now_ms();
        let records = workload(&options.workload, history + options.tail, now, 11);
        let split = history.div_ceil(options.workload.increments_per_record.max(1)).min(records.len());
        let (log, tail) = records.split_at(split);

        // The shard as it lived: its history applied, snapshot, then the tail —
        // which is also what a replay of the whole log does, timed.
        let name = format!("bench/shard-{history}");
        let lived = ShardStore::open(0, &dir.join(format!("lived-{history}")), StoreOptions::default())?;
        let started = Instant::now();
        apply_log(&lived, log, 0, batch, now)?;
        let replay_history = started.elapsed();
        let manifest = snapshots.take(lived.rocks(), &name, dir)?;
        let started = Instant::now();
        apply_log(&lived, tail, split as i64, batch, now)?;
        let replay_seconds = (replay_history + started.elapsed()).as_secs_f64();
        drop(lived);

        // The disk is lost: restore the newest snapshot, open it, replay the tail.
        let restored_dir = dir.join(format!("restored-{history}"));
        let before = reset_peak_rss();
        let started = Instant::now();
        Snapshotter::restore_latest(&snapshots, &name, &restored_dir)?;
        let download_seconds = started.elapsed().as_secs_f64();
        let download_rss_bytes =
            before.zip(status_kib("VmHWM:")).map(|(before, peak)| peak.saturating_sub(before) * 1024);
        let restored = ShardStore::open(0, &restored_dir, StoreOptions::default())?;
        let from = restored.next_offset().unwrap_or(0);
        apply_log(&restored, &records[from as usize..], from, batch, now)?;
        let restore_seconds = started.elapsed().as_secs_f64();
        figures.push(RestoreFigures {
            history,
            replay_seconds,
            restore_seconds,
            download_seconds,
            snapshot_bytes: manifest.bytes(),
            largest_file_bytes: manifest.files.iter().map(|f| f.bytes).max().unwrap_or(0),
            download_rss_bytes,
        });
    }
    Ok(figures)
}
