//! The quickstart of burn-ddp, the Rust counterpart of PyTorch's DDP tutorial: a synthetic,
//! deterministic dataset (`MyDataset`), an MLP (`MyModel`), cross-entropy, SGD. The binary is a
//! thin wrapper around [`run`].
//!
//! Modules: `data` (the synthetic set, the handwritten digits, batching), `model` (the MLP and
//! its accuracy), `training` (one quickstart run, alone or as a rank), `timed` (the timed run
//! every program of the package shares), `report` (what it measured: [`Report`]), `config` (the
//! options and command line).

#![warn(missing_docs)]

use std::sync::Arc;

pub mod charlm;
mod config;
mod data;
mod model;
mod report;
mod timed;
mod training;

pub use config::{
    BufferSyncFlag, CompressionFlag, Config, Flags, ModelKind, OptimizerFlag, ShardFlag,
};
pub use data::{
    CLASSES, DIGIT_PIXELS, Data, Digits, FEATURES, MyBatch, MyBatcher, MyDataset, MyItem,
};
pub use model::{MyModel, accuracy};
pub use report::{Report, mean_exposed_ms};
pub use training::{device, run};

use anyhow::{Context, Result};

/// Ends a binary: prints the error with its causes (also into torchrun's error file) and exits
/// with its code (128 + the signal for a stop by signal, see `burn_ddp::signals`; 1 for other
/// errors).
pub fn exit(result: Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let code = e
                .chain()
                .find_map(|c| c.downcast_ref::<burn_ddp::DdpError>())
                .map_or(1, burn_ddp::DdpError::exit_code);
            // Under torchrun, the error goes to its error file too (its "Root Cause" report).
            burn_ddp::elastic::record_error(&format_args!("{e:#}"));
            if code == 1 {
                eprintln!("Error: {e:#}");
            } else {
                eprintln!("{e:#}");
            }
            std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    }
}

/// Entry point of the binaries: forms the group from the environment, trains, and has rank 0
/// print the summary.
pub fn main_with(defaults: Config) -> Result<()> {
    // Wrong flags and `--help` end here, as clap does (exit codes 2 and 0).
    let cfg = defaults
        .parse_command_line(std::env::args_os())
        .unwrap_or_else(|e| e.exit());
    train_in_group(&cfg, |group| run(group, &cfg))
}

/// Forms the group from the environment, trains in it with `train`, and publishes what the run
/// measured: every rank its parameters' digest and memory figures (and `shown.report`'s
/// `.rank<r>` file), rank 0 the summary of `shown`'s epochs and batch size, `--report` and
/// `--params-out`. What every binary of the package ends with.
pub fn train_in_group(
    shown: &Config,
    train: impl FnOnce(Arc<burn_ddp::ProcessGroup>) -> Result<Report>,
) -> Result<()> {
    let group = Arc::new(burn_ddp::init_process_group().context("forming the process group")?);
    let report = train(group.clone())?;
    // Every rank's digest: equal digests show the replicas ended identical.
    println!("parameters digest {:016x}", report.digest());
    report.publish_rank(shown.report.as_deref(), group.rank())?;
    if group.rank() == 0 {
        report.publish(shown, group.world_size())?;
    }
    Ok(())
}
