//! No import circles inside `core`: among the modules of one folder (the crate's
//! top-level modules; `wire`'s; `jobs`' …), what one uses of another (a `crate::` or
//! `super::` path outside comments and test code) never leads back to it. A folder
//! module counts as one module to its siblings, whatever its children use.

// Helpers of tests: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root: `["wire", "shard"]`; the root is `[]`.
type ModPath = Vec<String>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every module file of the crate with its module path (test-only modules left out).
fn modules(dir: &Path, prefix: &[String], found: &mut BTreeMap<ModPath, PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            let mut inner = prefix.to_vec();
            inner.push(stem);
            modules(&path, &inner, found);
        } else if path.extension().is_some_and(|e| e == "rs") && stem != "tests" {
            let mut module = prefix.to_vec();
            if stem != "mod" && stem != "lib" {
                module.push(stem);
            }
            found.insert(module, path);
        }
    }
}

/// The code of a file without comments and without its `#[cfg(test)]` module (the
/// file's last item).
fn code(text: &str) -> String {
    let mut kept = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let test_module =
            lines.peek().is_some_and(|next| next.trim_start().trim_start_matches("pub(crate) ").starts_with("mod "));
        if line.trim() == "#[cfg(test)]" && test_module {
            break;
        }
        let line = line.split("//").next().unwrap_or_default();
        kept.push_str(line);
        kept.push('\n');
    }
    kept
}

/// The module paths `code` (of module `me`) names: `crate::a::b::…` and
/// `super::…`, braces expanded (`crate::{a, b::c}`).
fn named_paths(me: &[String], code: &str) -> Vec<ModPath> {
    let mut paths = Vec::new();
    for (start, anchor) in [("crate::", None), ("super::", Some(()))] {
        let mut rest = code;
        while let Some(at) = rest.find(start) {
            let before = rest[..at].chars().last();
            rest = &rest[at + start.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let base: Vec<String> = match anchor {
                None => Vec::new(),
                Some(()) => me[..me.len().saturating_sub(1)].to_vec(),
            };
            expand(&base, rest, &mut paths);
        }
    }
    paths
}

/// Appends the paths of one use-tree starting at `text` (after `base::`).
fn expand(base: &[String], text: &str, paths: &mut Vec<ModPath>) {
    let mut path = base.to_vec();
    let mut rest = text;
    loop {
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if end == 0 {
            if rest.starts_with('{') {
                let inner = &rest[1..matching_brace(rest)];
                for part in split_top_level(inner) {
                    expand(&path, part.trim(), paths);
                }
                return;
            }
            break;
        }
        path.push(rest[..end].to_string());
        rest = &rest[end..];
        match rest.strip_prefix("::") {
            Some(more) => rest = more,
            None => break,
        }
    }
    paths.push(path);
}

fn matching_brace(text: &str) -> usize {
    let mut depth = 0;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    text.len()
}

fn split_top_level(text: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut from) = (Vec::new(), 0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[from..i]);
                from = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[from..]);
    parts
}

/// The module a named path resolves to: its longest prefix that is a module.
fn resolve(path: &[String], all: &BTreeMap<ModPath, PathBuf>) -> ModPath {
    (0..=path.len()).rev().map(|n| path[..n].to_vec()).find(|prefix| all.contains_key(prefix)).unwrap_or_default()
}

/// Whether `file` defines the item `name` itself (rather than re-exporting it).
fn defines(file: &Path, name: &str) -> bool {
    let text = std::fs::read_to_string(file).unwrap();
    ["fn", "struct", "enum", "type", "const", "static", "trait", "mod", "macro_rules!"]
        .iter()
        .any(|kind| text.contains(&format!("{kind} {name}")) || text.contains(&format!("{kind} {name}<")))
}

