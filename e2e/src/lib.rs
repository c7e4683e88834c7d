//! The sandbox every end-to-end test runs in: its own Tansu broker on a free port,
//! its own topic prefix, the real service binaries as child processes, and helpers
//! to produce input, kill and restart services, read topics and call the HTTP API.

pub mod otlp;
pub mod probes;
pub mod prometheus;
pub mod s3;
pub mod tls;
pub mod workload;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use tally_core::rollups::LatestRollups;
use tally_core::wire::ROLLUP_POSITION_HEADER;
use tally_shared::config::{KafkaConfig, TallyConfig};
use tally_shared::harness;
use tally_shared::kafka::{client_config, producer_config, TopicNames};
use tally_shared::local_broker::{ensure_installed, free_port, LocalBroker};
use tally_shared::topics::{self, Declarations};

/// A broker, a topic prefix and the running services of one test.
pub struct Sandbox {
    pub dir: tempfile::TempDir,
    pub kafka: KafkaConfig,
    pub names: TopicNames,
    pub query_url: String,
    /// Each service's admin address (`/metrics`, `/healthz`, `/readyz`).
    admin: HashMap<&'static str, String>,
    /// What every service started from now on and the command line run with (each
    /// gets it as its config file; a spawn may change its own copy).
    pub config: TallyConfig,
    /// Process environment that is not tally's config (the test S3's credentials).
    process_env: Vec<(String, String)>,
    children: HashMap<&'static str, Child>,
    broker: LocalBroker,
    broker_binary: PathBuf,
    broker_port: u16,
    /// The TLS terminator in front of the broker, when the sandbox is TLS-only.
    tls: Option<tls::Terminator>,
}

/// A record [`Sandbox::read_records`] read.
#[derive(Debug, Clone)]
pub struct ReadRecord {
    pub partition: i32,
    pub key: Option<Vec<u8>>,
    /// Empty for a tombstone (see `tombstone`).
    pub payload: Vec<u8>,
    pub tombstone: bool,
    /// Its headers' keys.
    pub headers: Vec<String>,
    /// Its headers, with their values.
    pub header_values: Vec<(String, Vec<u8>)>,
    /// Its Kafka timestamp, in ms since the epoch.
    pub timestamp: Option<i64>,
}

impl ReadRecord {
    /// The value of header `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.header_values.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_slice())
    }
}

/// How a sandbox starts.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options<'a> {
    /// A built-in topic (short name, e.g. `rollups`) not created until
    /// [`Sandbox::apply_topics`].
    pub missing: &'a str,
    /// Clients reach the broker only through TLS (a private CA, a TLS terminator).
    pub tls: bool,
}

/// Where cargo put the service binaries: next to this test's `deps/` directory.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps directory");
    deps.parent().expect("target profile directory").to_path_buf()
}

impl Sandbox {
    /// Starts a broker and applies the topics; no service runs yet.
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    /// Like [`Sandbox::start`], but the topic `missing` (its short name, e.g.
    /// `rollups`) is not created until [`Sandbox::apply_topics`].
    pub async fn start_without(missing: &str) -> Self {
        Self::start_with(Options { missing, ..Default::default() }).await
    }

    pub async fn start_with(options: Options<'_>) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let binary = tokio::task::spawn_blocking(ensure_installed).await.unwrap().expect("tansu installed");
        let port = free_port().unwrap();
        let tls = match options.tls {
            true => Some(tls::Terminator::start(dir.path().join("tls"), port).await),
            false => None,
        };
        let advertised = tls.as_ref().map_or(port, |t| t.port);
        let broker = start_broker(binary.clone(), port, advertised, dir.path().join("kafka")).await;
        let prefix = format!("t{:08x}.", rand::random::<u32>());
        let mut kafka = KafkaConfig {
            bootstrap_servers: broker.bootstrap_servers.clone(),
            topic_prefix: prefix.clone(),
            ..Default::default()
        };
        if let Some(tls) = &tls {
            kafka.client = tls.client_settings();
        }
        let mut declarations = Declarations::load(None).unwrap();
        declarations.topics.retain(|topic| topic.name != options.missing);
        topics::apply(&kafka, &declarations).await.expect("topics apply");
        let query_port = free_port().unwrap();
        let admin: HashMap<&'static str, String> = ["tally-ingester", "tally-counter", "tally-graph", "tally-query"]
            .into_iter()
            .map(|name| (name, format!("127.0.0.1:{}", free_port().unwrap())))
            .collect();
        let mut config = TallyConfig { kafka: kafka.clone(), ..Default::default() };
        config.ingester.admin_listen = admin["tally-ingester"].clone();
        config.ingester.group_id = format!("{prefix}ingester");
        config.counter.admin_listen = admin["tally-counter"].clone();
        config.counter.group_id = format!("{prefix}counter");
        config.counter.data_dir = dir.path().join("counter");
        config.snapshots.dir = dir.path().join("snapshots");
        config.query.admin_listen = admin["tally-query"].clone();
        config.graph.admin_listen = admin["tally-graph"].clone();
        config.graph.data_dir = dir.path().join("graph");
        // Tansu 0.6 never evicts a member killed with -9 from a consumer group.
        config.ingester.static_assignment = true;
        config.counter.static_assignment = true;
        config.query.listen = format!("127.0.0.1:{query_port}");
        Self {
            names: TopicNames::new(&prefix),
            kafka,
            query_url: format!("http://127.0.0.1:{query_port}"),
            admin,
            config,
            process_env: Vec::new(),
            children: HashMap::new(),
            dir,
            broker,
            broker_binary: binary,
            broker_port: port,
            tls,
        }
    }

