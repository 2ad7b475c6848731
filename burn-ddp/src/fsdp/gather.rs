//! The gather of a wrapped block's parameters as a custom autodiff operation: forward gives the
//! whole flat parameters (gathered from every rank's shard), which the block's parameters are
//! cut from ([`super::piece`]); backward joins their gradients and starts the reduction into
//! the shard ([`super::step::backward`]).
//!
//! Its parents are the shard and an anchor, a one-element stand-in computed from the block's
//! input, through which no gradient flows: burn orders backward by depth, and the anchor puts
//! the operation at the block's depth, so its backward runs right after the block's own. With
//! [`ShardingStrategy::FullShard`] the operation is memory-bound with a retro-forward (a gather
//! again): on a device with gradient checkpointing, burn drops the gathered parameters after
//! the forward pass and gathers them again when backward first needs them.
//!
//! The anchor is an operation of its own, compute-bound, rather than the input itself: burn's
//! checkpointer walks up a memory-bound node's parents until it meets a computed one, both to
//! count what backward will need and to recompute it. Were the input (most often the previous
//! block's output, memory-bound) a parent, that walk would go through the previous block's
//! parameters into its gather, and from there into every earlier block: the first block's
//! backward would gather every block again and hold them all until each one's own backward.
//! For the same reason the block's input itself is kept from the forward pass
//! ([`FsdpBackend::fsdp_kept`], a compute-bound identity): rebuilt in backward, a transformer's
//! residual stream (memory-bound additions of every block's output) would need every earlier
//! block's parameters.

use std::marker::PhantomData;
use std::sync::Arc;

#[cfg(any(feature = "wgpu", feature = "nccl"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Backend, DispatchKindConversion, DispatchTensor, Flex, Shape, TensorMetadata, backend_extension,
};
use burn::tensor::Tensor;

use super::{ShardingStrategy, Shared, piece, step};
use crate::Work;

/// Starts gathering the flat parameters from every rank's `shard` (no autodiff): the whole
/// flat vector, padding included. With [`ShardingStrategy::NoShard`], or alone, the shard is
/// the whole.
pub(super) fn start(shared: &Shared, shard: Tensor<1>) -> Work<Tensor<1>> {
    let group = &shared.group;
    let world = group.world_size();
    if !shared.strategy.shards() || world == 1 {
        return Work::done(group.rank(), Ok(shard));
    }
    step::count_gather(shared.gathered_len());
    group.all_gather_parts(shard, &vec![shared.shard_len; world])
}

/// The gathered `full` (no autodiff) as the output of the gather operation on `shard` and
/// the block's `input`: an autodiff tensor whose backward reduces the gradient into the shard,
/// when `shard` is one.
pub(super) fn attach(
    shared: &Arc<Shared>,
    shard: Tensor<1>,
    input: Option<DispatchTensor>,
    full: Tensor<1>,
) -> Tensor<1> {
    let device = shard.device();
    if !device.is_autodiff() {
        return full;
    }
    let len = full.dims()[0];
    let full = crate::collectives::backend::slices::on_device(full, &device);
    // Without an input, the anchor comes from the shard (the gather then sits at depth 2).
    let shard = shard.into_dispatch();
    let input = input.unwrap_or_else(|| shard.clone());
    Tensor::from_dispatch(<burn::backend::Dispatch as FsdpBackend>::fsdp_gather(
        shard,
        input,
        full.into_dispatch(),
        Call {
            shared: shared.clone(),
            len,
        },
    ))
}

/// What the operation carries besides tensors: the block, and the gathered vector's length.
#[derive(Clone, Debug)]
pub(super) struct Call {
    shared: Arc<Shared>,
    len: usize,
}

/// The gather of a wrapped block's parameters, differentiated across the process group.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "nccl")))]
pub(super) trait FsdpBackend: Backend {
    /// One element standing for `input` in the order of backward, compute-bound, through which
    /// no gradient flows; from `shard` where `input` is not tracked.
    fn fsdp_anchor(input: FloatTensor<Self>, shard: FloatTensor<Self>) -> FloatTensor<Self> {
        let _ = input;
        let (device, dtype) = (shard.device(), shard.dtype());
        Self::float_zeros(Shape::new([1]), &device, dtype.into())
    }

    /// `input` itself, as a compute-bound operation whose gradient is its output's: under
    /// gradient checkpointing burn keeps it from the forward pass instead of recomputing it,
    /// which would recompute the previous blocks (a transformer's residual stream is a chain
    /// of memory-bound additions of every block's output) and gather them all again.
    fn fsdp_kept(input: FloatTensor<Self>) -> FloatTensor<Self> {
        input
    }

    /// `full`, the gathered parameters, as the result of gathering `shard`; `input` is the
    /// block's input (the shard where there is none), which the operation's anchor
    /// ([`Self::fsdp_anchor`]) stands for: a parent only, for the order of backward.
    fn fsdp_gather(
        shard: FloatTensor<Self>,
        input: FloatTensor<Self>,
        full: FloatTensor<Self>,
        call: Call,
    ) -> FloatTensor<Self> {
        let _ = (shard, input, call);
        full
    }
}

impl FsdpBackend for Flex {}
#[cfg(any(feature = "wgpu", feature = "nccl"))]
impl FsdpBackend for Cube {}

