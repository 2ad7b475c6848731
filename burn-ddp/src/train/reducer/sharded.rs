//! The reducer's sharded half (see [`crate::train::Sharding`]): after the optimizer step the
//! owners' updated parameters all-gathered, bucket by bucket, for every rank (timed and
//! counted in the step's figures, a span per bucket in the trace); what each rank owns; and
//! what a step sends. (The gradients' reduce-scatter is the reduction of `mod.rs`
//! with each bucket cut into its owners' parts.)

use std::collections::HashSet;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::collectives::backend::slices::{concat, cut};
use crate::error::{DdpError, Result};
use crate::train::reducer::GradientReducer;
use crate::train::reducer::RegisterGradients;
use crate::train::reducer::params::ParamInfo;
use crate::train::reducer::params::param_ids;
use crate::train::report::telemetry::StepStats;
use crate::train::report::telemetry::trace::{COMMUNICATION, COMPUTE, Span, Trace};

impl GradientReducer {
    /// After the optimizer stepped this rank's own parameters of `model`: every bucket's
    /// parameters all-gathered from their owners, as the values to give the parameters this
    /// rank does not own (by their ids, for [`crate::train::reducer::ownership::TakeOwners`]). `None`
    /// when the work is not sharded. Adds the all-gather's time and bytes to `stats`
    /// (`gather`, `gather_bytes`), and a span per bucket to `trace`.
    pub(crate) fn share_updates<M: Module>(
        &self,
        model: &M,
        trace: Option<&Trace>,
        stats: &mut StepStats,
    ) -> Result<Option<GradientsParams>> {
        let Some(owners) = &self.owners else {
            return Ok(None);
        };
        let started = Instant::now();
        let mut values = Values::default();
        crate::fsdp::replicated(|| model.visit(&mut values));
        let values = values.0;
        if values.len() != self.params.len() {
            return Err(DdpError::Disagreement(format!(
                "the model has {} trainable tensors, the bucket plan {}",
                values.len(),
                self.params.len()
            )));
        }
        // The owners' layout (each owner's part one range), whatever layout the gradients took.
        let buckets = &owners.plan.buckets;
        let mut pending = Vec::with_capacity(buckets.len());
        for (b, bucket) in buckets.iter().enumerate() {
            let mine: Vec<Tensor<1>> = (bucket.params.iter())
                .filter(|&&p| owners.owns(p))
                .map(|&p| values[p].clone())
                .collect();
            let like = &values[bucket.params[0]];
            stats.gather_bytes += (bucket.len * like.dtype().size()) as f64;
            let mine = concat(mine, &like.device(), like.dtype());
            let work = self.group.all_gather_parts(mine, &owners.parts[b]);
            pending.push((work, Instant::now()));
        }
        let first_sent = pending.first().map(|(_, sent)| *sent);
        let mut shared = vec![None; self.params.len()];
        let mut received = started;
        for (b, (bucket, (work, sent))) in buckets.iter().zip(pending).enumerate() {
            let all = work.wait();
            received = Instant::now();
            if let Some(trace) = trace {
                let span = Span::bucket("all-gather bucket", b);
                trace.span(span, COMMUNICATION, sent, received);
            }
            let all = all?;
            for (&p, &offset) in bucket.params.iter().zip(&bucket.offsets) {
                let numel = self.params[p].numel();
                if !owners.owns(p) {
                    shared[p] = Some(cut(&all, offset, numel));
                }
            }
        }
        stats.gather += first_sent.map_or(0.0, |t| (received - t).as_secs_f64());
        let mut out = GradientsParams::new();
        crate::fsdp::replicated(|| {
            model.visit(&mut RegisterGradients {
                grads: &mut out,
                flat: shared.into_iter(),
            })
        });
        if let Some(trace) = trace {
            let span = Span::named("share parameters");
            trace.span(span, COMPUTE, started, Instant::now());
        }
        Ok(Some(out))
    }

    /// Bytes each rank sends per step on a ring: an all-reduce sends `2 (n - 1) / n` of its
    /// buffer, a reduce-scatter and an all-gather `(n - 1) / n` each. With sharding, the
    /// gradients' reduction (an all-reduce, or a reduce-scatter with the flags and fingerprints
    /// in an all-reduce of their own) and the parameters' all-gather.
    pub fn sent_per_step(&self) -> f64 {
        let n = self.group.world_size() as f64;
        let share = (n - 1.0) / n;
        let per_value = self.compression.bytes_per_value();
        let grads: usize = self.plan.buckets.iter().map(|b| b.len * per_value).sum();
        let trailers: usize = (0..self.plan.buckets.len())
            .map(|b| self.trailer_len(b) * 4)
            .sum();
        let params: usize = self.plan.buckets.iter().map(|b| b.len * 4).sum();
        match (&self.owners, self.sharding) {
            (None, _) => 2.0 * share * (grads + trailers) as f64,
            (Some(_), crate::train::Sharding::OptimizerAndGradients) => {
                share * (grads + params) as f64 + 2.0 * share * trailers as f64
            }
            (Some(_), _) => 2.0 * share * (grads + trailers) as f64 + share * params as f64,
        }
    }

    /// Logs what this rank owns, when the work is sharded.
    pub(crate) fn log_ownership(&self) {
        let Some(owners) = &self.owners else {
            return;
        };
        let owned = (0..self.params.len()).filter(|&p| owners.owns(p));
        let tensors = owned.clone().count();
        let elements: usize = owned.map(|p| self.params[p].numel()).sum();
        let all: usize = self.params.iter().map(ParamInfo::numel).sum();
        log::info!(
            "rank {}: sharded ({}): steps and keeps optimizer state for {tensors} of {} \
             trainable tensors, {elements} of {all} values",
            owners.rank,
            self.sharding,
            self.params.len()
        );
    }

    /// Whether the work is sharded (on several ranks).
    pub(crate) fn shards(&self) -> bool {
        self.owners.is_some()
    }

    /// The `ParamId`s of the parameters of `model` this rank owns, when the work is sharded.
    pub(crate) fn owned_ids<M: Module>(&self, model: &M) -> Option<HashSet<u64>> {
        let owners = self.owners.as_ref()?;
        Some(
            (param_ids(model).into_iter().enumerate())
                .filter(|(p, _)| owners.owns(*p))
                .map(|(_, id)| id)
                .collect(),
        )
    }

    /// The module paths of the trainable parameters other ranks own, when the work is sharded
    /// on several ranks.
    pub(crate) fn not_owned_paths(&self) -> Option<Vec<String>> {
        let owners = self.owners.as_ref()?;
        Some(
            (self.params.iter().enumerate())
                .filter(|(p, _)| !owners.owns(*p))
                .map(|(_, info)| info.path.clone())
                .collect(),
        )
    }
}

/// Every trainable parameter's value, flattened, on its backend without autodiff, in visit
/// order.
#[derive(Default)]
struct Values(pub Vec<Tensor<1>>);

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        if t.is_require_grad() {
            let t = t.inner();
            let n = t.shape().num_elements();
            self.0.push(t.reshape([n]));
        }
    }
}
