//! The alerting rules (`deploy/prometheus/tally-rules.yaml`) against the real tool:
//! Debian's `promtool` checks them and runs their unit tests
//! (`tally-rules.test.yaml`). Every alert has a test that fires it and one where it
//! stays silent, a runbook section in `docs/runbook.md` that its `runbook_url` names,
//! and every metric a rule reads is one a service exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|err| panic!("{path}: {err}"))
}

/// `promtool` with `args`, from `$TALLY_PROMTOOL` or the PATH (Debian's
/// `prometheus` package, which the test command installs): its output, and whether it
/// succeeded.
fn promtool(args: &[&str]) -> (bool, String) {
    let binary = std::env::var("TALLY_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let output = Command::new(&binary)
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|err| panic!("{binary}: {err} (install Debian's prometheus package)"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

/// The values of `key:` lines (`- alert: X`, `alertname: X`), in order.
fn values_of(yaml: &str, key: &str) -> Vec<String> {
    yaml.lines()
        .filter_map(|line| line.trim().trim_start_matches("- ").strip_prefix(key)?.strip_prefix(':').map(str::trim))
        .map(|value| value.trim_matches('"').to_string())
        .collect()
}

const RULES: &str = "deploy/prometheus/tally-rules.yaml";
const TESTS: &str = "deploy/prometheus/tally-rules.test.yaml";

#[test]
fn promtool_checks_the_rules_and_passes_their_unit_tests() {
    let (ok, out) = promtool(&["check", "rules", RULES]);
    let alerts = values_of(&read(RULES), "alert");
    assert!(ok && out.contains(&format!("SUCCESS: {} rules found", alerts.len())), "{out}");
    let (ok, out) = promtool(&["test", "rules", TESTS]);
    assert!(ok && out.contains("SUCCESS"), "{out}");
}

#[test]
fn every_alert_is_tested_firing_and_silent_and_has_a_runbook() {
    let alerts = values_of(&read(RULES), "alert");
    assert!(alerts.len() >= 9, "{alerts:?}");
    // Each evaluation of a test: its alert and whether it expects alerts.
    let tests = read(TESTS);
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let mut firing = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for (at, line) in lines.iter().enumerate() {
        let Some(alert) = line.strip_prefix("alertname:").map(str::trim) else { continue };
        match lines.get(at + 1) {
            Some(&"exp_alerts: []") => silent.insert(alert.to_string()),
            Some(&"exp_alerts:") => firing.insert(alert.to_string()),
            other => panic!("{alert}: exp_alerts expected after alertname, found {other:?}"),
        };
    }
    let runbook = read("docs/runbook.md");
    let headings: BTreeSet<String> =
        runbook.lines().filter_map(|line| line.strip_prefix("## ")).map(|h| h.trim().to_string()).collect();
    let urls = values_of(&read(RULES), "runbook_url");
    assert_eq!(urls.len(), alerts.len(), "one runbook_url per alert: {urls:?}");
    for (alert, url) in alerts.iter().zip(&urls) {
        assert!(firing.contains(alert), "{alert}: no test fires it");
        assert!(silent.contains(alert), "{alert}: no test where it stays silent");
        assert!(headings.contains(alert), "{alert}: no `## {alert}` section in docs/runbook.md");
        assert_eq!(url, &format!("docs/runbook.md#{}", alert.to_lowercase()), "{alert}'s runbook_url");
    }
    let known: BTreeSet<&String> = alerts.iter().collect();
    assert_eq!(firing.iter().chain(&silent).filter(|a| !known.contains(a)).count(), 0, "tests of unknown alerts");
}

/// The metric names a rule reads, each a string some service's or the shared crate's
/// source registers.
#[test]
fn every_metric_the_rules_read_is_exported() {
    let rules = expand_alternations(&read(RULES));
    let names: BTreeSet<String> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("tally_") && !word.ends_with('_'))
        .map(str::to_string)
        .collect();
    assert!(names.contains("tally_graph_consumer_lag_seconds"), "a name in a regex counts: {names:?}");
    assert!(names.len() >= 8, "{names:?}");
    let mut source = String::new();
    for dir in ["services", "shared/src"] {
        collect_rust(&repo().join(dir), &mut source);
    }
    let missing: Vec<&String> = names.iter().filter(|name| !source.contains(&format!("\"{name}\""))).collect();
    assert!(missing.is_empty(), "metrics the rules read that no service exports: {missing:?}");
}

/// `tally_(a|b)_x` in a `__name__=~` matcher spelt out as `tally_a_x tally_b_x`.
fn expand_alternations(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(open) = rest.find("tally_(") {
        let close = open + rest[open..].find(')').expect("a closed group");
        let suffix_end = rest[close + 1..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(rest.len(), |at| close + 1 + at);
        let (choices, suffix) = (&rest[open + 7..close], &rest[close + 1..suffix_end]);
        out.push_str(&rest[..open]);
        let names: Vec<String> = choices.split('|').map(|choice| format!("tally_{choice}{suffix}")).collect();
        out.push_str(&names.join(" "));
        rest = &rest[suffix_end..];
    }
    out + rest
}

#[test]
fn alternations_in_metric_matchers_are_spelt_out() {
    assert_eq!(
        expand_alternations(r#"max ({__name__=~"tally_(ingester|graph)_consumer_lag_seconds"}) > 60"#),
        r#"max ({__name__=~"tally_ingester_consumer_lag_seconds tally_graph_consumer_lag_seconds"}) > 60"#
    );
    assert_eq!(expand_alternations("tally_ready == 0"), "tally_ready == 0");
}

fn collect_rust(dir: &Path, into: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_rust(&path, into);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            into.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}
