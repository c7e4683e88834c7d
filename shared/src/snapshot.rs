//! Snapshots of a processor's store, so a shard that moves or loses its disk
//! restores its state and replays only the log after it, instead of the whole log.
//!
//! A snapshot is a RocksDB checkpoint ([`Store::checkpoint`]: taken under the commit
//! lock, so it holds exactly the state, progress, outbox and marks of one committed
//! offset) uploaded file by file to a snapshot store — an [`ObjectStore`]: a local
//! directory by default — under `<name>/<id>/`, with its [`Manifest`] written last:
//! a snapshot without a manifest is incomplete and never restored (and collected
//! once older than `snapshots.orphan_grace_ms`). Ids sort by the offset the snapshot
//! is consistent with, so the newest is the last.
//!
//! Files move in bounded memory whatever their size: one up to [`PART_BYTES`] goes
//! up in one PUT, a larger one as a multipart upload of parts of that size (at most
//! [`PARTS_IN_FLIGHT`] at a time), and a download is written to disk as it streams
//! in. Stores are restored [`PARALLEL_RESTORES`] at a time.
//!
//! The store is read from outside and degrades gracefully: a manifest this build
//! cannot read is skipped and reported (the newest readable one is used); each file
//! is checked against its manifest's size and SHA-256 (when the manifest has it) as
//! it is downloaded, and a restore that meets a missing or damaged file falls back
//! to the next older snapshot, then to the log.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use serde::{Deserialize, Serialize};
use tally_core::format::JSON_V1;

use crate::config::SnapshotsConfig;
use crate::kafka::now_ms;
use crate::store::Store;
use crate::{Error, Result};

/// The file beside a store restored by an operator (`tally restore`): the service
/// serves it only once it caught up with the log, then removes the file.
pub fn restored_marker(dir: &Path) -> PathBuf {
    dir.with_extension("restored")
}

/// The name of the manifest in a snapshot's directory.
const MANIFEST: &str = "MANIFEST.json";

/// A file up to this size is uploaded in one PUT; a larger one in parts of this
/// size (S3 takes parts of 5 MiB to 5 GiB, at most 10 000 of them: files to 80 GB).
pub const PART_BYTES: usize = 8 << 20;

/// The parts of one file being uploaded at a time: with the part being filled, what
/// an upload holds in memory is at most this many parts and one more.
pub const PARTS_IN_FLIGHT: usize = 2;

/// The buffer a download is written to disk through.
const WRITE_BYTES: usize = 1 << 20;

/// Stores restored at a time (a counter taking shards it has no store of, `tally
/// restore`): downloads overlap (an object store answers each request after a round
/// trip) while memory stays bounded (a few parts per file).
pub const PARALLEL_RESTORES: usize = 4;

/// What a snapshot holds: its files and the offset it is consistent with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version ([`JSON_V1`]).
    pub v: u32,
    /// Whose store: `shard-0003`, `graph`.
    pub name: String,
    pub id: String,
    /// The next input offset of the snapshot's progress: the log is replayed from
    /// here after a restore. `None`: the store had applied nothing.
    pub next_offset: Option<i64>,
    pub created_ms: i64,
    pub files: Vec<SnapshotFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotFile {
    pub name: String,
    pub bytes: u64,
    /// The file's SHA-256, hex. A field added to version 1 (a build without it
    /// reads the manifest and ignores the hash, so a rollback keeps its snapshots);
    /// a manifest written before it has none, and its files are checked by size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// A manifest found in the snapshot store that this build cannot use: its folder
/// and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub folder: String,
    pub reason: String,
}

/// What a listing of one store's snapshots found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// The complete, readable snapshots, oldest first.
    pub manifests: Vec<Manifest>,
    /// Manifests skipped: unreadable, of a newer version, or naming another folder.
    pub unreadable: Vec<Unreadable>,
    /// Folders without a manifest (uploads under way or abandoned) and when each
    /// was started (from its id), if it says.
    pub incomplete: Vec<(String, Option<i64>)>,
}

/// A SHA-256 being computed, and the bytes it has seen.
struct Hashing {
    context: ring::digest::Context,
    bytes: u64,
}

impl Hashing {
    fn new() -> Self {
        Self { context: ring::digest::Context::new(&ring::digest::SHA256), bytes: 0 }
    }

    fn update(&mut self, bytes: &[u8]) {
        self.context.update(bytes);
        self.bytes += bytes.len() as u64;
    }

    /// The hash, hex.
    fn finish(self) -> String {
        tally_core::format::hex(self.context.finish().as_ref())
    }
}

/// The next part of `file` (`len` bytes long): up to `bytes` of it, hashed; empty
/// at its end.
fn read_part(file: &mut std::fs::File, (bytes, len): (usize, u64), hashing: &mut Hashing) -> Result<Vec<u8>> {
    use std::io::Read;
    // Allocated once: the part's size, or what is left of the file if less.
    let mut part = Vec::with_capacity(len.saturating_sub(hashing.bytes).min(bytes as u64) as usize);
    file.take(bytes as u64).read_to_end(&mut part)?;
    hashing.update(&part);
    Ok(part)
}

/// Sends the parts `next` reads to `upload`, at most [`PARTS_IN_FLIGHT`] at a time
/// (and one read ahead), until it has none.
async fn send_parts(
    upload: &mut dyn object_store::MultipartUpload,
    mut next: impl FnMut() -> Result<Option<Vec<u8>>>,
) -> Result<()> {
    let mut in_flight: futures::stream::FuturesUnordered<object_store::UploadPart> = Default::default();
    while let Some(part) = next()? {
        while in_flight.len() >= PARTS_IN_FLIGHT {
            if let Some(sent) = in_flight.next().await {
                sent.map_err(objects_error)?;
            }
        }
        in_flight.push(upload.put_part(part.into()));
    }
    while let Some(sent) = in_flight.next().await {
        sent.map_err(objects_error)?;
    }
    Ok(())
}

impl Manifest {
    /// The bytes of every file.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }

    fn decode(bytes: &[u8]) -> Result<Self> {
        Ok(tally_core::format::decode_json(bytes, "snapshot manifest", |manifest: &Self| manifest.v)?)
    }

