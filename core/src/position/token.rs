//! Write tokens: the position of one record a producer wrote (topic, partition,
//! offset), handed back by every write and taken by every read (`after=`) that must
//! include it. Compact, opaque to users and versioned: base64url of a version byte,
//! the topic's kind, the partition and offset as varints, and for a job a queue name.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

use super::{Source, Stamp};
use crate::{Error, Result};

/// The token format this build writes and reads.
const TOKEN_V1: u8 = 1;
/// The longest token accepted, in characters (a queue name is at most 128 bytes).
pub const MAX_TOKEN_LEN: usize = 200;

/// Which producer topic a token's record is in. The topics' prefix is the
/// cluster's, so a token names the topic by its role.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TokenTopic {
    Increments,
    Graph,
    /// A queue's jobs topic.
    Jobs(String),
}

impl TokenTopic {
    /// The topic of an input stream's records (`None`: a stream no producer
    /// writes).
    pub fn of_stream(stream: u8) -> Option<Self> {
        match stream {
            Source::INCREMENTS => Some(TokenTopic::Increments),
            Source::GRAPH => Some(TokenTopic::Graph),
            _ => None,
        }
    }

    /// How answers and errors name it.
    pub fn name(&self) -> &str {
        match self {
            TokenTopic::Increments => "increments",
            TokenTopic::Graph => "graph",
            TokenTopic::Jobs(queue) => queue,
        }
    }
}

/// A written record's position.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WriteToken {
    pub topic: TokenTopic,
    pub partition: u32,
    pub offset: i64,
}

impl WriteToken {
    pub fn encode(&self) -> String {
        let mut bytes = vec![TOKEN_V1];
        bytes.push(match self.topic {
            TokenTopic::Increments => 1,
            TokenTopic::Graph => 2,
            TokenTopic::Jobs(_) => 3,
        });
        put_varint(&mut bytes, u64::from(self.partition));
        put_varint(&mut bytes, self.offset as u64);
        if let TokenTopic::Jobs(queue) = &self.topic {
            bytes.extend_from_slice(queue.as_bytes());
        }
        URL_SAFE_NO_PAD.encode(bytes)
    }

    /// Reads a token; anything this build did not write is refused with the reason.
    pub fn decode(token: &str) -> Result<Self> {
        let invalid = |why: &str| Error::InvalidQuery(format!("token {:?}: {why}", shorten(token)));
        if token.is_empty() || token.len() > MAX_TOKEN_LEN {
            return Err(invalid(&format!("must be 1 to {MAX_TOKEN_LEN} characters")));
        }
        let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| invalid("not a tally write token"))?;
        let (&version, rest) = bytes.split_first().ok_or_else(|| invalid("empty"))?;
        if version != TOKEN_V1 {
            return Err(invalid(&format!("token version {version}; this build reads version {TOKEN_V1}")));
        }
        let (&kind, mut rest) = rest.split_first().ok_or_else(|| invalid("truncated"))?;
        let partition = take_varint(&mut rest).ok_or_else(|| invalid("truncated"))?;
        let offset = take_varint(&mut rest).ok_or_else(|| invalid("truncated"))?;
        let partition = u32::try_from(partition).map_err(|_| invalid("partition out of range"))?;
        let offset = i64::try_from(offset).map_err(|_| invalid("offset out of range"))?;
        let topic = match (kind, rest) {
            (1, []) => TokenTopic::Increments,
            (2, []) => TokenTopic::Graph,
            (3, queue) if !queue.is_empty() => {
                let queue = std::str::from_utf8(queue).map_err(|_| invalid("queue name is not UTF-8"))?;
                TokenTopic::Jobs(queue.to_string())
            }
            _ => return Err(invalid("not a tally write token")),
        };
        // One spelling per position (no padded varints): a token names its record.
        let decoded = Self { topic, partition, offset };
        match decoded.encode() == token {
            true => Ok(decoded),
            false => Err(invalid("not a tally write token")),
        }
    }

    /// The input stream this token's record feeds, when it is one tally counts
    /// (jobs feed no counter).
    pub fn source(&self) -> Option<Source> {
        let stream = match self.topic {
            TokenTopic::Increments => Source::INCREMENTS,
            TokenTopic::Graph => Source::GRAPH,
            TokenTopic::Jobs(_) => return None,
        };
        Some(Source { stream, partition: self.partition })
    }

    /// Whether a receiver whose high-water stamp of this token's source is
    /// `high_water` has everything of it up to and including this record: a stamp
    /// past the record's offset, or the mark saying its whole record was routed
    /// ([`Stamp::through`]).
    pub fn covered_by(&self, high_water: Option<Stamp>) -> bool {
        high_water.is_some_and(|stamp| stamp >= Stamp::through(self.offset))
    }

    /// The token of the last record of `source` a receiver holding `high_water`
    /// has whole (`None`: none yet).
    pub fn reached(source: Source, high_water: Stamp) -> Option<Self> {
        let topic = TokenTopic::of_stream(source.stream)?;
        let offset = if high_water.index == u32::MAX { high_water.offset } else { high_water.offset - 1 };
        (offset >= 0).then_some(Self { topic, partition: source.partition, offset })
    }
}

