//! `tally-bench freshness`: how soon a read through tally-query shows an increment
//! after it was sent (the target: within 2 s at p99 at nominal load), idle and under
//! steady loads — the rate a deployment runs at, not a backlog it catches up with
//! (`tally-bench read` and `tally-bench ingest` cover those).
//!
//! A probe is one increment of an entity of its own, sent every `--probe-every-ms`.
//! One client reads that entity's all-time total every millisecond on a keep-alive
//! connection; a probe's freshness runs from just before it was handed to the
//! producer to the first read whose total includes it (producing, the ingester, the
//! shard topic, the counter's batch and tally-query: everything a user waits for).
//! Meanwhile a producer sends messages of `--per-message` Zipf-skewed increments at
//! the phase's rate.
//!
//! The same reads check the answers' own account of their freshness: each read's
//! `lag_ms` (the `as_of` of the probe's shard) against the lag the bench sees on its
//! own clock at the moment it asked — the age of the oldest probe the broker had
//! acknowledged that the answer does not hold yet, 0 when it holds every one
//! ([`LagCheck`]; a record still in the producer's queue is not input yet).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::{FutureExt, StreamExt};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_shared::config::TallyConfig;
use tally_shared::kafka::producer_config;
use tally_shared::lock::lock;

use crate::pipeline::{bar, Connection, Entities, Latencies, Pace, Rig};
use tally_shared::kafka::fetch_wait;

#[derive(Debug, Clone, clap::Args)]
pub struct FreshnessBenchArgs {
    /// Steady loads, in increments/s, one phase each (0: idle).
    #[arg(long, value_delimiter = ',', default_values_t = [0u64, 100_000, 200_000])]
    pub rates: Vec<u64>,
    /// Seconds each phase sends probes.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Increments per message of the load.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub per_message: u32,
    /// How often a probe is sent, in ms.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub probe_every_ms: u64,
    /// Entities the load writes, with a Zipf skew.
    #[arg(long, default_value_t = 100_000)]
    pub entities: usize,
    /// Publish rollups, as a default deployment does (off unless asked: on the
    /// local broker their records are most of what is written under a load; see
    /// `tally-bench read --rollups`).
    #[arg(long)]
    pub rollups: bool,
}

/// What the lock of the probes' send times guards ([`tally_shared::lock`]).
const SENT: &str = "the probes' send times";

/// When a probe was handed to the producer, and when the broker acknowledged it.
#[derive(Debug, Clone, Copy)]
struct Probe {
    sent: Instant,
    acked: Option<Instant>,
}
/// The probes' entity: no load increment touches it.
const PROBE: &str = "bench-probe";
/// A probe: one increment of [`PROBE`]'s `views`.
const PROBE_MESSAGE: &str = r#"{"entity":"bench-probe","metric":"views"}"#;

pub async fn run(config: TallyConfig, args: FreshnessBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.seconds * 1_000 >= args.probe_every_ms, "a phase of --seconds must fit a probe");
    let mut rig = Rig::start(config).await?;
    if rig.config.auth.reader_token.is_some() {
        rig.finish().await?;
        bail!("tally-bench freshness sends no token: run it with auth.reader_token unset");
    }
    rig.config.counter.rollups = args.rollups;
    let names = rig.fresh_topics().await?;
    println!(
        "freshness bench: a probe increment every {} ms, read back through tally-query every millisecond; phases of {} s under steady loads of {} increments/s ({} per message, {} entities, Zipf 1.1); rollups {}; broker {}",
        args.probe_every_ms,
        args.seconds,
        args.rates.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
        args.per_message,
        args.entities,
        if args.rollups { "published" } else { "off (--rollups to publish them)" },
        rig.config.kafka.bootstrap_servers,
    );
    // The bound on the answers' own lag: 50 ms plus one fetch wait of the data path
    // (the ingester's hop, which a counter caught up with its shard log cannot see).
    let tolerance = Duration::from_millis(50) + fetch_wait(&rig.config.kafka);
    let ports = rig.ports;
    rig.run("tally-counter", ports.counter_admin).await?;
    rig.run("tally-ingester", ports.ingester_admin).await?;
    rig.run("tally-query", ports.query_admin).await?;
    let producer: FutureProducer = producer_config(&rig.config.kafka)?.create()?;
    let topic = names.increments();
    let mut lines = Vec::new();
    let applied_at_start = rig.scrape(ports.counter_admin, APPLIED).await?;
    let mut sent_in_all = 0u64;
    for (phase, &rate) in args.rates.iter().enumerate() {
        let applied_before = rig.scrape(ports.counter_admin, APPLIED).await?;
        let batches_before = rig.batches(ports.counter_admin).await?;
        let (Watched { freshness, lags }, sent) =
            measure(&producer, &topic, ports.query, rate, phase as u64, &args).await?;
        let applied = rig.scrape(ports.counter_admin, APPLIED).await? - applied_before;
        let batches = rig.batches(ports.counter_admin).await?.since(&batches_before);
        let load = if rate == 0 { "idle".to_string() } else { format!("{rate} increments/s") };
        // Once its last probe showed, a pipeline that keeps up has applied nearly
        // everything sent before it.
        let behind = if applied < 0.95 * sent as f64 {
            " — behind: not all of it was applied when the last probe showed, so freshness grew through the phase (more than this deployment sustains)"
        } else {
            ""
        };
        // The next phase starts on a drained pipeline.
        sent_in_all += sent;
        let deadline = Instant::now() + Duration::from_secs(120);
        while rig.scrape(ports.counter_admin, APPLIED).await? - applied_at_start < sent_in_all as f64 {
            anyhow::ensure!(Instant::now() < deadline, "the counter did not apply what the phase sent within 120 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        lines.push(format!(
            "{load:<24} freshness p50 {:>7.1} ms  p90 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms  ({} probes); of the {sent} increments sent (load and probes), {:.0} applied by then; the counter's write batches: {}{behind}",
            freshness.at(0.50),
            freshness.at(0.90),
            freshness.at(0.99),
            freshness.at(1.0),
            freshness.0.len(),
            applied,
            batches.describe(applied),
        ));
        lines.push(format!("{:<24} {}", "", lags.line(tolerance)));
    }
    rig.finish().await?;
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

