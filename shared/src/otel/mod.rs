//! Traces, exported over OTLP/HTTP (protobuf) when `telemetry.otlp_endpoint` is set
//! and not at all otherwise: with no endpoint no exporter thread starts, and every
//! call here returns at once.
//!
//! The W3C `traceparent` travels in Kafka record headers ([`TRACEPARENT`]) from a
//! producer (`tally produce`, `tally jobs enqueue`, any client that sets it) through
//! the ingester (which carries each input record's context onto the shard records
//! it routes it into) to the counter, whose span of a batch links its records'
//! contexts, as OpenTelemetry's messaging conventions have a batch consumer do; and
//! from a job's record through the broker (a span per handout, the child of the
//! producer's) to the worker (a child of the broker's, and the ack a child of that):
//! one job, one trace.
//!
//! Finished spans go on a bounded queue to the exporter thread ([`EXPORTER_THREAD`]),
//! which sends them in batches; a full queue drops spans (counted) rather than slow
//! the work they describe.

pub mod proto;

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, Opts};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use tally_core::trace::{Span, SpanSink, TraceContext, Value, MAX_LINKS, TRACEPARENT};

use crate::config::TelemetryConfig;
use crate::{Error, Result};

/// The name of the thread that sends spans (one per process, only when exporting).
pub const EXPORTER_THREAD: &str = "tally-otlp";
/// Most finished spans waiting for the exporter.
const QUEUE: usize = 4_096;
/// Most spans per request, and how long a span waits for more to join it.
const BATCH: usize = 512;
const BATCH_WAIT: Duration = Duration::from_millis(500);
/// How long one export request may take.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a failing export is logged.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(60);

enum Message {
    Span(Span),
    /// Send what is queued, then answer.
    Flush(SyncSender<()>),
}

struct Exporter {
    queue: SyncSender<Message>,
    /// `tally_trace_spans_total` by outcome.
    spans: IntCounterVec,
}

static EXPORTER: OnceLock<Exporter> = OnceLock::new();

/// Starts exporting this process's spans as `service` when `config` names an
/// endpoint; does nothing otherwise, or when already started.
pub fn install(config: &TelemetryConfig, service: &str) -> Result<()> {
    let Some(endpoint) = &config.otlp_endpoint else { return Ok(()) };
    if EXPORTER.get().is_some() {
        return Ok(());
    }
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let spans = IntCounterVec::new(
        Opts::new(
            "tally_trace_spans_total",
            "Spans by outcome: exported, failed (the collector refused them or did not answer: check \
             telemetry.otlp_endpoint and the collector's logs) or dropped (more spans than the exporter keeps \
             up with: a collector too slow or far away)",
        ),
        &["outcome"],
    )
    .expect("valid metric");
    let resource: Vec<(&'static str, Value)> = vec![
        ("service.name", service.into()),
        ("service.version", env!("CARGO_PKG_VERSION").into()),
        ("process.pid", i64::from(std::process::id()).into()),
    ];
    let (queue, waiting) = sync_channel(QUEUE);
    let counted = spans.clone();
    std::thread::Builder::new()
        .name(EXPORTER_THREAD.into())
        .spawn(move || export_loop(&url, &resource, &waiting, &counted))
        .map_err(|err| Error::Config(format!("starting the span exporter: {err}")))?;
    // A second install lost a race: its thread ends with its queue.
    if EXPORTER.set(Exporter { queue, spans }).is_ok() {
        tracing::info!(endpoint = %endpoint, service, "exporting traces");
    }
    Ok(())
}

/// Whether spans are exported: what decides whether work makes them at all.
pub fn enabled() -> bool {
    EXPORTER.get().is_some()
}

/// Hands a finished span to the exporter (a span of an unsampled trace is not
/// exported).
pub fn record(span: Span) {
    let Some(exporter) = EXPORTER.get() else { return };
    if !span.context.sampled() {
        return;
    }
    match exporter.queue.try_send(Message::Span(span)) {
        Ok(()) => {}
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            exporter.spans.with_label_values(&["dropped"]).inc();
        }
    }
}

