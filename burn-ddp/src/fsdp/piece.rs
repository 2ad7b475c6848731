//! A parameter of a wrapped block cut out of the gathered flat vector, as a custom autodiff
//! operation whose backward hands its gradient to the gather instead of spreading it over the
//! whole vector.
//!
//! burn's own `narrow` differentiates into a zero tensor of the whole vector with the gradient
//! written into it, added to the others: for a block of `k` parameters, `3k` passes over the
//! whole block per step. Here each piece's gradient waits, on this thread, under the gather's
//! node ([`take`]), and the gather's backward (which runs after every piece's: burn runs
//! backward deepest first, and the pieces are the gather's children) joins them once. The
//! pieces register a one-element zero gradient for the gather, which burn needs to run its step.
//!
//! Under gradient checkpointing a piece is memory-bound with a retro-forward (the cut again),
//! as burn's `narrow` is, so that the gathered vector is not kept alive by the pieces.

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;

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
    Backend, DispatchKindConversion, DispatchTensor, Flex, Shape, Slice, TensorMetadata,
    backend_extension,
};
use burn::tensor::Tensor;

use crate::collectives::backend::slices::concat;

/// Where a parameter lies in the flat vector, and its shape.
#[derive(Clone, Debug)]
pub(super) struct Piece {
    offset: usize,
    shape: Shape,
}

impl Piece {
    fn numel(&self) -> usize {
        self.shape.num_elements()
    }

    /// `full`'s elements of this piece, in its shape.
    fn cut<B: Backend>(&self, full: FloatTensor<B>) -> FloatTensor<B> {
        let end = (self.offset + self.numel()) as isize;
        let slice = Slice::new(self.offset as isize, Some(end), 1);
        B::float_reshape(B::float_slice(full, &[slice]), self.shape.clone())
    }
}

thread_local! {
    /// The pieces' gradients (offset, flat gradient) waiting for their gather's backward, by
    /// the gather's node.
    static WAITING: RefCell<HashMap<NodeId, Vec<(usize, Tensor<1>)>>> = RefCell::default();
}

/// The parameter of `shape` at `offset` in `full` (the gathered flat vector, an output of the
/// gather operation when tracked by autodiff).
pub(super) fn cut<const D: usize>(full: &Tensor<1>, offset: usize, shape: Shape) -> Tensor<D> {
    if !full.is_tracked() {
        return full
            .clone()
            .narrow(0, offset, shape.num_elements())
            .reshape(shape);
    }
    let piece = Piece { offset, shape };
    let out =
        <burn::backend::Dispatch as PieceBackend>::fsdp_piece(full.clone().into_dispatch(), piece);
    Tensor::from_dispatch(out)
}

/// The gradient of the gathered vector of `len` elements whose node is `node`: its pieces'
/// gradients in place, zeros where no piece received one (a parameter the block did not use,
/// the padding).
pub(super) fn take(node: NodeId, len: usize, like: &Tensor<1>) -> Tensor<1> {
    let mut pieces = WAITING
        .with(|w| w.borrow_mut().remove(&node))
        .unwrap_or_default();
    pieces.sort_by_key(|(offset, _)| *offset);
    let (device, dtype) = (like.device(), like.dtype());
    let zeros = |n: usize| Tensor::<1>::zeros([n], (&device, dtype));
    let mut parts = Vec::with_capacity(2 * pieces.len() + 1);
    let mut at = 0;
    for (offset, grad) in pieces {
        if offset > at {
            parts.push(zeros(offset - at));
        }
        at = offset + grad.dims()[0];
        parts.push(grad);
    }
    if len > at {
        parts.push(zeros(len - at));
    }
    concat(parts, &device, dtype)
}

/// A parameter cut out of the gathered vector, differentiated into the gather.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "nccl")))]
pub(super) trait PieceBackend: Backend {
    /// `full`'s elements of `piece`, in its shape.
    fn fsdp_piece(full: FloatTensor<Self>, piece: Piece) -> FloatTensor<Self> {
        piece.cut::<Self>(full)
    }
}

impl PieceBackend for Flex {}
#[cfg(any(feature = "wgpu", feature = "nccl"))]
impl PieceBackend for Cube {}

impl<B: Backend, C: CheckpointStrategy> PieceBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn fsdp_piece(full: FloatTensor<Self>, piece: Piece) -> FloatTensor<Self> {
        let prep = PieceBackward
            .prepare::<C>([full.node()])
            .memory_bound()
            .retro_forward(RetroPiece::<B> {
                full: full.id(),
                piece: piece.clone(),
                _backend: PhantomData,
            })
            .parents([&full]);
        let out = piece.cut::<B>(full.into_primitive());
        match prep.stateful() {
            OpsKind::Tracked(prep) => prep.finish(piece, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// The cut again, in backward, from the gathered vector burn recomputed.
#[derive(Debug)]
struct RetroPiece<B> {
    full: NodeId,
    piece: Piece,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend> RetroForward for RetroPiece<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let full = states.get_state::<FloatTensor<B>>(&self.full);
        states.save(out_node, self.piece.cut::<B>(full));
    }
}

/// The backward step of [`PieceBackend::fsdp_piece`].
#[derive(Debug)]
struct PieceBackward;

impl<B: Backend> Backward<B, 1> for PieceBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = Piece;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [full] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(full) = full else {
            return;
        };
        let piece = ops.state;
        let (device, dtype) = (grad.device(), grad.dtype());
        let flat = B::float_reshape(grad, Shape::new([piece.numel()]));
        let flat = Tensor::<1>::from_primitive::<B>(flat);
        WAITING.with(|w| {
            (w.borrow_mut().entry(full.id).or_default()).push((piece.offset, flat));
        });
        grads.register::<B>(
            full.id,
            B::float_zeros(Shape::new([1]), &device, dtype.into()),
        );
    }
}
