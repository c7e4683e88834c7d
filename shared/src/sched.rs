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
//! "Scheduling hints").
//!
//! Every service's runtime threads (async workers and the blocking pool) take
//! `runtime.latency_slice_us` ([`crate::service`]); threads they start inherit it.
//! The loops that apply or move backlogs (a counter's batches and rollups, the
//! ingester's pipeline, the graph's processor, a dequeue broker's fetcher) run on
//! threads of their own through [`spawn_background`], which go back to the kernel's
//! default. Elsewhere than Linux, and on kernels before 6.12 (which ignore the
//! field), the hints change nothing. A thread under a real-time or idle policy
//! keeps it; a nice value set by the operator is kept.

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

/// The calling thread's time slice now (for logs and tests); `None` where it
/// cannot be read.
pub fn slice() -> Option<Duration> {
    linux::slice(0).map(Duration::from_nanos)
}

/// Runs `work` on a new thread named `name` at the kernel's default slice (a loop
/// that applies or moves a backlog), in the caller's runtime context as
/// `spawn_blocking` would, and waits for it without holding an async worker. A
/// panic in `work` comes back as its message.
pub async fn spawn_background<T, F>(name: &str, work: F) -> Result<T, String>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (done, finished) = oneshot::channel();
    let runtime = tokio::runtime::Handle::try_current().ok();
    let spawned = std::thread::Builder::new().name(name.into()).spawn(move || {
        let _context = runtime.as_ref().map(|runtime| runtime.enter());
        if let Err(err) = set_slice(Duration::ZERO) {
            tracing::debug!(error = %err, "a background thread keeps its parent's slice");
        }
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        let _ = done.send(result.map_err(|panic| panic_message(&*panic)));
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
        attr.flags = 0;
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
}

#[cfg(not(target_os = "linux"))]
mod linux {
    pub(super) fn set_slice(_nanos: u64) -> std::io::Result<()> {
        Ok(())
    }

    pub(super) fn slice(_tid: i32) -> Option<u64> {
        None
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Whether this kernel keeps a thread's own slice (6.12 and later).
    fn custom_slices() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut numbers = release.trim().split(['.', '-']).map(|part| part.parse::<u32>().unwrap_or(0));
        (numbers.next().unwrap(), numbers.next().unwrap()) >= (6, 12)
    }

    #[test]
    fn a_thread_gets_the_slice_it_asks_for_keeps_its_nice_value_and_can_go_back() {
        assert!(custom_slices(), "these tests need Linux 6.12 or later (custom slices)");
        let (asked, clamped, back, nice) = std::thread::spawn(|| {
            let default = slice().unwrap();
            // SAFETY: setpriority on the calling thread (Linux: per thread).
            assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 3) }, 0);
            set_slice(Duration::from_micros(250)).unwrap();
            let asked = slice().unwrap();
            set_slice(Duration::from_micros(10)).unwrap();
            let clamped = slice().unwrap();
            set_slice(Duration::ZERO).unwrap();
            let back = slice().unwrap() == default;
            // SAFETY: getpriority on the calling thread.
            (asked, clamped, back, unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) })
        })
        .join()
        .unwrap();
        assert_eq!(
            (asked, clamped, back, nice),
            (Duration::from_micros(250), MIN_SLICE, true, 3),
            "slice asked, slice clamped, default again, nice kept"
        );
    }

    #[tokio::test]
    async fn background_threads_run_at_the_default_slice_and_report_panics() {
        assert!(custom_slices(), "these tests need Linux 6.12 or later (custom slices)");
        let (parent, default) = std::thread::spawn(|| {
            let default = slice().unwrap();
            set_slice(MIN_SLICE).unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let child = runtime.block_on(spawn_background("test-background", || {
                (std::thread::current().name().map(String::from), slice().unwrap())
            }));
            (slice().unwrap(), (child, default))
        })
        .join()
        .unwrap();
        let (child, default) = default;
        assert_eq!(parent, MIN_SLICE);
        assert_eq!(child, Ok((Some("test-background".to_string()), default)));
        let panicked = spawn_background("test-panics", || -> u32 { panic!("on purpose") }).await;
        assert_eq!(panicked, Err("panicked: on purpose".to_string()));
    }
}
