//! Fully sharded data parallelism (ZeRO-3), as PyTorch's FSDP: each rank stores `1/N` of a
//! block's parameters, gathers the whole block just before it runs, and reduce-scatters the
//! block's gradient into its own piece as soon as the block's backward is done.
//!
//! Wrap each large block of a model (a transformer layer, a big embedding) in an [`Fsdp`], made
//! by [`FsdpConfig::init`] on every rank in the same order. The model's field becomes
//! `Fsdp<Block>`, and the model's forward calls the block through [`Fsdp::forward`]:
//!
//! ```no_run
//! use std::sync::Arc;
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Device, Tensor};
//! use burn_ddp::fsdp::{Fsdp, FsdpConfig, ShardingStrategy};
//!
//! #[derive(Module, Debug)]
//! struct Net {
//!     layers: Vec<Fsdp<Linear>>,
//! }
//!
//! impl Net {
//!     fn forward(&self, x: Tensor<2>) -> Tensor<2> {
//!         // Each layer's parameters are gathered just before it runs; the next layer's
//!         // gather starts while this one computes (prefetch).
//!         burn_ddp::fsdp::forward_chain(&self.layers, x, |layer, x| layer.forward(x).tanh())
//!     }
//! }
//!
//! let group = Arc::new(burn_ddp::init_process_group()?);
//! let device = Device::flex().autodiff();
//! let config = FsdpConfig::new().with_strategy(ShardingStrategy::FullShard);
//! let layers = (0..4)
//!     .map(|_| config.init(LinearConfig::new(1024, 1024).init(&device), &group))
//!     .collect::<burn_ddp::Result<Vec<_>>>()?;
//! let net = Net { layers };
//! let y = net.forward(Tensor::ones([8, 1024], &device));
//! # Ok::<(), burn_ddp::DdpError>(())
//! ```
//!
//! The optimizer sees one flat parameter per block, the rank's shard, and keeps its state for
//! the shard only. [`DdpLearner`](crate::train::DdpLearner) leaves the shards' gradients alone
//! (they are averaged over the ranks in backward), broadcasts and checks only the parameters
//! outside the wrapped blocks, and its checkpoints hold the whole model and optimizer state.
//! Outside the learner, [`full_record`] and [`full_optimizer_record`] gather them to rank 0
//! (PyTorch's full state dicts), and [`load_full_record`] and [`load_full_optimizer_record`]
//! load them at any world size (see the guide's "Fully sharded" page).
//!
//! How it works: a block's gather is a custom autodiff operation whose parents are the shard
//! *and the block's input*. burn runs backward by depth (a node's depth is its deepest parent's
//! plus one, the deepest first), so the operation sits at the depth of the block's input and its
//! backward runs right after the block's own backward, when the block's gradient is complete:
//! there it starts the block's reduce-scatter (or, with [`ShardingStrategy::NoShard`], its
//! all-reduce) and goes on with the rest of backward while the collective runs. The last
//! wrapped block's backward waits for them all and hands each shard its gradient.

mod flat;
mod gather;
mod module;
mod optim_state;
mod piece;
mod state;
mod step;

use std::sync::Arc;

use burn::backend::DispatchTensor;
use burn::module::{Module, Param};
use burn::tensor::{DType, Tensor};

use self::flat::{FlatLayout, Template};
use crate::error::{DdpError, Result};
use crate::wire::Writer;
use crate::{ProcessGroup, Work};

pub(crate) use module::{block_gradients, first_block};
pub use optim_state::{full_optimizer_record, load_full_optimizer_record};
pub(crate) use optim_state::{shard_ids, shard_state, whole_state};
pub use state::{full_record, load_full_record};
pub(crate) use state::{loading_whole, replicated, saving_whole};
pub use step::{FsdpStats, stats};
pub(crate) use step::{Wait, recording_waits};

