//! A Kafka reachable only over TLS (a private CA, a TLS terminator in front of the
//! local broker): every service and the command line connect with
//! `security.protocol = "SSL"`, and the counts equal the model.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use tally_e2e::workload::Workload;
use tally_e2e::{check, Options, Sandbox};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_that_speaks_only_tls_works_end_to_end() {
    let mut sandbox = Sandbox::start_with(Options { tls: true, ..Default::default() }).await;
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-graph", "tally-query"]).await;
    let workload = Workload::generate_mixed(21, 300, tally_shared::kafka::now_ms(), 0.15);
    sandbox.produce(&workload.records).await;
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, model, entities, metrics).await;

    // The command line goes through TLS too.
    let (ok, output) = sandbox.cli(&["produce", "increment", "tls:cli", "views", "--delta", "5"]);
    assert!(ok, "{output}");
    // A plaintext client gets nowhere on the TLS port.
    let plain: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", &sandbox.kafka.bootstrap_servers).create().expect("client");
    let refused = tokio::task::spawn_blocking(move || plain.fetch_metadata(None, Duration::from_secs(5)).is_err());
    assert!(refused.await.unwrap(), "a plaintext client read metadata through the TLS port");
    let mut body = serde_json::Value::Null;
    for _ in 0..100 {
        body = sandbox.get("/v1/counters/tls:cli/views?window=all").await.1;
        if body["value"] == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(body["value"], 5, "{body}");
}
