//! Random producer workloads with their expected outcome: arrays and single objects,
//! out-of-order and missing timestamps, retried ids, malformed input of many kinds,
//! and (optionally) graph updates interleaved with the increments — edge adds and
//! removals with chains, diamonds, cycles and re-adds — together with the
//! brute-force model of what must be counted.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tally_core::model::Model;
use tally_core::wire::Increment;

/// One producer record.
#[derive(Debug, Clone)]
pub struct Record {
    /// A graph message (for `tally.graph`, keyed by `from`) rather than increments.
    pub graph: bool,
    pub key: String,
    pub payload: Vec<u8>,
    /// The record's timestamp (the event time of increments without `ts`).
    pub timestamp: i64,
}

pub struct Workload {
    pub records: Vec<Record>,
    pub model: Model,
    /// Rejected elements and messages: each must appear in the dead-letter topic.
    pub rejections: usize,
    pub entities: Vec<String>,
    pub metrics: Vec<String>,
}

const BAD_ELEMENTS: [&str; 10] = [
    r#"{"entity":"user:1","metric":"Bad Metric"}"#,
    r#"{"entity":"tab\there","metric":"views"}"#,
    r#"{"entity":"user:1","metric":"views","delta":"one"}"#,
    r#"{"entity":"user:1","metric":"views","delta":1.5}"#,
    r#"{"entity":"user:1","metric":"views","colour":"red"}"#,
    r#"{"entity":"user:1","metric":"views","id":""}"#,
    r#"{"entity":"user:1","metric":"views","ts":-5}"#,
    r#"{"metric":"views"}"#,
    r#""just a string""#,
    r#"{"entity":"","metric":"views"}"#,
];

const BAD_GRAPH_ELEMENTS: [&str; 4] = [
    r#"{"op":"add_edge","from":"user:1","to":"user:1"}"#,
    r#"{"op":"link","from":"user:1","to":"user:2"}"#,
    r#"{"op":"add_edge","from":"user:1"}"#,
    r#"{"op":"remove_edge","from":"","to":"user:2"}"#,
];

const BAD_MESSAGES: [&[u8]; 6] = [b"not json at all", b"42", b"[{\"entity\":", b"", b"null", b"\xff\xfe{}"];

impl Workload {
    /// What this workload and then `after` (increments only) lead to: the model,
    /// and every entity and metric of either.
    pub fn then(&self, after: &Workload) -> (Model, Vec<String>, Vec<String>) {
        let mut model = self.model.clone();
        for increment in after.model.events() {
            model.apply(increment.clone());
        }
        let mut entities = self.entities.clone();
        entities.extend(after.entities.iter().filter(|e| !self.entities.contains(e)).cloned());
        let mut metrics = self.metrics.clone();
        metrics.extend(after.metrics.iter().filter(|m| !self.metrics.contains(m)).cloned());
        (model, entities, metrics)
    }

    /// `messages` records of increments around `now`, deterministic for a `seed`.
    pub fn generate(seed: u64, messages: usize, now: i64) -> Self {
        Self::generate_mixed(seed, messages, now, 0.0)
    }

    /// Like [`Workload::generate`], with a `graph_share` of the records graph messages.
    pub fn generate_mixed(seed: u64, messages: usize, now: i64, graph_share: f64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let entities: Vec<String> =
            (0..24).map(|i| format!("user:{i}")).chain(["ünï:1".to_string(), "a/b c".to_string()]).collect();
        let metrics: Vec<String> = ["views", "clicks", "a.b:c-d_1"].iter().map(|s| s.to_string()).collect();
        let mut model = Model::default();
        let mut records = Vec::with_capacity(messages);
        let mut rejections = 0;
        let mut sent_with_ids: Vec<Value> = Vec::new();
        let mut next_id = 0u64;
        let mut graph_ids: Vec<Value> = Vec::new();
        for index in 0..messages {
            let timestamp = now - rng.random_range(0..60_000);
            if rng.random_bool(graph_share) {
                let (record, rejected) =
                    graph_record(&mut rng, &entities, &mut model, &mut graph_ids, seed, index, timestamp);
                rejections += rejected;
                records.push(record);
                continue;
            }
            if rng.random_bool(0.05) {
                rejections += 1;
                let payload = BAD_MESSAGES[rng.random_range(0..BAD_MESSAGES.len())].to_vec();
                records.push(Record { graph: false, key: format!("k{index}"), payload, timestamp });
                continue;
            }
            let count = if rng.random_bool(0.3) { 1 } else { rng.random_range(1..20) };
            let mut elements: Vec<String> = Vec::with_capacity(count);
            for _ in 0..count {
                if rng.random_bool(0.06) {
                    rejections += 1;
                    elements.push(BAD_ELEMENTS[rng.random_range(0..BAD_ELEMENTS.len())].to_string());
                    continue;
                }
                if !sent_with_ids.is_empty() && rng.random_bool(0.05) {
                    // A producer retry: the same element again, same id.
                    let copy = sent_with_ids[rng.random_range(0..sent_with_ids.len())].clone();
                    model.apply(to_increment(&copy, timestamp));
                    elements.push(copy.to_string());
                    continue;
                }
                let entity = &entities[skewed(&mut rng, entities.len())];
                let metric = &metrics[rng.random_range(0..metrics.len())];
                let mut element = json!({"entity": entity, "metric": metric});
                if rng.random_bool(0.8) {
                    element["delta"] = rng.random_range(-3i64..10).into();
                }
                if rng.random_bool(0.8) {
                    // Out of order, up to three days back: crosses every resolution.
                    element["ts"] = (now - rng.random_range(0..3 * 86_400_000i64)).into();
                }
                if rng.random_bool(0.3) {
                    // Retries carry their own ts, so every copy lands in one bucket.
                    element["ts"] = element.get("ts").cloned().unwrap_or_else(|| timestamp.into());
                    next_id += 1;
                    element["id"] = format!("evt-{seed}-{next_id}").into();
                    sent_with_ids.push(element.clone());
                }
                model.apply(to_increment(&element, timestamp));
                elements.push(element.to_string());
            }
            // A lone element goes out as itself half the time; rejected alone it is a
            // whole-message rejection, still one dead letter.
            let payload = if elements.len() == 1 && rng.random_bool(0.5) {
                elements.remove(0)
            } else {
                format!("[{}]", elements.join(","))
            };
            records.push(Record { graph: false, key: format!("k{index}"), payload: payload.into_bytes(), timestamp });
        }
        Self { records, model, rejections, entities, metrics }
    }
}

