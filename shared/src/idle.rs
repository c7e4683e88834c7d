//! How many of the cores this process may use sat idle over a span — so that a loop
//! can take on helper threads only where a core would otherwise go unused (a
//! counter's apply loop: `counter.apply_threads`).
//!
//! On Linux the kernel's account of every CPU's time (`/proc/stat`) says it, summed
//! over the CPUs the thread may run on (its affinity: a container pinned to some
//! cores sees those). A CPU quota (a container's `cpu.max`) is not in it: there the
//! caller's cap, [`std::thread::available_parallelism`], which follows the quota,
//! keeps a container of one CPU without helpers. Elsewhere nothing is known, and a
//! loop works alone.

use std::time::{Duration, Instant};

/// The shortest span [`HelperGauge::joining`] reads the kernel's account over: its
/// clock ticks every 10 ms, and a read of `/proc/stat` costs tens of microseconds.
pub const MIN_LOOK: Duration = Duration::from_millis(20);

/// The CPU time of the cores the thread may run on, at one moment, in the kernel's
/// clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Idle, and waiting for I/O with nothing else to run.
    idle: u64,
    /// Every state's ticks, summed over the CPUs.
    total: u64,
    /// How many CPUs are summed.
    cpus: usize,
}

impl CpuTimes {
    /// Now, summed over `allowed` CPUs (`None`: every CPU), or `None` where the
    /// kernel does not say (not Linux, no `/proc`).
    pub fn now(allowed: Option<&[usize]>) -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?, allowed)
    }

    /// Reads `/proc/stat`'s text: a first line that sums the CPUs, then a line per
    /// CPU (`cpuN user nice system idle iowait irq softirq steal …`).
    fn parse(text: &str, allowed: Option<&[usize]>) -> Option<Self> {
        let mut lines = text.lines();
        if !lines.next()?.starts_with("cpu ") {
            return None;
        }
        let mut times = Self { idle: 0, total: 0, cpus: 0 };
        for line in lines.take_while(|line| line.starts_with("cpu")) {
            let mut fields = line.split_ascii_whitespace();
            let cpu: usize = fields.next()?.strip_prefix("cpu")?.parse().ok()?;
            if allowed.is_some_and(|allowed| allowed.binary_search(&cpu).is_err()) {
                continue;
            }
            let ticks: Vec<u64> = fields.take(8).map(|field| field.parse().ok()).collect::<Option<_>>()?;
            if ticks.len() < 5 {
                return None;
            }
            times.idle += ticks[3] + ticks[4];
            times.total += ticks.iter().sum::<u64>();
            times.cpus += 1;
        }
        (times.cpus > 0).then_some(times)
    }

    /// How many cores sat idle on average from `self` until `later`; `None` when no
    /// tick passed in between (too short a span to tell).
    pub fn idle_cores_until(&self, later: &CpuTimes) -> Option<f64> {
        let total = later.total.checked_sub(self.total).filter(|ticks| *ticks > 0)?;
        let idle = later.idle.saturating_sub(self.idle).min(total);
        Some(idle as f64 / total as f64 * later.cpus as f64)
    }
}

/// The CPUs the calling thread may run on (its affinity), in order; `None` where
/// not known.
fn allowed_cpus() -> Option<Vec<usize>> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed `cpu_set_t` is an empty set, and the kernel writes at
        // most its size into it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
            return None;
        }
        Some((0..libc::CPU_SETSIZE as usize).filter(|cpu| unsafe { libc::CPU_ISSET(*cpu, &set) }).collect())
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// How many helper threads a loop that runs on one thread of its own should start
/// for its next piece of work, at most `max_helpers`, given how many cores sat idle
/// while it waited for that work (its own core among them) and how many the process
/// may use (`usable`): one for each further core that sat idle at least half the
/// time. A helper that gets less than half a core would finish its share after the
/// others, and the work with it. (Where idleness is unknown, [`HelperGauge`] starts
/// none.)
pub fn helpers(idle_cores: f64, max_helpers: usize, usable: usize) -> usize {
    let further = (idle_cores - 0.5).floor().max(0.0) as usize;
    further.min(max_helpers).min(usable.saturating_sub(1))
}

