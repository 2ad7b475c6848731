//! The smoke test's harness: the workspace's programs built once (as `cargo test --workspace`
//! builds them), each started with a time bound and its output kept, scratch directories.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[allow(dead_code)]
#[path = "../../src/build.rs"]
mod build;

/// The longest any one program may take (a loaded 2-core machine, debug build of burn).
const LIMIT: Duration = Duration::from_secs(600);

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lies in the workspace")
}

/// The target directory of this test binary (`TARGET/<profile>/deps/smoke-<hash>`): the
/// programs are built there too, whatever `--target-dir` cargo test was given.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .nth(3)
        .expect("the test binary lies in TARGET/<profile>/deps")
        .to_path_buf()
}

/// Whether this build has burn's wgpu backend: `--features burn-ddp/wgpu` turns it on for every
/// package of the build, this test's `burn` included (feature unification).
fn burn_has_wgpu() -> bool {
    use burn::tensor::{Device, DeviceKind};
    /// Stands in for burn's `Device::wgpu` (a lazy constructor) where burn lacks it: an
    /// inherent associated function takes precedence over a trait's, so with the backend the
    /// call below is burn's and returns a `Device`.
    #[allow(dead_code)]
    trait WithoutWgpu {
        fn wgpu(_: DeviceKind) -> Option<Device> {
            None
        }
    }
    impl WithoutWgpu for Device {}
    trait IsDevice {
        fn is_device(&self) -> bool;
    }
    impl IsDevice for Device {
        fn is_device(&self) -> bool {
            true
        }
    }
    impl IsDevice for Option<Device> {
        fn is_device(&self) -> bool {
            false
        }
    }
    Device::wgpu(DeviceKind::DefaultDevice).is_device()
}

/// The `--features` the programs are built with: those of this build that change what the
/// workspace's programs are (see [`burn_has_wgpu`]).
fn features() -> Option<&'static str> {
    burn_has_wgpu().then_some("burn-ddp/wgpu")
}

/// Every binary and example of the workspace, by name, built once.
pub(crate) fn programs() -> &'static HashMap<String, PathBuf> {
    static BUILT: OnceLock<HashMap<String, PathBuf>> = OnceLock::new();
    BUILT.get_or_init(|| {
        let target = target_dir();
        let mut selection = build::WORKSPACE_PROGRAMS.to_vec();
        selection.extend([
            "--target-dir",
            target.to_str().expect("a UTF-8 target path"),
        ]);
        if let Some(features) = features() {
            selection.extend(["--features", features]);
        }
        let built = build::build_all(&selection, false)
            .unwrap_or_else(|e| panic!("building the workspace's programs: {e:#}"));
        built.into_iter().map(|b| (b.name, b.path)).collect()
    })
}

pub(crate) fn program(name: &str) -> Command {
    let path = programs()
        .get(name)
        .unwrap_or_else(|| panic!("cargo built no program {name}"));
    let mut cmd = Command::new(path);
    cmd.current_dir(workspace());
    cmd
}

pub(crate) fn xtask(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.args(args)
        .current_dir(workspace())
        .env("CARGO", build::cargo())
        .env("CARGO_TARGET_DIR", target_dir())
        .env(build::FEATURES_VAR, features().unwrap_or_default());
    cmd
}

/// What a finished program wrote, and how it ended.
pub(crate) struct Ran {
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Ran {
    pub(crate) fn describe(&self) -> String {
        format!(
            "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }

    /// Exits 0 and prints every one of `wanted` on stdout.
    pub(crate) fn succeeds_printing(&self, wanted: &[&str]) {
        assert_eq!(self.code, Some(0), "{}", self.describe());
        for w in wanted {
            assert!(
                self.stdout.contains(w),
                "{w:?} missing: {}",
                self.describe()
            );
        }
    }

    /// Exits 2 (clap's usage error) with `tip` on stderr.
    pub(crate) fn refuses_with(&self, tip: &str) {
        assert_eq!(self.code, Some(2), "{}", self.describe());
        assert!(
            self.stderr.contains(tip),
            "{tip:?} missing: {}",
            self.describe()
        );
    }

    /// The hex digests of every "parameters digest" line: one per rank.
    pub(crate) fn digests(&self) -> Vec<&str> {
        self.stdout
            .lines()
            .filter_map(|l| l.split("parameters digest ").nth(1))
            .map(str::trim)
            .collect()
    }
}

/// Runs `cmd` to its end, killed (and the test failed) after [`LIMIT`].
pub(crate) fn run(mut cmd: Command) -> Ran {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {what}: {e}"));
    let drain = |mut from: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = from.read_to_string(&mut text);
            text
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped")));
    let err = drain(Box::new(child.stderr.take().expect("piped")));
    let start = Instant::now();
    let deadline = start + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for a child") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let ran = Ran {
        code: status.and_then(|s| s.code()),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    };
    assert!(
        status.is_some(),
        "{what} ran past {LIMIT:?}: {}",
        ran.describe()
    );
    eprintln!("{:>7.1?} {what}", start.elapsed());
    ran
}

/// A scratch directory for one program's files, removed when dropped.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("burn-ddp-smoke-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating a scratch directory");
        Scratch(dir)
    }

    pub(crate) fn arg(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Tiny quickstart flags, with burn-train's files in `artifacts`.
pub(crate) fn tiny_training(artifacts: &Scratch) -> Vec<String> {
    let artifacts = artifacts.arg();
    ["--epochs", "1", "--samples", "64", "--batch-size", "16"]
        .into_iter()
        .map(String::from)
        .chain(["--quiet".into(), "--artifacts".into(), artifacts])
        .collect()
}
