//! A TLS-only Kafka for the sandbox: a private CA and a server certificate made
//! with `openssl`, and Debian's `stunnel4` terminating TLS in front of the local
//! broker's plain listener (which advertises the TLS port, so every client
//! connection goes through TLS).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tally_shared::local_broker::free_port;

/// A running TLS terminator; stopped when dropped.
pub struct Terminator {
    child: Child,
    /// Where clients connect (TLS).
    pub port: u16,
    /// The CA that signed the server certificate (`ssl.ca.location`).
    pub ca: PathBuf,
}

/// Runs a tool in `dir`; panics with its stderr when it fails.
fn run(dir: &Path, program: &str, args: &[&str]) {
    let output = Command::new(program).args(args).current_dir(dir).output().unwrap_or_else(|err| {
        panic!("running {program} (Debian's openssl and stunnel4; scripts/test.sh installs them): {err}")
    });
    assert!(output.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&output.stderr));
}

impl Terminator {
    /// Makes the certificates in `dir` and starts stunnel on a free port,
    /// forwarding to `127.0.0.1:backend`.
    pub async fn start(dir: PathBuf, backend: u16) -> Self {
        tokio::task::spawn_blocking(move || Self::start_blocking(&dir, backend)).await.expect("tls terminator")
    }

    fn start_blocking(dir: &Path, backend: u16) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let days = ["-days", "2"];
        run(
            dir,
            "openssl",
            &[
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                    "-subj",
                    "/CN=tally test CA",
                ][..],
                &days,
            ]
            .concat(),
        );
        run(
            dir,
            "openssl",
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        );
        std::fs::write(dir.join("san.ext"), "subjectAltName = IP:127.0.0.1, DNS:localhost\n").unwrap();
        let sign = ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial"];
        run(dir, "openssl", &[&sign[..], &["-out", "server.pem", "-extfile", "san.ext"], &days].concat());

        let port = free_port().unwrap();
        let config = format!(
            "foreground = yes\npid =\n[kafka]\naccept = 127.0.0.1:{port}\nconnect = 127.0.0.1:{backend}\n\
             cert = {cert}\nkey = {key}\n",
            cert = dir.join("server.pem").display(),
            key = dir.join("server.key").display(),
        );
        std::fs::write(dir.join("stunnel.conf"), config).unwrap();
        let log = std::fs::File::create(dir.join("stunnel.log")).unwrap();
        let child = Command::new("stunnel4")
            .arg(dir.join("stunnel.conf"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("starting stunnel4 (scripts/test.sh installs it): {err}"));
        let mut terminator = Self { child, port, ca: dir.join("ca.pem") };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = terminator.child.try_wait() {
                let log = std::fs::read_to_string(dir.join("stunnel.log")).unwrap_or_default();
                panic!("stunnel4 exited ({status}):\n{log}");
            }
            assert!(Instant::now() < deadline, "stunnel4 did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        terminator.port = port;
        terminator
    }

    /// librdkafka settings of a client that trusts this terminator.
    pub fn client_settings(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("security.protocol".to_string(), "SSL".to_string()),
            ("ssl.ca.location".to_string(), self.ca.display().to_string()),
        ])
    }
}

impl Drop for Terminator {
    fn drop(&mut self) {
        // Dropped: a failure to stop it leaves a process the machine reaps later.
        self.child.kill().ok();
        self.child.wait().ok();
    }
}
