//! Read-your-writes end to end: `tally up --counters 3`, and 10 000 write → read
//! pairs (increments, edges added and removed) from concurrent sessions while
//! counters and the ingester are killed with -9 (tally up starts them again) and
//! counters paused. Each session owns its entities — leaves it increments,
//! parents it links leaves to — so it knows every count exactly; each write hands
//! back a token, and the read that follows names the session's newest token of
//! every partition it wrote (`after=`). No read may miss a write of its session:
//! its value equals the session's model, and every shard it read says (`as_of`'s
//! `through`) it holds at least those tokens. A negative control reads without the
//! tokens, at once, and sees misses.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use tally_core::position::token::{TokenTopic, WriteToken};
use tally_e2e::{children, encode, signal, Sandbox};

const PAIRS: usize = 10_000;
const SESSIONS: usize = 40;
const LEAVES: usize = 6;
const PARENTS: usize = 3;
/// How long a read may wait for its tokens (a killed owner's shards move within
/// seconds).
const MAX_WAIT_MS: u64 = 30_000;
/// How often something is killed or paused.
const CHAOS_EVERY_S: u64 = 20;

/// What a session wrote, and what it must read.
struct Session {
    id: usize,
    producer: FutureProducer,
    topics: (String, String),
    /// The newest token of each partition written.
    tokens: BTreeMap<(TokenTopic, u32), WriteToken>,
    counts: [i64; LEAVES],
    /// Leaves linked to each parent.
    links: [Vec<usize>; PARENTS],
}

/// One finished pair's outcome.
#[derive(Default)]
struct Tally {
    misses: Vec<String>,
    control_reads: usize,
    control_misses: usize,
    retried: usize,
}

impl Session {
    fn leaf(&self, i: usize) -> String {
        format!("ryw{}:leaf{i}", self.id)
    }

    fn parent(&self, j: usize) -> String {
        format!("ryw{}:parent{j}", self.id)
    }

    async fn write(&mut self, graph: bool, key: &str, body: Value) {
        let topic = if graph { &self.topics.1 } else { &self.topics.0 };
        let payload = body.to_string();
        let record = FutureRecord::to(topic).key(key).payload(&payload);
        let delivered = self.producer.send(record, Duration::from_secs(30)).await;
        let delivery = delivered.map_err(|(err, _)| err).expect("produce");
        let (partition, offset) = (delivery.partition, delivery.offset);
        let role = if graph { TokenTopic::Graph } else { TokenTopic::Increments };
        let token = WriteToken { topic: role.clone(), partition: partition as u32, offset };
        self.tokens.insert((role, partition as u32), token);
    }

    /// The session's tokens as `after=` takes them.
    fn after(&self) -> String {
        self.tokens.values().map(WriteToken::encode).collect::<Vec<_>>().join(",")
    }

    /// Writes one thing and reads what it changed: the read's path and the value
    /// the session's model says.
    async fn step(&mut self, rng: &mut StdRng) -> (String, i64, bool) {
        let leaf = rng.random_range(0..LEAVES);
        let linked: Vec<(usize, usize)> =
            (0..PARENTS).flat_map(|p| self.links[p].iter().map(move |l| (*l, p))).collect();
        if !linked.is_empty() && rng.random_bool(0.08) {
            let (leaf, parent) = linked[rng.random_range(0..linked.len())];
            let (from, to) = (self.leaf(leaf), self.parent(parent));
            self.write(true, &from, json!({"op": "remove_edge", "from": from, "to": to})).await;
            self.links[parent].retain(|l| *l != leaf);
            return (self.total_of(parent), self.parent_total(parent), true);
        }
        if rng.random_bool(0.25) {
            let parent = rng.random_range(0..PARENTS);
            let (from, to) = (self.leaf(leaf), self.parent(parent));
            self.write(true, &from, json!({"op": "add_edge", "from": from, "to": to})).await;
            if !self.links[parent].contains(&leaf) {
                self.links[parent].push(leaf);
            }
            return (self.total_of(parent), self.parent_total(parent), true);
        }
        let entity = self.leaf(leaf);
        self.write(false, &entity, json!({"entity": entity, "metric": "views", "delta": 1})).await;
        self.counts[leaf] += 1;
        match (0..PARENTS).find(|p| self.links[*p].contains(&leaf)) {
            // Through the graph: another shard's relayed totals.
            Some(parent) if rng.random_bool(0.5) => (self.total_of(parent), self.parent_total(parent), true),
            _ => (format!("/v1/counters/{}/views?kind=direct", encode(&entity)), self.counts[leaf], false),
        }
    }

    fn total_of(&self, parent: usize) -> String {
        format!("/v1/counters/{}/views?kind=total", encode(&self.parent(parent)))
    }

    fn parent_total(&self, parent: usize) -> i64 {
        self.links[parent].iter().map(|leaf| self.counts[*leaf]).sum()
    }

    /// Whether every shard the answer read holds the session's tokens (a direct
    /// read: those of increments).
    fn holds_tokens(&self, body: &Value, total: bool) -> Result<(), String> {
        let listed = body["as_of"].as_array().cloned().unwrap_or_default();
        if listed.is_empty() {
            return Err("no as_of".into());
        }
        for shard in listed {
            let through: Vec<WriteToken> = shard["through"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| WriteToken::decode(t.as_str()?).ok())
                .collect();
            for ((topic, partition), token) in &self.tokens {
                if *topic == TokenTopic::Graph && !total {
                    continue;
                }
                let held =
                    through.iter().any(|t| t.topic == *topic && t.partition == *partition && t.offset >= token.offset);
                if !held {
                    return Err(format!("shard {} does not say it holds {token:?}: {shard}", shard["shard"]));
                }
            }
        }
        Ok(())
    }
}