/// [`record`] as a [`SpanSink`], when exporting.
pub fn sink() -> Option<SpanSink> {
    enabled().then(|| SpanSink::new(record))
}

/// `tally_trace_spans_total`, when exporting (the admin router registers it).
pub fn spans_metric() -> Option<IntCounterVec> {
    EXPORTER.get().map(|exporter| exporter.spans.clone())
}

/// Waits up to `timeout` for every span recorded so far to be sent: a command
/// line's last step, and a service's after it stopped.
pub fn flush(timeout: Duration) {
    let Some(exporter) = EXPORTER.get() else { return };
    let deadline = Instant::now() + timeout;
    let (done, sent) = sync_channel(1);
    let mut flush = Message::Flush(done);
    loop {
        match exporter.queue.try_send(flush) {
            Ok(()) => break,
            Err(TrySendError::Full(again)) if Instant::now() < deadline => {
                flush = again;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => return,
        }
    }
    if sent.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
        tracing::warn!(?timeout, "not every span was exported before the end");
    }
}

/// The trace contexts a Kafka record carries ([`TRACEPARENT`] headers; an
/// ingester's shard record may carry several), at most [`MAX_LINKS`]; values that
/// are not valid are ignored (a producer's, not tally's, mistake).
pub fn contexts_of<H: Headers>(headers: Option<&H>) -> Vec<TraceContext> {
    let Some(headers) = headers else { return Vec::new() };
    headers
        .iter()
        .filter(|header| header.key == TRACEPARENT)
        .filter_map(|header| TraceContext::parse(header.value?))
        .take(MAX_LINKS)
        .collect()
}

/// `headers` with a [`TRACEPARENT`] header for each of `contexts`.
pub fn with_contexts<'a>(
    mut headers: OwnedHeaders,
    contexts: impl IntoIterator<Item = &'a TraceContext>,
) -> OwnedHeaders {
    for context in contexts {
        let value = context.header_value();
        headers = headers.insert(Header { key: TRACEPARENT, value: Some(value.as_bytes()) });
    }
    headers
}

fn export_loop(url: &str, resource: &[(&str, Value)], waiting: &Receiver<Message>, spans: &IntCounterVec) {
    let client = reqwest::Client::builder().timeout(SEND_TIMEOUT).build();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let (client, runtime) = match (client, runtime) {
        (Ok(client), Ok(runtime)) => (client, runtime),
        (Err(err), _) => return tracing::error!(error = %err, "the span exporter could not start; no spans are sent"),
        (_, Err(err)) => return tracing::error!(error = %err, "the span exporter could not start; no spans are sent"),
    };
    let mut last_failure_logged: Option<Instant> = None;
    let mut send = |batch: &mut Vec<Span>| {
        if batch.is_empty() {
            return;
        }
        let body = proto::export_request(resource, batch);
        let posted = runtime.block_on(async {
            let response = client.post(url).header("content-type", "application/x-protobuf").body(body).send().await?;
            response.error_for_status().map(|_| ())
        });
        let outcome = match &posted {
            Ok(()) => "exported",
            Err(_) => "failed",
        };
        spans.with_label_values(&[outcome]).inc_by(batch.len() as u64);
        if let Err(err) = posted {
            if last_failure_logged.is_none_or(|at| at.elapsed() >= FAILURE_LOG_EVERY) {
                last_failure_logged = Some(Instant::now());
                tracing::warn!(%url, error = %err, spans = batch.len(), "exporting spans failed; they are lost");
            }
        }
        batch.clear();
    };
    let mut batch = Vec::new();
    loop {
        let deadline = Instant::now() + BATCH_WAIT;
        let mut flushed = None;
        while batch.len() < BATCH {
            match waiting.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Message::Span(span)) => batch.push(span),
                Ok(Message::Flush(done)) => {
                    flushed = Some(done);
                    break;
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return send(&mut batch),
            }
        }
        send(&mut batch);
        if let Some(done) = flushed {
            // Whoever asked may have stopped waiting.
            done.send(()).ok();
        }
    }
}
