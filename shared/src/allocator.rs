//! How a service asks glibc's allocator to keep the memory its batches free.
//!
//! A batch allocates tens of megabytes in medium blocks (an ingester's routed
//! increments and shard records, a counter's decoded records and write batch) and
//! frees them all when it is done. With glibc's defaults the free memory at the top
//! of a heap is handed back to the kernel (trimmed) as soon as it passes twice the
//! largest block freed so far, so the next batch touches fresh pages: each a page
//! fault and a page the kernel zeroes: an ingester under a backlog takes about ten
//! times the page faults without the thresholds below (BENCHMARKS.md, "End to end:
//! ingest"; a counter's faults are mostly its memtables' new data, which no allocator setting
//! saves). So a service keeps up to
//! [`TRIM_THRESHOLD`] free at a heap's top, and serves blocks below
//! [`MMAP_THRESHOLD`] from its heaps instead of mapping each one afresh. An
//! operator's own `GLIBC_TUNABLES` (say, `glibc.malloc.trim_threshold`) wins: then
//! nothing is changed here.

/// Free memory a heap keeps at its top before giving it back to the kernel.
pub const TRIM_THRESHOLD: usize = 256 << 20;
/// Blocks from this size on are mapped on their own (glibc's largest allowed).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// What [`keep_freed_memory`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tuning {
    /// The thresholds above are in force.
    Kept,
    /// `GLIBC_TUNABLES` is set: the operator's settings stand.
    LeftToTheOperator,
    /// Not glibc, or glibc refused a setting: its defaults stand.
    Unavailable,
}

/// Sets the allocator's thresholds ([`TRIM_THRESHOLD`], [`MMAP_THRESHOLD`]) unless
/// `GLIBC_TUNABLES` is set. Called once at a service's start, before its threads.
pub fn keep_freed_memory() -> Tuning {
    if std::env::var_os("GLIBC_TUNABLES").is_some() {
        return Tuning::LeftToTheOperator;
    }
    set_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> Tuning {
    // SAFETY: mallopt only sets the allocator's parameters; both values are within
    // the ranges glibc accepts (it answers 0 otherwise, checked here).
    let (trim, mmap) = unsafe {
        (
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int),
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int),
        )
    };
    if trim == 1 && mmap == 1 {
        Tuning::Kept
    } else {
        Tuning::Unavailable
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> Tuning {
    Tuning::Unavailable
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Minor page faults of the calling thread so far.
    fn thread_faults() -> i64 {
        // SAFETY: getrusage writes into the zeroed struct it is given.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0);
            usage.ru_minflt
        }
    }

    /// Batches of medium blocks, all freed after each, as an ingester's and a
    /// counter's batches allocate: with the thresholds kept, the second batch on
    /// reuses the first one's pages instead of faulting in fresh ones (with glibc's
    /// defaults each batch of 32 MiB takes about 8 000 faults).
    #[test]
    fn batches_after_the_first_reuse_the_memory_the_first_freed() {
        // GLIBC_TUNABLES, if the test runner has it, would leave the defaults.
        assert_eq!(set_thresholds(), Tuning::Kept);
        // A thread of its own: its heap is not the main thread's (as a service's
        // batch threads).
        let faults = std::thread::spawn(|| {
            const BLOCKS: usize = 64;
            const BLOCK: usize = 512 << 10;
            let batch = || {
                let blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8 | 1; BLOCK]).collect();
                std::hint::black_box(&blocks);
            };
            batch();
            let before = thread_faults();
            for _ in 0..4 {
                batch();
            }
            thread_faults() - before
        })
        .join()
        .unwrap();
        // Four batches of 8 192 pages each.
        assert!(faults < 400, "{faults} page faults in four batches after the first");
    }
}
