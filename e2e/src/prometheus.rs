//! A real Prometheus (Debian's `prometheus` package, which the test command installs;
//! `$TALLY_PROMETHEUS` names another binary) scraping a sandbox's services and
//! evaluating rule files, on a free port and a data directory of its own; stopped
//! on drop.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tally_shared::local_broker::free_port;

pub struct Prometheus {
    child: Child,
    url: String,
}

/// One alert as Prometheus's `/api/v1/alerts` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Alert {
    pub name: String,
    /// `pending` or `firing`.
    pub state: String,
    pub labels: Value,
}

impl Prometheus {
    /// Starts Prometheus in `dir`, scraping each `(job, address)` every `interval` and
    /// evaluating `rules` as often; returns once it is ready.
    pub async fn start(dir: &Path, targets: &[(&str, String)], rules: &Path, interval: Duration) -> Self {
        let secs = format!("{}s", interval.as_secs().max(1));
        let jobs: Vec<String> = targets
            .iter()
            .map(|(job, addr)| format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n"))
            .collect();
        let config = format!(
            "global:\n  scrape_interval: {secs}\n  evaluation_interval: {secs}\nrule_files:\n  - '{}'\nscrape_configs:\n{}",
            rules.display(),
            jobs.concat()
        );
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config).unwrap();
        let port = free_port().unwrap();
        let binary = std::env::var("TALLY_PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(&binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("prometheus-data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("{binary}: {err} (install Debian's prometheus package)"));
        let prometheus = Self { child, url: format!("http://127.0.0.1:{port}") };
        let deadline = Instant::now() + Duration::from_secs(60);
        let ready = format!("{}/-/ready", prometheus.url);
        while !reqwest::get(&ready).await.is_ok_and(|answer| answer.status().is_success()) {
            assert!(Instant::now() < deadline, "prometheus not ready in 60 s: {}", prometheus.log(dir));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        prometheus
    }

    fn log(&self, dir: &Path) -> String {
        std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
    }

    /// The alerts pending or firing now.
    pub async fn alerts(&self) -> Vec<Alert> {
        let body: Value = reqwest::get(format!("{}/api/v1/alerts", self.url)).await.unwrap().json().await.unwrap();
        assert_eq!(body["status"], "success", "{body}");
        let alerts = body["data"]["alerts"].as_array().cloned().unwrap_or_default();
        alerts
            .into_iter()
            .map(|alert| Alert {
                name: alert["labels"]["alertname"].as_str().unwrap_or_default().to_string(),
                state: alert["state"].as_str().unwrap_or_default().to_string(),
                labels: alert["labels"].clone(),
            })
            .collect()
    }

    /// An instant query's result vector: each series' labels and value.
    pub async fn query(&self, expr: &str) -> Vec<(Value, f64)> {
        let body: Value = reqwest::Client::new()
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", expr)])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(body["status"], "success", "{expr}: {body}");
        let result = body["data"]["result"].as_array().cloned().unwrap_or_default();
        result
            .into_iter()
            .map(|series| {
                let value = series["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
                (series["metric"].clone(), value)
            })
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}
