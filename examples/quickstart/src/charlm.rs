//! A real model for `DdpLearner`: a small decoder-only transformer (GPT-style) trained as a
//! character-level language model on a bundled public-domain text (`data/liber-primus.txt`,
//! the first book of Cicero's *De finibus bonorum et malorum*), with AdamW, a warm-up learning
//! rate schedule (Noam's) and gradient clipping. The `charlm` binary runs it.
//!
//! Token and position embeddings, `layers` pre-norm blocks of causal multi-head attention and a
//! GELU feed-forward layer (burn's `TransformerEncoder` with an autoregressive mask), a final
//! layer norm and an untied output layer; dropout in every block.
//!
//! Dropout draws from the device's random state, which burn seeds per process: each rank seeds
//! it from the job seed and its rank ([`rank_seed`]), as PyTorch users must do by hand, so that
//! the ranks draw different masks.
//!
//! With `--fsdp full|grad-op|none` ([`LmConfig::fsdp`]) each block is wrapped in burn-ddp's
//! `Fsdp` before training ([`CharLm::shard`], in the `wrap` submodule): the blocks' parameters,
//! gradients and optimizer state are sharded over the ranks, the embeddings, the final norm and
//! the head stay replicated under `DdpLearner`.

mod wrap;

use std::sync::Arc;

use anyhow::Result;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput, TransformerEncoderLayer,
};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::lr_scheduler::noam::NoamLrSchedulerConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::{Fsdp, ShardingStrategy};
use burn_ddp::train::{CheckpointConfig, Compression, DdpLearner};

use crate::model::percent_correct;
use crate::report::Report;
use crate::timed::{Learning, Reduction, Settings, timed_run};

/// The bundled text: Cicero, *De finibus bonorum et malorum*, book 1 (45 BC, public domain), as
/// the `lipsum` crate ships it (`LIBER_PRIMUS`).
pub const TEXT: &str = include_str!("../data/liber-primus.txt");

/// The model's and the run's options (the `charlm` binary's flags).
#[derive(Debug, Clone)]
pub struct LmConfig {
    /// Epochs.
    pub epochs: usize,
    /// Sequences per batch, per rank.
    pub batch_size: usize,
    /// Characters per sequence.
    pub seq_len: usize,
    /// Width of the model.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Dropout probability in every block (0: none).
    pub dropout: f64,
    /// Peak learning rate, reached after `warmup` steps.
    pub lr: f64,
    /// Warm-up steps of the learning-rate schedule.
    pub warmup: usize,
    /// Largest gradient norm (clipping): the global norm of the whole model's averaged
    /// gradients (`DdpLearner::clip_grad_norm`, PyTorch's `clip_grad_norm_`), wrapped blocks
    /// included; with [`Self::plain`], each parameter tensor's own norm, as burn's optimizers
    /// clip.
    pub clip: f32,
    /// Job seed (initialisation, shuffling; dropout with the rank).
    pub seed: u64,
    /// burn's own `Learner` instead of `DdpLearner` (world of one; its overhead).
    pub plain: bool,
    /// Render no progress.
    pub quiet: bool,
    /// Where rank 0 writes timing as `key=value` (bench-train).
    pub report: Option<std::path::PathBuf>,
    /// Where rank 0 writes the final parameters as raw f32.
    pub params_out: Option<std::path::PathBuf>,
    /// Directory of burn-train's logs.
    pub artifacts: std::path::PathBuf,
    /// Train on the first this many sequences only (tests).
    pub max_sequences: Option<usize>,
    /// How the optimizer's work is sharded across the ranks.
    pub shard: crate::ShardFlag,
    /// Wrap every transformer block in burn-ddp's `Fsdp` with this strategy (`--fsdp`); `None`:
    /// plain data parallelism. `FullShard` trains on a device with gradient checkpointing, so
    /// that burn drops each gathered block after its forward pass.
    pub fsdp: Option<ShardingStrategy>,
    /// Directory of burn-ddp checkpoints (every epoch; resumed from when one is there).
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// The optimizer.
    pub optimizer: LmOptimizer,
}

/// The optimizer of a `charlm` run (`--optimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LmOptimizer {
    /// AdamW, weight decay 0.01 (two moments per parameter).
    #[default]
    #[value(name = "adamw")]
    AdamW,
    /// SGD with momentum 0.9 (one momentum buffer per parameter).
    SgdMomentum,
}

