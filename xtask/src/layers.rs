//! `cargo xtask check-layers`: the import graph of each crate's modules, read from the source
//! tree as it is when it runs, must have no circle between sibling modules at any level,
//! production code must not call the test rig (`crate::testing`), and ARCHITECTURE.md's folder
//! table must name every folder of `burn-ddp/src` (depth 1 and 2) and no folder that is not
//! there.
//!
//! A path (in a private `use`, code, a type, an attribute path or a macro's tokens) that leads
//! into the crate is resolved to the file defining what it names: re-exports and imports are
//! followed as aliases, not counted as uses themselves. A use of file A by file B is then
//! reduced to the level where they meet: at their longest common module P, the child of P
//! holding A uses the child of P holding B. A use between a module's own file and its
//! descendants is not an edge: a module and its children are one unit, the children its parts.
//! Circles are Tarjan's strongly connected components (more than one node) at each level.

mod collect;
mod graph;
mod model;
mod tree;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;

use graph::{Circle, FileEdge, Site, level_name, node_name};

/// The crates' `src` folders checked, below the workspace root.
const CRATES: [&str; 3] = ["burn-ddp/src", "burn-ddp-nccl/src", "xtask/src"];
/// The crate whose folders ARCHITECTURE.md's folder table names.
const TABLE_CRATE: &str = "burn-ddp/src";
/// How many files using one edge a circle's report shows.
const FILES_SHOWN: usize = 6;

/// Flags of `cargo xtask check-layers`.
#[derive(Debug, Args)]
pub struct CheckLayers {
    /// The workspace root (default: the one xtask was built from)
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
}

/// Runs the check on the workspace, prints the report; fails on any problem.
pub fn check_layers(task: CheckLayers) -> Result<()> {
    let root = task.root.unwrap_or_else(workspace_root);
    let started = Instant::now();
    let report = check_workspace(&root)?;
    print!("{}", report.text);
    println!(
        "checked {} files in {:.0?}",
        report.files,
        started.elapsed()
    );
    if report.problems > 0 {
        bail!("{} layering problem(s), listed above", report.problems);
    }
    Ok(())
}

/// The workspace xtask was built from.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The whole check's result.
#[derive(Debug, Default)]
pub struct Report {
    /// What to print.
    pub text: String,
    /// Circles, test-support calls and table mismatches.
    pub problems: usize,
    /// Files read.
    pub files: usize,
}

/// What one crate's check found.
#[derive(Debug, Default)]
pub struct CrateCheck {
    /// Files read.
    pub files: usize,
    /// Every circle, at every level.
    pub circles: Vec<Circle>,
    /// Uses of test-support modules from production code.
    pub test_support_calls: Vec<String>,
    /// Files no `mod` declares (placed by their path).
    pub undeclared: Vec<String>,
}

/// Checks every crate of the workspace at `root` and ARCHITECTURE.md's folder table.
pub fn check_workspace(root: &Path) -> Result<Report> {
    let mut report = Report::default();
    for name in CRATES {
        let check = check_crate(&root.join(name))?;
        report.files += check.files;
        report.problems += check.circles.len() + check.test_support_calls.len();
        render(name, &check, &mut report.text);
    }
    let md_path = root.join("ARCHITECTURE.md");
    let md =
        fs::read_to_string(&md_path).with_context(|| format!("reading {}", md_path.display()))?;
    let mismatches = table_mismatches(&md, &root.join(TABLE_CRATE))?;
    report.problems += mismatches.len();
    if mismatches.is_empty() {
        report
            .text
            .push_str("ARCHITECTURE.md: its folder table names every folder\n");
    }
    for m in mismatches {
        let _ = writeln!(report.text, "ARCHITECTURE.md: {m}");
    }
    Ok(report)
}

/// Checks the crate whose sources are in `src`.
pub fn check_crate(src: &Path) -> Result<CrateCheck> {
    let krate = tree::read_crate(src)?;
    let edges = graph::file_edges(&krate);
    let test_support_calls = edges
        .iter()
        .filter(|e| is_test_rig(&e.target) && krate.scopes[&e.target].gated && !e.site.test_code)
        .map(|e| test_support_call(&krate, e))
        .collect();
    let undeclared = krate
        .files
        .iter()
        .filter(|f| f.undeclared)
        .map(|f| f.rel.clone())
        .collect();
    Ok(CrateCheck {
        files: krate.files.len(),
        circles: graph::circles(&edges),
        test_support_calls,
        undeclared,
    })
}

/// Whether `module` is the crate's test rig, the root `testing` module (feature
/// `test-support`), or inside it. A test hook inside a production module (a `#[cfg(feature =
/// "test-support")]` child of a transport, say) is that module's own business, not a call into
/// the test rig.
fn is_test_rig(module: &[String]) -> bool {
    module.first().is_some_and(|m| m == "testing")
}