    /// The reader token the services were given, which [`Sandbox::get`] and
    /// [`Sandbox::post`] send.
    fn reader_token(&self) -> Option<&str> {
        self.config.auth.reader_token.as_deref()
    }

    /// Applies every built-in topic (after [`Sandbox::start_without`]).
    pub async fn apply_topics(&self) {
        topics::apply(&self.kafka, &Declarations::load(None).unwrap()).await.expect("topics apply");
    }

    /// Deletes `topic` and waits until the broker no longer lists it.
    pub async fn delete_topic(&self, topic: &str) {
        use rdkafka::admin::{AdminClient, AdminOptions};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            client_config(&self.kafka).unwrap().create().unwrap();
        let deleted = admin.delete_topics(&[topic], &AdminOptions::new()).await.expect("deleting a topic");
        assert!(deleted.iter().all(Result::is_ok), "deleting {topic}: {deleted:?}");
        let consumer: BaseConsumer = client_config(&self.kafka).unwrap().create().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while consumer
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .is_ok_and(|m| m.topics().iter().any(|t| t.error().is_none() && !t.partitions().is_empty()))
        {
            assert!(std::time::Instant::now() < deadline, "{topic} is still listed");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The high watermark of one partition: the offset the next record gets.
    pub fn next_offset(&self, topic: &str, partition: i32) -> i64 {
        let consumer: BaseConsumer = client_config(&self.kafka).unwrap().create().unwrap();
        consumer.fetch_watermarks(topic, partition, Duration::from_secs(10)).unwrap().1
    }

    /// The id the broker gives `topic` (none: it gives no ids).
    pub fn topic_id(&self, topic: &str) -> Option<String> {
        let consumer: BaseConsumer = client_config(&self.kafka).unwrap().create().unwrap();
        tally_shared::topic_id::topic_id(consumer.client(), topic, Duration::from_secs(10)).unwrap()
    }

    /// How many partitions `topic` has.
    pub fn partition_count(&self, topic: &str) -> u32 {
        let consumer: BaseConsumer = client_config(&self.kafka).unwrap().create().unwrap();
        tally_shared::kafka::partition_count(&consumer, topic, Duration::from_secs(10)).unwrap()
    }

    /// The offset `group` committed for a partition, if any.
    pub fn committed_offset(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        let mut config = client_config(&self.kafka).unwrap();
        config.set("group.id", group).set("enable.auto.commit", "false");
        let consumer: BaseConsumer = config.create().unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        let committed = consumer.committed_offsets(tpl, Duration::from_secs(10)).ok()?;
        match committed.find_partition(topic, partition)?.offset() {
            Offset::Offset(offset) => Some(offset),
            _ => None,
        }
    }

    /// Stops the broker gracefully and starts it again on the same port and data.
    pub async fn restart_broker(&mut self) {
        self.broker.stop();
        let advertised = self.tls.as_ref().map_or(self.broker_port, |t| t.port);
        let kafka_dir = self.dir.path().join("kafka");
        self.broker = start_broker(self.broker_binary.clone(), self.broker_port, advertised, kafka_dir).await;
    }

    /// Deletes a stopped counter's RocksDB: its shards must rebuild from the log.
    pub fn wipe_counter_data(&self) {
        assert!(!self.children.contains_key("tally-counter"), "stop the counter first");
        remove_dir(&self.dir.path().join("counter"));
    }

    /// Deletes a stopped graph processor's RocksDB: it must rebuild from the log.
    pub fn wipe_graph_data(&self) {
        assert!(!self.children.contains_key("tally-graph"), "stop the graph first");
        remove_dir(&self.dir.path().join("graph"));
    }

    /// Starts (or restarts) a service binary: `tally-ingester`, `tally-counter`, `tally-query`.
    pub fn spawn(&mut self, name: &'static str) {
        self.spawn_instance(name, name, |_| {});
    }

    /// Starts `binary` as the instance `name` (its log is `name.log`) with the
    /// sandbox's config as `change` changes it.
    pub fn spawn_instance(&mut self, name: &'static str, binary: &str, change: impl FnOnce(&mut TallyConfig)) {
        let mut config = self.config.clone();
        change(&mut config);
        self.spawn_configured(name, binary, &config, &[], &[]);
    }

    /// Starts `binary` with arguments as the instance `name` (its log is `name.log`),
    /// with the sandbox's config and the operator's environment `env` on top (how
    /// `tally up` is run).
    pub fn spawn_command(&mut self, name: &'static str, binary: &str, args: &[&str], env: &[(&str, String)]) {
        let config = self.config.clone();
        self.spawn_configured(name, binary, &config, args, env);
    }

    /// Runs `tally up --counters N` as `tally-up`, its data (counters', graph's,
    /// snapshots) under the sandbox's `up`, its ports free, `env` on top; its pid.
    pub fn spawn_up(&mut self, counters: u32, env: &[(&str, String)]) -> u32 {
        let up_dir = self.path("up");
        let free = || format!("127.0.0.1:{}", free_port().unwrap());
        let mut all = vec![
            ("TALLY__COUNTER__ADMIN_LISTEN", "127.0.0.1:0".to_string()),
            ("TALLY__BROKER__LISTEN", free()),
            ("TALLY__BROKER__ADMIN_LISTEN", free()),
            ("TALLY__COUNTER__DATA_DIR", format!("{up_dir}/counter")),
            ("TALLY__GRAPH__DATA_DIR", format!("{up_dir}/graph")),
            ("TALLY__SNAPSHOTS__DIR", format!("{up_dir}/snapshots")),
        ];
        all.extend(env.iter().cloned());
        let counters = counters.to_string();
        self.spawn_command("tally-up", "tally", &["up", "--counters", &counters, "--data-dir", &up_dir], &all);
        self.pid("tally-up").expect("tally up runs")
    }

    /// Starts `binary` as the instance `name` with its own `config` (environment
    /// overrides `env` on top, as an operator's would be).
    fn spawn_configured(
        &mut self,
        name: &'static str,
        binary: &str,
        config: &TallyConfig,
        args: &[&str],
        env: &[(&str, String)],
    ) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{name}.log")))
            .unwrap();
        let child = self
            .command_with(name, binary, config)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k.to_string(), v.clone())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("starting {binary} (run `cargo build --workspace --bins` first): {err}"));
        self.children.insert(name, child);
    }

    /// Applies more declarations (e.g. test queues) on top of the built-in ones and
    /// returns the path of a file holding them all, for the brokers.
    pub async fn declare(&self, extra: &str) -> PathBuf {
        let text = format!("{}\n{extra}", tally_shared::topics::BUILTIN);
        let decls = Declarations::parse(&text).expect("declarations parse");
        topics::apply(&self.kafka, &decls).await.expect("topics apply");
        let path = self.dir.path().join("topics.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Starts a dequeue broker instance serving the queues declared in `declarations`;
    /// returns its worker API URL.
    pub fn spawn_broker(&mut self, name: &'static str, declarations: &std::path::Path) -> String {
        self.spawn_broker_with(name, declarations, |_| {})
    }

    /// [`Sandbox::spawn_broker`] with its config as `change` changes it (e.g. tokens).
    pub fn spawn_broker_with(
        &mut self,
        name: &'static str,
        declarations: &std::path::Path,
        change: impl FnOnce(&mut TallyConfig),
    ) -> String {
        let port = free_port().unwrap();
        let mut config = self.config.clone();
        config.broker.listen = format!("127.0.0.1:{port}");
        config.broker.admin_listen = format!("127.0.0.1:{}", free_port().unwrap());
        config.broker.declarations = Some(declarations.to_path_buf());
        config.broker.group_id = format!("{}broker", self.names.name(""));
        config.broker.heartbeat_ms = 500;
        config.broker.member_timeout_ms = 3000;
        change(&mut config);
        self.admin.insert(name, config.broker.admin_listen.clone());
        self.spawn_configured(name, "tally-broker", &config, &[], &[]);
        format!("http://127.0.0.1:{port}")
    }

    /// Produces raw records to `topic` (keyed) and waits for every acknowledgement.
    pub async fn produce_to(&self, topic: &str, records: &[(Option<String>, Vec<u8>)]) {
        self.send_all(records.iter().map(|(key, payload)| {
            let record = FutureRecord::to(topic).payload(payload.as_slice());
            match key {
                Some(key) => record.key(key.as_str()),
                None => record,
            }
        }))
        .await;
    }

    /// Produces `records` (as read from a topic) to `topic` again, with their key,
    /// payload (or none: a tombstone) and header `header`, and waits for every
    /// acknowledgement.
    pub async fn produce_with_header(&self, topic: &str, header: &str, records: impl IntoIterator<Item = ReadRecord>) {
        use rdkafka::message::{Header, OwnedHeaders};
        let records: Vec<ReadRecord> = records.into_iter().collect();
        self.send_all(records.iter().map(|read| {
            let value = read.header(header);
            let mut record = FutureRecord::to(topic)
                .headers(OwnedHeaders::new().insert(Header { key: header, value }))
                .key(std::str::from_utf8(read.key.as_deref().unwrap_or_default()).expect("a text key"));
            if !read.tombstone {
                record = record.payload(read.payload.as_slice());
            }
            record
        }))
        .await;
    }

    /// Sends records on one producer and waits until every one is acknowledged.
    async fn send_all<'a>(&self, records: impl Iterator<Item = FutureRecord<'a, str, [u8]>>) {
        let producer: FutureProducer = producer_config(&self.kafka).unwrap().create().unwrap();
        let sends = records.map(|record| producer.send(record, Duration::from_secs(30)));
        for result in futures::future::join_all(sends).await {
            result.map_err(|(err, _)| err).expect("produce");
        }
    }

    /// Runs the `tally` command line with the sandbox's settings; its success and output.
    pub fn cli(&self, args: &[&str]) -> (bool, String) {
        self.cli_with(args, &[])
    }

    /// `tally shards skip <shard> <offset> --reason <reason>` (`shard`: a number or
    /// `graph`); its success and output.
    pub fn skip(&self, shard: &str, offset: i64, reason: &str) -> (bool, String) {
        self.cli(&["shards", "skip", shard, &offset.to_string(), "--reason", reason])
    }

    /// [`Self::cli`] with more environment.
    pub fn cli_with(&self, args: &[&str], env: &[(&str, String)]) -> (bool, String) {
        let output = self.command("tally").args(args).envs(env.iter().cloned()).output().expect("running tally");
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        (output.status.success(), text)
    }

    /// Runs one of the workspace's binaries (an example) to its end; its output.
    pub fn run(&self, binary: &str, args: &[&str]) -> std::process::Output {
        self.command(binary).args(args).output().unwrap_or_else(|err| panic!("running {binary}: {err}"))
    }

    /// A command for one of the binaries with the sandbox's config (never the
    /// developer's own `TALLY_CONFIG` or `TALLY__…` variables).
    fn command(&self, binary: &str) -> Command {
        self.command_with(binary, binary, &self.config)
    }

    /// A command for `binary` as the instance `name` with `config` (its file is
    /// `name.toml` in the sandbox's directory).
    fn command_with(&self, name: &str, binary: &str, config: &TallyConfig) -> Command {
        let service =
            harness::Service { name: name.to_string(), binary: bin_dir().join(binary), config: config.clone() };
        let mut command = service.command(self.dir.path()).expect("writing a service's config");
        command.env("RUST_LOG", std::env::var("TALLY_E2E_LOG").unwrap_or_else(|_| "info".into()));
        command.envs(self.process_env.iter().cloned());
        command
    }

    /// Services and the command line started from now on keep their snapshots in `s3`.
    pub fn use_s3(&mut self, s3: &s3::S3) {
        s3.configure(&mut self.config);
        self.process_env.extend(s3.credentials().map(|(key, value)| (key.to_string(), value)));
    }

    /// A scratch directory of this sandbox (for an extra instance's data).
    pub fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// Stops an instance with SIGTERM and waits for it to exit.
    pub fn stop(&mut self, name: &str) {
        if let Some(mut child) = self.children.remove(name) {
            terminate(&mut child);
        }
    }

    /// `kill -9` a service and reap it.
    pub fn kill9(&mut self, name: &'static str) {
        if let Some(mut child) = self.children.remove(name) {
            child.kill().expect("kill -9");
            child.wait().expect("reaping a killed service");
        }
    }

    /// The process id of a running instance.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.children.get(name).map(Child::id)
    }

    /// The names of a running instance's threads (`/proc/<pid>/task/*/comm`), sorted.
    pub fn thread_names(&self, name: &str) -> Vec<String> {
        let pid = self.pid(name).unwrap_or_else(|| panic!("{name} is not running"));
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads");
        let mut names: Vec<String> = tasks
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .map(|comm| comm.trim_end().to_string())
            .collect();
        names.sort();
        names
    }

    /// Sends `signal` to a running instance (`libc::SIGSTOP` pauses it,
    /// `libc::SIGCONT` resumes it).
    pub fn signal(&self, name: &str, sig: libc::c_int) {
        signal(self.pid(name).unwrap_or_else(|| panic!("{name} is not running")), sig);
    }

    /// The log a service wrote so far (for failure messages).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Produces records to their topics (increments or graph) and waits until all are
    /// acknowledged.
    pub async fn produce(&self, records: &[workload::Record]) {
        let (increments, graph) = (self.names.increments(), self.names.graph());
        self.send_all(records.iter().map(|r| {
            let topic = if r.graph { &graph } else { &increments };
            FutureRecord::to(topic).key(r.key.as_str()).payload(r.payload.as_slice()).timestamp(r.timestamp)
        }))
        .await;
    }

    /// Reads every record of `topic` (all partitions) until `expected` are seen or
    /// `timeout` passes.
    pub fn read_topic(&self, topic: &str, expected: usize, timeout: Duration) -> Vec<Vec<u8>> {
        let records = self.read_records(topic, timeout, |records| records.len() >= expected);
        records.into_iter().map(|record| record.payload).collect()
    }

    /// Reads the records of `topic` (all partitions, from the beginning) with their
    /// headers' names until `enough` says so of what was read, or `timeout` passes.
    pub fn read_records(
        &self,
        topic: &str,
        timeout: Duration,
        mut enough: impl FnMut(&[ReadRecord]) -> bool,
    ) -> Vec<ReadRecord> {
        use rdkafka::message::Headers;
        let mut config = client_config(&self.kafka).unwrap();
        config.set("group.id", format!("reader-{:08x}", rand::random::<u32>())).set("enable.auto.commit", "false");
        let consumer: BaseConsumer = config.create().unwrap();
        let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
        let mut tpl = TopicPartitionList::new();
        for partition in metadata.topics()[0].partitions() {
            tpl.add_partition_offset(topic, partition.id(), Offset::Beginning).unwrap();
        }
        consumer.assign(&tpl).unwrap();
        let deadline = std::time::Instant::now() + timeout;
        let mut records = Vec::new();
        while !enough(&records) && std::time::Instant::now() < deadline {
            if let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) {
                let header_values: Vec<(String, Vec<u8>)> = message.headers().map_or_else(Vec::new, |headers| {
                    headers.iter().map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec())).collect()
                });
                records.push(ReadRecord {
                    partition: message.partition(),
                    key: message.key().map(<[u8]>::to_vec),
                    payload: message.payload().unwrap_or_default().to_vec(),
                    tombstone: message.payload().is_none(),
                    headers: header_values.iter().map(|(key, _)| key.clone()).collect(),
                    header_values,
                    timestamp: message.timestamp().to_millis(),
                });
            }
        }
        records
    }

    /// What a consumer of the rollups topic keeps after reading it for `timeout`:
    /// the newest record of every bucket by position (every record must decode).
    pub fn latest_rollups(&self, timeout: Duration) -> LatestRollups {
        let mut latest = LatestRollups::new();
        for record in self.read_records(&self.names.rollups(), timeout, |_| false) {
            let payload = (!record.tombstone).then_some(record.payload.as_slice());
            let position = record.header(ROLLUP_POSITION_HEADER);
            let key = record.key.as_deref().expect("rollups are keyed");
            latest.offer_record(key, payload, position).expect("rollups decode");
        }
        latest
    }

    /// The status of a service's `/readyz` (0 when it does not answer).
    pub async fn readyz(&self, name: &str) -> u16 {
        match reqwest::get(format!("http://{}/readyz", self.admin[name])).await {
            Ok(response) => response.status().as_u16(),
            Err(_) => 0,
        }
    }

    /// A service's `/readyz`: status and body (JSON when not ready, else Null).
    pub async fn readyz_body(&self, name: &str) -> (u16, serde_json::Value) {
        let response = reqwest::get(format!("http://{}/readyz", self.admin[name])).await.expect("GET /readyz");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// Starts `services` and waits until each is ready (60 s at most each), for
    /// tests whose first read must find them answering.
    pub async fn spawn_ready(&mut self, services: &[&'static str]) {
        for service in services {
            self.spawn(service);
        }
        for service in services {
            self.wait_ready(service, Duration::from_secs(60)).await;
        }
    }

    /// Waits until a service reports ready; panics with its log after `timeout`.
    pub async fn wait_ready(&self, name: &str, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.readyz(name).await != 200 {
            assert!(tokio::time::Instant::now() < deadline, "{name} not ready after {timeout:?}:\n{}", self.log(name));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A running service's admin address (`/metrics`, `/healthz`, `/readyz`).
    pub fn admin_addr(&self, name: &str) -> String {
        self.admin.get(name).unwrap_or_else(|| panic!("{name} has no admin address")).clone()
    }

    /// The samples of one metric family on a service's `/metrics`: labels → value.
    pub async fn metric(&self, name: &str, family: &str) -> Vec<(String, f64)> {
        let text = reqwest::get(format!("http://{}/metrics", self.admin[name]))
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .filter(|line| line.starts_with(family) && line[family.len()..].starts_with(['{', ' ']))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                Some((series[family.len()..].to_string(), value.parse().ok()?))
            })
            .collect()
    }

    /// GET a path of the read API: status and JSON body (see [`answer`]).
    pub async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let request = reqwest::Client::new().get(format!("{}{path}", self.query_url));
        answer(self.as_reader(request).send().await).await
    }

    /// POST JSON to a path of the read API (see [`answer`]).
    pub async fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let request = reqwest::Client::new().post(format!("{}{path}", self.query_url)).json(body);
        answer(self.as_reader(request).send().await).await
    }

    /// GET a path of the read API and read its answer into `T` (counts past 2^64,
    /// which `serde_json::Value` cannot hold exactly, read into typed fields).
    pub async fn get_as<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let request = reqwest::Client::new().get(format!("{}{path}", self.query_url));
        typed(self.as_reader(request).send().await, path).await
    }

    /// POST JSON to a path of the read API and read its answer into `T`.
    pub async fn post_as<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<T, String> {
        let request = reqwest::Client::new().post(format!("{}{path}", self.query_url)).json(body);
        typed(self.as_reader(request).send().await, path).await
    }

    fn as_reader(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self.reader_token() {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for (_, mut child) in self.children.drain() {
            terminate(&mut child);
        }
    }
}