    /// Decodes the manifest found in folder `folder` (`<name>/<id>`) of the
    /// snapshot store, which is read from outside: it must name that folder, and
    /// each of its files must be a plain file name (a restore writes them into a
    /// directory and must not write anywhere else).
    fn decode_from(bytes: &[u8], folder: &str) -> Result<Self> {
        let manifest = Self::decode(bytes)?;
        let plain = |file: &str| {
            let mut parts = Path::new(file).components();
            matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None))
        };
        if format!("{}/{}", manifest.name, manifest.id) != folder {
            return Err(Error::corrupt(format!(
                "snapshot manifest in {folder} names {}/{}",
                manifest.name, manifest.id
            )));
        }
        if let Some(file) = manifest.files.iter().find(|f| !plain(&f.name)) {
            return Err(Error::corrupt(format!("snapshot manifest in {folder}: {:?} is not a file name", file.name)));
        }
        Ok(manifest)
    }
}

/// Removes `path` (a directory) if it is there; failing to is an error.
fn remove_dir_if_there(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

/// Removes the mark a restore left beside the store in `dir`, once its service
/// persisted its wait to catch up with the log; failing to is an error (the store
/// would wait again after every restart).
pub fn clear_restored_marker(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(restored_marker(dir)) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

/// Where snapshots are kept. Blocking calls: for the processors' plain threads, on
/// the runtime whose handle it was made with.
#[derive(Clone)]
pub struct SnapshotStore {
    objects: Arc<dyn ObjectStore>,
    runtime: tokio::runtime::Handle,
    /// [`PART_BYTES`], smaller in tests.
    part_bytes: usize,
}

fn objects_error(err: object_store::Error) -> Error {
    Error::Snapshot(err.to_string())
}

impl SnapshotStore {
    /// A snapshot store in the local directory `dir` (created when missing).
    pub fn local(dir: &Path, runtime: tokio::runtime::Handle) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        // Pruned snapshots leave no empty directories behind.
        let objects = LocalFileSystem::new_with_prefix(dir).map_err(objects_error)?.with_automatic_cleanup(true);
        Ok(Self { objects: Arc::new(objects), runtime, part_bytes: PART_BYTES })
    }

    /// The snapshot store `config` names: an S3-compatible object store when `url`
    /// is set, the local directory `dir` otherwise.
    pub fn from_config(config: &SnapshotsConfig, runtime: tokio::runtime::Handle) -> Result<Self> {
        if config.url.is_empty() {
            return Self::local(&config.dir, runtime);
        }
        let mut builder = object_store::aws::AmazonS3Builder::from_env()
            .with_url(&config.url)
            .with_region(&config.region)
            .with_allow_http(config.allow_http);
        if !config.endpoint.is_empty() {
            builder = builder.with_endpoint(&config.endpoint);
        }
        let objects = builder.build().map_err(objects_error)?;
        // Under the URL's prefix, if it has one.
        let prefix = config.url.trim_start_matches("s3://").split_once('/').map(|(_, p)| p.trim_matches('/'));
        let objects: Arc<dyn ObjectStore> = match prefix.filter(|p| !p.is_empty()) {
            Some(prefix) => Arc::new(object_store::prefix::PrefixStore::new(objects, prefix)),
            None => Arc::new(objects),
        };
        Ok(Self { objects, runtime, part_bytes: PART_BYTES })
    }

    /// The same store, uploading files over `bytes` in parts of `bytes` (S3 takes
    /// parts of at least 5 MiB but the last).
    pub fn with_part_bytes(self, bytes: usize) -> Self {
        Self { part_bytes: bytes.max(1), ..self }
    }

    /// Snapshots `store` as `name`: a checkpoint in `scratch` (a directory on the
    /// store's file system, removed afterwards), uploaded, the manifest last.
    pub fn take(&self, store: &Store, name: &str, scratch: &Path) -> Result<Manifest> {
        let checkpoint = scratch.join(format!("{}-{}", name.replace('/', "_"), now_ms()));
        let taken = self.take_from(store, name, &checkpoint);
        // A checkpoint left behind holds hard links to old files (removed at start).
        if let Err(err) = remove_dir_if_there(&checkpoint) {
            tracing::warn!(checkpoint = %checkpoint.display(), error = %err, "removing a checkpoint");
        }
        taken
    }

    fn take_from(&self, store: &Store, name: &str, checkpoint: &Path) -> Result<Manifest> {
        let progress = store.checkpoint(checkpoint)?;
        let created_ms = now_ms();
        let id = format!("{:020}-{created_ms}", progress.next_offset.unwrap_or(0).max(0));
        let mut files = Vec::new();
        let mut entries: Vec<PathBuf> =
            std::fs::read_dir(checkpoint)?.map(|entry| entry.map(|e| e.path())).collect::<std::io::Result<_>>()?;
        entries.sort();
        for path in entries {
            let file = path
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)
                .ok_or_else(|| Error::Snapshot(format!("{}: not a file name", path.display())))?;
            let location = ObjectPath::from(format!("{name}/{id}/{file}"));
            let (bytes, sha256) = self.upload(&location, &path)?;
            files.push(SnapshotFile { name: file, bytes, sha256: Some(sha256) });
        }
        let manifest = Manifest {
            v: JSON_V1,
            name: name.to_string(),
            id: id.clone(),
            next_offset: progress.next_offset,
            created_ms,
            files,
        };
        let body = serde_json::to_vec(&manifest).map_err(|err| Error::Snapshot(err.to_string()))?;
        let location = ObjectPath::from(format!("{name}/{id}/{MANIFEST}"));
        self.runtime.block_on(self.objects.put(&location, body.into())).map_err(objects_error)?;
        Ok(manifest)
    }

    /// Uploads the file at `path` to `location`: its size and SHA-256 as read. The
    /// parts' uploads run in this call (nothing is spawned on the runtime).
    fn upload(&self, location: &ObjectPath, path: &Path) -> Result<(u64, String)> {
        let mut file = std::fs::File::open(path)?;
        let size = (self.part_bytes, file.metadata()?.len());
        let mut hashing = Hashing::new();
        let first = read_part(&mut file, size, &mut hashing)?;
        let second = match first.len() == self.part_bytes {
            true => read_part(&mut file, size, &mut hashing)?,
            false => Vec::new(),
        };
        if second.is_empty() {
            self.runtime.block_on(self.objects.put(location, first.into())).map_err(objects_error)?;
            return Ok((hashing.bytes, hashing.finish()));
        }
        self.runtime.block_on(async {
            let mut upload = self.objects.put_multipart(location).await.map_err(objects_error)?;
            let mut read = [first, second].into_iter();
            let next = || match read.next() {
                Some(part) => Ok(Some(part)),
                None => read_part(&mut file, size, &mut hashing).map(|part| Some(part).filter(|p| !p.is_empty())),
            };
            let sent = match send_parts(upload.as_mut(), next).await {
                Ok(()) => upload.complete().await.map(drop).map_err(objects_error),
                Err(err) => Err(err),
            };
            if sent.is_err() {
                // The parts sent so far are deleted (else a store keeps them,
                // unlisted, until a lifecycle rule collects them).
                if let Err(abort) = upload.abort().await {
                    tracing::warn!(location = %location, error = %abort, "aborting a multipart upload");
                }
            }
            sent.map(|()| (hashing.bytes, hashing.finish()))
        })
    }

    /// The complete, readable snapshots of `name`, oldest first; a manifest this
    /// build cannot read is skipped with a warning ([`Self::listing`] names them).
    pub fn list(&self, name: &str) -> Result<Vec<Manifest>> {
        let listing = self.listing(name)?;
        for skipped in &listing.unreadable {
            tracing::warn!(folder = %skipped.folder, reason = %skipped.reason, "skipping a snapshot manifest this build cannot read");
        }
        Ok(listing.manifests)
    }

    /// Everything under `name`: readable snapshots, unreadable manifests and
    /// folders without a manifest.
    pub fn listing(&self, name: &str) -> Result<Listing> {
        self.runtime.block_on(async {
            let prefix = ObjectPath::from(name);
            let listed = self.objects.list_with_delimiter(Some(&prefix)).await.map_err(objects_error)?;
            let mut listing = Listing::default();
            for dir in listed.common_prefixes {
                let location = dir.child(MANIFEST);
                match self.objects.get(&location).await {
                    Ok(got) => {
                        let bytes = got.bytes().await.map_err(objects_error)?;
                        match Manifest::decode_from(&bytes, dir.as_ref()) {
                            Ok(manifest) => listing.manifests.push(manifest),
                            Err(err) => {
                                listing.unreadable.push(Unreadable { folder: dir.to_string(), reason: err.to_string() })
                            }
                        }
                    }
                    // Being uploaded, or abandoned half way: not a snapshot.
                    Err(object_store::Error::NotFound { .. }) => {
                        let started =
                            dir.filename().and_then(|id| id.rsplit_once('-')).and_then(|(_, ms)| ms.parse().ok());
                        listing.incomplete.push((dir.to_string(), started));
                    }
                    Err(err) => return Err(objects_error(err)),
                }
            }
            listing.manifests.sort_by(|a, b| a.id.cmp(&b.id));
            Ok(listing)
        })
    }

    /// The names with snapshots under `prefix` (a topic's name): `prefix/shard-0003`.
    pub fn names(&self, prefix: &str) -> Result<Vec<String>> {
        let listed = self
            .runtime
            .block_on(self.objects.list_with_delimiter(Some(&ObjectPath::from(prefix))))
            .map_err(objects_error)?;
        let mut names: Vec<String> = listed.common_prefixes.iter().map(|p| p.to_string()).collect();
        names.sort();
        Ok(names)
    }

    /// The newest complete snapshot of `name`.
    pub fn latest(&self, name: &str) -> Result<Option<Manifest>> {
        Ok(self.list(name)?.pop())
    }

    /// Downloads `manifest`'s files into `dir`, which must not exist yet; a store
    /// opened there is the snapshot's. Each file's size and SHA-256 are checked: a
    /// file missing or not as the manifest says is [`Error::SnapshotUnusable`].
    pub fn restore(&self, manifest: &Manifest, dir: &Path) -> Result<()> {
        self.restore_with_progress(manifest, dir, |_| {})
    }

    /// [`SnapshotStore::restore`], calling `progress(bytes)` after each file.
    pub fn restore_with_progress(&self, manifest: &Manifest, dir: &Path, mut progress: impl FnMut(u64)) -> Result<()> {
        if dir.exists() {
            return Err(Error::Snapshot(format!("{}: restore needs a directory that does not exist", dir.display())));
        }
        let partial = dir.with_extension("restoring");
        remove_dir_if_there(&partial)?;
        std::fs::create_dir_all(&partial)?;
        for file in &manifest.files {
            self.download(manifest, file, &partial.join(&file.name))?;
            progress(file.bytes);
        }
        std::fs::File::open(&partial)?.sync_all()?;
        // The mark first: a store in place without it would be served before it
        // caught up with the log (the service removes it once its wait is persisted).
        std::fs::write(restored_marker(dir), &manifest.id)?;
        // Whole or not at all: a crash mid-download leaves only the `.restoring` dir.
        std::fs::rename(&partial, dir)?;
        if let Some(parent) = dir.parent() {
            std::fs::File::open(parent)?.sync_all()?;
        }
        Ok(())
    }

    /// Restores into `dir` the first of `manifests` (newest first) that restores
    /// whole, calling `progress(bytes)` after each file and `passed_over` for each
    /// one with a file missing or damaged (and why); none, and what was downloaded
    /// is removed.
    pub fn restore_first<'m>(
        &self,
        manifests: impl IntoIterator<Item = &'m Manifest>,
        dir: &Path,
        mut progress: impl FnMut(u64),
        mut passed_over: impl FnMut(&Manifest, &str),
    ) -> Result<Option<&'m Manifest>> {
        for manifest in manifests {
            match self.restore_with_progress(manifest, dir, &mut progress) {
                Ok(()) => return Ok(Some(manifest)),
                Err(Error::SnapshotUnusable(reason)) => passed_over(manifest, &reason),
                Err(err) => return Err(err),
            }
        }
        remove_dir_if_there(&dir.with_extension("restoring"))?;
        Ok(None)
    }

    /// Downloads `file` of `manifest` to `path` as it streams in, checking its size
    /// (before a byte is written, and as they come) and its SHA-256.
    fn download(&self, manifest: &Manifest, file: &SnapshotFile, path: &Path) -> Result<()> {
        let location = ObjectPath::from(format!("{}/{}/{}", manifest.name, manifest.id, file.name));
        let unusable = |what: String| {
            Error::SnapshotUnusable(format!("snapshot {}/{}: {} {what}", manifest.name, manifest.id, file.name))
        };
        let wrong_size = |size: u64| unusable(format!("is {size} bytes, the manifest says {}", file.bytes));
        self.runtime.block_on(async {
            let got = self.objects.get(&location).await.map_err(|err| match err {
                object_store::Error::NotFound { .. } => unusable("is missing".into()),
                err => objects_error(err),
            })?;
            if got.meta.size != file.bytes {
                return Err(wrong_size(got.meta.size));
            }
            let mut written = std::io::BufWriter::with_capacity(WRITE_BYTES, std::fs::File::create(path)?);
            let mut hashing = Hashing::new();
            let mut chunks = got.into_stream();
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk.map_err(objects_error)?;
                hashing.update(&chunk);
                if hashing.bytes > file.bytes {
                    return Err(wrong_size(hashing.bytes));
                }
                std::io::Write::write_all(&mut written, &chunk)?;
            }
            if hashing.bytes != file.bytes {
                return Err(wrong_size(hashing.bytes));
            }
            let found = hashing.finish();
            if let Some(want) = file.sha256.as_ref().filter(|want| **want != found) {
                return Err(unusable(format!("has SHA-256 {found}, the manifest says {want}")));
            }
            written.into_inner().map_err(|err| err.into_error())?.sync_all()?;
            Ok(())
        })
    }

    /// Deletes all but the newest `keep` snapshots of `name` (at least two stay, so
    /// a restore that just picked the newer one is not cut short by the next prune)
    /// and the uploads that never got a manifest and started more than
    /// `orphan_grace_ms` ago; reports the manifests it could not read (left alone).
    pub fn prune(&self, name: &str, keep: usize, orphan_grace_ms: i64) -> Result<Pruned> {
        let listing = self.listing(name)?;
        let stale = listing.manifests.len().saturating_sub(keep.max(2));
        for manifest in &listing.manifests[..stale] {
            // The manifest first: a snapshot half deleted is no longer listed.
            self.delete_folder(&format!("{}/{}", manifest.name, manifest.id))?;
        }
        let cutoff = now_ms().saturating_sub(orphan_grace_ms);
        let mut collected = 0;
        for (folder, started) in &listing.incomplete {
            if started.is_some_and(|started| started < cutoff) {
                tracing::info!(folder = %folder, "collecting an upload that never got a manifest");
                self.delete_folder(folder)?;
                collected += 1;
            }
        }
        Ok(Pruned { deleted: stale, collected, unreadable: listing.unreadable })
    }

    /// Deletes a snapshot's folder, its manifest first.
    fn delete_folder(&self, folder: &str) -> Result<()> {
        self.runtime
            .block_on(async {
                let dir = ObjectPath::from(folder);
                match self.objects.delete(&dir.child(MANIFEST)).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(err) => return Err(err),
                }
                let mut files = self.objects.list(Some(&dir));
                while let Some(meta) = files.next().await {
                    self.objects.delete(&meta?.location).await?;
                }
                Ok::<_, object_store::Error>(())
            })
            .map_err(objects_error)
    }
}

