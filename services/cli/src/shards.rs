//! `tally shards`: operator actions on counter shards.
//!
//! `skip SHARD OFFSET --reason …` moves a failed shard (or `graph`: tally-graph's
//! graph-updates log) past the record that stopped it: the owner (found on the
//! shard-owners topic) sends the record to the dead-letter topic with the reason,
//! moves its offset past it and resumes.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Subcommand;
use tally_core::wire::ShardOwner;
use tally_shared::claims::ClaimTable;
use tally_shared::config::TallyConfig;
use tally_shared::kafka::TopicNames;

#[derive(Subcommand)]
pub enum ShardsCommand {
    /// Move a failed shard past the record at OFFSET (as its counter's /readyz
    /// names it): the record goes to the dead-letter topic with the reason, and the
    /// shard resumes after it.
    Skip {
        /// A shard number, or `graph` for tally-graph.
        shard: String,
        offset: i64,
        /// Why the record may be skipped; written into the dead letter.
        #[arg(long)]
        reason: String,
        /// The owner's read API (`host:port`); default: its claim on the
        /// shard-owners topic.
        #[arg(long)]
        counter: Option<String>,
    },
}

pub async fn run(config: &TallyConfig, command: ShardsCommand) -> anyhow::Result<()> {
    let ShardsCommand::Skip { shard, offset, reason, counter } = command;
    // The owner's claim on the shard-owners topic, and the partition it failed on.
    let (claim, partition) = match shard.as_str() {
        "graph" => (ShardOwner::GRAPH, 0),
        number => {
            let shard: u32 = number.parse().with_context(|| format!("`{number}`: a shard number or `graph`"))?;
            (shard, shard)
        }
    };
    let addr = match counter {
        Some(addr) => addr,
        None => owner_of(config, claim, &shard).await?,
    };
    let path = format!("/internal/v1/shards/{partition}/skip");
    let body = serde_json::json!({"offset": offset, "reason": reason});
    post_internal(config, &addr, &path, &body, Duration::from_secs(90))
        .await
        .with_context(|| format!("shard {shard}"))?;
    println!("shard {shard}: record {offset} is in the dead-letter topic; the shard resumed at {}", offset + 1);
    Ok(())
}

/// POSTs `body` to an operator route of a service's internal API at `addr` (with
/// the operator token, when one is set) and returns its JSON answer; an error answer
/// becomes an error with the service's message.
pub async fn post_internal(
    config: &TallyConfig,
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let mut request = reqwest::Client::new().post(format!("http://{addr}{path}")).json(body).timeout(timeout);
    if let Some(token) = &config.auth.operator_token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.with_context(|| format!("asking {addr}"))?;
    let status = response.status();
    let answer: serde_json::Value = response.json().await.with_context(|| format!("reading {addr}'s answer"))?;
    if !status.is_success() {
        bail!("{addr}: {} ({status})", answer["error"]["message"].as_str().unwrap_or("refused"));
    }
    Ok(answer)
}

/// The latest claim on every shard (and the graph), from the shard-owners topic
/// ([`ClaimTable::read_once`]: a record this build cannot read is an error): the
/// read address of its owner, `None` when it was let go.
pub async fn claims(config: &TallyConfig) -> anyhow::Result<HashMap<u32, Option<String>>> {
    let topic = TopicNames::new(&config.kafka.topic_prefix).shard_owners();
    let kafka = config.kafka.clone();
    let table =
        tokio::task::spawn_blocking(move || ClaimTable::read_once(&kafka, &topic, Duration::from_secs(30))).await??;
    Ok(table.owners())
}

/// The read address of the process that claims `shard`, from the shard-owners topic.
async fn owner_of(config: &TallyConfig, shard: u32, name: &str) -> anyhow::Result<String> {
    match claims(config).await?.remove(&shard) {
        Some(Some(addr)) => Ok(addr),
        _ => bail!("nothing claims shard {name} right now (see the services' /readyz); pass --counter HOST:PORT"),
    }
}
