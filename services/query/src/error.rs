//! The query service's error type; [`ApiError`] is what HTTP clients see.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error(transparent)]
    Shared(#[from] tally_shared::Error),
    #[error(transparent)]
    Core(#[from] tally_core::Error),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("internal: {0}")]
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What HTTP clients see: tally's one error format.
pub use tally_shared::http::ApiError;
