//! The Grafana dashboards (`deploy/grafana/*.json`) against a real Prometheus
//! (Debian's) scraping the real services — ingester, counter, tally-query, a dequeue
//! broker and a worker — after a workload of increments, a refused element, reads and
//! jobs: every query of every panel of every dashboard returns a finite value. Each dashboard
//! reads its Prometheus through the `datasource` variable, so it imports anywhere.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tally_e2e::prometheus::Prometheus;
use tally_e2e::Sandbox;
use tally_shared::local_broker::free_port;

const QUEUES: &str = r#"
[[queue]]
name = "work"
partitions = 2
"#;

/// Every dashboard file: its name and its JSON.
fn dashboards() -> Vec<(String, Value)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let dashboard = serde_json::from_str(&text).unwrap_or_else(|err| panic!("{name}: {err}"));
            (name, dashboard)
        })
        .collect()
}

/// Every panel query: (dashboard, panel title, PromQL).
fn queries(dashboards: &[(String, Value)]) -> Vec<(String, String, String)> {
    let mut all = Vec::new();
    for (name, dashboard) in dashboards {
        for panel in dashboard["panels"].as_array().unwrap() {
            let title = panel["title"].as_str().unwrap().to_string();
            let targets = panel["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{name}: panel {title} has no query");
            for target in targets {
                let expr = target["expr"].as_str().unwrap_or_else(|| panic!("{name}: {title}: no expr"));
                all.push((name.clone(), title.clone(), expr.to_string()));
            }
        }
    }
    all
}

#[test]
fn every_dashboard_reads_its_datasource_variable_and_has_unique_panels() {
    let dashboards = dashboards();
    let names: Vec<&str> = dashboards.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, vec!["tally-overview.json", "tally-queues.json", "tally-shards.json"]);
    let mut uids = BTreeSet::new();
    for (name, dashboard) in &dashboards {
        assert!(uids.insert(dashboard["uid"].as_str().unwrap().to_string()), "{name}: uid repeated");
        let variables = dashboard["templating"]["list"].as_array().unwrap();
        assert!(variables.iter().any(|v| v["name"] == "datasource" && v["type"] == "datasource"), "{name}");
        let panels = dashboard["panels"].as_array().unwrap();
        let ids: BTreeSet<u64> = panels.iter().map(|panel| panel["id"].as_u64().unwrap()).collect();
        assert_eq!(ids.len(), panels.len(), "{name}: panel ids repeated");
        for panel in panels {
            let uses = json!({"type": "prometheus", "uid": "${datasource}"});
            assert_eq!(panel["datasource"], uses, "{name}: {}", panel["title"]);
            assert!(panel["description"].as_str().is_some_and(|d| !d.is_empty()), "{name}: {}", panel["title"]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_query_returns_data_from_a_live_deployment() {
    let mut sandbox = Sandbox::start().await;
    for service in ["tally-ingester", "tally-counter", "tally-query"] {
        sandbox.spawn(service);
    }
    let declarations = sandbox.declare(QUEUES).await;
    let broker_admin = format!("127.0.0.1:{}", free_port().unwrap());
    let admin = broker_admin.clone();
    let broker = sandbox.spawn_broker_with("broker-a", &declarations, move |config| config.broker.admin_listen = admin);
    let worker_admin = format!("127.0.0.1:{}", free_port().unwrap());
    let admin = worker_admin.clone();
    sandbox.spawn_instance("worker", "tally-worker", move |config| {
        config.worker.brokers = vec![broker];
        config.worker.queue = "work".into();
        config.worker.command = Some(vec!["true".into()]);
        config.worker.admin_listen = admin;
    });
    sandbox.wait_ready("tally-counter", Duration::from_secs(60)).await;

    let mut targets: Vec<(&str, String)> = ["tally-ingester", "tally-counter", "tally-query"]
        .into_iter()
        .map(|name| (name, sandbox.admin_addr(name)))
        .collect();
    targets.extend([("tally-broker", broker_admin), ("tally-worker", worker_admin)]);
    let rules = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/tally-rules.yaml");
    let prometheus = Prometheus::start(sandbox.dir.path(), &targets, &rules, Duration::from_secs(1)).await;

    // The workload: increments, one element the ingester refuses, reads, jobs.
    let ts = tally_shared::kafka::now_ms();
    let mut records: Vec<(Option<String>, Vec<u8>)> = (0..200)
        .map(|i| {
            let entity = format!("user:{}", i % 20);
            (Some(entity.clone()), json!({"entity": entity, "metric": "views", "ts": ts}).to_string().into_bytes())
        })
        .collect();
    records.push((Some("bad".into()), json!({"entity": "", "metric": "views"}).to_string().into_bytes()));
    sandbox.produce_to(&sandbox.names.increments(), &records).await;
    let jobs: Vec<(Option<String>, Vec<u8>)> = (0..20)
        .map(|i| (Some(format!("j{i}")), json!({"id": format!("j{i}"), "payload": {"n": i}}).to_string().into_bytes()))
        .collect();
    sandbox.produce_to(&sandbox.names.jobs("work"), &jobs).await;

    let all = queries(&dashboards());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        // Increments and reads keep coming, so the histograms have a rate.
        let ts = tally_shared::kafka::now_ms();
        let more = json!({"entity": "user:1", "metric": "views", "ts": ts}).to_string().into_bytes();
        sandbox.produce_to(&sandbox.names.increments(), &[(Some("user:1".into()), more)]).await;
        for i in 0..5 {
            sandbox.get(&format!("/v1/counters/user:{i}/views")).await;
        }
        sandbox.post("/v1/query", &json!({"queries": [{"entity": "user:1", "metric": "views"}]})).await;
        let mut empty = Vec::new();
        for (dashboard, panel, expr) in &all {
            // Data: a series with a number (a quantile of no observations is NaN).
            if !prometheus.query(expr).await.iter().any(|(_, value)| value.is_finite()) {
                empty.push(format!("{dashboard}: {panel}: {expr}"));
            }
        }
        if empty.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "panel queries without data after 120 s:\n{}", empty.join("\n"));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!("{} panel queries over {} dashboards return data", all.len(), dashboards().len());

    // Every consuming service says its lag in seconds per group and partition; the
    // broker for each partition of each queue it serves.
    let lag = r#"count by (job) ({__name__=~"tally_(ingester|counter|graph|broker)_consumer_lag_seconds"})"#;
    let jobs: BTreeSet<String> =
        prometheus.query(lag).await.iter().map(|(labels, _)| labels["job"].as_str().unwrap().to_string()).collect();
    assert_eq!(jobs, BTreeSet::from(["tally-broker", "tally-counter", "tally-ingester"].map(String::from)));
    let partitions: BTreeSet<(String, String)> = prometheus
        .query("tally_broker_consumer_lag_seconds")
        .await
        .iter()
        .map(|(labels, _)| (labels["queue"].as_str().unwrap().into(), labels["partition"].as_str().unwrap().into()))
        .collect();
    let want: BTreeSet<(String, String)> = [("default", 4), ("work", 2)]
        .iter()
        .flat_map(|&(queue, count)| (0..count).map(move |p| (queue.to_string(), p.to_string())))
        .collect();
    assert_eq!(partitions, want);
}
