//! `shardlm`: what each rank of a large transformer holds and how fast it steps under DDP,
//! ZeRO-2 (burn-ddp's sharded optimizer) and fully sharded blocks (FSDP, ZeRO-3); the program
//! `cargo xtask bench-train --fsdp` runs.
//!
//! A decoder-only transformer (`model`) learns Cicero's text character by character with
//! AdamW, in a hand-written loop of a few steps (the first a warm-up): with `--mode ddp` the
//! gradients are averaged by a `GradientReducer`, with `zero2` the reducer shards them and the
//! optimizer (each rank steps its own parameters, `share_parameters` hands them round), with
//! `full` or `grad-op` every part of the model is an `Fsdp` block (full: on a device with
//! gradient checkpointing, so burn may drop the gathered parameters between forward and
//! backward). A plain loop rather than `DdpLearner`: it takes one code path per mode, nothing
//! of burn-train's (validation, metrics, checkpoints) adds to the memory measured, and it reads
//! the gradients each rank holds after the reduction.
//!
//! ```text
//! burn-ddp-run --nproc 4 target/release/shardlm --mode full --report /tmp/shardlm
//! ```
//!
//! Each rank prints its figures and with `--report PATH` writes them to `PATH.rank<r>` as
//! key=value (see `measure`); with `--memory-trace` rank 0 prints its resident memory after each
//! phase of each step (forward, backward, reduction, optimizer), which says where the peak is.

mod measure;
mod model;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::{self, FsdpConfig, FsdpStats, ShardingStrategy};
use burn_ddp::train::{BucketConfig, GradientReducer, Sharding, broadcast_module};
use clap::builder::RangedU64ValueParser;
use clap::{Parser, ValueEnum};

use measure::{Figures, Held};
use model::{LanguageModel, Lm, Shape, ShardedLm};

/// How the ranks divide the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Every rank holds everything; gradients all-reduced
    Ddp,
    /// The sharded optimizer: gradients reduce-scattered, optimizer state per owner
    Zero2,
    /// Fully sharded blocks: parameters, gradients and optimizer state in 1/N pieces
    Full,
    /// Fully sharded blocks, gathered parameters kept from forward to backward
    GradOp,
}

/// A large transformer's per-rank memory and step time under DDP, ZeRO-2 or FSDP.
#[derive(Debug, Parser)]
#[command(name = "shardlm")]
struct Flags {
    /// How the ranks divide the model
    #[arg(long, value_enum, default_value = "full")]
    mode: Mode,
    /// Width of the model
    #[arg(long, default_value_t = 1024, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    width: usize,
    /// Attention heads (dividing --width)
    #[arg(long, default_value_t = 16, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    heads: usize,
    /// Transformer blocks
    #[arg(long, default_value_t = 8, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    layers: usize,
    /// Characters per sequence
    #[arg(long, default_value_t = 16, value_parser = RangedU64ValueParser::<usize>::new().range(2..=1024))]
    seq_len: usize,
    /// Sequences per batch, per rank
    #[arg(long, default_value_t = 2, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    batch_size: usize,
    /// Measured steps (after one warm-up step)
    #[arg(long, default_value_t = 2, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    steps: usize,
    /// Learning rate (AdamW)
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Seed of the initialisation (rank 0's values are used)
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// With --mode full: a device without gradient checkpointing
    #[arg(long)]
    no_checkpointing: bool,
    /// With --mode full: backward gathers each block when it needs it, not while the block
    /// after it computes (`FsdpConfig::with_backward_prefetch(false)`)
    #[arg(long)]
    no_backward_prefetch: bool,
    /// Rank 0 prints its resident memory (now, peak) after each phase of each step: where the
    /// peak is reached
    #[arg(long)]
    memory_trace: bool,
    /// Where each rank writes its figures (`PATH.rank<r>`, key=value)
    #[arg(long, value_name = "PATH")]
    report: Option<PathBuf>,
}

/// Warm-up steps before the measured ones.
const WARMUP: usize = 1;

fn main() -> std::process::ExitCode {
    quickstart::exit(run())
}

fn run() -> Result<()> {
    let f = Flags::parse();
    if !f.width.is_multiple_of(f.heads) {
        anyhow::bail!("--heads {} does not divide --width {}", f.heads, f.width);
    }
    let group = Arc::new(burn_ddp::init_process_group().context("forming the process group")?);
    let text = Text::new();
    let shape = Shape {
        vocab: text.vocab,
        seq_len: f.seq_len,
        width: f.width,
        heads: f.heads,
        layers: f.layers,
    };
    let mut device = Device::flex().autodiff();
    if f.mode == Mode::Full && !f.no_checkpointing {
        device = device.gradient_checkpointing();
    }
    device.seed(f.seed);
    let rank = group.rank();
    if rank == 0 {
        println!(
            "shardlm: {:?}, world {}, {:.1} M parameters ({} x {}), batch {} x {} per rank",
            f.mode,
            group.world_size(),
            shape.parameters() as f64 / 1e6,
            f.layers,
            f.width,
            f.batch_size,
            f.seq_len
        );
    }
    let loop_ = Loop {
        flags: &f,
        text: &text,
        device: &device,
        group: &group,
    };
    let figures = match f.mode {
        Mode::Ddp | Mode::Zero2 => {
            let model = broadcast_module(Lm::new(&shape, &device)?, &group)?;
            let sharding = match f.mode {
                Mode::Zero2 => Sharding::OptimizerAndGradients,
                _ => Sharding::None,
            };
            let reducer = GradientReducer::new(&model, group.clone(), BucketConfig::default())?
                .sharding(sharding);
            loop_.train(model, Some(&reducer))?
        }
        Mode::Full | Mode::GradOp => {
            let strategy = match f.mode {
                Mode::Full => ShardingStrategy::FullShard,
                _ => ShardingStrategy::ShardGradOp,
            };
            let config = FsdpConfig::new()
                .with_strategy(strategy)
                .with_backward_prefetch(!f.no_backward_prefetch);
            let model = ShardedLm::new(&shape, &device, &group, config)?;
            let (whole, mine) = model.numel();
            println!("fsdp: this rank stores {mine} of the model's {whole} elements");
            loop_.train(model, None)?
        }
    };
    figures.publish(rank, f.report.as_deref())
}

/// What one training run is given.
struct Loop<'a> {
    flags: &'a Flags,
    text: &'a Text,
    device: &'a Device,
    group: &'a Arc<ProcessGroup>,
}

