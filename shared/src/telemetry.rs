//! Logs, metrics and health endpoints every service exposes.
//!
//! Logs go through tracing (text or JSON). Metrics are Prometheus, registered once per
//! service in its `metrics.rs` into the [`Registry`] handed to [`serve_admin`], which
//! serves `/metrics`, `/healthz` (the process is alive) and `/readyz` (it does its job:
//! connected and owning what it should).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use prometheus::{Encoder, IntGauge, Registry, TextEncoder};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};
use crate::lock::{read, write};
use crate::Result;

/// Installs the global tracing subscriber. `RUST_LOG`, when set, wins over the
/// configured level. Safe to call twice (the second call does nothing).
pub fn init_logging(config: &LogConfig) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&config.level));
    // Colours only on a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let installed = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if let Err(err) = installed {
        // To the subscriber installed before.
        tracing::debug!(error = %err, "logging was set up already; the first setup stays");
    }
}

/// Whether the service is ready to serve: set by the service from its real state
/// (connected, owning what it should), and never while something it owns failed.
#[derive(Clone, Default)]
pub struct Readiness(Arc<ReadinessState>);

/// What [`ReadinessState::failures`]' lock guards ([`crate::lock`]).
const FAILURES: &str = "the readiness's failures";

#[derive(Default)]
struct ReadinessState {
    ready: AtomicBool,
    /// What failed and why (a shard, a partition), for `/readyz` to name.
    failures: RwLock<Vec<String>>,
}

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.ready.store(ready, Ordering::Relaxed);
    }

    /// Replaces the list of failures; any failure makes the service not ready.
    pub fn set_failures(&self, failures: Vec<String>) {
        *write(&self.0.failures, FAILURES) = failures;
    }

    pub fn failures(&self) -> Vec<String> {
        read(&self.0.failures, FAILURES).clone()
    }

    pub fn is_ready(&self) -> bool {
        self.0.ready.load(Ordering::Relaxed) && self.failures().is_empty()
    }
}

#[derive(Clone)]
struct AdminState {
    registry: Registry,
    readiness: Readiness,
    /// `tally_ready`, set from `readiness` at each scrape.
    ready_gauge: IntGauge,
}

/// Binds the admin port and serves it until `shutdown`; returns the bound address.
pub async fn serve_admin(
    listen: &str,
    registry: Registry,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<SocketAddr> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let app = admin_router(registry, readiness);
    crate::http::spawn_serve("admin server", listener, app, shutdown);
    Ok(addr)
}

/// The admin routes, to merge into a service's own router when it has one port.
pub fn admin_router(registry: Registry, readiness: Readiness) -> Router {
    let ready_gauge = ready_gauge(&registry);
    if let Some(spans) = crate::otel::spans_metric() {
        register(&registry, spans);
    }
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(AdminState { registry, readiness, ready_gauge })
}

/// `tally_ready`, registered in `registry`.
fn ready_gauge(registry: &Registry) -> IntGauge {
    register(
        registry,
        IntGauge::new(
            "tally_ready",
            "1 while the service is ready (/readyz answers 200), 0 while not: one not ready for minutes \
             is stuck starting or stopped by a failure, which /readyz names",
        )
        .expect("valid metric"),
    )
}

async fn metrics(State(state): State<AdminState>) -> (StatusCode, String) {
    state.ready_gauge.set(i64::from(state.readiness.is_ready()));
    let mut buffer = Vec::new();
    if let Err(err) = TextEncoder::new().encode(&state.registry.gather(), &mut buffer) {
        return (StatusCode::INTERNAL_SERVER_ERROR, err.to_string());
    }
    (StatusCode::OK, String::from_utf8_lossy(&buffer).into_owned())
}

/// `200 ready`, or `503` with what is not ready: `{"ready":false,"failures":[…]}`.
async fn ready(State(state): State<AdminState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    if state.readiness.is_ready() {
        return (StatusCode::OK, "ready\n").into_response();
    }
    let body = serde_json::json!({"ready": false, "failures": state.readiness.failures()});
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
}

/// A histogram of a long operation's duration in seconds (a restore, a rebuild:
/// 0.1 s to an hour), registered in `registry`.
pub fn long_duration_histogram(registry: &Registry, name: &str, help: &str) -> prometheus::Histogram {
    let buckets = vec![0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3_600.0];
    let opts = prometheus::HistogramOpts::new(name, help).buckets(buckets);
    register(registry, prometheus::Histogram::with_opts(opts).expect("valid histogram options"))
}

/// Registers a metric, tolerating double registration (tests start a service twice
/// in one process).
pub fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    match registry.register(Box::new(metric.clone())) {
        Ok(()) | Err(prometheus::Error::AlreadyReg) => {}
        Err(err) => tracing::warn!(error = %err, "a metric not registered"),
    }
    metric
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn metrics_say_whether_the_service_is_ready() {
        let (registry, readiness) = (Registry::new(), Readiness::default());
        let ready_gauge = ready_gauge(&registry);
        let state = AdminState { registry, readiness: readiness.clone(), ready_gauge };
        let scrape = || async { metrics(State(state.clone())).await };
        let line = |text: String| text.lines().find(|line| line.starts_with("tally_ready ")).map(str::to_string);
        assert_eq!(line(scrape().await.1), Some("tally_ready 0".into()), "not ready at start");
        readiness.set(true);
        assert_eq!(line(scrape().await.1), Some("tally_ready 1".into()));
        readiness.set_failures(vec!["shard 3: undecodable record at 1207".into()]);
        assert_eq!(line(scrape().await.1), Some("tally_ready 0".into()), "a failure makes it not ready");
    }
}
