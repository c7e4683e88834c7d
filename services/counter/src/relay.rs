//! Sends every held shard's outbox — totals for descendants that live on other
//! shards — to the shard topic ([`tally_shared::outbox`]), and every owned shard's
//! dead letters (overflowing segment combinations) to the dead-letter topic, and
//! deletes what the broker acknowledged. A standby keeps its letters until it owns
//! the shard (a letter may then go twice, never not at all).

use tally_shared::outbox::Relay;

use crate::error::Result;
use crate::metrics::Metrics;
use crate::shards::Shards;

/// Relays the outbox of every held shard and the letters of every owned one;
/// returns how many outbox messages went out. Shards are independent senders: one
/// that fails does not hold up the others (its outbox is sent again next time); the
/// first error is returned after all tried.
pub fn relay_outboxes((relay, letters): (&Relay, &Relay), shards: &Shards, metrics: &Metrics) -> Result<u64> {
    let mut relayed = 0;
    let mut first_error = None;
    let owned = shards.owned();
    for shard in shards.stores() {
        let Some(store) = shards.get(shard) else { continue };
        let sent = store.relay_outbox(relay).and_then(|count| {
            if owned.contains(&shard) {
                let waiting = store.letters()?;
                if !waiting.is_empty() {
                    letters.send_all(&shard.to_string(), &waiting)?;
                    store.delete_letters(&waiting)?;
                }
            }
            Ok(count)
        });
        match sent {
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
