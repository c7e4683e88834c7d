//! Probes of reads that must never go back in time: a counter per shard, only ever
//! incremented, read continuously; a value below one already read would be a stale
//! owner's answer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tally_core::sharding::shard_of;

/// Probe entities, at least one on every shard, that only ever grow.
pub fn probes(shards: u32) -> Vec<String> {
    let mut probes: Vec<String> = Vec::new();
    let mut covered = std::collections::BTreeSet::new();
    for k in 0.. {
        let probe = format!("probe:{k}");
        if covered.insert(shard_of(&probe, shards)) {
            probes.push(probe);
        }
        if covered.len() == shards as usize {
            break;
        }
    }
    probes
}

/// Reads the probes' direct all-time counts until `stop`; every answer must be at
/// least the value read before and at most what was produced. Returns the
/// violations and how many reads answered.
pub async fn watch_probes(
    sandbox_url: String,
    probes: Vec<String>,
    produced: Arc<Mutex<i64>>,
    stop: Arc<AtomicBool>,
) -> (Vec<String>, usize) {
    let client = reqwest::Client::new();
    let queries: Vec<_> =
        probes.iter().map(|p| json!({"entity": p, "metric": "hits", "window": "all", "kind": "direct"})).collect();
    let mut seen: BTreeMap<String, i64> = BTreeMap::new();
    let mut violations = Vec::new();
    let mut answered = 0;
    while !stop.load(Ordering::SeqCst) {
        let response = client
            .post(format!("{sandbox_url}/v1/query"))
            .json(&json!({ "queries": queries }))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        if let Some(response) = response.ok().filter(|r| r.status() == 200) {
            let body: serde_json::Value = response.json().await.unwrap_or_default();
            // Counted before it is produced: read after the answer, it bounds it.
            let ceiling = *produced.lock().unwrap();
            let results = body["results"].as_array().cloned().unwrap_or_default();
            if results.len() != probes.len() {
                violations.push(format!("{} results for {} probes: {body}", results.len(), probes.len()));
            }
            answered += 1;
            for (probe, result) in probes.iter().zip(results) {
                let Some(value) = result["value"].as_i64() else {
                    violations.push(format!("{probe}: no value in {result}"));
                    continue;
                };
                let before = seen.entry(probe.clone()).or_insert(0);
                if value < *before {
                    violations.push(format!("{probe}: read {value} after {before} (a stale owner)"));
                }
                if value > ceiling {
                    violations.push(format!("{probe}: read {value}, only {ceiling} produced"));
                }
                *before = (*before).max(value);
            }
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    (violations, answered)
}
