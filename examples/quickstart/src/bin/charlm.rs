//! `charlm`: a small decoder-only transformer trained with `DdpLearner` as a character-level
//! language model on a bundled public-domain text (Cicero, `data/README.md`), with AdamW,
//! warm-up and gradient clipping (`quickstart::charlm`):
//!
//! ```text
//! cargo run --release -p quickstart --bin charlm -- --epochs 1
//! burn-ddp-run --nproc 2 target/release/charlm --epochs 1
//! burn-ddp-run --nproc 2 target/release/charlm --epochs 1 --fsdp full
//! burn-ddp-run --nproc 4 target/release/charlm --epochs 1 --fsdp full --checkpoint-dir ckpt
//! burn-ddp-run --nproc 2 target/release/charlm --epochs 2 --fsdp full --checkpoint-dir ckpt
//! ```
//!
//! `--fsdp full|grad-op|none` wraps each transformer block in burn-ddp's `Fsdp` (fully sharded
//! data parallelism, `docs/guide/fsdp.md`). Gradients are clipped by the global norm of the
//! whole model (`DdpLearner::clip_grad_norm`), wrapped or not.

use std::path::PathBuf;

use burn_ddp::fsdp::ShardingStrategy;
use clap::Parser;
use clap::builder::{PossibleValuesParser, RangedU64ValueParser, TypedValueParser};
use quickstart::ShardFlag;
use quickstart::charlm::{LmConfig, LmOptimizer, train};

/// A decoder-only transformer on Cicero, character by character, data-parallel.
#[derive(Debug, Parser)]
#[command(name = "charlm")]
struct Flags {
    /// Epochs
    #[arg(long, default_value_t = LmConfig::default().epochs,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    epochs: usize,
    /// Sequences per batch, per rank
    #[arg(long, default_value_t = LmConfig::default().batch_size,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    batch_size: usize,
    /// Characters per sequence
    #[arg(long, default_value_t = LmConfig::default().seq_len,
          value_parser = RangedU64ValueParser::<usize>::new().range(2..=1024))]
    seq_len: usize,
    /// Dropout probability in every block
    #[arg(long, default_value_t = LmConfig::default().dropout, value_parser = probability)]
    dropout: f64,
    /// Peak learning rate (AdamW, reached after the warm-up)
    #[arg(long, default_value_t = LmConfig::default().lr, value_parser = positive)]
    lr: f64,
    /// Warm-up steps
    #[arg(long, default_value_t = LmConfig::default().warmup,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    warmup: usize,
    /// Job seed (initialisation and shuffling; dropout from it and the rank)
    #[arg(long, default_value_t = LmConfig::default().seed)]
    seed: u64,
    /// burn's own Learner instead of DdpLearner (one process; to measure DdpLearner's overhead)
    #[arg(long)]
    plain: bool,
    /// No progress output
    #[arg(long)]
    quiet: bool,
    /// Where rank 0 writes timing as key=value
    #[arg(long, value_name = "PATH")]
    report: Option<PathBuf>,
    /// Where rank 0 writes the final parameters as raw little-endian f32
    #[arg(long, value_name = "PATH")]
    params_out: Option<PathBuf>,
    /// Width of the model
    #[arg(long, default_value_t = LmConfig::default().d_model,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    d_model: usize,
    /// Attention heads (dividing --d-model)
    #[arg(long, default_value_t = LmConfig::default().heads,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    heads: usize,
    /// Transformer blocks
    #[arg(long, default_value_t = LmConfig::default().layers,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    layers: usize,
    /// Shard the optimizer's work across the ranks (ZeRO): optimizer state, or optimizer state
    /// and gradients
    #[arg(
        long,
        value_name = "WHAT",
        default_value = "none",
        conflicts_with = "plain"
    )]
    shard: ShardFlag,
    /// Wrap each transformer block in burn-ddp's Fsdp: parameters, gradients and optimizer
    /// state sharded (full: the gathered blocks dropped after forward, gradient checkpointing
    /// on; grad-op: kept until backward), or none (whole blocks, reduced inside backward)
    #[arg(long, value_name = "STRATEGY", conflicts_with = "plain", value_parser = strategy())]
    fsdp: Option<ShardingStrategy>,
    /// The optimizer: AdamW (weight decay 0.01) or SGD with momentum 0.9
    #[arg(long, value_enum, default_value = "adamw")]
    optimizer: LmOptimizer,
    /// Directory of burn-ddp checkpoints (the whole model and optimizer state, written every
    /// epoch; resumed from when present, at any world size). A checkpoint of an --fsdp run
    /// resumes with any --fsdp strategy; charlm keeps its wrapped blocks in another field than
    /// its unwrapped ones, so not without --fsdp
    #[arg(long, value_name = "DIR", conflicts_with = "plain")]
    checkpoint_dir: Option<PathBuf>,
    /// Train on the text's first N sequences only (quick runs)
    #[arg(long, value_name = "N",
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    max_sequences: Option<usize>,
}

/// `full`, `grad-op` or `none`, as `ShardingStrategy::name` spells them.
fn strategy() -> impl TypedValueParser<Value = ShardingStrategy> {
    let names = [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ]
    .map(ShardingStrategy::name);
    PossibleValuesParser::new(names).map(|name| ShardingStrategy::parse(&name).unwrap_or_default())
}

fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..1.0).contains(&p) => Ok(p),
        _ => Err("a probability in [0, 1)".into()),
    }
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err("a finite number above 0".into()),
    }
}

fn run() -> anyhow::Result<()> {
    let f = Flags::parse();
    let cfg = LmConfig {
        epochs: f.epochs,
        batch_size: f.batch_size,
        seq_len: f.seq_len,
        dropout: f.dropout,
        lr: f.lr,
        warmup: f.warmup,
        seed: f.seed,
        plain: f.plain,
        quiet: f.quiet,
        report: f.report.clone(),
        params_out: f.params_out.clone(),
        max_sequences: f.max_sequences,
        d_model: f.d_model,
        heads: f.heads,
        layers: f.layers,
        shard: f.shard,
        fsdp: f.fsdp,
        optimizer: f.optimizer,
        checkpoint_dir: f.checkpoint_dir.clone(),
        ..LmConfig::default()
    };
    if !cfg.d_model.is_multiple_of(cfg.heads) {
        anyhow::bail!(
            "--heads {} does not divide --d-model {}",
            cfg.heads,
            cfg.d_model
        );
    }
    // What rank 0's summary and reports show of the run.
    let shown = quickstart::Config {
        epochs: cfg.epochs,
        batch_size: cfg.batch_size,
        report: cfg.report.clone(),
        params_out: cfg.params_out.clone(),
        ..quickstart::Config::default()
    };
    quickstart::train_in_group(&shown, |group| train(group, &cfg))
}

fn main() -> std::process::ExitCode {
    quickstart::exit(run())
}
