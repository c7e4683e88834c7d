//! Segmented counters through the real services: increments with three dimensions of
//! 50 values each, on answers that roll up to users and a team, with the counter
//! killed (-9) mid-way. Every filter, wildcard and breakdown — of windows and series,
//! direct and total — equals the model's; a breakdown is one query to the shard that
//! holds the entity; bad segments are dead letters and bad segment queries 400s.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tally_core::keys::Count;
use tally_core::model::Model;
use tally_core::segments::{Dimensions, Selector};
use tally_core::time::{parse_duration, Resolutions, WindowSpec};
use tally_core::wire::{Increment, Kind};
use tally_e2e::workload::Record;
use tally_e2e::{check, encode, Sandbox};

const DIMENSIONS: [&str; 3] = ["country", "state", "device"];
/// Combinations an origin's metric keeps here: some answers pass it.
const MAX_COMBINATIONS: u32 = 60;

fn value(dimension: &str, index: u32) -> String {
    format!("{}-{index}", &dimension[..2])
}

fn dimensions() -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([("views".to_string(), DIMENSIONS.iter().map(|d| d.to_string()).collect())])
}

/// A read's selector and the query parameters that ask for it.
struct Case {
    selector: Selector,
    params: String,
}

fn case(filters: &[(&str, Option<&str>)], by: Option<&str>) -> Case {
    let mut params: Vec<String> =
        filters.iter().map(|(d, v)| format!("segment.{d}={}", encode(v.unwrap_or("*")))).collect();
    if let Some(by) = by {
        params.push(format!("by={by}&limit=1000"));
    }
    Case {
        selector: Selector {
            filters: filters.iter().map(|(d, v)| (d.to_string(), v.map(str::to_string))).collect(),
            by: by.map(str::to_string),
        },
        params: params.join("&"),
    }
}

fn count(value: &Value) -> Count {
    Count::from(value.as_i64().unwrap_or_else(|| panic!("not a count: {value}")))
}

/// Every case's window answer (direct and total) for `entity` against the model.
async fn check_windows(sandbox: &Sandbox, model: &Model, entity: &str, cases: &[Case]) -> Result<(), String> {
    let resolutions = Resolutions::default();
    for window in ["all", "1h", "7d"] {
        for kind in [Kind::Direct, Kind::Total] {
            for case in cases {
                let path = format!(
                    "/v1/counters/{}/views?window={window}&kind={}&{}",
                    encode(entity),
                    kind.as_str(),
                    case.params
                );
                let (status, body) = sandbox.get(&path).await;
                if status != 200 {
                    return Err(format!("{path}: {status} {body}"));
                }
                let to = body["to"].as_i64().unwrap();
                let spec = match window {
                    "all" => WindowSpec::All,
                    w => WindowSpec::Last { window_ms: parse_duration(w).unwrap() },
                };
                let plan = resolutions.plan(spec, to).unwrap();
                let (groups, overflow) = model.segment_sums(entity, "views", kind, &plan, &case.selector);
                let got: BTreeMap<String, Vec<Count>> = match case.selector.by {
                    None => BTreeMap::from([(String::new(), vec![count(&body["value"])])]),
                    Some(_) => body["breakdown"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|g| (g["segment"].as_str().unwrap().to_string(), vec![count(&g["value"])]))
                        .collect(),
                };
                if got != groups || count(&body["overflow"]) != overflow[0] {
                    return Err(format!(
                        "{path}: got {got:?} and {}, want {groups:?} and {overflow:?}",
                        body["overflow"]
                    ));
                }
            }
        }
    }
    Ok(())
}

