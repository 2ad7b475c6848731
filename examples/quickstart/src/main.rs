//! `quickstart`: trains `MyModel` on the synthetic `MyDataset`, alone or as one rank of many:
//!
//! ```text
//! cargo run -p quickstart -- --epochs 2
//! cargo xtask multi-cpu --nproc 2 --example quickstart -- --epochs 2
//! ```
//!
//! Flags: `--epochs N` `--batch-size B` (per rank) `--lr X` `--seed S` `--device cpu|cuda`
//! `--save-model PATH` `--samples N` `--digits PATH` `--artifacts DIR` `--plain` (burn's own
//! `Learner`, one process) `--quiet` (no progress) `--report PATH` (timing as `key=value`)
//! `--checkpoint-dir DIR` (checkpoint every epoch, resume from DIR when a checkpoint is there)
//! `--checkpoint-every N` (also every N steps) `--no-desync-check` (to measure its cost).

fn main() -> anyhow::Result<()> {
    // Under torchrun, the error goes to its error file too (its "Root Cause" report).
    quickstart::main_with(quickstart::Config::default())
        .inspect_err(|e| burn_ddp::elastic::record_error(&format_args!("{e:#}")))
}
