//! A tiny OTLP/HTTP trace receiver: `POST /v1/traces` with an
//! `ExportTraceServiceRequest` in protobuf, decoded with messages declared here from
//! opentelemetry-proto's `.proto` files (field numbers and types as they are there),
//! independently of the services' hand-written encoder. It keeps every span it
//! received with the service that sent it, and every request it could not decode.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use prost::Message;
use tally_core::format::hex;
use tokio_util::sync::CancellationToken;

/// opentelemetry-proto's messages, as far as a receiver of tally's spans reads them.
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ExportTraceServiceRequest {
        #[prost(message, repeated, tag = "1")]
        pub resource_spans: Vec<ResourceSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResourceSpans {
        #[prost(message, optional, tag = "1")]
        pub resource: Option<Resource>,
        #[prost(message, repeated, tag = "2")]
        pub scope_spans: Vec<ScopeSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Resource {
        #[prost(message, repeated, tag = "1")]
        pub attributes: Vec<KeyValue>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ScopeSpans {
        #[prost(message, optional, tag = "1")]
        pub scope: Option<InstrumentationScope>,
        #[prost(message, repeated, tag = "2")]
        pub spans: Vec<Span>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct InstrumentationScope {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub version: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Span {
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub span_id: Vec<u8>,
        #[prost(string, tag = "3")]
        pub trace_state: String,
        #[prost(bytes = "vec", tag = "4")]
        pub parent_span_id: Vec<u8>,
        #[prost(string, tag = "5")]
        pub name: String,
        #[prost(int32, tag = "6")]
        pub kind: i32,
        #[prost(fixed64, tag = "7")]
        pub start_time_unix_nano: u64,
        #[prost(fixed64, tag = "8")]
        pub end_time_unix_nano: u64,
        #[prost(message, repeated, tag = "9")]
        pub attributes: Vec<KeyValue>,
        #[prost(uint32, tag = "10")]
        pub dropped_attributes_count: u32,
        #[prost(message, repeated, tag = "13")]
        pub links: Vec<Link>,
        #[prost(uint32, tag = "14")]
        pub dropped_links_count: u32,
        #[prost(message, optional, tag = "15")]
        pub status: Option<Status>,
        #[prost(fixed32, tag = "16")]
        pub flags: u32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Link {
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub span_id: Vec<u8>,
        #[prost(string, tag = "3")]
        pub trace_state: String,
        #[prost(fixed32, tag = "6")]
        pub flags: u32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Status {
        #[prost(string, tag = "2")]
        pub message: String,
        #[prost(int32, tag = "3")]
        pub code: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(message, optional, tag = "2")]
        pub value: Option<AnyValue>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AnyValue {
        #[prost(oneof = "any_value::Value", tags = "1, 2, 3, 4, 7")]
        pub value: Option<any_value::Value>,
    }

    pub mod any_value {
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            #[prost(string, tag = "1")]
            String(String),
            #[prost(bool, tag = "2")]
            Bool(bool),
            #[prost(int64, tag = "3")]
            Int(i64),
            #[prost(double, tag = "4")]
            Double(f64),
            #[prost(bytes, tag = "7")]
            Bytes(Vec<u8>),
        }
    }
}

/// OTLP's span kinds.
pub const KIND_CLIENT: i32 = 3;
pub const KIND_PRODUCER: i32 = 4;
pub const KIND_CONSUMER: i32 = 5;

/// A span as received, ids in hex.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// Its resource's `service.name`.
    pub service: String,
    /// Its scope's name.
    pub scope: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root.
    pub parent_span_id: String,
    pub name: String,
    pub kind: i32,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    /// Attributes, their values as text.
    pub attributes: BTreeMap<String, String>,
    /// Linked (trace id, span id).
    pub links: Vec<(String, String)>,
    /// The status code (0 unset, 2 error) and message.
    pub status: (i32, String),
}

#[derive(Default)]
struct Received {
    spans: Vec<ReceivedSpan>,
    /// Requests it could not decode, with why.
    refused: Vec<String>,
}

pub struct OtlpReceiver {
    /// The base URL a service's `telemetry.otlp_endpoint` names.
    pub endpoint: String,
    received: Arc<Mutex<Received>>,
    stop: CancellationToken,
}

fn text(value: Option<&proto::AnyValue>) -> String {
    use proto::any_value::Value;
    match value.and_then(|value| value.value.as_ref()) {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Bool(flag)) => flag.to_string(),
        Some(Value::Int(number)) => number.to_string(),
        Some(Value::Double(number)) => number.to_string(),
        Some(Value::Bytes(bytes)) => hex(bytes),
        None => String::new(),
    }
}

fn attributes(list: &[proto::KeyValue]) -> BTreeMap<String, String> {
    list.iter().map(|kv| (kv.key.clone(), text(kv.value.as_ref()))).collect()
}

/// The spans of one request, or why it is refused.
fn decode(headers: &HeaderMap, body: &[u8]) -> Result<Vec<ReceivedSpan>, String> {
    let content_type = headers.get("content-type").and_then(|value| value.to_str().ok()).unwrap_or_default();
    if content_type != "application/x-protobuf" {
        return Err(format!("content-type {content_type:?}, not application/x-protobuf"));
    }
    let request = proto::ExportTraceServiceRequest::decode(body).map_err(|err| err.to_string())?;
    let mut spans = Vec::new();
    for resource_spans in request.resource_spans {
        let resource = attributes(&resource_spans.resource.map(|r| r.attributes).unwrap_or_default());
        let service = resource.get("service.name").cloned().ok_or("a resource without service.name")?;
        for scope_spans in resource_spans.scope_spans {
            let scope = scope_spans.scope.map(|scope| scope.name).unwrap_or_default();
            for span in scope_spans.spans {
                if span.trace_id.len() != 16 || span.span_id.len() != 8 {
                    return Err(format!(
                        "span {:?}: ids of {} and {} bytes",
                        span.name,
                        span.trace_id.len(),
                        span.span_id.len()
                    ));
                }
                spans.push(ReceivedSpan {
                    service: service.clone(),
                    scope: scope.clone(),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    kind: span.kind,
                    start_unix_nanos: span.start_time_unix_nano,
                    end_unix_nanos: span.end_time_unix_nano,
                    attributes: attributes(&span.attributes),
                    links: span.links.iter().map(|link| (hex(&link.trace_id), hex(&link.span_id))).collect(),
                    status: span.status.map_or((0, String::new()), |status| (status.code, status.message)),
                });
            }
        }
    }
    Ok(spans)
}

async fn traces(
    State(received): State<Arc<Mutex<Received>>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Vec<u8>) {
    let decoded = decode(&headers, &body);
    let mut received = received.lock().unwrap();
    match decoded {
        Ok(spans) => {
            received.spans.extend(spans);
            // An empty ExportTraceServiceResponse: all accepted.
            (StatusCode::OK, Vec::new())
        }
        Err(why) => {
            received.refused.push(why);
            (StatusCode::BAD_REQUEST, Vec::new())
        }
    }
}

impl OtlpReceiver {
    /// Listens on a free loopback port until dropped.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let received = Arc::new(Mutex::new(Received::default()));
        let app = axum::Router::new().route("/v1/traces", post(traces)).with_state(received.clone());
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move { stopped.cancelled().await });
            serve.await.expect("the OTLP receiver serves");
        });
        Self { endpoint, received, stop }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received.lock().unwrap().spans.clone()
    }

    /// Requests it refused, with why (none, when the exporters speak OTLP).
    pub fn refused(&self) -> Vec<String> {
        self.received.lock().unwrap().refused.clone()
    }

    /// Waits up to `timeout` until `done` holds for the spans received; the spans.
    pub async fn wait_for(&self, timeout: Duration, done: impl Fn(&[ReceivedSpan]) -> bool) -> Vec<ReceivedSpan> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
