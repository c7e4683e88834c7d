//! A real S3 API for the snapshot-store tests: moto's server (installed from PyPI by
//! `scripts/test.sh` into `~/.cache/tally/s3-venv`, or `$TALLY_MOTO_SERVER`) on a free
//! port, with one bucket.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Requests under the services' access key: moto checks no signature, only whose the
/// objects are (an anonymous writer may not replace theirs, nor read them).
const AUTHORIZATION: &str =
    "AWS4-HMAC-SHA256 Credential=test/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0";

pub struct S3 {
    child: Child,
    pub endpoint: String,
    pub bucket: String,
}

impl S3 {
    pub async fn start(log: PathBuf) -> Self {
        let binary = std::env::var_os("TALLY_MOTO_SERVER").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/tally/s3-venv/bin/moto_server")
        });
        assert!(binary.exists(), "{}: moto's S3 server is missing; ./scripts/test.sh installs it", binary.display());
        let port = tally_shared::local_broker::free_port().unwrap();
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(&binary)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("starting {}: {err}", binary.display()));
        let endpoint = format!("http://127.0.0.1:{port}");
        let bucket = "tally-snapshots".to_string();
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(created) = client.put(format!("{endpoint}/{bucket}")).send().await {
                assert!(created.status().is_success(), "creating the bucket: {}", created.status());
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "moto's S3 server did not start");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Self { child, endpoint, bucket }
    }

    /// Points `config`'s snapshots at this server.
    pub fn configure(&self, config: &mut tally_shared::config::TallyConfig) {
        config.snapshots.url = format!("s3://{}/tally", self.bucket);
        config.snapshots.endpoint = self.endpoint.clone();
        config.snapshots.allow_http = true;
    }

    /// The credentials it takes, as the environment a client reads them from.
    pub fn credentials(&self) -> [(&'static str, String); 2] {
        [("AWS_ACCESS_KEY_ID", "test".into()), ("AWS_SECRET_ACCESS_KEY", "test".into())]
    }

    /// Writes an object, as a misbehaving writer of the bucket would.
    pub async fn put(&self, key: &str, bytes: Vec<u8>) {
        let url = format!("{}/{}/{key}", self.endpoint, self.bucket);
        let request = reqwest::Client::new().put(url).header("authorization", AUTHORIZATION).body(bytes);
        let response = request.send().await.expect("putting an object");
        assert!(response.status().is_success(), "putting {key}: {}", response.status());
    }

    /// The keys stored in the bucket (its ListObjectsV2, first page).
    pub async fn keys(&self) -> Vec<String> {
        self.objects().await.into_iter().map(|(key, _)| key).collect()
    }

    /// The ETag of the object `key` (a multipart upload's ends in `-<parts>`).
    pub async fn etag(&self, key: &str) -> String {
        let response = reqwest::Client::new()
            .head(format!("{}/{}/{key}", self.endpoint, self.bucket))
            .header("authorization", AUTHORIZATION)
            .send()
            .await
            .expect("a HEAD of the object");
        assert!(response.status().is_success(), "HEAD {key}: {}", response.status());
        let etag = response.headers().get("etag").expect("an ETag").to_str().expect("an ASCII ETag");
        etag.trim_matches('"').to_string()
    }

    /// The objects stored in the bucket with their sizes (first page).
    pub async fn objects(&self) -> Vec<(String, u64)> {
        let body = reqwest::get(format!("{}/{}?list-type=2", self.endpoint, self.bucket))
            .await
            .expect("listing the bucket")
            .text()
            .await
            .expect("the listing");
        let field = |entry: &str, name: &str| {
            let (_, rest) = entry.split_once(&format!("<{name}>"))?;
            rest.split_once(&format!("</{name}>")).map(|(value, _)| value.to_string())
        };
        body.split("<Contents>")
            .skip(1)
            .filter_map(|entry| Some((field(entry, "Key")?, field(entry, "Size")?.parse().ok()?)))
            .collect()
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        // Dropped: a failure to stop it leaves a process the machine reaps later.
        self.child.kill().ok();
        self.child.wait().ok();
    }
}
