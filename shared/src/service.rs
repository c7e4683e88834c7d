//! The common `main` of every tally service binary: parse `--config`, load the
//! configuration, start logging, turn signals into a cancellation token, run the
//! service and turn its result into an exit code.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use crate::config::{RuntimeConfig, TallyConfig};

/// Runs a service binary. `run` receives the loaded config and the shutdown token.
pub fn service_main<F, Fut, E>(name: &str, run: F) -> ExitCode
where
    F: FnOnce(TallyConfig, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let config_path = match parse_args(name) {
        Ok(path) => path,
        Err(code) => return code,
    };
    let config = match TallyConfig::load(config_path.as_deref()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("{name}: {err}");
            return ExitCode::from(2);
        }
    };
    crate::telemetry::init_logging(&config.log);
    let runtime = match runtime(&config.runtime) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("{name}: starting the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let shutdown = crate::shutdown::on_signals();
        run(config, shutdown).await
    });
    match result {
        Ok(()) => {
            tracing::info!(service = name, "stopped");
            ExitCode::SUCCESS
        }
        Err(err) => {
            tracing::error!(service = name, error = %err, "failed");
            eprintln!("{name}: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The service's async runtime: `worker_threads` threads (the main thread only
/// waits on the service's top future).
fn runtime(config: &RuntimeConfig) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(config.worker_threads).enable_all().build()
}

/// `--config PATH` (or `TALLY_CONFIG`), `--help`, `--version`.
fn parse_args(name: &str) -> Result<Option<PathBuf>, ExitCode> {
    let mut path = std::env::var_os("TALLY_CONFIG").map(PathBuf::from);
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--config" | "-c") => match args.next() {
                Some(value) => path = Some(PathBuf::from(value)),
                None => {
                    eprintln!("{name}: --config needs a path");
                    return Err(ExitCode::from(2));
                }
            },
            Some("--help" | "-h") => {
                println!("usage: {name} [--config tally.toml]\n\nConfiguration: the TOML file (or $TALLY_CONFIG), overridden by TALLY__SECTION__KEY variables.");
                return Err(ExitCode::SUCCESS);
            }
            Some("--version" | "-V") => {
                println!("{name} {}", env!("CARGO_PKG_VERSION"));
                return Err(ExitCode::SUCCESS);
            }
            _ => {
                eprintln!("{name}: unexpected argument {arg:?} (try --help)");
                return Err(ExitCode::from(2));
            }
        }
    }
    Ok(path)
}

/// The `host:port` other services reach a listener bound at `bound` on: the
/// configured advertised host, else the bound IP (loopback for a wildcard bind).
pub fn advertised_addr(bound: std::net::SocketAddr, advertise_host: Option<&str>) -> String {
    let host = match advertise_host {
        Some(host) => host.to_string(),
        None if bound.ip().is_unspecified() => "127.0.0.1".to_string(),
        None => bound.ip().to_string(),
    };
    format!("{host}:{}", bound.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_has_the_configured_threads() {
        for threads in [1, 3] {
            let runtime = runtime(&RuntimeConfig { worker_threads: threads }).unwrap();
            assert_eq!(runtime.metrics().num_workers(), threads);
        }
    }
}
