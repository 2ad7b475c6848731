//! The custom autodiff operation of [`SyncBatchNorm`](super::SyncBatchNorm): `x̂ = (x - μ) / σ`
//! with the global statistics `μ`, `σ`, whose backward all-reduces the per-channel sums
//! `[Σg, Σg·x̂]` over every rank and returns the exact input gradient
//! `dx = (g - Σg/N - x̂·Σ(g·x̂)/N) / σ`, `N` the global number of values per channel.
//!
//! burn's autodiff would differentiate `(x - μ) / σ` as if `μ` and `σ` were constants (they
//! come from an all-reduce of detached tensors); the terms through `μ` and `σ` need every
//! rank's gradients, so the backward itself communicates. A backend extension with a
//! hand-written [`Backward`] is burn 0.22's way to do that from outside burn.

use std::sync::Arc;

#[cfg(any(feature = "wgpu", feature = "nccl"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Backend, DispatchKindConversion, DispatchTensor, Flex, Shape, Slice, TensorMetadata,
    backend_extension,
};
use burn::tensor::Tensor;

use crate::{ProcessGroup, ReduceOp};

/// What the backward pass needs besides tensors: the group its all-reduce runs in, captured
/// when the forward pass ran.
#[derive(Clone, Debug)]
pub(super) struct SyncWith {
    pub(super) group: Arc<ProcessGroup>,
}

/// Normalisation with given statistics, differentiated across the process group.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "nccl")))]
pub(super) trait SyncBnBackend: Backend {
    /// `(x - mean) * invstd` per channel of `x` (`[N, C, ...]`); `mean` and `invstd` are `[C]`,
    /// `count` is `[1]`: the number of values per channel over all ranks (for the backward).
    fn sync_bn_normalize(
        x: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        invstd: FloatTensor<Self>,
        count: FloatTensor<Self>,
        sync: SyncWith,
    ) -> FloatTensor<Self> {
        let _ = (count, sync);
        normalize::<Self>(x, mean, invstd)
    }
}

impl SyncBnBackend for Flex {}
#[cfg(any(feature = "wgpu", feature = "nccl"))]
impl SyncBnBackend for Cube {}

impl<B: Backend, C: CheckpointStrategy> SyncBnBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn sync_bn_normalize(
        x: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        invstd: FloatTensor<Self>,
        count: FloatTensor<Self>,
        sync: SyncWith,
    ) -> FloatTensor<Self> {
        // The statistics are constants of the graph: their dependence on x is the backward's.
        let (mean, invstd, count) = (
            mean.into_primitive(),
            invstd.into_primitive(),
            count.into_primitive(),
        );
        match SyncBnBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xhat = normalize::<B>(x.primitive().clone(), mean, invstd.clone());
                let state = SyncBnState {
                    xhat: xhat.clone(),
                    invstd,
                    count,
                    sync,
                };
                prep.finish(state, xhat)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(normalize::<B>(x.into_primitive(), mean, invstd))
            }
        }
    }
}

/// The shape `[1, C, 1, ...]` that broadcasts a `[C]` tensor over `shape` (`[N, C, ...]`).
fn per_channel(shape: &Shape) -> Shape {
    let mut dims = vec![1; shape.num_dims()];
    dims[1] = shape[1];
    Shape::from(dims)
}

/// `(x - mean) * invstd`, per channel. An empty batch is its own result.
fn normalize<B: Backend>(
    x: FloatTensor<B>,
    mean: FloatTensor<B>,
    invstd: FloatTensor<B>,
) -> FloatTensor<B> {
    let shape = x.shape();
    if shape.num_elements() == 0 {
        return x;
    }
    let per_channel = per_channel(&shape);
    let centered = B::float_sub(x, B::float_reshape(mean, per_channel.clone()));
    B::float_mul(centered, B::float_reshape(invstd, per_channel))
}

/// The backward step of [`SyncBnBackend::sync_bn_normalize`].
#[derive(Debug)]
struct SyncBnBackward;

/// What the backward keeps from the forward pass.
#[derive(Clone, Debug)]
struct SyncBnState<B: Backend> {
    xhat: FloatTensor<B>,
    invstd: FloatTensor<B>,
    count: FloatTensor<B>,
    sync: SyncWith,
}

impl<B: Backend> Backward<B, 1> for SyncBnBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = SyncBnState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let SyncBnState {
            xhat,
            invstd,
            count,
            sync,
        } = ops.state;
        let shape = xhat.shape();
        let (channels, numel) = (shape[1], shape.num_elements());

        // Every rank takes part in the all-reduce, an empty batch with zeros.
        let sums = if numel == 0 {
            let (device, dtype) = (invstd.device(), invstd.dtype());
            B::float_zeros(Shape::new([2 * channels]), &device, dtype.into())
        } else {
            let flat = Shape::new([channels, numel / channels]);
            let by_channel = |t: FloatTensor<B>| {
                let t = B::float_reshape(B::float_swap_dims(t, 0, 1), flat.clone());
                B::float_reshape(B::float_sum_dim(t, 1), Shape::new([channels]))
            };
            let sum_g = by_channel(grad.clone());
            let sum_gx = by_channel(B::float_mul(grad.clone(), xhat.clone()));
            B::float_cat(vec![sum_g, sum_gx], 0)
        };
        let sums = all_reduce::<B>(&sync.group, sums);

        let Some(node) = node_x else { return };
        if numel == 0 {
            grads.register::<B>(node.id, grad);
            return;
        }
        let per_channel = per_channel(&shape);
        let inv_count = B::float_recip(count);
        let mean_of = |range: std::ops::Range<usize>| {
            let part = B::float_slice(sums.clone(), &[Slice::from(range)]);
            B::float_reshape(B::float_mul(part, inv_count.clone()), per_channel.clone())
        };
        let (mean_g, mean_gx) = (mean_of(0..channels), mean_of(channels..2 * channels));
        let centered = B::float_sub(grad, mean_g);
        let projected = B::float_mul(xhat, mean_gx);
        let x_grad = B::float_mul(
            B::float_sub(centered, projected),
            B::float_reshape(invstd, per_channel),
        );
        grads.register::<B>(node.id, x_grad);
    }
}

/// Sums `sums` over the group, on its device (the tensor collectives: NCCL on CUDA, the TCP
/// ring otherwise). A failed collective panics with the group's error: the group has recorded
/// it, and the backward pass cannot return an error.
fn all_reduce<B: Backend>(group: &ProcessGroup, sums: FloatTensor<B>) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let tensor = Tensor::<1>::from_primitive::<B>(sums);
    let reduced = group
        .all_reduce(tensor, ReduceOp::Sum)
        .wait()
        .unwrap_or_else(|e| panic!("{e}"));
    reduced.try_into_primitive::<B>().unwrap_or_else(|e| {
        panic!("SyncBatchNorm backward: the reduced sums changed backend: {e:?}")
    })
}