impl LmOptimizer {
    /// The optimizer, clipping gradients by `clip` if given.
    fn init(self, clip: Option<GradientClippingConfig>) -> ModuleOptimizer {
        match self {
            LmOptimizer::AdamW => AdamWConfig::new()
                .with_weight_decay(0.01)
                .with_grad_clipping(clip)
                .init(),
            LmOptimizer::SgdMomentum => SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                .with_gradient_clipping(clip)
                .init(),
        }
    }
}

impl Default for LmConfig {
    fn default() -> Self {
        LmConfig {
            epochs: 2,
            batch_size: 16,
            seq_len: 32,
            d_model: 64,
            heads: 4,
            layers: 2,
            dropout: 0.1,
            lr: 3e-3,
            warmup: 20,
            clip: 1.0,
            seed: 42,
            plain: false,
            quiet: false,
            report: None,
            params_out: None,
            artifacts: std::env::temp_dir().join("burn-ddp-charlm"),
            max_sequences: None,
            shard: crate::ShardFlag::None,
            fsdp: None,
            checkpoint_dir: None,
            optimizer: LmOptimizer::AdamW,
        }
    }
}

/// The seed of this rank's random state: the job seed mixed with the rank (SplitMix64), so that
/// every rank draws its own dropout masks and a job seed reproduces them all.
pub fn rank_seed(seed: u64, rank: usize) -> u64 {
    let mut x = seed ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The characters of the text, in order: the vocabulary.
fn vocabulary() -> Vec<char> {
    let mut chars: Vec<char> = TEXT.chars().collect();
    chars.sort_unstable();
    chars.dedup();
    chars
}

/// Sequences of `seq_len + 1` characters (as vocabulary indices) cut from the text, one every
/// `seq_len` characters; the first 90 % train, the rest validate.
#[derive(Debug, Clone)]
pub struct Sequences(Arc<Vec<Vec<i64>>>);

impl Sequences {
    /// The training and validation splits of the text.
    pub fn splits(seq_len: usize) -> (Self, Self) {
        let vocab = vocabulary();
        let ids: Vec<i64> = (TEXT.chars())
            .map(|c| vocab.binary_search(&c).unwrap_or(0) as i64)
            .collect();
        let all: Vec<Vec<i64>> = (0..ids.len().saturating_sub(seq_len + 1) / seq_len)
            .map(|i| ids[i * seq_len..i * seq_len + seq_len + 1].to_vec())
            .collect();
        let cut = all.len() * 9 / 10;
        (
            Sequences(Arc::new(all[..cut].to_vec())),
            Sequences(Arc::new(all[cut..].to_vec())),
        )
    }

    /// The first `n` sequences.
    fn first(&self, n: usize) -> Self {
        Sequences(Arc::new(self.0.iter().take(n).cloned().collect()))
    }
}

impl Dataset<Vec<i64>> for Sequences {
    fn get(&self, index: usize) -> Result<Vec<i64>, DatasetError> {
        self.0.get(index).cloned().ok_or_else(|| {
            DatasetError::new(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("sequence {index} out of range"),
            ))
        })
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// A batch: each sequence's characters but the last, and the characters that follow them.
#[derive(Debug, Clone)]
pub struct LmBatch {
    inputs: Tensor<2, Int>,
    targets: Tensor<2, Int>,
}

/// Batches sequences.
#[derive(Debug, Clone)]
pub struct LmBatcher;

impl Batcher<Vec<i64>, LmBatch> for LmBatcher {
    fn batch(&self, items: Vec<Vec<i64>>, device: &Device) -> LmBatch {
        let (b, t) = (items.len(), items.first().map_or(1, Vec::len) - 1);
        let inputs: Vec<i64> = items.iter().flat_map(|s| s[..t].to_vec()).collect();
        let targets: Vec<i64> = items.iter().flat_map(|s| s[1..].to_vec()).collect();
        LmBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [b, t]), device),
            targets: Tensor::from_data(TensorData::new(targets, [b, t]), device),
        }
    }
}