/// How a wrapped block's parameters, gradients and optimizer state are divided over the ranks
/// (PyTorch's `ShardingStrategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShardingStrategy {
    /// ZeRO-3: parameters, gradients and optimizer state in `1/N` pieces. The gathered block is
    /// declared recomputable, so on a device with gradient checkpointing
    /// (`Device::gradient_checkpointing()`) burn drops it after the forward pass and gathers it
    /// again when backward reaches the block; without checkpointing it behaves as
    /// [`Self::ShardGradOp`].
    #[default]
    FullShard,
    /// ZeRO-2 through this path: gradients and optimizer state in `1/N` pieces; the gathered
    /// parameters are kept from the forward pass to the block's backward.
    ShardGradOp,
    /// DDP: every rank holds the whole block; its gradient is all-reduced inside backward, as
    /// soon as the block's backward is done, overlapped with the rest of backward.
    NoShard,
}

impl ShardingStrategy {
    /// The strategy's name, as the `--fsdp` flags of the examples spell it.
    pub fn name(self) -> &'static str {
        match self {
            ShardingStrategy::FullShard => "full",
            ShardingStrategy::ShardGradOp => "grad-op",
            ShardingStrategy::NoShard => "none",
        }
    }

    /// The strategy `name` spells (`full`, `grad-op`, `none`), if any.
    ///
    /// ```
    /// use burn_ddp::fsdp::ShardingStrategy;
    /// assert_eq!(ShardingStrategy::parse("grad-op"), Some(ShardingStrategy::ShardGradOp));
    /// assert_eq!(ShardingStrategy::parse("zero3"), None);
    /// ```
    pub fn parse(name: &str) -> Option<Self> {
        [Self::FullShard, Self::ShardGradOp, Self::NoShard]
            .into_iter()
            .find(|s| s.name() == name)
    }

    /// Whether each rank keeps only its piece of the parameters.
    fn shards(self) -> bool {
        self != ShardingStrategy::NoShard
    }
}

/// Options of a wrapped block, burn-style: `FsdpConfig::new().with_strategy(..).init(block,
/// &group)`.
///
/// ```
/// use burn_ddp::fsdp::{FsdpConfig, ShardingStrategy};
/// let config = FsdpConfig::new().with_strategy(ShardingStrategy::NoShard).with_name("head");
/// assert_eq!(config.strategy, ShardingStrategy::NoShard);
/// ```
#[derive(Debug, Clone)]
pub struct FsdpConfig {
    /// How the block is divided over the ranks (default [`ShardingStrategy::FullShard`]).
    pub strategy: ShardingStrategy,
    /// The block's name in errors and logs (default `block <n>`, `n` counting the blocks this
    /// process wrapped with the group, from 0).
    pub name: Option<String>,
    /// The element type the block's gradient travels and is averaged in (PyTorch FSDP's
    /// `MixedPrecision(reduce_dtype=...)`): `None` (the default) for the parameters' own;
    /// `DType::BF16` or `DType::F16` halve the bytes of the block's reductions, at their
    /// precision (gradient compression: `DdpLearner::compression` covers the rest of the
    /// model, not the blocks).
    pub reduce_dtype: Option<DType>,
    /// With [`ShardingStrategy::FullShard`] under gradient checkpointing: whether backward
    /// starts gathering this block again while the block after it (in the forward pass) runs
    /// its backward, so that the gather is not waited for (PyTorch FSDP's
    /// `BackwardPrefetch.BACKWARD_PRE`; default `true`). It costs one more gathered block held
    /// during backward; `false` gathers it when its backward needs it.
    pub backward_prefetch: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            strategy: ShardingStrategy::default(),
            name: None,
            reduce_dtype: None,
            backward_prefetch: true,
        }
    }
}

impl FsdpConfig {
    /// The defaults: full sharding, blocks named by their order.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the sharding strategy.
    pub fn with_strategy(mut self, strategy: ShardingStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Names the block in errors and logs.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Reduces the block's gradient in `dtype` (see [`Self::reduce_dtype`]).
    ///
    /// ```
    /// use burn::tensor::DType;
    /// use burn_ddp::fsdp::FsdpConfig;
    /// let config = FsdpConfig::new().with_reduce_dtype(DType::BF16);
    /// assert_eq!(config.reduce_dtype, Some(DType::BF16));
    /// ```
    pub fn with_reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = Some(dtype);
        self
    }