/// The children of `parent` whose command is `comm`, by what `key` reads from the
/// config `tally up` started each with (a counter's instance name).
pub fn children(parent: u32, comm: &str, key: fn(&TallyConfig) -> String) -> std::collections::BTreeMap<String, u32> {
    let mut found = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // pid (comm) state ppid …
        let Some((head, rest)) = stat.rsplit_once(") ") else { continue };
        let name = head.split_once(" (").map_or("", |(_, name)| name);
        let ppid: u32 = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid != parent || name != comm {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let config = environ
            .split(|b| *b == 0)
            .filter_map(|var| std::str::from_utf8(var).ok())
            .find_map(|var| var.strip_prefix("TALLY_CONFIG="))
            .and_then(|path| {
                tally_shared::config::TallyConfig::load_with_env(Some(std::path::Path::new(path)), Vec::new()).ok()
            });
        if let Some(config) = config {
            found.insert(key(&config), pid);
        }
    }
    found
}

/// Sends `sig` to process `pid` (`libc::SIGSTOP` pauses it, `libc::SIGCONT`
/// resumes it, `libc::SIGKILL` kills it).
pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

fn terminate(child: &mut Child) {
    // A paused one (a test that failed while it held it stopped) resumes to stop.
    signal(child.id(), libc::SIGTERM);
    signal(child.id(), libc::SIGCONT);
    child.wait().expect("reaping a stopped service");
}

