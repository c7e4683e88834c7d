//! How much of the machine's CPU sat idle over a span, in cores — so that a loop can
//! take on helper threads only where a core would otherwise go unused (a counter's
//! apply loop: `counter.apply_threads`).
//!
//! On Linux the kernel's account of every CPU's time (`/proc/stat`) says it; it is
//! the whole machine's, so inside a container it counts other tenants' idle cores
//! too, which is why a caller also caps its threads by
//! [`std::thread::available_parallelism`] (which follows the container's CPU quota).
//! Elsewhere nothing is known and callers keep what they were configured with.

/// The machine's CPU time at one moment, in the kernel's clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Idle, and waiting for I/O with nothing else to run.
    idle: u64,
    /// Every state's ticks, summed over the CPUs.
    total: u64,
    /// How many CPUs the kernel counts.
    cpus: usize,
}

impl CpuTimes {
    /// Now, or `None` where the kernel does not say (not Linux, no `/proc`). Reads
    /// `/proc/stat` up to the end of its CPU lines only (the interrupt counts after
    /// them run to kilobytes on big machines).
    pub fn now() -> Option<Self> {
        use std::io::BufRead;
        let file = std::io::BufReader::new(std::fs::File::open("/proc/stat").ok()?);
        let lines = file.lines().map_while(Result::ok).take_while(|line| line.starts_with("cpu"));
        Self::parse(lines)
    }

    /// Reads `/proc/stat`'s lines: the first sums the CPUs (`cpu user nice system
    /// idle iowait irq softirq steal …`), a `cpuN` line follows for each.
    fn parse<S: AsRef<str>>(lines: impl IntoIterator<Item = S>) -> Option<Self> {
        let mut lines = lines.into_iter();
        let first = lines.next()?;
        let mut fields = first.as_ref().split_ascii_whitespace();
        if fields.next()? != "cpu" {
            return None;
        }
        let ticks: Vec<u64> = fields.take(8).map(|field| field.parse().ok()).collect::<Option<_>>()?;
        if ticks.len() < 5 {
            return None;
        }
        let cpus = lines.take_while(|line| line.as_ref().starts_with("cpu")).count();
        Some(Self { idle: ticks[3] + ticks[4], total: ticks.iter().sum(), cpus: cpus.max(1) })
    }

    /// How many cores sat idle on average from `self` until `later`; `None` when no
    /// tick passed in between (too short a span to tell).
    pub fn idle_cores_until(&self, later: &CpuTimes) -> Option<f64> {
        let total = later.total.checked_sub(self.total).filter(|ticks| *ticks > 0)?;
        let idle = later.idle.saturating_sub(self.idle).min(total);
        Some(idle as f64 / total as f64 * later.cpus as f64)
    }
}

/// How many helper threads a loop that runs on one thread of its own should start
/// for its next piece of work, at most `max_helpers`, given how many cores sat idle
/// while it waited for that work (its own core among them; `None`: unknown, so
/// `max_helpers`): one for each further core that sat idle at least half the time,
/// and none where the process may use only one core. A helper that gets less than
/// half a core would finish its share after the others, and the work with it.
pub fn helpers(idle_cores: Option<f64>, max_helpers: usize) -> usize {
    let usable = std::thread::available_parallelism().map_or(usize::MAX, usize::from);
    let Some(idle) = idle_cores else { return max_helpers.min(usable.saturating_sub(1)) };
    let further = (idle - 0.5).floor().max(0.0) as usize;
    further.min(max_helpers).min(usable.saturating_sub(1))
}

/// Decides, piece of work by piece of work, how many helpers a loop starts
/// ([`helpers`]) from how idle the machine was while the loop waited for that piece
/// (a batch gathering). A wait too short for the kernel's clock (10 ms ticks) keeps
/// the decision before; with `max_helpers` 0 nothing is read.
pub struct HelperGauge {
    max_helpers: usize,
    /// When the last piece of work ended (the wait began).
    waiting_since: Option<CpuTimes>,
    helpers: usize,
    /// [`CpuTimes::now`], or what a test says.
    sample: Box<dyn FnMut() -> Option<CpuTimes> + Send>,
}

impl HelperGauge {
    pub fn new(max_helpers: usize) -> Self {
        Self::sampling(max_helpers, CpuTimes::now)
    }

    fn sampling(max_helpers: usize, sample: impl FnMut() -> Option<CpuTimes> + Send + 'static) -> Self {
        let mut gauge = Self { max_helpers, waiting_since: None, helpers: 0, sample: Box::new(sample) };
        gauge.done();
        gauge
    }

    /// The next piece of work starts: how many helpers it takes.
    pub fn starting(&mut self) -> usize {
        if self.max_helpers == 0 {
            return 0;
        }
        match (self.waiting_since, (self.sample)()) {
            (Some(since), Some(now)) => {
                if let Some(idle) = since.idle_cores_until(&now) {
                    self.helpers = helpers(Some(idle), self.max_helpers);
                }
            }
            _ => self.helpers = helpers(None, self.max_helpers),
        }
        self.helpers
    }

