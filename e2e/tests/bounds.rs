//! Numbers nobody may push past their bounds: increments whose `delta` or `ts` lie
//! outside what tally keeps go to the dead-letter topic with their reasons (and
//! nothing of them is counted); leases, extends and retry delays past a queue's
//! maxima are refused with 400; guessed lease tokens ack nothing.

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
