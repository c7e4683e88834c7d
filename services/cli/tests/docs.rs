//! The documents stay true to the code: every module of the workspace is named in
//! ARCHITECTURE.md's map and every repository path the map names exists; every
//! `tally …` command line in README.md's shell blocks parses with the real CLI.

// Helpers of tests: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn read(name: &str) -> String {
    std::fs::read_to_string(root().join(name)).unwrap()
}

/// The names in backticks of `text`.
fn quoted(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// The workspace's member directories, from its Cargo.toml.
fn members() -> Vec<String> {
    let manifest: toml::Table = read("Cargo.toml").parse().unwrap();
    manifest["workspace"]["members"].as_array().unwrap().iter().map(|m| m.as_str().unwrap().to_string()).collect()
}

#[test]
fn every_module_is_named_in_the_architecture_map() {
    let map = read("ARCHITECTURE.md");
    let named: std::collections::BTreeSet<&str> = quoted(&map).into_iter().collect();
    let mut missing = Vec::new();
    let mut modules = 0;
    for member in members() {
        let mut files = Vec::new();
        sources(&root().join(&member).join("src"), &mut files);
        for file in files {
            let stem = file.file_stem().unwrap().to_str().unwrap();
            // Crate roots, folder modules and test modules are named by their crate or folder.
            if ["main", "lib", "mod", "tests"].contains(&stem) {
                continue;
            }
            modules += 1;
            if !named.contains(stem) {
                missing.push(file.strip_prefix(root()).unwrap().display().to_string());
            }
        }
    }
    assert!(modules > 100, "only {modules} modules found");
    assert_eq!(missing, Vec::<String>::new(), "modules ARCHITECTURE.md's map does not name");
}

#[test]
fn every_path_the_architecture_map_names_exists() {
    let map = read("ARCHITECTURE.md");
    let tops: Vec<String> = std::fs::read_dir(root())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name != "target")
        .collect();
    let mut checked = 0;
    let mut missing = Vec::new();
    for token in quoted(&map) {
        let first = token.split('/').next().unwrap_or_default();
        if !token.contains('/') || token.contains(char::is_whitespace) || !tops.iter().any(|top| top == first) {
            continue;
        }
        checked += 1;
        let exists = match token.split_once('*') {
            // One glob level: `services/*/src/main.rs`.
            Some((before, after)) => std::fs::read_dir(root().join(before))
                .unwrap()
                .any(|entry| entry.unwrap().path().join(after.trim_start_matches('/')).exists()),
            None => root().join(token).exists(),
        };
        if !exists {
            missing.push(token);
        }
    }
    assert!(checked > 20, "only {checked} paths found");
    assert_eq!(missing, Vec::<&str>::new(), "paths ARCHITECTURE.md names that do not exist");
}

/// Splits a shell command line into words (single and double quotes; a `#` outside
/// them starts a comment).
fn words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quote, mut started) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => (quote, started) = (Some(c), true),
            (None, '#') if !started => break,
            (None, c) if c.is_whitespace() => {
                if started {
                    words.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            (None, c) => (word, started) = (word + &c.to_string(), true),
        }
    }
    if started {
        words.push(word);
    }
    words
}

#[test]
fn every_tally_command_in_the_readme_parses() {
    let readme = read("README.md");
    let mut in_shell = false;
    let mut commands = Vec::new();
    for line in readme.lines() {
        match line.trim_start() {
            fence if fence.starts_with("```") => {
                in_shell = ["```sh", "```bash", "```shell", "```console"].contains(&fence.trim_end())
            }
            line if in_shell => {
                let command = line.strip_prefix("$ ").unwrap_or(line);
                if command.starts_with("tally ") {
                    commands.push(command);
                }
            }
            _ => {}
        }
    }
    assert!(commands.len() >= 15, "only {} commands found", commands.len());
    let refused: Vec<String> = commands
        .iter()
        .filter_map(|command| {
            let words = words(command);
            let error = tally_cli::check_command_line(&words[1..]).err()?;
            Some(format!("{command}\n{error}"))
        })
        .collect();
    assert_eq!(refused, Vec::<String>::new(), "README commands the CLI refuses");
}

#[test]
fn command_lines_split_like_a_shell() {
    let line = r#"tally jobs enqueue default '{"to":"a@b.c"}' --key "user 7"  # a comment"#;
    assert_eq!(words(line), ["tally", "jobs", "enqueue", "default", r#"{"to":"a@b.c"}"#, "--key", "user 7"]);
    assert!(tally_cli::check_command_line(&["jobs".into(), "nonsense".into()]).is_err(), "a refusal is seen");
    assert_eq!(tally_cli::check_command_line(&["query".into(), "--help".into()]), Ok(()), "help is not a refusal");
}

/// The shipped `tally` links tally's libraries only — no service, no benchmark:
/// ARCHITECTURE.md's invariant, read off its manifest.
#[test]
fn the_cli_depends_on_the_libraries_only() {
    let manifest: toml::Table = read("services/cli/Cargo.toml").parse().unwrap();
    let tally: Vec<&str> = manifest["dependencies"]
        .as_table()
        .unwrap()
        .keys()
        .map(String::as_str)
        .filter(|name| name.starts_with("tally-"))
        .collect();
    assert_eq!(tally, vec!["tally-core", "tally-shared"]);
}
