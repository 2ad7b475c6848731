//! Bucketed gradient all-reduce: gradients are taken from burn's `GradientsParams`, packed into
//! one flat tensor per bucket on the training device, averaged across ranks, and unpacked.
//!
//! Each bucket is handed to the process group's tensor all-reduce as soon as it is packed, and
//! the next bucket is packed while it travels; how it travels is the group's business (the
//! backend of the device kind, see `collectives::device`). A parameter without a gradient on this rank takes
//! part as zeros, so all ranks' buckets agree; a presence flag per parameter travels at the end
//! of each bucket, and a parameter that no rank produced a gradient for stays without one. Last
//! comes the bucket's [fingerprint](crate::train::reducer::fingerprint). Buckets are summed, then the gradients
//! scaled by `1 / world` on the device (flags and fingerprint stay exact sums).
//!
//! With the gradients sharded ([`Sharding::OptimizerAndGradients`]) each bucket is
//! reduce-scattered into its owners' parts instead, and each rank unpacks its own part; the
//! trailers then travel apart as with compression, so that every rank checks all of them and all
//! take the same decision (a desync, a skipped step).
//!
//! With [compression](crate::train::reducer::compression) the buckets hold only gradients, in a 16-bit format,
//! and the flags and fingerprints of all buckets travel in `f32` in one more, small all-reduce
//! per step (16-bit formats cannot hold their sums exactly).
//!
//! The flags and fingerprints of all buckets of a step are read back to the host together,
//! once the step's last bucket is reduced: one small device-to-host read per step, not one per
//! bucket (each read waits for the device). It is done in the same step, not one step late,
//! because a failed fingerprint must stop the step before the optimizer applies gradients that
//! mix different steps or models.
//!
//! Why not overlap with backward: burn 0.22's autodiff runs `backward()` to completion inside one
//! call and returns `Gradients` only at the end. Its gradient-registration hook (used by burn's
//! own in-process DDP) is crate-private to burn-autodiff and tied to burn's `DistributedContext`,
//! so a crate outside burn cannot start a bucket's reduction while backward still runs.
//! Communication therefore overlaps with packing and unpacking, not with backward.

pub(crate) mod bucket;
pub(crate) mod compression;
pub(crate) mod fingerprint;
pub(crate) mod non_finite;
pub(crate) mod ownership;
pub(crate) mod params;
mod receive;
mod sharded;
mod share;
mod visit;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use self::receive::average;
use self::visit::{RegisterGradients, take_gradients};
use crate::ProcessGroup;
use crate::collectives::ReduceOp;
use crate::error::Result;
use crate::train::reducer::bucket::{BucketConfig, BucketPlan};
use crate::train::reducer::compression::{Compressed, Compression};
use crate::train::reducer::fingerprint::{FINGERPRINT_LEN, Fingerprint};
use crate::train::reducer::non_finite::NonFinite;
use crate::train::reducer::ownership::{Owners, Sharding};
use crate::train::reducer::params::{ParamInfo, layout};
use crate::train::report::telemetry::StepStats;
use crate::train::report::telemetry::trace::{COMPUTE, Span, Trace};

/// Averages gradients across the ranks of a group, bucket by bucket.
pub struct GradientReducer {
    group: Arc<ProcessGroup>,
    /// Trainable parameters in visit order (bucket plan indices refer to this list).
    params: Vec<ParamInfo>,
    plan: BucketPlan,
    /// Reductions done (the fingerprint's step).
    steps: AtomicU64,
    /// Whether fingerprints are checked (on unless switched off to measure their cost).
    check: bool,
    /// The format buckets travel in.
    compression: Compression,
    /// What a non-finite gradient on some rank comes to.
    non_finite: NonFinite,
    /// How the optimizer's work is sharded, and (when it is, on several ranks) who owns what:
    /// with the gradients sharded `plan` is then the owners' plan (ZeRO-1 keeps plain DDP's).
    sharding: Sharding,
    owners: Option<Owners>,
}

/// A bucket's reduction under way, and when it was sent.
type InFlight = (Compressed, Instant);

/// How one step's buckets are sent (see [`GradientReducer::send_buckets`]).
struct Sending<'a> {
    /// The step, for the fingerprints.
    at: (usize, usize),
    device: &'a Device,
    /// The owners' parts when buckets are reduce-scattered.
    scatter: Option<&'a Owners>,
    /// Whether the trailers travel apart from their buckets (compressed or scattered).
    trailers_apart: bool,
    trace: Option<&'a Trace>,
}