/// Every edge between siblings: (folder, from, to), `from` and `to` children of
/// `folder`; and every use of an ancestor's re-export (`me` uses `path`), which
/// would hide an edge from a sibling.
#[allow(clippy::type_complexity)]
fn sibling_edges(all: &BTreeMap<ModPath, PathBuf>) -> (BTreeSet<(ModPath, String, String)>, Vec<String>) {
    let mut edges = BTreeSet::new();
    let mut through_reexports = Vec::new();
    for (me, file) in all {
        let text = code(&std::fs::read_to_string(file).unwrap());
        for named in named_paths(me, &text) {
            let target = resolve(&named, all);
            // Their common folder, and the child of it on each side.
            let common = me.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == target.len() && common < me.len() && !target.is_empty() {
                // An ancestor folder: fine for what it defines, not for what it re-exports.
                let item = &named[target.len()..];
                if item.first().is_some_and(|name| !defines(&all[&target], name)) {
                    through_reexports.push(format!("{} uses {}", me.join("::"), named.join("::")));
                }
                continue;
            }
            if common == me.len() || common == target.len() {
                continue; // an ancestor or a descendant: one unit to its siblings
            }
            edges.insert((me[..common].to_vec(), me[common].clone(), target[common].clone()));
        }
    }
    (edges, through_reexports)
}

/// A circle among the siblings of one folder, if any: the modules on it in order.
fn circle(edges: &BTreeSet<(ModPath, String, String)>) -> Option<(ModPath, Vec<String>)> {
    let folders: BTreeSet<&ModPath> = edges.iter().map(|(folder, _, _)| folder).collect();
    for folder in folders {
        let next: BTreeMap<&str, Vec<&str>> =
            edges.iter().filter(|(f, _, _)| f == folder).fold(BTreeMap::new(), |mut next, (_, from, to)| {
                next.entry(from.as_str()).or_default().push(to.as_str());
                next
            });
        for start in next.keys() {
            // Depth-first from `start`, looking for a way back to it.
            let mut stack = vec![(*start, vec![start.to_string()])];
            let mut seen = BTreeSet::new();
            while let Some((at, trail)) = stack.pop() {
                for to in next.get(at).into_iter().flatten() {
                    if to == start {
                        let mut circle = trail.clone();
                        circle.push(start.to_string());
                        return Some((folder.clone(), circle));
                    }
                    if seen.insert(*to) {
                        let mut trail = trail.clone();
                        trail.push(to.to_string());
                        stack.push((to, trail));
                    }
                }
            }
        }
    }
    None
}

#[test]
fn no_module_of_core_uses_a_sibling_that_uses_it_back() {
    let mut all = BTreeMap::new();
    modules(&src(), &[], &mut all);
    assert!(all.len() > 25, "only {} modules found", all.len());
    let (edges, through_reexports) = sibling_edges(&all);
    assert!(edges.len() > 30, "only {} edges found: the reader misses uses", edges.len());
    assert_eq!(circle(&edges), None, "an import circle (folder, modules on it)");
    assert_eq!(
        through_reexports,
        Vec::<String>::new(),
        "uses of a folder's re-exports from inside it: name the module"
    );
}

/// The reader itself: braces, `super::`, comments and test modules.
#[test]
fn the_reader_finds_uses_as_written() {
    let all: BTreeMap<ModPath, PathBuf> =
        [vec![], vec!["a".to_string()], vec!["w".into()], vec!["w".into(), "x".into()]]
            .into_iter()
            .map(|m| (m, PathBuf::new()))
            .collect();
    let me = vec!["w".to_string(), "x".to_string()];
    let text = code(
        "use crate::{a::T, Error};\nuse super::y::Z; // crate::b\nfn f() { crate::a::g(); }\n#[cfg(test)]\nmod tests {\nuse crate::q;\n}",
    );
    let named: Vec<ModPath> = named_paths(&me, &text).iter().map(|p| resolve(p, &all)).collect();
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(named, vec![s(&["a"]), s(&[]), s(&["a"]), s(&["w"])]);
    let edges: BTreeSet<(ModPath, String, String)> =
        [(vec![], "a".to_string(), "w".to_string()), (vec![], "w".to_string(), "a".to_string())].into();
    assert_eq!(circle(&edges), Some((vec![], s(&["a", "w", "a"]))));
}
