//! Traces end to end, received by the kit's OTLP receiver (which decodes the real
//! protobuf): one enqueued job is one trace from the producer through the broker to
//! the worker and its ack; an increment's producer context is linked by the
//! ingester's and the counter's batch spans; a service with export off runs no
//! exporter thread.

use std::collections::BTreeSet;
use std::time::Duration;

use tally_e2e::otlp::{OtlpReceiver, ReceivedSpan, KIND_CLIENT, KIND_CONSUMER, KIND_PRODUCER};
use tally_e2e::Sandbox;
use tally_shared::otel::EXPORTER_THREAD;

const QUEUES: &str = r#"
[[queue]]
name = "work"
partitions = 2
"#;

/// A trace's spans as (service, name, kind, the name of its parent in the trace or
/// "" for the root), sorted: the shape compared whole.
fn shape(spans: &[ReceivedSpan], trace_id: &str) -> Vec<(String, String, i32, String)> {
    let trace: Vec<&ReceivedSpan> = spans.iter().filter(|span| span.trace_id == trace_id).collect();
    let name_of = |id: &str| trace.iter().find(|span| span.span_id == id).map(|span| span.name.clone());
    let mut shape: Vec<(String, String, i32, String)> = trace
        .iter()
        .map(|span| {
            let parent = match span.parent_span_id.is_empty() {
                true => String::new(),
                false => name_of(&span.parent_span_id).unwrap_or_else(|| format!("missing {}", span.parent_span_id)),
            };
            (span.service.clone(), span.name.clone(), span.kind, parent)
        })
        .collect();
    shape.sort();
    shape
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_is_one_trace_and_a_counters_batch_links_its_producers() {
    let receiver = OtlpReceiver::start().await;
    let mut sandbox = Sandbox::start().await;
    // Export off for tally-query: no exporter thread.
    sandbox.spawn("tally-query");
    sandbox.config.telemetry.otlp_endpoint = Some(receiver.endpoint.clone());
    for service in ["tally-ingester", "tally-counter"] {
        sandbox.spawn(service);
    }
    let declarations = sandbox.declare(QUEUES).await;
    let broker = sandbox.spawn_broker("broker", &declarations);
    let seen = sandbox.path("traceparent");
    sandbox.spawn_instance("worker", "tally-worker", |config| {
        config.worker.brokers = vec![broker];
        config.worker.queue = "work".into();
        config.worker.command = Some(vec!["sh".into(), "-c".into(), format!("echo \"$TRACEPARENT\" > {seen}")]);
        config.worker.admin_listen = "127.0.0.1:0".into();
    });
    sandbox.wait_ready("tally-counter", Duration::from_secs(60)).await;

    // One job, enqueued by the command line.
    let (ok, out) = sandbox.cli(&["jobs", "enqueue", "work", r#"{"n":1}"#, "--id", "traced"]);
    assert!(ok, "{out}");
    let jobs_topic = sandbox.names.jobs("work");
    let send = format!("send {jobs_topic}");
    let spans =
        receiver.wait_for(Duration::from_secs(60), |spans| spans.iter().any(|span| span.name == "ack work")).await;
    let producer = spans
        .iter()
        .find(|span| span.name == send)
        .unwrap_or_else(|| panic!("no producer span among {spans:#?}\n{}", sandbox.log("worker")));
    let want = vec![
        ("tally".to_string(), send.clone(), KIND_PRODUCER, String::new()),
        ("tally-broker".into(), format!("deliver {jobs_topic}"), KIND_CONSUMER, send.clone()),
        ("tally-worker".into(), "ack work".into(), KIND_CLIENT, "process work".into()),
        ("tally-worker".into(), "process work".into(), KIND_CONSUMER, format!("deliver {jobs_topic}")),
    ];
    let mut want = want;
    want.sort();
    assert_eq!(shape(&spans, &producer.trace_id), want, "{spans:#?}");
    let run = spans.iter().find(|span| span.name == "process work").unwrap();
    assert_eq!(run.attributes.get("messaging.message.id").map(String::as_str), Some("traced"));
    assert_eq!(run.status, (0, String::new()), "the job succeeded");
    // The command ran in the worker's span of the job.
    let passed_on = std::fs::read_to_string(&seen).expect("the job ran");
    assert_eq!(passed_on.trim(), format!("00-{}-{}-01", run.trace_id, run.span_id));

    // One increment, produced by the command line: the ingester's routing span
    // and the counter's batch span link the producer's context.
    let (ok, out) = sandbox.cli(&["produce", "increment", "answer:1", "views"]);
    assert!(ok, "{out}");
    let send = format!("send {}", sandbox.names.increments());
    let linked = |spans: &[ReceivedSpan], service: &str| -> Option<ReceivedSpan> {
        let producer = spans.iter().find(|span| span.name == send)?;
        let context = (producer.trace_id.clone(), producer.span_id.clone());
        spans.iter().find(|span| span.service == service && span.links.contains(&context)).cloned()
    };
    let spans = receiver
        .wait_for(Duration::from_secs(60), |spans| {
            linked(spans, "tally-counter").is_some() && linked(spans, "tally-ingester").is_some()
        })
        .await;
    let producer = spans.iter().find(|span| span.name == send).expect("the increment's producer span");
    assert_eq!((producer.kind, producer.parent_span_id.as_str()), (KIND_PRODUCER, ""));
    let counter = linked(&spans, "tally-counter").unwrap_or_else(|| panic!("no counter span links {producer:#?}"));
    assert_eq!(
        (counter.name.as_str(), counter.kind),
        (format!("process {}", sandbox.names.shards()).as_str(), KIND_CONSUMER)
    );
    assert_eq!(counter.links, vec![(producer.trace_id.clone(), producer.span_id.clone())]);
    let ingester = linked(&spans, "tally-ingester").unwrap_or_else(|| panic!("no ingester span links {producer:#?}"));
    assert_eq!(ingester.links, counter.links);
    let count = counter.attributes.get("messaging.batch.message_count").and_then(|n| n.parse::<u64>().ok());
    assert!(count.is_some_and(|n| n >= 1), "{counter:#?}");
    assert!(
        counter.start_unix_nanos >= producer.start_unix_nanos && counter.end_unix_nanos >= counter.start_unix_nanos
    );
    assert_eq!(receiver.refused(), Vec::<String>::new(), "every request decoded");

    // The exporter thread runs where export is on, and only there.
    for service in ["tally-ingester", "tally-counter", "broker", "worker"] {
        assert!(sandbox.thread_names(service).iter().any(|name| name == EXPORTER_THREAD), "{service}");
    }
    let threads: BTreeSet<String> = sandbox.thread_names("tally-query").into_iter().collect();
    assert!(!threads.contains(EXPORTER_THREAD), "export off, yet {threads:?}");
    let services: BTreeSet<&str> = spans.iter().map(|span| span.service.as_str()).collect();
    assert!(!services.contains("tally-query"), "{services:?}");
}
