//! Round trips, bounds and refusals of the wire formats.

use std::borrow::Cow;

use serde::Serialize;

use super::codec::{decode, encode};
use super::*;
use crate::graph::{DescChange, EdgeUpdate};
use crate::keys::Count;
use crate::records::Truncated;
use proptest::prelude::*;

proptest! {
    #[test]
    fn shard_messages_round_trip(
        partition in any::<u32>(),
        entries in proptest::collection::vec(
            (any::<i64>(), any::<u32>(), "\\PC{1,20}", "[a-z]{1,8}", any::<i64>(), any::<i64>(), proptest::option::of("[a-z0-9]{1,10}")),
            0..20,
        ),
    ) {
        let message = ShardMessage::Increments {
            source: Source { stream: Source::INCREMENTS, partition },
            entries: entries.into_iter().map(|(offset, index, entity, metric, delta, ts, id)| {
                (Stamp { offset, index }, Increment { entity, metric, delta, ts, id })
            }).collect(),
        };
        let bytes = message.encode().unwrap();
        let ShardMessageRef::Increments { source, entries } = ShardMessageRef::decode(&bytes).unwrap() else {
            panic!("decoded another variant");
        };
        let ShardMessage::Increments { source: want_source, entries: want } = &message else { unreachable!() };
        prop_assert_eq!(&source, want_source);
        prop_assert_eq!(entries.len(), want.len());
        for ((stamp, got), (want_stamp, want)) in entries.iter().zip(want) {
            prop_assert_eq!(stamp, want_stamp);
            prop_assert_eq!((got.entity, got.metric, got.delta, got.ts, got.id), (want.entity.as_str(), want.metric.as_str(), want.delta, want.ts, want.id.as_deref()));
        }
        prop_assert_eq!(ShardMessage::decode(&bytes).unwrap(), message);
    }
}

#[test]
fn graph_and_totals_messages_round_trip_borrowed() {
    let source = Source { stream: Source::SHARD, partition: 3 };
    let delta =
        TotalDelta { entity: "user:7".into(), metric: "views".into(), width_ms: 60_000, bucket: -60_000, delta: -4 };
    let totals = ShardMessage::Totals { source, entries: vec![(Stamp { offset: 9, index: 2 }, delta)] };
    let bytes = totals.encode().unwrap();
    assert_eq!(ShardMessage::decode(&bytes).unwrap(), totals);
    let Ok(ShardMessageRef::Totals { entries, .. }) = ShardMessageRef::decode(&bytes) else { panic!("totals") };
    assert_eq!((entries[0].1.entity, entries[0].1.bucket, entries[0].1.delta), ("user:7", -60_000, -4));

    let change = DescChange { origin: "a".into(), added: vec!["b".into()], removed: vec![] };
    let changes = ShardMessage::DescChanges { source, entries: vec![(Stamp { offset: 1, index: 0 }, change.clone())] };
    let bytes = changes.encode().unwrap();
    let Ok(ShardMessageRef::DescChanges { entries, .. }) = ShardMessageRef::decode(&bytes) else { panic!("changes") };
    assert_eq!(entries[0].1.clone().into_owned(), change);

    let edge = EdgeUpdate { op: crate::graph::EdgeOp::Remove, from: "a".into(), to: "b".into() };
    let graph = GraphMessage::Updates {
        source,
        entries: vec![(Stamp { offset: 1, index: 0 }, GraphUpdate { edge, id: None })],
    };
    assert_eq!(GraphMessage::decode(&graph.encode().unwrap()).unwrap(), graph);
}

