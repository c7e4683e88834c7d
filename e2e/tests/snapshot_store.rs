//! The snapshot store against a real S3 API (moto's server): files bigger than a part
//! go up as multipart uploads and come back whole. A binary of its own: the test
//! sets the credentials in its environment, which no other test may read meanwhile.

use rand::{RngCore, SeedableRng};
use tally_shared::config::TallyConfig;
use tally_shared::store::{Durability, Store};

/// Snapshot files bigger than a part go to S3 as multipart uploads (an object's ETag
/// names its parts) and come back whole, streamed to disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_snapshot_files_go_to_s3_in_parts_and_come_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = tally_e2e::s3::S3::start(dir.path().join("moto.log")).await;
    // The snapshot store reads its credentials from the environment, as a service
    // does: set while this binary's one test runs no other thread that reads it.
    for (key, value) in s3.credentials() {
        std::env::set_var(key, value);
    }
    let mut config = TallyConfig::default();
    s3.configure(&mut config);
    // S3's smallest part.
    let part = 5usize << 20;
    let open = |path: &std::path::Path| {
        let families = vec![rocksdb::ColumnFamilyDescriptor::new("state", rocksdb::Options::default())];
        Store::open(path, rocksdb::Options::default(), families, Durability::InputLog).unwrap()
    };
    let (runtime, path) = (tokio::runtime::Handle::current(), dir.path().to_path_buf());
    let (manifest, written, read) = tokio::task::spawn_blocking(move || {
        let snapshots = tally_shared::snapshot::SnapshotStore::from_config(&config.snapshots, runtime)
            .unwrap()
            .with_part_bytes(part);
        let store = open(&path.join("store"));
        // Incompressible values: one file of about 12 MiB, three parts.
        let mut rng = rand::rngs::StdRng::seed_from_u64(56);
        let written: Vec<(Vec<u8>, Vec<u8>)> = (0..12)
            .map(|i| {
                let mut value = vec![0u8; 1 << 20];
                rng.fill_bytes(&mut value);
                (format!("key{i:02}").into_bytes(), value)
            })
            .collect();
        let mut batch = rocksdb::WriteBatch::default();
        for (key, value) in &written {
            batch.put_cf(store.cf("state").unwrap(), key, value);
        }
        let progress = tally_shared::progress::Progress { next_offset: Some(3), ..Default::default() };
        store.commit(batch, progress).unwrap();
        let manifest = snapshots.take(&store, "t.shards/shard-0000", &path).unwrap();
        snapshots.restore(&manifest, &path.join("restored")).unwrap();
        let restored = open(&path.join("restored"));
        let read: Vec<(Vec<u8>, Vec<u8>)> = restored
            .db()
            .iterator_cf(restored.cf("state").unwrap(), rocksdb::IteratorMode::Start)
            .map(|entry| entry.map(|(key, value)| (key.to_vec(), value.to_vec())).unwrap())
            .collect();
        (manifest, written, read)
    })
    .await
    .unwrap();
    assert!(read == written, "the restored store holds what was written");
    let (mut parts, mut whole) = (Vec::new(), Vec::new());
    for file in &manifest.files {
        let etag = s3.etag(&format!("tally/{}/{}/{}", manifest.name, manifest.id, file.name)).await;
        let uploaded = etag.split_once('-').map(|(_, parts)| parts.parse::<u64>().unwrap());
        let expected = (file.bytes > part as u64).then(|| file.bytes.div_ceil(part as u64));
        assert_eq!(uploaded, expected, "{}: {} bytes, ETag {etag}", file.name, file.bytes);
        match uploaded {
            Some(n) => parts.push(n),
            None => whole.push(file.name.clone()),
        }
    }
    assert!(parts == vec![3] && !whole.is_empty(), "one file in 3 parts {parts:?}, the small ones whole {whole:?}");
}
