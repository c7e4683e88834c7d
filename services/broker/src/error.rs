//! The broker's error type.

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
    #[error("the system's random source failed drawing {0}")]
    Random(&'static str),
    #[error("broker: {0}")]
    Broker(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