impl Loop<'_> {
    /// Trains `model` for the warm-up and measured steps, its gradients averaged by `reducer`
    /// (or inside backward by the model's wrapped blocks), and measures it.
    fn train<M: LanguageModel>(
        &self,
        mut model: M,
        reducer: Option<&GradientReducer>,
    ) -> Result<Figures> {
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let f = self.flags;
        let mut optim: ModuleOptimizer = AdamWConfig::new().with_weight_decay(0.01).init();
        let mut measured = Duration::ZERO;
        let mut held = Held::default();
        let mut fsdp_from = FsdpStats::default();
        let mut loss = f32::NAN;
        for step in 0..WARMUP + f.steps {
            if step == WARMUP {
                fsdp_from = fsdp::stats();
            }
            let (inputs, targets) = self.text.batch(step, rank, world, f, self.device);
            let start = Instant::now();
            let trace = |phase: &str| {
                if f.memory_trace && rank == 0 {
                    let (now, peak) = measure::rss_now_and_peak();
                    println!(
                        "memory: step {step}, after {phase}: RSS {:.1} MB, peak {:.1} MB",
                        now as f64 / 1e6,
                        peak as f64 / 1e6
                    );
                }
            };
            trace("the batch");
            let l = model.loss(inputs, targets);
            loss = l.clone().into_scalar();
            trace("forward");
            let grads = GradientsParams::from_grads(l.backward(), &model);
            trace("backward");
            let grads = match reducer {
                Some(r) => r.reduce(&model, grads)?,
                None => grads,
            };
            trace("the reduction");
            held = Held::of(&model, &grads);
            model = optim.step(f.lr, model, grads);
            trace("the optimizer step");
            if let Some(r) = reducer {
                model = r.share_parameters(model)?;
                trace("sharing the parameters");
            }
            let took = start.elapsed();
            if step >= WARMUP {
                measured += took;
            }
            if rank == 0 {
                println!(
                    "step {step}: loss {loss:.4}, {:.0} ms",
                    took.as_secs_f64() * 1e3
                );
            }
        }
        let fsdp = fsdp::stats() - fsdp_from;
        // The peak before the optimizer state is counted (counting copies it).
        let peak_rss = measure::peak_rss_bytes();
        let optim_bytes = measure::optimizer_state_bytes(&optim)?;
        Ok(Figures::new(
            (f.steps, measured),
            (held, optim_bytes, peak_rss),
            reducer,
            fsdp,
            (world, loss),
        ))
    }
}

/// The text as vocabulary indices, and the size of its vocabulary.
struct Text {
    ids: Vec<i64>,
    vocab: usize,
}

impl Text {
    fn new() -> Self {
        let text = quickstart::charlm::TEXT;
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = (text.chars())
            .map(|c| chars.binary_search(&c).unwrap_or(0) as i64)
            .collect();
        Text {
            ids,
            vocab: chars.len(),
        }
    }

    /// Rank `rank`'s batch of step `step`: each sequence's characters and those that follow.
    fn batch(
        &self,
        step: usize,
        rank: usize,
        world: usize,
        f: &Flags,
        device: &Device,
    ) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let (b, t) = (f.batch_size, f.seq_len);
        let starts = self.ids.len().saturating_sub(t + 1).max(1);
        let (mut inputs, mut targets) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for i in 0..b {
            let at = ((step * world + rank) * b + i) * t % starts;
            let seq = &self.ids[at..(at + t + 1).min(self.ids.len())];
            inputs.extend((0..t).map(|k| seq.get(k).copied().unwrap_or(0)));
            targets.extend((1..=t).map(|k| seq.get(k).copied().unwrap_or(0)));
        }
        (
            Tensor::from_data(TensorData::new(inputs, [b, t]), device),
            Tensor::from_data(TensorData::new(targets, [b, t]), device),
        )
    }
}
