//! The idempotency window of a stateful service's RocksDB: marks of the producer
//! ids it applied, each holding the time of the record that first carried it, kept
//! for the dedupe window and dropped by a compaction filter afterwards.
//!
//! Time here is the records' own (their Kafka timestamps, which the ingester sets to
//! the producer's record time), never the apply time: a retry produced within the
//! window is a duplicate however late it is applied — after a long backlog, or when
//! a store is rebuilt from the log. A mark expires by the *stream time of its own
//! source* (the latest record time applied from that input partition, as Kafka
//! Streams' windowed stores expire by stream time), and only once the wall clock
//! agrees: a retry comes through the same partition as its original (same key), so
//! neither a lagging partition beside live ones, nor a producer's skewed clock, drops
//! a mark its retry still needs.
//!
//! A store without the WAL ([`crate::store::Durability::InputLog`]) can lose the
//! commits after its last flush and replay their records; a mark expired by a stream
//! time those commits set could then be missing for a retry among them. Its window
//! ([`DedupeWindow::until_flushed`]) expires marks only by the stream times of the
//! last flush it was told of ([`DedupeWindow::flushed`]).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use rocksdb::compaction_filter::Decision;

use crate::lock::{read, write};
use crate::Result;
use tally_core::wire::Source;

/// What [`DedupeWindow::stream_time`]'s and [`DedupeWindow::flushed`]'s locks
/// guard ([`crate::lock`]).
const STREAM_TIME: &str = "a dedupe window's stream times";
const FLUSHED: &str = "a dedupe window's stream times as of the last flush";

/// The window and the stream time of each source it expires marks by.
#[derive(Debug, Clone)]
pub struct DedupeWindow {
    window_ms: i64,
    /// Per source; a source not seen since opening expires nothing.
    stream_time: Arc<RwLock<HashMap<Source, i64>>>,
    /// What marks expire by, for a store whose commits wait in memtables for a
    /// flush: the stream times as of its last flush. `None`: `stream_time`.
    flushed: Option<Arc<RwLock<HashMap<Source, i64>>>>,
}

impl DedupeWindow {
    pub fn new(window_ms: i64) -> Self {
        Self { window_ms, stream_time: Arc::default(), flushed: None }
    }

    /// A window that expires marks only by the stream times of the last flush
    /// ([`DedupeWindow::flushed`]): none until the first.
    pub fn until_flushed(window_ms: i64) -> Self {
        Self { flushed: Some(Arc::default()), ..Self::new(window_ms) }
    }

    /// The stream times of what was committed so far: taken before a flush, they
    /// are at most those of what it wrote.
    pub fn stream_times(&self) -> HashMap<Source, i64> {
        read(&self.stream_time, STREAM_TIME).clone()
    }

    /// A flush wrote the commits whose stream times are `times` (taken before it):
    /// marks may now expire by them.
    pub fn flushed(&self, times: HashMap<Source, i64>) {
        if let Some(flushed) = &self.flushed {
            *write(flushed, FLUSHED) = times;
        }
    }

    /// The value of a mark first seen in a record of `source` at `record_time`
    /// ([`tally_core::keys::encode_mark`]).
    pub fn mark(record_time: i64, source: Source) -> [u8; 14] {
        tally_core::keys::encode_mark(record_time, source)
    }

    fn decode(mark: &[u8]) -> Result<(i64, Source)> {
        Ok(tally_core::keys::decode_mark(mark)?)
    }

    /// Whether a record at `record_time` whose id has the stored `mark` repeats it:
    /// the mark is younger than the window at that time. (A record older than the
    /// mark — producers' clocks differ — is within it too.) A malformed mark is an
    /// error: neither "seen" nor "new" would be safe.
    pub fn repeats(&self, mark: &[u8], record_time: i64) -> Result<bool> {
        let (time, _) = Self::decode(mark)?;
        Ok(self.within(time, record_time))
    }

