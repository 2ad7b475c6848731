//! The transformer `shardlm` trains, in two forms: [`Lm`], the whole model on every rank (DDP
//! and ZeRO-2), and [`ShardedLm`], every part wrapped in an [`Fsdp`] (the embeddings, each
//! block, the head), built and wrapped one part at a time so that the whole unwrapped model
//! never exists on a rank. Both compute the same next-character loss ([`LanguageModel`]).

use std::sync::Arc;

use anyhow::Result;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Int, Tensor};
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::{self, Fsdp, FsdpConfig};

/// The model's shape.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Characters of the vocabulary.
    pub vocab: usize,
    /// Positions (characters per sequence).
    pub seq_len: usize,
    /// Width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
}

impl Shape {
    /// Parameters of the whole model (embeddings, blocks, final norm and head).
    pub fn parameters(&self) -> usize {
        let d = self.width;
        // Attention: 4 d x d with biases; feed-forward d -> 4d -> d with biases; 2 norms.
        let block = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d;
        (self.vocab + self.seq_len) * d + self.layers * block + 2 * d + d * self.vocab + self.vocab
    }

    fn block(&self, device: &Device) -> Result<TransformerEncoderLayer> {
        let mut one = TransformerEncoderConfig::new(self.width, 4 * self.width, self.heads, 1)
            .with_dropout(0.0)
            .with_norm_first(true)
            .init(device);
        one.layers
            .pop()
            .ok_or_else(|| anyhow::anyhow!("burn built a transformer of one layer without it"))
    }
}

/// Token and position embeddings.
#[derive(Module, Debug)]
pub struct Embed {
    tokens: Embedding,
    positions: Embedding,
}

impl Embed {
    fn new(shape: &Shape, device: &Device) -> Self {
        Embed {
            tokens: EmbeddingConfig::new(shape.vocab, shape.width).init(device),
            positions: EmbeddingConfig::new(shape.seq_len, shape.width).init(device),
        }
    }

    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &ids.device())
            .reshape([1, t])
            .repeat_dim(0, b);
        self.tokens.forward(ids) + self.positions.forward(positions)
    }
}

/// The final layer norm and the output layer.
#[derive(Module, Debug)]
pub struct Head {
    norm: LayerNorm,
    out: Linear,
}

impl Head {
    fn new(shape: &Shape, device: &Device) -> Self {
        Head {
            norm: LayerNormConfig::new(shape.width).init(device),
            out: LinearConfig::new(shape.width, shape.vocab).init(device),
        }
    }

    fn forward(&self, h: Tensor<3>) -> Tensor<3> {
        self.out.forward(self.norm.forward(h))
    }
}

/// A model that gives the mean next-character loss of a batch.
pub trait LanguageModel: Module {
    /// Cross-entropy of `targets` after `inputs` (both `[batch, seq_len]`).
    fn loss(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1>;
}

/// The whole model, on every rank.
#[derive(Module, Debug)]
pub struct Lm {
    embed: Embed,
    blocks: Vec<TransformerEncoderLayer>,
    head: Head,
}

impl Lm {
    /// A freshly initialised model.
    pub fn new(shape: &Shape, device: &Device) -> Result<Self> {
        let blocks = (0..shape.layers)
            .map(|_| shape.block(device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Lm {
            embed: Embed::new(shape, device),
            blocks,
            head: Head::new(shape, device),
        })
    }
}

/// The causal mask of a batch.
fn mask(ids: &Tensor<2, Int>) -> Tensor<3, Bool> {
    let [b, t] = ids.dims();
    burn::nn::attention::generate_autoregressive_mask(b, t, &ids.device())
}

/// The mean cross-entropy of `logits` (`[b, t, vocab]`) against `targets`.
fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, vocab] = logits.dims();
    let device = logits.device();
    CrossEntropyLossConfig::new()
        .init(&device)
        .forward(logits.reshape([b * t, vocab]), targets.reshape([b * t]))
}

impl LanguageModel for Lm {
    fn loss(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let mask = mask(&inputs);
        let mut x = self.embed.forward(inputs);
        for block in &self.blocks {
            x = block.forward(x, None, Some(mask.clone()));
        }
        cross_entropy(self.head.forward(x), targets)
    }
}

/// Every part of the model wrapped in an [`Fsdp`]: each rank stores `1/N` of each.
#[derive(Module, Debug)]
pub struct ShardedLm {
    embed: Fsdp<Embed>,
    blocks: Vec<Fsdp<TransformerEncoderLayer>>,
    head: Fsdp<Head>,
}

impl ShardedLm {
    /// Builds and wraps the parts one at a time (rank 0's values are broadcast by each wrap).
    pub fn new(
        shape: &Shape,
        device: &Device,
        group: &Arc<ProcessGroup>,
        config: FsdpConfig,
    ) -> Result<Self> {
        let embed = config
            .clone()
            .with_name("embeddings")
            .init(Embed::new(shape, device), group)?;
        let mut blocks = Vec::with_capacity(shape.layers);
        for i in 0..shape.layers {
            let block = shape.block(device)?;
            blocks.push(
                config
                    .clone()
                    .with_name(format!("block {i}"))
                    .init(block, group)?,
            );
        }
        let head = config
            .with_name("head")
            .init(Head::new(shape, device), group)?;
        Ok(ShardedLm {
            embed,
            blocks,
            head,
        })
    }

    /// Elements of the whole model, and of this rank's shards.
    pub fn numel(&self) -> (usize, usize) {
        let mut whole = self.embed.numel() + self.head.numel();
        let mut mine = self.embed.shard_numel() + self.head.shard_numel();
        for b in &self.blocks {
            whole += b.numel();
            mine += b.shard_numel();
        }
        (whole, mine)
    }
}

impl LanguageModel for ShardedLm {
    fn loss(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let mask = mask(&inputs);
        let x = self.embed.forward(inputs, |e, ids| e.forward(ids));
        let x = fsdp::forward_chain(&self.blocks, x, |block, x| {
            block.forward(x, None, Some(mask.clone()))
        });
        let logits = self.head.forward(x, |h, x| h.forward(x));
        cross_entropy(logits, targets)
    }
}
