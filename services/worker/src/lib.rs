//! `tally-worker`: a generic worker for one queue. Each job's payload is
//! either POSTed to `worker.webhook_url` (a 2xx answer acks it; anything else, or no
//! answer, retries it with the queue's backoff) or given on stdin to
//! `worker.command` (exit status 0 acks; otherwise it retries with the command's
//! stderr as the error). Dequeueing, concurrency, lease extension and acks come
//! from the worker library in `tally_jobs_client`.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounterVec, Opts, Registry};
use tally_core::jobs::api::DequeuedJob;
use tally_core::trace::TRACEPARENT;
use tally_jobs_client::{self as worker, Outcome, WorkerOptions};
use tally_shared::config::{TallyConfig, WorkerConfig};
use tally_shared::telemetry::{register, serve_admin, Readiness};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Shared(#[from] tally_shared::Error),
    #[error(transparent)]
    Client(#[from] tally_jobs_client::Error),
    #[error("worker config: {0}")]
    Config(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How a job is run.
#[derive(Debug, Clone)]
pub enum Handler {
    Webhook {
        client: reqwest::Client,
        url: String,
    },
    /// `env`: what the command sees of the worker's environment
    /// (`worker.command_env`, those set at start); nothing else.
    Command {
        program: Vec<String>,
        env: Vec<(String, String)>,
    },
}

impl Handler {
    pub fn from_config(config: &WorkerConfig) -> Result<Self> {
        match (&config.webhook_url, &config.command) {
            (Some(url), None) => {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(300))
                    .build()
                    .map_err(|err| Error::Config(err.to_string()))?;
                Ok(Handler::Webhook { client, url: url.clone() })
            }
            (None, Some(program)) if !program.is_empty() => {
                let env = config
                    .command_env
                    .iter()
                    .filter_map(|name| Some((name.clone(), std::env::var(name).ok()?)))
                    .collect();
                Ok(Handler::Command { program: program.clone(), env })
            }
            _ => Err(Error::Config("set exactly one of worker.webhook_url and worker.command".into())),
        }
    }

    /// Runs one job; `stop` (the job was cancelled) sends a command SIGTERM — the
    /// worker library kills it after `worker.stop_grace_ms` — and abandons a
    /// webhook call.
    pub async fn run(&self, job: &DequeuedJob, stop: CancellationToken) -> Outcome {
        match self {
            Handler::Webhook { client, url } => {
                let request = client
                    .post(url)
                    .header("content-type", "application/json")
                    .header("x-tally-job-id", &job.id)
                    .header("x-tally-attempt", job.attempt.to_string())
                    .body(job.payload.get().to_string());
                // The job's trace goes on to the webhook.
                let request = match &job.traceparent {
                    Some(context) => request.header(TRACEPARENT, context),
                    None => request,
                };
                let sent = tokio::select! {
                    sent = request.send() => sent,
                    _ = stop.cancelled() => return Outcome::Retry { in_ms: None, error: "cancelled".into() },
                };
                match sent {
                    Ok(response) if response.status().is_success() => Outcome::Ack,
                    Ok(response) => {
                        Outcome::Retry { in_ms: None, error: format!("webhook answered {}", response.status()) }
                    }
                    Err(err) => Outcome::Retry { in_ms: None, error: format!("webhook: {err}") },
                }
            }
            Handler::Command { program, env } => run_command(program, env, job, stop).await,
        }
    }
}

async fn run_command(
    program: &[String],
    env: &[(String, String)],
    job: &DequeuedJob,
    stop: CancellationToken,
) -> Outcome {
    let mut command = tokio::process::Command::new(&program[0]);
    // The job runs at the kernel's default CPU slice, not this request thread's short
    // one, which a child inherits (`tally_shared::sched`).
    // The command leads its own process group, so a stop reaches what it started.
    // SAFETY: between fork and exec the closure makes three system calls and
    // allocates nothing.
    unsafe {
        command.pre_exec(|| {
            // Nothing may log here (it would allocate); a child that keeps the
            // short slice still runs.
            tally_shared::sched::set_slice(Duration::ZERO).ok();
            libc::setpgid(0, 0);
            Ok(())
        });
    }
    let spawned = command
        .args(&program[1..])
        .env_clear()
        .envs(env.iter().map(|(name, value)| (name, value)))
        .env("TALLY_JOB_ID", &job.id)
        .env("TALLY_JOB_ATTEMPT", job.attempt.to_string())
        // The job's trace, under the name OpenTelemetry's environment carrier uses.
        .envs(job.traceparent.iter().map(|context| ("TRACEPARENT", context)))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(err) => return Outcome::Retry { in_ms: None, error: format!("starting {}: {err}", program[0]) },
    };
    // From here, a dropped handler kills the command's whole group.
    let mut group = ProcessGroup(child.id().and_then(|pid| libc::pid_t::try_from(pid).ok()));
    if let Some(mut stdin) = child.stdin.take() {
        let written = tokio::select! {
            written = stdin.write_all(job.payload.get().as_bytes()) => written,
            // Stopped before it read its payload: it gets SIGTERM below.
            _ = stop.cancelled() => Ok(()),
        };
        if let Err(err) = written {
            // A command that does not read its stdin closes it early: its exit says how it went.
            tracing::debug!(job = %job.id, error = %err, "the payload was not all written to the command's stdin");
        }
    }
    let output = child.wait_with_output();
    tokio::pin!(output);
    let finished = tokio::select! {
        finished = &mut output => finished,
        _ = stop.cancelled() => {
            // Asked to stop: SIGTERM now; the library drops this (SIGKILL) after the grace.
            group.signal(libc::SIGTERM);
            output.await
        }
    };
    group.0 = None;
    match finished {
        Ok(output) if output.status.success() => Outcome::Ack,
        Ok(output) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let error: String = stderr.trim().chars().take(500).collect();
            Outcome::Retry { in_ms: None, error: format!("{} ({})", error, output.status) }
        }
        Err(err) => Outcome::Retry { in_ms: None, error: err.to_string() },
    }
}