impl GradientReducer {
    /// Plans the buckets of `model`'s trainable parameters.
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
        Ok(GradientReducer {
            group,
            params,
            plan,
            steps: AtomicU64::new(0),
            check: true,
            compression: Compression::None,
            non_finite: NonFinite::default(),
            sharding: Sharding::None,
            owners: None,
        })
    }

    /// Shards the optimizer's work (default [`Sharding::None`]; every rank must choose the
    /// same): each rank then owns a part of the parameters, and the reductions hand back only
    /// its own parameters' gradients (see [`Sharding`]). A hand-written loop then steps its
    /// optimizer and calls [`GradientReducer::share_parameters`] for the others' parameters.
    pub fn sharding(mut self, sharding: Sharding) -> Self {
        self.sharding = sharding;
        self.owners = None;
        let world = self.group.world_size();
        if sharding.shards() && world > 1 {
            let sizes: Vec<usize> = self.params.iter().map(ParamInfo::numel).collect();
            let owners = Owners::new(&self.plan, &sizes, world, self.group.rank());
            // ZeRO-2 reduce-scatters the owners' layout (each owner's part one range); ZeRO-1
            // all-reduces plain DDP's layout, so its gradients are plain DDP's, bit for bit.
            if sharding == Sharding::OptimizerAndGradients {
                self.plan = owners.plan.clone();
            }
            self.owners = Some(owners);
        }
        self
    }

    /// Whether buckets carry and check a fingerprint (default true; every rank must choose the
    /// same). It costs 24 values per bucket; switch it off only to measure that cost.
    pub fn desync_check(mut self, check: bool) -> Self {
        self.check = check;
        self
    }

    /// The format buckets travel in (default [`Compression::None`]; every rank must choose the
    /// same).
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// What a NaN or an infinity in some rank's gradients comes to (default
    /// [`NonFinite::Stop`]; every rank must choose the same).
    pub fn non_finite(mut self, non_finite: NonFinite) -> Self {
        self.non_finite = non_finite;
        self
    }

    /// Values of bucket `b`'s trailer: presence flags, then the fingerprint, then one non-finite
    /// slot per rank.
    fn trailer_len(&self, b: usize) -> usize {
        let fingerprint = if self.check { FINGERPRINT_LEN } else { 0 };
        let slots = if self.non_finite.checks() {
            self.group.world_size()
        } else {
            0
        };
        self.plan.buckets[b].params.len() + fingerprint + slots
    }

    /// Bytes one reduction sends into the all-reduces (each rank's buffers: gradients, presence
    /// flags and fingerprints), before the transport's own overhead.
    pub fn bytes_per_step(&self) -> usize {
        let per_value = self.compression.bytes_per_value();
        (self.plan.buckets.iter().enumerate())
            .map(|(i, b)| b.len * per_value + self.trailer_len(i) * 4)
            .sum()
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
        grads: GradientsParams,
        epoch: usize,
        step: usize,
    ) -> Result<GradientsParams> {
        self.reduce_traced(model, grads, (epoch, step), None)
            .map(|(grads, _)| grads)
    }

    /// [`GradientReducer::reduce_at`] at `(epoch, step)`, measured: the step's packing and
    /// communication figures (its `compute` left 0), and each bucket's spans in `trace`.
    pub(crate) fn reduce_traced<M: Module>(
        &self,
        model: &M,
        mut grads: GradientsParams,
        at: (usize, usize),
        trace: Option<&Trace>,
    ) -> Result<(GradientsParams, StepStats)> {
        let mut stats = StepStats::default();
        if self.group.world_size() == 1 {
            return Ok((grads, stats));
        }
        let (mut flat, device) = take_gradients(model, &mut grads, self.params.len())?;
        let Some(device) = device else {
            return Ok((grads, stats));
        };
        let n = self.plan.buckets.len();
        let compressed = self.compression != Compression::None;
        // Sharding the gradients: each bucket is reduce-scattered into its owners' parts.
        let scatter = match (&self.owners, self.sharding) {
            (Some(owners), Sharding::OptimizerAndGradients) => Some(owners),
            _ => None,
        };
        // Compressed or scattered: the trailers of all buckets, for one f32 all-reduce after the
        // buckets (every rank needs all of them).
        let trailers_apart = compressed || scatter.is_some();
        let sending = Sending {
            at,
            device: &device,
            scatter,
            trailers_apart,
            trace,
        };
        let (pending, trailers) = self.send_buckets(&sending, &mut flat, &mut stats)?;
        let first_sent = pending.first().map(|(_, sent)| *sent);
        let trailers = trailers_apart.then(|| self.group.all_reduce(trailers, ReduceOp::Sum));
        let summed = self.wait_buckets(pending, trace, &mut stats)?;
        let unpacking = Instant::now();
        let (averaged, trailers) = match trailers {
            // Compressed buckets were divided by the world size before they travelled.
            Some(work) if compressed => (summed, work.wait()?),
            Some(work) => (average(summed, self.group.world_size()), work.wait()?),
            None => self.split_trailers(summed)?,
        };
        // The elements of each bucket this rank received: its part, or all of it.
        let windows: Vec<_> = (0..n)
            .map(|b| scatter.map_or(0..self.plan.buckets[b].len, |o| o.window(b)))
            .collect();
        let mut reduced = self.unpack(at, averaged, &windows, &trailers)?;
        if let Some(owners) = &self.owners {
            owners.keep_own(&mut reduced);
        }
        model.visit(&mut RegisterGradients {
            grads: &mut grads,
            flat: reduced.into_iter(),
        });
        if let Some(trace) = trace {
            trace.span(Span::named("unpack"), COMPUTE, unpacking, Instant::now());
        }
        stats.communication = first_sent.map_or(0.0, |t| (unpacking - t).as_secs_f64());
        stats.bytes = self.bytes_per_step() as f64;
        Ok((grads, stats))
    }

    /// Packs every bucket and starts its reduction (an all-reduce, or a reduce-scatter into
    /// its owners' parts), in plan order; each bucket's trailer goes with it, or into the returned
    /// trailers when they travel apart. Adds the packing time to `stats.pack`.
    fn send_buckets(
        &self,
        how: &Sending<'_>,
        flat: &mut [Option<Tensor<1>>],
        stats: &mut StepStats,
    ) -> Result<(Vec<InFlight>, Vec<f32>)> {
        let n = self.plan.buckets.len();
        let mut pending = Vec::with_capacity(n);
        let mut trailers = Vec::new();
        for b in 0..n {
            let packing = Instant::now();
            let (mut parts, trailer) = self.pack(b, how.at, flat, how.device)?;
            if how.trailers_apart {
                trailers.extend(trailer);
            } else {
                let n = trailer.len();
                parts.push(Tensor::from_data(TensorData::new(trailer, [n]), how.device));
            }
            let bucket = Tensor::cat(parts, 0);
            let sent = Instant::now();
            stats.pack += (sent - packing).as_secs_f64();
            if let Some(trace) = how.trace {
                trace.span(Span::bucket("pack bucket", b), COMPUTE, packing, sent);
            }
            let parts_b = how.scatter.map(|o| o.parts[b].as_slice());
            let work = (self.compression).start(&self.group, bucket, parts_b, how.device)?;
            pending.push((work, sent));
        }
        Ok((pending, trailers))
    }

    fn fingerprint(&self, b: usize, (epoch, step): (usize, usize)) -> Fingerprint {
        Fingerprint {
            epoch,
            step,
            bucket: b,
            len: self.plan.buckets[b].len,
        }
    }

    /// Bucket `b`'s gradients on the device (zeros where missing), in plan order, and its trailer:
    /// one presence flag per parameter, the fingerprint, this rank's non-finite slots.
    fn pack(
        &self,
        b: usize,
        at: (usize, usize),
        flat: &mut [Option<Tensor<1>>],
        device: &Device,
    ) -> Result<(Vec<Tensor<1>>, Vec<f32>)> {
        let bucket = &self.plan.buckets[b];
        let mut trailer = Vec::with_capacity(self.trailer_len(b));
        let parts: Vec<Tensor<1>> = bucket
            .params
            .iter()
            .map(|&p| match flat[p].take() {
                Some(g) => {
                    trailer.push(1.0f32);
                    g
                }
                None => {
                    trailer.push(0.0);
                    Tensor::zeros([self.params[p].numel()], device)
                }
            })
            .collect();
        if self.check {
            trailer.extend(self.fingerprint(b, at).values());
        }
        if self.non_finite.checks() {
            let (rank, world) = (self.group.rank(), self.group.world_size());
            trailer.extend(NonFinite::slots(&parts, rank, world)?);
        }
        Ok((parts, trailer))
    }
}
