//! CPU time of processes from `/proc` (Linux), so a benchmark can say what each
//! process spent per unit of work: a figure that does not depend on how the cores
//! were shared, unlike a rate measured on a machine that runs the broker too.

/// User + system CPU seconds `pid` has used so far; `None` when it is gone or this
/// is not Linux.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count the
    // fields after its closing one. utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks as f64 / per_second as f64)
}

/// CPU seconds of named processes between [`CpuWatch::start`] and
/// [`CpuWatch::spent`].
pub struct CpuWatch {
    start: Vec<(&'static str, u32, Option<f64>)>,
}

impl CpuWatch {
    pub fn start(processes: &[(&'static str, u32)]) -> Self {
        Self { start: processes.iter().map(|&(name, pid)| (name, pid, cpu_seconds(pid))).collect() }
    }

    /// Each process's CPU seconds since the start (`None` when unknown).
    pub fn spent(&self) -> Vec<(&'static str, Option<f64>)> {
        self.start
            .iter()
            .map(|&(name, pid, start)| (name, start.zip(cpu_seconds(pid)).map(|(before, now)| now - before)))
            .collect()
    }

    /// The CPU seconds of every process together, if each is known.
    pub fn total(&self) -> Option<f64> {
        self.spent().iter().map(|(_, spent)| *spent).sum()
    }

    /// `name 0.52 s, …` per `per` units of work.
    pub fn per_unit(&self, per: f64) -> String {
        self.divided(per, " s")
    }

    /// `name 0.52{suffix}, …`: each process's CPU seconds divided by `by` (units of
    /// work, or the seconds watched for the cores kept busy).
    pub fn divided(&self, by: f64, suffix: &str) -> String {
        self.spent()
            .iter()
            .map(|(name, spent)| match spent {
                Some(seconds) => format!("{name} {:.2}{suffix}", seconds / by.max(1e-9)),
                None => format!("{name} unknown"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // This thread's CPU seconds, by another clock than `/proc`'s.
    use crate::counter_apply::thread_cpu_seconds as thread_cpu;

    #[test]
    fn counts_the_cpu_a_process_spends() {
        let me = std::process::id();
        let watch = CpuWatch::start(&[("me", me), ("nobody", u32::MAX)]);
        let (started, wall) = (thread_cpu(), std::time::Instant::now());
        let mut spin = 0u64;
        while thread_cpu() - started < 0.3 {
            spin = std::hint::black_box(spin.wrapping_add(1));
        }
        let spent = watch.spent();
        assert_eq!(spent.len(), 2);
        assert_eq!(spent[0].0, "me");
        // At least this thread's 0.3 s (less the clock's 10 ms ticks); other tests'
        // threads may add theirs, at most every core for as long as it took.
        let mine = spent[0].1.expect("this process's CPU time");
        let most = 0.3 + 0.02 + wall.elapsed().as_secs_f64() * num_cpus();
        assert!(mine >= 0.28 && mine <= most, "spent {mine} s, expected 0.28..{most}");
        assert_eq!(spent[1], ("nobody", None));
        assert!(watch.per_unit(0.5).starts_with("me "), "{}", watch.per_unit(0.5));
        assert!(watch.per_unit(0.5).ends_with(", nobody unknown"), "{}", watch.per_unit(0.5));
    }

    fn num_cpus() -> f64 {
        std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
    }
}
