//! Queue declarations users own: a file of `[[queue]]` entries alone, named by the
//! config, drives `tally topics apply`, `tally up` and the brokers; a queue declared
//! or changed while brokers run is served without restarting them.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tally_e2e::Sandbox;
use tally_shared::local_broker::free_port;

async fn get(url: &str) -> (u16, Value) {
    match reqwest::get(url).await {
        Ok(response) => (response.status().as_u16(), response.json().await.unwrap_or(Value::Null)),
        Err(_) => (0, Value::Null),
    }
}

/// Waits until GET `url` answers 200 with a body `accept` likes; returns it.
async fn wait_for(url: &str, what: &str, accept: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (status, body) = get(url).await;
        if status == 200 && accept(&body) {
            return body;
        }
        assert!(Instant::now() < deadline, "{what}: last answer {status} {body}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn owned(stats: &Value) -> usize {
    stats["partitions"].as_array().map_or(0, |ps| ps.iter().filter(|p| p["owned_here"] == true).count())
}

async fn dequeue(broker: &str, queue: &str, max: usize) -> Vec<Value> {
    let response = reqwest::Client::new()
        .post(format!("{broker}/v1/queues/{queue}/dequeue"))
        .json(&json!({"max": max, "wait_ms": 1000}))
        .send()
        .await
        .expect("dequeue");
    let body: Value = response.json().await.expect("dequeue JSON");
    body["jobs"].as_array().cloned().unwrap_or_default()
}

/// The first non-empty dequeue of up to 10 jobs (within 30 s).
async fn first_jobs(broker: &str, queue: &str) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut handed = Vec::new();
    while handed.is_empty() && Instant::now() < deadline {
        handed = dequeue(broker, queue, 10).await;
    }
    handed
}

fn job(id: &str, key: &str) -> (Option<String>, Vec<u8>) {
    (Some(key.to_string()), json!({"id": id, "payload": {"n": id}, "key": key}).to_string().into_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_declared_while_brokers_run_is_served_without_a_restart() {
    let mut sandbox = Sandbox::start().await;
    let first = sandbox.path("first.toml");
    std::fs::write(&first, "[[queue]]\nname = \"first\"\npartitions = 2\n").unwrap();
    let (ok, output) = sandbox.cli(&["topics", "apply", "--file", &first]);
    assert!(ok, "{output}");
    let broker = sandbox.spawn_broker("broker", std::path::Path::new(&first));
    wait_for(&format!("{broker}/v1/queues/first"), "first served", |s| owned(s) == 2).await;
    let (status, body) = get(&format!("{broker}/v1/queues/second")).await;
    assert_eq!(status, 404, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("tally topics apply"), "the error names the command that fixes it: {message}");

    // A second queue, and new settings for the first, while the broker runs.
    let both = sandbox.path("both.toml");
    std::fs::write(
        &both,
        "[[queue]]\nname = \"first\"\npartitions = 2\nrate_limit_per_sec = 7\n\n\
         [[queue]]\nname = \"second\"\npartitions = 3\nfifo = true\n",
    )
    .unwrap();
    let (ok, output) = sandbox.cli(&["topics", "apply", "--file", &both]);
    assert!(ok, "{output}");
    let second = wait_for(&format!("{broker}/v1/queues/second"), "second served", |s| owned(s) == 3).await;
    assert_eq!(second["fifo"], true, "{second}");
    wait_for(&format!("{broker}/v1/queues/first"), "first's new rate limit", |s| s["rate_limit_per_sec"] == 7).await;

    sandbox.produce_to(&sandbox.names.jobs("second"), &[job("a", "k"), job("b", "k")]).await;
    let handed = first_jobs(&broker, "second").await;
    let ids: Vec<&str> = handed.iter().filter_map(|j| j["id"].as_str()).collect();
    assert_eq!(ids, vec!["a"], "the new queue serves its first job, and holds the next of its key (fifo)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tally_up_serves_the_queues_of_a_users_own_file() {
    let mut sandbox = Sandbox::start().await;
    let dir = sandbox.path("user");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        format!("{dir}/queues.toml"),
        "[[queue]]\nname = \"emails\"\npartitions = 2\nfifo = true\n\n\
         [[queue]]\nname = \"limited\"\npartitions = 2\nrate_limit_per_sec = 20\n",
    )
    .unwrap();
    let config = format!("{dir}/tally.toml");
    // The user's own file: their Kafka (the sandbox's) and their queues.
    let kafka = format!(
        "[kafka]\nbootstrap_servers = {:?}\ntopic_prefix = {:?}\n",
        sandbox.kafka.bootstrap_servers, sandbox.kafka.topic_prefix
    );
    std::fs::write(&config, format!("{kafka}[broker]\ndeclarations = \"queues.toml\"\n")).unwrap();
    let (ok, output) = sandbox.cli(&["config", "check", "--config", &config]);
    assert!(ok && output.contains(&format!("declarations = \"{dir}/queues.toml\"")), "{output}");

    let api = format!("127.0.0.1:{}", free_port().unwrap());
    let env = [
        ("TALLY__BROKER__LISTEN", api.clone()),
        ("TALLY__BROKER__ADMIN_LISTEN", format!("127.0.0.1:{}", free_port().unwrap())),
        ("TALLY__BROKER__HEARTBEAT_MS", "500".to_string()),
    ];
    let data = format!("{dir}/data");
    sandbox.spawn_command("tally-up", "tally", &["up", "--config", &config, "--data-dir", &data], &env);
    let broker = format!("http://{api}");
    wait_for(&format!("{broker}/v1/queues/emails"), "emails served", |s| owned(s) == 2).await;
    let limited = wait_for(&format!("{broker}/v1/queues/limited"), "limited served", |s| owned(s) == 2).await;
    assert_eq!(limited["rate_limit_per_sec"], 20, "{limited}");

    sandbox.produce_to(&sandbox.names.jobs("emails"), &[job("e1", "user:7"), job("e2", "user:7")]).await;
    let handed = first_jobs(&broker, "emails").await;
    let ids: Vec<&str> = handed.iter().filter_map(|j| j["id"].as_str()).collect();
    assert_eq!(ids, vec!["e1"], "{}", sandbox.log("tally-up"));
    sandbox.stop("tally-up");
}