/// A graph message: edge updates from one `from` entity (producers key graph
/// messages by `from`, so one entity's updates stay in order), some bad elements,
/// some retried ids. Returns the record and how many elements it rejects.
fn graph_record(
    rng: &mut StdRng,
    entities: &[String],
    model: &mut Model,
    sent_with_ids: &mut Vec<Value>,
    seed: u64,
    index: usize,
    timestamp: i64,
) -> (Record, usize) {
    // Mostly "down" a hierarchy (higher index → lower index), sometimes up: cycles.
    let from_index = rng.random_range(1..entities.len());
    let from = &entities[from_index];
    let mut elements = Vec::new();
    let mut rejected = 0;
    for n in 0..rng.random_range(1..4) {
        if rng.random_bool(0.1) {
            rejected += 1;
            elements.push(BAD_GRAPH_ELEMENTS[rng.random_range(0..BAD_GRAPH_ELEMENTS.len())].to_string());
            continue;
        }
        let retry = sent_with_ids.iter().filter(|e| e["from"] == from.as_str()).cloned().collect::<Vec<_>>();
        if !retry.is_empty() && rng.random_bool(0.1) {
            let copy = retry[rng.random_range(0..retry.len())].clone();
            apply_edge(model, &copy);
            elements.push(copy.to_string());
            continue;
        }
        let to_index =
            if rng.random_bool(0.85) { rng.random_range(0..from_index) } else { rng.random_range(0..entities.len()) };
        if to_index == from_index {
            continue;
        }
        let op = if rng.random_bool(0.7) { "add_edge" } else { "remove_edge" };
        let mut element = json!({"op": op, "from": from, "to": entities[to_index]});
        if rng.random_bool(0.3) {
            element["id"] = format!("g-{seed}-{index}-{n}").into();
            sent_with_ids.push(element.clone());
        }
        apply_edge(model, &element);
        elements.push(element.to_string());
    }
    let payload = if elements.len() == 1 { elements.remove(0) } else { format!("[{}]", elements.join(",")) };
    if payload.is_empty() || payload == "[]" {
        // Nothing left (a skipped self-loop): send a harmless removal instead.
        let element = json!({"op": "remove_edge", "from": from, "to": "nobody"});
        apply_edge(model, &element);
        return (
            Record { graph: true, key: from.clone(), payload: element.to_string().into_bytes(), timestamp },
            rejected,
        );
    }
    (Record { graph: true, key: from.clone(), payload: payload.into_bytes(), timestamp }, rejected)
}

fn apply_edge(model: &mut Model, element: &Value) {
    let text = |field: &str| element[field].as_str().unwrap_or_default().to_string();
    model.apply_edge(
        element["op"] == "add_edge",
        &text("from"),
        &text("to"),
        element.get("id").and_then(Value::as_str),
    );
}

/// Picks an index with a skew towards the first ones.
fn skewed(rng: &mut StdRng, n: usize) -> usize {
    let x: f64 = rng.random::<f64>();
    ((x * x) * n as f64) as usize % n
}

fn to_increment(element: &Value, record_ts: i64) -> Increment {
    Increment {
        entity: element["entity"].as_str().unwrap_or_default().to_string(),
        metric: element["metric"].as_str().unwrap_or_default().to_string(),
        delta: element.get("delta").and_then(Value::as_i64).unwrap_or(1),
        ts: element.get("ts").and_then(Value::as_i64).unwrap_or(record_ts),
        id: element.get("id").and_then(Value::as_str).map(str::to_string),
    }
}
