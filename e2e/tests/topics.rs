//! `tally topics apply` against a real broker: idempotent, raises partitions, and
//! reports settings that differ from the declarations without touching them.

use tally_e2e::Sandbox;
use tally_shared::topics::{self, Action, Declarations};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_is_idempotent_and_reports_drift() {
    let sandbox = Sandbox::start().await; // applied the built-in declarations once
    let builtin = Declarations::load(None).unwrap();
    let again = topics::apply(&sandbox.kafka, &builtin).await.expect("second apply");
    assert!(again.iter().all(|a| matches!(a, Action::Unchanged { .. })), "{again:?}");

    let mut changed = builtin.clone();
    for decl in &mut changed.topics {
        match decl.name.as_str() {
            "increments" => decl.retention_ms = Some(1_000),
            "dead-letter" => decl.partitions += 2,
            _ => {}
        }
    }
    let actions = topics::apply(&sandbox.kafka, &changed).await.expect("apply with changes");
    let increments = sandbox.names.increments();
    let dead_letter = sandbox.names.dead_letter();
    assert!(
        actions.iter().any(|a| matches!(a, Action::Drift { topic, what } if *topic == increments && what.starts_with("retention.ms is "))),
        "{actions:?}"
    );
    // Kafka adds the partitions; the local Tansu cannot, and apply says so instead of failing.
    assert!(
        actions.iter().any(|a| match a {
            Action::RaisePartitions { topic, .. } => *topic == dead_letter,
            Action::Drift { topic, what } => *topic == dead_letter && what.contains("cannot add partitions"),
            _ => false,
        }),
        "{actions:?}"
    );
    // Nothing was created, and the drift left the topic as it was.
    assert!(!actions.iter().any(|a| matches!(a, Action::Create { .. })), "{actions:?}");
    let last = topics::apply(&sandbox.kafka, &builtin).await.expect("third apply");
    assert!(last.iter().all(|a| matches!(a, Action::Unchanged { .. })), "{last:?}");
}
