//! `gpu-bundle`: stripped release binaries and `run.sh`, the one-command GPU check for a bare
//! machine with a GPU, CUDA 13 and NCCL (no cargo, no network): the NCCL crate's tests (world 1),
//! `gpu_check` (burn-ddp's example: the collectives at worlds 1 and 2, a dead rank, bandwidth,
//! SyncBatchNorm, the matmul's precision) and the quickstart. run.sh (`assets/gpu-check.sh`)
//! finds the libraries (system, CUDA toolkit or NVIDIA's Python wheels), puts their folders on
//! `LD_LIBRARY_PATH`, prints each row as it is known, keeps its logs (under `$OUT` when set),
//! ends within `BURN_DDP_GPU_CHECK_BUDGET` seconds (480), and fails without a GPU unless
//! `BURN_DDP_GPU_CHECK_ALLOW_NO_GPU=1`; `xtask/tests/gpu_script.rs` runs it with stand-ins.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::build::build_all;

/// Stripped release binaries of the GPU checks plus run.sh, for a bare GPU machine.
#[derive(Debug, Args)]
pub struct GpuBundle {
    /// Directory to write the bundle to
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

/// Largest bundle `gpu-bundle` may produce.
const BUNDLE_LIMIT: u64 = 60 << 20;

fn run_tool(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn dir_size(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        total += if e.file_type()?.is_dir() {
            dir_size(&e.path())?
        } else {
            e.metadata()?.len()
        };
    }
    Ok(total)
}

/// Runs `gpu-bundle`.
pub fn gpu_bundle(task: GpuBundle) -> Result<()> {
    let out = task.out;
    // One build for all three, so burn is compiled once with one feature set.
    let exes = build_all(
        &[
            "-p",
            "burn-ddp-nccl",
            "-p",
            "quickstart",
            "-p",
            "burn-ddp",
            "--features",
            "burn-ddp-nccl/cuda,quickstart/cuda,burn-ddp/nccl,burn-ddp/cli",
            "--test",
            "nccl",
            "--bin",
            "quickstart",
            "--example",
            "gpu_check",
        ],
        true,
    )?;
    let find = |name: &str| {
        exes.iter()
            .find(|b| b.name == name)
            .map(|b| b.path.clone())
            .with_context(|| format!("cargo built no {name}"))
    };
    let (tests, quickstart, check) = (find("nccl")?, find("quickstart")?, find("gpu_check")?);
    let bin = out.join("bin");
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::create_dir_all(&bin)?;
    for (from, name) in [
        (&tests, "nccl-tests"),
        (&quickstart, "quickstart"),
        (&check, "gpu-check"),
    ] {
        let to = bin.join(name);
        std::fs::copy(from, &to).with_context(|| format!("copying {}", from.display()))?;
        run_tool(Command::new("strip").arg(&to))?;
    }
    if dir_size(&bin)? > BUNDLE_LIMIT {
        for e in std::fs::read_dir(&bin)? {
            run_tool(Command::new("xz").args(["-9", "-T0"]).arg(e?.path()))?;
        }
    }
    let script = out.join("run.sh");
    std::fs::write(&script, include_str!("../assets/gpu-check.sh"))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    let total = dir_size(&out)?;
    println!(
        "gpu-bundle: {} ({:.1} MiB); on the GPU machine run: bash {}/run.sh (logs under $OUT \
         when set)",
        out.display(),
        total as f64 / (1 << 20) as f64,
        out.display()
    );
    if total > BUNDLE_LIMIT {
        bail!("the bundle is {total} bytes, above the {BUNDLE_LIMIT}-byte limit");
    }
    Ok(())
}
