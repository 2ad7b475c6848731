//! `DdpLearner`: burn-train's `Learner`, data-parallel. Swap the type, launch with
//! [`DdpTraining::launch_ddp`], run one process per device (the whole program is on the
//! crate's front page).
//!
//! ```no_run
//! # use burn::optim::SgdConfig;
//! # use burn::train::{LearnerModel, LearningResult, SupervisedTraining, InferenceStep, TrainStep};
//! # use burn_ddp::train::{DdpLearner, DdpTraining, GlobalItem};
//! # fn train<M>(model: M, training: SupervisedTraining<M>) -> burn_ddp::Result<LearningResult<M>>
//! # where M: LearnerModel, <M as TrainStep>::Output: GlobalItem, <M as InferenceStep>::Output: GlobalItem {
//! let learner = DdpLearner::new(model, SgdConfig::new().init(), 0.1)?; // was: Learner::new
//! let result = training.launch_ddp(learner)?;                          // was: launch
//! # Ok(result) }
//! ```

mod buffers;
pub(crate) mod checkpoint;
mod sampler;
mod settings;
mod stop;
mod strategy;

pub use buffers::BufferSync;
pub use sampler::{DistributedDataset, DistributedSampler};

use std::fmt::Display;
use std::path::PathBuf;
use std::sync::Arc;

use burn::optim::ModuleOptimizer;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::train::{
    InferenceStep, Learner, LearnerModel, LearningResult, SupervisedTraining, TrainStep,
    TrainingStrategy,
};

use crate::error::{DdpError, Result};
use crate::status::Phase;
use crate::train::learner::buffers::Buffers;
use crate::train::learner::checkpoint::CheckpointConfig;
use crate::train::learner::sampler::SamplerRegistry;
use crate::train::learner::settings::SharedSettings;
use crate::train::learner::strategy::{DdpStrategy, Feeding, Samplers};
use crate::train::reducer::GradientReducer;
use crate::train::reducer::bucket::BucketConfig;
use crate::train::reducer::compression::Compression;
use crate::train::reducer::non_finite::NonFinite;
use crate::train::reducer::ownership::{Sharding, TakeOwners, take_owners_group};
use crate::train::reducer::params::{broadcast_module, check_agreement, layout};
use crate::train::report::metrics::GlobalItem;
use crate::train::report::progress::ProgressOutput;
use crate::train::report::quiet::QuietRenderer;
use crate::train::report::telemetry::Telemetry;
use crate::train::report::telemetry::trace::Trace;
use crate::{ProcessGroup, init_process_group};

/// A data-parallel learner: the model, optimizer and schedule of a burn `Learner`, plus the
/// process group they train in.
pub struct DdpLearner<M: LearnerModel> {
    model: M,
    optim: ModuleOptimizer,
    lr: ModuleLrScheduler,
    group: Arc<ProcessGroup>,
    samplers: Samplers,
    shared: SharedSettings,
    checkpoints: Option<CheckpointConfig>,
    progress: ProgressOutput,
    profile: Option<PathBuf>,
    telemetry: Telemetry,
}

impl<M: LearnerModel> DdpLearner<M> {
    /// Like `Learner::new`, in the process group described by the environment (a world of one
    /// when no launcher variables are set).
    pub fn new(model: M, optim: ModuleOptimizer, lr: impl Into<ModuleLrScheduler>) -> Result<Self> {
        Ok(Self::with_group(
            Arc::new(init_process_group()?),
            model,
            optim,
            lr,
        ))
    }

    /// Like `Learner::new`, in an existing group.
    pub fn with_group(
        group: Arc<ProcessGroup>,
        model: M,
        optim: ModuleOptimizer,
        lr: impl Into<ModuleLrScheduler>,
    ) -> Self {
        DdpLearner {
            model,
            optim,
            lr: lr.into(),
            group,
            samplers: Samplers::default(),
            shared: SharedSettings::default(),
            checkpoints: None,
            progress: ProgressOutput::default(),
            profile: None,
            telemetry: Telemetry::default(),
        }
    }

