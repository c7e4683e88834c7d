//! Graceful shutdown: signals become a [`CancellationToken`] that services receive
//! as an argument, so tests can cancel them without signals.

use tokio_util::sync::CancellationToken;

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
