//! The one error type of the runtime crate.

/// Everything that can go wrong in the runtime glue. Messages are lowercase and say
/// what the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// From the pure core: a bad duration or query, a format this build does not read.
    #[error(transparent)]
    Core(#[from] tally_core::Error),
    #[error("config: {0}")]
    Config(String),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("skip: {0}")]
    Skip(String),
    #[error("topics: {0}")]
    Topics(String),
    #[error("snapshots: {0}")]
    Snapshot(String),
    /// A snapshot that cannot be restored as it is (a file missing, cut short or
    /// changed): a restore falls back to an older one.
    #[error("snapshots: {0}")]
    SnapshotUnusable(String),
    #[error("rocksdb: {0}")]
    Store(String),
    #[error("outbox relay: {0}")]
    Relay(String),
    #[error("shard claims: {0}")]
    Claims(String),
    #[error("local broker: {0}")]
    LocalBroker(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Stored bytes that are not what they should be: never read as a default.
    pub fn corrupt(message: impl Into<String>) -> Self {
        Self::Core(tally_core::Error::Format(message.into()))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
