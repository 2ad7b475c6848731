//! `burn-ddp-run`: starts N ranks of a program with the torchrun variables set, as `torchrun`
//! does. Everything after the program goes to the program untouched.
//!
//! ```text
//! burn-ddp-run --nproc 4 [--nnodes M --node-rank R --master-addr A --master-port P]
//!              [--max-restarts K] [--log-dir DIR [--tee]] [--local-ranks-filter 0,3]
//!              PROGRAM [ARGS...]
//! ```
//!
//! `burn-ddp-run --help` lists the flags (`burn_ddp::cli::LaunchArgs`, shared with
//! `cargo xtask multi-cpu|multi-gpu`).

use std::ffi::OsString;
use std::process::ExitCode;

use burn_ddp::cli::LaunchArgs;
use burn_ddp::launch::launch;
use clap::Parser;

/// Starts N ranks of PROGRAM, as torchrun does.
///
/// Each rank gets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT); the launcher serves the job's store, prefixes each output line
/// with its rank, and when a rank fails stops the others and names the one that failed first.
/// NCCL installed only as libnccl.so.2 (the pip wheel) is linked as libnccl.so for the ranks.
#[derive(Debug, Parser)]
#[command(name = "burn-ddp-run", version)]
#[command(mut_arg("nproc_per_node", |a| a.default_value("1")))]
struct Cli {
    #[command(flatten)]
    launch: LaunchArgs,
    /// The program each rank runs, then its arguments (passed on untouched)
    #[arg(
        required = true,
        trailing_var_arg = true,
        value_name = "PROGRAM [ARGS]"
    )]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (program, args) = cli
        .command
        .split_first()
        .expect("clap requires the program");
    match launch(&cli.launch.config(program, args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("burn-ddp-run: {e}");
            ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
        }
    }
}
