//! The one error type of the shared crate.

/// Everything that can go wrong in shared code. Messages are lowercase and say what
/// the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid duration `{0}`: expected a positive number followed by s, m, h or d (e.g. 90s, 15m, 24h, 7d)")]
    InvalidDuration(String),
    #[error("{0}")]
    InvalidQuery(String),
    #[error("config: {0}")]
    Config(String),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("wire format: {0}")]
    Wire(String),
    /// Bytes that are not a format this build reads: corrupt, foreign, or written
    /// by a newer tally. Never read as a default.
    #[error("format: {0}")]
    Format(String),
    #[error("skip: {0}")]
    Skip(String),
    #[error("topics: {0}")]
    Topics(String),
    #[error("rocksdb: {0}")]
    Store(String),
    #[error("outbox relay: {0}")]
    Relay(String),
    #[error("worker: {0}")]
    Worker(String),
    #[error("local broker: {0}")]
    LocalBroker(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