/// Decides, piece of work by piece of work, how many helpers a loop starts
/// ([`helpers`]) from how idle its cores were while the loop waited for that piece
/// (a batch gathering), and, while the piece runs, how many more join it as cores
/// fall idle ([`HelperGauge::joining`]). A wait too short for the kernel's clock
/// (10 ms ticks) keeps the decision before; with `max_helpers` 0 nothing is read.
pub struct HelperGauge {
    max_helpers: usize,
    /// How many cores the process may use ([`std::thread::available_parallelism`]).
    usable: usize,
    /// When the last piece of work ended (the wait began).
    waiting_since: Option<CpuTimes>,
    /// While a piece of work runs: when it started or [`HelperGauge::joining`] last
    /// decided, by the kernel's account and by the clock.
    working_since: Option<(CpuTimes, Instant)>,
    helpers: usize,
    /// [`CpuTimes::now`] over the thread's CPUs, or what a test says.
    sample: Box<dyn FnMut() -> Option<CpuTimes> + Send>,
}

impl HelperGauge {
    /// For the calling thread (its affinity decides which CPUs count).
    pub fn new(max_helpers: usize) -> Self {
        let usable = std::thread::available_parallelism().map_or(1, usize::from);
        let allowed = if max_helpers > 0 { allowed_cpus() } else { None };
        Self::sampling(max_helpers, usable, move || CpuTimes::now(allowed.as_deref()))
    }

    fn sampling(max_helpers: usize, usable: usize, sample: impl FnMut() -> Option<CpuTimes> + Send + 'static) -> Self {
        let mut gauge = Self {
            max_helpers,
            usable,
            waiting_since: None,
            working_since: None,
            helpers: 0,
            sample: Box::new(sample),
        };
        gauge.done();
        gauge
    }

    /// The next piece of work starts: how many helpers it takes.
    pub fn starting(&mut self) -> usize {
        if self.max_helpers == 0 {
            return 0;
        }
        let now = (self.sample)();
        match (self.waiting_since, now) {
            (Some(since), Some(now)) => {
                if let Some(idle) = since.idle_cores_until(&now) {
                    self.helpers = helpers(idle, self.max_helpers, self.usable);
                }
            }
            _ => self.helpers = 0,
        }
        self.working_since = now.map(|now| (now, Instant::now()));
        self.helpers
    }

    /// While the work runs with `running` helpers: how many more to start now, one
    /// for each further core that sat idle at least half the time since it started
    /// or since the last look that decided (the loop's own core busy with it) — a
    /// batch that gathered while the machine was busy, and goes on after the others
    /// fell idle (the end of a backlog), or one that gathered at once (a rebuild).
    /// A look sooner than [`MIN_LOOK`] after that, or one the kernel's clock has
    /// not ticked twice per CPU for, decides nothing and keeps its span.
    pub fn joining(&mut self, running: usize) -> usize {
        let Some((since, at)) = self.working_since.filter(|_| running < self.max_helpers) else { return 0 };
        if at.elapsed() < MIN_LOOK {
            return 0;
        }
        let Some(now) = (self.sample)() else { return 0 };
        if now.total.saturating_sub(since.total) < 2 * now.cpus as u64 {
            return 0;
        }
        self.working_since = Some((now, Instant::now()));
        let Some(idle) = since.idle_cores_until(&now) else { return 0 };
        helpers(idle + 1.0, self.max_helpers, self.usable).saturating_sub(running)
    }

