//! `quickstart`: trains `MyModel` on the synthetic `MyDataset`, alone or as one rank of many:
//!
//! ```text
//! cargo run -p quickstart -- --epochs 2
//! cargo xtask multi-cpu --nproc 2 --example quickstart -- --epochs 2
//! ```
//!
//! Flags (`quickstart --help` lists them with their defaults; `quickstart::Flags`):
//! `--epochs N` `--batch-size B` (per rank) `--lr X` `--seed S` `--device cpu|cuda`
//! `--save-model PATH` `--samples N` `--digits PATH` `--artifacts DIR` `--plain` (burn's own
//! `Learner`, one process) `--quiet` (no progress) `--report PATH` (timing as `key=value`)
//! `--checkpoint-dir DIR` (checkpoint every epoch, resume from DIR when a checkpoint is there)
//! `--checkpoint-every N` (also every N steps) `--no-desync-check` (to measure its cost).

fn main() -> std::process::ExitCode {
    quickstart::exit(quickstart::main_with(quickstart::Config::default()))
}
