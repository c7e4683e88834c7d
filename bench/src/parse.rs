//! `tally-bench parse`: the ingester's parse of producers' messages on one thread.
//! Arrays of valid increments (read in one pass) against the same messages with one
//! element to reject put first, which go element by element (the way that names each
//! bad element). The one pass gives
//! up on such a message at its first element, and the rejection is the cheapest there
//! is (not an object), so the baseline is the element-by-element way and little else.
//! Messages of one increment are single objects: the scanner's read of them against
//! serde_json's of the same objects with `"id":null`, which the scanner leaves to it.

use crate::counter_apply::thread_cpu_seconds;
use anyhow::ensure;
use tally_core::input::{parse_increments, Bounds};

use crate::pipeline::Entities;

/// The element every baseline message starts with: not an object.
const REJECTED: &str = "5";

/// What single-object baseline messages end with in place of their closing brace.
const LEFT_TO_SERDE: &str = r#","id":null}"#;

/// Parse rates per CPU-second of the parsing thread.
#[derive(Debug, Clone, Copy)]
pub struct ParseFigures {
    pub one_pass: f64,
    /// The baseline's rate.
    pub element_by_element: f64,
    /// What the baseline is.
    pub baseline: &'static str,
}

/// Parses `messages` messages of `per_message` increments (Zipf-drawn entities, as
/// `tally-bench ingest` produces them) both ways, `rounds` times each, alternating;
/// the best round of each counts.
pub fn run(messages: usize, per_message: usize, rounds: usize) -> anyhow::Result<ParseFigures> {
    ensure!(per_message >= 1, "messages of no increments");
    let mut entities = Entities::new(100_000, 11);
    let valid: Vec<String> = (0..messages).map(|_| entities.message(per_message).1).collect();
    let (baseline, rejected, description): (Vec<String>, usize, &'static str) = if per_message == 1 {
        let left_to_serde = valid.iter().map(|object| format!("{}{LEFT_TO_SERDE}", &object[..object.len() - 1]));
        (left_to_serde.collect(), 0, "serde_json (the same objects with \"id\":null)")
    } else {
        let with_rejection = valid.iter().map(|message| format!("[{REJECTED},{}", &message[1..]));
        (with_rejection.collect(), 1, "element by element (one to reject)")
    };
    let mut figures = ParseFigures { one_pass: 0.0, element_by_element: 0.0, baseline: description };
    for _ in 0..rounds.max(1) {
        figures.one_pass = figures.one_pass.max(parse_all(&valid, per_message, 0)?);
        figures.element_by_element = figures.element_by_element.max(parse_all(&baseline, per_message, rejected)?);
    }
    Ok(figures)
}

/// Increments accepted per CPU-second; fails unless every message gave exactly
/// `per_message` increments and `rejected_per_message` rejections.
fn parse_all(messages: &[String], per_message: usize, rejected_per_message: usize) -> anyhow::Result<f64> {
    let (mut accepted, mut rejected) = (0usize, 0usize);
    let started = thread_cpu_seconds();
    for message in messages {
        let dimensions = tally_core::segments::Dimensions::default();
        parse_increments(message.as_bytes(), 0, &Bounds::none(), &dimensions, |_, _| accepted += 1, |_| rejected += 1);
    }
    let spent = thread_cpu_seconds() - started;
    let want = (messages.len() * per_message, messages.len() * rejected_per_message);
    ensure!((accepted, rejected) == want, "parsed {accepted} increments and {rejected} rejections, expected {want:?}");
    Ok(accepted as f64 / spent.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ways_parse_every_increment_of_every_message() {
        for per_message in [100, 1] {
            let figures = run(20, per_message, 1).unwrap();
            assert!(figures.one_pass > 0.0 && figures.element_by_element > 0.0, "{figures:?}");
        }
        assert!(run(20, 0, 1).is_err(), "messages of nothing");
    }

    #[test]
    fn a_message_that_parses_wrong_fails_the_bench() {
        let messages = vec![r#"[{"entity":"a","metric":"v"},{"entity":"b","metric":"BAD"}]"#.to_string()];
        let err = parse_all(&messages, 2, 0).unwrap_err().to_string();
        assert_eq!(err, "parsed 1 increments and 1 rejections, expected (2, 0)");
    }
}
