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
mod clip;
pub(crate) mod compression;
pub(crate) mod fingerprint;
pub(crate) mod non_finite;
pub(crate) mod ownership;
pub(crate) mod params;
mod setup;
mod sharded;
mod share;

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use crate::ProcessGroup;
use crate::collectives::ReduceOp;
use crate::collectives::backend::slices::cut;
use crate::error::{DdpError, Result};
use crate::train::reducer::bucket::BucketPlan;
use crate::train::reducer::compression::{Compressed, Compression};
use crate::train::reducer::fingerprint::{FINGERPRINT_LEN, Fingerprint};
use crate::train::reducer::non_finite::NonFinite;
use crate::train::reducer::ownership::{Owners, Sharding};
use crate::train::reducer::params::ParamInfo;
use crate::train::report::telemetry::StepStats;
use crate::train::report::telemetry::trace::{COMMUNICATION, COMPUTE, Span, Trace};

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
    /// The largest global norm of the averaged gradients, if they are clipped.
    clip_norm: Option<f32>,
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
    /// communication figures (its `compute` left 0), and each bucket's spans in `trace`. The
    /// averaged gradients are then clipped by their global norm, if a limit is set.
    pub(crate) fn reduce_traced<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        at: (usize, usize),
        trace: Option<&Trace>,
    ) -> Result<(GradientsParams, StepStats)> {
        let (grads, stats) = self.average(model, grads, at, trace)?;
        Ok((self.clip(model, grads)?, stats))
    }

    /// The averaging of [`GradientReducer::reduce_traced`].
    fn average<M: Module>(
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
        if self.shards_not_finite(model, &grads, at)? {
            return Ok((GradientsParams::new(), stats));
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
        if reduced.is_empty() && !self.params.is_empty() {
            return Ok((GradientsParams::new(), stats));
        }
        if let Some(owners) = &self.owners {
            owners.keep_own(&mut reduced);
        }
        crate::fsdp::replicated(|| {
            model.visit(&mut RegisterGradients {
                grads: &mut grads,
                flat: reduced.into_iter(),
            })
        });
        if let Some(trace) = trace {
            trace.span(Span::named("unpack"), COMPUTE, unpacking, Instant::now());
        }
        stats.communication = first_sent.map_or(0.0, |t| (unpacking - t).as_secs_f64());
        stats.bytes = self.bytes_per_step() as f64;
        Ok((grads, stats))
    }

    /// The non-finite check of the gradients of wrapped blocks' shards ([`crate::fsdp`]),
    /// reduced in backward and so not in any bucket: each rank's slot in one small all-reduce
    /// (only for a model with wrapped blocks). `true` when the step is to be skipped.
    fn shards_not_finite<M: Module>(
        &self,
        model: &M,
        grads: &GradientsParams,
        at: (usize, usize),
    ) -> Result<bool> {
        if !self.non_finite.checks() || crate::fsdp::first_block(model).is_none() {
            return Ok(false);
        }
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let shards: Vec<_> = (crate::fsdp::block_gradients(model, grads).into_iter())
            .map(|(grad, _)| grad)
            .collect();
        let slots = NonFinite::slots(&shards, rank, world)?;
        let summed = self.group.all_reduce(slots, ReduceOp::Sum).wait()?;
        let culprits = NonFinite::marked(&summed);
        if culprits.is_empty() {
            return Ok(false);
        }
        match self.non_finite.decide(rank, &culprits, at) {
            Some(e) => Err(e),
            None => Ok(true),
        }
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

impl GradientReducer {
    /// Waits for the buckets in order, publishing which one this rank waits for; adds the
    /// time waited to `stats.exposed` and each bucket's travel to `trace`.
    fn wait_buckets(
        &self,
        pending: Vec<InFlight>,
        trace: Option<&Trace>,
        stats: &mut StepStats,
    ) -> Result<Vec<Tensor<1>>> {
        let status = self.group.status();
        let n = pending.len();
        let mut summed = Vec::with_capacity(n);
        for (b, (work, sent)) in pending.into_iter().enumerate() {
            status.activity(Some(format!("waits for bucket {} of {n}", b + 1)));
            let waiting = Instant::now();
            let done = work.wait();
            let received = Instant::now();
            status.activity(None);
            stats.exposed += (received - waiting).as_secs_f64();
            if let Some(trace) = trace {
                let span = Span::bucket("all-reduce bucket", b);
                trace.span(span, COMMUNICATION, sent, received);
            }
            summed.push(done?);
        }
        Ok(summed)
    }

    /// Uncompressed buckets: their averaged gradients, and every bucket's trailer read in one
    /// device-to-host copy.
    fn split_trailers(&self, summed: Vec<Tensor<1>>) -> Result<(Vec<Tensor<1>>, Vec<f32>)> {
        let world = self.group.world_size();
        let trailers: Vec<Tensor<1>> = (summed.iter().zip(&self.plan.buckets).enumerate())
            .map(|(b, (t, bucket))| cut(t, bucket.len, self.trailer_len(b)))
            .collect();
        let trailers = host_f32(Tensor::cat(trailers, 0))?;
        let grads = (summed.into_iter().zip(&self.plan.buckets))
            .map(|(sum, bucket)| cut(&sum, 0, bucket.len))
            .collect();
        Ok((average(grads, world), trailers))
    }

    /// Checks the fingerprints and the non-finite slots in the summed `trailers` and hands out the
    /// averaged gradients (`grads`, one tensor per bucket, covering the elements `windows` of
    /// it) some rank produced: an empty list when the step is skipped for non-finite gradients.
    fn unpack(
        &self,
        at: (usize, usize),
        grads: Vec<Tensor<1>>,
        windows: &[Range<usize>],
        trailers: &[f32],
    ) -> Result<Vec<Option<Tensor<1>>>> {
        let world = self.group.world_size();
        let fingerprint = if self.check { FINGERPRINT_LEN } else { 0 };
        let mut out = vec![None; self.params.len()];
        let mut culprits = Vec::new();
        let mut offset = 0;
        for (b, (grads, bucket)) in grads.into_iter().zip(&self.plan.buckets).enumerate() {
            let n = bucket.params.len();
            let trailer = &trailers[offset..offset + self.trailer_len(b)];
            offset += self.trailer_len(b);
            if self.check
                && let Err(reason) = self
                    .fingerprint(b, at)
                    .check(&trailer[n..n + fingerprint], world)
            {
                return Err(self.desync(at, b, reason));
            }
            culprits.extend(NonFinite::marked(&trailer[n + fingerprint..]));
            let window = &windows[b];
            for (k, (&p, &offset)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
                let n = self.params[p].numel();
                let inside = window.start <= offset && offset + n <= window.end;
                if trailer[k] > 0.0 && inside {
                    out[p] = Some(cut(&grads, offset - window.start, n));
                }
            }
        }
        if !culprits.is_empty() {
            culprits.sort_unstable();
            culprits.dedup();
            if let Some(e) = self.non_finite.decide(self.group.rank(), &culprits, at) {
                return Err(e);
            }
            // The step is skipped: no gradient at all (nothing of it, not even the gradients
            // of wrapped blocks, reaches the optimizer).
            return Ok(Vec::new());
        }
        Ok(out)
    }

    /// Stops the group for a desync found in bucket `b` at `at`: the error every rank reports.
    fn desync(&self, at: (usize, usize), b: usize, reason: impl std::fmt::Display) -> DdpError {
        let cause = self.group.abort(&reason);
        DdpError::Collective {
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
        }
    }
}

/// Summed buckets divided by the world size.
fn average(summed: Vec<Tensor<1>>, world: usize) -> Vec<Tensor<1>> {
    (summed.into_iter())
        .map(|sum| sum.mul_scalar(1.0 / world as f32))
        .collect()
}

/// A tensor's values on the host, as `f32`.
fn host_f32(t: Tensor<1>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DdpError::Tensor(format!("{e:?}")))
}

/// Takes every trainable parameter's gradient out of `grads` ([`RemoveGradients`]), checking that the
/// model has the `expected` number of trainable tensors; with the device of the first gradient
/// (or parameter), `None` when the model has no trainable parameter.
fn take_gradients<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    expected: usize,
) -> Result<(Vec<Option<Tensor<1>>>, Option<Device>)> {
    let mut take = RemoveGradients {
        grads,
        flat: Vec::with_capacity(expected),
        device: None,
    };
    crate::fsdp::replicated(|| model.visit(&mut take));
    if take.flat.len() != expected {
        return Err(DdpError::Disagreement(format!(
            "the model has {} trainable tensors, the bucket plan {expected}",
            take.flat.len(),
        )));
    }
    Ok((take.flat, take.device))
}

/// Takes every trainable parameter's gradient out of `grads`, flattened, in visit order.
struct RemoveGradients<'a> {
    grads: &'a mut GradientsParams,
    flat: Vec<Option<Tensor<1>>>,
    device: Option<Device>,
}

impl ModuleVisitor for RemoveGradients<'_> {
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
pub(super) struct RegisterGradients<'a> {
    pub grads: &'a mut GradientsParams,
    pub flat: std::vec::IntoIter<Option<Tensor<1>>>,
}

impl ModuleVisitor for RegisterGradients<'_> {
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
