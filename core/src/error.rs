//! The one error type of the pure core.

/// What can go wrong in pure code. Messages are lowercase and say what the caller
/// can do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid duration `{0}`: expected a positive number followed by s, m, h or d (e.g. 90s, 15m, 24h, 7d)")]
    InvalidDuration(String),
    #[error("{0}")]
    InvalidQuery(String),
    /// A setting that cannot work (resolutions that overlap or keep nothing).
    #[error("config: {0}")]
    Config(String),
    #[error("wire format: {0}")]
    Wire(String),
    /// Bytes that are not a format this build reads: corrupt, foreign, or written
    /// by a newer tally. Never read as a default.
    #[error("format: {0}")]
    Format(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