/// What [`SnapshotStore::prune`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Old snapshots deleted.
    pub deleted: usize,
    /// Uploads without a manifest collected.
    pub collected: usize,
    /// Manifests this build cannot read (skipped by every listing).
    pub unreadable: Vec<Unreadable>,
}

/// Decides when a store is snapshot: once it applied `every_records` records since
/// its last snapshot, or `interval` after it if it applied any; at once when it has
/// none. Remembers, per name, the newest snapshot (read from the store at first sight).
pub struct Snapshotter {
    snapshots: SnapshotStore,
    /// Checkpoints are made here (the stores' file system: hard links).
    scratch: PathBuf,
    every_records: i64,
    interval: Duration,
    keep: usize,
    orphan_grace_ms: i64,
    /// Unreadable manifests met since the last round (reported as failures).
    unreadable: u64,
    /// Per name, its newest snapshot: its offset and when it was taken (what
    /// `interval` counts from, and in ms since the epoch what its age does).
    last: HashMap<String, Option<(i64, Instant, i64)>>,
    /// When each name was first looked at (ms since the epoch): the age of a store
    /// never snapshot counts from then.
    first_seen: HashMap<String, i64>,
}

impl Snapshotter {
    pub fn new(snapshots: SnapshotStore, config: &SnapshotsConfig, scratch: PathBuf) -> Self {
        // Checkpoints a crash left behind hold hard links to old files.
        if let Err(err) = remove_dir_if_there(&scratch) {
            tracing::warn!(scratch = %scratch.display(), error = %err, "removing old checkpoints");
        }
        Self {
            snapshots,
            scratch,
            every_records: config.every_records.max(1),
            interval: Duration::from_millis(config.interval_ms),
            keep: config.keep,
            orphan_grace_ms: config.orphan_grace_ms.min(i64::MAX as u64) as i64,
            unreadable: 0,
            last: HashMap::new(),
            first_seen: HashMap::new(),
        }
    }

