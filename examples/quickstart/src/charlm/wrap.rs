//! `charlm --fsdp`: the transformer's blocks wrapped in burn-ddp's `Fsdp`
//! ([`CharLm::shard`]), the whole model gathered back ([`CharLm::gathered`]), the device a
//! strategy trains on, and what the wrapped blocks did in a run.

use std::sync::Arc;

use anyhow::{Result, bail};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, GradientCheckpointingStrategy, Tensor};
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::{Fsdp, FsdpConfig, FsdpStats, ShardingStrategy};

use super::CharLm;

impl CharLm {
    /// Wraps every transformer block in an `Fsdp` with `strategy` over `group` (blocks named
    /// `block 0`, `block 1`, ...): a collective, every rank of `group` calls it with the same
    /// model shape. Rank 0's block parameters are broadcast; each rank then keeps its piece
    /// (the whole blocks with `NoShard`). The rest of the model stays as it is (replicated:
    /// `DdpLearner` broadcasts and reduces it).
    ///
    /// # Errors
    ///
    /// If the blocks are already wrapped or there are none; a collective's error, or ranks
    /// wrapping different blocks (burn-ddp's error, naming the block and the ranks).
    pub fn shard(mut self, strategy: ShardingStrategy, group: &Arc<ProcessGroup>) -> Result<Self> {
        if let Some(wrapped) = self.sharding() {
            bail!(
                "rank {}: the model's blocks are already wrapped (fsdp {})",
                group.rank(),
                wrapped.name()
            );
        }
        if self.blocks.layers.is_empty() {
            bail!("rank {}: the model has no block to wrap", group.rank());
        }
        let config = FsdpConfig::new().with_strategy(strategy);
        let layers = std::mem::take(&mut self.blocks.layers);
        self.sharded = (layers.into_iter().enumerate())
            .map(|(i, layer)| (config.clone().with_name(format!("block {i}"))).init(layer, group))
            .collect::<burn_ddp::Result<Vec<_>>>()?;
        Ok(self)
    }

    /// How the blocks are wrapped; `None` when they are not.
    pub fn sharding(&self) -> Option<ShardingStrategy> {
        self.sharded.first().map(Fsdp::strategy)
    }

    /// The unwrapped model: every wrapped block gathered from the ranks (a collective: every
    /// rank of the blocks' group calls it) and put back where [`Self::shard`] took it from;
    /// the same model, cloned, when nothing is wrapped. The gathered blocks' parameters are
    /// not tracked by autodiff: for evaluation, export, or comparing.
    ///
    /// # Errors
    ///
    /// A gather's error.
    pub fn gathered(&self) -> Result<Self> {
        let layers = (self.sharded.iter())
            .map(Fsdp::gathered)
            .collect::<burn_ddp::Result<Vec<_>>>()?;
        let mut whole = self.clone();
        if !layers.is_empty() {
            whole.sharded.clear();
            whole.blocks.layers = layers;
        }
        Ok(whole)
    }
}

/// The device a model with blocks wrapped with `fsdp` trains on: with gradient checkpointing
/// for `FullShard`, so that burn drops each gathered block after its forward pass and gathers
/// it again in backward (without it `FullShard` keeps the gathered blocks, as `ShardGradOp`).
pub(super) fn training_device(fsdp: Option<ShardingStrategy>) -> Device {
    match fsdp {
        Some(ShardingStrategy::FullShard) => super::device().gradient_checkpointing(),
        _ => super::device(),
    }
}

/// `model` on `device` with its blocks wrapped with `fsdp` over `group` (as it is without), and
/// rank 0 saying so. The whole model takes `device`'s gradient checkpointing before wrapping:
/// a shard takes its block's, `DdpLearner` trains on the device of the model's first parameter,
/// and burn refuses to combine tensors of different strategies.
pub(super) fn wrapped(
    model: CharLm,
    fsdp: Option<ShardingStrategy>,
    group: &Arc<ProcessGroup>,
    device: &Device,
) -> Result<CharLm> {
    let Some(strategy) = fsdp else {
        return Ok(model);
    };
    let model = model.fork(device);
    let model = match device.gradient_checkpointing_strategy() {
        Some(checkpointing) => model.map(&mut Checkpointing(checkpointing)),
        None => model,
    };
    let model = model.shard(strategy, group)?;
    if group.rank() == 0 {
        println!(
            "rank 0: fsdp {}: {} blocks wrapped",
            strategy.name(),
            model.sharded.len()
        );
    }
    Ok(model)
}

/// Gives every float parameter a gradient-checkpointing strategy: `Module::fork` keeps each
/// tensor's own, whatever the device's.
struct Checkpointing(GradientCheckpointingStrategy);

impl ModuleMapper for Checkpointing {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let strategy = self.0;
        param.map(|t| {
            let trained = t.is_require_grad();
            (t.autodiff().with_gradient_checkpointing_strategy(strategy)).set_require_grad(trained)
        })
    }
}

/// Rank 0 prints what its wrapped blocks did over training and validation (`spent`, read on
/// the training thread): gathers and reductions, and the communication the thread waited for,
/// per optimizer step.
pub(super) fn print_stats(
    group: &ProcessGroup,
    strategy: ShardingStrategy,
    spent: FsdpStats,
    steps: usize,
) {
    if group.rank() != 0 {
        return;
    }
    println!(
        "rank 0: fsdp {}: {} gathers, {} reductions, {:.3} ms exposed per step",
        strategy.name(),
        spent.gathers,
        spent.reduces,
        spent.exposed.as_secs_f64() * 1e3 / steps.max(1) as f64
    );
}