/// The decoder-only transformer. Its blocks are either all in `blocks` (unwrapped) or all in
/// `sharded` (wrapped by [`CharLm::shard`]): `blocks` keeps no layer then, so that the unwrapped
/// model's parameters (and record) are those of burn's `TransformerEncoder`, in the same order.
#[derive(Module, Debug)]
pub struct CharLm {
    tokens: Embedding,
    positions: Embedding,
    blocks: TransformerEncoder,
    sharded: Vec<Fsdp<TransformerEncoderLayer>>,
    norm: LayerNorm,
    head: Linear,
}

impl CharLm {
    /// A freshly initialised model for `cfg` over the text's vocabulary.
    pub fn init(device: &Device, cfg: &LmConfig) -> Self {
        let vocab = vocabulary().len();
        let d = cfg.d_model;
        CharLm {
            tokens: EmbeddingConfig::new(vocab, d).init(device),
            positions: EmbeddingConfig::new(cfg.seq_len, d).init(device),
            blocks: TransformerEncoderConfig::new(d, 4 * d, cfg.heads, cfg.layers)
                .with_dropout(cfg.dropout)
                .with_norm_first(true)
                .init(device),
            sharded: Vec::new(),
            norm: LayerNormConfig::new(d).init(device),
            head: LinearConfig::new(d, vocab).init(device),
        }
    }

