//! A user's crate outside the workspace (`tests/user-crate`), written as the README says: its
//! `main.rs` is the README's whole program and a link to `burn-ddp/doc/whole_program.rs`
//! (burn-ddp's front-page example, which lies in the package so that it is published). Built offline
//! with the workspace's `Cargo.lock` copied in, in this test's target directory and with its
//! features (so only the crate itself compiles), then run alone and under
//! `burn-ddp-run --nproc 2`: every rank prints the same checksum and nothing warns.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::bins::{Build, run_bounded};

/// The line in README.md after which the whole program's code block starts.
const MARKER: &str = "<!-- the whole program: tests/user-crate/src/main.rs -->";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_readme_program_is_the_user_crate() {
    let readme = include_str!("../../../README.md");
    let main = include_str!("../../../tests/user-crate/src/main.rs");
    let after = readme
        .split_once(MARKER)
        .expect("the marker in README.md")
        .1;
    let block = after
        .split_once("```rust\n")
        .and_then(|(_, rest)| rest.split_once("\n```\n"))
        .expect("a rust code block after the marker")
        .0;
    assert_eq!(
        format!("{block}\n"),
        main,
        "README.md's whole program differs from tests/user-crate/src/main.rs"
    );
}

/// Builds the user crate; returns its binary.
fn build_user_crate() -> PathBuf {
    let Build {
        profile_dir,
        target_dir,
        profile,
    } = Build::of_this_test();
    let krate = workspace().join("tests/user-crate");
    std::fs::copy(workspace().join("Cargo.lock"), krate.join("Cargo.lock"))
        .expect("copying Cargo.lock");
    let mut cargo = Build::cargo();
    cargo
        .args([
            "build",
            "--offline",
            "--message-format=json",
            "--manifest-path",
        ])
        .arg(krate.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .args(["--profile", &profile]);
    if cfg!(feature = "wgpu") {
        cargo.args(["--features", "wgpu"]);
    }
    let out = run_bounded(cargo, Duration::from_secs(1200));
    assert!(
        out.status.success(),
        "building tests/user-crate failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every package but the crate itself should come from the workspace's build: name those
    // that did not (their features drifted from the workspace's, see the crate's Cargo.toml).
    let rebuilt: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["fresh"] == false)
        .filter_map(|m| m["target"]["name"].as_str().map(str::to_string))
        .filter(|name| name != "user-crate" && name != "user_crate")
        .collect();
    if !rebuilt.is_empty() {
        println!(
            "NOTE: building tests/user-crate compiled {} package(s) the workspace's build did not \
             share (features differ; see tests/user-crate/Cargo.toml): {}",
            rebuilt.len(),
            rebuilt.join(", ")
        );
    }
    profile_dir.join("user-crate")
}

/// The checksums the ranks printed, after checking that nothing warned or failed.
fn checksums(what: &str, out: &std::process::Output) -> Vec<String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    for line in stdout.lines().chain(stderr.lines()) {
        let lower = line.to_lowercase();
        for bad in ["warn", "error", "panic"] {
            assert!(
                !lower.contains(bad),
                "{what} printed {line:?}:\n{stdout}\n{stderr}"
            );
        }
    }
    stdout
        .lines()
        .filter_map(|l| {
            l.split_once("trained, parameter checksum ")
                .map(|(_, c)| c.to_string())
        })
        .collect()
}

#[test]
fn a_user_crate_trains_alone_and_on_two_ranks() {
    let bin = build_user_crate();
    let alone = run_bounded(Command::new(&bin), Duration::from_secs(300));
    assert_eq!(checksums("the user crate alone", &alone).len(), 1);

    let mut launch = Command::new(env!("CARGO_BIN_EXE_burn-ddp-run"));
    launch.args(["--nproc", "2"]).arg(&bin);
    let two = run_bounded(launch, Duration::from_secs(300));
    let sums = checksums("the user crate on 2 ranks", &two);
    assert_eq!(sums.len(), 2, "one checksum per rank");
    assert_eq!(sums[0], sums[1], "the replicas differ");
}