    /// Whether a record at `record_time` repeats an id whose mark holds `mark_time`
    /// ([`DedupeWindow::repeats`] for a mark not decoded, or not stored yet).
    pub fn within(&self, mark_time: i64, record_time: i64) -> bool {
        mark_time.saturating_add(self.window_ms) > record_time
    }

    /// Moves `source`'s stream time forward to `record_time` (never back); call
    /// after the batch holding that record is committed.
    pub fn advance(&self, source: Source, record_time: i64) {
        let mut times = write(&self.stream_time, STREAM_TIME);
        let time = times.entry(source).or_insert(record_time);
        *time = (*time).max(record_time);
    }

    /// The compaction filter of the marks' column family.
    pub fn compaction_filter(&self) -> impl Fn(u32, &[u8], &[u8]) -> Decision + Send + 'static {
        let window = self.clone();
        move |_level, _key, mark| {
            // A malformed mark stays, for the lookup that meets it to fail loudly.
            let Ok((time, source)) = Self::decode(mark) else { return Decision::Keep };
            let (times, name) = match &window.flushed {
                Some(flushed) => (flushed, FLUSHED),
                None => (&window.stream_time, STREAM_TIME),
            };
            let source_time = read(times, name).get(&source).copied();
            let Some(source_time) = source_time else { return Decision::Keep };
            if window.within(time, source_time.min(crate::kafka::now_ms())) {
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
        let mark = DedupeWindow::mark(1_000, A);
        assert!(window.repeats(&mark, 1_009).unwrap());
        assert!(!window.repeats(&mark, 1_010).unwrap());
        assert!(window.repeats(&mark, 990).unwrap(), "an earlier record time is within the window");
        assert!(window.repeats(&1_000i64.to_le_bytes(), 1_009).is_err(), "an unversioned mark");
    }

    const A: Source = Source { stream: Source::INCREMENTS, partition: 0 };
    const B: Source = Source { stream: Source::INCREMENTS, partition: 5 };

    /// Whether `window`'s compaction filter keeps a mark.
    fn keeps(window: &DedupeWindow) -> impl Fn(&[u8]) -> bool {
        let filter = window.compaction_filter();
        move |mark| matches!(filter(0, b"k", mark), Decision::Keep)
    }

    #[test]
    fn marks_expire_by_their_own_sources_stream_time_and_the_wall_clock() {
        let window = DedupeWindow::new(10);
        let keep = keeps(&window);
        let lagging = DedupeWindow::mark(1_000, B);
        assert!(keep(&lagging), "no record of B applied since opening");
        window.advance(A, 5_000_000);
        assert!(keep(&lagging), "a live partition beside a lagging one expires none of its marks");
        window.advance(B, 1_005);
        assert!(keep(&lagging), "within the window of B's stream time");
        window.advance(B, 1_010);
        window.advance(B, 3);
        assert!(!keep(&lagging), "B's stream time passed it, and never moves back");
        let future = DedupeWindow::mark(i64::MAX - 20, A);
        window.advance(A, i64::MAX);
        assert!(keep(&future), "the wall clock has not passed it");
        assert!(keep(&1_000i64.to_le_bytes()), "a malformed mark stays for its lookup to fail");
    }

    #[test]
    fn a_window_until_flushed_expires_marks_by_the_stream_time_of_the_last_flush() {
        let window = DedupeWindow::until_flushed(10);
        let keep = keeps(&window);
        let mark = DedupeWindow::mark(1_000, A);
        window.advance(A, 1_005);
        let before_flush = window.stream_times();
        window.advance(A, 5_000);
        assert!(keep(&mark), "applied past the window, but nothing flushed yet");
        window.flushed(before_flush);
        assert!(keep(&mark), "the flush wrote commits up to 1 005 only");
        window.flushed(window.stream_times());
        assert!(!keep(&mark), "a flush wrote the commit at 5 000");
    }
}