    /// Snapshots `store` as `name` if it is due (then prunes old ones); the new
    /// snapshot, if one was taken.
    pub fn consider(&mut self, name: &str, store: &Store) -> Result<Option<Manifest>> {
        self.snapshot(name, store, false)
    }

    /// One round of a service's snapshot thread over the `stores` it serves now
    /// (snapshot name, store): operators' `requests` answered with a snapshot of
    /// each as of now (or the first failure), then each snapshot if due. Returns
    /// how many were taken and how many failed (failures are tried again next round;
    /// an unreadable manifest met while pruning counts as one).
    pub fn round(&mut self, requests: &SnapshotRequests, stores: &[(String, &Store)]) -> (u64, u64) {
        let (mut taken, mut failed) = (0, std::mem::take(&mut self.unreadable));
        for reply in requests.take() {
            let mut now = Vec::new();
            let mut answer = Ok(());
            for (name, store) in stores {
                match self.now(name, store) {
                    Ok(manifest) => now.extend(manifest),
                    Err(err) => {
                        failed += 1;
                        answer = Err(format!("{name}: {err}"));
                        break;
                    }
                }
            }
            if reply.send(answer.map(|()| now)).is_err() {
                tracing::debug!("the snapshot's requester stopped waiting before its answer");
            }
        }
        for (name, store) in stores {
            match self.consider(name, store) {
                Ok(Some(_)) => taken += 1,
                Ok(None) => {}
                Err(err) => {
                    failed += 1;
                    tracing::warn!(snapshot = %name, error = %err, "taking a snapshot; trying again later");
                }
            }
        }
        (taken, failed)
    }

