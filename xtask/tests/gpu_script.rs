//! The GPU check's script (`gpu-bundle`'s run.sh) on this machine, which has no GPU, in bundles
//! of stand-in binaries (building the real bundle takes a release build of the CUDA stack): a
//! stand-in `nvidia-smi` that lists a GPU, and libraries under the names the check loads (a copy
//! of libz: the check loads them, it calls nothing in them), laid out as the GPU machine's image
//! has them (NVRTC in a CUDA 13 Python wheel, NCCL as `libnccl.so.2`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The longest one run of the script may take here (its stand-ins return at once).
const LIMIT: Duration = Duration::from_secs(120);

/// A bundle (run.sh and stand-in binaries), a folder for a stand-in nvidia-smi, and a stand-in
/// GPU machine's libraries, in a scratch directory removed when dropped.
struct Bundle {
    dir: PathBuf,
}

/// What one run of the script printed, how it ended, how long it took.
struct Ran {
    code: Option<i32>,
    stdout: String,
    took: Duration,
}

impl Ran {
    fn describe(&self) -> String {
        format!(
            "exit {:?} after {:?}\n{}",
            self.code, self.took, self.stdout
        )
    }

    fn prints(&self, wanted: &[&str]) {
        for w in wanted {
            assert!(self.stdout.contains(w), "{w:?}: {}", self.describe());
        }
    }
}

fn write_exe(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("a parent")).unwrap();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A real shared library to stand in for CUDA's, NCCL's and NVRTC's.
fn some_library() -> PathBuf {
    [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib64",
        "/usr/lib64",
    ]
    .iter()
    .map(|d| Path::new(d).join("libz.so.1"))
    .find(|p| p.is_file())
    .expect("libz.so.1 in a system library folder")
}

impl Bundle {
    /// The bundle with stand-ins that print like the real binaries without a GPU.
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("bddp-gpu-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let bundle = Bundle { dir };
        let bin = bundle.dir.join("bundle/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/gpu-check.sh");
        std::fs::copy(&script, bundle.dir.join("bundle/run.sh")).unwrap();
        write_exe(
            &bin.join("quickstart"),
            "#!/bin/sh\necho 'libcuda not found (looked for [\"libcuda.so\"])' >&2\nexit 1\n",
        );
        write_exe(
            &bin.join("nccl-tests"),
            "#!/bin/sh\necho 'NCCL world 1 all_gather F32 n=1: ok'\n",
        );
        // The multi-rank checks pass, bandwidth fails; each says what it was started with.
        write_exe(
            &bin.join("gpu-check"),
            "#!/bin/sh\necho \"started with LD_LIBRARY_PATH=$LD_LIBRARY_PATH\"\n\
             for d in $(echo \"$LD_LIBRARY_PATH\" | tr : ' '); do\n\
             [ -e \"$d/libnccl.so\" ] && echo \"libnccl.so in $d\"; done\n\
             if [ \"$1\" = bandwidth ]; then echo \"CHECK bandwidth: FAILED stand-in\"; exit 1; fi\n\
             echo \"CHECK $1 rank $RANK of $WORLD_SIZE: ok stand-in\"\n",
        );
        bundle
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bundle/bin").join(name)
    }

    /// The stand-in GPU machine: nvidia-smi listing one GPU, libcuda, NCCL's wheel, NVRTC's
    /// wheel (found through python3), CUDA's headers.
    fn gpu_machine(&self) {
        write_exe(
            &self.dir.join("path/nvidia-smi"),
            "#!/bin/sh\necho 'GPU 0: Stand-in GPU (UUID: GPU-0)'\n",
        );
        let lib = some_library();
        for (folder, name) in [
            ("driver", "libcuda.so.1"),
            ("nccl", "libnccl.so.2"),
            ("site/nvidia/cu13/lib", "libnvrtc.so.13"),
        ] {
            std::fs::create_dir_all(self.dir.join(folder)).unwrap();
            std::fs::copy(&lib, self.dir.join(folder).join(name)).unwrap();
        }
        std::fs::write(
            self.dir
                .join("site/nvidia/cu13/lib/libnvrtc-builtins.so.13.0"),
            b"",
        )
        .unwrap();
        std::fs::create_dir_all(self.dir.join("cuda/include")).unwrap();
        std::fs::write(self.dir.join("cuda/include/cuda_fp16.h"), b"").unwrap();
    }

    /// Runs `bash run.sh` with `vars` set (and the stand-in GPU machine's, if made), logs to
    /// OUT=<dir>/out.
    fn run(&self, vars: &[(&str, &str)]) -> Ran {
        let path = format!(
            "{}:{}",
            self.dir.join("path").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("bash");
        cmd.arg(self.dir.join("bundle/run.sh"))
            .env("PATH", path)
            .env("OUT", self.out())
            .env("LD_LIBRARY_PATH", self.dir.join("driver"))
            .env("BURN_DDP_NCCL_DIR", self.dir.join("nccl"))
            .env("PYTHONPATH", self.dir.join("site"))
            .env("CUDA_PATH", self.dir.join("cuda"))
            .env_remove("BURN_DDP_GPU_CHECK_ALLOW_NO_GPU")
            .env_remove("BURN_DDP_GPU_CHECK_BUDGET")
            .envs(vars.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let start = Instant::now();
        let mut child = cmd.spawn().expect("starting bash");
        let mut out = child.stdout.take().expect("piped");
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut out, &mut text);
            text
        });
        let status = loop {
            if let Some(status) = child.try_wait().expect("waiting for bash") {
                break status;
            }
            if start.elapsed() > LIMIT {
                let _ = child.kill();
                panic!("run.sh ran past {LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ran {
            code: status.code(),
            stdout: reader.join().unwrap_or_default(),
            took: start.elapsed(),
        }
    }

    fn out(&self) -> PathBuf {
        self.dir.join("out")
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.out().join(name)).unwrap_or_default()
    }
}

