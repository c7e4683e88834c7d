//! The alerting rules in a real Prometheus (Debian's) scraping the real services: a
//! shard failed on purpose (bytes no tally wrote on its shard topic, as in
//! `fail_closed.rs`) fires `TallyShardFailed` within two evaluation intervals of the
//! counter reporting it, with the counter's readiness scraped as 0, and the alert
//! resolves once `tally shards skip` moved past the record; before the failure, no
//! alert fires. A paused counter (SIGSTOP: its own metrics go unscraped) fires
//! `TallyShardStale` for every shard it owns, from tally-query's view of their
//! staleness, and resolves once it runs again — with that rule's threshold and wait
//! scaled from a minute and five to seconds (promtool's unit tests cover the real ones).

use std::time::{Duration, Instant};

use serde_json::json;
use tally_core::sharding::shard_of;
use tally_e2e::prometheus::{Alert, Prometheus};
use tally_e2e::Sandbox;
use tally_shared::kafka::client_config;

const SHARDS: u32 = 8;
/// Prometheus's scrape and evaluation interval here.
const INTERVAL: Duration = Duration::from_secs(1);

/// Waits until `done` holds for Prometheus's alerts; panics with them after `within`.
async fn alerts_until(prometheus: &Prometheus, within: Duration, what: &str, done: impl Fn(&[Alert]) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let alerts = prometheus.alerts().await;
        if done(&alerts) {
            return;
        }
        assert!(Instant::now() < deadline, "{what} within {within:?}: {alerts:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn firing<'a>(alerts: &'a [Alert], name: &str) -> Vec<&'a Alert> {
    alerts.iter().filter(|alert| alert.name == name && alert.state == "firing").collect()
}

/// Shard numbers as labels, in numeric order.
fn in_shard_order(mut shards: Vec<String>) -> Vec<String> {
    shards.sort_by_key(|shard| shard.parse::<u32>().unwrap_or(u32::MAX));
    shards
}

const SERVICES: [&str; 3] = ["tally-ingester", "tally-counter", "tally-query"];

/// A sandbox running [`SERVICES`], ready, and a Prometheus scraping them every
/// [`INTERVAL`] that evaluates `rules` (a rule file's text) as often.
async fn scraped(rules: &str) -> (Sandbox, Prometheus) {
    let mut sandbox = Sandbox::start().await;
    for service in SERVICES {
        sandbox.spawn(service);
    }
    for service in ["tally-counter", "tally-query"] {
        sandbox.wait_ready(service, Duration::from_secs(60)).await;
    }
    let path = sandbox.dir.path().join("rules.yaml");
    std::fs::write(&path, rules).unwrap();
    let targets: Vec<(&str, String)> = SERVICES.into_iter().map(|name| (name, sandbox.admin_addr(name))).collect();
    let prometheus = Prometheus::start(sandbox.dir.path(), &targets, &path, INTERVAL).await;
    (sandbox, prometheus)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_shard_fires_its_alert_in_prometheus_and_resolves_once_skipped() {
    let (sandbox, prometheus) = scraped(&std::fs::read_to_string(rules_path()).unwrap()).await;
    let counter = sandbox.admin_addr("tally-counter");

    // Every service scraped and ready, no alert firing.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = prometheus.query("tally_ready").await;
        let mut jobs: Vec<(String, f64)> =
            ready.iter().map(|(labels, value)| (labels["job"].as_str().unwrap_or("").to_string(), *value)).collect();
        jobs.sort_by(|a, b| a.0.cmp(&b.0));
        let want =
            vec![("tally-counter".to_string(), 1.0), ("tally-ingester".into(), 1.0), ("tally-query".into(), 1.0)];
        if jobs == want {
            break;
        }
        assert!(Instant::now() < deadline, "tally_ready as Prometheus scraped it: {jobs:?}, not {want:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let none: Vec<Alert> = prometheus.alerts().await.into_iter().filter(|alert| alert.state == "firing").collect();
    assert_eq!(none, vec![], "nothing fires on a healthy deployment");

    // A stray producer writes bytes no tally wrote to a shard.
    let failed = shard_of("user:0", SHARDS);
    let shard_topic = sandbox.names.shards();
    let producer: rdkafka::producer::FutureProducer = client_config(&sandbox.kafka).unwrap().create().unwrap();
    let garbage = b"\x00\x01 not a tally record".to_vec();
    let record =
        rdkafka::producer::FutureRecord::<(), [u8]>::to(&shard_topic).partition(failed as i32).payload(&garbage);
    let garbage_offset = producer.send(record, Duration::from_secs(10)).await.map_err(|(err, _)| err).unwrap().offset;

    // From the counter reporting the failure to the alert firing: two evaluations.
    let deadline = Instant::now() + Duration::from_secs(60);
    while sandbox.metric("tally-counter", "tally_counter_failed_shards").await != vec![(String::new(), 1.0)] {
        assert!(Instant::now() < deadline, "the shard did not fail:\n{}", sandbox.log("tally-counter"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reported = Instant::now();
    alerts_until(&prometheus, Duration::from_secs(30), "TallyShardFailed firing", |alerts| {
        !firing(alerts, "TallyShardFailed").is_empty()
    })
    .await;
    let took = reported.elapsed();
    let alerts = prometheus.alerts().await;
    let fired: Vec<&Alert> = firing(&alerts, "TallyShardFailed");
    let want =
        json!({"alertname": "TallyShardFailed", "severity": "critical", "job": "tally-counter", "instance": counter});
    assert_eq!(fired.iter().map(|alert| alert.labels.clone()).collect::<Vec<_>>(), vec![want]);
    println!("TallyShardFailed fired {took:?} after the counter reported the failure");
    // A scrape and two evaluations (3 s), and a second of slack for a busy machine.
    assert!(took <= INTERVAL * 4, "TallyShardFailed fired {took:?} after the failure was reported");
    let scraped = prometheus.query("tally_ready{job=\"tally-counter\"}").await;
    assert_eq!(scraped.iter().map(|(_, value)| *value).collect::<Vec<_>>(), vec![0.0], "the counter is not ready");

    // The operator skips the record: the alert resolves.
    let (ok, output) = sandbox.skip(&failed.to_string(), garbage_offset, "a stray producer");
    assert!(ok, "{output}\n{}", sandbox.log("tally-counter"));
    alerts_until(&prometheus, Duration::from_secs(30), "TallyShardFailed resolved", |alerts| {
        firing(alerts, "TallyShardFailed").is_empty() && alerts.iter().all(|alert| alert.name != "TallyShardFailed")
    })
    .await;
    let still: Vec<Alert> = prometheus.alerts().await.into_iter().filter(|alert| alert.state == "firing").collect();
    assert_eq!(still, vec![], "nothing fires once the shard counts again");
}

/// The rules file with `alert`'s threshold and `for` replaced (`> 60` and `for: 5m`):
/// the rule as shipped, on a test's time scale.
fn scaled(alert: &str, threshold: &str, wait: &str) -> String {
    let rules = std::fs::read_to_string(rules_path()).unwrap();
    let start = rules.find(&format!("- alert: {alert}\n")).unwrap_or_else(|| panic!("no {alert}"));
    let end = rules[start + 1..].find("- alert: ").map_or(rules.len(), |at| start + 1 + at);
    let block = &rules[start..end];
    let changed = block.replace("> 60", &format!("> {threshold}")).replace("for: 5m", &format!("for: {wait}"));
    assert!(changed.contains(&format!("> {threshold}")) && changed.contains(&format!("for: {wait}")), "{block}");
    format!("{}{changed}{}", &rules[..start], &rules[end..])
}

fn rules_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/tally-rules.yaml")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_counter_fires_the_stale_shard_alert_until_it_runs_again() {
    let (sandbox, prometheus) = scraped(&scaled("TallyShardStale", "3", "1s")).await;
    let all: Vec<String> = (0..SHARDS).map(|shard| shard.to_string()).collect();

    // Every shard's staleness scraped, and fresh.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let staleness = prometheus.query("tally_query_shard_staleness_seconds").await;
        let fresh = staleness
            .iter()
            .filter(|(_, seconds)| *seconds < 3.0)
            .map(|(labels, _)| labels["shard"].as_str().unwrap_or("").to_string());
        if in_shard_order(fresh.collect()) == all {
            break;
        }
        assert!(Instant::now() < deadline, "every shard's staleness under 3 s: {staleness:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(firing(&prometheus.alerts().await, "TallyShardStale"), Vec::<&Alert>::new());

    sandbox.signal("tally-counter", libc::SIGSTOP);
    let paused = Instant::now();
    let stale_shards = |alerts: &[Alert]| -> Vec<String> {
        let firing = firing(alerts, "TallyShardStale");
        in_shard_order(firing.iter().map(|alert| alert.labels["shard"].as_str().unwrap_or("").to_string()).collect())
    };
    alerts_until(&prometheus, Duration::from_secs(30), "TallyShardStale for every shard", |alerts| {
        stale_shards(alerts) == all
    })
    .await;
    println!("TallyShardStale fired for every shard {:?} after the counter paused", paused.elapsed());
    let alerts = prometheus.alerts().await;
    let want = |shard: &String| json!({"alertname": "TallyShardStale", "severity": "warning", "job": "tally-query", "shard": shard});
    let mut labels: Vec<serde_json::Value> =
        firing(&alerts, "TallyShardStale").iter().map(|alert| alert.labels.clone()).collect();
    labels.sort_by_key(|labels| labels["shard"].as_str().unwrap_or("").parse::<u32>().unwrap_or(u32::MAX));
    assert_eq!(labels, all.iter().map(want).collect::<Vec<_>>());

    sandbox.signal("tally-counter", libc::SIGCONT);
    alerts_until(&prometheus, Duration::from_secs(30), "TallyShardStale resolved", |alerts| {
        alerts.iter().all(|alert| alert.name != "TallyShardStale")
    })
    .await;
}