#[test]
fn sections_of_several_sources_read_back_with_their_times() {
    let increment = |entity: &str, ts| Increment { entity: entity.into(), metric: "m".into(), delta: 1, ts, id: None };
    let first: Vec<(Stamp, Increment)> =
        (0..300).map(|i| (Stamp { offset: 10 + i / 3, index: i as u32 % 3 }, increment("a", 5))).collect();
    let second = vec![(Stamp { offset: 4, index: 0 }, increment("b", 6))];
    let (p0, p5) =
        (Source { stream: Source::INCREMENTS, partition: 0 }, Source { stream: Source::INCREMENTS, partition: 5 });
    let v2 = |source, entries: &[(Stamp, Increment)]| {
        ShardMessage::encode_increments(source, entries, crate::format::RECORD_V2).unwrap()
    };
    let sections = [(100, v2(p0, &first)), (90, v2(p5, &second))];
    let bytes = ShardMessage::bundle(&sections).unwrap();
    assert_eq!(bytes[..2], [crate::format::RECORD_MAGIC, crate::format::RECORD_V3], "packed: it shrinks");
    let want = vec![
        (100, ShardMessage::Increments { source: p0, entries: first.clone() }),
        (90, ShardMessage::Increments { source: p5, entries: second.clone() }),
    ];
    assert_eq!(ShardMessage::decode_sections(&bytes, 7).unwrap(), want);
    let unpacked = crate::wire::packed::unpack(&bytes).unwrap();
    let borrowed = ShardMessageRef::decode_sections(&unpacked, 7).unwrap();
    let summary: Vec<(i64, u32, usize)> = borrowed
        .iter()
        .map(|(time, message)| match message {
            ShardMessageRef::Increments { source, entries } => (*time, source.partition, entries.len()),
            _ => (*time, u32::MAX, 0),
        })
        .collect();
    assert_eq!(summary, vec![(100, 0, 300), (90, 5, 1)]);
    // A bundle is only read by its sections; any other record is one message with
    // the time it is given.
    assert!(ShardMessageRef::decode(&unpacked).unwrap_err().to_string().contains("a bundle"));
    assert!(ShardMessage::decode(&bytes).unwrap_err().to_string().contains("a bundle"));
    let single = ShardMessage::Increments { source: p5, entries: second };
    assert_eq!(ShardMessage::decode_sections(&single.encode().unwrap(), 7).unwrap(), vec![(7, single)]);
    assert!(ShardMessage::bundle(&[]).is_err());
    let packed = ShardMessage::encode_increments(p5, &first, crate::format::RECORD_V3).unwrap();
    assert!(ShardMessage::bundle(&[(1, packed)]).unwrap_err().to_string().contains("version 2 records only"));
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    assert!(ShardMessage::decode(&[0xff; 7]).is_err());
    assert!(ShardMessage::decode(&[]).is_err());
    let mut bytes =
        ShardMessage::Increments { source: Source { stream: 1, partition: 0 }, entries: vec![] }.encode().unwrap();
    bytes.push(0);
    assert!(ShardMessage::decode(&bytes).is_err());
}

