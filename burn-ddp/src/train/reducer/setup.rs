//! Building a [`GradientReducer`]: its bucket plan from the model's trainable parameters, and
//! the options every rank must choose alike (sharding, fingerprints, compression, the
//! non-finite check).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use burn::module::Module;

use super::GradientReducer;
use crate::ProcessGroup;
use crate::error::Result;
use crate::train::reducer::bucket::{BucketConfig, BucketPlan};
use crate::train::reducer::compression::Compression;
use crate::train::reducer::non_finite::NonFinite;
use crate::train::reducer::ownership::{Owners, Sharding};
use crate::train::reducer::params::{ParamInfo, layout};

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
            clip_norm: None,
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

    /// Clips the averaged gradients by their global L2 norm, at most `max` (PyTorch's
    /// `clip_grad_norm_` after backward): the norm over every trainable parameter, shards of
    /// wrapped blocks included, the same on every rank (one all-reduce of a number per step);
    /// above `max` every gradient is scaled by `max / norm`. Every rank must choose the same.
    pub fn clip_grad_norm(mut self, max: f32) -> Self {
        self.clip_norm = Some(max);
        self
    }

    /// What a NaN or an infinity in some rank's gradients comes to (default
    /// [`NonFinite::Stop`]; every rank must choose the same).
    pub fn non_finite(mut self, non_finite: NonFinite) -> Self {
        self.non_finite = non_finite;
        self
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
    #[cfg(feature = "test-support")]
    pub(crate) fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// The group gradients are averaged over.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }
}
