//! Paths resolved to the file that defines what they name (re-exports and imports followed as
//! aliases), file-to-file edges reduced to the level where the two files meet, and the circles
//! (strongly connected components of more than one node) at every level.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::model::{Crate, ModPath, Named};

/// How many aliases a path may go through before the walk stops (re-export loops).
const MAX_ALIASES: usize = 32;

/// Where a path ends: on a module itself, or on an item of (or unresolved below) a module.
enum Found {
    Module(ModPath),
    Item(ModPath),
}

/// The module that defines what `named` names (an inline module or a file's own), or `None`
/// for a path outside the crate.
pub fn resolve(krate: &Crate, named: &Named) -> Option<ModPath> {
    match find(krate, named, 0)? {
        Found::Module(m) | Found::Item(m) => Some(m),
    }
}

fn find(krate: &Crate, named: &Named, depth: usize) -> Option<Found> {
    if let Some(at) = named.relative_at {
        let scope = krate.scopes.get(&named.path[..at])?;
        let first = named.path.get(at)?;
        let child = named.path[..=at].to_vec();
        // A lone name is an import or a local (a variable named as a child module is no use
        // of it); a longer path may start with a child module or an item.
        let lone = named.path.len() == at + 1;
        let known = scope.aliases.contains_key(first)
            || !lone && (krate.scopes.contains_key(&child) || scope.defined.contains(first));
        if !known {
            return None;
        }
    }
    walk(krate, &named.path, depth)
}

/// Walks the longest prefix of `path` that is modules, then follows the next name if the
/// module imports it (explicitly or by a glob of a module that has it).
fn walk(krate: &Crate, path: &[String], depth: usize) -> Option<Found> {
    let mut module = ModPath::new();
    krate.scopes.get(&module)?;
    for (i, seg) in path.iter().enumerate() {
        module.push(seg.clone());
        if krate.scopes.contains_key(&module) {
            continue;
        }
        module.pop();
        let scope = &krate.scopes[&module];
        if depth >= MAX_ALIASES || scope.defined.contains(seg) {
            return Some(Found::Item(module));
        }
        let rest = &path[i + 1..];
        if let Some(alias) = scope.aliases.get(seg) {
            let target = Named {
                path: [&alias.path[..], rest].concat(),
                relative_at: alias.relative_at,
            };
            return Some(find(krate, &target, depth + 1).unwrap_or(Found::Item(module)));
        }
        for glob in &scope.globs {
            let Some(Found::Module(g)) = find(krate, glob, depth + 1) else {
                continue;
            };
            let child = [&g[..], std::slice::from_ref(seg)].concat();
            let there = &krate.scopes[&g];
            if there.defined.contains(seg)
                || there.aliases.contains_key(seg)
                || krate.scopes.contains_key(&child)
            {
                let target = [&child[..], rest].concat();
                return Some(walk(krate, &target, depth + 1).unwrap_or(Found::Item(module)));
            }
        }
        return Some(Found::Item(module));
    }
    Some(Found::Module(module))
}

/// Where a path is named: file, line, the path as written.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Site {
    /// The file below `src`.
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// The path as written.
    pub text: String,
    /// In test code (`#[cfg(test)]`, `#[test]`, a test-gated module).
    pub test_code: bool,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let test = if self.test_code { " [test code]" } else { "" };
        write!(f, "{}:{} uses {}{test}", self.file, self.line, self.text)
    }
}

/// One use between two different files: their modules, the site, the module it reaches.
pub struct FileEdge {
    /// The using file's module.
    pub from: ModPath,
    /// The defining file's module.
    pub to: ModPath,
    /// The module (file or inline) the path resolved to.
    pub target: ModPath,
    /// Where.
    pub site: Site,
}

/// Every use of one file by another.
pub fn file_edges(krate: &Crate) -> Vec<FileEdge> {
    let mut out = Vec::new();
    for file in &krate.files {
        for r in &file.refs {
            let Some(target) = resolve(krate, &r.named) else {
                continue;
            };
            let to = &krate.files[krate.scopes[&target].file].module;
            if *to != file.module {
                let site = Site {
                    file: file.rel.clone(),
                    line: r.line,
                    text: r.text.clone(),
                    test_code: r.test_code,
                };
                out.push(FileEdge {
                    from: file.module.clone(),
                    to: to.clone(),
                    target,
                    site,
                });
            }
        }
    }
    out
}

