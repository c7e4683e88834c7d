//! Freshness end to end, on the real services: every read says how fresh it is
//! (`as_of`: each shard read, the offset of its log applied — equal to the log's
//! end once idle — and its lag), single reads, batches, series and contributors
//! alike; a read bounded by `max_staleness_ms` answers while the counter keeps
//! up, and once the counter is paused it answers 503 `too_stale` — the first
//! within its bound, the next at once; a read with the token of a write made
//! meanwhile answers 504 `not_fresh_enough` after its `max_wait_ms`, and once the
//! counter is back, the write's count, its `as_of` saying it holds the token.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tally_core::position::token::WriteToken;
use tally_e2e::Sandbox;

const SERVICES: [&str; 4] = ["tally-ingester", "tally-counter", "tally-graph", "tally-query"];

fn increment(entity: &str, delta: i64, id: &str) -> (Option<String>, Vec<u8>) {
    let body = json!({"entity": entity, "metric": "views", "delta": delta, "id": id});
    (Some(entity.to_string()), body.to_string().into_bytes())
}

/// `body`'s `as_of` as (shard, applied, lag_ms, served_by).
fn as_of(body: &Value) -> Vec<(u64, i64, Option<i64>, String)> {
    let listed = body["as_of"].as_array().cloned().unwrap_or_default();
    listed
        .iter()
        .map(|a| {
            let shard = a["shard"].as_u64().unwrap();
            (shard, a["applied"].as_i64().unwrap(), a["lag_ms"].as_i64(), a["served_by"].as_str().unwrap().to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_say_how_fresh_they_are_and_refuse_stale_data_at_once() {
    let mut sandbox = Sandbox::start().await;
    for service in SERVICES {
        sandbox.spawn(service);
    }
    let entities = ["user:1", "user:2", "answer:9"];
    let records: Vec<_> =
        entities.iter().enumerate().map(|(i, e)| increment(e, i as i64 + 2, &format!("e{i}"))).collect();
    sandbox.produce_to(&sandbox.names.increments(), &records).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = sandbox.get("/v1/counters/answer:9/views").await;
        if status == 200 && body["value"] == 4 {
            break;
        }
        assert!(Instant::now() < deadline, "never counted: {status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Idle and caught up: each answer names the shard it read, the shard log's end as
    // applied, a lag within the bound, served by the owner.
    let shards = sandbox.names.shards();
    let fresh = |body: &Value| {
        as_of(body).into_iter().all(|(shard, applied, lag, by)| {
            applied == sandbox.next_offset(&shards, shard as i32)
                && lag.is_some_and(|lag| lag <= 2_000)
                && by == "owner"
        })
    };
    let read_shards = |body: &Value| as_of(body).into_iter().map(|(shard, ..)| shard).collect::<Vec<_>>();
    let shard_count = sandbox.partition_count(&shards);
    let shard_of = |entity: &str| u64::from(tally_core::sharding::shard_of(entity, shard_count));
    let mut all: Vec<u64> = entities.iter().map(|e| shard_of(e)).collect();
    all.sort_unstable();
    all.dedup();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, single) = sandbox.get("/v1/counters/user:2/views?max_staleness_ms=2000").await;
        let (_, series) = sandbox.get("/v1/counters/user:2/views/series?step=1m&range=10m").await;
        let queries: Vec<Value> = entities.iter().map(|e| json!({"entity": e, "metric": "views"})).collect();
        let (_, batch) = sandbox.post("/v1/query", &json!({"queries": queries, "max_staleness_ms": 2000})).await;
        let (_, explained) = sandbox.get("/v1/counters/user:2/views/contributors").await;
        let ok = status == 200
            && single["value"] == 3
            && read_shards(&single) == vec![shard_of("user:2")]
            && read_shards(&series) == vec![shard_of("user:2")]
            && read_shards(&batch) == all
            && read_shards(&explained) == vec![shard_of("user:2")]
            && [&single, &series, &batch, &explained].into_iter().all(fresh);
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "answers never said they were fresh: {single} / {series} / {batch} / {explained}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The CLI reads with a bound alike.
    let (ok, out) = sandbox.cli(&["query", "user:2", "views", "--max-staleness-ms", "2000"]);
    let printed: Value = serde_json::from_str(out.trim()).unwrap_or_default();
    assert!(ok && printed["value"] == 3 && fresh(&printed), "{out}");
    for bad in ["-1", "3600001", "soon"] {
        let (status, body) = sandbox.get(&format!("/v1/counters/user:2/views?max_staleness_ms={bad}")).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }

    // The counter paused: a bounded read answers 503 too_stale within its bound, and
    // the next at once, without asking the silent counter.
    sandbox.signal("tally-counter", libc::SIGSTOP);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let bounded = "/v1/counters/user:2/views?max_staleness_ms=500";
    let started = Instant::now();
    let (status, body) = sandbox.get(bounded).await;
    let first = started.elapsed();
    assert_eq!((status, body["error"]["code"].as_str()), (503, Some("too_stale")), "{body}");
    assert!(first < Duration::from_millis(1_500), "the first stale read took {first:?}");
    let started = Instant::now();
    let (status, body) = sandbox.get(bounded).await;
    let next = started.elapsed();
    assert_eq!((status, body["error"]["code"].as_str()), (503, Some("too_stale")), "{body}");
    assert!(next < Duration::from_millis(200), "the next stale read took {next:?}: {body}");
    println!("a stale read refused in {first:?}, the next in {next:?}");

    // A write while it is paused: a read with its token waits at most max_wait_ms and
    // answers 504 with how far it got.
    let (ok, token) = sandbox.cli(&["produce", "--print-token", "increment", "user:2", "views"]);
    let token = token.trim().to_string();
    assert!(ok && WriteToken::decode(&token).is_ok(), "{token}");
    let after = format!("/v1/counters/user:2/views?kind=direct&after={token}&max_wait_ms=200");
    let started = Instant::now();
    let (status, body) = sandbox.get(&after).await;
    let waited = started.elapsed();
    assert_eq!((status, body["error"]["code"].as_str()), (504, Some("not_fresh_enough")), "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    let waited_ms: u64 = message.split(" ms").next().and_then(|m| m.rsplit(' ').next()?.parse().ok()).unwrap_or(0);
    assert!(waited_ms >= 200 && message.contains(&format!("shard {}", shard_of("user:2"))), "{message}");
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_millis(1_500), "{waited:?}");

    // Resumed, it answers fresh again, the write included once the token is held.
    sandbox.signal("tally-counter", libc::SIGCONT);
    let (status, body) = sandbox.get(&after.replace("max_wait_ms=200", "max_wait_ms=30000")).await;
    let written = WriteToken::decode(&token).unwrap();
    let through: Vec<WriteToken> = body["as_of"][0]["through"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| WriteToken::decode(t.as_str()?).ok())
        .collect();
    assert_eq!((status, &body["value"]), (200, &json!(4)), "{body}");
    assert!(
        through
            .iter()
            .any(|t| t.topic == written.topic && t.partition == written.partition && t.offset >= written.offset),
        "{body}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = sandbox.get(bounded).await;
        if status == 200 && fresh(&body) {
            break;
        }
        assert!(Instant::now() < deadline, "never fresh again: {status} {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
