//! The crate's modules form no cycle: each module uses only modules below it, so each
//! can be read (and tested) knowing only those.
//!
//! The graph is read from the sources themselves (`src/*.rs`, `src/rules/*.rs`): every
//! `crate::X` (also `$crate::X` and `use crate::{X, …}`), every `super::…` that climbs
//! out of a module, and in `lib.rs` every `X::` naming a child module is an edge to the
//! top-level module `X` (`rules/*` count as the one module `rules`). A `crate::Y` whose
//! `Y` is no module (a re-export such as `crate::Graph`) is an edge to the crate root,
//! `lib`. Comments (doc links included) and string literals are no edges; `#[cfg(test)]`
//! modules are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules it uses.
type ModuleGraph = BTreeMap<String, BTreeSet<String>>;

/// The root: `lib.rs`, what `crate::Y` names when `Y` is no module.
const ROOT: &str = "lib";

#[test]
fn the_crate_modules_form_no_cycle() {
    let graph = crate_graph();
    let cycles = cycles(&graph);
    let tangles = tangles(&graph);
    assert!(
        cycles.is_empty(),
        "{} cycle(s) between hapd-core's modules:\n{}\n(graph: {graph:#?})",
        cycles.len(),
        cycles
            .iter()
            .zip(&tangles)
            .map(|(c, t)| format!("  {}   (modules that reach each other: {t:?})", c.join(" -> ")))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    // the order a reader can take them in, ground floor up
    println!("modules, ground floor up: {}", layers(&graph).join(", "));
}

/// The crate docs' list of modules (`lib.rs`, "## Modules, ground floor up") names every
/// module once, each after all those it uses.
#[test]
fn the_documented_module_order_is_true() {
    let graph = crate_graph();
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let listed: Vec<String> = lib
        .lines()
        .skip_while(|l| !l.starts_with("//! ## Modules, ground floor up"))
        .skip(1)
        .take_while(|l| l.starts_with("//!"))
        .filter_map(|l| l.strip_prefix("//! - [`")?.split('`').next().map(str::to_string))
        .collect();
    let modules: BTreeSet<&String> = graph.keys().filter(|m| *m != ROOT).collect();
    assert_eq!(listed.iter().collect::<BTreeSet<_>>(), modules, "lib.rs's module list names each module once");
    assert_eq!(listed.len(), modules.len(), "lib.rs's module list names a module twice: {listed:?}");
    for (i, module) in listed.iter().enumerate() {
        for used in &graph[module] {
            assert!(
                listed[..i].contains(used),
                "lib.rs lists `{module}` before `{used}`, which it uses (listed: {listed:?})"
            );
        }
    }
}

/// The checker itself: it finds a cycle through `use`, `super::` and grouped imports, and
/// names its modules; comments, strings and re-exports through the root make no false one.
#[test]
fn the_checker_finds_a_planted_cycle() {
    let mut files = vec![
        (vec!["a".to_string()], "use crate::b::Thing; // crate::c::Not\nconst S: &str = \"crate::c\";".to_string()),
        (vec!["b".to_string()], "use crate::{layer::X, c};".to_string()),
        (vec!["c".to_string()], "fn f() { crate::Graph::new(); }".to_string()),
        (vec!["layer".to_string(), "inner".to_string()], "use super::super::d::Y;\nmod tests { use super::*; }".to_string()),
        (vec!["d".to_string()], "/* crate::a */ fn g<'a>(x: &'a str) -> char { '\"' }".to_string()),
        (vec![], "pub mod a; pub mod b; pub mod c; pub mod d; pub mod layer; pub use {a::Thing, d::Y};".to_string()),
    ];
    let graph = module_graph(&files);
    assert_eq!(graph["a"], ["b"].iter().map(|s| s.to_string()).collect());
    assert_eq!(graph["b"], ["c", "layer"].iter().map(|s| s.to_string()).collect());
    assert_eq!(graph["layer"], ["d"].iter().map(|s| s.to_string()).collect());
    assert!(graph["d"].is_empty());
    let found = cycles(&graph);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].first(), found[0].last(), "{found:?}");
    assert_eq!(found[0], vec!["a", "b", "c", "lib", "a"]);
    // without the root's use of `a` (c → lib → a → b → c) the graph has none
    files.last_mut().unwrap().1 = "pub mod b; pub mod c; pub mod d; pub mod layer;".to_string();
    files[0].1.clear();
    assert!(cycles(&module_graph(&files)).is_empty());
    // a cycle through `super::` out of a nested module
    files[4].1 = "use crate::layer::inner::Z;".to_string();
    let found = cycles(&module_graph(&files));
    assert_eq!(found, vec![vec!["d", "layer", "d"]]);
}

