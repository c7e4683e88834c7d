//! Sends every owned shard's outbox — totals for descendants that live on other
//! shards — to the shard topic ([`tally_shared::outbox`]), and deletes what the
//! broker acknowledged.

use tally_shared::outbox::Relay;

use crate::error::Result;
use crate::metrics::Metrics;
use crate::shards::Shards;

/// Relays the outbox of every owned shard; returns how many messages went out.
pub fn relay_outboxes(relay: &Relay, shards: &Shards, metrics: &Metrics) -> Result<u64> {
    let mut relayed = 0;
    for shard in shards.owned() {
        let Some(store) = shards.get(shard) else { continue };
        let entries = store.outbox()?;
        if entries.is_empty() {
            continue;
        }
        relay.send_all(&shard.to_string(), &entries)?;
        store.delete_outbox(&entries)?;
        relayed += entries.len() as u64;
    }
    metrics.outbox_relayed.inc_by(relayed);
    Ok(relayed)
}
