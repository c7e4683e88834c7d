//! Several counters, failure-safe: `tally up --counters 3` runs three counter
//! processes that share the shards through their membership. For 20 rounds, while
//! increments and graph updates flow, a random counter is killed with -9 (tally up
//! restarts it) or paused for 15 s (SIGSTOP, then SIGCONT: a zombie that comes
//! back); once, a counter's and the graph's data are wiped mid-workload (they come
//! back from snapshots). The totals end equal to the model, and reads taken all the
//! while never go back in time: a probe counter per shard, only ever incremented,
//! is read continuously, and a value below one already read would be a stale
//! owner's answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tally_core::wire::Increment;
use tally_e2e::probes::{probes, watch_probes};
use tally_e2e::workload::{Record, Workload};
use tally_e2e::{check, children, signal, Sandbox};

const ROUNDS: usize = 20;
const SHARDS: u32 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_counters_under_kill9_and_pauses_count_exactly_and_never_read_stale() {
    let mut sandbox = Sandbox::start().await;
    let up_dir = sandbox.path("up");
    // Defaults but for the snapshots, taken every 2 s here.
    let up = sandbox.spawn_up(3, &[("TALLY__SNAPSHOTS__INTERVAL_MS", "2000".to_string())]);
    let counters = || children(up, "tally-counter", |config| config.counter.instance.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    while counters().len() < 3 {
        assert!(Instant::now() < deadline, "three counters never ran:\n{}", sandbox.log("tally-up"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let workload = Workload::generate_mixed(90, 1_200, tally_shared::kafka::now_ms(), 0.2);
    let probes = probes(SHARDS);
    let mut model = workload.model.clone();
    let produced = Arc::new(Mutex::new(0i64));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn(watch_probes(sandbox.query_url.clone(), probes.clone(), produced.clone(), stop.clone()));
    let probe_round = |round: usize| -> Record {
        let elements: Vec<_> = probes.iter().map(|p| json!({"entity": p, "metric": "hits"})).collect();
        let now = tally_shared::kafka::now_ms();
        Record {
            graph: false,
            key: format!("probe-{round}"),
            payload: json!(elements).to_string().into_bytes(),
            timestamp: now,
        }
    };

    let mut rng = StdRng::seed_from_u64(9);
    let chunks: Vec<&[Record]> = workload.records.chunks(workload.records.len().div_ceil(ROUNDS * 2)).collect();
    let mut chunks = chunks.into_iter();
    // Sends the next chunk of the workload and a round of probes; whether a chunk was left.
    let mut send = async |sandbox: &Sandbox, model: &mut tally_core::model::Model, round: usize| -> bool {
        let chunk = chunks.next();
        let mut records: Vec<Record> = chunk.map(<[Record]>::to_vec).unwrap_or_default();
        let probe = probe_round(round);
        *produced.lock().unwrap() += 1;
        for p in &probes {
            model.apply(Increment {
                entity: p.clone(),
                metric: "hits".into(),
                delta: 1,
                ts: probe.timestamp,
                id: None,
            });
        }
        records.push(probe);
        sandbox.produce(&records).await;
        chunk.is_some()
    };
    let (mut kills, mut pauses) = (0, 0);
    for round in 0..ROUNDS {
        send(&sandbox, &mut model, round * 2).await;
        let mut running = counters();
        while running.len() < 2 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            running = counters();
        }
        let names: Vec<&String> = running.keys().collect();
        let victim = names[rng.random_range(0..names.len())].clone();
        let pid = running[&victim];
        if round == ROUNDS / 2 {
            // Lose a counter's disk and the graph's, mid-workload.
            let graph = children(up, "tally-graph", |config| config.graph.data_dir.display().to_string());
            let graph_pid = *graph.values().next().expect("tally-graph runs");
            signal(pid, libc::SIGSTOP);
            signal(graph_pid, libc::SIGSTOP);
            std::fs::remove_dir_all(format!("{up_dir}/{victim}")).unwrap();
            std::fs::remove_dir_all(format!("{up_dir}/graph")).unwrap();
            signal(pid, libc::SIGKILL);
            signal(graph_pid, libc::SIGKILL);
            kills += 1;
            tokio::time::sleep(Duration::from_secs(3)).await;
        } else if rng.random_bool(0.5) {
            signal(pid, libc::SIGKILL);
            kills += 1;
            tokio::time::sleep(Duration::from_secs(3)).await;
        } else {
            signal(pid, libc::SIGSTOP);
            pauses += 1;
            tokio::time::sleep(Duration::from_secs(7)).await;
            send(&sandbox, &mut model, round * 2 + 1).await;
            tokio::time::sleep(Duration::from_secs(8)).await;
            signal(pid, libc::SIGCONT);
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
    // What is left of the workload, and a last round of probes.
    let mut round = ROUNDS * 2;
    while send(&sandbox, &mut model, round).await {
        round += 1;
    }

    let mut entities = workload.entities.clone();
    entities.extend(probes.iter().cloned());
    let mut metrics = workload.metrics.clone();
    metrics.push("hits".into());
    let settled = Instant::now() + Duration::from_secs(240);
    while let Err(mismatches) = check::all_time(&sandbox, &model, &entities, &metrics).await {
        assert!(Instant::now() < settled, "counts never matched the model:\n{mismatches}\n{}", sandbox.log("tally-up"));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    check::windows(&sandbox, &model, &entities, &metrics).await;
    stop.store(true, Ordering::SeqCst);
    let (violations, answered) = watcher.await.unwrap();
    assert!(violations.is_empty(), "reads went back in time:\n{}", violations.join("\n"));
    assert!(answered > 100, "only {answered} probe reads answered");
    let log = sandbox.log("tally-up");
    assert_eq!(kills + pauses, ROUNDS);
    if pauses > 0 {
        assert!(log.contains("lease lapsed"), "a paused counter never noticed its lease lapsed:\n{log}");
    }
    assert!(log.contains("restored from a snapshot"), "nothing restored from a snapshot:\n{log}");
    eprintln!("{kills} kills, {pauses} pauses, {answered} probe reads answered");
}
