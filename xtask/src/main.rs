//! Project tasks, run as `cargo xtask <task>`: thin wrappers that build a program and start its
//! ranks through `burn_ddp::launch`. `cargo xtask --help` lists the tasks, `cargo xtask TASK
//! --help` their flags.
//!
//! - `multi-cpu [--nproc N] [--example NAME] [--release] [--max-restarts K] [-- ARGS]`: N CPU
//!   ranks (default 2) of a binary or example (`quickstart`, the default; `digits`;
//!   `hello_ddp`); a failed job is restarted up to K times. It takes every flag `burn-ddp-run`
//!   takes (`--nnodes`, `--log-dir`, ...: `burn_ddp::cli::LaunchArgs`).
//! - `multi-gpu [--nproc-per-node N] [--nnodes M --node-rank R --master-addr A --master-port P]`:
//!   one rank per visible GPU (`CUDA_VISIBLE_DEVICES` respected), examples built with CUDA.
//! - `bench-collectives [--world N] [--sizes 4K,64M,...] [--chunk 512K] [--spin-us 20]
//!   [--op sum|avg|max] [--transport auto|tcp|shm] [--dtype f32|bf16] [--gloo PYTHON]
//!   [--debug]`: the all-reduce benchmark on N rank processes (and PyTorch gloo's in the same
//!   run); with `--hosts N --nproc-per-host L --link-rate R`, on hosts of network namespaces:
//!   flat ring against hierarchical, in f32 and bf16.
//! - `bench-train [--epochs 3] [--repeats 3] [--batch-size 32] [--samples N] [--debug]`:
//!   quickstart step time of `DdpLearner` at world size 1 against burn's `Learner`, and
//!   samples/s at world size 2 against 1; with `--hosts N [--nproc-per-host L] --link-rate R`,
//!   on the 784-1024-1024-10 MLP: world 1, the same world on one host and across the hosts,
//!   with and without bf16 gradients.
//! - `gpu-bundle --out DIR`: stripped release binaries and `run.sh`, the one-command GPU check
//!   for a bare machine with a GPU, CUDA 13 and NCCL (no cargo, no network).
//! - `soak [--iters 5000]`: the long soak test (random all-reduces on 4 ranks, results checked,
//!   resident memory reported).
//! - `cluster [--hosts 2] [--nproc-per-host 1] [--link-rate 1gbit] -- PROGRAM ARGS`: PROGRAM on
//!   several hosts made of network namespaces on this machine (root), one launcher per host.
//! - `check-layers`: no import circle between sibling modules of any crate (a module and its
//!   own children are one unit), production code calls no test rig (`crate::testing`),
//!   ARCHITECTURE.md's folder table names every folder of `burn-ddp/src`; prints every circle
//!   with the uses that make it.
//!
//! The CPU tasks build every binary and example of the workspace in one `cargo build` (the
//! selection `cargo test --workspace` makes, so they share its build of burn); the benchmarks
//! build in the release profile unless given `--debug`.

mod bench_collectives;
mod bench_train;
mod build;
mod bundle;
mod cluster;
mod layers;
mod ranks;

use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

/// Project tasks: multi-rank runs and benchmarks.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// N CPU ranks of an example binary; a failed job is restarted up to --max-restarts times
    MultiCpu(ranks::MultiCpu),
    /// One rank per visible GPU (CUDA_VISIBLE_DEVICES respected), examples built with CUDA
    MultiGpu(ranks::MultiGpu),
    /// The all-reduce benchmark on N rank processes (release build)
    BenchCollectives(bench_collectives::BenchCollectives),
    /// DdpLearner's overhead at world 1 and scaling to world 2, on the quickstart; with --hosts,
    /// across hosts on a slow link (release build)
    BenchTrain(bench_train::BenchTrain),
    /// Stripped release binaries and run.sh: the one-command check for a bare GPU machine
    GpuBundle(bundle::GpuBundle),
    /// The long soak test: random all-reduces on 4 ranks, checked; resident memory reported
    Soak(Soak),
    /// A program on several hosts made of network namespaces here (root), one launcher each
    Cluster(cluster::ClusterTask),
    /// The import graph: no circle between sibling modules, no call of the test rig from
    /// production code, ARCHITECTURE.md's folder table complete
    CheckLayers(layers::CheckLayers),
}

/// The long soak test of burn-ddp's integration tests.
#[derive(Debug, Args)]
struct Soak {
    /// Random all-reduces
    #[arg(long, value_name = "N", default_value_t = 5000)]
    iters: usize,
}

/// Runs the ignored long soak test of burn-ddp's integration tests.
fn soak(task: Soak) -> Result<()> {
    let status = Command::new(build::cargo())
        .args(["test", "-p", "burn-ddp", "--test", "integration", "--"])
        .args(["--ignored", "--exact", "soak::soak_long", "--nocapture"])
        .env("BDDP_SOAK_ITERS", task.iters.to_string())
        .status()
        .context("running cargo test")?;
    if !status.success() {
        bail!("the soak test failed ({status})");
    }
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::MultiCpu(t) => ranks::multi_cpu(t),
        Task::MultiGpu(t) => ranks::multi_gpu(t),
        Task::BenchCollectives(t) => bench_collectives::bench_collectives(t),
        Task::BenchTrain(t) => bench_train::bench_train(t),
        Task::GpuBundle(t) => bundle::gpu_bundle(t),
        Task::Soak(t) => soak(t),
        Task::Cluster(t) => cluster::cluster(t),
        Task::CheckLayers(t) => layers::check_layers(t),
    }
}
