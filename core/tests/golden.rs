//! Golden bytes of every format tally keeps (see `tally_core::format`).
//!
//! Each sample's bytes, as the current version writes them, are committed under
//! `tests/golden/`. The test decodes the committed bytes and compares with the sample
//! (old data still reads), and encodes the sample and compares with the committed
//! bytes (the format did not drift). The bytes of a version no longer written (shard
//! records of increments in format version 1) stay committed and are only decoded, as
//! do those of shard records in format version 3, and version 4's packed into it
//! (zstd's output changes with its version; what the encoder writes now must decode
//! to the same sample). A change that fails here needs a new format
//! version, not new golden bytes. `TALLY_BLESS=1` writes missing files only.

use std::path::PathBuf;

use tally_core::format::{self, JSON_V1, PRESENT};
use tally_core::graph::{DescChange, EdgeOp, EdgeUpdate};
use tally_core::jobs::{DeadJob, DeadJobAction, DeadJobDecision, Job};
use tally_core::keys::{decode_mark, decode_names, decode_stamp, encode_mark, encode_names, encode_stamp, Counts};
use tally_core::records::Truncated;
use tally_core::segments::Selector;
use tally_core::time::WindowSpec;
use tally_core::wire::{
    DeadLetter, FreshReadResponse, GraphMessage, GraphUpdate, Heartbeat, Increment, Kind, ReadRequest, ReadResponse,
    Rollup, RollupPosition, ShardAnswer, ShardAsOf, ShardMessage, ShardMessageRef, ShardOutcome, ShardOwner,
    ShardQueries, ShardQuery, Source, Stamp, TotalDelta,
};

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name)
}

/// Compares `encoded` with the committed bytes of `name` and returns them.
fn golden(name: &str, encoded: &[u8]) -> Vec<u8> {
    if !golden_path(name).exists() && std::env::var_os("TALLY_BLESS").is_some() {
        std::fs::write(golden_path(name), encoded).expect("writing a blessed golden file");
    }
    let committed = committed(name);
    assert_eq!(encoded, committed.as_slice(), "{name}: the current encoder no longer writes the committed bytes");
    committed
}

/// The committed bytes of `name` (written from `encoded` when missing and blessed),
/// for a format whose encoder may write other bytes of the same meaning (zstd's
/// output changes with its version): they are only decoded.
fn committed_or_blessed(name: &str, encoded: &[u8]) -> Vec<u8> {
    if !golden_path(name).exists() && std::env::var_os("TALLY_BLESS").is_some() {
        std::fs::write(golden_path(name), encoded).expect("writing a blessed golden file");
    }
    committed(name)
}