/// Deletes `dir` and what it holds; nothing when there is none.
fn remove_dir(dir: &std::path::Path) {
    match std::fs::remove_dir_all(dir) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => panic!("removing {}: {err}", dir.display()),
        _ => {}
    }
}

/// A read's status and JSON body; status 0 (and the error, as `{"transport":…}`) when
/// the service did not answer — not listening yet on a busy machine, or killed — so
/// that checks that wait for an answer wait on, and others fail saying so.
async fn answer(sent: reqwest::Result<reqwest::Response>) -> (u16, serde_json::Value) {
    match sent {
        Ok(response) => {
            let status = response.status().as_u16();
            (status, response.json().await.unwrap_or(serde_json::Value::Null))
        }
        Err(err) => (0, serde_json::json!({ "transport": err.to_string() })),
    }
}

/// A 200 answer read into `T`; anything else an error naming `path`.
async fn typed<T: serde::de::DeserializeOwned>(
    sent: reqwest::Result<reqwest::Response>,
    path: &str,
) -> Result<T, String> {
    let response = sent.map_err(|err| format!("{path}: {err}"))?;
    let status = response.status().as_u16();
    let body = response.text().await.map_err(|err| format!("{path}: {err}"))?;
    match status {
        200 => serde_json::from_str(&body).map_err(|err| format!("{path}: {err}: {body}")),
        _ => Err(format!("{path}: {status} {body}")),
    }
}

