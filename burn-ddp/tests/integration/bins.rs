//! The workspace's example programs for tests that run them as a user would (under mpirun,
//! srun, torchrun): built once per test process, with the test binary's own profile and target
//! directory, and run with a time bound that kills the whole process group.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The path of binary `bin` of workspace package `package`, built now if this test process has
/// not built it yet, with the same profile as this test binary. It builds every target of the
/// workspace (`cargo build --workspace --all-targets`), with burn-ddp's optional features this
/// test binary was built with (see [`FEATURES`]): that is the feature unification of
/// `cargo test --workspace --features burn-ddp/wgpu` (CI's command), so there only the binaries
/// themselves are compiled, whereas other features or `cargo build -p PACKAGE` would rebuild
/// the burn stack (minutes on 2 cores). Panics with cargo's output when the build fails.
pub fn example_bin(package: &str, bin: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(path) = built.get(bin) {
        return path.clone();
    }
    let Build {
        profile_dir,
        target_dir,
        profile,
    } = Build::of_this_test();
    let features: Vec<&str> = FEATURES
        .iter()
        .filter(|(_, on)| *on)
        .map(|(f, _)| *f)
        .collect();
    let started = Instant::now();
    let out = Build::cargo()
        .args([
            "build",
            "--quiet",
            "--workspace",
            "--all-targets",
            "--profile",
        ])
        .arg(&profile)
        .args(features.iter().flat_map(|f| ["--features", f]))
        .arg("--target-dir")
        .arg(&target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .output()
        .expect("running cargo build");
    assert!(
        out.status.success(),
        "cargo build --workspace --all-targets {features:?} (for {package}'s {bin}) failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("built {bin} in {:.1?}", started.elapsed());
    let path = profile_dir.join(bin);
    assert!(path.is_file(), "cargo built no {}", path.display());
    built.insert(bin.to_string(), path.clone());
    path
}

/// Where and how this test binary was built.
pub struct Build {
    /// `target/<profile dir>`, where binaries land.
    pub profile_dir: PathBuf,
    /// The target directory.
    pub target_dir: PathBuf,
    /// The cargo profile (`dev` for `target/debug`).
    pub profile: String,
}

impl Build {
    /// This test binary's, which is `target/<profile>/deps/integration-<hash>`.
    pub fn of_this_test() -> Self {
        let exe = std::env::current_exe().expect("the test binary's path");
        let profile_dir = exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("the test binary lies in target/<profile>/deps");
        let target_dir = profile_dir
            .parent()
            .expect("target/<profile>")
            .to_path_buf();
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev",
            Some(other) => other,
        };
        Build {
            profile_dir: profile_dir.to_path_buf(),
            target_dir,
            profile: profile.to_string(),
        }
    }

    /// The cargo that runs these tests.
    pub fn cargo() -> Command {
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
    }
}

/// burn-ddp's optional features that change what the workspace builds, as `cargo --features`
/// names, each with whether this test binary has it (`cargo test --workspace --features
/// burn-ddp/wgpu` builds the tests with `wgpu`; the programs must be built the same way).
const FEATURES: [(&str, bool); 2] = [
    ("burn-ddp/wgpu", cfg!(feature = "wgpu")),
    ("burn-ddp/nccl", cfg!(feature = "nccl")),
];

/// Runs `cmd` in its own process group with stdout and stderr captured; past `limit` the whole
/// group (the launcher and every rank it started) is killed and the test fails with what the
/// programs printed so far.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("waiting for the child"),
        Err(_) => {
            if let Some(group) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            }
            let out = rx
                .recv_timeout(Duration::from_secs(10))
                .map(|o| o.expect("waiting for the child"));
            let shown = out.map_or_else(
                |_| "(no output)".to_string(),
                |o| {
                    format!(
                        "{}{}",
                        String::from_utf8_lossy(&o.stdout),
                        String::from_utf8_lossy(&o.stderr)
                    )
                },
            );
            panic!("{cmd:?} ran past {limit:?} and was killed; it printed:\n{shown}");
        }
    }
}