impl Stamp {
    /// The stamp after every element of the record at `offset`: the mark a router
    /// sends once it has routed the record whole.
    pub const fn through(offset: i64) -> Self {
        Stamp { offset, index: u32::MAX }
    }
}

fn shorten(token: &str) -> String {
    token.chars().take(40).collect()
}

fn put_varint(bytes: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        bytes.push(value as u8 | 0x80);
        value >>= 7;
    }
    bytes.push(value as u8);
}

fn take_varint(bytes: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = bytes.split_first()?;
        *bytes = rest;
        value |= u64::from(byte & 0x7f).checked_shl(shift)?;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn topics() -> impl Strategy<Value = TokenTopic> {
        prop_oneof![
            Just(TokenTopic::Increments),
            Just(TokenTopic::Graph),
            "[a-z0-9_.-]{1,128}".prop_map(TokenTopic::Jobs),
        ]
    }

    proptest! {
        #[test]
        fn tokens_round_trip(topic in topics(), partition in any::<u32>(), offset in 0..i64::MAX) {
            let token = WriteToken { topic, partition, offset };
            let encoded = token.encode();
            prop_assert!(encoded.len() <= MAX_TOKEN_LEN);
            prop_assert_eq!(WriteToken::decode(&encoded).unwrap(), token);
        }

        #[test]
        fn garbage_is_refused_never_misread(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let text = URL_SAFE_NO_PAD.encode(&bytes);
            if let Ok(token) = WriteToken::decode(&text) {
                prop_assert_eq!(token.encode(), text, "only what encode writes decodes");
            }
        }

        /// A receiver covers a token exactly when its brute-force history holds the
        /// token's record whole: an element of a later record, or the record's mark.
        #[test]
        fn covered_by_matches_the_history(offset in 0..50i64, seen in 0..50i64, index in prop_oneof![0..4u32, Just(u32::MAX)]) {
            let token = WriteToken { topic: TokenTopic::Increments, partition: 0, offset };
            let whole = seen > offset || (seen == offset && index == u32::MAX);
            prop_assert_eq!(token.covered_by(Some(Stamp { offset: seen, index })), whole);
            let reached = WriteToken::reached(token.source().unwrap(), Stamp { offset: seen, index });
            prop_assert_eq!(reached.is_some_and(|r| r.offset >= offset), whole);
        }
    }

    #[test]
    fn refusals_say_why() {
        let cases = [
            ("", "must be 1 to"),
            ("!!", "not a tally write token"),
            (&URL_SAFE_NO_PAD.encode([2, 1, 0, 0]), "token version 2"),
            (&URL_SAFE_NO_PAD.encode([1, 1, 0]), "truncated"),
            (&URL_SAFE_NO_PAD.encode([1, 9, 0, 0]), "not a tally write token"),
            (&URL_SAFE_NO_PAD.encode([1, 3, 0, 0]), "not a tally write token"),
            (&URL_SAFE_NO_PAD.encode([1, 1, 0, 0, 7]), "not a tally write token"),
            (&URL_SAFE_NO_PAD.encode([1, 1, 0x80, 0, 0]), "not a tally write token"),
        ];
        for (token, why) in cases {
            let err = WriteToken::decode(token).unwrap_err().to_string();
            assert!(err.contains(why), "{token:?}: {err}");
        }
        assert_eq!(
            WriteToken::decode(&"A".repeat(201)).unwrap_err().to_string(),
            "token \"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\": must be 1 to 200 characters"
        );
        assert!(!WriteToken { topic: TokenTopic::Graph, partition: 0, offset: 0 }.covered_by(None));
    }
}
