//! Building the programs a task starts, through cargo's JSON messages.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// A program cargo built: target kind (`bin`, `example`, `test`), name and executable.
#[derive(Debug, Clone)]
pub struct Built {
    /// `bin`, `example` or `test`.
    pub kind: String,
    /// Target name.
    pub name: String,
    /// The executable.
    pub path: PathBuf,
}

/// The cargo running this task (`CARGO`), else `cargo` on the path. Not the toolchain's own
/// binary that built xtask: started outside rustup's proxy, it would run rustc without
/// `RUSTUP_TOOLCHAIN`, and rustup would then follow a dependency's own `rust-toolchain.toml`
/// (convert_case ships one naming 1.83.0) when xtask is run directly as `target/.../xtask`.
pub fn cargo() -> std::ffi::OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// Runs `cargo build` with `selection` (cargo's package, target and feature flags) and returns
/// the executables cargo reports.
pub fn build_all(selection: &[&str], release: bool) -> Result<Vec<Built>> {
    let mut cmd = Command::new(cargo());
    cmd.args(["build", "--message-format=json-render-diagnostics"]);
    cmd.args(selection);
    if release {
        cmd.arg("--release");
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running cargo build {selection:?}"))?;
    if !out.status.success() {
        bail!("building {selection:?} failed");
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let msg: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        if msg["reason"] == "compiler-artifact"
            && let Some(path) = msg["executable"].as_str()
        {
            let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
            exes.push(Built {
                kind: text(&msg["target"]["kind"][0]),
                name: text(&msg["target"]["name"]),
                path: PathBuf::from(path),
            });
        }
    }
    Ok(exes)
}

/// Builds one target (`selection` names it) and returns its executable.
pub fn build(selection: &[&str], release: bool) -> Result<PathBuf> {
    build_all(selection, release)?
        .pop()
        .map(|b| b.path)
        .with_context(|| format!("cargo built no executable for {selection:?}"))
}

/// What [`build_cpu_program`] builds: every binary and example of the workspace, the same
/// selection (and so the same features) as `cargo test --workspace`, so that tests, the smoke
/// test and every CPU task share one build of burn.
pub const WORKSPACE_PROGRAMS: [&str; 3] = ["--workspace", "--bins", "--examples"];

/// Cargo features (as `--features` takes them, e.g. `burn-ddp/wgpu`) that
/// [`build_cpu_program`] adds to [`WORKSPACE_PROGRAMS`]; unset, none. The smoke test sets it to
/// its own build's features, so that under `cargo test --workspace --features burn-ddp/wgpu`
/// the tasks it runs reuse that build instead of building burn again without them.
pub const FEATURES_VAR: &str = "BURN_DDP_XTASK_FEATURES";

/// The CPU executable of the binary or example `name` (binaries first), built with the
/// workspace's other programs (see [`WORKSPACE_PROGRAMS`] and [`FEATURES_VAR`]).
pub fn build_cpu_program(name: &str, release: bool) -> Result<PathBuf> {
    let features = std::env::var(FEATURES_VAR).unwrap_or_default();
    let mut selection = WORKSPACE_PROGRAMS.to_vec();
    if !features.trim().is_empty() {
        selection.extend(["--features", features.trim()]);
    }
    let built = build_all(&selection, release)?;
    for kind in ["bin", "example"] {
        if let Some(b) = built.iter().find(|b| b.kind == kind && b.name == name) {
            return Ok(b.path.clone());
        }
    }
    let mut names: Vec<&str> = built.iter().map(|b| b.name.as_str()).collect();
    names.sort_unstable();
    bail!(
        "the workspace has no binary or example named {name:?}; it has: {}",
        names.join(", ")
    )
}