async fn start_broker(binary: PathBuf, port: u16, advertised: u16, dir: PathBuf) -> LocalBroker {
    tokio::task::spawn_blocking(move || LocalBroker::start_advertising(&binary, port, advertised, &dir))
        .await
        .unwrap()
        .expect("broker starts")
}

/// Percent-encodes a path segment.
pub fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

/// Comparisons of the HTTP answers with the model. Answers are read into typed
/// structs: counts may pass 2^64, past what `serde_json::Value` holds exactly.
pub mod check {
    use serde::Deserialize;
    use serde_json::{json, Value};
    use tally_core::model::Model;
    use tally_core::time::{format_duration, parse_duration, Resolutions, WindowSpec};
    use tally_core::wire::Kind;

    use crate::{encode, Sandbox};

    /// One window of a batch read.
    #[derive(Debug, Deserialize)]
    struct WindowAnswer {
        resolution: String,
        from: i64,
        to: i64,
        value: i128,
    }

    #[derive(Debug, Deserialize)]
    struct BatchAnswer {
        results: Vec<WindowAnswer>,
    }

    #[derive(Debug, Deserialize)]
    struct SeriesAnswer {
        points: Vec<Point>,
    }

    #[derive(Debug, Deserialize)]
    struct Point {
        t: i64,
        value: i128,
    }