fn test_support_call(krate: &model::Crate, e: &FileEdge) -> String {
    let file = &krate.files[krate.scopes[&e.target].file].rel;
    format!(
        "{}, in {} ({file}), a test-gated module",
        e.site,
        level_name(&e.target)
    )
}

/// Appends one crate's part of the report.
fn render(name: &str, check: &CrateCheck, out: &mut String) {
    let _ = writeln!(
        out,
        "{name}: {} files, {} circle(s)",
        check.files,
        check.circles.len()
    );
    for c in &check.circles {
        let level = level_name(&c.level);
        let members: Vec<&str> = c.members.iter().map(node_name).collect();
        let _ = writeln!(out, "  circle in {level}: {}", members.join(", "));
        for ((a, b), sites) in &c.edges {
            let (a, b) = (node_name(a), node_name(b));
            let _ = writeln!(out, "    {level}: {a} -> {b} ({})", sites_by_file(sites));
        }
    }
    if !check.test_support_calls.is_empty() {
        let _ = writeln!(out, "  production code calls test-support code:");
    }
    for call in &check.test_support_calls {
        let _ = writeln!(out, "    {call}");
    }
    for file in &check.undeclared {
        let _ = writeln!(
            out,
            "  note: {file} is declared by no `mod` (placed by its path)"
        );
    }
}

/// The uses of one edge, shortly: per file (the first [`FILES_SHOWN`]) its first line.
fn sites_by_file(sites: &[Site]) -> String {
    let mut files: BTreeMap<&str, BTreeMap<usize, Vec<&Site>>> = BTreeMap::new();
    for s in sites {
        files
            .entry(&s.file)
            .or_default()
            .entry(s.line)
            .or_default()
            .push(s);
    }
    let mut shown = Vec::new();
    for lines in files.values().take(FILES_SHOWN) {
        let Some((_, first)) = lines.first_key_value() else {
            continue;
        };
        let texts: Vec<&str> = first.iter().map(|s| s.text.as_str()).collect();
        let Some(one) = first.first() else { continue };
        let mut site = format!("{}:{} uses {}", one.file, one.line, texts.join(", "));
        if first.iter().any(|s| s.test_code) {
            site.push_str(" [test code]");
        }
        if lines.len() > 1 {
            let more = lines.len() - 1;
            let _ = write!(site, " (+{more} line{})", if more == 1 { "" } else { "s" });
        }
        shown.push(site);
    }
    if files.len() > FILES_SHOWN {
        shown.push(format!("and {} more files", files.len() - FILES_SHOWN));
    }
    shown.join("; ")
}

/// The folders of `src` at depth 1 and 2, as `a/` and `a/b/`.
fn folders(src: &Path) -> Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    let mut stack = vec![(src.to_path_buf(), String::new(), 0)];
    while let Some((dir, prefix, depth)) = stack.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.file_type()?.is_dir() && !name.starts_with('.') {
                let rel = format!("{prefix}{name}/");
                if depth < 1 {
                    stack.push((entry.path(), rel.clone(), depth + 1));
                }
                out.insert(rel);
            }
        }
    }
    Ok(out)
}

/// The folders named (in backticks, ending in `/`) by the rows of the first table of
/// `markdown` whose header has a "folder" column; `None` when there is no such table.
fn table_folders(markdown: &str) -> Option<BTreeSet<String>> {
    let lines: Vec<&str> = markdown.lines().map(str::trim).collect();
    let header = lines.windows(2).position(|w| {
        w[0].starts_with('|')
            && w[0].to_lowercase().contains("folder")
            && w[1].starts_with('|')
            && w[1].chars().all(|c| "|-: ".contains(c))
    })?;
    let rows = lines[header + 2..]
        .iter()
        .take_while(|l| l.starts_with('|'));
    let named = rows.flat_map(|row| row.split('`').skip(1).step_by(2));
    let folder = |s: &&str| s.ends_with('/') && !s.contains(char::is_whitespace);
    Some(
        named
            .filter(folder)
            .map(|s| s.trim_start_matches("./").to_string())
            .collect(),
    )
}

/// The folders of `src` (depth 1 and 2) ARCHITECTURE.md's folder table leaves out, and the
/// folders it names that `src` does not have.
pub fn table_mismatches(markdown: &str, src: &Path) -> Result<Vec<String>> {
    let Some(named) = table_folders(markdown) else {
        return Ok(vec![
            "no table with a \"Folder\" column (one row per folder)".into(),
        ]);
    };
    let mut out = Vec::new();
    for folder in folders(src)? {
        if !named.contains(&folder) {
            out.push(format!("folder `{folder}` has no row in the folder table"));
        }
    }
    for folder in named {
        if !src.join(&folder).is_dir() {
            out.push(format!(
                "the folder table names `{folder}`, which is not a folder"
            ));
        }
    }
    Ok(out)
}
