//! What the layer check knows of one crate: its modules (which file each lives in, what each
//! defines and imports) and every path each file names that may lead into the crate.

use std::collections::{HashMap, HashSet};

/// A module's path below `crate` (empty: the crate root).
pub type ModPath = Vec<String>;

/// A path as named somewhere, made absolute (below `crate`). A path that began with a plain
/// name (`device::Kind`, `Kind`) is `relative_at` the length of the scope it was written in:
/// it leads into the crate only if that name is a module, item or import of that scope.
#[derive(Debug, Clone)]
pub struct Named {
    /// The segments below `crate`.
    pub path: Vec<String>,
    /// For a path that began with a plain name: where that name sits in `path`.
    pub relative_at: Option<usize>,
}

/// One module, a file's own or an inline `mod x { ... }` in it.
#[derive(Debug, Default)]
pub struct Scope {
    /// Index of the file it lives in ([`Crate::files`]).
    pub file: usize,
    /// Its declaration, or an ancestor's, is `#[cfg(test)]` or `#[cfg(feature = "test-support")]`.
    pub gated: bool,
    /// Names of the items defined here.
    pub defined: HashSet<String>,
    /// Names imported by `use` (any visibility), and what they name.
    pub aliases: HashMap<String, Named>,
    /// Glob imports (`use x::*`).
    pub globs: Vec<Named>,
}

/// A path a file names: by `use`, in code, in a type, an attribute or a macro's tokens.
#[derive(Debug, Clone)]
pub struct Ref {
    /// Where it leads.
    pub named: Named,
    /// 1-based line.
    pub line: usize,
    /// As written, e.g. `super::b::*` or `crate::a::f`.
    pub text: String,
    /// In test code: a `#[cfg(test)]`/`#[test]` item or a test-gated module.
    pub test_code: bool,
}

/// One file of the crate.
#[derive(Debug)]
pub struct SourceFile {
    /// The module the file holds.
    pub module: ModPath,
    /// Its path below the `src` folder, with `/`.
    pub rel: String,
    /// Declared by no `mod`: placed by its path.
    pub undeclared: bool,
    /// The paths it names.
    pub refs: Vec<Ref>,
}

/// One crate's modules and files.
#[derive(Debug, Default)]
pub struct Crate {
    /// Every file read.
    pub files: Vec<SourceFile>,
    /// Every module, by path.
    pub scopes: HashMap<ModPath, Scope>,
}
