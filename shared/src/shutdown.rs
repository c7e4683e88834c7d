//! Graceful shutdown: signals become a [`CancellationToken`] that services receive
//! as an argument, so tests can cancel them without signals.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

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
            let until = Instant::now() + period;
            while !shutdown.is_cancelled() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
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
