//! Clipping the averaged gradients by their global norm, as PyTorch's `clip_grad_norm_` (and
//! FSDP's): the L2 norm over every trainable parameter of the model, the shards of wrapped
//! blocks included, the same number on every rank; when it exceeds the limit, every gradient is
//! scaled by `max / norm`. burn's own `GradientClippingConfig::Norm` clips each tensor by its own
//! norm, and a wrapped block is one tensor per rank (its shard).
//!
//! Each rank adds the squares of what it alone knows once and of what every rank holds alike
//! divided by the world size: the parameters it owns under ZeRO (or, unsharded, every
//! replicated parameter over the world size), its shard of each sharded block, and a
//! `NoShard` block over the world size. One all-reduce of that sum gives every rank the total.

use std::collections::HashSet;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

use super::GradientReducer;
use crate::ReduceOp;
use crate::error::{DdpError, Result};

impl GradientReducer {
    /// Clips by the global norm the limit set with [`GradientReducer::clip_grad_norm`] (nothing
    /// without one); a collective at world sizes above 1. A norm that is not finite leaves
    /// the gradients as they are (the non-finite check decides about them).
    pub(super) fn clip<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let Some(max) = self.clip_norm else {
            return Ok(grads);
        };
        if !(max.is_finite() && max > 0.0) {
            return Err(DdpError::InvalidConfig(format!(
                "rank {}: clip_grad_norm({max}): the largest norm must be a finite number above 0",
                self.group.rank()
            )));
        }
        let world = self.group.world_size();
        let owned = self.owned_ids(model);
        let mut squares = Squares {
            grads: &grads,
            owned: owned.as_ref(),
            seen: HashSet::new(),
            whole: Vec::new(),
            shared: Vec::new(),
        };
        crate::fsdp::replicated(|| model.visit(&mut squares));
        let (mut whole, mut shared) = (squares.whole, squares.shared);
        for (grad, sharded) in crate::fsdp::block_gradients(model, &grads) {
            let sum = square_sum(grad);
            match sharded {
                true => whole.push(sum),
                false => shared.push(sum),
            }
        }
        let local = total(whole) + total(shared) / world as f64;
        let sum = match world {
            1 => local,
            _ => {
                let summed = self.group.all_reduce(vec![local], ReduceOp::Sum).wait()?;
                summed.first().copied().unwrap_or(local)
            }
        };
        let norm = sum.sqrt();
        let scale = max as f64 / (norm + 1e-6);
        if !norm.is_finite() || scale >= 1.0 {
            return Ok(grads);
        }
        log::debug!(
            "rank {}: gradient norm {norm:.4e} clipped to {max}",
            self.group.rank()
        );
        let mut scaled = Scale {
            grads,
            scale: scale as f32,
            seen: HashSet::new(),
        };
        model.visit(&mut scaled);
        Ok(scaled.grads)
    }
}

/// The sum of the squares of `grad`'s elements, in f32, as a one-element tensor.
fn square_sum<const D: usize>(grad: Tensor<D>) -> Tensor<1> {
    let g = grad.cast(DType::F32);
    (g.clone() * g).sum()
}

/// The sum of one-element tensors, read back once.
fn total(sums: Vec<Tensor<1>>) -> f64 {
    if sums.is_empty() {
        return 0.0;
    }
    let sum: f32 = Tensor::cat(sums, 0).sum().into_scalar();
    f64::from(sum)
}

/// The squares of the replicated parameters' gradients: `whole` those this rank alone counts
/// (it owns them under ZeRO), `shared` those every rank counts alike.
struct Squares<'a> {
    grads: &'a GradientsParams,
    owned: Option<&'a HashSet<u64>>,
    /// Parameters counted (one reached twice, tied, counts once).
    seen: HashSet<u64>,
    whole: Vec<Tensor<1>>,
    shared: Vec<Tensor<1>>,
}

impl ModuleVisitor for Squares<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.seen.insert(param.id.val()) {
            return;
        }
        let Some(grad) = self.grads.get::<D>(param.id) else {
            return;
        };
        match self.owned {
            Some(owned) if owned.contains(&param.id.val()) => self.whole.push(square_sum(grad)),
            Some(_) => {}
            None => self.shared.push(square_sum(grad)),
        }
    }
}

/// Every gradient of the model's parameters (shards included) scaled.
struct Scale {
    grads: GradientsParams,
    scale: f32,
    /// Parameters scaled (one reached twice, tied, is scaled once).
    seen: HashSet<u64>,
}

impl ModuleVisitor for Scale {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.seen.insert(param.id.val()) {
            return;
        }
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            self.grads
                .register::<D>(param.id, grad.mul_scalar(self.scale));
        }
    }
}
