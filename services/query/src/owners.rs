//! Which counter serves which shard: the shard-owners topic followed into the one
//! claim table ([`tally_shared::claims`]). Readers that find a claim stale — the
//! owner answered `not_owner` or did not answer — wait for a newer one.

use std::sync::Arc;
use std::time::Duration;

use tally_shared::config::KafkaConfig;
use tally_shared::telemetry::Readiness;
use tokio_util::sync::CancellationToken;

use crate::error::Result;

use tally_shared::claims::ClaimTable;

/// Keeps `readiness` true while every one of `shards` has an owner to read from and
/// the `follower` thread follows the claims; a follower that ends before `shutdown`
/// (a panic) stops the service. Returns whether it did, once the follower is joined.
pub async fn track_readiness(
    owners: Arc<ClaimTable>,
    shards: u32,
    readiness: Readiness,
    shutdown: CancellationToken,
    follower: std::thread::JoinHandle<()>,
) -> bool {
    let mut died = false;
    while !shutdown.is_cancelled() {
        if follower.is_finished() {
            tracing::error!("the shard-owners follower stopped unexpectedly; stopping");
            died = true;
            shutdown.cancel();
            break;
        }
        readiness.set((0..shards).all(|shard| owners.get(shard).is_some_and(|claim| claim.addr.is_some())));
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    readiness.set(false);
    let joined = tokio::task::spawn_blocking(move || follower.join()).await;
    died || !matches!(joined, Ok(Ok(())))
}

pub fn follow(
    kafka: &KafkaConfig,
    topic: &str,
    owners: Arc<ClaimTable>,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let group = format!("tally-query-{:016x}", rand::random::<u64>());
    Ok(tally_shared::follow::follow(
        kafka,
        "owners",
        &group,
        topic,
        Duration::from_millis(200),
        tally_shared::follow::FAILOVER_FETCH_WAIT,
        shutdown,
        ClaimTable::follower(owners),
    )?)
}
