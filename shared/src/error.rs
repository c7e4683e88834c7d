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
    /// RocksDB's own error, kept whole: [`Error::is_corruption`] reads its kind.
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    /// A store that is not as tally keeps it (a column family missing, a flush that
    /// left data behind).
    #[error("store: {0}")]
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

    /// Whether it says stored data is corrupt or of another format (not a passing
    /// I/O or Kafka trouble): what met it must stop, never read around it.
    pub fn is_corruption(&self) -> bool {
        match self {
            Error::Rocks(err) => err.kind() == rocksdb::ErrorKind::Corruption,
            Error::Core(tally_core::Error::Format(_)) => true,
            _ => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
