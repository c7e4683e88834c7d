//! What one phase of `tally-bench read` cost the machine, and where its tail was:
//! the cores each process kept busy, and the share of reads that took over 1 ms and
//! over 5 ms (the two bars) inside tally-query, by its own latency histogram
//! (`tally_query_request_seconds`, from the request's handler to its answer, the
//! counter's hop included). A tail the clients see and tally-query does not is spent
//! outside the read path: in waking the clients and its own thread, on the cores the
//! broker and the other services share.

use std::time::Instant;

use crate::cpu::CpuWatch;
use crate::pipeline::{find_series, sum_series};

/// What a phase's line says when tally-query's histogram counted no reads.
const NONE_COUNTED: &str = "no reads counted in tally_query_request_seconds";

/// The histogram's counts of one endpoint at one moment; a bucket it does not
/// expose is `None` (none before the endpoint's first read, or a histogram whose
/// bounds changed: then its share is said to be unknown, not read as zero).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tail {
    pub reads: f64,
    pub within_1ms: Option<f64>,
    pub within_5ms: Option<f64>,
}

impl Tail {
    /// The counts of `endpoint` in a Prometheus text exposition of tally-query's
    /// metrics (no reads and no buckets before its first read).
    pub fn parse(text: &str, endpoint: &str) -> Self {
        let endpoint = format!("endpoint=\"{endpoint}\"");
        let has = |labels: &str, label: &str| labels.trim_matches(['{', '}']).split(',').any(|one| one == label);
        let within = |le: &str| {
            let le = format!("le=\"{le}\"");
            let labelled = |labels: &str| has(labels, &endpoint) && has(labels, &le);
            find_series(text, "tally_query_request_seconds_bucket", labelled)
        };
        Self {
            reads: sum_series(text, "tally_query_request_seconds_count", |labels| has(labels, &endpoint)),
            within_1ms: within("0.001"),
            within_5ms: within("0.005"),
        }
    }

    /// `X % over 1 ms, Y % over 5 ms` of the reads between `before` and `self`; or
    /// that the histogram counted none (a phase that read: tally-query did not expose
    /// it under this name, which is then said rather than read as "no slow reads").
    pub fn shares_since(&self, before: &Self) -> String {
        let reads = self.reads - before.reads;
        if reads <= 0.0 {
            return NONE_COUNTED.into();
        }
        let over = |bound: &str, within: Option<f64>, within_before: Option<f64>| match within {
            Some(within) => {
                format!("{:.2} % over {bound}", 100.0 * (reads - (within - within_before.unwrap_or(0.0))) / reads)
            }
            None => format!("no {bound} bucket in tally_query_request_seconds"),
        };
        format!(
            "{}, {}",
            over("1 ms", self.within_1ms, before.within_1ms),
            over("5 ms", self.within_5ms, before.within_5ms)
        )
    }
}

/// Started before a phase, finished after it.
pub struct PhaseWatch {
    cpu: CpuWatch,
    started: Instant,
    endpoint: &'static str,
    before: Tail,
}

impl PhaseWatch {
    /// `processes` by name and pid; `metrics` is tally-query's exposition now.
    pub fn start(processes: &[(&'static str, u32)], endpoint: &'static str, metrics: &str) -> Self {
        let before = Tail::parse(metrics, endpoint);
        Self { cpu: CpuWatch::start(processes), started: Instant::now(), endpoint, before }
    }

    /// The phase's line: inside tally-query's share of slow reads, and the cores
    /// each process kept busy.
    pub fn finish(&self, metrics: &str) -> String {
        format!(
            "    inside tally-query: {}; cores busy: {}",
            Tail::parse(metrics, self.endpoint).shares_since(&self.before),
            self.cpu.divided(self.started.elapsed().as_secs_f64(), "")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposition(counter: [u64; 3], batch: [u64; 3]) -> String {
        let mut text = String::from("# HELP tally_query_request_seconds Read latency per endpoint\n");
        for (endpoint, [within_1ms, within_5ms, reads]) in [("counter", counter), ("batch", batch)] {
            for (le, count) in
                [("0.0005", within_1ms / 2), ("0.001", within_1ms), ("0.005", within_5ms), ("+Inf", reads)]
            {
                text += &format!("tally_query_request_seconds_bucket{{endpoint=\"{endpoint}\",le=\"{le}\"}} {count}\n");
            }
            text += &format!("tally_query_request_seconds_sum{{endpoint=\"{endpoint}\"}} 0.5\n");
            text += &format!("tally_query_request_seconds_count{{endpoint=\"{endpoint}\"}} {reads}\n");
        }
        text
    }

    #[test]
    fn reads_one_endpoints_counts_and_the_shares_between_two_moments() {
        let before = exposition([90, 99, 100], [10, 20, 30]);
        let after = exposition([1_080, 1_097, 1_100], [10, 20, 30]);
        let (start, end) = (Tail::parse(&before, "counter"), Tail::parse(&after, "counter"));
        assert_eq!(start, Tail { reads: 100.0, within_1ms: Some(90.0), within_5ms: Some(99.0) });
        assert_eq!(end, Tail { reads: 1_100.0, within_1ms: Some(1_080.0), within_5ms: Some(1_097.0) });
        // 1 000 reads: 10 over 1 ms, 2 over 5 ms.
        assert_eq!(end.shares_since(&start), "1.00 % over 1 ms, 0.20 % over 5 ms");
        assert_eq!(Tail::parse(&after, "batch"), Tail { reads: 30.0, within_1ms: Some(10.0), within_5ms: Some(20.0) });
        assert_eq!(Tail::parse(&after, "batch").shares_since(&Tail::parse(&before, "batch")), NONE_COUNTED);
    }

    /// The first read of an endpoint creates its series: before it, nothing counts.
    /// A histogram without a 1 ms bound says so rather than "100 % over 1 ms".
    #[test]
    fn a_bucket_the_histogram_does_not_have_is_said_to_be_missing() {
        let before = Tail::parse("", "counter");
        assert_eq!(before, Tail::default());
        let after = exposition([1_080, 1_097, 1_100], [10, 20, 30]);
        assert_eq!(
            Tail::parse(&after, "counter").shares_since(&before),
            "1.82 % over 1 ms, 0.27 % over 5 ms",
            "from no series at all"
        );
        let without_1ms: String =
            after.lines().filter(|line| !line.contains("le=\"0.001\"")).map(|line| format!("{line}\n")).collect();
        assert_eq!(
            Tail::parse(&without_1ms, "counter").shares_since(&before),
            "no 1 ms bucket in tally_query_request_seconds, 0.27 % over 5 ms"
        );
    }

    #[test]
    fn an_exposition_before_the_first_read_counts_nothing() {
        let text = "# HELP tally_query_request_seconds Read latency per endpoint\n# TYPE tally_query_request_seconds histogram\n";
        assert_eq!(Tail::parse(text, "counter"), Tail::default());
        assert_eq!(
            Tail::parse("", "counter").shares_since(&Tail::default()),
            "no reads counted in tally_query_request_seconds"
        );
    }
}
