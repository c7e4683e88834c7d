//! BENCHMARKS.md stays true to the benchmarks: every `tally-bench …` command line in
//! its code blocks parses with the real command line, and every benchmark has a
//! section that shows one.

// Helpers of tests: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;

fn benchmarks_md() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../BENCHMARKS.md")).unwrap()
}

/// The argument lists of every `tally-bench` command in the document's code blocks
/// (a command ends at `;` or a `#` comment).
fn command_lines(text: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if !in_block {
            continue;
        }
        let code = line.split(" #").next().unwrap_or_default();
        for command in code.split(';') {
            let words: Vec<&str> = command.split_whitespace().collect();
            // The binary run (not `cargo build -p tally-bench`).
            let run = |at: usize| {
                let word = words[at];
                (word == "tally-bench" || word.ends_with("/tally-bench")) && (at == 0 || words[at - 1] != "-p")
            };
            if let Some(at) = (0..words.len()).find(|at| run(*at)) {
                found.push(words[at + 1..].iter().map(|w| w.to_string()).collect());
            }
        }
    }
    found
}

#[test]
fn every_tally_bench_command_in_benchmarks_md_parses() {
    let commands = command_lines(&benchmarks_md());
    assert!(commands.len() >= 10, "only {} tally-bench commands found", commands.len());
    let refused: Vec<String> = commands
        .iter()
        .filter_map(|args| tally_bench::check_command_line(args).err().map(|err| format!("{args:?}: {err}")))
        .collect();
    assert_eq!(refused, Vec::<String>::new());
    let shown: std::collections::BTreeSet<String> = commands.iter().filter_map(|args| args.first().cloned()).collect();
    let every = tally_bench::benchmarks();
    assert!(every.len() >= 11 && every.contains(&"scale".to_string()), "{every:?}");
    assert_eq!(shown, every.into_iter().collect(), "benchmarks without a command in BENCHMARKS.md");
}

#[test]
fn a_command_line_it_would_refuse_is_found() {
    let text = "```\ntarget/release/tally-bench ingest --nope 1   # a comment\ntally-bench read; x\ncargo build -p tally-bench\n```\ntally-bench outside\n";
    let commands = command_lines(text);
    assert_eq!(commands, vec![vec!["ingest".to_string(), "--nope".into(), "1".into()], vec!["read".to_string()]]);
    assert!(tally_bench::check_command_line(&commands[0]).is_err());
}