async fn run_session(
    sandbox: Arc<Sandbox>,
    producer: FutureProducer,
    id: usize,
    pairs: usize,
    done: Arc<AtomicUsize>,
) -> Tally {
    let mut rng = StdRng::seed_from_u64(id as u64);
    let mut session = Session {
        id,
        producer,
        topics: (sandbox.names.increments(), sandbox.names.graph()),
        tokens: BTreeMap::new(),
        counts: [0; LEAVES],
        links: Default::default(),
    };
    let mut tally = Tally::default();
    for _ in 0..pairs {
        let (path, want, total) = session.step(&mut rng).await;
        if rng.random_bool(0.2) {
            // The control: the same read at once, without the tokens.
            let (status, body) = sandbox.get(&path).await;
            if status == 200 {
                tally.control_reads += 1;
                if body["value"].as_i64() != Some(want) {
                    tally.control_misses += 1;
                }
            }
        }
        let read = format!("{path}&after={}&max_wait_ms={MAX_WAIT_MS}", session.after());
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let (status, body) = sandbox.get(&read).await;
            if status == 200 {
                if body["value"].as_i64() != Some(want) {
                    tally
                        .misses
                        .push(format!("{path}: read {} after its writes, the session wrote {want}", body["value"]));
                } else if let Err(why) = session.holds_tokens(&body, total) {
                    tally.misses.push(format!("{path}: {why}"));
                }
                break;
            }
            // A shard without an owner for longer than the wait (a 503 or 504): again.
            assert!([503, 504].contains(&status), "{read}: {status} {body}");
            if Instant::now() > deadline {
                let (_, shards) = sandbox.get("/v1/status").await;
                let log = sandbox.log("tally-up");
                let tail: Vec<&str> = log.lines().rev().take(150).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!("{read}: never answered: {status} {body}\nstatus: {shards}\n{}", tail.join("\n"));
            }
            tally.retried += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_with_a_write_token_never_miss_it_while_counters_die_and_pause() {
    let mut sandbox = Sandbox::start().await;
    // Rollups every 10 s: their records load the local broker, and they are not
    // what is tested here.
    let up = sandbox.spawn_up(3, &[("TALLY__COUNTER__ROLLUP_INTERVAL_MS", "10000".to_string())]);
    let counters = move || children(up, "tally-counter", |config| config.counter.instance.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _) = sandbox.get("/v1/counters/warm/views").await;
        if status == 200 && counters().len() == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "tally up never served:\n{}", sandbox.log("tally-up"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let sandbox = Arc::new(sandbox);
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    // One producer for every session: their writes share the broker's requests.
    let producer: FutureProducer = tally_shared::kafka::producer_config(&sandbox.kafka).unwrap().create().unwrap();
    let sessions: Vec<_> = (0..SESSIONS)
        .map(|id| tokio::spawn(run_session(sandbox.clone(), producer.clone(), id, PAIRS / SESSIONS, done.clone())))
        .collect();

    // Meanwhile, every 20 s: a counter killed with -9 or paused for 2 s, or the
    // ingester killed (tally up restarts a process at once only after it ran a
    // minute). Pauses past the lease stall the local broker (its
    // clients' heartbeats time out together), which says nothing of tally.
    let stop = Arc::new(AtomicBool::new(false));
    let chaos = {
        let (stop, done) = (stop.clone(), done.clone());
        tokio::spawn(async move {
            let (mut kills, mut pauses) = (0, 0);
            let mut rng = StdRng::seed_from_u64(52);
            for round in 0.. {
                // Spaced so each is over, and tally up's restart backoff back at a
                // second, before the next.
                tokio::time::sleep(Duration::from_secs(CHAOS_EVERY_S)).await;
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                println!("{:?}: {} pairs", started.elapsed(), done.load(Ordering::Relaxed));
                let pids: Vec<u32> = counters().values().copied().collect();
                let Some(&pid) = pids.get(rng.random_range(0..pids.len().max(1))) else { continue };
                match round % 6 {
                    // The ingester: it replays from its last commit.
                    5 => children(up, "tally-ingester", |config| config.ingester.group_id.clone())
                        .values()
                        .for_each(|pid| signal(*pid, libc::SIGKILL)),
                    0 | 3 => signal(pid, libc::SIGKILL),
                    _ => {
                        signal(pid, libc::SIGSTOP);
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        signal(pid, libc::SIGCONT);
                        pauses += 1;
                        continue;
                    }
                }
                kills += 1;
            }
            (kills, pauses)
        })
    };
    let mut tally = Tally::default();
    for session in sessions {
        let outcome = session.await.unwrap();
        tally.misses.extend(outcome.misses);
        tally.control_reads += outcome.control_reads;
        tally.control_misses += outcome.control_misses;
        tally.retried += outcome.retried;
    }
    stop.store(true, Ordering::SeqCst);
    let (kills, pauses) = chaos.await.unwrap();
    let pairs = done.load(Ordering::Relaxed);
    println!(
        "{pairs} pairs in {:?}: {} missed; control {} of {} reads missed; {} reads retried; {kills} kills, {pauses} pauses",
        started.elapsed(),
        tally.misses.len(),
        tally.control_misses,
        tally.control_reads,
        tally.retried
    );
    assert_eq!(pairs, PAIRS / SESSIONS * SESSIONS);
    assert!(tally.misses.is_empty(), "reads missed their own writes:\n{}", tally.misses.join("\n"));
    assert!(tally.control_misses > 0, "the control never missed: the test cannot tell");
    assert!(kills > 0 && pauses > 0, "{kills} kills, {pauses} pauses");
}