/// The committed bytes of `name`, which the current encoder no longer writes (an
/// older format version that must keep decoding).
fn committed(name: &str) -> Vec<u8> {
    let path = golden_path(name);
    std::fs::read(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

const SOURCE: Source = Source { stream: Source::INCREMENTS, partition: 7 };

#[test]
fn shard_records() {
    let increments = ShardMessage::Increments {
        source: SOURCE,
        entries: vec![
            (
                Stamp { offset: 41, index: 0 },
                Increment {
                    entity: "user:1".into(),
                    metric: "views".into(),
                    delta: 3,
                    ts: 1_700_000_000_000,
                    id: None,
                },
            ),
            (
                Stamp { offset: 41, index: 1 },
                Increment { entity: "ü".into(), metric: "likes".into(), delta: -2, ts: -1, id: Some("r-9".into()) },
            ),
        ],
    };
    let bytes = golden("shard-increments-v2.bin", &increments.encode().unwrap());
    assert_eq!(bytes[..2], [format::RECORD_MAGIC, format::RECORD_V2]);
    assert_eq!(ShardMessage::decode(&bytes).unwrap(), increments);
    // Version 1, which ingesters wrote before version 2, still reads.
    let v1 = committed("shard-increments.bin");
    assert_eq!(v1[..2], [format::RECORD_MAGIC, format::RECORD_V1]);
    assert_eq!(ShardMessage::decode(&v1).unwrap(), increments);
    let Ok(ShardMessageRef::Increments { entries, .. }) = ShardMessageRef::decode(&v1) else { panic!("v1 increments") };
    let borrowed: Vec<(Stamp, Increment)> = entries.into_iter().map(|(s, i)| (s, i.into_owned())).collect();
    let ShardMessage::Increments { entries: want, .. } = &increments else { unreachable!() };
    assert_eq!(&borrowed, want);

    // Version 3 (what ingesters write): a version 2 record packed with zstd. Its
    // bytes depend on the zstd library's version, so the committed ones are only
    // decoded, and what the encoder writes now must decode the same.
    let many = ShardMessage::Increments {
        source: SOURCE,
        entries: (0..60)
            .map(|index| {
                let ShardMessage::Increments { entries, .. } = &increments else { unreachable!() };
                (Stamp { offset: 41 + i64::from(index / 2), index: index % 2 }, entries[index as usize % 2].1.clone())
            })
            .collect(),
    };
    let ShardMessage::Increments { source, entries } = &many else { unreachable!() };
    let packed = ShardMessage::encode_increments(*source, entries, format::RECORD_V3).unwrap();
    let v3 = committed_or_blessed("shard-increments-v3.bin", &packed);
    for bytes in [&v3, &packed] {
        assert_eq!(bytes[..2], [format::RECORD_MAGIC, format::RECORD_V3]);
        assert_eq!(ShardMessage::decode(bytes).unwrap(), many);
    }
    let unpacked = tally_core::wire::packed::unpack(&v3).unwrap();
    assert_eq!(unpacked[..2], [format::RECORD_MAGIC, format::RECORD_V2]);
    let Ok(ShardMessageRef::Increments { entries, .. }) = ShardMessageRef::decode(&unpacked) else { panic!("v3") };
    assert_eq!(entries.len(), 60);

    // Version 4 (what ingesters write): a bundle of version 2
    // records of several sources for one shard, each with its record time, packed
    // into version 3. The bundle's own bytes are golden; packed, they are only
    // decoded (zstd).
    let ShardMessage::Increments { entries: few, .. } = &increments else { unreachable!() };
    let ShardMessage::Increments { entries: sixty, .. } = &many else { unreachable!() };
    let other = Source { stream: Source::INCREMENTS, partition: 2 };
    let sections = [
        (1_700_000_000_000, ShardMessage::encode_increments(SOURCE, sixty, format::RECORD_V2).unwrap()),
        (1_700_000_000_123, ShardMessage::encode_increments(other, few, format::RECORD_V2).unwrap()),
    ];
    let packed = ShardMessage::bundle(&sections).unwrap();
    assert_eq!(packed[..2], [format::RECORD_MAGIC, format::RECORD_V3]);
    let v4 = golden("shard-increments-v4.bin", &tally_core::wire::packed::unpack(&packed).unwrap());
    assert_eq!(v4[..2], [format::RECORD_MAGIC, format::RECORD_V4]);
    let want = vec![
        (1_700_000_000_000, many.clone()),
        (1_700_000_000_123, ShardMessage::Increments { source: other, entries: few.clone() }),
    ];
    let v4_packed = committed_or_blessed("shard-increments-v4-packed.bin", &packed);
    for bytes in [&v4, &v4_packed, &packed] {
        assert_eq!(ShardMessage::decode_sections(bytes, 0).unwrap(), want);
    }

    let changes = ShardMessage::DescChanges {
        source: Source { stream: Source::GRAPH_PROCESSOR, partition: 0 },
        entries: vec![(
            Stamp { offset: 5, index: 2 },
            DescChange { origin: "a".into(), added: vec!["b".into(), "c".into()], removed: vec!["d".into()] },
        )],
    };
    let bytes = golden("shard-desc-changes.bin", &changes.encode().unwrap());
    assert_eq!(ShardMessage::decode(&bytes).unwrap(), changes);

    let totals = ShardMessage::Totals {
        source: Source { stream: Source::SHARD, partition: 3 },
        entries: vec![(
            Stamp { offset: 9, index: 0 },
            TotalDelta {
                entity: "topic:x".into(),
                metric: "views".into(),
                width_ms: 60_000,
                bucket: 120_000,
                delta: 4,
            },
        )],
    };
    let bytes = golden("shard-totals.bin", &totals.encode().unwrap());
    assert_eq!(ShardMessage::decode(&bytes).unwrap(), totals);
}

#[test]
fn graph_update_records() {
    let updates = GraphMessage::Updates {
        source: Source { stream: Source::GRAPH, partition: 1 },
        entries: vec![
            (
                Stamp { offset: 3, index: 0 },
                GraphUpdate { edge: EdgeUpdate { op: EdgeOp::Add, from: "a".into(), to: "b".into() }, id: None },
            ),
            (
                Stamp { offset: 3, index: 1 },
                GraphUpdate {
                    edge: EdgeUpdate { op: EdgeOp::Remove, from: "a".into(), to: "c".into() },
                    id: Some("g-1".into()),
                },
            ),
        ],
    };
    let bytes = golden("graph-updates.bin", &updates.encode().unwrap());
    assert_eq!(GraphMessage::decode(&bytes).unwrap(), updates);
}

/// The router's marks: how far it has routed each input partition, to every shard
/// and to the graph (what write tokens wait for).
#[test]
fn mark_records() {
    let marks = vec![
        (Source { stream: Source::INCREMENTS, partition: 0 }, Stamp::through(41)),
        (Source { stream: Source::INCREMENTS, partition: 2 }, Stamp::through(7)),
    ];
    let shard = ShardMessage::Marks { marks: marks.clone() };
    let bytes = golden("shard-marks.bin", &shard.encode().unwrap());
    assert_eq!(ShardMessage::decode(&bytes).unwrap(), shard);
    let graph =
        GraphMessage::Marks { marks: vec![(Source { stream: Source::GRAPH, partition: 1 }, Stamp::through(3))] };
    let bytes = golden("graph-marks.bin", &graph.encode().unwrap());
    assert_eq!(GraphMessage::decode(&bytes).unwrap(), graph);
}

/// The read link's messages (tally-query ↔ counter): a query of an older release
/// must still be understood by a newer counter, and the other way round.
#[test]
fn read_link_messages() {
    let query = |entity: &str, kind, spec| ShardQuery::plain(entity.into(), "views".into(), kind, spec);
    let request = ReadRequest {
        now_ms: 1_700_000_000_000,
        shards: vec![
            ShardQueries { shard: 3, queries: vec![query("user:1", Kind::Total, WindowSpec::All)] },
            ShardQueries {
                shard: 60,
                queries: vec![
                    query("ü", Kind::Direct, WindowSpec::Last { window_ms: 3_600_000 }),
                    query("t", Kind::Total, WindowSpec::Series { step_ms: 60_000, range_ms: 180_000 }),
                ],
            },
        ],
    };
    let bytes = golden("read-request.bin", &request.encode().unwrap());
    assert_eq!(bytes[..2], [format::RECORD_MAGIC, format::RECORD_V1]);
    assert_eq!(ReadRequest::decode(&bytes).unwrap(), request);
    // Version 2: a query selecting segments (a version-1 reader refuses it).
    let mut segmented = request.clone();
    segmented.shards[1].queries[1].segments = Some(Selector {
        filters: vec![("country".into(), Some("US".into())), ("device".into(), None)],
        by: Some("state".into()),
    });
    let bytes = golden("read-request-v2.bin", &segmented.encode().unwrap());
    assert_eq!(bytes[..2], [format::RECORD_MAGIC, format::RECORD_V2]);
    assert_eq!(ReadRequest::decode(&bytes).unwrap(), segmented);

    let response = ReadResponse {
        shards: vec![
            ShardOutcome::Answers {
                answers: vec![
                    ShardAnswer::Window { value: -7, resolution: "all".into(), from: 0, to: 1_700_000_000_000 },
                    ShardAnswer::Series { resolution: "1m".into(), points: vec![(60_000, 1), (120_000, 0)] },
                    ShardAnswer::Error { code: "invalid_window".into(), message: "too long".into() },
                ],
            },
            ShardOutcome::NotOwner,
            ShardOutcome::Failed { message: "shard 9 failed".into() },
            ShardOutcome::Unavailable { message: "shard 10: io".into() },
        ],
    };
    let bytes = golden("read-response.bin", &response.encode().unwrap());
    assert_eq!(ReadResponse::decode(&bytes).unwrap(), response);
    let segments = ReadResponse {
        shards: vec![ShardOutcome::Answers {
            answers: vec![ShardAnswer::Segments {
                resolution: "1h".into(),
                from: 3_600_000,
                to: 10_800_000,
                step: 3_600_000,
                groups: vec![("CA".into(), vec![3, 0]), ("NY".into(), vec![0, -2])],
                overflow: vec![1, 0],
            }],
        }],
    };
    let segments_bytes = golden("read-response-segments.bin", &segments.encode().unwrap());
    assert_eq!(ReadResponse::decode(&segments_bytes).unwrap(), segments);
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(ReadResponse::decode(&trailing).is_err(), "trailing bytes are refused");
    assert!(ReadResponse::decode(&bytes[..bytes.len() - 1]).is_err(), "a truncated response is refused");

    // Link version 2: the same outcomes and each one's freshness.
    let as_of = vec![Some(ShardAsOf { applied: 1_234, lag_ms: Some(80) }), None, None, None];
    let fresh = FreshReadResponse { shards: response.shards.clone(), as_of };
    let bytes = golden("read-response-fresh.bin", &fresh.encode().unwrap());
    assert_eq!(bytes[..2], [format::RECORD_MAGIC, format::RECORD_V1]);
    assert_eq!(FreshReadResponse::decode(&bytes).unwrap(), fresh);
    assert!(ReadResponse::decode(&bytes).is_err(), "a version-1 reader refuses it (it asks for version 1)");
    assert_eq!(fresh.clone().without_freshness(), response);
    // The JSON route's answer, read by a reader that knows no freshness, and the other way round.
    let json = serde_json::to_string(&fresh).unwrap();
    assert_eq!(serde_json::from_str::<ReadResponse>(&json).unwrap(), response);
    let old = serde_json::to_string(&response).unwrap();
    assert_eq!(serde_json::from_str::<FreshReadResponse>(&old).unwrap().as_of, Vec::new());
}

#[test]
fn store_values() {
    let counts = Counts { direct: 5, total: -12 };
    let bytes = golden("value-counts.bin", &counts.encode());
    assert_eq!(Counts::decode(&bytes).unwrap(), counts);
    let wide = Counts { direct: -(1 << 70), total: (1 << 65) + 3 };
    let bytes = golden("value-counts-v2.bin", &wide.encode());
    assert_eq!(bytes[0], format::VALUE_V2);
    assert_eq!(Counts::decode(&bytes).unwrap(), wide);

    let mark = golden("value-dedupe-mark.bin", &encode_mark(1_700_000_000_123, SOURCE));
    assert_eq!(decode_mark(&mark).unwrap(), (1_700_000_000_123, SOURCE));

    let stamp = Stamp { offset: 1_234_567, index: 8 };
    let bytes = golden("value-high-water.bin", &encode_stamp(stamp));
    assert_eq!(decode_stamp(&bytes).unwrap(), stamp);

    let bytes = golden("value-offset.bin", &format::i64_value(987_654));
    assert_eq!(format::decode_i64_value(&bytes, "offset").unwrap(), 987_654);

    let names = vec!["b".to_string(), "topic:ü".to_string()];
    let bytes = golden("value-descendants.bin", &encode_names(&names).unwrap());
    assert_eq!(decode_names(&bytes).unwrap(), names);

    let bytes = golden("value-present.bin", &PRESENT);
    format::check_present(&bytes, "mark").unwrap();
    golden("store-format.bin", &[format::STORE_V1]);
}

#[test]
fn json_records() {
    let owner = ShardOwner::new(4, Some("10.0.0.7:9101".into()), "00ab".into(), 1_700_000_000_000);
    let bytes = golden("shard-owner.json", &serde_json::to_vec(&owner).unwrap());
    assert_eq!(ShardOwner::decode(&bytes).unwrap(), owner);

    let beat = Heartbeat::new("b1".into(), "10.0.0.8:9300".into(), 1_700_000_000_000, true);
    let bytes = golden("broker-heartbeat.json", &serde_json::to_vec(&beat).unwrap());
    assert_eq!(Heartbeat::decode(&bytes).unwrap(), beat);

    let rollup = Rollup {
        v: JSON_V1,
        entity: "user:1".into(),
        metric: "views".into(),
        resolution: "1h".into(),
        bucket: 1_699_999_200_000,
        total: 10,
        direct: 7,
        position: None,
        expires_at: None,
    };
    let bytes = committed("rollup.json");
    assert_eq!(Rollup::decode(&bytes).unwrap(), rollup, "version 1, from before positions, still reads");
    let position = Some(RollupPosition { shard: 3, offset: 1_234 });
    let rollup = Rollup { v: Rollup::V2, position, expires_at: Some(1_703_026_800_000), ..rollup };
    let bytes = golden("rollup-v2.json", &serde_json::to_vec(&rollup).unwrap());
    assert_eq!(Rollup::decode(&bytes).unwrap(), rollup);
    let position = rollup.position.unwrap();
    let bytes = golden("rollup-position-header.json", &position.header_value());
    assert_eq!(RollupPosition::from_header(&bytes).unwrap(), position);

    let letter =
        DeadLetter::encode("tally.increments", 2, 17, Some(1), "metric: empty", b"{\"x\":1}", 1 << 20).unwrap();
    let bytes = golden("dead-letter.json", &letter);
    let decoded: DeadLetter = serde_json::from_slice(&bytes).unwrap();
    assert_eq!((decoded.v, decoded.offset, decoded.index, decoded.truncated), (JSON_V1, 17, Some(1), Truncated::new()));

    let job = Job::parse(br#"{"id":"j1","payload":{"n":1}}"#).unwrap();
    let dead = DeadJob {
        v: JSON_V1,
        queue: "emails".into(),
        partition: 0,
        offset: 3,
        attempts: 5,
        error: "smtp timeout".into(),
        job,
        truncated: Truncated::new(),
    };
    let bytes = golden("dead-job.json", &serde_json::to_vec(&dead).unwrap());
    let decoded = DeadJob::decode(&bytes).unwrap();
    assert_eq!((decoded.job.id.as_str(), decoded.attempts, decoded.error.as_str()), ("j1", 5, "smtp timeout"));

    let decision = DeadJobDecision::new("emails", 0, 3, DeadJobAction::Requeued, 1_763_780_000_000);
    let bytes = golden("dead-job-decision.json", &serde_json::to_vec(&decision).unwrap());
    assert_eq!(DeadJobDecision::decode(&bytes).unwrap(), decision);
}

#[test]
fn other_versions_fail_loudly() {
    let mut newer = ShardMessage::Totals { source: SOURCE, entries: vec![] }.encode().unwrap();
    newer[1] = 5;
    let err = ShardMessage::decode(&newer).unwrap_err().to_string();
    assert!(err.contains("unknown format version 5"), "{err}");
    assert!(ShardMessageRef::decode(&newer).unwrap_err().to_string().contains("unknown format version 5"));
    let err = ShardMessage::decode_sections(&newer, 0).unwrap_err().to_string();
    assert!(err.contains("unknown format version 5"), "{err}");
    // Version 4 is a bundle of shard records of increments only.
    newer[1] = 4;
    let err = ShardMessage::decode_sections(&newer, 0).unwrap_err().to_string();
    assert!(err.contains("shard record (format version 4): sections 2 is more than"), "{err}");
    assert!(GraphMessage::decode(&newer).unwrap_err().to_string().contains("unknown format version 4"));
    // Version 3 is a packed shard record of increments only.
    newer[1] = 3;
    let err = ShardMessage::decode(&newer).unwrap_err().to_string();
    assert!(err.contains("shard record version 3: not a zstd frame"), "{err}");
    assert!(GraphMessage::decode(&newer).unwrap_err().to_string().contains("unknown format version 3"));
    // Version 2 is a shard record of increments only.
    newer[1] = 2;
    assert!(GraphMessage::decode(&newer).unwrap_err().to_string().contains("unknown format version 2"));
    assert!(GraphMessage::decode(b"{\"op\":\"add_edge\"}").unwrap_err().to_string().contains("not a tally record"));
    let mut counts = Counts::default().encode().to_vec();
    counts[0] = 3;
    assert!(Counts::decode(&counts).unwrap_err().to_string().contains("unknown format version 3"));
    let owner = br#"{"v":2,"shard":1,"addr":null,"instance":"i","at_ms":0}"#;
    assert!(ShardOwner::decode(owner).unwrap_err().to_string().contains("version 2"));
    let unversioned = br#"{"shard":1,"addr":null,"instance":"i","at_ms":0}"#;
    assert!(ShardOwner::decode(unversioned).is_err());
}
