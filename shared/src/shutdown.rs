//! Graceful shutdown: signals become a [`CancellationToken`] that services receive
//! as an argument, so tests can cancel them without signals.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// Sleeps `rest` on this thread unless `shutdown` comes first (noticed within
/// 50 ms); false when it did.
pub fn sleep_unless(shutdown: &CancellationToken, rest: Duration) -> bool {
    let until = Instant::now() + rest;
    while !shutdown.is_cancelled() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
    false
}

/// Runs `tick` now and then every `period` on a thread named `name` until
/// `shutdown` (noticed within 50 ms): for periodic blocking work, such as broker
/// round trips for lag, that must not hold up a service's main loop.
pub fn every(
    name: &str,
    period: Duration,
    shutdown: CancellationToken,
    mut tick: impl FnMut() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.into()).spawn(move || {
        while !shutdown.is_cancelled() {
            tick();
            sleep_unless(&shutdown, period);
        }
    })
}

/// A token cancelled on the first SIGINT or SIGTERM; a second signal exits at once
/// with status 130.
pub fn on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown requested; finishing the current batch (signal again to exit at once)");
        cancel.cancel();
        wait_for_signal().await;
        tracing::warn!("second signal: exiting now");
        std::process::exit(130);
    });
    token
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without signal handlers the process can still be stopped by SIGKILL.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleep_ends_early_when_shutdown_comes() {
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        assert!(sleep_unless(&shutdown, Duration::from_millis(120)), "slept in full");
        assert!(started.elapsed() >= Duration::from_millis(120));
        let cancel = {
            let shutdown = shutdown.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                shutdown.cancel();
            })
        };
        let started = Instant::now();
        assert!(!sleep_unless(&shutdown, Duration::from_secs(60)), "cut short");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        cancel.join().unwrap();
        assert!(!sleep_unless(&shutdown, Duration::from_secs(60)), "already cancelled");
    }
}
