//! Bucketed gradient all-reduce: gradients are taken from burn's `GradientsParams`, packed into
//! one flat tensor per bucket on the training device, averaged across ranks, and unpacked.
//!
//! Bucket `i`'s reduction runs on the group's collective thread while bucket `i + 1` is packed
//! and bucket `i - 1` is unpacked. A parameter without a gradient on this rank takes part as
//! zeros, so all ranks' buckets agree; a presence flag per parameter travels at the end of each
//! bucket, and a parameter that no rank produced a gradient for stays without one. Last comes
//! the bucket's [fingerprint](super::fingerprint), checked after every reduction. Buckets are
//! summed, then the gradients scaled by `1 / world` on the device (flags and fingerprint stay
//! exact sums).
//!
//! Why not overlap with backward: burn 0.22's autodiff runs `backward()` to completion inside one
//! call and returns `Gradients` only at the end. Its gradient-registration hook (used by burn's
//! own in-process DDP) is crate-private to burn-autodiff and tied to burn's `DistributedContext`,
//! so a crate outside burn cannot start a bucket's reduction while backward still runs.
//! Communication therefore overlaps with packing and unpacking, not with backward.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use super::bucket::{BucketConfig, BucketPlan};
use super::fingerprint::{FINGERPRINT_LEN, Fingerprint};
use super::params::{ParamInfo, layout};
use crate::ProcessGroup;
use crate::collectives::{ReduceOp, Work};
use crate::error::{DdpError, Result};

/// Averages gradients across the ranks of a group, bucket by bucket.
pub struct GradientReducer {
    group: Arc<ProcessGroup>,
    transport: Transport,
    /// Trainable parameters in visit order (bucket plan indices refer to this list).
    params: Vec<ParamInfo>,
    plan: BucketPlan,
    /// Reductions done (the fingerprint's step).
    steps: AtomicU64,
    /// Whether fingerprints are checked (on unless switched off to measure their cost).
    check: bool,
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
    /// Plans the buckets of `model`'s trainable parameters and picks the transport: NCCL for a
    /// model on a CUDA device (feature `nccl`), the group's TCP collectives otherwise.
    pub fn new<M: Module>(
        model: &M,
        group: Arc<ProcessGroup>,
        config: BucketConfig,
    ) -> Result<Self> {
        let params: Vec<ParamInfo> = layout(model).into_iter().filter(|p| p.trainable).collect();
        let sizes: Vec<usize> = params.iter().map(ParamInfo::numel).collect();
        let plan = BucketPlan::new(&sizes, 4, &config);
        log::debug!(
            "rank {}: {} trainable tensors in {} buckets",
            group.rank(),
            params.len(),
            plan.buckets.len()
        );
        let device = model.devices().first().cloned().unwrap_or_default();
        let transport = if group.world_size() == 1 {
            Transport::Tcp
        } else {
            transport(&group, &device)?
        };
        Ok(GradientReducer {
            group,
            transport,
            params,
            plan,
            steps: AtomicU64::new(0),
            check: true,
        })
    }

    /// Whether buckets carry and check a fingerprint (default true; every rank must choose the
    /// same). It costs 24 values per bucket; switch it off only to measure that cost.
    pub fn desync_check(mut self, check: bool) -> Self {
        self.check = check;
        self
    }

    /// The bucket plan.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// The group gradients are averaged over.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// Averages `grads` over all ranks. Every rank must call it at the same step; the
    /// fingerprint counts the calls (use [`GradientReducer::reduce_at`] to name the step).
    pub fn reduce<M: Module>(&self, model: &M, grads: GradientsParams) -> Result<GradientsParams> {
        let n = self.steps.fetch_add(1, Ordering::Relaxed);
        self.reduce_at(model, grads, 0, n as usize)
    }

