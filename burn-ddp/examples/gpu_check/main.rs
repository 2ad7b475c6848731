//! The multi-rank half of the GPU check (`cargo xtask gpu-bundle`, `run.sh`): one rank of a
//! world formed from the launch environment (two processes on one GPU, or one per GPU, or a
//! world of one), with every check compared against a result computed on the host, not against
//! the other rank.
//!
//! - `collectives` (`collectives.rs`): all-reduce (sum, avg, max, min) of f32, f16, bf16 and
//!   f64 (where burn's CUDA backend has f64) at several lengths against the host's reduction of
//!   every rank's input, broadcast from the last rank, all-gather, reduce-scatter in equal and
//!   in given parts; the input is left as it was. Before each operation, buffers of its output's
//!   size are filled with NaN and freed, so that the output, allocated from the same pool, holds
//!   NaN unless NCCL writes it: at world 1 the right result equals the input, and freed memory
//!   that held an earlier result would let a collective that wrote nothing pass.
//! - `syncbn` (`syncbn.rs`): `SyncBatchNorm` forward and backward on each rank's half of a batch
//!   against burn's `BatchNorm` on the whole batch (relative error at most 1e-5).
//! - `fsdp` (`fsdp.rs`): two linear layers wrapped in `Fsdp`, each strategy, one SGD step on
//!   each rank's rows against the unwrapped layers' step on the whole batch (the gathers and
//!   reduce-scatters inside forward and backward, through NCCL).
//! - `die` (`checks.rs`): rank 1 exits (0.5 s in) while rank 0 waits in an all-reduce; rank 0
//!   must fail within 10 s, and the group's failure record must name rank 1 as the culprit.
//! - `bandwidth` (`checks.rs`): 8 buckets of 32 MiB all-reduced in flight through the process
//!   group (the bucket path), every bucket's result checked, against a device-to-device copy of
//!   the same bytes (the row gives the ratio of their times).
//! - `precision` (`checks.rs`, one process): the f32 matmul against the exact product on the
//!   host. burn 0.22's CUDA matmul rounds f32 inputs to TF32 on tensor cores (cubek-matmul's
//!   `adjust_dtypes`; no setting turns that off) and picks its kernel by shape (autotune is not
//!   built in: burn-cubecl's `autotune` feature is off), so runs that multiply different batch
//!   shapes differ by about this error; run.sh sets those comparisons' limit from it.
//!
//! Each check prints `CHECK <name>: ok ...` or `CHECK <name>: FAILED ...`; the exit status is
//! non-zero if one failed. Needs a GPU (and burn-ddp's `nccl` feature). The verdicts
//! (`verdict.rs`) are tested without one: `cargo test -p burn-ddp --features nccl --example
//! gpu_check`.

mod checks;
mod collectives;
mod fsdp;
mod syncbn;
mod verdict;

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::tensor::{Device, Tensor};
use burn_ddp::ProcessGroup;
use clap::{Parser, Subcommand};

/// One rank of the GPU check's multi-rank part (world from RANK, WORLD_SIZE, MASTER_ADDR...).
#[derive(Debug, Parser)]
#[command(name = "gpu_check")]
struct Cli {
    /// The CUDA ordinal of this rank's GPU (default: LOCAL_RANK)
    #[arg(long, value_name = "N")]
    gpu: Option<usize>,
    #[command(subcommand)]
    check: Check,
}

#[derive(Debug, Subcommand)]
enum Check {
    /// All-reduce, broadcast and all-gather against the host's result
    Collectives {
        /// Lengths to check
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 7, 1_000_003])]
        sizes: Vec<usize>,
    },
    /// SyncBatchNorm on halves of a batch against BatchNorm on the whole batch
    Syncbn,
    /// Wrapped layers (each fsdp strategy) stepped on halves of a batch against the unwrapped
    /// layers on the whole batch
    Fsdp,
    /// Rank 1 dies while rank 0 waits in an all-reduce; rank 0 must record it as the culprit
    Die,
    /// Bucket all-reduce bandwidth against a device copy, results checked
    Bandwidth,
    /// The f32 matmul's error against the exact product (TF32), in this process alone
    Precision,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Says which library is missing instead of a loader panic at the first CUDA tensor.
    burn_ddp_nccl::check_libraries()?;
    let failed = match cli.check {
        Check::Precision => checks::precision(&Device::cuda(cli.gpu.unwrap_or(0)))?,
        check => in_group(check, cli.gpu)?,
    };
    if failed > 0 {
        bail!("{failed} check(s) failed");
    }
    Ok(())
}

/// Runs a check that needs the group the environment describes; returns how many failed.
fn in_group(check: Check, gpu: Option<usize>) -> Result<usize> {
    let group = Arc::new(ProcessGroup::from_env().context("forming the group")?);
    let device = Device::cuda(gpu.unwrap_or(group.local_rank()));
    let failed = match check {
        Check::Collectives { sizes } => collectives::collectives(&group, &device, &sizes)?,
        Check::Syncbn => syncbn::syncbn(&group, &device)?,
        Check::Fsdp => fsdp::fsdp(&group, &device)?,
        Check::Die => checks::die(&group, &device)?,
        Check::Bandwidth => checks::bandwidth(&group, &device)?,
        Check::Precision => checks::precision(&device)?,
    };
    if failed > 0 {
        eprintln!("rank {}: {failed} check(s) failed", group.rank());
    }
    Ok(failed)
}

/// Prints a check's outcome; returns 1 if it failed.
fn report(name: &str, outcome: std::result::Result<String, String>) -> usize {
    match outcome {
        Ok(detail) => {
            println!("CHECK {name}: ok {detail}");
            0
        }
        Err(detail) => {
            println!("CHECK {name}: FAILED {detail}");
            1
        }
    }
}

/// The tensor's values on the host (empty if they cannot be read back).
fn host<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .unwrap_or_default()
}
