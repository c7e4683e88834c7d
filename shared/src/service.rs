//! The common `main` of every tally service binary: keep the memory batches free
//! ([`crate::allocator`]), parse `--config`, load the configuration, start logging,
//! turn signals into a cancellation token, run the service and turn its result into
//! an exit code.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use crate::config::{RuntimeConfig, TallyConfig};
use crate::sched::Asked;

/// Runs a service binary. `run` receives the loaded config and the shutdown token.
pub fn service_main<F, Fut, E>(name: &str, run: F) -> ExitCode
where
    F: FnOnce(TallyConfig, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let allocator = crate::allocator::keep_freed_memory();
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
    if let Err(err) = crate::otel::install(&config.telemetry, name) {
        eprintln!("{name}: {err}");
        return ExitCode::FAILURE;
    }
    tracing::info!(?allocator, "allocator: memory freed between batches");
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
    crate::otel::flush(std::time::Duration::from_secs(5));
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
/// waits on the service's top future). Its threads — async workers and the blocking
/// pool, which answer requests — ask for `latency_slice_us` slices
/// ([`crate::sched`]); the main thread, and the Kafka clients' and RocksDB's threads
/// it starts, keep the kernel's default.
fn runtime(config: &RuntimeConfig) -> std::io::Result<tokio::runtime::Runtime> {
    let (slice, slice_us) = (config.latency_slice(), config.latency_slice_us);
    let said = std::sync::Once::new();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_threads)
        .on_thread_start(move || {
            if slice.is_zero() {
                return;
            }
            let asked = crate::sched::ask_for_slice(slice);
            said.call_once(|| match asked {
                Asked::Granted => tracing::info!(slice_us, "request threads run on short CPU slices"),
                Asked::Ignored => {
                    tracing::info!(slice_us, "request threads keep the kernel's CPU slice (Linux before 6.12)")
                }
                Asked::Refused(err) => tracing::warn!(error = %err, "request threads keep the kernel's CPU slice"),
            });
        })
        .enable_all()
        .build()
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

/// A command line's `main` (`tally`, `tally-bench`): runs `work` on a two-thread
/// runtime and exits 1 with `name: error` (its causes too) when it fails.
pub fn command_main<E: std::fmt::Display>(name: &str, work: impl Future<Output = Result<(), E>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("{name}: starting the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{name}: {err:#}");
            ExitCode::FAILURE
        }
    }
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
            let runtime = runtime(&RuntimeConfig { worker_threads: threads, latency_slice_us: 0 }).unwrap();
            assert_eq!(runtime.metrics().num_workers(), threads);
        }
    }

    /// The slices of a runtime's async worker and of a blocking-pool thread, and the
    /// kernel's default slice, read on a fresh thread.
    #[cfg(target_os = "linux")]
    fn slices_with(latency_slice_us: u64) -> [std::time::Duration; 3] {
        std::thread::spawn(move || {
            let default = crate::sched::slice().unwrap();
            let runtime = runtime(&RuntimeConfig { worker_threads: 1, latency_slice_us }).unwrap();
            let worker = runtime.block_on(async { tokio::spawn(async { crate::sched::slice() }).await.unwrap() });
            let blocking = runtime.block_on(async { tokio::task::spawn_blocking(crate::sched::slice).await.unwrap() });
            [worker.unwrap(), blocking.unwrap(), default]
        })
        .join()
        .unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn runtime_threads_ask_for_the_configured_slice_or_keep_the_kernels() {
        if !crate::sched::tests::kernel_keeps_slices() {
            return;
        }
        let [worker, blocking, default] = slices_with(250);
        assert_eq!([worker, blocking], [std::time::Duration::from_micros(250); 2]);
        assert_ne!(default, worker, "the kernel's default is not what was asked for");
        let [worker, blocking, default] = slices_with(0);
        assert_eq!([worker, blocking], [default; 2]);
    }
}