const APPLIED: &str = "tally_counter_applied_increments_total";

/// What a phase's watcher saw: each probe's freshness, and each read's lag as its
/// answer said it against the bench's own clock.
struct Watched {
    freshness: Latencies,
    lags: LagCheck,
}

/// One phase: the load at `rate` and a probe every `probe_every_ms` for `seconds`;
/// then waits for the last probe to show. Returns what the watcher saw and the
/// increments sent (the load, the probes and the one that settled the phase).
async fn measure(
    producer: &FutureProducer,
    topic: &str,
    query_port: u16,
    rate: u64,
    seed: u64,
    args: &FreshnessBenchArgs,
) -> anyhow::Result<(Watched, u64)> {
    let label = if rate == 0 { "probes, idle".to_string() } else { format!("probes at {rate} increments/s") };
    let progress = bar(args.seconds, &label);
    let (base, reader) = settle(producer, topic, Connection::open(query_port)?).await?;
    let sent: Arc<Mutex<Vec<Probe>>> = Arc::default();
    // How many probes the watcher waits for: all that were sent, once sending ended
    // (none, should sending fail: the guard stops the watcher with the phase).
    let expected = Arc::new(AtomicUsize::new(usize::MAX));
    let _stop = StopWatching(expected.clone());
    let watcher = {
        let (sent, expected) = (sent.clone(), expected.clone());
        tokio::task::spawn_blocking(move || watch(reader, base, &sent, &expected))
    };

    let (start, end) = (Instant::now(), Instant::now() + Duration::from_secs(args.seconds));
    let mut draw = Entities::new(args.entities, 100 + seed);
    let per_message = args.per_message as usize;
    let (mut pending, mut probes_pending) =
        (futures::stream::FuturesUnordered::new(), futures::stream::FuturesUnordered::new());
    let (mut pace, mut next_probe, mut tick) =
        (Pace::new(rate, per_message), start, tokio::time::interval(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sent_load = 0u64;
    while Instant::now() < end {
        tick.tick().await;
        let now = Instant::now();
        for _ in 0..pace.due() {
            let (key, payload) = draw.message(per_message);
            let record = FutureRecord::to(topic).key(&key).payload(&payload);
            pending
                .push(producer.send_result(record).map_err(|(err, _)| anyhow::anyhow!("producing the load: {err}"))?);
            sent_load += per_message as u64;
        }
        if now >= next_probe {
            next_probe += Duration::from_millis(args.probe_every_ms);
            let probe = {
                let mut probes = lock(&sent, SENT);
                probes.push(Probe { sent: Instant::now(), acked: None });
                probes.len() - 1
            };
            let record = FutureRecord::to(topic).key(PROBE).payload(PROBE_MESSAGE);
            let delivery =
                producer.send_result(record).map_err(|(err, _)| anyhow::anyhow!("producing a probe: {err}"))?;
            probes_pending.push(delivery.map(move |delivered| (probe, delivered)));
        }
        while let Some(Some(delivered)) = pending.next().now_or_never() {
            check_delivered(delivered)?;
        }
        while let Some(Some((probe, delivered))) = probes_pending.next().now_or_never() {
            check_delivered(delivered)?;
            lock(&sent, SENT)[probe].acked = Some(Instant::now());
        }
        progress.set_position(start.elapsed().as_secs());
    }
    while let Some((probe, delivered)) = probes_pending.next().await {
        check_delivered(delivered)?;
        lock(&sent, SENT)[probe].acked = Some(Instant::now());
    }
    while let Some(delivered) = pending.next().await {
        check_delivered(delivered)?;
    }
    let probes = lock(&sent, SENT).len();
    expected.store(probes, Ordering::SeqCst);
    progress.finish_and_clear();
    let mut watched = watcher.await??;
    watched.freshness.0.sort();
    Ok((watched, sent_load + probes as u64 + 1))
}

/// Ends a phase's watcher if the phase ends before sending did (an error): a
/// watcher still told to wait for every probe would poll for its full 120 s, and the
/// runtime waits for it before the bench can exit with the error.
struct StopWatching(Arc<AtomicUsize>);

impl Drop for StopWatching {
    fn drop(&mut self) {
        // Fails once sending ended: the watcher was told how many probes to wait for.
        self.0.compare_exchange(usize::MAX, 0, Ordering::SeqCst, Ordering::SeqCst).ok();
    }
}

/// Sends one probe and waits until a read shows it: the producer's and the path's
/// start-up (metadata, producer ids, connections) and the previous phase's tail
/// stay out of the figures. Returns the probes' total then.
async fn settle(producer: &FutureProducer, topic: &str, reader: Connection) -> anyhow::Result<(i64, Connection)> {
    let (reader, before) = blocking_total(reader).await?;
    let delivered =
        producer.send(FutureRecord::to(topic).key(PROBE).payload(PROBE_MESSAGE), Duration::from_secs(60)).await;
    delivered.map_err(|(err, _)| anyhow::anyhow!("producing a probe: {err}"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut reader = reader;
    loop {
        let (back, total) = blocking_total(reader).await?;
        reader = back;
        if total > before {
            return Ok((total, reader));
        }
        anyhow::ensure!(Instant::now() < deadline, "a probe did not show within 60 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// [`probe_total`] off the async runtime.
async fn blocking_total(mut reader: Connection) -> anyhow::Result<(Connection, i64)> {
    tokio::task::spawn_blocking(move || probe_total(&mut reader).map(|answer| (reader, answer.total))).await?
}

fn check_delivered(
    delivered: Result<rdkafka::producer::future_producer::OwnedDeliveryResult, futures::channel::oneshot::Canceled>,
) -> anyhow::Result<()> {
    match delivered {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((err, _))) => bail!("a record was not delivered: {err}"),
        Err(_) => bail!("the producer dropped a record"),
    }
}

/// Reads the probes' total every millisecond until every probe of this phase
/// shows (`expected`, once sending ended; up to 120 s after the last was sent);
/// each probe's freshness runs from its send time in `sent` to the first read that
/// includes it, and each read's `lag_ms` is checked against the bench's clock.
fn watch(
    mut reader: Connection,
    base: i64,
    sent: &Mutex<Vec<Probe>>,
    expected: &AtomicUsize,
) -> anyhow::Result<Watched> {
    let (mut freshness, mut lags) = (Vec::new(), LagCheck::default());
    let mut last_send = Instant::now();
    while freshness.len() < expected.load(Ordering::SeqCst) {
        let asked_at = Instant::now();
        let answer = probe_total(&mut reader)?;
        let read_at = Instant::now();
        let shown = usize::try_from(answer.total - base).context("the probes' total fell")?;
        let times = lock(sent, SENT);
        anyhow::ensure!(shown <= times.len(), "{shown} probes show but {} were sent", times.len());
        while freshness.len() < shown {
            freshness.push(read_at - times[freshness.len()].sent);
        }
        lags.add(answer.lag_ms, oldest_missing(&times, shown, asked_at));
        if let Some(probe) = times.last() {
            last_send = probe.sent;
        }
        anyhow::ensure!(
            last_send.elapsed() < Duration::from_secs(120),
            "{} of {} probes showed within 120 s of the last one sent: the load is far more than this deployment sustains (lower --rates)",
            freshness.len(),
            times.len()
        );
        drop(times);
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(Watched { freshness: Latencies(freshness), lags })
}

/// The lag an answer holding the first `shown` probes has on the bench's clock when
/// it was asked for at `asked_at`: the age of the oldest probe the broker had
/// acknowledged by then that it does not hold, or nothing missing (0). Probes go to
/// one partition, in order: those an answer holds are the first ones.
fn oldest_missing(probes: &[Probe], shown: usize, asked_at: Instant) -> Duration {
    let acked = probes.get(shown).and_then(|probe| probe.acked).filter(|at| *at <= asked_at);
    acked.map_or(Duration::ZERO, |at| asked_at - at)
}

/// The reads' `lag_ms` against the bench's own lag at the moment each was asked for
/// ([`oldest_missing`]): the error (said minus seen), in ms, of every read.
#[derive(Debug, Default)]
struct LagCheck {
    errors_ms: Vec<i64>,
    /// Reads whose answer gave no lag (not known yet).
    unknown: usize,
}

impl LagCheck {
    fn add(&mut self, said_ms: Option<i64>, seen: Duration) {
        match said_ms {
            Some(said) => self.errors_ms.push(said - seen.as_millis() as i64),
            None => self.unknown += 1,
        }
    }

    /// The error at quantile `p` (0.0: the most under, 1.0: the most over).
    fn at(&self, p: f64) -> Option<i64> {
        let mut sorted = self.errors_ms.clone();
        sorted.sort_unstable();
        let last = sorted.len().checked_sub(1)?;
        Some(sorted[((last as f64) * p).round() as usize])
    }

    /// The share of reads whose error is within `tolerance` either way.
    fn within(&self, tolerance: Duration) -> f64 {
        let bound = tolerance.as_millis() as i64;
        let inside = self.errors_ms.iter().filter(|error| error.abs() <= bound).count();
        100.0 * inside as f64 / self.errors_ms.len().max(1) as f64
    }

    fn line(&self, tolerance: Duration) -> String {
        let ms = |p| self.at(p).map_or("-".into(), |error: i64| format!("{error:+}"));
        format!(
            "as_of lag_ms minus the bench's own lag: p1 {} ms  p50 {} ms  p99 {} ms  ({} reads; {:.1} % within ±{} ms; {} without a lag)",
            ms(0.01),
            ms(0.50),
            ms(0.99),
            self.errors_ms.len(),
            self.within(tolerance),
            tolerance.as_millis(),
            self.unknown
        )
    }
}

/// What a read of the probes answered.
#[derive(Debug, PartialEq)]
struct ProbeAnswer {
    /// The all-time total (0 before the first probe).
    total: i64,
    /// The `lag_ms` of the one shard it read (none: not known).
    lag_ms: Option<i64>,
}

/// The probes' all-time total as tally-query answers it (0 before the first).
fn probe_total(reader: &mut Connection) -> anyhow::Result<ProbeAnswer> {
    let request = format!("GET /v1/counters/{PROBE}/views HTTP/1.1\r\nhost: bench\r\n\r\n");
    let mut body = Vec::new();
    let status = reader.exchange(request.as_bytes(), &mut body)?;
    anyhow::ensure!(status == 200, "reading the probes answered {status}: {}", String::from_utf8_lossy(&body));
    let answer: serde_json::Value = serde_json::from_slice(&body).context("reading the probes' answer")?;
    probe_answer(&answer)
}

fn probe_answer(answer: &serde_json::Value) -> anyhow::Result<ProbeAnswer> {
    let total = answer["value"].as_i64().with_context(|| format!("no value in {answer}"))?;
    let shards = answer["as_of"].as_array().with_context(|| format!("no as_of in {answer}"))?;
    anyhow::ensure!(shards.len() == 1, "a counter's read names one shard in its as_of: {answer}");
    Ok(ProbeAnswer { total, lag_ms: shards[0]["lag_ms"].as_i64() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers every read of the probes on one keep-alive connection with `total`.
    fn answer_probe_totals(listener: std::net::TcpListener, total: i64) {
        use std::io::{BufRead, Write};
        let (stream, _) = listener.accept().unwrap();
        let (mut writer, mut reader) = (stream.try_clone().unwrap(), std::io::BufReader::new(stream));
        let body = format!(r#"{{"value":{total},"as_of":[{{"shard":2,"applied":9,"lag_ms":0,"served_by":"owner"}}]}}"#);
        let mut line = String::new();
        loop {
            // One request: lines up to the blank one.
            loop {
                line.clear();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                if line == "\r\n" {
                    break;
                }
            }
            let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            if writer.write_all(answer.as_bytes()).is_err() {
                return;
            }
        }
    }

    #[test]
    fn a_phase_that_ends_before_sending_did_stops_its_watcher() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || answer_probe_totals(listener, 7));
        let (sent, expected) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicUsize::new(usize::MAX)));
        let stop = StopWatching(expected.clone());
        let watcher = {
            let (sent, expected, reader) = (sent.clone(), expected.clone(), Connection::open(port).unwrap());
            std::thread::spawn(move || watch(reader, 7, &sent, &expected))
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!watcher.is_finished(), "the watcher waits while the phase sends");
        // The phase fails (an early return drops the guard).
        let failed = Instant::now();
        drop(stop);
        let seen = watcher.join().unwrap().unwrap();
        assert!(failed.elapsed() < Duration::from_secs(1), "the watcher took {:?} to stop", failed.elapsed());
        assert_eq!(
            (seen.freshness.0, expected.load(Ordering::SeqCst)),
            (Vec::new(), 0),
            "a failed phase waits for no probe"
        );
        assert!(
            seen.lags.errors_ms.iter().all(|error| *error == 0),
            "no probe sent, none missing, lag 0: {:?}",
            seen.lags
        );
        // A phase that sent everything told the watcher how many probes to wait for.
        let expected = Arc::new(AtomicUsize::new(usize::MAX));
        let stop = StopWatching(expected.clone());
        expected.store(250, Ordering::SeqCst);
        drop(stop);
        assert_eq!(expected.load(Ordering::SeqCst), 250, "a phase that sent everything waits for every probe");
    }

    #[test]
    fn a_probe_increments_the_entity_that_is_read_back() {
        let message: serde_json::Value = serde_json::from_str(PROBE_MESSAGE).unwrap();
        assert_eq!(message, serde_json::json!({"entity": PROBE, "metric": "views"}));
    }

    #[test]
    fn the_bench_sees_the_age_of_the_oldest_probe_an_answer_misses() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        // Probe i sent at 20·i ms, acknowledged 5 ms later; probe 3 not yet.
        let mut probes: Vec<Probe> = (0..4).map(|i| Probe { sent: at(20 * i), acked: Some(at(20 * i + 5)) }).collect();
        probes[3].acked = None;
        let asked_at = at(100);
        assert_eq!(oldest_missing(&probes, 4, asked_at), Duration::ZERO, "every probe held");
        assert_eq!(oldest_missing(&probes, 2, asked_at), Duration::from_millis(55), "probe 2, acknowledged at 45 ms");
        assert_eq!(oldest_missing(&probes, 0, asked_at), Duration::from_millis(95));
        assert_eq!(oldest_missing(&probes, 3, asked_at), Duration::ZERO, "in the producer's queue: not input yet");
        assert_eq!(oldest_missing(&probes, 2, at(44)), Duration::ZERO, "acknowledged after the ask");
    }

    #[test]
    fn a_lag_check_gives_the_errors_quantiles_and_the_share_within_the_bound() {
        let mut check = LagCheck::default();
        for (said, seen) in [(Some(10), 0), (Some(100), 150), (Some(0), 300), (None, 40), (Some(90), 80)] {
            check.add(said, Duration::from_millis(seen));
        }
        assert_eq!(check.errors_ms, vec![10, -50, -300, 10]);
        assert_eq!((check.at(0.0), check.at(0.5), check.at(1.0)), (Some(-300), Some(10), Some(10)));
        assert_eq!(check.within(Duration::from_millis(150)), 75.0);
        assert_eq!(
            check.line(Duration::from_millis(150)),
            "as_of lag_ms minus the bench's own lag: p1 -300 ms  p50 +10 ms  p99 +10 ms  (4 reads; 75.0 % within ±150 ms; 1 without a lag)"
        );
        assert_eq!(LagCheck::default().at(0.5), None, "no reads, no quantile");
    }

    #[test]
    fn a_probe_answer_gives_the_total_and_its_shards_lag() {
        let answer =
            serde_json::json!({"value": 7, "as_of": [{"shard": 3, "applied": 12, "lag_ms": 40, "served_by": "owner"}]});
        assert_eq!(probe_answer(&answer).unwrap(), ProbeAnswer { total: 7, lag_ms: Some(40) });
        let unknown = serde_json::json!({"value": 0, "as_of": [{"shard": 3, "applied": 0, "lag_ms": null}]});
        assert_eq!(probe_answer(&unknown).unwrap(), ProbeAnswer { total: 0, lag_ms: None });
        let no_as_of = serde_json::json!({"value": 7});
        assert_eq!(probe_answer(&no_as_of).unwrap_err().to_string(), r#"no as_of in {"value":7}"#);
    }
}
