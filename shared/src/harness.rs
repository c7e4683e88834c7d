//! The one way tally starts its own processes — `tally up`, `tally-bench` and the
//! e2e kit alike: a local broker when no Kafka is configured, each service started
//! from a typed [`TallyConfig`] written as its TOML file (never hand-typed
//! `TALLY__…` variables), restarted with backoff when it dies under `tally up`, and
//! stopped gracefully (SIGTERM, SIGKILL after a grace period).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tokio::process::Child;
use tokio_util::sync::CancellationToken;

use crate::config::{TallyConfig, ENV_PREFIX};
use crate::local_broker::{ensure_installed, free_port, LocalBroker};
use crate::{Error, Result};

/// How long a stopped service may take to persist its batch before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(20);

/// A service process to start: which binary, under which name, with which config.
#[derive(Debug, Clone)]
pub struct Service {
    /// What logs and errors call it (`tally-counter (counter-1)`).
    pub name: String,
    pub binary: PathBuf,
    pub config: TallyConfig,
}

impl Service {
    /// The binary `binary` next to the running executable (cargo and the images put
    /// every tally binary in one directory), named after it.
    pub fn sibling(binary: &str, config: TallyConfig) -> Result<Self> {
        Ok(Self { name: binary.to_string(), binary: sibling_binary(binary)?, config })
    }

    /// The command that starts it: its config written to `<dir>/<name>.toml` and
    /// named by `TALLY_CONFIG`, with this process's `TALLY__…` variables removed
    /// (they are in the config already, as this process loaded them).
    pub fn command(&self, dir: &Path) -> Result<Command> {
        let file: String =
            self.name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let path = dir.join(format!("{file}.toml"));
        write_config(&self.config, &path)?;
        let mut command = Command::new(&self.binary);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with(ENV_PREFIX) {
                command.env_remove(key);
            }
        }
        command.env("TALLY_CONFIG", &path);
        Ok(command)
    }
}

/// `binary` in the directory of the running executable; tests run from `deps/`, so
/// for them the directory above it.
pub fn sibling_binary(binary: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir.join(binary))
}

/// Writes `config` as the TOML file a service loads (owner-only: it may hold tokens),
/// whole or not at all: a process starting meanwhile reads the old file or the new.
pub fn write_config(config: &TallyConfig, path: &Path) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut value = serde_json::to_value(config).map_err(|err| Error::Config(err.to_string()))?;
    drop_nulls(&mut value);
    let text = toml::to_string(&value).map_err(|err| Error::Config(format!("writing {}: {err}", path.display())))?;
    let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = path.with_extension(format!("toml.{}.{write}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        // Nothing half-written stays behind to be taken for a config.
        std::fs::remove_file(&partial).ok();
    }
    Ok(written?)
}

/// Unset options (TOML has no null) are left out.
fn drop_nulls(value: &mut serde_json::Value) {
    if let serde_json::Value::Object(map) = value {
        map.retain(|_, v| !v.is_null());
        map.values_mut().for_each(drop_nulls);
    }
}

/// A local broker with its data in `dir`, on `port` (a free one when `None`), when
/// `config` names no Kafka; `config` is pointed at it.
pub async fn local_broker_unless_configured(
    config: &mut TallyConfig,
    dir: PathBuf,
    port: Option<u16>,
) -> Result<Option<LocalBroker>> {
    if !config.kafka.bootstrap_servers.trim().is_empty() {
        return Ok(None);
    }
    let port = match port {
        Some(port) => port,
        None => free_port()?,
    };
    let broker = tokio::task::spawn_blocking(move || LocalBroker::start(&ensure_installed()?, port, &dir))
        .await
        .map_err(|err| Error::LocalBroker(err.to_string()))??;
    config.kafka.bootstrap_servers = broker.bootstrap_servers.clone();
    Ok(Some(broker))
}

