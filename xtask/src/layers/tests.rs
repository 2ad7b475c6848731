//! The layer check on synthetic crates written to a temporary folder, and on the real tree.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::graph::{Circle, file_edges, node_name};
use super::tree::read_crate;
use super::{check_crate, check_workspace, table_mismatches, workspace_root};

/// A crate's `src` folder in a temporary folder, removed on drop.
struct Tree(PathBuf);

impl Tree {
    fn new(files: &[(&str, &str)]) -> Tree {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("xtask-layers-{}-{n}", std::process::id()));
        for (rel, text) in files {
            let path = dir.join(rel);
            std::fs::create_dir_all(path.parent().expect("a file has a folder")).expect("mkdir");
            std::fs::write(&path, text).expect("write");
        }
        Tree(dir)
    }

    fn src(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Each circle as `level: members`, and each of its edges as `a -> b @ site; site`.
fn describe(circles: &[Circle]) -> Vec<String> {
    let mut out = Vec::new();
    for c in circles {
        let members: Vec<&str> = c.members.iter().map(node_name).collect();
        out.push(format!("{}: {}", c.level.join("::"), members.join(", ")));
        for ((a, b), sites) in &c.edges {
            let sites: Vec<String> = sites.iter().map(|s| s.to_string()).collect();
            out.push(format!(
                "{} -> {} @ {}",
                node_name(a),
                node_name(b),
                sites.join("; ")
            ));
        }
    }
    out
}

/// `from -> to: text @ line` for every use between two files.
fn edges(src: &Path) -> Vec<String> {
    let krate = read_crate(src).expect("read");
    let mut out: Vec<String> = file_edges(&krate)
        .iter()
        .map(|e| {
            format!(
                "{} -> {}: {} @ {}",
                e.from.join("::"),
                e.to.join("::"),
                e.site.text,
                e.site.line
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_two_file_circle_is_found_with_both_use_lines() {
    let tree = Tree::new(&[
        ("lib.rs", "mod a;\nmod b;\n"),
        ("a.rs", "use crate::b::B;\npub struct A;\n"),
        (
            "b.rs",
            "pub struct B;\npub fn f() -> crate::a::A {\n    todo!()\n}\n",
        ),
    ]);
    let check = check_crate(tree.src()).expect("check");
    assert_eq!(
        describe(&check.circles),
        [
            ": a, b",
            "a -> b @ a.rs:1 uses crate::b::B",
            "b -> a @ b.rs:2 uses crate::a::A"
        ]
    );
}

#[test]
fn a_circle_through_a_parents_own_file_is_not_one_but_siblings_below_it_are() {
    let tree = Tree::new(&[
        ("lib.rs", "mod p;\n"),
        (
            "p/mod.rs",
            "mod c;\nmod d;\npub struct Config;\npub fn run() {\n    c::go();\n}\n",
        ),
        ("p/c.rs", "pub fn go() {\n    let _ = crate::p::d::D;\n}\n"),
        ("p/d.rs", "use super::Config;\npub struct D;\n"),
    ]);
    let check = check_crate(tree.src()).expect("check");
    assert_eq!(describe(&check.circles), Vec::<String>::new());
    let tree = Tree::new(&[
        ("lib.rs", "mod p;\n"),
        ("p/mod.rs", "mod c;\nmod d;\n"),
        ("p/c.rs", "mod inner;\npub struct C;\n"),
        (
            "p/c/inner.rs",
            "pub fn go() {\n    let _ = crate::p::d::D;\n}\n",
        ),
        ("p/d.rs", "use super::c::C;\npub struct D;\n"),
    ]);
    let check = check_crate(tree.src()).expect("check");
    assert_eq!(
        describe(&check.circles),
        [
            "p: c, d",
            "c -> d @ p/c/inner.rs:2 uses crate::p::d::D",
            "d -> c @ p/d.rs:1 uses super::c::C",
        ]
    );
}

#[test]
fn a_pub_use_reexport_is_followed_and_not_counted() {
    let tree = Tree::new(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
        ("a.rs", "pub use crate::b::Thing;\npub fn helper() {}\n"),
        (
            "b.rs",
            "pub struct Thing;\npub fn g() {\n    crate::a::helper();\n}\n",
        ),
        ("c.rs", "use crate::a::Thing;\n"),
    ]);
    let check = check_crate(tree.src()).expect("check");
    assert_eq!(describe(&check.circles), Vec::<String>::new());
    assert_eq!(
        edges(tree.src()),
        [
            "b -> a: crate::a::helper @ 3",
            "c -> b: crate::a::Thing @ 1"
        ]
    );
}

#[test]
fn a_braced_use_of_super_is_expanded() {
    let tree = Tree::new(&[
        ("lib.rs", "mod p;\n"),
        ("p/mod.rs", "mod a;\nmod b;\nmod c;\n"),
        ("p/a.rs", "pub struct X;\n"),
        ("p/b.rs", "pub struct Y;\n"),
        ("p/c.rs", "use super::{\n    a::X,\n    b::*,\n};\n"),
    ]);
    assert_eq!(
        edges(tree.src()),
        [
            "p::c -> p::a: super::a::X @ 2",
            "p::c -> p::b: super::b::* @ 3"
        ]
    );
}

#[test]
fn paths_in_function_bodies_and_macros_are_counted() {
    let tree = Tree::new(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
        ("a.rs", "pub fn f() -> u8 {\n    1\n}\n"),
        ("b.rs", "pub fn g() {\n    let _ = crate::a::f();\n}\n"),
        (
            "c.rs",
            "pub fn h() -> String {\n    format!(\"{}\", super::a::f())\n}\n",
        ),
    ]);
    assert_eq!(
        edges(tree.src()),
        ["b -> a: crate::a::f @ 2", "c -> a: super::a::f @ 2"]
    );
}

#[test]
fn a_local_named_as_a_child_module_is_no_use_of_it() {
    let tree = Tree::new(&[
        (
            "lib.rs",
            "mod output;\npub fn f(output: u8) -> u8 {\n    format!(\"{}\", output);\n    output\n}\n",
        ),
        ("output.rs", "pub fn g() -> u8 {\n    crate::f(1)\n}\n"),
    ]);
    assert_eq!(edges(tree.src()), ["output -> : crate::f @ 2"]);
}

#[test]
fn a_path_attribute_places_the_file() {
    let tree = Tree::new(&[
        ("lib.rs", "#[path = \"other/x_impl.rs\"]\nmod x;\nmod y;\n"),
        ("other/x_impl.rs", "use crate::y::Y;\npub struct X;\n"),
        ("y.rs", "use crate::x::X;\npub struct Y;\n"),
    ]);
    let check = check_crate(tree.src()).expect("check");
    assert_eq!(
        describe(&check.circles),
        [
            ": x, y",
            "x -> y @ other/x_impl.rs:1 uses crate::y::Y",
            "y -> x @ y.rs:1 uses crate::x::X"
        ]
    );
}

#[test]
fn production_code_calling_test_support_is_reported() {
    let tree = Tree::new(&[
        (
            "lib.rs",
            "#[cfg(feature = \"test-support\")]\npub mod testing;\nmod prod;\n#[cfg(test)]\nmod tests;\n",
        ),
        ("testing.rs", "pub fn hook() {}\n"),
        ("prod/hook.rs", "pub fn held() {}\n"),
        ("tests.rs", "fn t() {\n    crate::testing::hook();\n}\n"),
        (
            "prod.rs",
            "#[cfg(feature = \"test-support\")]\nmod hook;\npub fn f() {\n    #[cfg(feature = \"test-support\")]\n    hook::held();\n    #[cfg(feature = \"test-support\")]\n    crate::testing::hook();\n}\n\
             #[cfg(test)]\nmod t {\n    fn x() {\n        crate::testing::hook();\n    }\n}\n",
        ),
    ]);
    let check = check_crate(tree.src()).expect("check");
    assert_eq!(
        check.test_support_calls,
        ["prod.rs:7 uses crate::testing::hook, in testing (testing.rs), a test-gated module"]
    );
}

#[test]
fn a_folder_missing_from_the_table_is_reported() {
    let tree = Tree::new(&[("lib.rs", ""), ("store/c10d/wire.rs", ""), ("net/x.rs", "")]);
    let md = "# A\n\n| Layer | Folder |\n|---|---|\n| 1 | `store/` |\n| 2 | `gone/` (`x.rs`) |\n";
    assert_eq!(
        table_mismatches(md, tree.src()).expect("check"),
        [
            "folder `net/` has no row in the folder table",
            "folder `store/c10d/` has no row in the folder table",
            "the folder table names `gone/`, which is not a folder",
        ]
    );
    let no_table =
        table_mismatches("| a | b |\n|---|---|\n| `store/` | |\n", tree.src()).expect("check");
    assert_eq!(no_table.len(), 1, "{no_table:?}");
}

#[test]
fn a_clean_tree_passes() {
    let tree = Tree::new(&[
        (
            "lib.rs",
            "pub mod low;\npub mod high;\npub use high::Top;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        ),
        (
            "low/mod.rs",
            "mod base;\npub use base::Base;\nuse std::sync::Arc;\npub type Shared = Arc<u8>;\npub const LIMIT: usize = 4;\n",
        ),
        (
            "low/base.rs",
            "use super::LIMIT;\npub struct Base(pub [u8; LIMIT]);\n",
        ),
        (
            "high.rs",
            "use crate::low::{Base, Shared};\npub struct Top(pub Base, pub Shared);\n",
        ),
    ]);
    let check = check_crate(tree.src()).expect("check");
    assert_eq!(describe(&check.circles), Vec::<String>::new());
    assert_eq!(check.test_support_calls, Vec::<String>::new());
    assert_eq!(check.undeclared, Vec::<String>::new());
    let md = "| Folder | What |\n|---|---|\n| `low/` | the bottom |\n";
    assert_eq!(
        table_mismatches(md, tree.src()).expect("check"),
        Vec::<String>::new()
    );
}

#[test]
fn the_workspace_has_no_import_circles() {
    let report = check_workspace(&workspace_root()).expect("check");
    assert_eq!(report.problems, 0, "\n{}", report.text);
}
