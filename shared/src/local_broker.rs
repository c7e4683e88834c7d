//! A local Kafka-protocol broker for `tally up` and the tests: Tansu 0.6.0 with sqlite
//! storage (see LOCAL_KAFKA.md for why this one).
//!
//! Installed once per machine with `cargo install` into a cache directory outside the
//! repository (`$TALLY_TANSU_ROOT`, default `~/.cache/tally/tansu-0.6.0`), started on a
//! chosen port with its data in a chosen directory, and stopped with SIGTERM on drop.
//!
//! Once started, its database gets one index Tansu's schema lacks
//! ([`HEADERS_INDEX`]): without it every record a fetch returns scans the table of
//! every record header ever written, so a broker fed headers (tally's routed records
//! carry some) slows as it fills until its clients' sessions time out.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The Tansu release tally is tested with.
pub const TANSU_VERSION: &str = "0.6.0";

/// The index on Tansu's record headers, by the record they belong to: the one its
/// fetch looks them up by. Made with Debian's `sqlite3` (the scripts install it) on
/// every start; a no-op when there.
pub const HEADERS_INDEX: &str = "create index if not exists tally_header_by_record on header (topition, offset_id)";

/// Where Tansu is installed: `$TALLY_TANSU_ROOT`, else `~/.cache/tally/tansu-0.6.0`.
pub fn install_root() -> PathBuf {
    if let Some(root) = std::env::var_os("TALLY_TANSU_ROOT") {
        return PathBuf::from(root);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("tally").join(format!("tansu-{TANSU_VERSION}"))
}

/// The Tansu binary, installing it first when missing (about 16 minutes on 2 cores,
/// once per machine; cargo prints its progress).
pub fn ensure_installed() -> Result<PathBuf> {
    let root = install_root();
    let binary = root.join("bin").join("tansu");
    if binary.exists() {
        return Ok(binary);
    }
    eprintln!("tally: installing the local Kafka-protocol broker (Tansu {TANSU_VERSION}) into {} — once per machine, ~16 min on 2 cores", root.display());
    let status = Command::new("cargo")
        .args(["install", "tansu", "--version", TANSU_VERSION, "--locked", "--features", "libsql", "--root"])
        .arg(&root)
        .status()
        .map_err(|err| Error::LocalBroker(format!("running cargo install: {err}")))?;
    if !status.success() || !binary.exists() {
        return Err(Error::LocalBroker(format!("cargo install tansu failed ({status})")));
    }
    Ok(binary)
}

/// A port nobody listens on right now, and never handed out before by this process.
///
/// Picked at random below the kernel's ephemeral range (32768 and up), where no
/// outgoing connection can take it between this check and the caller's bind. A port
/// is handed out once per process: tests running side by side in one process each
/// pick their services' ports before those services bind them, and a port picked
/// twice in that window was a second service's "Address already in use".
pub fn free_port() -> Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    static PICKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static HANDED_OUT: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    let mut handed_out = crate::lock::lock(&HANDED_OUT, "the ports handed out");
    for _ in 0..200 {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(PICKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        hasher.write_u32(std::process::id());
        let port = 12_000 + (hasher.finish() % 20_000) as u16;
        if !handed_out.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A running local broker; stopped (SIGTERM, then SIGKILL after 5 s) when dropped.
pub struct LocalBroker {
    child: Child,
    /// `127.0.0.1:<port>`, for `bootstrap.servers`.
    pub bootstrap_servers: String,
    data_dir: PathBuf,
}

impl LocalBroker {
    /// Starts Tansu on `127.0.0.1:port` with its sqlite database and log in
    /// `data_dir`, and waits until it accepts connections.
    pub fn start(binary: &Path, port: u16, data_dir: &Path) -> Result<Self> {
        Self::start_advertising(binary, port, port, data_dir)
    }

    /// [`LocalBroker::start`], telling clients to connect to `127.0.0.1:advertised`
    /// instead — a TLS terminator in front of the plain listener, say.
    pub fn start_advertising(binary: &Path, port: u16, advertised: u16, data_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(data_dir)?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(data_dir.join("tansu.log"))?;
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised_url = format!("tcp://127.0.0.1:{advertised}");
        let child = Command::new(binary)
            .arg("broker")
            .args(["--listener-url", &url, "--advertised-listener-url", &advertised_url])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .current_dir(data_dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|err| Error::LocalBroker(format!("starting {}: {err}", binary.display())))?;
        let bootstrap_servers = format!("127.0.0.1:{advertised}");
        let mut broker = Self { child, bootstrap_servers, data_dir: data_dir.to_path_buf() };
        broker.wait_ready(port, Duration::from_secs(60))?;
        broker.index_headers()?;
        Ok(broker)
    }

    /// Adds [`HEADERS_INDEX`] to the database Tansu made on start-up, waiting up to
    /// 10 s for Tansu's own writes.
    fn index_headers(&self) -> Result<()> {
        let output = Command::new("sqlite3")
            // No ~/.sqliterc; the first error ends it.
            .args(["-init", "/dev/null", "-bail"])
            .arg(self.data_dir.join("tansu.db"))
            .args([".timeout 10000", HEADERS_INDEX])
            .stdin(Stdio::null())
            .output()
            .map_err(|err| {
                Error::LocalBroker(format!(
                    "running sqlite3 to index the local broker's record headers (`apt-get install sqlite3`; scripts/test.sh and scripts/up.sh install it): {err}"
                ))
            })?;
        if !output.status.success() {
            return Err(Error::LocalBroker(format!(
                "indexing the local broker's record headers: sqlite3 {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        Ok(())
    }

    fn wait_ready(&mut self, port: u16, timeout: Duration) -> Result<()> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + timeout;
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(Error::LocalBroker(format!("tansu exited during start-up ({status}); see its tansu.log")));
            }
            if Instant::now() > deadline {
                return Err(Error::LocalBroker(format!(
                    "tansu did not accept connections on {addr} within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Where its database and log are.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The broker's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops the broker gracefully and waits for it.
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Err(err) = self.child.kill() {
            tracing::warn!(error = %err, "killing the local broker");
        }
        if let Err(err) = self.child.wait() {
            tracing::warn!(error = %err, "waiting for the local broker to stop");
        }
    }
}

impl Drop for LocalBroker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two thousand picks, none of them bound meanwhile (a sandbox picks its services'
    /// ports before it starts them): every one different.
    #[test]
    fn a_port_is_handed_out_once_even_before_anyone_binds_it() {
        let ports: Vec<u16> = (0..2_000).map(|_| free_port().unwrap()).collect();
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
        assert!(ports.iter().all(|port| (12_000..32_000).contains(port)), "below the ephemeral range");
    }

    /// Tansu 0.6.0's own query for a fetched record's headers
    /// (`tansu-storage/src/sql/header_fetch.sql`): once the broker has started, sqlite
    /// answers it through the index, not by reading every header written.
    #[test]
    fn a_started_broker_finds_a_records_headers_by_index() {
        let dir = tempfile::tempdir().unwrap();
        let broker = LocalBroker::start(&ensure_installed().unwrap(), free_port().unwrap(), dir.path()).unwrap();
        let header_fetch = "select h.k, h.v from header h \
            join record r on h.topition = r.topition and h.offset_id = r.offset_id \
            join topition tp on tp.id = r.topition join topic t on tp.topic = t.id \
            join cluster c on t.cluster = c.id \
            where c.name = ?1 and t.name = ?2 and tp.partition = ?3 and r.offset_id = ?4";
        let output = Command::new("sqlite3")
            .args(["-init", "/dev/null", "-bail"])
            .arg(broker.data_dir().join("tansu.db"))
            .arg(format!("explain query plan {header_fetch}"))
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let plan = String::from_utf8(output.stdout).unwrap();
        let headers: Vec<&str> = plan.lines().filter(|line| line.contains(" h ") || line.ends_with(" h")).collect();
        assert_eq!(
            headers.iter().map(|line| line.trim_start_matches(|c: char| !c.is_ascii_alphabetic())).collect::<Vec<_>>(),
            ["SEARCH h USING INDEX tally_header_by_record (topition=? AND offset_id=?)"],
            "{plan}"
        );
    }
}