    /// Next-character logits of every position, as a classification of `b * t` items.
    fn forward(&self, batch: LmBatch) -> ClassificationOutput {
        let [b, t] = batch.inputs.dims();
        let device = batch.inputs.device();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &device)
            .reshape([1, t])
            .repeat_dim(0, b);
        let x = self.tokens.forward(batch.inputs) + self.positions.forward(positions);
        let mask = generate_autoregressive_mask(b, t, &device);
        let h = self
            .blocks
            .forward(TransformerEncoderInput::new(x).mask_attn(mask.clone()));
        // The wrapped blocks, each gathered just before it runs (the next one's gather meanwhile).
        let h = burn_ddp::fsdp::forward_chain(&self.sharded, h, |block, x| {
            block.forward(x, None, Some(mask.clone()))
        });
        let logits = self.head.forward(self.norm.forward(h));
        let vocab = logits.dims()[2];
        let logits = logits.reshape([b * t, vocab]);
        let targets = batch.targets.reshape([b * t]);
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl TrainStep for CharLm {
    type Input = LmBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: LmBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for CharLm {
    type Input = LmBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: LmBatch) -> ClassificationOutput {
        self.forward(batch)
    }
}

/// The device models train on (burn's CPU backend, with autodiff).
pub fn device() -> Device {
    Device::flex().autodiff()
}

/// Trains a model initialised from the job seed in `group` (a world of one or many ranks) on
/// the CPU; the final parameters and the figures of the run.
pub fn train(group: Arc<ProcessGroup>, cfg: &LmConfig) -> Result<Report> {
    let device = device();
    device.seed(cfg.seed);
    let model = CharLm::init(&device, cfg).materialize();
    train_model(group, cfg, model)
}

/// Next-character accuracy of `model` over the validation split, in percent.
pub fn accuracy(model: &CharLm, cfg: &LmConfig) -> f64 {
    let (_, valid) = Sequences::splits(cfg.seq_len);
    let items: Vec<Vec<i64>> = valid.0.iter().cloned().collect();
    let device = device().inner();
    let batch = LmBatcher.batch(items, &device);
    percent_correct(InferenceStep::step(&model.clone().fork(&device), batch))
}

/// Noam's schedule, peaking at step `warmup` at `lr` (factor / sqrt(d_model * warmup)).
fn schedule(cfg: &LmConfig) -> Result<ModuleLrScheduler> {
    let factor = cfg.lr * ((cfg.d_model * cfg.warmup.max(1)) as f64).sqrt();
    NoamLrSchedulerConfig::new(factor)
        .with_warmup_steps(cfg.warmup.max(1))
        .with_model_size(cfg.d_model)
        .init()
        .map_err(anyhow::Error::msg)
}

/// Trains `model` (every rank's is replaced by rank 0's at the start) in `group`, its blocks
/// wrapped first with `cfg.fsdp`. The report's parameters are the whole model's, gathered from
/// the ranks when its blocks were wrapped.
pub fn train_model(group: Arc<ProcessGroup>, cfg: &LmConfig, model: CharLm) -> Result<Report> {
    let device = wrap::training_device(cfg.fsdp);
    // Dropout from this rank's own seed (initialisation and shuffling use the job seed).
    device.seed(rank_seed(cfg.seed, group.rank()));
    let model = wrap::wrapped(model, cfg.fsdp, &group, &device)?;
    let (mut train_data, mut valid_data) = Sequences::splits(cfg.seq_len);
    if let Some(n) = cfg.max_sequences {
        train_data = train_data.first(n);
    }
    if cfg.fsdp.is_some() {
        // Every validation batch gathers the wrapped blocks, a collective: every rank validates
        // as many sequences (the split's last world - 1 at most are left out).
        let world = group.world_size();
        valid_data = valid_data.first(valid_data.len() / world * world);
    }
    // DdpLearner clips the global norm (below); burn's Learner only each tensor's own.
    let optim = (cfg.optimizer).init(cfg.plain.then_some(GradientClippingConfig::Norm(cfg.clip)));
    let learning = Learning {
        model,
        optim,
        lr: schedule(cfg)?,
        device: &device,
    };
    let settings = Settings {
        epochs: cfg.epochs,
        batch_size: cfg.batch_size,
        seed: cfg.seed,
        artifacts: &cfg.artifacts,
        quiet: cfg.quiet,
        plain: cfg.plain,
        reduction: Reduction {
            desync_check: true,
            compression: Compression::None,
            sharding: cfg.shard.into(),
        },
    };
    let settings_of = |training, learner: DdpLearner<CharLm>| {
        let learner = learner
            .clip_grad_norm(cfg.clip)
            .setting("batch_size", cfg.batch_size)
            .setting("seq_len", cfg.seq_len)
            .setting("lr", cfg.lr)
            .setting("seed", cfg.seed)
            .setting("dropout", cfg.dropout)
            .setting("optimizer", format!("{:?}", cfg.optimizer))
            .setting(
                "model",
                format!("{}x{}x{}", cfg.layers, cfg.d_model, cfg.heads),
            );
        let learner = match &cfg.checkpoint_dir {
            Some(dir) => learner.checkpoints(CheckpointConfig::new(dir)),
            None => learner,
        };
        (training, learner)
    };
    let data = (LmBatcher, (train_data, valid_data));
    let before = burn_ddp::fsdp::stats();
    let (mut spent, mut whole) = (None, None);
    let mut report = timed_run(&group, &settings, data, learning, settings_of, |model| {
        spent = Some(burn_ddp::fsdp::stats() - before);
        // The whole model (a collective when its blocks are wrapped): accuracy and parameters.
        let gathered = model.gathered()?;
        whole = Some(burn_ddp::train::parameters_to_vector(&gathered));
        Ok(accuracy(&gathered, cfg))
    })?;
    if let Some(params) = whole {
        report.params = params;
    }
    if let (Some(strategy), Some(spent)) = (cfg.fsdp, spent) {
        wrap::print_stats(&group, strategy, spent, report.steps);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;

    #[test]
    fn each_rank_draws_its_own_dropout_masks_and_a_seed_repeats_them() {
        let device = device().inner();
        let mask = |seed: u64| {
            device.seed(seed);
            let t = Tensor::<1>::random([256], Distribution::Bernoulli(0.5), &device);
            t.into_data().try_to_vec::<f32>().unwrap()
        };
        let (rank0, rank1) = (mask(rank_seed(42, 0)), mask(rank_seed(42, 1)));
        assert_ne!(rank0, rank1, "ranks 0 and 1 draw the same mask");
        assert_eq!(rank0, mask(rank_seed(42, 0)), "a seed repeats its masks");
        assert_ne!(rank_seed(42, 0), rank_seed(43, 0));
    }

    #[test]
    fn the_text_is_cut_into_sequences_of_the_vocabulary() {
        let (train, valid) = Sequences::splits(32);
        assert!(
            train.len() > 1000 && valid.len() > 100,
            "{} {}",
            train.len(),
            valid.len()
        );
        let vocab = vocabulary().len() as i64;
        let seq = train.get(0).unwrap();
        assert_eq!(seq.len(), 33);
        assert!(seq.iter().all(|&c| (0..vocab).contains(&c)));
    }
}
