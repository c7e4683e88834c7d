//! The OTLP trace request (`ExportTraceServiceRequest` of opentelemetry-proto's
//! `collector/trace/v1`), encoded by hand in the protobuf wire format: the handful
//! of messages tally sends do not need a code generator. Field numbers are the
//! `.proto` files'; the e2e receiver decodes with independently declared messages.

use tally_core::trace::{Span, Value};

/// The instrumentation scope every span is reported under.
const SCOPE: &str = "tally";
/// `SpanFlags`: the W3C trace flags, plus for links "whether the context is remote"
/// (known) and "it is": a link always points at another process's span.
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LENGTH_DELIMITED: u8 = 2;
const FIXED32: u8 = 5;

fn varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push((value as u8) | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

fn tag(buf: &mut Vec<u8>, field: u32, wire_type: u8) {
    varint(buf, (u64::from(field) << 3) | u64::from(wire_type));
}

fn bytes(buf: &mut Vec<u8>, field: u32, value: &[u8]) {
    tag(buf, field, LENGTH_DELIMITED);
    varint(buf, value.len() as u64);
    buf.extend_from_slice(value);
}

fn message(buf: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    body(&mut inner);
    bytes(buf, field, &inner);
}

fn uint(buf: &mut Vec<u8>, field: u32, value: u64) {
    tag(buf, field, VARINT);
    varint(buf, value);
}

fn fixed64(buf: &mut Vec<u8>, field: u32, value: u64) {
    tag(buf, field, FIXED64);
    buf.extend_from_slice(&value.to_le_bytes());
}

fn fixed32(buf: &mut Vec<u8>, field: u32, value: u32) {
    tag(buf, field, FIXED32);
    buf.extend_from_slice(&value.to_le_bytes());
}

/// `KeyValue { key = 1; AnyValue value = 2 }`, `AnyValue { string_value = 1; int_value = 3 }`.
fn key_value(buf: &mut Vec<u8>, field: u32, key: &str, value: &Value) {
    message(buf, field, |kv| {
        bytes(kv, 1, key.as_bytes());
        message(kv, 2, |any| match value {
            Value::Str(text) => bytes(any, 1, text.as_bytes()),
            // int64 in a varint: a negative number as its two's complement.
            Value::Int(number) => uint(any, 3, *number as u64),
        });
    });
}

/// `Span` of `trace/v1/trace.proto`.
fn span(buf: &mut Vec<u8>, span: &Span) {
    bytes(buf, 1, &span.context.trace_id);
    bytes(buf, 2, &span.context.span_id);
    if let Some(parent) = &span.parent {
        bytes(buf, 4, parent);
    }
    bytes(buf, 5, span.name.as_bytes());
    uint(buf, 6, span.kind as u64);
    fixed64(buf, 7, span.start_unix_nanos);
    fixed64(buf, 8, span.end_unix_nanos);
    for (key, value) in &span.attributes {
        key_value(buf, 9, key, value);
    }
    for link in &span.links {
        // Link { trace_id = 1; span_id = 2; flags = 6 }
        message(buf, 13, |out| {
            bytes(out, 1, &link.trace_id);
            bytes(out, 2, &link.span_id);
            fixed32(out, 6, u32::from(link.flags) | HAS_IS_REMOTE | IS_REMOTE);
        });
    }
    if span.dropped_links > 0 {
        uint(buf, 14, u64::from(span.dropped_links));
    }
    if let Some(error) = &span.error {
        // Status { message = 2; code = 3 (STATUS_CODE_ERROR = 2) }
        message(buf, 15, |status| {
            bytes(status, 2, error.as_bytes());
            uint(status, 3, 2);
        });
    }
    // The W3C flags; whether the parent is remote is left unknown (no HAS_IS_REMOTE).
    fixed32(buf, 16, u32::from(span.context.flags));
}

/// `ExportTraceServiceRequest { repeated ResourceSpans resource_spans = 1 }` of one
/// resource (this process: `resource`'s attributes) and one scope.
pub fn export_request(resource: &[(&str, Value)], spans: &[Span]) -> Vec<u8> {
    let mut buf = Vec::new();
    message(&mut buf, 1, |resource_spans| {
        // Resource { repeated KeyValue attributes = 1 }
        message(resource_spans, 1, |out| {
            for (key, value) in resource {
                key_value(out, 1, key, value);
            }
        });
        // ScopeSpans { InstrumentationScope scope = 1 { name = 1; version = 2 }; repeated Span spans = 2 }
        message(resource_spans, 2, |scope_spans| {
            message(scope_spans, 1, |scope| {
                bytes(scope, 1, SCOPE.as_bytes());
                bytes(scope, 2, env!("CARGO_PKG_VERSION").as_bytes());
            });
            for one in spans {
                message(scope_spans, 2, |out| span(out, one));
            }
        });
    });
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_are_base_128_little_end_first() {
        let encoded = |value: u64| {
            let mut buf = Vec::new();
            varint(&mut buf, value);
            buf
        };
        assert_eq!(encoded(0), [0]);
        assert_eq!(encoded(1), [1]);
        assert_eq!(encoded(300), [0xac, 0x02]);
        assert_eq!(encoded(u64::MAX), [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
        let mut buf = Vec::new();
        uint(&mut buf, 6, 5);
        assert_eq!(buf, [0x30, 5], "field 6, varint");
        buf.clear();
        fixed64(&mut buf, 7, 1);
        assert_eq!(buf, [0x39, 1, 0, 0, 0, 0, 0, 0, 0], "field 7, fixed64");
    }
}
