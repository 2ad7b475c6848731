//! Smallest burn-ddp program. Alone it is a world of one; under a launcher it is N ranks:
//!
//! ```text
//! cargo xtask multi-cpu --nproc 3 --example hello_ddp
//! ```
//!
//! It takes no flags (`--help` says so).

use anyhow::Context;
use burn_ddp::{ReduceOp, init_process_group};
use clap::Parser;

/// Forms the process group from the launcher's environment, all-reduces the ranks and prints
/// who took part.
#[derive(Debug, Parser)]
#[command(name = "hello_ddp")]
struct Cli {}

fn main() -> anyhow::Result<()> {
    Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    // Under torchrun, the error goes to its error file too (its "Root Cause" report).
    run().inspect_err(|e| burn_ddp::elastic::record_error(&format_args!("{e:#}")))
}

fn run() -> anyhow::Result<()> {
    let group = init_process_group().context("forming the process group")?;
    let (rank, world) = (group.rank(), group.world_size());
    let sum = group
        .all_reduce(vec![rank as f32, 1.0], ReduceOp::Sum)
        .wait()
        .context("all-reduce")?;
    let names = group
        .all_gather(format!("rank {rank} on pid {}", std::process::id()).into_bytes())
        .wait()
        .context("all-gather")?;
    println!(
        "rank {rank} of {world}: sum of ranks {} over {} ranks",
        sum[0], sum[1]
    );
    if rank == 0 {
        for n in names {
            println!("  {}", String::from_utf8_lossy(&n));
        }
    }
    Ok(())
}
