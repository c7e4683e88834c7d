//! Numbers nobody may push past their bounds: increments whose `delta` or `ts` lie
//! outside what tally keeps go to the dead-letter topic with their reasons (and
//! nothing of them is counted); leases, extends and retry delays past a queue's
//! maxima are refused with 400; guessed lease tokens ack nothing; counts that pass an
//! i64 read back exactly, through two levels of the graph.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};
use tally_core::model::Model;
use tally_core::wire::{DeadLetter, Increment};
use tally_e2e::{check, Sandbox};
use tally_shared::kafka::now_ms;

const TEN_YEARS_MS: i64 = 10 * 365 * 86_400_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn increments_beyond_their_bounds_are_dead_lettered_with_reasons() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-query"]).await;
    let now = now_ms();
    let in_2100 = 4_102_444_800_000i64;
    let too_old = now - 401 * 86_400_000;
    let max = 1i64 << 53;
    let elements = [
        json!({"entity": "e", "metric": "m", "delta": max, "ts": now}),
        json!({"entity": "e", "metric": "m", "delta": -max, "ts": now - 399 * 86_400_000}),
        json!({"entity": "e", "metric": "m", "delta": max + 1, "ts": now}),
        json!({"entity": "e", "metric": "m", "delta": i64::MIN, "ts": now}),
        json!({"entity": "e", "metric": "m", "delta": 5, "ts": in_2100}),
        json!({"entity": "e", "metric": "m", "delta": 7, "ts": too_old}),
        json!({"entity": "e", "metric": "m", "delta": 3, "ts": now}),
    ];
    let records: Vec<(Option<String>, Vec<u8>)> =
        elements.iter().map(|element| (Some("e".to_string()), element.to_string().into_bytes())).collect();
    sandbox.produce_to(&sandbox.names.increments(), &records).await;

    let letters: Vec<DeadLetter> = sandbox
        .read_topic(&sandbox.names.dead_letter(), 4, Duration::from_secs(60))
        .iter()
        .map(|raw| serde_json::from_slice(raw).expect("dead letters are JSON"))
        .collect();
    let mut reasons: Vec<(String, String)> = letters
        .iter()
        .map(|letter| {
            let payload = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &letter.payload).unwrap();
            (String::from_utf8(payload).unwrap(), letter.reason.clone())
        })
        .collect();
    reasons.sort();
    let mut expected = vec![
        (elements[2].to_string(), format!("delta: {} is beyond ±{max} (ingester.max_abs_delta)", max + 1)),
        (elements[3].to_string(), format!("delta: {} is beyond ±{max} (ingester.max_abs_delta)", i64::MIN)),
        (
            elements[4].to_string(),
            format!("ts: {in_2100} is more than 1h ahead of the ingester's clock (ingester.max_future_ms)"),
        ),
        (
            elements[5].to_string(),
            format!("ts: {too_old} is older than the longest retention (400d): no bucket keeps it"),
        ),
    ];
    expected.sort();
    assert_eq!(reasons, expected);

    let mut model = Model::default();
    for element in [&elements[0], &elements[1], &elements[6]] {
        let (delta, ts) = (element["delta"].as_i64().unwrap(), element["ts"].as_i64().unwrap());
        model.apply(Increment { entity: "e".into(), metric: "m".into(), delta, ts, id: None });
    }
    let (entities, metrics) = (vec!["e".to_string()], vec!["m".to_string()]);
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(60)).await;
    check::windows(&sandbox, &model, &entities, &metrics).await;
}

