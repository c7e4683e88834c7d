//! A queue's concurrency limits: at most `per_key` jobs of one concurrency key in
//! flight (with overrides for keys matching a pattern), and at most `total` jobs of
//! the queue in flight, over every worker and broker.
//!
//! Both are enforced where the jobs are, with no chatter between brokers:
//! - every job of a concurrency key lives in one partition,
//!   [`partition_of`] (a broker forwards a job produced elsewhere there), so the
//!   partition's owner alone counts a key's jobs in flight;
//! - the total is split between the partitions ([`share`]): each partition runs at
//!   most its share, whoever owns it, so shares never need to move with partitions.
//!
//! A partition that changes owner hands out nothing until the leases its previous
//! owner may have handed out have expired (the broker sets the hold,
//! [`super::partition::PartitionQueue::hold_until`]).

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::Job;

/// The longest concurrency key, in bytes (a job's own or one read from its payload).
pub const MAX_KEY_BYTES: usize = 256;
/// The most per-key overrides a queue may declare.
pub const MAX_OVERRIDES: usize = 100;

/// What a queue declares (`[queue.limits]`); empty: no limits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// At most this many jobs of one concurrency key in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_key: Option<u32>,
    /// Other per-key limits for the keys that match a pattern (`*` stands for any
    /// run of characters); the first match wins over `per_key`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<KeyOverride>,
    /// The payload's top-level field that holds a job's concurrency key when the job
    /// names none (`"concurrency_key"`); a string, or a number taken as its text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_field: Option<String>,
    /// At most this many jobs of the queue in flight at once, over all partitions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u32>,
    /// What happens to a job whose key is at its limit when it becomes ready.
    #[serde(default, skip_serializing_if = "AtLimit::is_wait")]
    pub at_limit: AtLimit,
}

/// A per-key limit for the keys matching `pattern`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyOverride {
    pub pattern: String,
    pub per_key: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AtLimit {
    /// It waits until a job of its key finishes.
    #[default]
    Wait,
    /// It is dropped: written to the dead topic as `dropped`, never run.
    DropNewest,
    /// The jobs of its key in flight are cancelled (their workers are told on
    /// their next extend; they end dead, never retried) and it runs in their place.
    CancelInProgress,
}

impl AtLimit {
    fn is_wait(&self) -> bool {
        *self == AtLimit::Wait
    }
}

impl Limits {
    /// Whether the queue declares no limit at all.
    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// Whether keys are limited (and so must live in their own partition).
    pub fn per_key_limited(&self) -> bool {
        self.per_key.is_some() || !self.overrides.is_empty()
    }

    /// Checks a declaration of a queue of `partitions`; the error says what to fix.
    pub fn check(&self, partitions: i32) -> Result<(), String> {
        if self.per_key == Some(0) || self.overrides.iter().any(|o| o.per_key == 0) {
            return Err("limits: per_key must be at least 1 (leave it out for no per-key limit)".into());
        }
        if self.overrides.len() > MAX_OVERRIDES {
            return Err(format!("limits: at most {MAX_OVERRIDES} overrides"));
        }
        if let Some(bad) = self.overrides.iter().find(|o| o.pattern.is_empty() || o.pattern.len() > MAX_KEY_BYTES) {
            return Err(format!("limits: override pattern {:?} must be 1-{MAX_KEY_BYTES} bytes", bad.pattern));
        }
        if self.key_field.as_ref().is_some_and(|field| field.is_empty() || field.len() > 64) {
            return Err("limits: key_field must be 1-64 bytes".into());
        }
        match self.total {
            Some(0) => return Err("limits: total must be at least 1 (leave it out for no total limit)".into()),
            Some(total) if i64::from(total) < i64::from(partitions) => {
                return Err(format!(
                    "limits: total ({total}) must be at least the queue's partitions ({partitions}): each partition \
                     runs its share of the total; declare fewer partitions or a larger total"
                ))
            }
            _ => {}
        }
        if self.at_limit != AtLimit::Wait && !self.per_key_limited() {
            return Err(
                "limits: at_limit = \"drop_newest\" or \"cancel_in_progress\" needs a per-key limit (per_key or overrides)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The concurrency key of `job`: its own, else its payload's `key_field`.
    /// An error when the payload's key is over [`MAX_KEY_BYTES`].
    pub fn key_of<'a>(&self, job: &'a Job) -> Result<Option<Cow<'a, str>>, String> {
        if let Some(key) = &job.concurrency_key {
            return Ok(Some(Cow::Borrowed(key)));
        }
        let Some(field) = &self.key_field else { return Ok(None) };
        let Ok(serde_json::Value::Object(mut payload)) = serde_json::from_str(job.payload.get()) else {
            return Ok(None);
        };
        let key = match payload.remove(field) {
            Some(serde_json::Value::String(text)) => text,
            Some(number @ serde_json::Value::Number(_)) => number.to_string(),
            _ => return Ok(None),
        };
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return Err(format!(
                "payload.{field}: the concurrency key must be 1-{MAX_KEY_BYTES} bytes (the queue's limits.key_field)"
            ));
        }
        Ok(Some(Cow::Owned(key)))
    }

    /// The per-key limit of `key` (none: not limited).
    pub fn limit_of(&self, key: &str) -> Option<u32> {
        self.overrides.iter().find(|o| glob_match(&o.pattern, key)).map(|o| o.per_key).or(self.per_key)
    }
}