    /// Averages `grads` of training step `step` of `epoch` over all ranks; ranks at another
    /// epoch or step are a desync error on every rank.
    pub fn reduce_at<M: Module>(
        &self,
        model: &M,
        mut grads: GradientsParams,
        epoch: usize,
        step: usize,
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
        let mut in_flight: Option<(usize, InFlight)> = None;
        let n = self.plan.buckets.len();
        let at = (epoch, step);
        let status = self.group.status();
        let finish = |b: usize, f: InFlight, reduced: &mut [Option<Tensor<1>>]| {
            status.activity(Some(format!("waits for bucket {} of {n}", b + 1)));
            let done = f.finish(&device);
            status.activity(None);
            self.unpack(b, at, done?, reduced)
        };
        for b in 0..n {
            let started = self.start(self.pack(b, at, &mut flat, &device))?;
            if let Some((prev, f)) = in_flight.replace((b, started)) {
                finish(prev, f, &mut reduced)?;
            }
        }
        if let Some((last, f)) = in_flight {
            finish(last, f, &mut reduced)?;
        }
        model.visit(&mut Give {
            grads: &mut grads,
            flat: reduced.into_iter(),
        });
        Ok(grads)
    }

    fn fingerprint(&self, b: usize, (epoch, step): (usize, usize)) -> Fingerprint {
        Fingerprint {
            epoch,
            step,
            bucket: b,
            len: self.plan.buckets[b].len,
        }
    }

    /// One contiguous tensor on the device: bucket `b`'s gradients (zeros where missing), one
    /// presence flag per parameter, then the fingerprint.
    fn pack(
        &self,
        b: usize,
        at: (usize, usize),
        flat: &mut [Option<Tensor<1>>],
        device: &Device,
    ) -> Tensor<1> {
        let bucket = &self.plan.buckets[b];
        let mut presence = Vec::with_capacity(bucket.params.len() + FINGERPRINT_LEN);
        let mut parts: Vec<Tensor<1>> = bucket
            .params
            .iter()
            .map(|&p| match flat[p].take() {
                Some(g) => {
                    presence.push(1.0f32);
                    g
                }
                None => {
                    presence.push(0.0);
                    Tensor::zeros([self.params[p].numel()], device)
                }
            })
            .collect();
        if self.check {
            presence.extend(self.fingerprint(b, at).values());
        }
        let n = presence.len();
        parts.push(Tensor::from_data(TensorData::new(presence, [n]), device));
        Tensor::cat(parts, 0)
    }

    /// Starts summing a packed bucket across the ranks.
    fn start(&self, packed: Tensor<1>) -> Result<InFlight> {
        match &self.transport {
            Transport::Tcp => {
                let values = host_f32(packed)?;
                Ok(InFlight::Tcp(self.group.all_reduce(values, ReduceOp::Sum)))
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(comm) => comm
                .all_reduce(packed, burn_ddp_nccl::ReduceOp::Sum)
                .map(|t| InFlight::Done(Box::new(t)))
                .map_err(|e| DdpError::Collective {
                    rank: self.group.rank(),
                    op: "NCCL all_reduce of a gradient bucket".into(),
                    // A failure another rank recorded (e.g. a desync) explains a timeout here.
                    cause: match self.group.recorded_failure() {
                        Some(recorded) => format!("{e}; recorded by the group: {recorded}"),
                        None => e.to_string(),
                    },
                    ranks: self.group.status().report(),
                }),
        }
    }

    /// Checks the fingerprint, averages the gradients and hands out those some rank produced.
    fn unpack(
        &self,
        b: usize,
        at: (usize, usize),
        summed: Tensor<1>,
        out: &mut [Option<Tensor<1>>],
    ) -> Result<()> {
        let bucket = &self.plan.buckets[b];
        let n = bucket.params.len();
        let world = self.group.world_size();
        let fingerprint = if self.check { FINGERPRINT_LEN } else { 0 };
        let tail = host_f32(summed.clone().narrow(0, bucket.len, n + fingerprint))?;
        if self.check
            && let Err(reason) = self.fingerprint(b, at).check(&tail[n..], world)
        {
            let cause = self.group.abort(&reason);
            return Err(DdpError::Collective {
                rank: self.group.rank(),
                op: format!(
                    "gradient reduction of epoch {} step {} (bucket {} of {})",
                    at.0,
                    at.1,
                    b + 1,
                    self.plan.buckets.len()
                ),
                cause,
                ranks: self.group.status().report(),
            });
        }
        let grads = summed
            .narrow(0, 0, bucket.len)
            .mul_scalar(1.0 / world as f32);
        for (k, (&p, &offset)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
            if tail[k] > 0.0 {
                out[p] = Some(grads.clone().narrow(0, offset, self.params[p].numel()));
            }
        }
        Ok(())
    }
}

/// A tensor's values on the host, as `f32`.
fn host_f32(t: Tensor<1>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DdpError::Tensor(format!("{e:?}")))
}