/// 4 096 increments of the largest delta (2^53) sum to 2^65: past an i64, counted
/// exactly in the entity and, two levels on through the graph, in every total
/// (each on its own shard where the topic has several: the sums cross shards),
/// in every window, series, listing and contributors answer, and in the rollups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_past_an_i64_are_exact_everywhere() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-graph", "tally-query"]).await;
    let shards = sandbox.partition_count(&sandbox.names.shards());
    // leaf → mid → top: leaf's increments count in mid's and top's totals.
    let mut names: Vec<String> = Vec::new();
    for i in 0.. {
        let name = format!("node:{i}");
        let shard = tally_core::sharding::shard_of(&name, shards);
        if names.iter().all(|n| tally_core::sharding::shard_of(n, shards) != shard) || shards < 3 {
            names.push(name);
        }
        if names.len() == 3 {
            break;
        }
    }
    let (leaf, mid, top) = (&names[0], &names[1], &names[2]);
    let mut model = Model::default();
    let edges: Vec<(Option<String>, Vec<u8>)> = [(leaf, mid), (mid, top)]
        .iter()
        .map(|(from, to)| {
            model.apply_edge(true, from, to, None);
            (Some(from.to_string()), json!({"op": "add_edge", "from": from, "to": to}).to_string().into_bytes())
        })
        .collect();
    sandbox.produce_to(&sandbox.names.graph(), &edges).await;

    let max = 1i64 << 53;
    let now = now_ms();
    let mut records = Vec::new();
    for batch in 0..8 {
        // Half now, half two hours ago: two hourly buckets, one daily.
        let ts = if batch % 2 == 0 { now } else { now - 2 * 3_600_000 };
        let elements: Vec<Value> =
            (0..512).map(|_| json!({"entity": leaf, "metric": "views", "delta": max, "ts": ts})).collect();
        for _ in 0..512 {
            model.apply(Increment { entity: leaf.clone(), metric: "views".into(), delta: max, ts, id: None });
        }
        records.push((Some(leaf.clone()), Value::Array(elements).to_string().into_bytes()));
    }
    sandbox.produce_to(&sandbox.names.increments(), &records).await;

    let (entities, metrics) = (names.clone(), vec!["views".to_string()]);
    assert_eq!(model.metrics(top)["views"], (0, 4_096 * i128::from(max)), "2^65 in top's total");
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, &model, &entities, &metrics).await;
    check::series(&sandbox, &model, &entities, &metrics).await;
    check::listings(&sandbox, &model, &entities).await;
    check::contributors(&sandbox, &model, &entities, &metrics).await;

    // The rollups: the latest all-time record of each counter holds its exact counts.
    let want: BTreeMap<String, (i128, i128)> =
        entities.iter().map(|e| (e.clone(), model.metrics(e)["views"])).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut latest: BTreeMap<String, (i128, i128)> = BTreeMap::new();
    while latest != want && std::time::Instant::now() < deadline {
        let rollups = sandbox.latest_rollups(Duration::from_secs(3));
        latest = rollups
            .live()
            .filter(|(_, rollup)| rollup.resolution == "all")
            .map(|(_, rollup)| (rollup.entity.clone(), (rollup.direct, rollup.total)))
            .collect();
    }
    assert_eq!(latest, want, "the latest all-time rollup of every counter");
}

/// A 5 000-node chain fits a `graph.max_descendants` lowered to 4 999 (its head has
/// 4 999 descendants); one more edge at its tail would give the head 5 000: it is
/// dead-lettered with its reason, and the graph and every total stay as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_past_max_descendants_is_dead_lettered_and_changes_nothing() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn_instance("tally-graph", "tally-graph", |config| config.graph.max_descendants = 4999);
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-query"]).await;
    let node = |i: usize| format!("c:{i}");
    let mut model = Model::default();
    let now = now_ms();
    let mut increments = Vec::new();
    for (i, delta) in [(0, 5), (2_500, 7), (4_999, 11)] {
        model.apply(Increment { entity: node(i), metric: "views".into(), delta, ts: now, id: None });
        let element = json!({"entity": node(i), "metric": "views", "delta": delta, "ts": now});
        increments.push((Some(node(i)), element.to_string().into_bytes()));
    }
    sandbox.produce_to(&sandbox.names.increments(), &increments).await;
    let edges: Vec<Value> = (0..4_999)
        .map(|i| {
            model.apply_edge(true, &node(i), &node(i + 1), None);
            json!({"op": "add_edge", "from": node(i), "to": node(i + 1)})
        })
        .collect();
    let records: Vec<(Option<String>, Vec<u8>)> = edges
        .chunks(500)
        .map(|chunk| (Some("chain".to_string()), Value::Array(chunk.to_vec()).to_string().into_bytes()))
        .collect();
    sandbox.produce_to(&sandbox.names.graph(), &records).await;
    let entities: Vec<String> =
        [0, 1, 2_500, 4_998, 4_999].map(node).into_iter().chain(["beyond".to_string()]).collect();
    let metrics = vec!["views".to_string()];
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(180)).await;

    // The chain is in: the edge past the bound comes after it.
    let past = json!({"op": "add_edge", "from": node(4_999), "to": "beyond", "id": "past"});
    sandbox.produce_to(&sandbox.names.graph(), &[(Some(node(4_999)), past.to_string().into_bytes())]).await;
    let letters: Vec<DeadLetter> = sandbox
        .read_topic(&sandbox.names.dead_letter(), 1, Duration::from_secs(60))
        .iter()
        .map(|raw| serde_json::from_slice(raw).expect("dead letters are JSON"))
        .collect();
    let got: Vec<(String, String)> = letters
        .iter()
        .map(|letter| {
            let payload = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &letter.payload).unwrap();
            (serde_json::from_slice::<Value>(&payload).unwrap().to_string(), letter.reason.clone())
        })
        .collect();
    let reason =
        "add_edge c:4999 -> beyond: c:0's descendants would pass 4999 (graph.max_descendants); the graph is unchanged";
    assert_eq!(got, vec![(past.to_string(), reason.to_string())]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Given the time a wrong descendant change would take to show: nothing changed.
    // The tail has no descendant, `beyond` no ancestor, every total
    // is the chain's (and would not be, had the edge counted).
    for (entity, direction) in [(node(4_999), "descendants"), ("beyond".to_string(), "ancestors")] {
        let (status, body) =
            sandbox.get(&format!("/v1/graph/{}?direction={direction}", tally_e2e::encode(&entity))).await;
        assert_eq!((status, &body["entities"]), (200, &json!([])), "{entity} {direction}");
    }
    let mut wrong = model.clone();
    wrong.apply_edge(true, &node(4_999), "beyond", None);
    assert!(check::all_time(&sandbox, &wrong, &entities, &metrics).await.is_err(), "the edge would show");
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(10)).await;
    check::windows(&sandbox, &model, &entities, &metrics).await;
}