/// The partition that every job of concurrency key `key` lives in.
pub fn partition_of(key: &str, partitions: i32) -> i32 {
    crate::sharding::shard_of(key, partitions.max(1) as u32) as i32
}

/// Partition `partition`'s share of a total limit over `partitions`: the shares
/// differ by at most one and add up to the total.
pub fn share(total: u32, partitions: i32, partition: i32) -> usize {
    let partitions = partitions.max(1) as u32;
    let partition = partition.clamp(0, partitions as i32 - 1) as u32;
    (total / partitions + u32::from(partition < total % partitions)) as usize
}

/// Whether `text` matches `pattern`, where `*` stands for any run of characters.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else { return rest.is_empty() };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Brute force: every way to split `text` among the pattern's pieces.
    fn matches_by_brute_force(pattern: &[u8], text: &[u8]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some((b'*', rest)) => (0..=text.len()).any(|skip| matches_by_brute_force(rest, &text[skip..])),
            Some((c, rest)) => text.first() == Some(c) && matches_by_brute_force(rest, &text[1..]),
        }
    }

    proptest! {
        #[test]
        fn globs_match_as_brute_force_does(pattern in "[ab*]{0,6}", text in "[ab]{0,8}") {
            prop_assert_eq!(glob_match(&pattern, &text), matches_by_brute_force(pattern.as_bytes(), text.as_bytes()));
        }

        #[test]
        fn shares_add_up_to_the_total_and_differ_by_one_at_most(total in 1u32..1_000, partitions in 1i32..64) {
            let shares: Vec<usize> = (0..partitions).map(|p| share(total, partitions, p)).collect();
            prop_assert_eq!(shares.iter().sum::<usize>(), total as usize);
            prop_assert!(shares.iter().max().unwrap() - shares.iter().min().unwrap() <= 1);
        }
    }

    fn job(text: &str) -> Job {
        Job::parse(text.as_bytes()).unwrap()
    }

    #[test]
    fn a_key_comes_from_the_job_or_its_payload_and_overrides_pick_its_limit() {
        let limits = Limits {
            per_key: Some(1),
            overrides: vec![KeyOverride { pattern: "big:*".into(), per_key: 5 }],
            key_field: Some("tenant".into()),
            ..Default::default()
        };
        let own = job(r#"{"id":"a","payload":{"tenant":"x"},"concurrency_key":"big:1"}"#);
        assert_eq!(limits.key_of(&own).unwrap().as_deref(), Some("big:1"));
        let from_payload = job(r#"{"id":"a","payload":{"tenant":"t7"}}"#);
        assert_eq!(limits.key_of(&from_payload).unwrap().as_deref(), Some("t7"));
        let numbered = job(r#"{"id":"a","payload":{"tenant":42}}"#);
        assert_eq!(limits.key_of(&numbered).unwrap().as_deref(), Some("42"));
        for none in [
            r#"{"id":"a","payload":{"other":1}}"#,
            r#"{"id":"a","payload":[1]}"#,
            r#"{"id":"a","payload":{"tenant":null}}"#,
        ] {
            assert_eq!(limits.key_of(&job(none)).unwrap(), None, "{none}");
        }
        let long = format!(r#"{{"id":"a","payload":{{"tenant":"{}"}}}}"#, "x".repeat(300));
        assert!(limits.key_of(&job(&long)).unwrap_err().contains("payload.tenant"));
        assert_eq!(
            (limits.limit_of("big:1"), limits.limit_of("small"), Limits::default().limit_of("x")),
            (Some(5), Some(1), None)
        );
    }

    #[test]
    fn bad_limits_say_what_to_fix() {
        let check = |limits: Limits| limits.check(4).unwrap_err();
        assert!(check(Limits { per_key: Some(0), ..Default::default() }).contains("per_key must be at least 1"));
        assert!(check(Limits { total: Some(0), ..Default::default() }).contains("total must be at least 1"));
        assert!(check(Limits { total: Some(3), ..Default::default() }).contains("at least the queue's partitions (4)"));
        assert!(check(Limits { at_limit: AtLimit::DropNewest, total: Some(9), ..Default::default() })
            .contains("drop_newest"));
        let cancelling = Limits { at_limit: AtLimit::CancelInProgress, total: Some(9), ..Default::default() };
        assert!(check(cancelling).contains("needs a per-key limit"));
        let empty_pattern =
            Limits { overrides: vec![KeyOverride { pattern: String::new(), per_key: 1 }], ..Default::default() };
        assert!(check(empty_pattern).contains("pattern"));
        assert!(check(Limits { key_field: Some(String::new()), ..Default::default() }).contains("key_field"));
        assert_eq!(Limits { per_key: Some(1), total: Some(4), ..Default::default() }.check(4), Ok(()));
    }

    #[test]
    fn keys_spread_over_the_partitions() {
        let mut per_partition = [0usize; 8];
        for key in 0..8_000 {
            per_partition[partition_of(&format!("tenant:{key}"), 8) as usize] += 1;
        }
        assert!(per_partition.iter().all(|n| (800..1_200).contains(n)), "{per_partition:?}");
        assert_eq!(partition_of("tenant:1", 8), partition_of("tenant:1", 8));
    }
}