/// A breakdown of a series by state, and a filtered one, against the model.
async fn check_series(sandbox: &Sandbox, model: &Model, entity: &str) -> Result<(), String> {
    let resolutions = Resolutions::default();
    for case in [case(&[], Some("state")), case(&[("device", Some(&value("device", 1)))], None)] {
        let path = format!("/v1/counters/{}/views/series?step=1h&range=24h&{}", encode(entity), case.params);
        let (status, body) = sandbox.get(&path).await;
        if status != 200 {
            return Err(format!("{path}: {status} {body}"));
        }
        let points =
            |points: &Value| -> Vec<Count> { points.as_array().unwrap().iter().map(|p| count(&p["value"])).collect() };
        let overflow = points(&body["overflow"]);
        let last_t = body["overflow"].as_array().and_then(|p| p.last()).map(|p| p["t"].as_i64().unwrap());
        let last_t = last_t.ok_or_else(|| format!("{path}: no point"))?;
        let spec = WindowSpec::Series { step_ms: 3_600_000, range_ms: 86_400_000 };
        let plan = resolutions.plan(spec, last_t).unwrap();
        let (groups, want_overflow) = model.segment_sums(entity, "views", Kind::Total, &plan, &case.selector);
        let got: BTreeMap<String, Vec<Count>> = match case.selector.by {
            None => BTreeMap::from([(String::new(), points(&body["points"]))]),
            Some(_) => body["series"]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| (g["segment"].as_str().unwrap().to_string(), points(&g["points"])))
                .collect(),
        };
        if got != groups || overflow != want_overflow {
            return Err(format!("{path}: got {got:?} / {overflow:?}, want {groups:?} / {want_overflow:?}"));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breakdowns_and_filters_equal_the_model_through_the_graph_and_a_kill9() {
    let mut sandbox = Sandbox::start().await;
    sandbox.config.counting.dimensions = dimensions();
    sandbox.config.counting.max_segment_combinations = MAX_COMBINATIONS;
    for service in ["tally-ingester", "tally-graph", "tally-counter", "tally-query"] {
        sandbox.spawn(service);
    }
    let declared = Dimensions::new(dimensions()).unwrap();
    let mut model = Model::with_max_combinations(MAX_COMBINATIONS);
    let now = tally_shared::kafka::now_ms();
    let answers: Vec<String> = (0..12).map(|i| format!("answer:{i}")).collect();
    let users: Vec<String> = (0..3).map(|i| format!("user:{i}")).collect();
    let mut entities: Vec<String> = answers.iter().chain(&users).cloned().collect();
    entities.push("team:0".into());
    // answers → users → team; answer:11's edge comes after its views.
    let edge = |from: &str, to: &str, add: bool, model: &mut Model| {
        model.apply_edge(add, from, to, None);
        let op = if add { "add_edge" } else { "remove_edge" };
        let payload = json!({"op": op, "from": from, "to": to}).to_string().into_bytes();
        Record { graph: true, key: from.to_string(), payload, timestamp: now }
    };
    let mut graph: Vec<Record> =
        answers[..11].iter().enumerate().map(|(i, a)| edge(a, &users[i % 3], true, &mut model)).collect();
    graph.extend(users.iter().map(|u| edge(u, "team:0", true, &mut model)));
    sandbox.produce(&graph).await;

    let mut rng = StdRng::seed_from_u64(56);
    let mut records = Vec::new();
    for _ in 0..300 {
        // Keyed by entity: which combinations pass the cap depends on their order,
        // which Kafka keeps within a partition.
        let entity = &answers[rng.random_range(0..answers.len())];
        let mut elements = Vec::new();
        for _ in 0..10 {
            let mut segments = serde_json::Map::new();
            for dimension in DIMENSIONS {
                if rng.random_bool(0.85) {
                    // Skewed: low values far more often, so combinations repeat.
                    let index = (rng.random_range(0.0f64..1.0).powi(3) * 50.0) as u32;
                    segments.insert(dimension.to_string(), value(dimension, index).into());
                }
            }
            let ts = now - rng.random_range(0..3 * 86_400_000i64);
            let delta = rng.random_range(1i64..5);
            let pairs: Vec<(&str, &str)> = segments.iter().map(|(d, v)| (d.as_str(), v.as_str().unwrap())).collect();
            let metric = declared.segmented("views", &pairs).unwrap().unwrap_or_else(|| "views".into());
            model.apply(Increment { entity: entity.clone(), metric, delta, ts, id: None });
            elements.push(json!({"entity": entity, "metric": "views", "delta": delta, "ts": ts, "segments": segments}));
        }
        let payload = Value::Array(elements).to_string().into_bytes();
        records.push(Record { graph: false, key: entity.clone(), payload, timestamp: now });
    }
    for (wave, chunk) in records.chunks(60).enumerate() {
        sandbox.produce(chunk).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if wave == 2 {
            sandbox.kill9("tally-counter");
            sandbox.spawn("tally-counter");
        }
    }
    // An edge after the views (its answer's combinations move up) and one removed.
    let late = [edge(&answers[11], &users[0], true, &mut model), edge(&answers[0], &users[0], false, &mut model)];
    sandbox.produce(&late).await;
    let metrics = vec!["views".to_string()];
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(180)).await;

    let state = value("state", 0);
    let cases = [
        case(&[], Some("state")),
        case(&[("country", Some(&value("country", 0)))], None),
        case(&[("country", Some(&value("country", 1))), ("device", None)], Some("device")),
        case(&[("state", None)], Some("country")),
        case(&[("state", Some(&state)), ("device", Some(&value("device", 0)))], None),
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for entity in &entities {
        loop {
            let checked = match check_windows(&sandbox, &model, entity, &cases).await {
                Ok(()) => check_series(&sandbox, &model, entity).await,
                failure => failure,
            };
            match checked {
                Ok(()) => break,
                Err(failure) if tokio::time::Instant::now() > deadline => panic!("{failure}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
    // The cap was reached somewhere, and said so.
    let overflows = sandbox.metric("tally-counter", "tally_counter_segment_overflows_total").await;
    assert!(overflows.iter().any(|(_, v)| *v > 0.0), "no overflow at a cap of {MAX_COMBINATIONS}: {overflows:?}");

    // A breakdown over every state of the team is one query to one shard.
    let queries = || async {
        let read = sandbox.metric("tally-counter", "tally_counter_read_queries_total").await;
        read.first().map_or(0.0, |(_, v)| *v)
    };
    let before = queries().await;
    let (status, body) = sandbox.get("/v1/counters/team:0/views?by=state&limit=1000").await;
    assert_eq!(status, 200, "{body}");
    let groups = body["breakdown"].as_array().unwrap().len();
    let plan = Resolutions::default().plan(WindowSpec::All, now).unwrap();
    let by_state = model.segment_sums("team:0", "views", Kind::Total, &plan, &case(&[], Some("state")).selector);
    assert_eq!(groups, by_state.0.len());
    assert!(groups >= 20, "a breakdown of {groups} states");
    assert_eq!(queries().await - before, 1.0, "{groups} states read as one query");

    // The command line asks the same, and writes a segmented increment.
    let (ok, out) = sandbox.cli(&["query", "team:0", "views", "--by", "state"]);
    let printed: Value = serde_json::from_str(out.trim()).unwrap_or_default();
    assert!(ok && printed["breakdown"] == body["breakdown"], "{out}");
    let device = value("device", 7);
    let segment = format!("device={device}");
    let (ok, out) = sandbox.cli(&[
        "produce",
        "--print-token",
        "increment",
        "cli:1",
        "views",
        "--delta",
        "4",
        "--segment",
        &segment,
    ]);
    assert!(ok, "{out}");
    let (ok, out) = sandbox.cli(&["query", "cli:1", "views", "--segment", &segment, "--after", out.trim()]);
    let printed: Value = serde_json::from_str(out.trim()).unwrap_or_default();
    assert!(ok && printed["value"] == 4 && printed["segments"]["device"] == device.as_str(), "{out}");

    // POST /v1/query answers the same as the GET.
    let (status, batch) = sandbox
        .post(
            "/v1/query",
            &json!({"queries": [{"entity": "team:0", "metric": "views", "by": "state"},
                                               {"entity": "team:0", "metric": "views", "segments": {"state": state}}]}),
        )
        .await;
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["results"][0]["breakdown"], body["breakdown"]);
    let (_, one) = sandbox.get(&format!("/v1/counters/team:0/views?segment.state={state}")).await;
    assert_eq!(batch["results"][1]["value"], one["value"]);

    // Bad segments are dead letters naming the field, bad queries 400s.
    let nine: serde_json::Map<String, Value> = (0..9).map(|i| (format!("d{i}"), "x".into())).collect();
    let bad = [
        json!({"entity": "answer:1", "metric": "views", "segments": {"colour": "red"}}),
        json!({"entity": "answer:1", "metric": "views", "segments": {"country": "x".repeat(65)}}),
        json!({"entity": "answer:1", "metric": "views", "segments": nine}),
        json!({"entity": "answer:1", "metric": "likes", "segments": {"country": "US"}}),
    ];
    let payload = Value::Array(bad.to_vec()).to_string().into_bytes();
    sandbox.produce(&[Record { graph: false, key: "bad".into(), payload, timestamp: now }]).await;
    // And the first increment past each origin's cap is a dead letter of its own.
    let all_time = Resolutions::default().plan(WindowSpec::All, now).unwrap();
    let mut overflowed: Vec<String> = answers
        .iter()
        .filter(|a| model.segment_sums(a, "views", Kind::Direct, &all_time, &Selector::default()).1[0] > 0)
        .map(|a| {
            format!(
                "segments: {a}'s views holds {MAX_COMBINATIONS} combinations (counting.max_segment_combinations): \
                 this one and every later new one count under its overflow"
            )
        })
        .collect();
    assert!(!overflowed.is_empty(), "no answer passed its cap");
    // A letter may go twice (a counter killed after sending it, before its store
    // forgot it, sends it again): at least once per origin.
    let reasons_of = |records: &[tally_e2e::ReadRecord]| -> (BTreeSet<String>, Vec<String>) {
        let reasons = records
            .iter()
            .map(|r| serde_json::from_slice::<Value>(&r.payload).unwrap()["reason"].as_str().unwrap().to_string());
        let (capped, mut others): (Vec<String>, Vec<String>) =
            reasons.partition(|reason| reason.contains("max_segment_combinations"));
        others.sort();
        (capped.into_iter().collect(), others)
    };
    overflowed.sort();
    let letters = sandbox.read_records(&sandbox.names.dead_letter(), Duration::from_secs(30), |records| {
        let (capped, others) = reasons_of(records);
        capped.len() >= overflowed.len() && others.len() >= 4
    });
    let (capped, reasons) = reasons_of(&letters);
    assert_eq!(capped.into_iter().collect::<Vec<_>>(), overflowed, "a letter per origin past its cap");
    assert_eq!(
        reasons,
        [
            "segments: at most 8 dimensions, not 9",
            "segments: country's value must be 1-64 bytes of UTF-8",
            "segments: metric likes declares no dimensions (counting.dimensions)",
            "segments: views has no dimension \"colour\"; it has country, state, device",
        ]
    );
    for (path, code) in [
        ("/v1/counters/team:0/views?segment.colour=red", "invalid_segment"),
        ("/v1/counters/team:0/views?by=colour", "invalid_segment"),
        ("/v1/counters/team:0/likes?by=state", "invalid_segment"),
        ("/v1/counters/team:0/views?limit=5", "invalid_parameter"),
        ("/v1/counters/team:0/views/series?by=state&page_token=bogus", "invalid_page_token"),
    ] {
        let (status, body) = sandbox.get(path).await;
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some(code)), "{path}: {body}");
    }
}