/// Stops a service: SIGTERM (it persists its batch and leaves), SIGKILL after `grace`.
pub async fn stop(name: &str, child: &mut Child, grace: Duration) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        tracing::warn!(service = name, "did not stop within {grace:?}; killing it");
        if let Err(err) = child.kill().await {
            tracing::warn!(service = name, "killing it: {err}");
        }
    }
}

/// Keeps `service` running until `shutdown` (its config file in `dir`), restarting it
/// with backoff (1 s doubling to 30 s, back to 1 s after a minute up) and saying so;
/// on `shutdown` stops it gracefully.
pub async fn supervise(service: Service, dir: PathBuf, shutdown: CancellationToken) {
    let name = &service.name;
    let mut backoff = Duration::from_secs(1);
    loop {
        let spawned = service
            .command(&dir)
            .and_then(|command| Ok(tokio::process::Command::from(command).kill_on_drop(true).spawn()?));
        let started = Instant::now();
        let ended = match spawned {
            // Not started (its config not written, its binary missing): said, and
            // tried again like a service that died.
            Err(err) => format!("could not start ({}): {err}", service.binary.display()),
            Ok(mut child) => tokio::select! {
                status = child.wait() => status.map(|s| format!("exited ({s})")).unwrap_or_else(|e| format!("exited ({e})")),
                _ = shutdown.cancelled() => {
                    stop(name, &mut child, STOP_GRACE).await;
                    return;
                }
            },
        };
        if shutdown.is_cancelled() {
            return;
        }
        if started.elapsed() > Duration::from_secs(60) {
            backoff = Duration::from_secs(1);
        }
        eprintln!("tally: {name} {ended}; restarting in {}s", backoff.as_secs());
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config written for a service loads back as the same config: every field,
    /// secrets and dotted client settings included.
    #[test]
    fn a_written_config_loads_back_whole() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config = TallyConfig::default();
        config.kafka.bootstrap_servers = "127.0.0.1:19092".into();
        config.kafka.topic_prefix = "t1.".into();
        config.kafka.client.insert("ssl.ca.location".into(), "/tmp/ca.pem".into());
        config.counter.data_dir = dir.path().join("counter");
        config.counter.static_assignment = true;
        config.snapshots.enabled = false;
        config.auth.reader_token = Some("a-reader-token-of-24-chars".into());
        config.log.level = "warn".into();
        let path = dir.path().join("service.toml");
        write_config(&config, &path).expect("written");
        let loaded = TallyConfig::load_with_env(Some(&path), Vec::new()).expect("loads");
        let json = |c: &TallyConfig| serde_json::to_value(c).expect("json");
        assert_eq!(json(&loaded), json(&config));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).expect("metadata").permissions().mode() & 0o777, 0o600);
    }

    /// A declarations file named relative to the user's config is the same file for a
    /// service whose config is written elsewhere.
    #[test]
    fn a_relative_declarations_file_stays_the_users() {
        // The user's config named relative to the working directory (`tally up -c conf/tally.toml`).
        let dir = tempfile::tempdir_in(".").expect("temp dir");
        let cwd = std::env::current_dir().expect("working directory");
        let user = dir.path().strip_prefix(&cwd).unwrap_or(dir.path()).join("conf");
        assert!(user.is_relative());
        std::fs::create_dir_all(&user).expect("conf dir");
        std::fs::write(user.join("tally.toml"), "[broker]\ndeclarations = \"queues.toml\"\n").expect("written");
        let loaded = TallyConfig::load_with_env(Some(&user.join("tally.toml")), Vec::new()).expect("loads");
        assert_eq!(loaded.broker.declarations.as_deref(), Some(cwd.join(&user).join("queues.toml").as_path()));
        let run = dir.path().join("run");
        std::fs::create_dir_all(&run).expect("run dir");
        write_config(&loaded, &run.join("tally-broker.toml")).expect("written");
        let service = TallyConfig::load_with_env(Some(&run.join("tally-broker.toml")), Vec::new()).expect("loads");
        assert_eq!(service.broker.declarations, loaded.broker.declarations);
        assert_eq!(std::fs::read_dir(&run).expect("run dir").count(), 1, "nothing but the config left");
    }
}