impl Drop for Bundle {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Without any GPU the check fails, unless told that none is expected: then it checks that the
/// quickstart fails cleanly without CUDA (a loader panic fails it) and exits 0.
#[test]
fn without_a_gpu_the_check_fails_unless_none_is_expected() {
    let bundle = Bundle::new("none");
    let ran = bundle.run(&[]);
    assert_eq!(ran.code, Some(1), "{}", ran.describe());
    ran.prints(&[
        "no GPU",
        "GPUs visible",
        "FAILED",
        "BURN_DDP_GPU_CHECK_ALLOW_NO_GPU=1",
    ]);

    let allowed = [("BURN_DDP_GPU_CHECK_ALLOW_NO_GPU", "1")];
    let ran = bundle.run(&allowed);
    assert_eq!(ran.code, Some(0), "{}", ran.describe());
    ran.prints(&["no GPU", "clean error: libcuda not found", "failed: 0"]);

    write_exe(
        &bundle.bin("quickstart"),
        "#!/bin/sh\necho \"thread 'main' panicked at cudarc: Unable to dynamically load\" >&2\nexit 101\n",
    );
    let ran = bundle.run(&allowed);
    assert_eq!(ran.code, Some(1), "{}", ran.describe());
    ran.prints(&["FAILED   panicked"]);
}

/// With a GPU listed, every row is printed as it is recorded (before the closing table), the
/// logs stay under OUT (both ranks' output, prefixed), NVRTC is found in a CUDA 13 wheel and its
/// folder, like NCCL's link, is on the binaries' LD_LIBRARY_PATH, and a failed check fails the run.
#[test]
fn with_a_gpu_rows_come_as_they_go_and_the_logs_stay_in_out() {
    let bundle = Bundle::new("rows");
    bundle.gpu_machine();
    let ran = bundle.run(&[]);
    assert_eq!(ran.code, Some(1), "{}", ran.describe());
    let nvrtc = bundle.dir.join("site/nvidia/cu13/lib");
    ran.prints(&[
        "GPUs visible",
        "preflight: NVRTC (libnvrtc)",
        &format!("{}/libnvrtc.so.13", nvrtc.display()),
        "collectives rank 0 of 2",
        "collectives rank 0 of 1",
        "FAILED   stand-in",
        "failed: 3",
    ]);
    let summary = ran
        .stdout
        .find("=== burn-ddp GPU check: summary")
        .expect("a summary");
    for row in [
        "GPUs visible",
        "NCCL world 1",
        "bandwidth",
        "die rank 0 of 2",
    ] {
        let first = ran.stdout.find(row).unwrap_or(usize::MAX);
        assert!(
            first < summary,
            "{row:?} only in the summary: {}",
            ran.describe()
        );
    }
    let (log, rows) = (bundle.log("gpu-check.log"), bundle.log("summary.txt"));
    assert!(
        rows.contains("bandwidth") && rows.contains("failed: 3"),
        "{rows}"
    );
    for line in [
        "[coll-0] CHECK collectives",
        "[coll-1] CHECK collectives",
        "[t] NCCL",
    ] {
        assert!(log.contains(line), "{line:?} missing from the log: {log}");
    }
    let path = log
        .lines()
        .find_map(|l| l.strip_prefix("[coll1] started with LD_LIBRARY_PATH="))
        .unwrap_or_else(|| panic!("no LD_LIBRARY_PATH in the log: {log}"));
    let dirs: Vec<&str> = path.split(':').collect();
    assert!(dirs.contains(&nvrtc.to_str().unwrap()), "{path}");
    assert!(
        log.contains("[coll1] libnccl.so in "),
        "no libnccl.so link on {path}: {log}"
    );
}

/// Preflight names the missing library and where it looked (the wheels' folders included)
/// before any binary starts.
#[test]
fn preflight_names_what_is_missing_and_where_it_looked() {
    let bundle = Bundle::new("preflight");
    bundle.gpu_machine();
    std::fs::remove_file(bundle.dir.join("site/nvidia/cu13/lib/libnvrtc.so.13")).unwrap();
    let ran = bundle.run(&[]);
    assert_eq!(ran.code, Some(1), "{}", ran.describe());
    ran.prints(&[
        "preflight: NVRTC (libnvrtc)",
        "libnvrtc.so.13 not found in:",
        "nvidia/cu13/lib",
        "preflight failed",
    ]);
    assert!(
        !bundle.log("gpu-check.log").contains("started with"),
        "a binary started after a failed preflight"
    );
    std::fs::remove_file(bundle.dir.join("driver/libcuda.so.1")).unwrap();
    let ran = bundle.run(&[]);
    assert_eq!(ran.code, Some(1), "{}", ran.describe());
    ran.prints(&["preflight: CUDA driver (libcuda)", "libcuda.so.1 not found"]);
}

/// The whole check ends within its budget: a step that hangs is stopped at what is left, and
/// the steps after it are failed rows, not silence.
#[test]
fn the_budget_bounds_the_whole_check() {
    let bundle = Bundle::new("budget");
    bundle.gpu_machine();
    write_exe(&bundle.bin("gpu-check"), "#!/bin/sh\nexec sleep 60\n");
    let ran = bundle.run(&[("BURN_DDP_GPU_CHECK_BUDGET", "8")]);
    assert_eq!(ran.code, Some(1), "{}", ran.describe());
    assert!(ran.took < Duration::from_secs(30), "{}", ran.describe());
    ran.prints(&["timed out after", "not run: the 8s budget is spent"]);
}