    /// Sets [`Self::backward_prefetch`].
    ///
    /// ```
    /// use burn_ddp::fsdp::FsdpConfig;
    /// assert!(FsdpConfig::new().backward_prefetch);
    /// assert!(!FsdpConfig::new().with_backward_prefetch(false).backward_prefetch);
    /// ```
    pub fn with_backward_prefetch(mut self, prefetch: bool) -> Self {
        self.backward_prefetch = prefetch;
        self
    }

    /// Wraps `block`: every rank of `group` must call this with the same block (same parameter
    /// shapes and types), in the same order. Rank 0's parameter values are broadcast, so the
    /// replicas start identical; each rank then keeps its piece and drops the rest.
    ///
    /// # Errors
    ///
    /// [`DdpError::Fsdp`] if the block has no float parameter, holds parameters of more than
    /// one element type, or mixes frozen and trainable parameters;
    /// [`DdpError::Disagreement`] naming the block and the ranks that differ if the ranks wrap
    /// different blocks or with different strategies; a collective's error.
    pub fn init<M: Module>(&self, block: M, group: &Arc<ProcessGroup>) -> Result<Fsdp<M>> {
        let index = step::next_block_index(group);
        let name = self
            .name
            .clone()
            .unwrap_or_else(|| format!("block {index}"));
        let rank = group.rank();
        let fail = |reason: String| DdpError::Fsdp {
            rank,
            block: name.clone(),
            reason,
        };
        let layout = FlatLayout::of(&block).map_err(fail)?;
        if let Some(d) = self.reduce_dtype.filter(|d| !d.is_float()) {
            return Err(fail(format!(
                "its gradient cannot be reduced in {d:?}: give a float type (BF16, F16, F32, \
                 F64)"
            )));
        }
        let mut what = self.strategy.name().to_string();
        if let Some(d) = self.reduce_dtype {
            what += &format!(", reduced in {d:?}");
        }
        if !self.backward_prefetch {
            what += ", no backward prefetch";
        }
        agree(group, &name, &what, &layout)?;

        let device = layout.device.clone();
        let flat = flat::flatten(&block, &layout);
        let flat = if group.world_size() > 1 {
            group.broadcast(flat, 0).wait()?
        } else {
            flat
        };
        let world = group.world_size();
        let shard_len = match self.strategy.shards() {
            true => layout.numel.div_ceil(world),
            false => layout.numel,
        };
        let shard = match self.strategy.shards() {
            true => flat::piece(flat, rank * shard_len, shard_len, &device),
            false => flat,
        };
        let shard = crate::collectives::backend::slices::on_device(shard, &device);
        let shard = match layout.trainable && device.is_autodiff() {
            true => shard.require_grad(),
            false => shard,
        };
        log::debug!(
            "rank {rank}: fsdp {name}: {} parameters, {} elements, {} strategy, shard of {shard_len}",
            layout.params.len(),
            layout.numel,
            self.strategy.name(),
        );
        Ok(Fsdp {
            shard: Param::from_tensor(shard),
            template: Template::of(block),
            shared: Arc::new(Shared {
                name,
                strategy: self.strategy,
                reduce_dtype: self.reduce_dtype,
                backward_prefetch: self.backward_prefetch,
                layout,
                shard_len,
                group: group.clone(),
            }),
        })
    }
}

/// The ranks compare the block's description; a rank that wraps a different block is named.
fn agree(group: &ProcessGroup, name: &str, strategy: &str, layout: &FlatLayout) -> Result<()> {
    let mut w = Writer::default();
    w.bytes(name.as_bytes())
        .bytes(strategy.as_bytes())
        .bytes(layout.describe().as_bytes());
    let said = group.all_gather_object(w.buf.clone())?;
    let differing = said.differing();
    if differing.is_empty() {
        return Ok(());
    }
    let theirs = said.decode_each("an fsdp block description", |r| {
        let (name, strategy, layout) = (r.string()?, r.string()?, r.string()?);
        Ok(format!("{name}, {strategy}: {layout}"))
    })?;
    let lines: Vec<String> = std::iter::once(0)
        .chain(differing)
        .map(|r| format!("rank {r} wraps {}", theirs[r]))
        .collect();
    Err(DdpError::Disagreement(format!(
        "fsdp {name}: the ranks wrap different blocks (every rank must wrap the same blocks \
         with the same strategy, in the same order): {}",
        lines.join("; ")
    )))
}

