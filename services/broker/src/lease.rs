//! Lease tokens workers hold: `partition.lease.instance.tag`, where `tag` is 128
//! bits of an HMAC-SHA256 of the rest under a key this broker process drew at
//! start and never shows. The partition's lease numbers count up and the instance
//! is public (heartbeats, `/v1/jobs`), so without the tag any worker could ack or
//! nack a job it was never given; with it, a guessed neighbour names no lease.

use ring::hmac;
use subtle::ConstantTimeEq;
use tally_core::format::hex;

/// Bytes of the HMAC a token carries (128 bits, hex in the token).
const TAG_BYTES: usize = 16;

/// Issues and checks this broker's lease tokens.
pub struct LeaseSigner {
    /// The broker instance the tokens name: a restarted broker refuses its
    /// predecessor's leases (their jobs are handed out again anyway).
    instance: String,
    key: hmac::Key,
}

impl LeaseSigner {
    /// A signer with a fresh random key.
    pub fn new(instance: String) -> Result<Self, crate::Error> {
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &ring::rand::SystemRandom::new())
            .map_err(|_| crate::Error::Random("the lease key"))?;
        Ok(Self { instance, key })
    }

    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The token of `lease` on `partition`.
    pub fn issue(&self, partition: i32, lease: u64) -> String {
        let fields = format!("{partition}.{lease}.{}", self.instance);
        let tag = self.tag(&fields);
        format!("{fields}.{}", hex(&tag))
    }

    /// `(partition, lease)` of a token this signer issued; `None` for anything else,
    /// the tag compared in constant time.
    pub fn check(&self, token: &str) -> Option<(i32, u64)> {
        let (fields, tag) = token.rsplit_once('.')?;
        let mut parts = fields.splitn(3, '.');
        let partition = parts.next()?.parse().ok()?;
        let lease = parts.next()?.parse().ok()?;
        if parts.next()? != self.instance {
            return None;
        }
        let given = unhex::<TAG_BYTES>(tag)?;
        bool::from(self.tag(fields).ct_eq(&given)).then_some((partition, lease))
    }

    fn tag(&self, fields: &str) -> [u8; TAG_BYTES] {
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(&hmac::sign(&self.key, fields.as_bytes()).as_ref()[..TAG_BYTES]);
        tag
    }
}

fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_its_partition_and_lease_to_its_signer_only() {
        let signer = LeaseSigner::new("abc".into()).unwrap();
        let token = signer.issue(3, 42);
        assert_eq!(signer.check(&token), Some((3, 42)));
        assert!(token.starts_with("3.42.abc."), "{token}");
        let other_key = LeaseSigner::new("abc".into()).unwrap();
        assert_eq!(other_key.check(&token), None, "another process's key");
        let other_instance = LeaseSigner::new("xyz".into()).unwrap();
        assert_eq!(other_instance.check(&other_instance.issue(3, 42).replace(".xyz.", ".abc.")), None);
        for junk in ["junk", "1.x.abc", "3.42.abc", "3.42.abc.", "3.42.abc.zz", &format!("{token}0")] {
            assert_eq!(signer.check(junk), None, "{junk}");
        }
    }

    /// A worker that holds one real token and rewrites its numbers or its tag.
    #[test]
    fn ten_thousand_guesses_around_a_real_token_name_no_lease() {
        let signer = LeaseSigner::new("abc".into()).unwrap();
        let real = signer.issue(1, (7 << 32) | 500);
        let (fields, tag) = real.rsplit_once('.').unwrap();
        let mut accepted = Vec::new();
        for guess in 0..10_000u64 {
            let lease = ((7u64 << 32) | 500).wrapping_add(guess / 2).wrapping_sub(2_500);
            let guessed = match guess % 2 {
                // A neighbour's numbers with the real tag.
                0 => format!("1.{lease}.abc.{tag}"),
                // The real numbers with a tag one bit away.
                _ => {
                    let mut bytes = unhex::<TAG_BYTES>(tag).unwrap();
                    bytes[(guess as usize / 2) % TAG_BYTES] ^= 1 << (guess % 8);
                    format!("{fields}.{}", hex(&bytes))
                }
            };
            if guessed != real {
                accepted.extend(signer.check(&guessed));
            }
        }
        assert_eq!(accepted.len(), 0, "guesses accepted, the first: {:?}", &accepted[..accepted.len().min(3)]);
        assert_eq!(signer.check(&real), Some((1, (7 << 32) | 500)));
    }
}
