//! CPU scheduling hints per thread: threads that answer requests ask the kernel for
//! short time slices, threads that grind through backlogs keep its default.
//!
//! Linux's fair scheduler (EEVDF, 6.6 and later) gives every thread a slice of CPU
//! (1.4 ms by default on 2 cores); since 6.12 a thread may ask for a shorter one
//! (`sched_setattr`, `sched_runtime`: 0.1–100 ms). A shorter slice means an earlier
//! deadline, so a request thread that wakes up runs at once instead of waiting for
//! the thread on its core to use up its slice — while its share of the CPU stays
//! what its nice value gives it. On cores that the services share with each other
//! and the broker, that wait is what a read's p99 is made of (BENCHMARKS.md,
//! "Reads").
//!
//! Every service's runtime threads (async workers and the blocking pool) take
//! `runtime.latency_slice_us` ([`crate::service`]); threads and processes they start
//! inherit it. The loops that apply or move backlogs (a counter's batches and
//! rollups, the ingester's pipeline, the graph's processor, a dequeue broker's
//! fetcher) and what opens a RocksDB (whose background threads it starts) run on
//! threads of their own ([`background_thread`], [`spawn_background`]), which go back to the kernel's
//! default; a worker's job processes go back to it too. Elsewhere than Linux, and on
//! kernels before 6.12 (which accept the field and ignore it), the hints change
//! nothing ([`custom_slices`] tells). A thread under a real-time or idle policy
//! keeps it; a nice value and reset-on-fork set by the operator are kept.
//!
//! One loop also gives up part of its share: a counter's apply loop raises its nice
//! value ([`lower_priority`], `counter.apply_nice`), since its batches cost less per
//! increment the longer they wait, while the stages before it cannot catch up later.

use std::io;
use std::time::Duration;

use tokio::sync::oneshot;

/// Shortest slice the kernel grants (it clamps to 0.1–100 ms).
pub const MIN_SLICE: Duration = Duration::from_micros(100);
/// Longest slice the kernel grants.
pub const MAX_SLICE: Duration = Duration::from_millis(100);

/// Asks for `slice` as the calling thread's time slice (clamped to
/// [`MIN_SLICE`]..=[`MAX_SLICE`]; zero: the kernel's default).
pub fn set_slice(slice: Duration) -> io::Result<()> {
    let nanos = match slice.is_zero() {
        true => 0,
        false => slice.clamp(MIN_SLICE, MAX_SLICE).as_nanos() as u64,
    };
    linux::set_slice(nanos)
}

/// What came of asking for a slice ([`ask_for_slice`]).
#[derive(Debug)]
pub enum Asked {
    /// The thread runs on the slice asked for (or the kernel's default, asked for).
    Granted,
    /// Accepted and ignored: a kernel before 6.12, or not Linux.
    Ignored,
    /// Refused (a sandbox without the call): the thread keeps its slice.
    Refused(io::Error),
}

/// Asks for `slice` as the calling thread's time slice ([`set_slice`]) and reads
/// back what the kernel gave, so that logs and reports say what is so.
pub fn ask_for_slice(slice: Duration) -> Asked {
    match (set_slice(slice), self::slice()) {
        (Err(err), _) => Asked::Refused(err),
        _ if slice.is_zero() => Asked::Granted,
        (Ok(()), Some(granted)) if granted == slice.clamp(MIN_SLICE, MAX_SLICE) => Asked::Granted,
        (Ok(()), _) => Asked::Ignored,
    }
}

/// The calling thread's time slice now, as the kernel reports it: `None` where it
/// cannot be read, zero on kernels before 6.12.
pub fn slice() -> Option<Duration> {
    linux::slice(0).map(Duration::from_nanos)
}

/// Whether this kernel keeps a thread's own slice (Linux 6.12 or later): the
/// kernel's figure for a new thread is its default slice, never zero.
pub fn custom_slices() -> bool {
    std::thread::spawn(slice).join().ok().flatten().is_some_and(|slice| !slice.is_zero())
}

/// The highest nice value (the lowest priority) a thread can have.
pub const MAX_NICE: i32 = 19;