/// A block of a model whose parameters are sharded over the ranks (PyTorch's `fully_shard`):
/// see the [module documentation](self).
///
/// As a [`Module`] it holds one parameter, this rank's flat shard (the block's parameters in
/// visit order, flattened and concatenated, padded to a multiple of the world size and cut in
/// rank order); the optimizer steps that. [`Self::forward`] runs the block on the gathered
/// parameters.
#[derive(Clone)]
pub struct Fsdp<M: Module> {
    /// This rank's piece of the flat parameters (the whole of them with
    /// [`ShardingStrategy::NoShard`]).
    shard: Param<Tensor<1>>,
    /// The block without its parameters' values (each an empty tensor): what the gathered
    /// values are put into.
    template: Template<M>,
    /// What every copy of this wrapper shares.
    shared: Arc<Shared>,
}

/// What a wrapped block's copies share.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The block's name in errors and logs.
    pub(crate) name: String,
    pub(crate) strategy: ShardingStrategy,
    /// The element type the gradient is reduced in, if not the parameters'.
    pub(crate) reduce_dtype: Option<DType>,
    /// Whether backward gathers the block ahead of its need ([`FsdpConfig::backward_prefetch`]).
    pub(crate) backward_prefetch: bool,
    /// Where each parameter lies in the flat vector.
    pub(crate) layout: FlatLayout,
    /// Elements of each rank's shard.
    pub(crate) shard_len: usize,
    pub(crate) group: Arc<ProcessGroup>,
}

impl Shared {
    /// The flat parameters, every rank's shard concatenated (padding included).
    fn gathered_len(&self) -> usize {
        match self.strategy.shards() {
            true => self.shard_len * self.group.world_size(),
            false => self.shard_len,
        }
    }

    /// The error of this block on this rank.
    pub(crate) fn error(&self, reason: impl Into<String>) -> DdpError {
        DdpError::Fsdp {
            rank: self.group.rank(),
            block: self.name.clone(),
            reason: reason.into(),
        }
    }
}

impl<M: Module> std::fmt::Debug for Fsdp<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fsdp")
            .field("name", &self.shared.name)
            .field("strategy", &self.shared.strategy)
            .field("numel", &self.shared.layout.numel)
            .field("shard_len", &self.shared.shard_len)
            .finish()
    }
}

/// A gather started ahead of the block's forward (by [`forward_chain`]).
pub struct Prefetched(Work<Tensor<1>>);

impl<M: Module> Fsdp<M> {
    /// The block's name in errors and logs.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The sharding strategy.
    pub fn strategy(&self) -> ShardingStrategy {
        self.shared.strategy
    }

    /// Elements of the block's parameters (without padding).
    pub fn numel(&self) -> usize {
        self.shared.layout.numel
    }

    /// Elements this rank stores: its shard (the whole block with
    /// [`ShardingStrategy::NoShard`]).
    pub fn shard_numel(&self) -> usize {
        self.shared.shard_len
    }

    /// Runs `f` on the block with its whole parameters, gathered from every rank, and `input`.
    /// `input` should be what the block computes from (its activation): the gather's backward
    /// then runs right after the block's, which is where the block's gradient is reduced. The
    /// block must use `input` (an ordinary block does).
    ///
    /// Every rank must call the wrapped blocks in the same order, once per forward pass on an
    /// autodiff device (evaluation, on a device without autodiff, may call them as often as it
    /// likes).
    ///
    /// # Panics
    ///
    /// With an [`DdpError::Fsdp`] naming the block and the rank if the block runs a second time
    /// in one training forward pass, and with the group's error if a collective fails (as
    /// burn's own operations panic: a forward pass cannot return an error).
    pub fn forward<I: FsdpInput, R>(&self, input: I, f: impl FnOnce(&M, I) -> R) -> R {
        self.forward_prefetched(None, input, f)
    }

    /// Starts gathering the block's parameters now, for a [`Self::forward_prefetched`] later:
    /// the gather runs while this rank computes something else.
    pub fn prefetch(&self) -> Prefetched {
        Prefetched(gather::start(&self.shared, self.shard.val().inner()))
    }