impl<B: Backend, C: CheckpointStrategy> FsdpBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn fsdp_anchor(input: FloatTensor<Self>, shard: FloatTensor<Self>) -> FloatTensor<Self> {
        let parent = if input.is_tracked() { input } else { shard };
        let (device, dtype) = (parent.primitive().device(), parent.primitive().dtype());
        let out = B::float_zeros(Shape::new([1]), &device, dtype.into());
        AnchorBackward
            .prepare::<C>([parent.node()])
            .compute_bound()
            .stateless(out)
    }

    fn fsdp_kept(input: FloatTensor<Self>) -> FloatTensor<Self> {
        if !input.is_tracked() {
            return input;
        }
        let out = input.primitive().clone();
        KeptBackward
            .prepare::<C>([input.node()])
            .compute_bound()
            .stateless(out)
    }

    fn fsdp_gather(
        shard: FloatTensor<Self>,
        input: FloatTensor<Self>,
        full: FloatTensor<Self>,
        call: Call,
    ) -> FloatTensor<Self> {
        // A block whose input has a gradient needs its parameters in backward (for that
        // gradient): only such a block is gathered ahead there (one whose input has none may
        // not be gathered again at all).
        let input_tracked = input.is_tracked() && input.id() != shard.id();
        let anchor = Self::fsdp_anchor(input, shard.clone());
        let full = full.into_primitive();
        let prep = GatherBackward.prepare::<C>([shard.node(), anchor.node()]);
        let prep = match call.shared.strategy {
            ShardingStrategy::FullShard => prep
                .memory_bound()
                .retro_forward(RetroGather::<B> {
                    shard: shard.id(),
                    anchor: anchor.id(),
                    call: call.clone(),
                    _backend: PhantomData,
                })
                .parents([&shard, &anchor]),
            _ => prep.compute_bound(),
        };
        match prep.stateful() {
            OpsKind::Tracked(prep) => {
                let ahead = input_tracked
                    .then(|| Tensor::<1>::from_primitive::<B>(shard.primitive().clone()));
                step::forward(&call.shared, ahead).unwrap_or_else(|e| panic!("{e}"));
                prep.finish(call, full)
            }
            OpsKind::UnTracked(prep) => prep.finish(full),
        }
    }
}

/// The gather again, in backward (burn's gradient checkpointing drops the gathered
/// parameters after the forward pass when the strategy is `FullShard`): the one started ahead
/// if there is one; and the gather of the block before this one in the forward pass, which
/// backward reaches next, starts now (backward prefetch, as FSDP's `BACKWARD_PRE`).
#[derive(Debug)]
struct RetroGather<B> {
    shard: NodeId,
    anchor: NodeId,
    call: Call,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend> RetroForward for RetroGather<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let shard = states.get_state::<FloatTensor<B>>(&self.shard);
        // Counted as needed by burn, as every parent is: taken, so that burn lets it go.
        let _anchor = states.get_state::<FloatTensor<B>>(&self.anchor);
        let shard = Tensor::<1>::from_primitive::<B>(shard);
        let shared = &self.call.shared;
        step::regathered(shared);
        let work = step::take_prefetched(shared).unwrap_or_else(|| start(shared, shard));
        // The block backward reaches next: its gather runs while this one's backward computes.
        if let Some((next, shard)) = step::ahead_of(shared) {
            step::prefetched(&next, start(&next, shard));
        }
        let full = step::wait_exposed(work, step::Wait::Gather).unwrap_or_else(|e| panic!("{e}"));
        states.save(out_node, primitive::<B>(&self.call.shared, full));
    }
}

/// The backward step of [`FsdpBackend::fsdp_anchor`]: nothing, no gradient flows through it.
#[derive(Debug)]
struct AnchorBackward;

impl<B: Backend> Backward<B, 1> for AnchorBackward {
    type State = ();

    fn backward(self, _: Ops<Self::State, 1>, _: &mut Gradients, _: &mut Checkpointer) {}
}

/// The backward step of [`FsdpBackend::fsdp_kept`]: the gradient passes through.
#[derive(Debug)]
struct KeptBackward;

impl<B: Backend> Backward<B, 1> for KeptBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [input] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(input) = input {
            grads.register::<B>(input.id, grad);
        }
    }
}

/// The block's input (a float tensor of any rank) kept from the forward pass
/// ([`FsdpBackend::fsdp_kept`]).
pub(super) fn kept(input: DispatchTensor) -> DispatchTensor {
    <burn::backend::Dispatch as FsdpBackend>::fsdp_kept(input)
}

/// The backward step of [`FsdpBackend::fsdp_gather`].
#[derive(Debug)]
struct GatherBackward;

impl<B: Backend> Backward<B, 2> for GatherBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = Call;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [shard, _anchor] = ops.parents;
        // The pieces' stand-in; their gradients wait in `piece`, joined here once.
        let stand_in = Tensor::<1>::from_primitive::<B>(grads.consume::<B>(&ops.node));
        let grad = piece::take(ops.node.id, ops.state.len, &stand_in);
        let shared = ops.state.shared;
        let ready =
            step::backward(&shared, shard.map(|n| n.id), grad).unwrap_or_else(|e| panic!("{e}"));
        for (node, shard_grad, block) in ready {
            grads.register::<B>(node, primitive::<B>(&block, shard_grad));
        }
    }
}

/// `t`'s primitive on the backend `B` of the operation.
fn primitive<B: Backend>(shared: &Shared, t: Tensor<1>) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    t.try_into_primitive::<B>().unwrap_or_else(|e| {
        panic!(
            "{}",
            shared.error(format!("a reduced tensor changed backend: {e:?}"))
        )
    })
}
