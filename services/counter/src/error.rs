//! The counter's error type.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error(transparent)]
    Shared(#[from] tally_shared::Error),
    #[error(transparent)]
    Core(#[from] tally_core::Error),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("shard {shard}: {message}")]
    Shard { shard: u32, message: String },
    #[error("consumer thread: {0}")]
    Consumer(String),
}

impl Error {
    /// Whether it says the stored data is corrupt or of another format (not a
    /// passing I/O or Kafka trouble): the shard must stop.
    pub fn is_corruption(&self) -> bool {
        match self {
            Error::Rocks(err) => err.kind() == rocksdb::ErrorKind::Corruption,
            Error::Core(tally_core::Error::Format(_)) => true,
            Error::Shared(err) => err.is_corruption(),
            _ => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