    /// [`Self::forward`] with the gather started by [`Self::prefetch`] (or started now when
    /// `prefetched` is `None`).
    ///
    /// # Panics
    ///
    /// As [`Self::forward`].
    pub fn forward_prefetched<I: FsdpInput, R>(
        &self,
        prefetched: Option<Prefetched>,
        input: I,
        f: impl FnOnce(&M, I) -> R,
    ) -> R {
        let shard = self.shard.val();
        let work = match prefetched {
            Some(Prefetched(work)) => work,
            None => gather::start(&self.shared, shard.clone().inner()),
        };
        let full = step::wait_exposed(work, Wait::Gather).unwrap_or_else(|e| panic!("{e}"));
        let input = input.kept();
        let full = gather::attach(&self.shared, shard, input.anchor(), full);
        let block = self.template.fill(&self.shared.layout, full);
        f(&block, input)
    }

    /// This rank's shard (the optimizer's parameter).
    pub fn shard(&self) -> &Param<Tensor<1>> {
        &self.shard
    }

    /// The whole block, gathered from every rank (a collective: every rank must call it), with
    /// parameters that are not tracked by autodiff: for evaluation, export, or unwrapping.
    ///
    /// # Errors
    ///
    /// A collective's error.
    pub fn gathered(&self) -> Result<M> {
        let work = gather::start(&self.shared, self.shard.val().inner());
        let full = work.wait()?;
        let full = crate::collectives::backend::slices::on_device(full, &self.shard.val().device());
        Ok(self.template.fill(&self.shared.layout, full))
    }
}

/// Runs `blocks` one after the other (`x = f(block, x)`), each through [`Fsdp::forward`], with
/// the next block's gather started before the current block computes (forward prefetch, as
/// FSDP's `forward_prefetch`).
///
/// # Panics
///
/// As [`Fsdp::forward`].
pub fn forward_chain<M: Module, const D: usize>(
    blocks: &[Fsdp<M>],
    input: Tensor<D>,
    mut f: impl FnMut(&M, Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    let mut next = blocks.first().map(Fsdp::prefetch);
    let mut x = input;
    for (i, block) in blocks.iter().enumerate() {
        let current = next.take();
        next = blocks.get(i + 1).map(Fsdp::prefetch);
        x = block.forward_prefetched(current, x, &mut f);
    }
    x
}

/// What a wrapped block's input gives its gather: the autodiff node it hangs on.
pub trait FsdpInput {
    /// The float tensor whose node becomes the gather's second parent, if any. It must be the
    /// input itself (not a tensor computed from it): the gather hands it no gradient, so it
    /// must receive one from the block.
    fn anchor(&self) -> Option<DispatchTensor>;

    /// The input as the block gets it: where it is a float tensor tracked by autodiff, passed
    /// through an operation burn's gradient checkpointing keeps from the forward pass (the
    /// value is not copied). Without it, burn would rebuild a block's input in backward by
    /// recomputing what made it, through every earlier block (a transformer's residual
    /// stream), gathering them all again at once. The default keeps nothing.
    fn kept(self) -> Self
    where
        Self: Sized,
    {
        self
    }
}

impl<const D: usize> FsdpInput for Tensor<D> {
    fn anchor(&self) -> Option<DispatchTensor> {
        Some(self.clone().into_dispatch())
    }

    fn kept(self) -> Self {
        Tensor::from_dispatch(gather::kept(self.into_dispatch()))
    }
}

/// Token ids: no autodiff node, so the block's gather hangs on the shard alone (its backward
/// then runs near the end of backward, which is where an embedding's runs anyway).
impl<const D: usize> FsdpInput for Tensor<D, burn::tensor::Int> {
    fn anchor(&self) -> Option<DispatchTensor> {
        None
    }
}

/// Several inputs: the first one anchors the gather.
impl<A: FsdpInput, B> FsdpInput for (A, B) {
    fn anchor(&self) -> Option<DispatchTensor> {
        self.0.anchor()
    }

    fn kept(self) -> Self {
        (self.0.kept(), self.1)
    }
}
