//! Trace context and finished spans: what travels with a record (the W3C
//! `traceparent`, in a Kafka header or an HTTP header) and what a service reports
//! of its work on it. Exporting them (OTLP) is `tally_shared::otel`'s; this is the
//! pure part, so the jobs client can make spans without the services' runtime.
//!
//! The `traceparent` format is W3C Trace Context level 1: `00-<trace id: 32 hex>-<span
//! id: 16 hex>-<flags: 2 hex>`, lowercase, neither id all zeros. A version above `00`
//! is read as far as version `00` goes (the specification's rule); `ff` is refused.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::format::hex;

/// The header (Kafka record, HTTP request) that carries a [`TraceContext`].
pub const TRACEPARENT: &str = "traceparent";
/// Most trace contexts one shard record carries on (the ingester's), and most links
/// one span keeps: a batch of a million traced increments links the first ones.
pub const MAX_LINKS: usize = 32;
/// The `sampled` flag: spans of a context without it are passed on, never exported.
const SAMPLED: u8 = 0x01;

/// A position in a trace: the trace and the span that the next work descends from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceContext {
    /// The start of a new, sampled trace.
    pub fn root() -> Self {
        let mut trace_id = [0; 16];
        trace_id[..8].copy_from_slice(&nonzero_random().to_be_bytes());
        trace_id[8..].copy_from_slice(&random().to_be_bytes());
        Self { trace_id, span_id: nonzero_random().to_be_bytes(), flags: SAMPLED }
    }

    /// A new span of the same trace (its parent is `self.span_id`).
    pub fn child(&self) -> Self {
        Self { span_id: nonzero_random().to_be_bytes(), ..*self }
    }

    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// Reads a `traceparent` value; `None` for anything the specification refuses.
    pub fn parse(value: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(value).ok()?;
        let version = u8::from_str_radix(lower_hex(text.get(0..2)?)?, 16).ok()?;
        let fits = match version {
            0xff => false,
            0 => text.len() == 55,
            // A later version may append fields after a dash.
            _ => text.len() == 55 || text.as_bytes().get(55) == Some(&b'-'),
        };
        let dashes = [2, 35, 52].iter().all(|&at| text.as_bytes().get(at) == Some(&b'-'));
        if !fits || !dashes {
            return None;
        }
        let trace_id: [u8; 16] = hex_bytes(lower_hex(text.get(3..35)?)?)?.try_into().ok()?;
        let span_id: [u8; 8] = hex_bytes(lower_hex(text.get(36..52)?)?)?.try_into().ok()?;
        let flags = u8::from_str_radix(lower_hex(text.get(53..55)?)?, 16).ok()?;
        let zero = |bytes: &[u8]| bytes.iter().all(|byte| *byte == 0);
        if zero(&trace_id) || zero(&span_id) {
            return None;
        }
        Some(Self { trace_id, span_id, flags })
    }

    /// The `traceparent` value (version `00`).
    pub fn header_value(&self) -> String {
        format!("00-{}-{}-{:02x}", hex(&self.trace_id), hex(&self.span_id), self.flags)
    }
}

/// `text` when it is lowercase hex only.
fn lower_hex(text: &str) -> Option<&str> {
    text.bytes().all(|byte| matches!(byte, b'0'..=b'9' | b'a'..=b'f')).then_some(text)
}

fn hex_bytes(text: &str) -> Option<Vec<u8>> {
    (0..text.len()).step_by(2).map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok()).collect()
}

/// 64 random bits: SipHash, keyed by the process's random hasher keys, of a counter
/// and the clock. Unpredictable enough for trace ids (they are not secrets) without
/// a dependency.
fn random() -> u64 {
    static DRAWN: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(DRAWN.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |at| at.as_nanos()));
    hasher.finish()
}

fn nonzero_random() -> u64 {
    random().max(1)
}

/// Wall-clock nanoseconds since the epoch, as spans keep time.
pub fn now_unix_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |at| at.as_nanos() as u64)
}

/// What a span does, as OpenTelemetry names it (the OTLP numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
    Producer = 4,
    Consumer = 5,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Str(String),
    Int(i64),
}

impl From<&str> for Value {
    fn from(text: &str) -> Self {
        Value::Str(text.to_string())
    }
}

impl From<String> for Value {
    fn from(text: String) -> Self {
        Value::Str(text)
    }
}

impl From<i64> for Value {
    fn from(number: i64) -> Self {
        Value::Int(number)
    }
}

/// A span: started with [`Span::start`], described, then [`Span::end`]ed and handed
/// to a [`SpanSink`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// Its own trace and span id.
    pub context: TraceContext,
    /// The span it descends from (same trace); `None` for a trace's root.
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub kind: SpanKind,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    /// OpenTelemetry semantic-convention keys (`messaging.system`, …) and tally's
    /// (`tally.…`).
    pub attributes: Vec<(&'static str, Value)>,
    /// Contexts of other traces it worked for (a batch's records'), at most [`MAX_LINKS`].
    pub links: Vec<TraceContext>,
    /// Links left out past [`MAX_LINKS`].
    pub dropped_links: u32,
    /// Set when the work failed: the span's status is an error with this message.
    pub error: Option<String>,
}

impl Span {
    /// A span starting now, a child of `parent` (a new trace's root without one).
    pub fn start(name: impl Into<String>, kind: SpanKind, parent: Option<&TraceContext>) -> Self {
        Self {
            context: parent.map_or_else(TraceContext::root, TraceContext::child),
            parent: parent.map(|parent| parent.span_id),
            name: name.into(),
            kind,
            start_unix_nanos: now_unix_nanos(),
            end_unix_nanos: 0,
            attributes: Vec::new(),
            links: Vec::new(),
            dropped_links: 0,
            error: None,
        }
    }

