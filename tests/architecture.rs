//! The router crate's shape, checked from its source: which file imports which (through
//! `crate::`, `super::`, `self::` and child-module paths, in `use` lines and in code), and that
//! those imports form no cycle, so the crate reads bottom-up (see docs/architecture.md). Unit
//! tests (`#[cfg(test)]` items) are left out: a module's tests may reach anywhere.
//!
//! `cargo test --test architecture -- --nocapture` prints the files in dependency order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module of the crate, one per source file: `crate::proxy::send` for src/proxy/send.rs.
type Module = Vec<String>;

fn name(module: &[String]) -> String {
    if module.is_empty() {
        "crate".to_string()
    } else {
        module.join("::")
    }
}

/// Every `.rs` file under `dir`, with its module path (src/lib.rs is the crate root; main.rs is
/// the binary, not the library).
fn modules(root: &Path, dir: &Path, out: &mut BTreeMap<Module, PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            modules(root, &path, out);
            continue;
        }
        if path.extension().is_none_or(|ext| ext != "rs") {
            continue;
        }
        let relative = path.strip_prefix(root).expect("under src");
        let mut parts: Vec<String> = relative
            .iter()
            .map(|part| part.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        match parts.last().map(String::as_str) {
            Some("main") if parts.len() == 1 => continue,
            Some("lib") if parts.len() == 1 => parts.clear(),
            Some("mod") => {
                parts.pop();
            }
            _ => {}
        }
        out.insert(parts, path);
    }
}

/// The source with comments, string and char literals blanked (so doc links and messages are
/// not read as imports), and every `#[cfg(test)]` item removed.
fn code(source: &str) -> String {
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &source[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            i += end;
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(rest.len(), |end| end + 2);
            i += end;
        } else if rest.starts_with("r#\"") || rest.starts_with("r\"") {
            let hashes = rest[1..].chars().take_while(|&c| c == '#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let start = 2 + hashes;
            let end = rest[start..]
                .find(&close)
                .map_or(rest.len(), |end| start + end + close.len());
            out.push_str("\"\"");
            i += end;
        } else if bytes[i] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            i = j + 1;
        } else if bytes[i] == b'\'' && char_literal(rest) > 0 {
            out.push_str("' '");
            i += char_literal(rest);
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            i += c.len_utf8();
        }
    }
    without_test_items(&out)
}

/// The length of a char literal at the start of `rest` (0 for a lifetime).
fn char_literal(rest: &str) -> usize {
    let b = rest.as_bytes();
    if b.len() >= 4 && b[1] == b'\\' {
        // The escaped character itself may be a quote: `'\''`.
        rest[3..].find('\'').map_or(0, |end| end + 4)
    } else {
        let mut chars = rest[1..].char_indices();
        match (chars.next(), chars.next()) {
            (Some(_), Some((at, '\''))) => at + 2,
            _ => 0,
        }
    }
}

/// `code` with each item under `#[cfg(test)]` cut out (up to its `;` or its closing brace).
fn without_test_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at + "#[cfg(test)]".len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (i, c) in item.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The paths a file's code names: each `use` tree expanded (`a::{b, c::d}` gives `a::b` and
/// `a::c::d`), then every other `x::y` path in the code.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut rest = code;
    let mut others = String::new();
    while let Some(at) = find_word(rest, "use") {
        others.push_str(&rest[..at]);
        let tree = &rest[at + 3..];
        let end = tree.find(';').unwrap_or(tree.len());
        expand(&[], tree[..end].trim(), &mut found);
        rest = &tree[(end + 1).min(tree.len())..];
    }
    others.push_str(rest);
    let chars: Vec<char> = others.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let starts = is_ident_start(chars[i])
            && (i == 0 || !is_ident(chars[i - 1]) && !after_colons(&chars, i));
        if !starts {
            i += 1;
            continue;
        }
        let mut path = Vec::new();
        let mut j = i;
        loop {
            let begin = j;
            while j < chars.len() && is_ident(chars[j]) {
                j += 1;
            }
            path.push(chars[begin..j].iter().collect::<String>());
            if j + 2 < chars.len()
                && chars[j] == ':'
                && chars[j + 1] == ':'
                && is_ident_start(chars[j + 2])
            {
                j += 2;
            } else {
                break;
            }
        }
        if path.len() > 1 {
            found.push(path);
        }
        i = j.max(i + 1);
    }
    found
}