/// A node at a level: one of its child modules, or (`None`) the level's own file.
pub type Node = Option<String>;

/// The name a node is shown by.
pub fn node_name(node: &Node) -> &str {
    node.as_deref().unwrap_or("self")
}

/// The name a level is shown by: its module path, or `crate`.
pub fn level_name(level: &[String]) -> String {
    if level.is_empty() {
        "crate".into()
    } else {
        level.join("::")
    }
}

/// One circle: its level, its members and every edge between them with its uses.
#[derive(Debug)]
pub struct Circle {
    /// The module whose children (and own file) the members are.
    pub level: ModPath,
    /// The members, sorted (`None` first: the level's own file).
    pub members: Vec<Node>,
    /// Every edge between two members, with every use that makes it (sorted).
    pub edges: Vec<((Node, Node), Vec<Site>)>,
}

/// Reduces `a -> b` to the level where the two modules meet.
fn reduce(a: &[String], b: &[String]) -> (ModPath, Node, Node) {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    (
        a[..common].to_vec(),
        a.get(common).cloned(),
        b.get(common).cloned(),
    )
}

/// Every circle at every level, sorted by level.
pub fn circles(edges: &[FileEdge]) -> Vec<Circle> {
    let mut levels: BTreeMap<ModPath, BTreeMap<(Node, Node), Vec<Site>>> = BTreeMap::new();
    for e in edges {
        let (level, a, b) = reduce(&e.from, &e.to);
        // A module and its own children are one unit (the children are its parts, as a type's
        // private helpers are): only uses between siblings can make a circle.
        if a.is_none() || b.is_none() {
            continue;
        }
        levels
            .entry(level)
            .or_default()
            .entry((a, b))
            .or_default()
            .push(e.site.clone());
    }
    let mut out = Vec::new();
    for (level, level_edges) in levels {
        for members in components(&level_edges) {
            let inside: BTreeSet<&Node> = members.iter().collect();
            let mut edges: Vec<_> = level_edges
                .iter()
                .filter(|((a, b), _)| inside.contains(a) && inside.contains(b))
                .map(|(k, sites)| {
                    let mut sites = sites.clone();
                    sites.sort();
                    sites.dedup();
                    (k.clone(), sites)
                })
                .collect();
            edges.sort();
            out.push(Circle {
                level: level.clone(),
                members,
                edges,
            });
        }
    }
    out
}

/// Tarjan's strongly connected components of more than one node.
fn components(edges: &BTreeMap<(Node, Node), Vec<Site>>) -> Vec<Vec<Node>> {
    let nodes: BTreeSet<&Node> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let nodes: Vec<&Node> = nodes.into_iter().collect();
    let index_of = |n: &Node| nodes.iter().position(|m| *m == n).unwrap_or(0);
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (a, b) in edges.keys() {
        next[index_of(a)].push(index_of(b));
    }
    let mut t = Tarjan {
        next,
        index: vec![None; nodes.len()],
        low: vec![0; nodes.len()],
        stack: Vec::new(),
        on_stack: vec![false; nodes.len()],
        counter: 0,
        found: Vec::new(),
    };
    for v in 0..nodes.len() {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    let mut out: Vec<Vec<Node>> = t
        .found
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut c: Vec<Node> = c.into_iter().map(|i| nodes[i].clone()).collect();
            c.sort();
            c
        })
        .collect();
    out.sort();
    out
}

struct Tarjan {
    next: Vec<Vec<usize>>,
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    stack: Vec<usize>,
    on_stack: Vec<bool>,
    counter: usize,
    found: Vec<Vec<usize>>,
}

impl Tarjan {
    fn visit(&mut self, v: usize) {
        self.index[v] = Some(self.counter);
        self.low[v] = self.counter;
        self.counter += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
        for w in self.next[v].clone() {
            match self.index[w] {
                None => {
                    self.visit(w);
                    self.low[v] = self.low[v].min(self.low[w]);
                }
                Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(self.low[v]) == self.index[v] {
            let mut component = Vec::new();
            while let Some(w) = self.stack.pop() {
                self.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            self.found.push(component);
        }
    }
}