fn src() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The crate's files: (module path, text), `lib.rs` at the empty path.
fn crate_files() -> Vec<(Vec<String>, String)> {
    let mut files = Vec::new();
    for (dir, prefix) in [(src(), vec![]), (src().join("rules"), vec!["rules".to_string()])] {
        let mut entries: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for path in entries.into_iter().filter(|p| p.extension().is_some_and(|e| e == "rs")) {
            let stem = path.file_stem().unwrap().to_str().unwrap().to_string();
            let mut module = prefix.clone();
            if stem != "lib" && stem != "mod" {
                module.push(stem);
            }
            files.push((module, std::fs::read_to_string(&path).unwrap()));
        }
    }
    assert!(files.iter().any(|(m, _)| m.is_empty()), "no lib.rs under {}", src().display());
    assert!(files.len() > 10, "too few files under {}", src().display());
    files
}

fn crate_graph() -> ModuleGraph {
    module_graph(&crate_files())
}

/// The graph between top-level modules of `files` (module path, text).
fn module_graph(files: &[(Vec<String>, String)]) -> ModuleGraph {
    let modules: BTreeSet<String> = files.iter().filter_map(|(m, _)| m.first().cloned()).collect();
    let mut graph: ModuleGraph = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    graph.insert(ROOT.to_string(), BTreeSet::new());
    for (path, text) in files {
        let from = path.first().cloned().unwrap_or_else(|| ROOT.to_string());
        for target in references(path, &code_only(text), &modules) {
            if target != from {
                graph.get_mut(&from).unwrap().insert(target);
            }
        }
    }
    graph
}