    /// How far `store`'s newest snapshot trails it, in seconds: 0 while that snapshot
    /// holds everything the store applied (or it applied nothing), else the
    /// snapshot's age (since the store was first looked at, when it has none).
    /// Past twice `interval`, snapshots are failing or cannot keep up.
    pub fn age_seconds(&self, name: &str, store: &Store) -> f64 {
        let Some(next) = store.next_offset() else { return 0.0 };
        let since = match self.last.get(name).copied().flatten() {
            Some((offset, _, _)) if next <= offset => return 0.0,
            Some((_, _, created_ms)) => created_ms,
            None => self.first_seen.get(name).copied().unwrap_or_else(now_ms),
        };
        (now_ms() - since).max(0) as f64 / 1_000.0
    }

    /// `interval`, in seconds: what a store's snapshot age stays under.
    pub fn interval_seconds(&self) -> f64 {
        self.interval.as_secs_f64()
    }

    /// Snapshots `store` as `name` now unless its newest snapshot is of its current
    /// offset already (an operator's `tally snapshot`); the snapshot of now, if it
    /// has applied anything.
    pub fn now(&mut self, name: &str, store: &Store) -> Result<Option<Manifest>> {
        match self.snapshot(name, store, true)? {
            Some(taken) => Ok(Some(taken)),
            None if store.next_offset().is_some() => self.snapshots.latest(name),
            None => Ok(None),
        }
    }

    fn snapshot(&mut self, name: &str, store: &Store, now: bool) -> Result<Option<Manifest>> {
        let Some(next) = store.next_offset() else { return Ok(None) };
        self.first_seen.entry(name.to_string()).or_insert_with(now_ms);
        if !self.last.contains_key(name) {
            // Its interval counts from when it was taken, also across a restart.
            let taken_at = |created_ms: i64| {
                let ago = Duration::from_millis((now_ms() - created_ms).max(0) as u64);
                Instant::now().checked_sub(ago).unwrap_or_else(Instant::now)
            };
            let newest = (self.snapshots.latest(name)?)
                .map(|m| (m.next_offset.unwrap_or(0), taken_at(m.created_ms), m.created_ms));
            self.last.insert(name.to_string(), newest);
        }
        let due = match self.last.get(name).copied().flatten() {
            None => true,
            Some((offset, at, _)) => {
                next - offset >= self.every_records || (next > offset && (now || at.elapsed() >= self.interval))
            }
        };
        if !due {
            return Ok(None);
        }
        std::fs::create_dir_all(&self.scratch)?;
        let manifest = self.snapshots.take(store, name, &self.scratch)?;
        tracing::info!(snapshot = %manifest.name, id = %manifest.id, next_offset = ?manifest.next_offset, bytes = manifest.bytes(), "snapshot stored");
        let newest = (manifest.next_offset.unwrap_or(0), Instant::now(), manifest.created_ms);
        self.last.insert(name.to_string(), Some(newest));
        // Stored whatever pruning does; old snapshots go next time.
        match self.snapshots.prune(name, self.keep, self.orphan_grace_ms) {
            Ok(pruned) => {
                for skipped in &pruned.unreadable {
                    tracing::warn!(folder = %skipped.folder, reason = %skipped.reason, "a snapshot manifest this build cannot read: skipped by restores, left in place");
                }
                self.unreadable += pruned.unreadable.len() as u64;
            }
            Err(err) => {
                tracing::warn!(snapshot = %manifest.name, error = %err, "pruning old snapshots; trying again next time")
            }
        }
        Ok(Some(manifest))
    }

    /// Restores the newest snapshot of `name` that restores whole into `dir` (where
    /// no store is): one with a file missing or damaged is passed over for the next
    /// older; none, and the store rebuilds from the log. The snapshot restored, if any.
    pub fn restore_latest(snapshots: &SnapshotStore, name: &str, dir: &Path) -> Result<Option<Manifest>> {
        let manifests = snapshots.list(name)?;
        let passed_over = |manifest: &Manifest, reason: &str| {
            tracing::warn!(snapshot = %manifest.name, id = %manifest.id, %reason, "a snapshot that cannot be restored; trying the next older one");
        };
        let started = Instant::now();
        match snapshots.restore_first(manifests.iter().rev(), dir, |_| {}, passed_over)? {
            Some(manifest) => {
                tracing::info!(snapshot = %manifest.name, id = %manifest.id, next_offset = ?manifest.next_offset, bytes = manifest.bytes(), seconds = started.elapsed().as_secs_f64(), "restored from a snapshot; replaying the log after it");
                Ok(Some(manifest.clone()))
            }
            None => {
                if !manifests.is_empty() {
                    tracing::warn!(snapshot = %name, "no snapshot restores whole: rebuilding from the log");
                }
                Ok(None)
            }
        }
    }
}

/// `f` of each of `items`, [`PARALLEL_RESTORES`] at a time (each thread taking the
/// next item as it is done with one), in the items' order.
pub fn restore_in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<R>>> = items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..PARALLEL_RESTORES.min(items.len()) {
            scope.spawn(|| loop {
                let at = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(item) = items.get(at) else { break };
                let result = f(item);
                *crate::lock::lock(&results[at], "a parallel restore's result") = Some(result);
            });
        }
    });
    results.into_iter().filter_map(|result| result.into_inner().ok().flatten()).collect()
}

/// A service's snapshot gauges: the age of each store's newest snapshot
/// ([`Snapshotter::age_seconds`]) and the interval, what the ages stay under while
/// snapshots keep up (the alert compares the two).
pub struct SnapshotAges {
    age: prometheus::GaugeVec,
    /// The label values set at the last report (a store no longer held is removed).
    reported: std::collections::BTreeSet<Vec<String>>,
}