    #[derive(Debug, Deserialize)]
    struct MetricsPage {
        metrics: Vec<ListedMetric>,
        next_page_token: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    struct ListedMetric {
        metric: String,
        direct: i128,
        total: i128,
    }

    #[derive(Debug, Deserialize)]
    struct ContributorsPage {
        entity: String,
        metric: String,
        window: String,
        resolution: String,
        from: i64,
        to: i64,
        total: i128,
        direct: i128,
        contributors: Vec<Contributor>,
        next_page_token: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    struct Contributor {
        entity: String,
        value: i128,
    }

    /// A page of a listing: where the next one starts.
    pub trait Page: serde::de::DeserializeOwned {
        fn next_page_token(&self) -> Option<&str>;
    }

    impl Page for Value {
        fn next_page_token(&self) -> Option<&str> {
            self["next_page_token"].as_str()
        }
    }

    impl Page for MetricsPage {
        fn next_page_token(&self) -> Option<&str> {
            self.next_page_token.as_deref()
        }
    }

    impl Page for ContributorsPage {
        fn next_page_token(&self) -> Option<&str> {
            self.next_page_token.as_deref()
        }
    }

    /// Every (entity, metric) all-time total and direct equals the model's; the
    /// mismatches otherwise.
    pub async fn all_time(
        sandbox: &Sandbox,
        model: &Model,
        entities: &[String],
        metrics: &[String],
    ) -> Result<(), String> {
        let mut queries = Vec::new();
        let mut expected = Vec::new();
        for entity in entities {
            let sums = model.metrics(entity);
            for metric in metrics {
                let (direct, total) = sums.get(metric).copied().unwrap_or((0, 0));
                for (kind, want) in [("total", total), ("direct", direct)] {
                    queries.push(json!({"entity": entity, "metric": metric, "window": "all", "kind": kind}));
                    expected.push(want);
                }
            }
        }
        let body: BatchAnswer = sandbox
            .post_as("/v1/query", &json!({ "queries": queries }))
            .await
            .map_err(|failure| format!("batch read failed: {failure}"))?;
        if body.results.len() != queries.len() {
            return Err(format!("{} results for {} queries: {body:?}", body.results.len(), queries.len()));
        }
        let mut mismatches = Vec::new();
        for ((query, want), got) in queries.iter().zip(&expected).zip(body.results) {
            if got.value != *want {
                mismatches.push(format!("{query}: want {want}, got {}", got.value));
            }
        }
        if mismatches.is_empty() {
            Ok(())
        } else {
            Err(mismatches.join("\n"))
        }
    }

