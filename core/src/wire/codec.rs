//! The bincode codec of internal records: a format header, then the bincode body.

use serde::Serialize;

use crate::{Error, Result};

/// The format header, then the bincode of `value`.
pub(super) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    encode_sized(value, 64)
}

/// [`encode`] into a buffer of `capacity` bytes (the encoded size's bound, when known:
/// growing a record of a megabyte copied it several times).
pub(super) fn encode_sized<T: Serialize>(value: &T, capacity: usize) -> Result<Vec<u8>> {
    encode_with_header(value, crate::format::RECORD_HEADER, capacity)
}

/// The header of format `version`, then the bincode of `value`.
pub(super) fn encode_version<T: Serialize>(value: &T, version: u8) -> Result<Vec<u8>> {
    encode_with_header(value, [crate::format::RECORD_MAGIC, version], 64)
}

fn encode_with_header<T: Serialize>(value: &T, header: [u8; 2], capacity: usize) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(capacity);
    out.extend_from_slice(&header);
    bincode::serde::encode_into_std_write(value, &mut out, bincode_config())
        .map_err(|err| Error::Wire(err.to_string()))?;
    Ok(out)
}

pub(super) fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    decode_body(crate::format::record_body(bytes, what)?, what)
}

/// The bincode `body` of a record whose header was checked.
pub(super) fn decode_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T> {
    let (message, used) = bincode::serde::decode_from_slice(body, bincode_config())
        .map_err(|err| Error::Format(format!("{what}: {err}")))?;
    if used != body.len() {
        return Err(Error::Format(format!("{what}: {} trailing bytes", body.len() - used)));
    }
    Ok(message)
}

pub(super) fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
}