fn after_colons(chars: &[char], i: usize) -> bool {
    i >= 2 && chars[i - 1] == ':' && chars[i - 2] == ':'
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The offset of `word` standing alone in `text`.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = text[from..].find(word) {
        let at = from + at;
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        if before.is_none_or(|c| !is_ident(c)) && after.is_some_and(char::is_whitespace) {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// Expands one `use` tree under `prefix`.
fn expand(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim().trim_start_matches("::");
    if tree.is_empty() {
        return;
    }
    if let Some(inner) = tree.strip_prefix('{') {
        let inner = inner.strip_suffix('}').unwrap_or(inner);
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(prefix, &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(prefix, &inner[start..], out);
        return;
    }
    let (head, tail) = match tree.find("::") {
        Some(at) => (&tree[..at], Some(&tree[at + 2..])),
        None => (tree, None),
    };
    let head = head.split_whitespace().next().unwrap_or("");
    let mut path = prefix.to_vec();
    path.push(head.to_string());
    match tail {
        Some(tail) => expand(&path, tail, out),
        None => out.push(path),
    }
}

/// The module file a path lands in, seen from `from`: the longest prefix of the path that is a
/// module of the crate.
fn target(from: &[String], path: &[String], known: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let mut base: Module;
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            base = Vec::new();
            rest = &path[1..];
        }
        Some("self") => {
            base = from.to_vec();
            rest = &path[1..];
        }
        Some("super") => {
            base = from.to_vec();
            while rest.first().is_some_and(|part| part == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        Some(first) => {
            // A child module named without `self::` (the 2018 edition's uniform paths).
            let mut child = from.to_vec();
            child.push(first.to_string());
            if !known.contains_key(&child) {
                return None;
            }
            base = from.to_vec();
        }
        None => return None,
    }
    for part in rest {
        let mut next = base.clone();
        next.push(part.clone());
        if known.contains_key(&next) {
            base = next;
        } else {
            break;
        }
    }
    Some(base)
}

/// Which module imports which, without a module's own parts and without its `mod` lines.
fn graph(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut known = BTreeMap::new();
    modules(src, src, &mut known);
    // Unit tests kept in files of their own (`mod tests;` under `#[cfg(test)]`): a module's
    // tests may reach anywhere.
    known.retain(|module, _| module.last().is_none_or(|last| last != "tests"));
    let mut edges = BTreeMap::new();
    for (module, path) in &known {
        let source = std::fs::read_to_string(path).expect("read source");
        let code = code(&source);
        let mut to = BTreeSet::new();
        for path in paths(&code) {
            if let Some(target) = target(module, &path, &known) {
                if &target != module {
                    to.insert(target);
                }
            }
        }
        edges.insert(module.clone(), to);
    }
    edges
}

/// Tarjan's strongly connected components with more than one module: the import circles.
fn circles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct State<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on_stack: BTreeSet<&'a Module>,
        found: Vec<Vec<Module>>,
    }
    fn visit<'a>(state: &mut State<'a>, module: &'a Module) {
        let next = state.index.len();
        state.index.insert(module, next);
        state.low.insert(module, next);
        state.stack.push(module);
        state.on_stack.insert(module);
        for to in &state.edges[module] {
            if !state.index.contains_key(to) {
                visit(state, to);
                let low = state.low[module].min(state.low[to]);
                state.low.insert(module, low);
            } else if state.on_stack.contains(to) {
                let low = state.low[module].min(state.index[to]);
                state.low.insert(module, low);
            }
        }
        if state.low[module] == state.index[module] {
            let mut component = Vec::new();
            loop {
                let top = state.stack.pop().expect("on the stack");
                state.on_stack.remove(top);
                component.push(top.clone());
                if top == module {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                state.found.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for module in edges.keys() {
        if !state.index.contains_key(module) {
            visit(&mut state, module);
        }
    }
    state.found
}

/// The modules in an order where each comes after everything it imports (cycles aside).
fn bottom_up(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Module> {
    let mut done: BTreeSet<Module> = BTreeSet::new();
    let mut order = Vec::new();
    while done.len() < edges.len() {
        let ready: Vec<Module> = edges
            .iter()
            .filter(|(module, to)| !done.contains(*module) && to.iter().all(|t| done.contains(t)))
            .map(|(module, _)| module.clone())
            .collect();
        if ready.is_empty() {
            break;
        }
        for module in ready {
            done.insert(module.clone());
            order.push(module);
        }
    }
    order
}

#[test]
fn the_router_crates_imports_form_no_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/rankgate/src");
    let edges = graph(&src);
    assert!(
        edges.len() > 50,
        "found only {} modules under {}",
        edges.len(),
        src.display()
    );
    for module in bottom_up(&edges) {
        let to: Vec<String> = edges[&module].iter().map(|to| name(to)).collect();
        println!("{} <- {}", name(&module), to.join(", "));
    }
    let found = circles(&edges);
    let described: Vec<String> = found
        .iter()
        .map(|circle| {
            let members: Vec<String> = circle.iter().map(|module| name(module)).collect();
            let inside: Vec<String> = circle
                .iter()
                .flat_map(|from| {
                    edges[from]
                        .iter()
                        .filter(|to| circle.contains(to))
                        .map(move |to| format!("{} -> {}", name(from), name(to)))
                })
                .collect();
            format!(
                "{} modules: {}\n  imports inside it: {}",
                members.len(),
                members.join(", "),
                inside.join("; ")
            )
        })
        .collect();
    assert!(
        found.is_empty(),
        "import circles:\n{}",
        described.join("\n")
    );
}

#[test]
fn the_import_reader_sees_use_trees_child_paths_and_skips_tests_and_comments() {
    let source = r#"
//! see [`crate::doc::only`]
use crate::{a::{b, c::D}, e};
use super::sibling::Thing;
fn f() { let _ = child::call(); let _ = "crate::in_string"; x::<crate::g::H>(); }
#[cfg(test)]
mod tests { use crate::tested::T; }
"#;
    let found: BTreeSet<String> = paths(&code(source))
        .iter()
        .map(|path| path.join("::"))
        .collect();
    for expected in [
        "crate::a::b",
        "crate::a::c::D",
        "crate::e",
        "super::sibling::Thing",
        "child::call",
        "crate::g::H",
    ] {
        assert!(
            found.contains(expected),
            "{expected} missing from {found:?}"
        );
    }
    for absent in ["crate::doc::only", "crate::in_string", "crate::tested::T"] {
        assert!(
            !found.contains(absent),
            "{absent} read from a comment, string or test: {found:?}"
        );
    }
}
