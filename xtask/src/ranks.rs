//! `multi-cpu` and `multi-gpu`: an example's ranks on this machine's CPUs or GPUs, started
//! through `burn_ddp::launch` with the launcher flags `burn-ddp-run` has.

use std::ffi::OsString;
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn_ddp::cli::LaunchArgs;
use burn_ddp::launch::launch;
use clap::Args;

use crate::build::{build, build_cpu_program};

/// What `multi-cpu` and `multi-gpu` start: the launcher's flags, the program, its profile and
/// its ranks' arguments (the help texts are `multi-cpu`'s; `multi-gpu` words its own).
#[derive(Debug, Args)]
struct Ranks {
    #[command(flatten)]
    launch: LaunchArgs,
    /// The binary or example to run: quickstart, digits, hello_ddp, ...
    #[arg(long, value_name = "NAME", default_value = "quickstart")]
    example: String,
    /// Build in the release profile (default: dev)
    #[arg(long)]
    release: bool,
    /// Arguments for every rank, after `--`
    #[arg(last = true, value_name = "ARGS")]
    args: Vec<OsString>,
}

/// N CPU ranks of an example binary; a failed job is restarted up to --max-restarts times.
#[derive(Debug, Args)]
#[command(mut_arg("nproc_per_node", |a| a.default_value("2")))]
pub struct MultiCpu {
    #[command(flatten)]
    ranks: Ranks,
}

/// One rank per visible GPU (CUDA_VISIBLE_DEVICES respected), examples built with CUDA.
#[derive(Debug, Args)]
#[command(
    mut_arg("nproc_per_node", |a| {
        a.help("Ranks on this node, one per GPU [default: one per visible GPU]")
    }),
    mut_arg("example", |a| {
        a.help("The binary to run: quickstart, digits (trained on the GPU), or another")
    }),
    mut_arg("args", |a| {
        a.help("Arguments for every rank, after `--` (quickstart and digits get `--device cuda`)")
    })
)]
pub struct MultiGpu {
    #[command(flatten)]
    ranks: Ranks,
}

/// Runs `multi-cpu`.
pub fn multi_cpu(MultiCpu { ranks: task }: MultiCpu) -> Result<()> {
    let exe = build_cpu_program(&task.example, task.release)?;
    launch(&task.launch.config(exe, task.args)).context("multi-cpu run failed")
}

/// GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set, else what `nvidia-smi -L` lists.
fn visible_gpus() -> usize {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v
            .split(',')
            .map(str::trim)
            .take_while(|d| !d.is_empty() && !d.starts_with('-'))
            .count();
    }
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

/// Runs `multi-gpu`.
pub fn multi_gpu(MultiGpu { ranks: task }: MultiGpu) -> Result<()> {
    let visible = visible_gpus();
    let nproc = task.launch.nproc_per_node.unwrap_or(visible);
    if nproc == 0 || nproc > visible {
        bail!(
            "{nproc} processes asked for, {visible} GPU(s) visible (CUDA_VISIBLE_DEVICES or \
             nvidia-smi): one process per GPU; without GPUs use `cargo xtask multi-cpu`"
        );
    }
    let example = task.example.as_str();
    let on_gpu = matches!(example, "quickstart" | "digits");
    // The quickstart package's binaries train on GPUs with its `cuda` feature.
    let exe = if on_gpu {
        let selection = ["-p", "quickstart", "--bin", example, "--features", "cuda"];
        build(&selection, task.release)?
    } else {
        build(&["--bin", example], task.release)?
    };
    let mut rank_args = task.args.clone();
    if on_gpu && !rank_args.iter().any(|a| a == "--device") {
        rank_args.extend(["--device".into(), "cuda".into()]);
    }
    let mut cfg = task.launch.config(exe, rank_args);
    cfg.nproc_per_node = nproc;
    launch(&cfg).context("multi-gpu run failed")
}
