//! The naming rules of entities, metrics and idempotency ids.
//!
//! Each check returns the precise reason a producer sees in the dead-letter topic or
//! an HTTP client sees in a 400.

/// Longest entity, in bytes.
pub const MAX_ENTITY_BYTES: usize = 256;
/// Longest metric, in bytes.
pub const MAX_METRIC_BYTES: usize = 64;
/// Longest idempotency id, in bytes.
pub const MAX_ID_BYTES: usize = 128;

/// An entity is 1–256 bytes of UTF-8 without control characters.
pub fn check_entity(entity: &str) -> Result<(), &'static str> {
    if entity.is_empty() || entity.len() > MAX_ENTITY_BYTES {
        return Err("entity: must be 1-256 bytes of UTF-8");
    }
    if entity.chars().any(char::is_control) {
        return Err("entity: must not contain control characters");
    }
    Ok(())
}

/// A metric matches `[a-z0-9_.:-]{1,64}`.
pub fn check_metric(metric: &str) -> Result<(), &'static str> {
    let allowed = |b: u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b':' | b'-');
    if metric.is_empty() || metric.len() > MAX_METRIC_BYTES || !metric.bytes().all(allowed) {
        return Err("metric: must match [a-z0-9_.:-]{1,64}");
    }
    Ok(())
}

/// An idempotency id is 1–128 bytes.
pub fn check_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err("id: must be 1-128 bytes");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn entity_rules() {
        assert!(check_entity("answer:42").is_ok());
        assert!(check_entity("ünïcode entity").is_ok());
        assert!(check_entity("").is_err());
        assert!(check_entity(&"x".repeat(256)).is_ok());
        assert!(check_entity(&"x".repeat(257)).is_err());
        assert!(check_entity("tab\there").is_err());
        assert!(check_entity("nul\0").is_err());
        assert!(check_entity("del\u{7f}").is_err());
    }

    #[test]
    fn metric_rules() {
        assert!(check_metric("views").is_ok());
        assert!(check_metric("a.b:c-d_9").is_ok());
        assert!(check_metric("Views").is_err());
        assert!(check_metric("").is_err());
        assert!(check_metric("with space").is_err());
        assert!(check_metric(&"m".repeat(64)).is_ok());
        assert!(check_metric(&"m".repeat(65)).is_err());
    }

    #[test]
    fn id_rules() {
        assert!(check_id("evt-1").is_ok());
        assert!(check_id("").is_err());
        assert!(check_id(&"i".repeat(128)).is_ok());
        assert!(check_id(&"i".repeat(129)).is_err());
    }

    proptest! {
        #[test]
        fn metric_check_agrees_with_its_regex(s in "\\PC{0,70}") {
            let by_hand = !s.is_empty() && s.len() <= 64
                && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.:-".contains(&b));
            prop_assert_eq!(check_metric(&s).is_ok(), by_hand);
        }

        #[test]
        fn entities_without_controls_pass(s in "[^\\p{Cc}]{1,64}") {
            prop_assert!(check_entity(&s).is_ok());
        }
    }
}