    /// Waits until every answer equals the model, and panics at once if the read API
    /// ever answers 200 with something else: after every input is in Kafka, a
    /// counter (rebuilding or not) must never serve partial totals. Non-200 answers
    /// (no owner yet) are waited out until `timeout`.
    pub async fn never_partial(
        sandbox: &Sandbox,
        model: &Model,
        entities: &[String],
        metrics: &[String],
        timeout: std::time::Duration,
    ) -> usize {
        let deadline = std::time::Instant::now() + timeout;
        let mut unavailable = 0;
        loop {
            match all_time(sandbox, model, entities, metrics).await {
                Ok(()) => return unavailable,
                Err(failure) if failure.starts_with("batch read failed") => {
                    unavailable += 1;
                    assert!(std::time::Instant::now() < deadline, "never answered: {failure}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(mismatches) => panic!("a 200 answer with partial totals:\n{mismatches}"),
            }
        }
    }

    /// Waits until [`all_time`] holds; panics with the mismatches after `timeout`.
    pub async fn wait_for_all_time(
        sandbox: &Sandbox,
        model: &Model,
        entities: &[String],
        metrics: &[String],
        timeout: std::time::Duration,
    ) {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let result = all_time(sandbox, model, entities, metrics).await;
            match result {
                Ok(()) => return,
                Err(mismatches) if std::time::Instant::now() > deadline => {
                    panic!(
                        "counts never matched the model:\n{mismatches}\n--- counter log ---\n{}\n--- graph log ---\n{}\n--- ingester log ---\n{}",
                        sandbox.log("tally-counter"),
                        sandbox.log("tally-graph"),
                        sandbox.log("tally-ingester")
                    )
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(500)).await,
            }
        }
    }

    /// `Err` with a message unless `got == want` (whole values: lengths included).
    fn same<T: PartialEq + std::fmt::Debug>(got: T, want: T, context: impl std::fmt::Display) -> Result<(), String> {
        if got == want {
            Ok(())
        } else {
            Err(format!("{context}: got {got:?}, want {want:?}"))
        }
    }

    /// Windows of every counter, both kinds, through one batch request.
    pub async fn windows(sandbox: &Sandbox, model: &Model, entities: &[String], metrics: &[String]) {
        try_windows(sandbox, model, entities, metrics).await.unwrap_or_else(|mismatch| panic!("{mismatch}"));
    }

    /// [`windows`], as a result (for negative controls).
    pub async fn try_windows(
        sandbox: &Sandbox,
        model: &Model,
        entities: &[String],
        metrics: &[String],
    ) -> Result<(), String> {
        let resolutions = Resolutions::default();
        let windows = ["90s", "5m", "1h", "6h", "24h", "7d", "30d"];
        let mut queries = Vec::new();
        for entity in entities {
            for metric in metrics {
                for window in windows {
                    for kind in ["direct", "total"] {
                        queries.push(json!({"entity": entity, "metric": metric, "window": window, "kind": kind}));
                    }
                }
            }
        }
        for chunk in queries.chunks(1_000) {
            let body: BatchAnswer = sandbox.post_as("/v1/query", &json!({ "queries": chunk })).await?;
            same(body.results.len(), chunk.len(), "one result per query")?;
            for (query, result) in chunk.iter().zip(&body.results) {
                let window_ms = parse_duration(query["window"].as_str().unwrap()).unwrap();
                let plan = resolutions.plan(WindowSpec::Last { window_ms }, result.to).unwrap();
                same(result.resolution.as_str(), plan.resolution_name(), query)?;
                same(result.from, plan.start, query)?;
                let kind = if query["kind"] == "total" { Kind::Total } else { Kind::Direct };
                let (entity, metric) = (query["entity"].as_str().unwrap(), query["metric"].as_str().unwrap());
                let want = model.sums(entity, metric, kind, &plan)[0];
                same(result.value, want, format!("{query} → {result:?}"))?;
            }
        }
        Ok(())
    }

    /// Series at several steps for each counter, both kinds.
    pub async fn series(sandbox: &Sandbox, model: &Model, entities: &[String], metrics: &[String]) {
        try_series(sandbox, model, entities, metrics).await.unwrap_or_else(|mismatch| panic!("{mismatch}"));
    }

    /// [`series`], as a result (for negative controls).
    pub async fn try_series(
        sandbox: &Sandbox,
        model: &Model,
        entities: &[String],
        metrics: &[String],
    ) -> Result<(), String> {
        let resolutions = Resolutions::default();
        for entity in entities {
            for metric in metrics {
                for (step, range, kind) in
                    [("5m", "2h", "total"), ("1h", "24h", "direct"), ("1d", "7d", "total"), ("2h", "3d", "direct")]
                {
                    let path = format!(
                        "/v1/counters/{}/{}/series?step={step}&range={range}&kind={kind}",
                        encode(entity),
                        encode(metric)
                    );
                    let body: SeriesAnswer = sandbox.get_as(&path).await?;
                    let last_t = body.points.last().map(|p| p.t).ok_or_else(|| format!("{path}: no point"))?;
                    let spec = WindowSpec::Series {
                        step_ms: parse_duration(step).unwrap(),
                        range_ms: parse_duration(range).unwrap(),
                    };
                    let plan = resolutions.plan(spec, last_t).unwrap();
                    let kind = if kind == "total" { Kind::Total } else { Kind::Direct };
                    let want = model.sums(entity, metric, kind, &plan);
                    let got: Vec<i128> = body.points.iter().map(|p| p.value).collect();
                    let times: Vec<i64> = body.points.iter().map(|p| p.t).collect();
                    let want_times: Vec<i64> = (0..plan.points as i64).map(|i| plan.start + i * plan.step).collect();
                    same(times, want_times, &path)?;
                    same(got, want, &path)?;
                }
            }
        }
        Ok(())
    }

    /// Every page of the listing at `base` (a path with its query), following
    /// `next_page_token`: each page's path and body; `Err` unless every page is a 200,
    /// and when a token comes back a second time (a listing that would never end).
    pub async fn pages<P: Page>(sandbox: &Sandbox, base: &str) -> Result<Vec<(String, P)>, String> {
        let mut pages = Vec::new();
        let mut path = base.to_string();
        let mut tokens = std::collections::HashSet::new();
        loop {
            let body: P = sandbox.get_as(&path).await?;
            let next = match body.next_page_token() {
                Some(token) => {
                    same(tokens.insert(token.to_string()), true, format!("{path}: token {token} again"))?;
                    Some(format!("{base}&page_token={token}"))
                }
                None => None,
            };
            pages.push((path, body));
            match next {
                Some(next) => path = next,
                None => return Ok(pages),
            }
        }
    }

    /// Metric listings, paginated two at a time.
    pub async fn listings(sandbox: &Sandbox, model: &Model, entities: &[String]) {
        try_listings(sandbox, model, entities).await.unwrap_or_else(|mismatch| panic!("{mismatch}"));
    }

    /// [`listings`], as a result (for negative controls).
    pub async fn try_listings(sandbox: &Sandbox, model: &Model, entities: &[String]) -> Result<(), String> {
        for entity in entities {
            let mut listed: Vec<(String, (i128, i128))> = Vec::new();
            let base = format!("/v1/entities/{}/metrics?limit=2", encode(entity));
            for (_, page) in pages::<MetricsPage>(sandbox, &base).await? {
                listed.extend(page.metrics.into_iter().map(|m| (m.metric, (m.direct, m.total))));
            }
            let want: Vec<(String, (i128, i128))> = model.metrics(entity).into_iter().collect();
            same(listed, want, entity)?;
        }
        Ok(())
    }

    /// Every counter's contributors (`all` and `24h`), paginated two at a time: the
    /// model's ranking (every nonzero ancestor, largest first), its total and direct,
    /// and `direct + Σ contributors = total` over the pages of one listing.
    pub async fn contributors(sandbox: &Sandbox, model: &Model, entities: &[String], metrics: &[String]) {
        try_contributors(sandbox, model, entities, metrics).await.unwrap_or_else(|mismatch| panic!("{mismatch}"));
    }

    /// [`contributors`], as a result (for negative controls).
    pub async fn try_contributors(
        sandbox: &Sandbox,
        model: &Model,
        entities: &[String],
        metrics: &[String],
    ) -> Result<(), String> {
        let resolutions = Resolutions::default();
        for entity in entities {
            for metric in metrics {
                for window in ["all", "24h"] {
                    let base = format!(
                        "/v1/counters/{}/{}/contributors?window={window}&limit=2",
                        encode(entity),
                        encode(metric)
                    );
                    let (mut listed, mut first) = (Vec::new(), None);
                    for (path, page) in pages::<ContributorsPage>(sandbox, &base).await? {
                        same(page.contributors.len() <= 2, true, format!("{path}: at most `limit`: {page:?}"))?;
                        listed.extend(page.contributors.iter().map(|c| (c.entity.clone(), c.value)));
                        let header = (
                            page.entity,
                            page.metric,
                            page.window,
                            page.resolution,
                            page.from,
                            page.to,
                            page.total,
                            page.direct,
                        );
                        match &first {
                            None => first = Some(header),
                            Some(earlier) => same(&header, earlier, format!("{path}: every page alike"))?,
                        }
                    }
                    let header = first.ok_or_else(|| format!("{base}: no page"))?;
                    let to = header.5;
                    let spec = match window {
                        "all" => WindowSpec::All,
                        text => WindowSpec::Last { window_ms: parse_duration(text).unwrap() },
                    };
                    let plan = resolutions.plan(spec, to).unwrap();
                    let echoed = match spec {
                        WindowSpec::Last { window_ms } => format_duration(window_ms),
                        _ => window.to_string(),
                    };
                    let want_header = (
                        entity.clone(),
                        metric.clone(),
                        echoed,
                        plan.resolution_name().to_string(),
                        plan.start,
                        to,
                        model.sums(entity, metric, Kind::Total, &plan)[0],
                        model.sums(entity, metric, Kind::Direct, &plan)[0],
                    );
                    same(&header, &want_header, &base)?;
                    let want = model.contributors(entity, metric, &plan);
                    same(&listed, &want, &base)?;
                    let sum: i128 = listed.iter().map(|(_, v)| v).sum();
                    same(header.7 + sum, header.6, format!("{base}: adds up"))?;
                }
            }
        }
        Ok(())
    }

    /// Bad requests are 400s with a JSON error, never 500s.
    pub async fn bad_requests(sandbox: &Sandbox) {
        let gets = [
            "/v1/counters/user:1/views?window=7x",
            "/v1/counters/user:1/views?window=1000d",
            "/v1/counters/user:1/Views",
            "/v1/counters/user:1/views?kind=sum",
            "/v1/counters/user:1/views?colour=red",
            "/v1/counters/user:1/views/series?step=90s&range=1h",
            "/v1/counters/user:1/views/series?step=1m&range=30d",
            "/v1/counters/user:1/views/series?step=1s&range=1000d",
            "/v1/counters/%09tab/views",
            "/v1/entities/user:1/metrics?limit=0",
            "/v1/entities/user:1/metrics?page_token=%21%21",
            "/v1/graph/user:1?direction=sideways",
            "/v1/graph/user:1?limit=0",
            "/v1/graph/%09tab",
            "/v1/counters/user:1/views/contributors?limit=0",
            "/v1/counters/user:1/views/contributors?window=7x",
            "/v1/counters/user:1/views/contributors?page_token=YzE6MTp4",
            "/v1/counters/user:1/views/contributors?page_token=YzI6MDoxOmE",
            "/v1/counters/user:1/views/contributors?sort=up",
        ];
        for path in gets {
            bad_request(sandbox, path).await.unwrap_or_else(|mismatch| panic!("{mismatch}"));
        }
        let too_many: Vec<Value> = (0..1_001).map(|i| json!({"entity": format!("e{i}"), "metric": "m"})).collect();
        for body in
            [json!({"queries": too_many}), json!({"queries": [{"entity": "e"}]}), json!({"nope": 1}), json!([1, 2])]
        {
            let (status, answer) = sandbox.post("/v1/query", &body).await;
            assert_eq!(status, 400, "{answer}");
            assert!(answer["error"]["code"].is_string(), "{answer}");
        }
        let (status, _) = sandbox.get("/v1/counters/never-written/views?window=7d").await;
        assert_eq!(status, 200);
    }

    /// `Ok` when GET `path` answers 400 with a JSON error.
    pub async fn bad_request(sandbox: &Sandbox, path: &str) -> Result<(), String> {
        let (status, body) = sandbox.get(path).await;
        same(status, 400, format!("{path}: {body}"))?;
        let described = body["error"]["code"].is_string() && body["error"]["message"].is_string();
        same(described, true, format!("{path}: a JSON error: {body}"))
    }
}
