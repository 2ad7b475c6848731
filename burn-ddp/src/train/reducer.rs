//! Bucketed gradient all-reduce: gradients are taken from burn's `GradientsParams`, packed into
//! one flat tensor per bucket on the training device, averaged across ranks, and unpacked.
//!
//! Bucket `i`'s reduction runs on the group's collective thread while bucket `i + 1` is packed
//! and bucket `i - 1` is unpacked. A parameter without a gradient on this rank takes part as
//! zeros, so all ranks' buckets agree; a presence flag per parameter travels at the end of each
//! bucket, and a parameter that no rank produced a gradient for stays without one.
//!
//! Why not overlap with backward: burn 0.22's autodiff runs `backward()` to completion inside one
//! call and returns `Gradients` only at the end. Its gradient-registration hook (used by burn's
//! own in-process DDP) is crate-private to burn-autodiff and tied to burn's `DistributedContext`,
//! so a crate outside burn cannot start a bucket's reduction while backward still runs.
//! Communication therefore overlaps with packing and unpacking, not with backward.

use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use super::bucket::{BucketConfig, BucketPlan};
use super::params::{ParamInfo, layout};
use crate::ProcessGroup;
use crate::collectives::{ReduceOp, Work};
use crate::error::{DdpError, Result};

/// Averages gradients across the ranks of a group, bucket by bucket.
pub struct GradientReducer {
    group: Arc<ProcessGroup>,
    /// Trainable parameters in visit order (bucket plan indices refer to this list).
    params: Vec<ParamInfo>,
    plan: BucketPlan,
}

/// Takes every trainable parameter's gradient out of `grads`, flattened, in visit order.
struct Take<'a> {
    grads: &'a mut GradientsParams,
    flat: Vec<Option<Tensor<1>>>,
    device: Option<Device>,
}

impl ModuleVisitor for Take<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.val().is_require_grad() {
            return;
        }
        let g = self.grads.remove::<D>(param.id);
        if let Some(g) = &g {
            self.device.get_or_insert_with(|| g.device());
        } else if self.device.is_none() {
            self.device = Some(param.val().device().inner());
        }
        let n = param.val().shape().num_elements();
        self.flat.push(g.map(|g| g.reshape([n])));
    }
}

/// Registers reduced gradients back, reshaped to each parameter's shape.
struct Give<'a> {
    grads: &'a mut GradientsParams,
    flat: std::vec::IntoIter<Option<Tensor<1>>>,
}

impl ModuleVisitor for Give<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.val().is_require_grad() {
            return;
        }
        if let Some(Some(g)) = self.flat.next() {
            self.grads
                .register::<D>(param.id, g.reshape(param.val().dims()));
        }
    }
}

impl GradientReducer {
    /// Plans the buckets of `model`'s trainable parameters.
    pub fn new<M: Module>(model: &M, group: Arc<ProcessGroup>, config: BucketConfig) -> Self {
        let params: Vec<ParamInfo> = layout(model).into_iter().filter(|p| p.trainable).collect();
        let sizes: Vec<usize> = params.iter().map(ParamInfo::numel).collect();
        let plan = BucketPlan::new(&sizes, 4, &config);
        log::debug!(
            "rank {}: {} trainable tensors in {} buckets",
            group.rank(),
            params.len(),
            plan.buckets.len()
        );
        GradientReducer {
            group,
            params,
            plan,
        }
    }

    /// The bucket plan.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// The group gradients are averaged over.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// Averages `grads` over all ranks. Every rank must call it at the same step.
    pub fn reduce<M: Module>(
        &self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        if self.group.world_size() == 1 {
            return Ok(grads);
        }
        let mut take = Take {
            grads: &mut grads,
            flat: Vec::with_capacity(self.params.len()),
            device: None,
        };
        model.visit(&mut take);
        let (mut flat, device) = (take.flat, take.device);
        if flat.len() != self.params.len() {
            return Err(DdpError::Disagreement(format!(
                "the model has {} trainable tensors, the bucket plan {}",
                flat.len(),
                self.params.len()
            )));
        }
        let Some(device) = device else {
            return Ok(grads);
        };

        let mut reduced: Vec<Option<Tensor<1>>> = vec![None; flat.len()];
        let mut in_flight: Option<(usize, Work<Vec<f32>>)> = None;
        for b in 0..self.plan.buckets.len() {
            let work = self
                .group
                .all_reduce(self.pack(b, &mut flat, &device)?, ReduceOp::Avg);
            if let Some((prev, w)) = in_flight.replace((b, work)) {
                self.unpack(prev, w.wait()?, &device, &mut reduced);
            }
        }
        if let Some((last, w)) = in_flight {
            self.unpack(last, w.wait()?, &device, &mut reduced);
        }
        model.visit(&mut Give {
            grads: &mut grads,
            flat: reduced.into_iter(),
        });
        Ok(grads)
    }

    /// One contiguous tensor of bucket `b`'s gradients (zeros where missing), on the device,
    /// then its values for the transport, followed by one presence flag per parameter.
    fn pack(&self, b: usize, flat: &mut [Option<Tensor<1>>], device: &Device) -> Result<Vec<f32>> {
        let bucket = &self.plan.buckets[b];
        let mut presence = Vec::with_capacity(bucket.params.len());
        let parts: Vec<Tensor<1>> = bucket
            .params
            .iter()
            .map(|&p| match flat[p].take() {
                Some(g) => {
                    presence.push(1.0);
                    g
                }
                None => {
                    presence.push(0.0);
                    Tensor::zeros([self.params[p].numel()], device)
                }
            })
            .collect();
        let packed = Tensor::cat(parts, 0);
        let mut values = packed
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| DdpError::Tensor(format!("{e:?}")))?;
        values.extend_from_slice(&presence);
        Ok(values)
    }

    fn unpack(
        &self,
        b: usize,
        mut values: Vec<f32>,
        device: &Device,
        out: &mut [Option<Tensor<1>>],
    ) {
        let bucket = &self.plan.buckets[b];
        let presence = values.split_off(bucket.len);
        let packed = Tensor::<1>::from_data(TensorData::new(values, [bucket.len]), device);
        for (k, (&p, &offset)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
            if presence[k] > 0.0 {
                out[p] = Some(packed.clone().narrow(0, offset, self.params[p].numel()));
            }
        }
    }
}