/// How buckets travel: TCP through the process group (CPU devices), or NCCL on the GPU.
enum Transport {
    Tcp,
    #[cfg(feature = "nccl")]
    Nccl(burn_ddp_nccl::NcclComm),
}

/// A bucket's reduction in progress.
enum InFlight {
    /// On the group's collective thread; comes back as host values.
    Tcp(Work<Vec<f32>>),
    /// Already reduced on the device (NCCL waits for its stream).
    #[cfg(feature = "nccl")]
    Done(Box<Tensor<1>>),
}

impl InFlight {
    fn finish(self, device: &Device) -> Result<Tensor<1>> {
        match self {
            InFlight::Tcp(work) => {
                let values = work.wait()?;
                let n = values.len();
                Ok(Tensor::from_data(TensorData::new(values, [n]), device))
            }
            #[cfg(feature = "nccl")]
            InFlight::Done(t) => Ok(*t),
        }
    }
}

/// Picks NCCL for CUDA devices (feature `nccl`), TCP otherwise.
#[cfg(feature = "nccl")]
fn transport(group: &ProcessGroup, device: &Device) -> Result<Transport> {
    if !burn_ddp_nccl::is_cuda(device) {
        return Ok(Transport::Tcp);
    }
    // Rank 0 creates the NCCL id; the others read it from the store.
    const KEY: &str = "bddp/nccl/id";
    let id: [u8; 128] = if group.rank() == 0 {
        let id = burn_ddp_nccl::unique_id(0).map_err(nccl_error(group, "creating the NCCL id"))?;
        group.store().set(KEY, &id)?;
        id
    } else {
        let bytes = group.store().get(KEY)?;
        bytes
            .as_slice()
            .try_into()
            .map_err(|_| DdpError::Rendezvous {
                rank: group.rank(),
                reason: format!(
                    "the NCCL id in the store has {} bytes, not 128",
                    bytes.len()
                ),
            })?
    };
    let comm = burn_ddp_nccl::NcclComm::new(
        group.rank(),
        group.world_size(),
        group.local_rank(),
        &id,
        group.options().timeout,
    )
    .map_err(nccl_error(group, "joining the NCCL communicator"))?;
    log::info!(
        "rank {}: gradients travel by NCCL on GPU {}",
        group.rank(),
        group.local_rank()
    );
    Ok(Transport::Nccl(comm))
}

#[cfg(feature = "nccl")]
fn nccl_error(
    group: &ProcessGroup,
    what: &'static str,
) -> impl Fn(burn_ddp_nccl::NcclError) -> DdpError {
    let rank = group.rank();
    move |e| DdpError::Rendezvous {
        rank,
        reason: format!("{what}: {e}"),
    }
}

#[cfg(not(feature = "nccl"))]
fn transport(_group: &ProcessGroup, _device: &Device) -> Result<Transport> {
    Ok(Transport::Tcp)
}