impl SnapshotAges {
    /// Registers the gauges under `names` (the age's, the interval's); `labels` name
    /// a store (`["shard"]`, or none for one store).
    pub fn new(
        registry: &prometheus::Registry,
        (age, interval): (&str, &str),
        labels: &[&str],
        snapshotter: &Snapshotter,
    ) -> Self {
        use crate::telemetry::register;
        let age = prometheus::GaugeVec::new(
            prometheus::Opts::new(
                age,
                "How far the store's newest snapshot trails it: 0 while that snapshot holds everything applied, \
                 else the snapshot's age (a restore would replay what came since). Above twice \
                 snapshot_interval_seconds, snapshots fail or cannot keep up: see the snapshot failures and the \
                 service's log",
            ),
            labels,
        )
        .expect("valid metric");
        let interval = prometheus::Gauge::new(
            interval,
            "snapshots.interval_ms in seconds: a store that applied anything is snapshot at least this often",
        )
        .expect("valid metric");
        register(registry, interval.clone()).set(snapshotter.interval_seconds());
        Self { age: register(registry, age), reported: std::collections::BTreeSet::new() }
    }

    /// Sets each store's age: `(label values, snapshot name, store)`.
    pub fn report<'a>(
        &mut self,
        snapshotter: &Snapshotter,
        stores: impl IntoIterator<Item = (Vec<String>, &'a str, &'a Store)>,
    ) {
        let mut reported = std::collections::BTreeSet::new();
        for (labels, name, store) in stores {
            let values: Vec<&str> = labels.iter().map(String::as_str).collect();
            self.age.with_label_values(&values).set(snapshotter.age_seconds(name, store));
            reported.insert(labels);
        }
        for gone in self.reported.difference(&reported) {
            let values: Vec<&str> = gone.iter().map(String::as_str).collect();
            self.age.remove_label_values(&values).ok();
        }
        self.reported = reported;
    }
}

/// What [`SnapshotRequests`]' lock guards ([`crate::lock`]).
const SNAPSHOT_REQUESTS: &str = "the snapshot requests";

/// An answer to an operator's snapshot request: the snapshots stored, or what failed.
pub type SnapshotReply = tokio::sync::oneshot::Sender<std::result::Result<Vec<Manifest>, String>>;

/// Operators' requests to snapshot now (`tally snapshot`), queued by the internal
/// API ([`snapshot_router`]) and answered by the service's snapshot thread, which
/// snapshots everything it serves (a store whose newest snapshot is current is not
/// taken again).
#[derive(Default)]
pub struct SnapshotRequests(std::sync::Mutex<Vec<SnapshotReply>>);

impl SnapshotRequests {
    fn push(&self, reply: SnapshotReply) {
        crate::lock::lock(&self.0, SNAPSHOT_REQUESTS).push(reply);
    }

    /// The requests waiting, to be answered now.
    pub fn take(&self) -> Vec<SnapshotReply> {
        std::mem::take(&mut *crate::lock::lock(&self.0, SNAPSHOT_REQUESTS))
    }
}

/// `POST /internal/v1/snapshots`: snapshot now, answered with the snapshots stored
/// (`{"snapshots": [manifest…]}`) once they are; `None`: snapshots are off here.
/// For operators.
pub fn snapshot_router(requests: Option<Arc<SnapshotRequests>>, auth: &crate::auth::AuthConfig) -> axum::Router {
    let routes = axum::Router::new().route("/internal/v1/snapshots", axum::routing::post(snapshot_now));
    crate::auth::require(routes, auth, &[crate::auth::Role::Operator]).with_state(requests)
}

