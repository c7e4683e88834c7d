//! Sends every owned shard's outbox — totals for descendants that live on other
//! shards — to the shard topic ([`tally_shared::outbox`]), and deletes what the
//! broker acknowledged.

use tally_shared::outbox::Relay;

use crate::error::Result;
use crate::metrics::Metrics;
use crate::shards::Shards;

/// Relays the outbox of every owned shard; returns how many messages went out.
/// Shards are independent senders: one that fails does not hold up the others (its
/// outbox is sent again next time); the first error is returned after all tried.
pub fn relay_outboxes(relay: &Relay, shards: &Shards, metrics: &Metrics) -> Result<u64> {
    let mut relayed = 0;
    let mut first_error = None;
    for shard in shards.stores() {
        let Some(store) = shards.get(shard) else { continue };
        match store.relay_outbox(relay) {
            Ok(count) => relayed += count,
            Err(err) => {
                tracing::warn!(shard, error = %err, "relaying a shard's outbox; it is sent again next time");
                first_error.get_or_insert(err);
            }
        }
    }
    metrics.outbox_relayed.inc_by(relayed);
    first_error.map_or(Ok(relayed), Err)
}