    /// The piece of work ended: the wait for the next begins.
    pub fn done(&mut self) {
        if self.max_helpers > 0 {
            self.waiting_since = (self.sample)();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  100 5 50 1000 20 1 2 0 0 0\n\
                        cpu0 50 2 25 500 10 1 1 0 0 0\n\
                        cpu1 50 3 25 500 10 0 1 0 0 0\n\
                        intr 12345 0 0\n\
                        ctxt 999\n";

    #[test]
    fn reads_the_idle_and_total_ticks_of_every_cpu() {
        let parse = |text: &str| CpuTimes::parse(text.lines());
        assert_eq!(parse(STAT), Some(CpuTimes { idle: 1_020, total: 1_178, cpus: 2 }));
        assert_eq!(parse("intr 1 2\n"), None);
        assert_eq!(parse("cpu 1 2 3\ncpu0 1 2 3\n"), None);
        assert_eq!(parse("cpu 1 2 x 4 5\n"), None);
        assert_eq!(parse(""), None);
    }

    #[test]
    fn idle_cores_are_the_idle_share_of_the_ticks_times_the_cpus() {
        let before = CpuTimes { idle: 1_000, total: 2_000, cpus: 2 };
        let later = |idle: u64, busy: u64| CpuTimes { idle: 1_000 + idle, total: 2_000 + idle + busy, cpus: 2 };
        assert_eq!(before.idle_cores_until(&later(30, 10)), Some(1.5));
        assert_eq!(before.idle_cores_until(&later(0, 40)), Some(0.0));
        assert_eq!(before.idle_cores_until(&later(40, 0)), Some(2.0));
        assert_eq!(before.idle_cores_until(&before), None, "no tick passed");
        assert_eq!(later(5, 5).idle_cores_until(&before), None, "the clock never runs back");
        if cfg!(target_os = "linux") {
            let text = std::fs::read_to_string("/proc/stat").unwrap();
            let cpus = text.lines().filter(|line| line.starts_with("cpu") && !line.starts_with("cpu ")).count();
            assert_eq!(CpuTimes::now().map(|now| now.cpus), Some(cpus));
        }
    }

    #[test]
    fn a_helper_for_each_further_core_idle_half_the_time() {
        let usable = std::thread::available_parallelism().map_or(usize::MAX, usize::from);
        let capped = |helpers: usize| helpers.min(usable - 1);
        let cases =
            [(0.0, 3, 0), (1.0, 3, 0), (1.49, 3, 0), (1.5, 3, 1), (2.4, 3, 1), (2.5, 3, 2), (9.0, 3, 3), (9.0, 0, 0)];
        for (idle, max, expected) in cases {
            assert_eq!(helpers(Some(idle), max), capped(expected), "{idle} idle cores, at most {max}");
        }
        assert_eq!(helpers(None, 3), capped(3), "unknown: as configured");
        assert_eq!(helpers(Some(f64::NAN), 3), 0);
    }

    /// A gauge whose samples are `idle` ticks out of `total` per wait or piece of
    /// work, in turn, on 2 CPUs.
    fn scripted(max_helpers: usize, steps: Vec<(u64, u64)>) -> (HelperGauge, std::sync::Arc<std::sync::Mutex<usize>>) {
        let taken = std::sync::Arc::new(std::sync::Mutex::new(0));
        let seen = taken.clone();
        let mut times = CpuTimes { idle: 0, total: 0, cpus: 2 };
        let mut steps = steps.into_iter();
        let gauge = HelperGauge::sampling(max_helpers, move || {
            *seen.lock().unwrap() += 1;
            let (idle, total) = steps.next()?;
            times = CpuTimes { idle: times.idle + idle, total: times.total + total, cpus: 2 };
            Some(times)
        });
        (gauge, taken)
    }

    #[test]
    fn the_gauge_follows_each_wait_and_keeps_its_decision_over_one_too_short_to_tell() {
        let usable = std::thread::available_parallelism().map_or(usize::MAX, usize::from);
        if usable < 2 {
            return;
        }
        // Created (a sample), then per batch: the wait's ticks, the work's ticks.
        let steps = vec![(0, 0), (18, 20), (0, 40), (0, 0), (0, 40), (5, 20), (0, 40)];
        let (mut gauge, _) = scripted(1, steps);
        let mut decided = Vec::new();
        for _ in 0..3 {
            decided.push(gauge.starting());
            gauge.done();
        }
        assert_eq!(decided, vec![1, 1, 0], "1.8 idle cores, no tick, then 0.5");
        // The samples ran out: not known any more, so as configured.
        assert_eq!(gauge.starting(), 1);

        let (mut none, taken) = scripted(0, vec![(40, 40)]);
        assert_eq!((none.starting(), none.starting()), (0, 0));
        none.done();
        assert_eq!(*taken.lock().unwrap(), 0, "without helpers to give, nothing is read");
    }
}