/// A running command's process group: killed whole when its handler is dropped
/// before the command ended (a stop past its grace, a lost lease).
struct ProcessGroup(Option<libc::pid_t>);

impl ProcessGroup {
    fn signal(&self, signal: libc::c_int) {
        if let Some(leader) = self.0 {
            // SAFETY: kill(2) takes no pointers. The group is the one our child made
            // for itself (setpgid before exec); its id is not reused while any of its
            // processes lives, and `0` is cleared once the command has ended.
            unsafe { libc::kill(-leader, signal) };
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
    }
}

/// Runs the worker until `shutdown`; jobs in hand finish first.
pub async fn run(config: TallyConfig, shutdown: CancellationToken) -> Result<()> {
    let handler = Arc::new(Handler::from_config(&config.worker)?);
    let registry = Registry::new();
    let outcomes = register(
        &registry,
        IntCounterVec::new(
            Opts::new(
                "tally_worker_jobs_total",
                "Jobs this worker ran, by outcome: ack, retry (the command or webhook failed: run again, dead \
                 after max_attempts; or the job was cancelled) or abandon (left to its lease's expiry). A rising \
                 retry rate: the worker's log names each error — fix the handler or what it calls",
            ),
            &["outcome"],
        )
        .expect("valid metric"),
    );
    let readiness = Readiness::default();
    let admin = serve_admin(&config.worker.admin_listen, registry, readiness.clone(), shutdown.clone())
        .await
        .map_err(Error::Shared)?;
    let options = WorkerOptions {
        brokers: config.worker.brokers.clone(),
        queue: config.worker.queue.clone(),
        concurrency: config.worker.concurrency,
        lease_ms: (config.worker.lease_ms > 0).then_some(config.worker.lease_ms),
        auth_token: config.auth.worker_token.clone(),
        stop_grace_ms: config.worker.stop_grace_ms,
        spans: tally_shared::otel::sink(),
    };
    tracing::info!(queue = %options.queue, brokers = ?options.brokers, concurrency = options.concurrency, admin = %admin, "tally-worker starting");
    let probe = tokio::spawn(track_readiness(options.clone(), readiness.clone(), shutdown.clone()));
    let job_handler = move |job: DequeuedJob, stop: CancellationToken| {
        let (handler, outcomes) = (handler.clone(), outcomes.clone());
        async move {
            let outcome = handler.run(&job, stop).await;
            let label = match &outcome {
                Outcome::Ack => "ack",
                Outcome::Retry { error, .. } => {
                    tracing::info!(job = %job.id, attempt = job.attempt, %error, "job failed; it will be retried");
                    "retry"
                }
                Outcome::Abandon => "abandon",
            };
            outcomes.with_label_values(&[label]).inc();
            outcome
        }
    };
    let result = worker::run_stoppable(options, job_handler, shutdown.clone()).await;
    shutdown.cancel();
    if let Err(err) = probe.await {
        tracing::warn!(error = %err, "the readiness probe task failed");
    }
    tracing::info!("tally-worker stopped");
    Ok(result.map(|_| ())?)
}

/// Ready while a broker answers for the queue and some partition of it has an
/// owner to dequeue from; checked every few seconds.
async fn track_readiness(options: WorkerOptions, readiness: Readiness, shutdown: CancellationToken) {
    let Ok(client) = worker::BrokerClient::new(&options.queue, options.auth_token.clone()) else { return };
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(3));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        readiness.set(!client.owners(&options.brokers).await.is_empty());
    }
    readiness.set(false);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(payload: &str) -> DequeuedJob {
        DequeuedJob {
            id: "j1".into(),
            payload: serde_json::value::RawValue::from_string(payload.into()).unwrap(),
            attempt: 2,
            lease: "0.1.x".into(),
            key: None,
            priority: None,
            concurrency_key: None,
            lease_deadline: 0,
            partition: 0,
            offset: 0,
            traceparent: None,
        }
    }

    /// A command as the default config runs it.
    fn command(program: &[&str]) -> Handler {
        let config =
            WorkerConfig { command: Some(program.iter().map(|arg| arg.to_string()).collect()), ..Default::default() };
        Handler::from_config(&config).unwrap()
    }

    /// The command sees the variables `worker.command_env` names (those set) and
    /// the job's own, never the rest of the worker's environment (`HOME` here, a
    /// token in production).
    #[tokio::test]
    async fn a_command_sees_only_the_environment_its_config_names() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("env");
        let config = WorkerConfig {
            command: Some(vec!["sh".into(), "-c".into(), format!("env > {}", out.display())]),
            command_env: vec!["PATH".into(), "TALLY_TEST_NOT_SET".into()],
            ..Default::default()
        };
        assert!(std::env::var("HOME").is_ok(), "the test needs a variable the command must not see");
        assert_eq!(Handler::from_config(&config).unwrap().run(&job("1"), CancellationToken::new()).await, Outcome::Ack);
        let seen = std::fs::read_to_string(&out).unwrap();
        // What the shell itself sets.
        let shells_own = ["PWD=", "OLDPWD=", "SHLVL=", "_="];
        let mut seen: Vec<&str> =
            seen.lines().filter(|line| !shells_own.iter().any(|own| line.starts_with(own))).collect();
        seen.sort_unstable();
        let path = format!("PATH={}", std::env::var("PATH").unwrap());
        assert_eq!(seen, vec![path.as_str(), "TALLY_JOB_ATTEMPT=2", "TALLY_JOB_ID=j1"]);
    }

    #[tokio::test]
    async fn commands_ack_on_exit_zero_and_retry_with_stderr_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("seen");
        let ok =
            command(&["sh", "-c", &format!("cat > {}; echo $TALLY_JOB_ATTEMPT >> {}", out.display(), out.display())]);
        assert_eq!(ok.run(&job(r#"{"to":"a@b"}"#), CancellationToken::new()).await, Outcome::Ack);
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "{\"to\":\"a@b\"}2\n");
        let failing = command(&["sh", "-c", "echo nope >&2; exit 3"]);
        match failing.run(&job("1"), CancellationToken::new()).await {
            Outcome::Retry { error, .. } => assert!(error.contains("nope"), "{error}"),
            other => panic!("{other:?}"),
        }
        let missing = command(&["/no/such/program"]);
        assert!(matches!(missing.run(&job("1"), CancellationToken::new()).await, Outcome::Retry { .. }));
    }

    #[tokio::test]
    async fn a_job_runs_at_the_kernels_default_slice_not_the_workers_short_one() {
        let readable = std::path::Path::new("/proc/self/sched").exists();
        if !tally_shared::sched::custom_slices() || !readable {
            eprintln!("skipped: needs Linux 6.12 or later with /proc/self/sched");
            return;
        }
        let default = std::thread::spawn(tally_shared::sched::slice).join().unwrap().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("sched");
        let report = command(&["sh", "-c", &format!("grep '^se.slice ' /proc/self/sched > {}", out.display())]);
        tally_shared::sched::set_slice(tally_shared::sched::MIN_SLICE).unwrap();
        let outcome = report.run(&job("1"), CancellationToken::new()).await;
        tally_shared::sched::set_slice(Duration::ZERO).unwrap();
        assert_eq!(outcome, Outcome::Ack);
        let line = std::fs::read_to_string(&out).unwrap();
        let reported = line.split(':').nth(1).map(|nanos| nanos.trim().parse::<u64>());
        assert_eq!(reported, Some(Ok(default.as_nanos() as u64)), "{line}");
    }

    /// A cancelled job's command gets SIGTERM (and can clean up); one that ignores
    /// it is killed when the library drops it after the grace, with what it started.
    #[tokio::test]
    async fn a_stopped_command_gets_sigterm_then_dies_with_its_handler() {
        let dir = tempfile::tempdir().unwrap();
        let (out, pid) = (dir.path().join("term"), dir.path().join("pid"));
        let trapping =
            command(&["sh", "-c", &format!("trap 'echo cleaned > {}; exit 7' TERM; sleep 30 & wait", out.display())]);
        let stop = CancellationToken::new();
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            stopper.cancel();
        });
        let started = std::time::Instant::now();
        let outcome = trapping.run(&job("1"), stop).await;
        assert!(started.elapsed() < Duration::from_secs(10), "it stopped at the signal: {:?}", started.elapsed());
        assert!(matches!(&outcome, Outcome::Retry { error, .. } if error.contains("exit status: 7")), "{outcome:?}");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "cleaned\n");

        let stubborn =
            command(&["sh", "-c", &format!("trap '' TERM; sleep 30 2>/dev/null & echo $! > {}; wait", pid.display())]);
        let stop = CancellationToken::new();
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            stopper.cancel();
        });
        let dropped = tokio::time::timeout(Duration::from_millis(1_000), stubborn.run(&job("1"), stop)).await;
        assert!(dropped.is_err(), "a command that ignores SIGTERM runs on until dropped");
        let pid: i32 = std::fs::read_to_string(&pid).unwrap().trim().parse().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        // SAFETY: kill(2) with signal 0 only asks whether the process exists.
        while unsafe { libc::kill(pid, 0) } == 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_ne!(unsafe { libc::kill(pid, 0) }, 0, "what the dropped command started was killed with it");
    }

    #[test]
    fn exactly_one_way_to_run_jobs() {
        let mut config = WorkerConfig::default();
        assert!(Handler::from_config(&config).is_err());
        config.command = Some(vec!["true".into()]);
        assert!(Handler::from_config(&config).is_ok());
        config.webhook_url = Some("http://x".into());
        assert!(Handler::from_config(&config).is_err());
    }
}