async fn snapshot_now(
    axum::extract::State(requests): axum::extract::State<Option<Arc<SnapshotRequests>>>,
) -> axum::response::Response {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;

    use crate::http::ApiError;

    let Some(requests) = requests else {
        return ApiError::new(StatusCode::CONFLICT, "no_snapshots", "snapshots are off here").into_response();
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    requests.push(reply);
    match tokio::time::timeout(Duration::from_secs(600), answer).await {
        Ok(Ok(Ok(manifests))) => axum::Json(serde_json::json!({"snapshots": manifests})).into_response(),
        Ok(Ok(Err(message))) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "snapshot_failed", message).into_response()
        }
        Ok(Err(_)) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "stopping", "the service is stopping").into_response()
        }
        Err(_) => ApiError::new(StatusCode::GATEWAY_TIMEOUT, "timeout", "the snapshots took longer than 10 min")
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use rocksdb::{ColumnFamilyDescriptor, Options, WriteBatch};

    use super::*;
    use crate::progress::Progress;

    fn open(path: &Path) -> Store {
        let families = vec![ColumnFamilyDescriptor::new("state", Options::default())];
        Store::open(path, Options::default(), families, crate::store::Durability::InputLog).unwrap()
    }

    fn commit(store: &Store, key: &[u8], next_offset: i64) {
        let mut batch = WriteBatch::default();
        batch.put_cf(store.cf("state").unwrap(), key, b"v");
        store.commit(batch, Progress { next_offset: Some(next_offset), ..Default::default() }).unwrap();
    }

    #[test]
    fn a_restored_snapshot_is_the_store_at_its_offset_and_old_ones_are_pruned() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let snapshots = SnapshotStore::local(&dir.path().join("snapshots"), runtime.handle().clone()).unwrap();
        let store = open(&dir.path().join("store"));
        assert_eq!(snapshots.latest("t.shards/shard-0001").unwrap(), None);
        commit(&store, b"a", 10);
        let first = snapshots.take(&store, "t.shards/shard-0001", dir.path()).unwrap();
        commit(&store, b"b", 20);
        let second = snapshots.take(&store, "t.shards/shard-0001", dir.path()).unwrap();
        commit(&store, b"c", 30);
        assert_eq!((first.next_offset, second.next_offset), (Some(10), Some(20)));
        assert_eq!(snapshots.list("t.shards/shard-0001").unwrap(), vec![first.clone(), second.clone()]);
        // An upload cut short (no manifest) is not a snapshot.
        let runtime_handle = runtime.handle();
        runtime_handle
            .block_on(
                snapshots.objects.put(
                    &ObjectPath::from("t.shards/shard-0001/99999999999999999999-1/000001.sst"),
                    b"x".to_vec().into(),
                ),
            )
            .unwrap();
        assert_eq!(snapshots.latest("t.shards/shard-0001").unwrap(), Some(second.clone()));

        let restored_dir = dir.path().join("restored");
        snapshots.restore(&second, &restored_dir).unwrap();
        let restored = open(&restored_dir);
        assert_eq!(restored.progress().next_offset, Some(20));
        let state = restored.cf("state").unwrap();
        let keys: Vec<bool> =
            [&b"a"[..], b"b", b"c"].iter().map(|k| restored.db().get_cf(state, k).unwrap().is_some()).collect();
        assert_eq!(keys, vec![true, true, false], "the state of offset 20, not later");
        assert!(snapshots.restore(&second, &restored_dir).is_err(), "never over an existing store");
        assert!(restored_marker(&restored_dir).exists(), "marked for its service to wait until caught up");

        let third = snapshots.take(&store, "t.shards/shard-0001", dir.path()).unwrap();
        // A manifest this build cannot use is skipped, and named by the listing.
        let garbage = ObjectPath::from("t.shards/shard-0002/00000000000000000001-1/MANIFEST.json");
        let folder = "t.shards/shard-0002/00000000000000000001-1";
        let skipped = |manifest: &[u8]| {
            runtime_handle.block_on(snapshots.objects.put(&garbage, manifest.to_vec().into())).unwrap();
            assert_eq!(snapshots.latest("t.shards/shard-0002").unwrap(), None);
            let listing = snapshots.listing("t.shards/shard-0002").unwrap();
            assert_eq!((listing.manifests.len(), listing.unreadable.len()), (0, 1));
            assert_eq!(listing.unreadable[0].folder, folder);
            listing.unreadable[0].reason.clone()
        };
        assert!(skipped(b"{\"v\":1,\"name\":").contains("snapshot manifest"));
        let newer = br#"{"v":2,"name":"n","id":"i","next_offset":1,"created_ms":0,"files":[]}"#;
        assert!(skipped(newer).contains("format version 2, this build reads version 1"));
        // Read from outside: it must name its own folder, and only plain file names.
        for (manifest, says) in [
            (
                r#"{"v":1,"name":"t.shards/shard-0009","id":"00000000000000000001-1","next_offset":1,"created_ms":0,"files":[]}"#,
                "names t.shards/shard-0009",
            ),
            (
                r#"{"v":1,"name":"t.shards/shard-0002","id":"00000000000000000001-1","next_offset":1,"created_ms":0,"files":[{"name":"../../evil","bytes":1}]}"#,
                "\"../../evil\" is not a file name",
            ),
            (
                r#"{"v":1,"name":"t.shards/shard-0002","id":"00000000000000000001-1","next_offset":1,"created_ms":0,"files":[{"name":"/etc/x","bytes":1}]}"#,
                "is not a file name",
            ),
        ] {
            let reason = skipped(manifest.as_bytes());
            assert!(reason.contains(folder) && reason.contains(says), "{reason}");
        }
        // An object bigger than its manifest says is refused before it is loaded.
        let oversized = second.files.iter().max_by_key(|f| f.bytes).unwrap().name.clone();
        let location = ObjectPath::from(format!("{}/{}/{oversized}", second.name, second.id));
        runtime_handle.block_on(snapshots.objects.put(&location, vec![0u8; 1 << 20].into())).unwrap();
        let err = snapshots.restore(&second, &dir.path().join("again")).unwrap_err();
        assert!(
            matches!(&err, Error::SnapshotUnusable(m) if m.contains(&format!("{oversized} is 1048576 bytes, the manifest says"))),
            "{err}"
        );
        let pruned = snapshots.prune("t.shards/shard-0001", 1, 3_600_000).unwrap();
        assert_eq!(
            pruned,
            Pruned { deleted: 1, collected: 1, unreadable: vec![] },
            "two stay at least; the cut-short upload goes"
        );
        assert_eq!(snapshots.list("t.shards/shard-0001").unwrap(), vec![second, third]);
    }

    /// A restore passes over a snapshot with a file damaged or missing for the next
    /// older one, then for the log; an unreadable manifest is never tried; uploads
    /// without a manifest go once older than the grace period.
    #[test]
    fn restores_fall_back_past_damaged_snapshots_and_orphans_are_collected() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let snapshots = SnapshotStore::local(&dir.path().join("snapshots"), runtime.handle().clone()).unwrap();
        let store = open(&dir.path().join("store"));
        let name = "t.shards/shard-0003";
        let mut taken = Vec::new();
        for (key, offset) in [(&b"a"[..], 10), (b"b", 20), (b"c", 30)] {
            commit(&store, key, offset);
            taken.push(snapshots.take(&store, name, dir.path()).unwrap());
        }
        let put = |location: String, bytes: Vec<u8>| {
            runtime.block_on(snapshots.objects.put(&ObjectPath::from(location), bytes.into())).unwrap();
        };
        put(format!("{name}/99999999999999999999-5/MANIFEST.json"), b"not json".to_vec());
        let restored = |into: &str| {
            let path = dir.path().join(into);
            let manifest = Snapshotter::restore_latest(&snapshots, name, &path).unwrap();
            assert!(!path.with_extension("restoring").exists(), "nothing half restored is left");
            manifest.map(|m| (m.next_offset, open(&path).progress().next_offset))
        };
        assert_eq!(restored("r1"), Some((Some(30), Some(30))), "the newest readable snapshot");
        // The newest: one file changed, its size kept.
        let file = taken[2].files.iter().max_by_key(|f| f.bytes).unwrap();
        let location = format!("{name}/{}/{}", taken[2].id, file.name);
        let mut bytes = runtime
            .block_on(async { snapshots.objects.get(&ObjectPath::from(location.clone())).await?.bytes().await })
            .unwrap()
            .to_vec();
        bytes[0] ^= 0xff;
        put(location, bytes);
        assert_eq!(restored("r2"), Some((Some(20), Some(20))), "the next older one");
        // The middle one: a file missing.
        let file = &taken[1].files[0];
        runtime
            .block_on(snapshots.objects.delete(&ObjectPath::from(format!("{name}/{}/{}", taken[1].id, file.name))))
            .unwrap();
        assert_eq!(restored("r3"), Some((Some(10), Some(10))));
        let file = &taken[0].files[0];
        runtime
            .block_on(snapshots.objects.delete(&ObjectPath::from(format!("{name}/{}/{}", taken[0].id, file.name))))
            .unwrap();
        assert_eq!(restored("r4"), None, "then the log");

        put(format!("{name}/00000000000000000001-1000/000001.sst"), b"x".to_vec());
        put(format!("{name}/00000000000000000002-{}/000001.sst", now_ms()), b"x".to_vec());
        let pruned = snapshots.prune(name, 10, 3_600_000).unwrap();
        assert_eq!((pruned.deleted, pruned.collected, pruned.unreadable.len()), (0, 1, 1));
        let listing = snapshots.listing(name).unwrap();
        let incomplete: Vec<&str> = listing.incomplete.iter().map(|(folder, _)| folder.as_str()).collect();
        assert_eq!(incomplete.len(), 1, "the upload under way stays: {incomplete:?}");
        assert!(incomplete[0].starts_with(&format!("{name}/00000000000000000002-")));
        assert_eq!(listing.manifests, taken, "damaged snapshots stay listed (a restore passes them over)");
    }

    /// A store's snapshot age: 0 while nothing is applied past its newest snapshot,
    /// else how long ago that snapshot was taken (from the manifest, also for one a
    /// restarted snapshotter finds), or since the store was first looked at.
    #[test]
    fn a_snapshot_age_counts_only_while_the_store_is_ahead_of_its_snapshot() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let snapshots = SnapshotStore::local(&dir.path().join("snapshots"), runtime.handle().clone()).unwrap();
        let config = SnapshotsConfig { every_records: 1_000, interval_ms: 3_600_000, ..Default::default() };
        let store = open(&dir.path().join("store"));
        let name = "t.shards/shard-0001";
        let mut snapshotter = Snapshotter::new(snapshots.clone(), &config, dir.path().join("scratch"));
        assert_eq!(snapshotter.age_seconds(name, &store), 0.0, "nothing applied");
        commit(&store, b"a", 10);
        assert!(snapshotter.consider(name, &store).unwrap().is_some(), "the first is due at once");
        assert_eq!(snapshotter.age_seconds(name, &store), 0.0, "the snapshot holds everything");
        commit(&store, b"b", 20);
        assert!(snapshotter.consider(name, &store).unwrap().is_none(), "not due for an hour");
        std::thread::sleep(Duration::from_millis(50));
        let age = snapshotter.age_seconds(name, &store);
        assert!((0.05..60.0).contains(&age), "{age}");
        // A snapshotter started later counts from the manifest's time.
        let mut restarted = Snapshotter::new(snapshots.clone(), &config, dir.path().join("scratch"));
        assert!(restarted.consider(name, &store).unwrap().is_none());
        assert!(restarted.age_seconds(name, &store) >= age);
        assert_eq!(snapshotter.interval_seconds(), 3_600.0);

        // The interval counts from when the newest snapshot was taken, across restarts:
        // a store ahead of one older than the interval is snapshot at once.
        let quick = SnapshotsConfig { every_records: 1_000, interval_ms: 100, ..Default::default() };
        let other = "t.shards/shard-0002";
        let mut first = Snapshotter::new(snapshots.clone(), &quick, dir.path().join("scratch"));
        assert!(first.consider(other, &store).unwrap().is_some());
        std::thread::sleep(Duration::from_millis(150));
        commit(&store, b"c", 30);
        let mut second = Snapshotter::new(snapshots, &quick, dir.path().join("scratch"));
        assert!(second.consider(other, &store).unwrap().is_some(), "due: taken over 100 ms ago");
        assert_eq!(second.age_seconds(other, &store), 0.0);
    }

    /// Incompressible bytes: SHA-256 chained from `seed`.
    fn noise(seed: u64, len: usize) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(len + 32);
        let mut block = ring::digest::digest(&ring::digest::SHA256, &seed.to_le_bytes());
        while bytes.len() < len {
            bytes.extend_from_slice(block.as_ref());
            block = ring::digest::digest(&ring::digest::SHA256, block.as_ref());
        }
        bytes.truncate(len);
        bytes
    }

    /// A file larger than a part goes up part by part (a multipart upload) and comes
    /// back whole, streamed to disk; each file as its manifest says.
    #[test]
    fn files_larger_than_a_part_go_up_in_parts_and_come_back_whole() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let part = 4_096;
        let snapshots = SnapshotStore::local(&dir.path().join("snapshots"), runtime.handle().clone())
            .unwrap()
            .with_part_bytes(part);
        let store = open(&dir.path().join("store"));
        let written: Vec<(Vec<u8>, Vec<u8>)> =
            (0..40u64).map(|i| (format!("key{i:03}").into_bytes(), noise(i, 1_000 + i as usize))).collect();
        let mut batch = WriteBatch::default();
        for (key, value) in &written {
            batch.put_cf(store.cf("state").unwrap(), key, value);
        }
        store.commit(batch, Progress { next_offset: Some(7), ..Default::default() }).unwrap();
        let manifest = snapshots.take(&store, "t.shards/shard-0001", dir.path()).unwrap();
        let largest = manifest.files.iter().map(|f| f.bytes).max().unwrap();
        assert!(largest > 8 * part as u64, "a file of many parts: {largest} bytes");
        for file in &manifest.files {
            let stored =
                std::fs::read(dir.path().join("snapshots").join(&manifest.name).join(&manifest.id).join(&file.name));
            let stored = stored.unwrap();
            assert_eq!(
                (stored.len() as u64, file.sha256.clone()),
                (file.bytes, Some(sha256(&stored))),
                "{}",
                file.name
            );
        }

        let restored_dir = dir.path().join("restored");
        snapshots.restore(&manifest, &restored_dir).unwrap();
        let restored = open(&restored_dir);
        let state = restored.cf("state").unwrap();
        let read: Vec<(Vec<u8>, Vec<u8>)> = restored
            .db()
            .iterator_cf(state, rocksdb::IteratorMode::Start)
            .map(|entry| entry.map(|(key, value)| (key.to_vec(), value.to_vec())).unwrap())
            .collect();
        assert_eq!(read, written);
        assert_eq!(restored.progress().next_offset, Some(7));
    }

    fn sha256(bytes: &[u8]) -> String {
        tally_core::format::hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
    }
}
