//! The idempotency window of a stateful service's RocksDB: marks of the producer
//! ids it applied, each holding the time of the record that first carried it, kept
//! for the dedupe window and dropped by a compaction filter afterwards.
//!
//! Time here is the records' own (their Kafka timestamps, which the ingester sets to
//! the producer's record time), never the apply time: a retry produced within the
//! window is a duplicate however late it is applied — after a long backlog, or when
//! a store is rebuilt from the log. Marks expire by *stream time*, the latest record
//! time applied (as Kafka Streams' windowed stores do), and only once the wall clock
//! agrees, so neither a backlog nor a producer's skewed clock drops a mark early.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use rocksdb::compaction_filter::Decision;

use crate::progress::decode_i64;

/// The window and the stream time it expires marks by.
#[derive(Debug, Clone)]
pub struct DedupeWindow {
    window_ms: i64,
    /// Unknown (`i64::MIN`) until the first batch after opening: nothing expires
    /// before it.
    stream_time: Arc<AtomicI64>,
}

impl DedupeWindow {
    pub fn new(window_ms: i64) -> Self {
        Self { window_ms, stream_time: Arc::new(AtomicI64::new(i64::MIN)) }
    }

    /// The value of a mark first seen in a record at `record_time`.
    pub fn mark(record_time: i64) -> [u8; 8] {
        record_time.to_le_bytes()
    }

    /// Whether a record at `record_time` whose id has the stored `mark` repeats it:
    /// the mark is younger than the window at that time. (A record older than the
    /// mark — producers' clocks differ — is within it too.)
    pub fn repeats(&self, mark: &[u8], record_time: i64) -> bool {
        decode_i64(mark).saturating_add(self.window_ms) > record_time
    }

    /// Moves the stream time forward to `record_time` (never back); call after the
    /// batch holding that record is committed.
    pub fn advance(&self, record_time: i64) {
        self.stream_time.fetch_max(record_time, Ordering::Relaxed);
    }

    /// The compaction filter of the marks' column family.
    pub fn compaction_filter(&self) -> impl Fn(u32, &[u8], &[u8]) -> Decision + Send + 'static {
        let window = self.clone();
        move |_level, _key, mark| {
            let now = window.stream_time.load(Ordering::Relaxed).min(crate::kafka::now_ms());
            if window.repeats(mark, now) {
                Decision::Keep
            } else {
                Decision::Remove
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_repeat_within_the_window_of_record_time() {
        let window = DedupeWindow::new(10);
        let mark = DedupeWindow::mark(1_000);
        assert!(window.repeats(&mark, 1_009));
        assert!(!window.repeats(&mark, 1_010));
        assert!(window.repeats(&mark, 990), "an earlier record time is within the window");
    }

    #[test]
    fn marks_expire_by_stream_time_and_wall_clock_both() {
        let window = DedupeWindow::new(10);
        let filter = window.compaction_filter();
        let old = DedupeWindow::mark(1_000);
        assert!(matches!(filter(0, b"k", &old), Decision::Keep), "no record applied since opening");
        window.advance(1_005);
        assert!(matches!(filter(0, b"k", &old), Decision::Keep), "within the window of stream time");
        window.advance(1_010);
        window.advance(3);
        assert!(matches!(filter(0, b"k", &old), Decision::Remove), "stream time never moves back");
        let future = DedupeWindow::mark(i64::MAX - 20);
        window.advance(i64::MAX);
        assert!(matches!(filter(0, b"k", &future), Decision::Keep), "the wall clock has not passed it");
    }
}