    pub fn attribute(mut self, key: &'static str, value: impl Into<Value>) -> Self {
        self.attributes.push((key, value.into()));
        self
    }

    /// Links `contexts`, keeping at most [`MAX_LINKS`] in all and counting the rest.
    pub fn link(mut self, contexts: impl IntoIterator<Item = TraceContext>) -> Self {
        for context in contexts {
            match self.links.len() < MAX_LINKS {
                true => self.links.push(context),
                false => self.dropped_links += 1,
            }
        }
        self
    }

    /// Ends it now.
    pub fn end(mut self) -> Self {
        self.end_unix_nanos = now_unix_nanos().max(self.start_unix_nanos);
        self
    }
}

/// The sampled ones of `contexts`, each once (in id order): what a batch's span links.
/// A batch with none makes no span (its producers chose not to be traced).
pub fn sampled(contexts: impl IntoIterator<Item = TraceContext>) -> Vec<TraceContext> {
    let mut sampled: Vec<TraceContext> = contexts.into_iter().filter(TraceContext::sampled).collect();
    sampled.sort_unstable_by_key(|context| (context.trace_id, context.span_id));
    sampled.dedup();
    sampled
}

/// Where finished spans go: the process's exporter (`tally_shared::otel::sink`).
#[derive(Clone)]
pub struct SpanSink(Arc<dyn Fn(Span) + Send + Sync>);

impl SpanSink {
    pub fn new(record: impl Fn(Span) + Send + Sync + 'static) -> Self {
        Self(Arc::new(record))
    }

    pub fn record(&self, span: Span) {
        (self.0)(span)
    }
}

impl std::fmt::Debug for SpanSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpanSink")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_the_specifications_examples_and_refuses_the_rest() {
        let valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let context = TraceContext::parse(valid.as_bytes()).unwrap();
        assert_eq!(hex(&context.trace_id), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(hex(&context.span_id), "b7ad6b7169203331");
        assert!(context.sampled());
        assert_eq!(context.header_value(), valid);
        let unsampled = TraceContext::parse(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00").unwrap();
        assert!(!unsampled.sampled());
        // A later version with more fields is read as version 00.
        let later = "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-comes-next";
        assert_eq!(TraceContext::parse(later.as_bytes()), Some(context));
        for refused in [
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", // version ff
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x", // 00 with more
            "00-00000000000000000000000000000000-b7ad6b7169203331-01", // zero trace id
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", // zero span id
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", // uppercase
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",  // short span id
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", // not a dash
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x", // no dash after
            "",
        ] {
            assert_eq!(TraceContext::parse(refused.as_bytes()), None, "{refused}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_gets_its_own_span() {
        let root = TraceContext::root();
        let child = root.child();
        assert_eq!((child.trace_id, child.flags), (root.trace_id, root.flags));
        assert_ne!(child.span_id, root.span_id);
        assert_ne!(TraceContext::root().trace_id, root.trace_id, "each root is a new trace");
        let span = Span::start("process", SpanKind::Consumer, Some(&root)).end();
        assert_eq!((span.context.trace_id, span.parent), (root.trace_id, Some(root.span_id)));
        assert!(span.end_unix_nanos >= span.start_unix_nanos);
        assert_eq!(Span::start("send", SpanKind::Producer, None).parent, None);
    }

    #[test]
    fn links_are_bounded_and_the_rest_counted() {
        let contexts: Vec<TraceContext> = (0..MAX_LINKS + 5).map(|_| TraceContext::root()).collect();
        let span = Span::start("batch", SpanKind::Consumer, None).link(contexts.clone());
        assert_eq!(span.links, contexts[..MAX_LINKS]);
        assert_eq!(span.dropped_links, 5);
    }

    proptest! {
        #[test]
        fn every_context_reads_back_from_its_header(trace in any::<[u8; 16]>(), span in any::<[u8; 8]>(), flags in any::<u8>()) {
            let context = TraceContext { trace_id: trace, span_id: span, flags };
            let zero = trace == [0; 16] || span == [0; 8];
            prop_assert_eq!(TraceContext::parse(context.header_value().as_bytes()), (!zero).then_some(context));
        }

        /// A valid header with one byte changed (or cut, or extended) reads as a
        /// context only when it is still valid, and then writes back as itself in
        /// version 00; no input panics.
        #[test]
        fn a_changed_header_reads_back_as_written_or_not_at_all(
            trace in any::<[u8; 16]>(),
            at in 0usize..60,
            byte in prop_oneof![Just(b'-'), Just(b'0'), Just(b'f'), Just(b'F'), Just(b'g'), any::<u8>()],
            cut in any::<bool>(),
        ) {
            let valid = TraceContext { trace_id: trace, span_id: [7; 8], flags: 1 }.header_value().into_bytes();
            let mut bytes = valid.clone();
            match (cut, at < bytes.len()) {
                (true, _) => bytes.truncate(at),
                (false, true) => bytes[at] = byte,
                (false, false) => bytes.push(byte),
            }
            if let Some(context) = TraceContext::parse(&bytes) {
                let written = context.header_value();
                prop_assert_eq!(&written.as_bytes()[3..], &bytes[3..55]);
                prop_assert!(bytes == valid || context != TraceContext::parse(&valid).unwrap() || at < 2);
            }
        }
    }
}