    /// The process group.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// This learner's [`Telemetry`]: the metrics that show where each training step's time
    /// goes (add them to burn-train's `SupervisedTraining` before launching).
    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }

    /// The training loader's [`DistributedSampler`], for PyTorch's exact semantics (a global
    /// reshuffle every epoch, padded equal shares): the learner advances its epoch and, when
    /// resuming, its position within the epoch, and does not shard the training loader itself.
    /// Without one, each rank trains on a contiguous slice of the loader (see
    /// [`DdpLearner::shard_loaders`]).
    pub fn sampler(mut self, sampler: &DistributedSampler) -> Self {
        self.samplers.train.push(sampler.clone());
        self
    }

    /// The validation loader's [`DistributedSampler`] (build it with `.pad(false)` so that
    /// every item is evaluated once): the learner sets its epoch and does not shard the
    /// validation loader itself.
    pub fn valid_sampler(mut self, sampler: &DistributedSampler) -> Self {
        self.samplers.valid.push(sampler.clone());
        self
    }

    /// Whether a training or validation loader without a registered sampler is sharded by the
    /// learner (default true): rank `r` of `n` takes items `[r * len / n, (r + 1) * len / n)`
    /// (burn's `DataLoader::slice`), so every item is on exactly one rank; the loader's own
    /// shuffle, if any, reorders within each rank's slice. Rank 0 logs what it did. With
    /// `false`, each rank's loaders are taken as its share already (sharded by your own code).
    pub fn shard_loaders(mut self, shard: bool) -> Self {
        self.shared.shard_loaders = shard;
        self
    }

    /// A training setting every rank must agree on (batch size, learning rate, seed...):
    /// compared across ranks before training; a mismatch stops every rank naming the field.
    pub fn setting(mut self, name: &str, value: impl Display) -> Self {
        self.shared.user.push((name.to_string(), value.to_string()));
        self
    }

    /// Checkpoints of the whole training state (rank 0 writes, all ranks agree), and resuming
    /// from one found in the directory. See [`CheckpointConfig`].
    pub fn checkpoints(mut self, config: CheckpointConfig) -> Self {
        self.checkpoints = Some(config);
        self
    }

    /// Whether every bucket's fingerprint is checked (default true: ranks reducing different
    /// steps or layouts stop with an error). Switch off only to measure the check's cost.
    pub fn desync_check(mut self, check: bool) -> Self {
        self.shared.desync_check = check;
        self
    }

    /// How rank 0 shows progress (default [`ProgressOutput::Auto`]: burn-train's TUI in a
    /// terminal with the `tui` feature, readable lines otherwise). Use
    /// [`ProgressOutput::Keep`] with your own `SupervisedTraining::renderer`.
    pub fn progress(mut self, output: ProgressOutput) -> Self {
        self.progress = output;
        self
    }

    /// How buffers (BatchNorm's running statistics, every float tensor without gradient) are
    /// kept identical across ranks: default [`BufferSync::Broadcast`], rank 0's at every step.
    pub fn buffer_sync(mut self, mode: BufferSync) -> Self {
        self.shared.buffer_sync = mode;
        self
    }

    /// Whether ranks may have different numbers of training batches (default false: every rank
    /// must have as many, as [`DistributedSampler`] gives them). With `true` (PyTorch's `Join`),
    /// a rank whose batches ran out keeps taking part in the others' steps with zero gradients
    /// until every rank is done, and applies the same optimizer steps, so the replicas stay
    /// identical; the epoch ends together. Gradients are averaged over the world size, as
    /// PyTorch does: in a step where only `k` of `n` ranks have a batch, the update is the sum
    /// of their gradients divided by `n`. Costs a tiny all-reduce per step.
    pub fn uneven_inputs(mut self, uneven: bool) -> Self {
        self.shared.uneven = uneven;
        self
    }

    /// The format gradient buckets travel in (default [`Compression::None`], `f32`):
    /// [`Compression::Bf16`] or [`Compression::Fp16`] halve the bytes sent (PyTorch's
    /// fp16/bf16 communication hooks). Gradients are averaged to the format's precision.
    pub fn compression(mut self, compression: Compression) -> Self {
        self.shared.compression = compression;
        self
    }

    /// Clips the averaged gradients by their global L2 norm, at most `max`, before each
    /// optimizer step (PyTorch's `clip_grad_norm_`): the norm over every trainable parameter of
    /// the model, the shards of wrapped blocks ([`crate::fsdp`]) and the parts other ranks own
    /// under ZeRO included, the same on every rank. burn's own `GradientClippingConfig::Norm`
    /// clips each tensor by its own norm (a wrapped block's shard by the shard's).
    pub fn clip_grad_norm(mut self, max: f32) -> Self {
        self.shared.clip_grad_norm = Some(max);
        self
    }

    /// What a NaN or an infinity in some rank's gradients comes to (default
    /// [`NonFinite::Stop`]: every rank stops with an error naming the rank(s), the epoch and the
    /// step, before the optimizer applies them). [`NonFinite::SkipStep`] skips the optimizer
    /// step instead (every rank alike); [`NonFinite::Propagate`] does not check, as PyTorch.
    pub fn non_finite(mut self, non_finite: NonFinite) -> Self {
        self.shared.non_finite = non_finite;
        self
    }

    /// Shards the optimizer's work across the ranks, as ZeRO does (default
    /// [`Sharding::None`]): each rank keeps the optimizer state of its own part of the
    /// parameters (about 1/N of it) and steps only those, and (with
    /// [`Sharding::OptimizerAndGradients`]) receives only their averaged gradients. The
    /// parameters stay identical on every rank after each step; checkpoints hold the whole
    /// optimizer state, so a run resumes at any world size, sharded or not. At a checkpoint the
    /// ranks send their state to rank 0 in pieces of at most `GroupOptions::max_gather_bytes`
    /// (and 16 MiB): rank 0 holds the whole state while it writes, the other ranks their own
    /// share and one piece. burn-train's own checkpointer
    /// (`SupervisedTraining::with_default_checkpointers`) would save rank 0's share only: with
    /// sharding it is refused before training; use [`DdpLearner::checkpoints`].
    pub fn shard_optimizer(mut self, sharding: Sharding) -> Self {
        self.shared.sharding = sharding;
        self
    }

    /// Every rank writes a Chrome trace of its training steps to `dir/rank-<r>.json` (open it
    /// in Perfetto or chrome://tracing): the forward and backward pass, each bucket's pack,
    /// all-reduce and the unpack, the optimizer step. Written at each epoch's end.
    pub fn profile(mut self, dir: impl Into<PathBuf>) -> Self {
        self.profile = Some(dir.into());
        self
    }

    /// Bucket sizes (default 25 MiB, first bucket 1 MiB; every rank must choose the same, as
    /// they decide the buckets and, sharded, which rank owns which parameter: compared before
    /// training with the other settings).
    pub fn buckets(mut self, config: BucketConfig) -> Self {
        self.shared.buckets = config;
        self
    }

    /// Checks agreement across ranks, broadcasts rank 0's parameters, and builds the burn
    /// `Learner` and the strategy that trains it.
    pub(crate) fn prepare(self) -> Result<(Learner<M>, DdpStrategy)> {
        self.check_samplers()?;
        // On the autodiff device, parameters report whether they are trained.
        let device = self
            .model
            .devices()
            .first()
            .cloned()
            .unwrap_or_default()
            .autodiff();
        let model = self.model.fork(&device);
        self.group.status().enter(Phase::Starting, None);
        let shared = &self.shared;
        check_agreement(&self.group, &layout(&model), &shared.entries())?;
        let model = broadcast_module(model, &self.group)?;
        let reducer = GradientReducer::new(&model, self.group.clone(), shared.buckets)?
            .desync_check(shared.desync_check)
            .compression(shared.compression)
            .non_finite(shared.non_finite)
            .sharding(shared.sharding);
        let reducer = match shared.clip_grad_norm {
            Some(max) => reducer.clip_grad_norm(max),
            None => reducer,
        };
        reducer.log_ownership();
        // The parameters another rank owns take the values their owner sends.
        let optim = match reducer.not_owned_paths() {
            Some(paths) if !paths.is_empty() => {
                (self.optim).with_group(take_owners_group(&paths), TakeOwners, None)
            }
            _ => self.optim,
        };
        let buffers = Buffers::new(shared.buffer_sync, self.group.clone(), &model);
        let trace = match &self.profile {
            Some(dir) => Some(Arc::new(Trace::new(dir, self.group.rank()).map_err(
                |e| {
                    let what = format!("creating the trace directory {}", dir.display());
                    DdpError::io(what, e)
                },
            )?)),
            None => None,
        };
        let feeding = Feeding {
            samplers: self.samplers,
            shard_loaders: shared.shard_loaders,
            uneven: shared.uneven,
        };
        let strategy = DdpStrategy::new(
            (self.group, device),
            (reducer, buffers),
            feeding,
            self.checkpoints,
            (self.telemetry, trace),
        )?;
        Ok((Learner::new(model, optim, self.lr), strategy))
    }

    /// A sampler made for this group that wraps more datasets than the splits it is registered
    /// for (none, or only training while it also feeds validation): the learner would shard
    /// that loader a second time (by the sampler, then by slicing) and never set its epoch.
    fn check_samplers(&self) -> Result<()> {
        let registered = |s: &DistributedSampler| {
            let for_split = |list: &[DistributedSampler]| list.iter().any(|r| r.same_as(s));
            usize::from(for_split(&self.samplers.train))
                + usize::from(for_split(&self.samplers.valid))
        };
        let in_use = self.group.attachment::<SamplerRegistry>().in_use();
        if let Some((sampler, datasets)) = in_use.iter().find(|(s, n)| *n > registered(s)) {
            let splits = match registered(sampler) {
                0 => "is not registered with the DdpLearner",
                _ => "is registered for one split only",
            };
            return Err(DdpError::InvalidConfig(format!(
                "rank {}: a DistributedSampler of this group wraps {datasets} dataset(s) but \
                 {splits}, so the learner would shard a loader over it a second time and never \
                 set its epoch: register the training loader's sampler with .sampler(&s) and \
                 the validation loader's with .valid_sampler(&s) (one sampler may serve both), \
                 or build the loaders over the whole datasets and let DdpLearner shard them",
                self.group.rank()
            )));
        }
        Ok(())
    }
}

/// Launching burn-train's `SupervisedTraining` with a [`DdpLearner`].
pub trait DdpTraining<M: LearnerModel> {
    /// Trains on every rank. Rank 0 renders progress, logs, writes checkpoints and artifacts;
    /// the others stay quiet. A failed collective (dead rank, timeout, disagreement) is
    /// returned as an error on every rank.
    fn launch_ddp(self, learner: DdpLearner<M>) -> Result<LearningResult<M>>;
}

impl<M> DdpTraining<M> for SupervisedTraining<M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalItem,
    <M as InferenceStep>::Output: GlobalItem,
{
    fn launch_ddp(self, learner: DdpLearner<M>) -> Result<LearningResult<M>> {
        let rank = learner.group.rank();
        let progress = learner.progress;
        let (learner, strategy) = learner.prepare()?;
        let failure = strategy.failure();
        let training = if rank == 0 {
            match progress.renderer() {
                Some(renderer) => self.renderer(renderer),
                None => self,
            }
        } else {
            self.with_application_logger(None)
                .renderer(Box::new(QuietRenderer))
        };
        let result = training
            .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
            .launch(learner);
        match crate::sync::lock(&failure).take() {
            Some(e) => Err(e),
            None => Ok(result),
        }
    }
}
