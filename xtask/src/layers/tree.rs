//! The module tree of one crate's `src` folder, read from its files as they are now: which file
//! holds which module (`mod x;` declarations followed from `lib.rs`/`main.rs`, `#[path]`
//! honoured, files no `mod` declares placed by their path), each file walked by
//! [`collect`](super::collect).

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::collect::{Decl, collect};
use super::model::{Crate, ModPath, Scope, SourceFile};

/// Reads the crate whose root is `src/lib.rs` (else `src/main.rs`). Files under `src/bin/`
/// are crates of their own and are left out.
pub fn read_crate(src: &Path) -> Result<Crate> {
    let root = ["lib.rs", "main.rs"]
        .iter()
        .map(|n| src.join(n))
        .find(|p| p.is_file());
    let root = root.with_context(|| format!("{}: no lib.rs or main.rs", src.display()))?;
    let mut krate = Crate::default();
    let mut seen = HashSet::new();
    let mut queue = vec![(root.clone(), ModPath::new(), false, true)];
    while let Some((path, module, gated, mod_rs)) = queue.pop() {
        if !seen.insert(path.clone()) || krate.scopes.contains_key(&module) {
            continue;
        }
        for decl in read_file(&mut krate, src, &path, module, gated, false)? {
            let dir = mod_dir(&path, mod_rs).join(decl.inline.join("/"));
            let (file, mod_rs) = match decl.path_attr {
                Some(p) if decl.inline.is_empty() => (path.with_file_name(&p), is_mod_rs(&p)),
                Some(p) => (dir.join(&p), is_mod_rs(&p)),
                None => match dir.join(format!("{}.rs", decl.name)) {
                    f if f.is_file() => (f, false),
                    _ => (dir.join(&decl.name).join("mod.rs"), true),
                },
            };
            if file.is_file() {
                queue.push((file, decl.module, decl.gated, mod_rs));
            }
        }
    }
    for path in rust_files(src)? {
        let rel = rel_path(src, &path);
        if seen.contains(&path) || rel.starts_with("bin/") || rel == "main.rs" {
            continue;
        }
        let mut module: ModPath = rel
            .trim_end_matches(".rs")
            .split('/')
            .map(String::from)
            .collect();
        if module.last().is_some_and(|m| m == "mod") {
            module.pop();
        }
        if !krate.scopes.contains_key(&module) {
            read_file(&mut krate, src, &path, module, false, true)?;
        }
    }
    Ok(krate)
}

fn is_mod_rs(path: &str) -> bool {
    path.ends_with("mod.rs")
}

/// The folder a file's outline `mod x;` declarations are found in.
fn mod_dir(file: &Path, mod_rs: bool) -> PathBuf {
    let dir = file.parent().unwrap_or(Path::new(""));
    match file.file_stem() {
        Some(stem) if !mod_rs => dir.join(stem),
        _ => dir.to_path_buf(),
    }
}

fn rel_path(src: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(src).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// Every `.rs` file under `dir`, sorted.
pub fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Parses one file into `krate` as `module`; returns its outline `mod` declarations.
fn read_file(
    krate: &mut Crate,
    src: &Path,
    path: &Path,
    module: ModPath,
    gated: bool,
    undeclared: bool,
) -> Result<Vec<Decl>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let ast = syn::parse_file(&text).with_context(|| format!("parsing {}", path.display()))?;
    let file = krate.files.len();
    krate.scopes.insert(
        module.clone(),
        Scope {
            file,
            gated,
            ..Scope::default()
        },
    );
    let (refs, decls) = collect(krate, file, &module, &ast);
    krate.files.push(SourceFile {
        module,
        rel: rel_path(src, path),
        undeclared,
        refs,
    });
    Ok(decls)
}