/// Raises the calling thread's nice value by `by` over what it has (an operator's
/// `nice` is the base), at most to [`MAX_NICE`]; returns the value it now has. A
/// thread with a higher nice value gets a smaller share of a busy CPU and the same
/// as any other on an idle one: for a stage whose work gets cheaper per record
/// when it lets records pile up (a counter's batches), so that the stages before
/// it keep pace with the broker. Only the calling thread changes (Linux keeps nice
/// values per thread), and threads it starts afterwards inherit it.
pub fn lower_priority(by: i32) -> io::Result<i32> {
    linux::lower_priority(by)
}

/// The calling thread's nice value now.
pub fn nice() -> io::Result<i32> {
    linux::nice()
}

/// Works through items on `threads` threads at once — the calling thread and
/// `threads - 1` helpers named `name`, which inherit its nice value and slice —
/// each taking the next item from `next` (its result; `None`: none are left) until
/// none are left. Between its own items the calling thread asks `join`, given how
/// many helpers run, how many more to start (cores that fell idle meanwhile).
/// Returns every item's result (the caller's first, then each helper's) and how
/// many threads ran. A helper that cannot be started is done without (said in a
/// warning); a panic in a helper comes back in the caller once the others are done.
pub fn on_threads<T: Send>(
    threads: usize,
    name: &str,
    mut join: impl FnMut(usize) -> usize,
    next: impl Fn() -> Option<T> + Sync,
) -> (Vec<T>, usize) {
    let next = &next;
    let work = move || std::iter::from_fn(next).collect::<Vec<T>>();
    std::thread::scope(|scope| {
        let mut helpers = Vec::new();
        let start = |helpers: &mut Vec<_>, count: usize| {
            for _ in 0..count {
                match std::thread::Builder::new().name(name.into()).spawn_scoped(scope, work) {
                    Ok(helper) => helpers.push(helper),
                    Err(err) => {
                        tracing::warn!(name, error = %err, "cannot start a helper thread; going on without it");
                        return;
                    }
                }
            }
        };
        start(&mut helpers, threads.saturating_sub(1));
        let mut results = Vec::new();
        while let Some(result) = next() {
            results.push(result);
            let more = join(helpers.len());
            start(&mut helpers, more);
        }
        let ran = 1 + helpers.len();
        for helper in helpers {
            results.extend(helper.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
        }
        (results, ran)
    })
}

/// Starts `work` on a new thread named `name` at the kernel's default slice (a loop
/// that applies or moves a backlog), whatever slice the caller has.
pub fn background_thread<T, F>(name: &str, work: F) -> io::Result<std::thread::JoinHandle<T>>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    std::thread::Builder::new().name(name.into()).spawn(move || {
        if let Err(err) = set_slice(Duration::ZERO) {
            tracing::debug!(error = %err, "a background thread keeps its parent's slice");
        }
        work()
    })
}

/// Runs `work` on a [`background_thread`], in the caller's runtime context as
/// `spawn_blocking` would, and waits for it without holding an async worker. A
/// panic in `work` comes back as its message.
pub async fn spawn_background<T, F>(name: &str, work: F) -> Result<T, String>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (done, finished) = oneshot::channel();
    let runtime = tokio::runtime::Handle::try_current().ok();
    let spawned = background_thread(name, move || {
        let _context = runtime.as_ref().map(|runtime| runtime.enter());
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        if done.send(result.map_err(|panic| panic_message(&*panic))).is_err() {
            tracing::debug!("a background thread's result is no longer waited for");
        }
    });
    if let Err(err) = spawned {
        return Err(format!("cannot start thread {name}: {err}"));
    }
    finished.await.unwrap_or_else(|_| Err(format!("thread {name} ended without a result")))
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let message = panic
        .downcast_ref::<&str>()
        .map(|text| text.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    format!("panicked: {message}")
}

#[cfg(target_os = "linux")]
mod linux {
    use std::io;

    /// `struct sched_attr` as of Linux 4.13 (`SCHED_ATTR_SIZE_VER0` is 48 bytes; the
    /// utilisation clamps after it are not used).
    #[repr(C)]
    #[derive(Default)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }

    const SCHED_OTHER: u32 = 0;
    const SCHED_BATCH: u32 = 3;
    /// Kept as read: clearing it takes a privilege.
    const SCHED_FLAG_RESET_ON_FORK: u64 = 1;

    fn get(tid: libc::pid_t) -> io::Result<SchedAttr> {
        let mut attr = SchedAttr::default();
        let size = std::mem::size_of::<SchedAttr>() as libc::c_uint;
        // SAFETY: `attr` is a valid, writable `sched_attr` of `size` bytes.
        let result = unsafe { libc::syscall(libc::SYS_sched_getattr, tid, &mut attr as *mut SchedAttr, size, 0) };
        match result {
            0 => Ok(attr),
            _ => Err(io::Error::last_os_error()),
        }
    }

    pub(super) fn set_slice(nanos: u64) -> io::Result<()> {
        let mut attr = get(0)?;
        // Real-time, deadline and idle threads are the operator's choice.
        if attr.policy != SCHED_OTHER && attr.policy != SCHED_BATCH {
            return Ok(());
        }
        attr.size = std::mem::size_of::<SchedAttr>() as u32;
        attr.flags &= SCHED_FLAG_RESET_ON_FORK;
        attr.runtime = nanos;
        // SAFETY: `attr` is a valid `sched_attr`; the call only reads it.
        let result = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
        match result {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }

    pub(super) fn slice(tid: libc::pid_t) -> Option<u64> {
        get(tid).ok().map(|attr| attr.runtime)
    }

    pub(super) fn nice() -> io::Result<i32> {
        // SAFETY: getpriority of the calling thread (who 0: on Linux the thread, not
        // the process); -1 is also a valid value, so errno tells a failure.
        unsafe {
            *libc::__errno_location() = 0;
            let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
            match nice == -1 && *libc::__errno_location() != 0 {
                true => Err(io::Error::last_os_error()),
                false => Ok(nice),
            }
        }
    }

    pub(super) fn lower_priority(by: i32) -> io::Result<i32> {
        let now = nice()?;
        let nice = now.saturating_add(by.max(0)).min(super::MAX_NICE);
        // SAFETY: setpriority of the calling thread, as in `nice`.
        if nice != now && unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(nice)
    }

    /// Moves the calling thread to the idle policy (`SCHED_IDLE`), which keeps no
    /// slice of its own.
    #[cfg(test)]
    pub(super) fn idle_policy() {
        let mut attr = get(0).unwrap();
        attr.policy = 5;
        // SAFETY: as in `set_slice`.
        let result = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
        assert_eq!(result, 0, "{}", io::Error::last_os_error());
    }

    /// Sets the calling thread's reset-on-fork flag (what an operator's `chrt -R`
    /// does) and says whether it is set.
    #[cfg(test)]
    pub(super) fn reset_on_fork(set: bool) -> bool {
        let mut attr = get(0).unwrap();
        if set {
            attr.flags = SCHED_FLAG_RESET_ON_FORK;
            // SAFETY: as in `set_slice`.
            let result = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
            assert_eq!(result, 0, "{}", io::Error::last_os_error());
            attr = get(0).unwrap();
        }
        attr.flags & SCHED_FLAG_RESET_ON_FORK != 0
    }
}

#[cfg(not(target_os = "linux"))]
mod linux {
    pub(super) fn set_slice(_nanos: u64) -> std::io::Result<()> {
        Ok(())
    }

    pub(super) fn slice(_tid: i32) -> Option<u64> {
        None
    }

    pub(super) fn lower_priority(_by: i32) -> std::io::Result<i32> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    pub(super) fn nice() -> std::io::Result<i32> {
        Err(std::io::ErrorKind::Unsupported.into())
    }
}

#[cfg(all(test, target_os = "linux"))]
pub(crate) mod tests {
    use super::*;

    /// Whether the slice tests can run; says so when they cannot.
    pub(crate) fn kernel_keeps_slices() -> bool {
        let keeps = custom_slices();
        if !keeps {
            eprintln!("skipped: this kernel has no custom slices (Linux 6.12 or later)");
        }
        keeps
    }

