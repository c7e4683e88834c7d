//! Dead letters: every rejected input with its reason.

use serde::{Deserialize, Serialize};

use crate::records::{truncate_utf8, Truncated};
use crate::{Error, Result};

/// A record of `tally.dead-letter`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Format version ([`crate::format::JSON_V1`]).
    pub v: u32,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// Position of the element in an array message; absent when the whole message
    /// was rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub reason: String,
    /// The original bytes, base64.
    pub payload: String,
    /// What was cut to fit the record under the broker's limit (`payload`: the
    /// original length in bytes); absent when the payload is whole.
    #[serde(default, skip_serializing_if = "Truncated::is_empty")]
    pub truncated: Truncated,
}

/// The longest reason a dead letter keeps.
const MAX_REASON_BYTES: usize = 1_024;

impl DeadLetter {
    /// The dead letter of `raw` (an element or a whole record at `topic`/`partition`/
    /// `offset`), encoded as JSON in at most `budget` bytes: a payload too big for
    /// that is cut, and the letter says so in `truncated`.
    pub fn encode(
        topic: &str,
        partition: i32,
        offset: i64,
        index: Option<u32>,
        reason: &str,
        raw: &[u8],
        budget: usize,
    ) -> Result<Vec<u8>> {
        let mut letter = DeadLetter {
            v: crate::format::JSON_V1,
            topic: topic.to_string(),
            partition,
            offset,
            index,
            reason: truncate_utf8(reason, MAX_REASON_BYTES).to_string(),
            payload: String::new(),
            truncated: Truncated::new(),
        };
        let json = |letter: &DeadLetter| serde_json::to_vec(letter).map_err(|err| Error::Wire(err.to_string()));
        let whole = base64_len(raw.len());
        // Room for the payload once the rest (and a `truncated` note) is written.
        let rest = json(&letter)?.len() + 64;
        let mut kept = raw.len();
        if rest + whole > budget {
            kept = budget.saturating_sub(rest) / 4 * 3;
            letter.truncated.insert("payload".into(), raw.len());
        }
        letter.payload = Self::payload_of(&raw[..kept.min(raw.len())]);
        json(&letter)
    }

    /// The `payload` field for rejected bytes: base64.
    pub fn payload_of(raw: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(raw)
    }
}

/// The length of `n` bytes in padded base64.
fn base64_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}
