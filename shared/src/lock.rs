//! The one way tally takes a lock, and its one policy for a poisoned one.
//!
//! A lock is poisoned when a thread panicked holding it: what it guards may be
//! half-changed, so neither reading it as it is nor as "nothing" is safe (the one
//! stalls or corrupts a partition silently, the other serves a torn state). Every
//! tally service recovers from its stores and the log after a crash, so a poisoned
//! lock stops the process at once, as `kill -9` would, with an error naming the
//! lock: its supervisor (Kubernetes, `tally up`) restarts it, and a panic that
//! repeats shows as a crash loop, never as a quiet stall.
//!
//! Take locks with [`lock`], [`read`] and [`write`]; `name` says what the lock
//! guards, for that error.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `mutex`; a poisoned one stops the process ([`poisoned`]).
pub fn lock<'a, T>(mutex: &'a Mutex<T>, name: &str) -> MutexGuard<'a, T> {
    mutex.lock().unwrap_or_else(|_| poisoned(name))
}

/// Read-locks `lock`; a poisoned one stops the process ([`poisoned`]).
pub fn read<'a, T>(lock: &'a RwLock<T>, name: &str) -> RwLockReadGuard<'a, T> {
    lock.read().unwrap_or_else(|_| poisoned(name))
}

/// Write-locks `lock`; a poisoned one stops the process ([`poisoned`]).
pub fn write<'a, T>(lock: &'a RwLock<T>, name: &str) -> RwLockWriteGuard<'a, T> {
    lock.write().unwrap_or_else(|_| poisoned(name))
}

/// Says which lock was poisoned, on the log and on stderr, and aborts the process.
pub fn poisoned(name: &str) -> ! {
    let message = format!(
        "the lock of {name} is poisoned (a thread panicked holding it; what it guards may be half-changed): \
         stopping the process, which recovers from its stores and the log when it starts again"
    );
    tracing::error!(lock = name, "{message}");
    eprintln!("tally: {message}");
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the child process of the test below runs: it poisons a lock, then takes it.
    #[test]
    #[ignore = "run by a_poisoned_lock_stops_the_process_naming_it, in a process of its own"]
    fn poison_and_take() {
        let shared = std::sync::Arc::new(RwLock::new(1));
        let holder = shared.clone();
        let panicked = std::thread::spawn(move || {
            let _held = holder.write();
            panic!("a panic while holding the lock");
        })
        .join();
        assert!(panicked.is_err());
        let value = *read(&shared, "the test's counts");
        println!("read {value} from a poisoned lock");
    }

    #[test]
    fn a_poisoned_lock_stops_the_process_naming_it() {
        use std::os::unix::process::ExitStatusExt;
        let output = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "lock::tests::poison_and_take", "--ignored", "--nocapture"])
            .output()
            .expect("running the child");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(output.status.signal(), Some(libc::SIGABRT), "{stdout}\n{stderr}");
        assert!(stderr.contains("tally: the lock of the test's counts is poisoned"), "{stderr}");
        assert!(!stdout.contains("read 1 from a poisoned lock"), "{stdout}");
    }

    #[test]
    fn a_sound_lock_is_taken() {
        let (mutex, rw) = (Mutex::new(vec![1]), RwLock::new(2));
        lock(&mutex, "a list").push(2);
        *write(&rw, "a number") += 1;
        assert_eq!((lock(&mutex, "a list").clone(), *read(&rw, "a number")), (vec![1, 2], 3));
    }
}