    /// The piece of work ended: the wait for the next begins.
    pub fn done(&mut self) {
        self.working_since = None;
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
                        cpu2 50 3 25 400 10 0 1 0 0 0\n\
                        intr 12345 0 0\n\
                        ctxt 999\n";

    #[test]
    fn reads_the_idle_and_total_ticks_of_the_cpus_allowed() {
        assert_eq!(CpuTimes::parse(STAT, None), Some(CpuTimes { idle: 920, total: 1_078, cpus: 2 }));
        assert_eq!(CpuTimes::parse(STAT, Some(&[2, 3])), Some(CpuTimes { idle: 410, total: 489, cpus: 1 }));
        assert_eq!(CpuTimes::parse(STAT, Some(&[1])), None, "none of its CPUs is listed");
        assert_eq!(CpuTimes::parse("intr 1 2\n", None), None);
        assert_eq!(CpuTimes::parse("cpu  1 2 3 4 5\ncpu0 1 2 3\n", None), None);
        assert_eq!(CpuTimes::parse("cpu  1 2 3 4 5\ncpu0 1 2 x 4 5\n", None), None);
        assert_eq!(CpuTimes::parse("cpu  1 2 3 4 5\ncpux 1 2 3 4 5\n", None), None);
        assert_eq!(CpuTimes::parse("", None), None);
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
    }

    #[test]
    fn the_thread_counts_the_cpus_it_may_run_on() {
        let Ok(text) = std::fs::read_to_string("/proc/stat") else { return };
        let allowed = allowed_cpus().expect("a thread's affinity where /proc/stat is");
        let listed = text.lines().filter(|line| line.starts_with("cpu") && !line.starts_with("cpu "));
        let numbers = listed.filter_map(|line| line.split_ascii_whitespace().next()?.strip_prefix("cpu")?.parse().ok());
        let cpus = numbers.filter(|cpu: &usize| allowed.contains(cpu)).count();
        assert_eq!(CpuTimes::now(Some(&allowed)).map(|now| now.cpus), Some(cpus).filter(|cpus| *cpus > 0));
    }

    #[test]
    fn a_helper_for_each_further_core_idle_half_the_time() {
        let cases =
            [(0.0, 3, 0), (1.0, 3, 0), (1.49, 3, 0), (1.5, 3, 1), (2.4, 3, 1), (2.5, 3, 2), (9.0, 3, 3), (9.0, 0, 0)];
        for (idle, max, expected) in cases {
            assert_eq!(helpers(idle, max, 64), expected, "{idle} idle cores, at most {max}");
        }
        assert_eq!(helpers(9.0, 3, 2), 1, "within the cores the process may use");
        assert_eq!(helpers(9.0, 3, 1), 0);
        assert_eq!(helpers(f64::NAN, 3, 64), 0);
    }

    /// A gauge whose samples add `idle` ticks out of `total`, step by step, on 2
    /// CPUs, and how many samples it took.
    fn scripted(max_helpers: usize, steps: Vec<(u64, u64)>) -> (HelperGauge, std::sync::Arc<std::sync::Mutex<usize>>) {
        let taken = std::sync::Arc::new(std::sync::Mutex::new(0));
        let seen = taken.clone();
        let mut times = CpuTimes { idle: 0, total: 0, cpus: 2 };
        let mut steps = steps.into_iter();
        let gauge = HelperGauge::sampling(max_helpers, 2, move || {
            *seen.lock().unwrap() += 1;
            let (idle, total) = steps.next()?;
            times = CpuTimes { idle: times.idle + idle, total: times.total + total, cpus: 2 };
            Some(times)
        });
        (gauge, taken)
    }

    #[test]
    fn the_gauge_follows_each_wait_and_keeps_its_decision_over_one_too_short_to_tell() {
        // Created (a sample), then per batch: the wait's ticks, the work's ticks.
        let steps = vec![(0, 0), (18, 20), (0, 40), (0, 0), (0, 40), (5, 20), (0, 40)];
        let (mut gauge, _) = scripted(1, steps);
        let mut decided = Vec::new();
        for _ in 0..3 {
            decided.push(gauge.starting());
            gauge.done();
        }
        assert_eq!(decided, vec![1, 1, 0], "1.8 idle cores, no tick, then 0.5");
        // The samples ran out: not known any more, so alone.
        assert_eq!(gauge.starting(), 0);

        let (mut none, taken) = scripted(0, vec![(40, 40)]);
        assert_eq!((none.starting(), none.starting()), (0, 0));
        none.done();
        assert_eq!(*taken.lock().unwrap(), 0, "without helpers to give, nothing is read");
    }

    #[test]
    fn helpers_join_work_under_way_once_a_further_core_sat_idle_half_the_time() {
        let wait_out = || std::thread::sleep(MIN_LOOK + Duration::from_millis(5));
        // Created, a busy wait, looks while the work runs; done, a busy wait, a look.
        let steps = vec![(0, 0), (0, 40), (1, 3), (19, 37), (0, 40), (0, 0), (1, 40), (20, 40)];
        let (mut gauge, taken) = scripted(2, steps);
        assert_eq!(gauge.starting(), 0, "the machine was busy as the work gathered");
        assert_eq!(gauge.joining(0), 0, "too soon to look");
        assert_eq!(*taken.lock().unwrap(), 2, "not read");
        wait_out();
        assert_eq!(gauge.joining(0), 0, "fewer than two ticks per CPU: too short to tell");
        wait_out();
        assert_eq!(gauge.joining(0), 1, "one further core idle half the time since the work started");
        assert_eq!(gauge.joining(1), 0, "too soon after that look");
        wait_out();
        assert_eq!(gauge.joining(1), 0, "busy since the last look");
        gauge.done();
        assert_eq!(gauge.starting(), 0, "the wait: 1 idle tick of 40");
        wait_out();
        assert_eq!(gauge.joining(0), 1);
        gauge.done();
        wait_out();
        assert_eq!(gauge.joining(0), 0, "no work under way");

        let (mut alone, taken) = scripted(0, vec![(40, 40)]);
        alone.starting();
        wait_out();
        assert_eq!(alone.joining(0), 0);
        assert_eq!(*taken.lock().unwrap(), 0, "without helpers to give, nothing is read");
    }
}