#[test]
fn size_bounds_hold_for_encoded_messages() {
    let source = Source { stream: Source::INCREMENTS, partition: u32::MAX };
    let entries: Vec<(Stamp, Increment)> = (0..50)
        .map(|i| {
            // Every name new, every difference as wide as it gets (offsets and
            // times swing between the extremes): the compact format's worst case.
            let extreme = if i % 2 == 0 { i64::MIN } else { i64::MAX };
            let increment = Increment {
                entity: "é".repeat(i * 3),
                metric: "m".repeat(i),
                delta: i64::MIN,
                ts: extreme,
                id: (i % 2 == 0).then(|| "x".repeat(i)),
            };
            (Stamp { offset: extreme, index: u32::MAX }, increment)
        })
        .collect();
    let bound: usize = entries.iter().map(|(_, inc)| inc.size_bound()).sum();
    let encoded = ShardMessage::encode_increments(source, &entries, crate::format::RECORD_V2).unwrap();
    assert!(encoded.len() <= bound + 32, "{} > {bound}", encoded.len());
    let v1 = ShardMessage::encode_increments(source, &entries, crate::format::RECORD_V1).unwrap();
    assert!(v1.len() <= bound + 32, "{} > {bound}", v1.len());
    assert_eq!(v1[..2], crate::format::RECORD_HEADER);
    assert_eq!(ShardMessage::decode(&v1).unwrap(), ShardMessage::decode(&encoded).unwrap());
    let v3 = ShardMessage::encode_increments(source, &entries, crate::format::RECORD_V3).unwrap();
    assert!(v3.len() <= encoded.len(), "{} > {}", v3.len(), encoded.len());
    assert_eq!(ShardMessage::decode(&v3).unwrap(), ShardMessage::decode(&encoded).unwrap());
    assert!(ShardMessage::encode_increments(source, &entries, 4).is_err());
    // A bundle of such records (times as wide as they get, and packing that
    // cannot shrink them much) stays within their lengths and the overheads.
    let halves = entries.split_at(25);
    let sections = [
        (i64::MIN, ShardMessage::encode_increments(source, halves.0, crate::format::RECORD_V2).unwrap()),
        (i64::MAX, ShardMessage::encode_increments(source, halves.1, crate::format::RECORD_V2).unwrap()),
    ];
    let bundle = ShardMessage::bundle(&sections).unwrap();
    let bound: usize =
        sections.iter().map(|(_, record)| record.len() + crate::wire::bundle::SECTION_OVERHEAD).sum::<usize>()
            + crate::wire::bundle::BUNDLE_OVERHEAD;
    assert!(bundle.len() <= bound, "{} > {bound}", bundle.len());
    let unpacked = crate::wire::packed::unpack(&bundle).unwrap();
    assert!(unpacked.len() <= bound, "{} > {bound}", unpacked.len());
    // The borrowed form the ingester routes encodes to the same bytes.
    let borrowed: Vec<(Stamp, IncrementCow<'_>)> = entries
        .iter()
        .map(|(stamp, inc)| {
            let cow = IncrementCow {
                entity: Cow::Borrowed(inc.entity.as_str()),
                metric: Cow::Owned(inc.metric.clone()),
                delta: inc.delta,
                ts: inc.ts,
                id: inc.id.as_deref().map(Cow::Borrowed),
            };
            assert_eq!(cow.size_bound(), inc.size_bound());
            (*stamp, cow)
        })
        .collect();
    assert_eq!(ShardMessage::encode_increments(source, &borrowed, crate::format::RECORD_V2).unwrap(), encoded);
    assert_eq!(ShardMessage::encode_increments(source, &borrowed, crate::format::RECORD_V1).unwrap(), v1);
    assert_eq!(borrowed.into_iter().map(|(s, c)| (s, c.into_owned())).collect::<Vec<_>>(), entries);

    let change = DescChange {
        origin: "o".into(),
        added: (0..3_000).map(|i| format!("added-{i:0>40}")).collect(),
        removed: (0..1_000).map(|i| format!("removed-{i:0>40}")).collect(),
    };
    let pieces = split_desc_change(change.clone(), 20_000);
    assert!(pieces.len() > 5);
    let mut added: Vec<String> = pieces.iter().flat_map(|p| p.added.clone()).collect();
    let mut removed: Vec<String> = pieces.iter().flat_map(|p| p.removed.clone()).collect();
    added.sort();
    removed.sort();
    assert_eq!((added, removed), (change.added.clone(), change.removed.clone()));
    for piece in &pieces {
        let message =
            ShardMessage::DescChanges { source, entries: vec![(Stamp { offset: 1, index: 1 }, piece.clone())] };
        assert!(message.encode().unwrap().len() <= 20_000 + 32);
        assert!(desc_change_bound(piece) <= 20_000);
    }
}

#[test]
fn dead_letters_fit_the_budget_and_say_what_was_cut() {
    use base64::Engine;
    let raw = vec![b'x'; 800_000];
    let bytes = DeadLetter::encode("t.increments", 3, 9, None, "not json", &raw, 500_000).unwrap();
    assert!(bytes.len() <= 500_000, "{}", bytes.len());
    let letter: DeadLetter = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(letter.truncated, Truncated::from([("payload".to_string(), 800_000)]));
    let kept = base64::engine::general_purpose::STANDARD.decode(&letter.payload).unwrap();
    assert!(kept.len() > 300_000 && raw.starts_with(&kept), "{}", kept.len());

    let small = DeadLetter::encode("t.increments", 3, 9, Some(2), "bad", b"{}", 500_000).unwrap();
    let letter: DeadLetter = serde_json::from_slice(&small).unwrap();
    assert!(letter.truncated.is_empty());
    assert_eq!(base64::engine::general_purpose::STANDARD.decode(&letter.payload).unwrap(), b"{}");
    assert!(!String::from_utf8(small).unwrap().contains("truncated"));
}

#[test]
fn stamps_order_by_offset_then_index() {
    assert!(Stamp { offset: 1, index: 9 } < Stamp { offset: 2, index: 0 });
    assert!(Stamp { offset: 2, index: 0 } < Stamp { offset: 2, index: 1 });
}

/// Counts past an i64 travel exactly, in bincode and in JSON; a count within an
/// i64 keeps the bytes it had when these fields were i64s.
#[test]
fn wide_counts_travel_exactly() {
    let wide: Count = (1 << 65) + 7;
    let response = ReadResponse {
        shards: vec![ShardOutcome::Answers {
            answers: vec![
                ShardAnswer::Window { value: -wide, resolution: "all".into(), from: 0, to: 9 },
                ShardAnswer::Series { resolution: "1h".into(), points: vec![(0, wide), (1, 2)] },
            ],
        }],
    };
    assert_eq!(ReadResponse::decode(&response.encode().unwrap()).unwrap(), response);
    let json = serde_json::to_string(&response).unwrap();
    assert!(json.contains("-36893488147419103239"), "{json}");
    assert_eq!(serde_json::from_str::<ReadResponse>(&json).unwrap(), response);

    #[derive(Serialize)]
    struct Narrow {
        entity: String,
        metric: String,
        width_ms: i64,
        bucket: i64,
        delta: i64,
    }
    for delta in [0, -1, 300, i64::MIN, i64::MAX] {
        let narrow = Narrow { entity: "e".into(), metric: "m".into(), width_ms: 60_000, bucket: 5, delta };
        let total =
            TotalDelta { entity: "e".into(), metric: "m".into(), width_ms: 60_000, bucket: 5, delta: delta.into() };
        assert_eq!(encode(&total).unwrap(), encode(&narrow).unwrap(), "{delta}");
    }
    let total = TotalDelta { entity: "e".into(), metric: "m".into(), width_ms: 0, bucket: 0, delta: -wide };
    assert!(encode(&total).unwrap().len() <= 2 + total.size_bound());
    assert_eq!(decode::<TotalDelta>(&encode(&total).unwrap(), "total").unwrap(), total);
}