async fn post(url: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new().post(url).json(&body).send().await.expect("POST");
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

/// The code of an error answer, with its status.
fn refused(answer: (u16, Value)) -> (u16, Option<String>) {
    (answer.0, answer.1["error"]["code"].as_str().map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_delays_past_the_queues_maxima_and_guessed_leases_are_refused() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare("[[queue]]\nname = \"bounded\"\npartitions = 1\nmax_lease_ms = 600000\n").await;
    let jobs: Vec<(Option<String>, Vec<u8>)> = (0..2)
        .map(|i| (Some("k".to_string()), json!({"id": format!("j{i}"), "payload": i}).to_string().into_bytes()))
        .collect();
    sandbox.produce_to(&sandbox.names.jobs("bounded"), &jobs).await;
    let broker = sandbox.spawn_broker("broker", &declarations);
    let queue = format!("{broker}/v1/queues/bounded");

    // A ten-year lease is refused before anything is handed out.
    let started = std::time::Instant::now();
    let ten_years = loop {
        let sent = reqwest::Client::new()
            .post(format!("{queue}/dequeue"))
            .json(&json!({"max": 2, "lease_ms": TEN_YEARS_MS}))
            .send()
            .await;
        match sent {
            Ok(response) if response.status() != 404 => {
                break (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
            }
            _ => {
                assert!(started.elapsed() < Duration::from_secs(60), "the broker never served the queue");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(refused(ten_years), (400, Some("invalid_lease".into())));
    let mut leased = Vec::new();
    while leased.len() < 2 {
        assert!(started.elapsed() < Duration::from_secs(60), "handed out {leased:?}");
        let (status, body) =
            post(&format!("{queue}/dequeue"), json!({"max": 2, "lease_ms": 600_000, "wait_ms": 500})).await;
        assert_eq!(status, 200, "{body}");
        leased.extend(body["jobs"].as_array().cloned().unwrap_or_default());
    }
    let lease = |i: usize| leased[i]["lease"].as_str().unwrap().to_string();

    let extend = post(&format!("{queue}/extend"), json!({"lease": lease(0), "lease_ms": TEN_YEARS_MS})).await;
    assert_eq!(refused(extend), (400, Some("invalid_lease".into())));
    let retry = post(&format!("{queue}/nack"), json!({"lease": lease(0), "retry_in_ms": TEN_YEARS_MS})).await;
    assert_eq!(refused(retry), (400, Some("invalid_retry".into())));

    // 10 000 guesses around the first job's lease: its neighbours' numbers with its
    // tag, and its numbers with other tags. None acks anything.
    let real = lease(0);
    let (fields, tag) = real.rsplit_once('.').unwrap();
    let numbers: Vec<&str> = fields.splitn(3, '.').collect();
    let (partition, number, instance) = (numbers[0], numbers[1].parse::<u64>().unwrap(), numbers[2]);
    let guesses: Vec<String> = (0..10_000u64)
        .map(|i| match i % 2 {
            0 => format!("{partition}.{}.{instance}.{tag}", number.wrapping_add(i / 2).wrapping_sub(2_500)),
            _ => format!(
                "{fields}.{:032x}",
                u128::from_str_radix(tag, 16).unwrap() ^ (u128::from(i) << 64 | u128::from(i))
            ),
        })
        .filter(|guess| *guess != real)
        .collect();
    assert_eq!(guesses.len(), 9_999);
    for chunk in guesses.chunks(1_000) {
        let (status, body) = post(&format!("{queue}/ack"), json!({"leases": chunk})).await;
        assert_eq!((status, &body["acked"]), (200, &json!(0)), "{body}");
    }
    // Both jobs are still leased, and their real leases finish them.
    let (status, body) = post(&format!("{queue}/ack"), json!({"leases": [lease(0), lease(1)]})).await;
    assert_eq!((status, body), (200, json!({"acked": 2, "unknown": []})));
}