    /// Sets the calling thread's nice value, as an operator's `nice` would.
    fn set_nice(value: i32) {
        // SAFETY: setpriority of the calling thread (Linux: per thread).
        assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, value) }, 0, "setting nice {value}");
    }

    #[test]
    fn a_thread_gets_the_slice_it_asks_for_keeps_its_nice_value_and_can_go_back() {
        if !kernel_keeps_slices() {
            return;
        }
        let (asked, clamped, back, nice) = std::thread::spawn(|| {
            let default = slice().unwrap();
            set_nice(3);
            set_slice(Duration::from_micros(250)).unwrap();
            let asked = slice().unwrap();
            set_slice(Duration::from_micros(10)).unwrap();
            let clamped = slice().unwrap();
            set_slice(Duration::ZERO).unwrap();
            let back = slice().unwrap() == default;
            (asked, clamped, back, nice().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(
            (asked, clamped, back, nice),
            (Duration::from_micros(250), MIN_SLICE, true, 3),
            "slice asked, slice clamped, default again, nice kept"
        );
    }

    #[test]
    fn asking_says_whether_the_slice_was_granted() {
        if !kernel_keeps_slices() {
            return;
        }
        let outcomes = std::thread::spawn(|| {
            let asked = [Duration::from_micros(250), Duration::from_micros(10), Duration::ZERO];
            let granted = asked.map(|slice| format!("{:?}", ask_for_slice(slice)));
            linux::idle_policy();
            (granted, format!("{:?}", ask_for_slice(MIN_SLICE)))
        })
        .join()
        .unwrap();
        assert_eq!(outcomes, (["Granted", "Granted", "Granted"].map(String::from), "Ignored".to_string()));
    }

    #[test]
    fn an_operators_reset_on_fork_is_kept() {
        if !kernel_keeps_slices() {
            return;
        }
        let kept = std::thread::spawn(|| {
            assert!(linux::reset_on_fork(true), "set");
            set_slice(MIN_SLICE).unwrap();
            (linux::reset_on_fork(false), slice().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(kept, (true, MIN_SLICE));
    }

    #[test]
    fn lowering_priority_adds_to_the_operators_nice_for_this_thread_and_its_children_only() {
        let before = nice().unwrap();
        // An operator's `nice -n 3` over whatever the tests run at.
        let base = (before + 3).min(MAX_NICE - 5);
        let seen = std::thread::spawn(move || {
            set_nice(base);
            let lowered = (lower_priority(5).unwrap(), nice().unwrap());
            let child = std::thread::spawn(|| nice().unwrap()).join().unwrap();
            let unchanged = (lower_priority(0).unwrap(), lower_priority(-4).unwrap());
            let capped = (lower_priority(40).unwrap(), nice().unwrap());
            (lowered, child, unchanged, capped)
        })
        .join()
        .unwrap();
        let lowered = base + 5;
        assert_eq!(seen, ((lowered, lowered), lowered, (lowered, lowered), (MAX_NICE, MAX_NICE)));
        assert_eq!(nice().unwrap(), before, "other threads keep theirs");
    }

    /// Threads that meet: each that arrives waits until `.1` have, or 10 s passed
    /// (so that a test of threads that never come fails instead of hanging).
    struct Meet(std::sync::atomic::AtomicUsize, usize);

    impl Meet {
        fn new(threads: usize) -> Self {
            Self(std::sync::atomic::AtomicUsize::new(0), threads)
        }

        fn wait(&self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while self.0.load(std::sync::atomic::Ordering::SeqCst) < self.1 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// An item's number, and the name and nice value of the thread that took it.
    type Taken = (usize, Option<String>, i32);

    /// `count` items for [`on_threads`], each taken in turn: item `i` waits at
    /// `meets[i]` (if any) and returns who ran it.
    fn items<'a>(count: usize, meets: &'a [Option<&'a Meet>]) -> impl Fn() -> Option<Taken> + Sync + 'a {
        let taken = std::sync::atomic::AtomicUsize::new(0);
        move || {
            let item = taken.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if item >= count {
                return None;
            }
            if let Some(meet) = meets.get(item).copied().flatten() {
                meet.wait();
            }
            Some((item, std::thread::current().name().map(String::from), nice().expect("the thread's nice value")))
        }
    }

    #[test]
    fn work_on_threads_runs_on_the_caller_and_helpers_that_inherit_its_nice_value() {
        // Room to lower it by 3, whatever the tests run at.
        let base = nice().unwrap().min(MAX_NICE - 3);
        let seen = std::thread::Builder::new()
            .name("caller".into())
            .spawn(move || {
                set_nice(base);
                let lowered = lower_priority(3).unwrap();
                // Three items that wait for each other: one on each thread.
                let all = Meet::new(3);
                let three = on_threads(3, "helper", |_| 0, items(3, &[Some(&all), Some(&all), Some(&all)]));
                // The caller alone takes its item, then starts a helper; the two
                // items after wait for each other.
                let (pair, mut asked) = (Meet::new(2), Vec::new());
                let joined = on_threads(
                    1,
                    "helper",
                    |running| {
                        asked.push(running);
                        usize::from(running == 0)
                    },
                    items(3, &[None, Some(&pair), Some(&pair)]),
                );
                (lowered, three, joined, asked, on_threads(0, "helper", |_| 0, items(2, &[])))
            })
            .unwrap()
            .join()
            .unwrap();
        let lowered = base + 3;
        let (got_lowered, three, joined, asked, alone) = seen;
        assert_eq!(got_lowered, lowered);
        let by = |results: &(Vec<Taken>, usize)| {
            let mut who: Vec<(String, i32)> =
                results.0.iter().map(|(_, name, nice)| (name.clone().unwrap_or_default(), *nice)).collect();
            who.sort();
            let mut items: Vec<usize> = results.0.iter().map(|(item, _, _)| *item).collect();
            items.sort();
            (items, who, results.1)
        };
        let on = |name: &str| (name.to_string(), lowered);
        assert_eq!(by(&three), (vec![0, 1, 2], vec![on("caller"), on("helper"), on("helper")], 3));
        assert_eq!(by(&joined), (vec![0, 1, 2], vec![on("caller"), on("caller"), on("helper")], 2));
        assert_eq!(joined.0[0].0, 0, "the caller's results come first");
        assert_eq!(asked, vec![0, 1], "asked after each of the caller's items, with the helpers running");
        assert_eq!(by(&alone), (vec![0, 1], vec![on("caller"), on("caller")], 1));
        let panicked = std::panic::catch_unwind(|| {
            let once = std::sync::atomic::AtomicBool::new(false);
            on_threads(
                2,
                "helper",
                |_| 0,
                || {
                    assert!(std::thread::current().name() != Some("helper"), "a helper panicked");
                    (!once.swap(true, std::sync::atomic::Ordering::Relaxed)).then_some(())
                },
            )
        });
        assert!(panicked.is_err(), "a helper's panic comes back in the caller");
    }

    #[test]
    fn background_threads_run_at_the_default_slice() {
        if !kernel_keeps_slices() {
            return;
        }
        let (parent, default) = std::thread::spawn(|| {
            let default = slice().unwrap();
            set_slice(MIN_SLICE).unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let child = runtime.block_on(spawn_background("test-background", slice));
            let thread = background_thread("test-thread", slice).unwrap().join().unwrap();
            (slice().unwrap(), (child, thread, default))
        })
        .join()
        .unwrap();
        let (child, thread, default) = default;
        assert_eq!((parent, child, thread), (MIN_SLICE, Ok(Some(default)), Some(default)));
    }

    #[tokio::test]
    async fn background_threads_are_named_in_the_runtime_and_report_panics() {
        let (name, runtime) = spawn_background("test-background", || {
            let spawned = tokio::runtime::Handle::try_current().map(|runtime| runtime.spawn(async { 7 }));
            (std::thread::current().name().map(String::from), spawned.is_ok())
        })
        .await
        .unwrap();
        assert_eq!((name.as_deref(), runtime), (Some("test-background"), true));
        let panicked = spawn_background("test-panics", || -> u32 { panic!("on purpose") }).await;
        assert_eq!(panicked, Err("panicked: on purpose".to_string()));
    }
}