/// `text` with comments and the contents of string and char literals blanked out.
fn code_only(text: &str) -> Vec<char> {
    let c: Vec<char> = text.chars().collect();
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let mut out = Vec::with_capacity(c.len());
    let mut i = 0;
    while i < c.len() {
        if c[i] == '/' && at(i + 1) == '/' {
            i = c[i..].iter().position(|&x| x == '\n').map_or(c.len(), |n| i + n);
        } else if c[i] == '/' && at(i + 1) == '*' {
            i = block_comment_end(&c, i);
            out.push(' ');
        } else if let Some(end) = raw_string_end(&c, i) {
            i = end;
            out.extend(['"', '"']);
        } else if c[i] == '"' {
            i = quoted_end(&c, i, '"');
            out.extend(['"', '"']);
        } else if c[i] == '\'' && (at(i + 1) == '\\' || at(i + 2) == '\'') {
            // a char literal ('x', '\n', '\''); a lifetime ('a) is code
            i = quoted_end(&c, i, '\'');
            out.push(' ');
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Past the (nested) block comment opening at `i`.
fn block_comment_end(c: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < c.len() {
        if c[i..].starts_with(&['/', '*']) {
            depth += 1;
            i += 2;
        } else if c[i..].starts_with(&['*', '/']) {
            depth -= 1;
            i += 2;
            if depth == 0 {
                break;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// Past the raw string (`r"…"`, `r#"…"#`) opening at `i`, if one does.
fn raw_string_end(c: &[char], i: usize) -> Option<usize> {
    if c[i] != 'r' || (i > 0 && ident(c[i - 1])) {
        return None;
    }
    let hashes = c[i + 1..].iter().take_while(|&&x| x == '#').count();
    let open = i + 1 + hashes;
    if c.get(open) != Some(&'"') {
        return None;
    }
    let closes = |j: usize| c[j] == '"' && (1..=hashes).all(|h| c.get(j + h) == Some(&'#'));
    let close = (open + 1..c.len()).find(|&j| closes(j)).unwrap_or(c.len());
    Some(close + 1 + hashes)
}

/// Past the literal opening with `quote` at `i` (backslash escapes skipped).
fn quoted_end(c: &[char], mut i: usize, quote: char) -> usize {
    i += 1;
    while i < c.len() && c[i] != quote {
        i += if c[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

fn ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The identifier starting at `i`, if any.
fn word(code: &[char], i: usize) -> String {
    code[i.min(code.len())..].iter().take_while(|c| ident(**c)).collect()
}

fn skip_space(code: &[char], mut i: usize) -> usize {
    while i < code.len() && code[i].is_whitespace() {
        i += 1;
    }
    i
}

/// Whether `code[i..]` starts with `s`, not in the middle of an identifier or path.
fn token_at(code: &[char], i: usize, s: &str) -> bool {
    let s: Vec<char> = s.chars().collect();
    code.len() >= i + s.len()
        && code[i..i + s.len()] == s[..]
        && (i == 0 || !(ident(code[i - 1]) || code[i - 1] == ':'))
}

/// The top-level modules (or [`ROOT`]) that the file of module `path` refers to.
fn references(path: &[String], code: &[char], modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let top = |name: &str| if modules.contains(name) { name.to_string() } else { ROOT.to_string() };
    let mut scope = Scope::default();
    let mut i = 0;
    while i < code.len() {
        scope.step(code, i);
        if let Some(j) = crate_path_at(code, i) {
            found.extend(crate_names(code, j).iter().map(|name| top(name)));
        } else if token_at(code, i, "super::") {
            // where `super` climbs to from here: the file's module and its open inline ones
            let mut at: Vec<String> = path.iter().cloned().chain(scope.inline.iter().map(|(n, _)| n.clone())).collect();
            let mut j = i;
            while code[j..].starts_with(&"super::".chars().collect::<Vec<_>>()) {
                at.pop();
                j += "super::".len();
            }
            let name = word(code, j);
            match at.first() {
                Some(first) => found.insert(first.clone()),
                None if !name.is_empty() && name != "self" => found.insert(top(&name)),
                None => false,
            };
        } else if path.is_empty() && !word(code, i).is_empty() && (i == 0 || !(ident(code[i - 1]) || code[i - 1] == ':')) {
            // in lib.rs the child modules are in scope by their names
            let name = word(code, i);
            if modules.contains(&name) && code[i + name.len()..].starts_with(&[':', ':']) {
                found.insert(name.clone());
            }
            i += name.len();
            continue;
        }
        i += 1;
    }
    found
}

/// The inline modules (`mod tests { … }`) open at a point of a file, as its text is
/// read char by char.
#[derive(Default)]
struct Scope {
    /// Each open inline module: (name, brace depth inside it).
    inline: Vec<(String, usize)>,
    depth: usize,
}

impl Scope {
    /// Read `code[i]`: a `mod name {` opens a module, a `}` may close one.
    fn step(&mut self, code: &[char], i: usize) {
        if token_at(code, i, "mod") && code.get(i + 3).is_some_and(|c| c.is_whitespace()) {
            let j = skip_space(code, i + 3);
            let name = word(code, j);
            let k = skip_space(code, j + name.len());
            if !name.is_empty() && code.get(k) == Some(&'{') {
                self.inline.push((name, self.depth + 1));
            }
        }
        match code[i] {
            '{' => self.depth += 1,
            '}' => {
                if self.inline.last().is_some_and(|(_, d)| *d == self.depth) {
                    self.inline.pop();
                }
                self.depth = self.depth.saturating_sub(1);
            }
            _ => {}
        }
    }
}

/// Where the path after a `crate::` (or `$crate::`) at `i` starts, if one is there.
fn crate_path_at(code: &[char], i: usize) -> Option<usize> {
    if token_at(code, i, "crate::") {
        Some(i + "crate::".len())
    } else if code[i] == '$' && token_at(code, i + 1, "crate::") {
        Some(i + 1 + "crate::".len())
    } else {
        None
    }
}

/// The first names of the path at `j` after `crate::`: one, or each of a group
/// (`crate::{a::X, b}`).
fn crate_names(code: &[char], j: usize) -> Vec<String> {
    if code.get(j) != Some(&'{') {
        return vec![word(code, j)];
    }
    let mut names = Vec::new();
    let (mut k, mut level, mut start) = (j + 1, 1, true);
    while k < code.len() && level > 0 {
        match code[k] {
            '{' => level += 1,
            '}' => level -= 1,
            ',' if level == 1 => start = true,
            c if start && ident(c) => {
                let name = word(code, k);
                k += name.len();
                names.push(name);
                start = false;
                continue;
            }
            c if !c.is_whitespace() => start = false,
            _ => {}
        }
        k += 1;
    }
    names
}

/// One cycle (a path from a module back to it) in each of the graph's [`tangles`].
fn cycles(graph: &ModuleGraph) -> Vec<Vec<String>> {
    tangles(graph).iter().map(|tangle| path_back(graph, tangle.first().unwrap(), tangle)).collect()
}

/// The strongly connected components of more than one module: the modules of each
/// reach each other.
fn tangles(graph: &ModuleGraph) -> Vec<BTreeSet<String>> {
    let mut tangles = Vec::new();
    let mut done: BTreeSet<&String> = BTreeSet::new();
    for start in graph.keys() {
        if done.contains(start) {
            continue;
        }
        let component: BTreeSet<&String> =
            graph.keys().filter(|m| reaches(graph, start, m) && reaches(graph, m, start)).collect();
        done.extend(component.iter().copied());
        if component.len() > 1 {
            tangles.push(component.into_iter().cloned().collect());
        }
    }
    tangles
}

fn reaches(graph: &ModuleGraph, from: &String, to: &String) -> bool {
    let mut seen = BTreeSet::from([from]);
    let mut todo = vec![from];
    while let Some(m) = todo.pop() {
        if m == to {
            return true;
        }
        for next in &graph[m] {
            if seen.insert(next) {
                todo.push(next);
            }
        }
    }
    false
}

/// The shortest path from `start` back to itself within `component` (breadth first).
fn path_back(graph: &ModuleGraph, start: &String, component: &BTreeSet<String>) -> Vec<String> {
    let mut parent: BTreeMap<&String, &String> = BTreeMap::new();
    let mut frontier = vec![start];
    while !frontier.is_empty() {
        let mut next_frontier = Vec::new();
        for m in frontier {
            for next in graph[m].iter().filter(|n| component.contains(*n)) {
                if next == start {
                    let mut path = vec![start.clone(), m.clone()];
                    let mut at = m;
                    while at != start {
                        at = parent[at];
                        path.push(at.clone());
                    }
                    path.reverse();
                    return path;
                }
                if !parent.contains_key(next) {
                    parent.insert(next, m);
                    next_frontier.push(next);
                }
            }
        }
        frontier = next_frontier;
    }
    unreachable!("{start} is in a component of more than one module")
}

/// The modules (root last) in an order where each comes after those it uses; modules of
/// one height in name order.
fn layers(graph: &ModuleGraph) -> Vec<String> {
    let mut placed: Vec<String> = Vec::new();
    while placed.len() < graph.len() {
        let ready: Vec<String> = graph
            .iter()
            .filter(|(m, uses)| !placed.contains(m) && uses.iter().all(|u| placed.contains(u)))
            .map(|(m, _)| m.clone())
            .collect();
        assert!(!ready.is_empty(), "a cycle among {:?}", graph.keys().filter(|m| !placed.contains(m)).collect::<Vec<_>>());
        placed.extend(ready);
    }
    placed
}
