//! The training loop of `DdpLearner`, plugged into burn-train as a custom
//! `SupervisedLearningStrategy`: every rank trains on its shard, gradients are averaged in
//! buckets (once per optimizer step, also with gradient accumulation), rank 0 alone reports
//! metrics (gathered from all ranks), writes checkpoints and decides early stopping.
//!
//! As burn-train's own `strategies/ddp/`, one type per file: the strategy here
//! ([`DdpStrategy`]), the epoch loop (`epochs.rs`), the training and validation passes of an
//! epoch (`train_epoch.rs`, `valid_epoch.rs`) over one split pass (`split.rs`), what a step
//! works on and produces (`step.rs`), the loaders' sharding (`loader_shards.rs`) and the training
//! state on disk (`state.rs`).

use std::sync::{Arc, Mutex};

use burn::tensor::Device;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    LearningResult, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, ValidLoader,
};

mod epochs;
mod loader_shards;
mod split;
mod state;
mod step;
mod train_epoch;
mod valid_epoch;

use self::epochs::EpochLoop;
use self::loader_shards::Split;
use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::signals::StopSignals;
use crate::train::learner::buffers::Buffers;
use crate::train::learner::checkpoint::burn_train::refuse_in_sharded_run;
use crate::train::learner::checkpoint::{CheckpointConfig, Position};
use crate::train::learner::sampler::DistributedSampler;
use crate::train::reducer::GradientReducer;
use crate::train::report::metrics::GlobalItem;
use crate::train::report::telemetry::Telemetry;
use crate::train::report::telemetry::trace::Trace;

/// The samplers registered for each split.
#[derive(Default)]
pub(crate) struct Samplers {
    /// The training split's.
    pub train: Vec<DistributedSampler>,
    /// The validation split's.
    pub valid: Vec<DistributedSampler>,
}

impl Samplers {
    /// Sets every sampler's epoch; the training samplers skip the `samples` the job consumed
    /// of a resumed epoch.
    pub(super) fn start_epoch(&self, epoch: usize, samples: usize) {
        for s in &self.train {
            s.resume(epoch, samples);
        }
        for s in &self.valid {
            s.set_epoch(epoch);
        }
    }
}

/// How the strategy feeds its ranks.
pub(crate) struct Feeding {
    /// The samplers registered for each split.
    pub samplers: Samplers,
    /// Whether splits without a sampler are sharded by slicing (see `shard.rs`).
    pub shard_loaders: bool,
    /// Whether ranks may hold different numbers of training batches (join), as configured.
    pub uneven: bool,
}

/// The custom strategy `DdpLearner` installs. Errors of collectives stop training on every
/// rank and are handed back through [`DdpStrategy::failure`].
pub(crate) struct DdpStrategy {
    /// First, so dropped first: its watchdog stands down before the group goes.
    pub(super) signals: StopSignals,
    pub(super) group: Arc<ProcessGroup>,
    pub(super) device: Device,
    pub(super) reducer: GradientReducer,
    pub(super) buffers: Buffers,
    pub(super) samplers: Samplers,
    pub(super) shard_loaders: bool,
    pub(super) uneven: bool,
    pub(super) checkpoints: Option<CheckpointConfig>,
    pub(super) failure: Arc<Mutex<Option<DdpError>>>,
    /// This rank's Chrome trace, if profiling.
    pub(super) trace: Option<Arc<Trace>>,
    /// Where rank 0 records each step's figures for the learner's metrics.
    pub(super) telemetry: Telemetry,
}

impl DdpStrategy {
    /// The strategy that trains on `device` with `reducer` and `buffers` over `group`, fed as
    /// `feeding` says, writing `checkpoints`, each step's figures to `telemetry` and (if
    /// profiling) its `trace`.
    pub(crate) fn new(
        (group, device): (Arc<ProcessGroup>, Device),
        (reducer, buffers): (GradientReducer, Buffers),
        feeding: Feeding,
        checkpoints: Option<CheckpointConfig>,
        (telemetry, trace): (Telemetry, Option<Arc<Trace>>),
    ) -> Result<Self> {
        Ok(DdpStrategy {
            signals: StopSignals::arm_for(&group)?,
            group,
            device,
            reducer,
            buffers,
            samplers: feeding.samplers,
            shard_loaders: feeding.shard_loaders,
            uneven: feeding.uneven,
            checkpoints,
            failure: Arc::new(Mutex::new(None)),
            trace,
            telemetry,
        })
    }

    /// Where the first error that stopped training is kept (read after burn-train returns).
    pub(crate) fn failure(&self) -> Arc<Mutex<Option<DdpError>>> {
        self.failure.clone()
    }

    pub(super) fn is_main(&self) -> bool {
        self.group.rank() == 0
    }

    /// Writes this rank's trace so far, if profiling (a failure to write is logged: it does not
    /// stop training).
    pub(super) fn write_trace(&self) {
        if let Some(trace) = &self.trace
            && let Err(e) = trace.write()
        {
            log::warn!("rank {}: writing the trace: {e}", self.group.rank());
        }
    }

    /// Records the first failure and stops the loop. A stop by signal is not a failure: it is
    /// handed back as the outcome without an error in the log.
    pub(super) fn fail(&self, interrupter: &Interrupter, error: DdpError) {
        if matches!(error, DdpError::Stopped { .. }) {
            log::warn!("{error}");
            interrupter.stop(None);
        } else {
            log::error!("rank {}: {error}", self.group.rank());
            interrupter.stop(Some(&error.to_string()));
        }
        let mut slot = crate::sync::lock(&self.failure);
        slot.get_or_insert(error);
    }
}

impl<M> SupervisedLearningStrategy<M> for DdpStrategy
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalItem,
    <M as InferenceStep>::Output: GlobalItem,
{
    /// burn-train's default `train`, copied because it must differ in two ways: the start and
    /// end events (and so the renderer's output) are rank 0's only, and the summary cannot name
    /// the model (burn-train's `LearnerSummaryConfig::with_model` is `pub(crate)`).
    fn train(
        &self,
        mut learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        mut components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        let fresh = Position::start_of(components.checkpoint.unwrap_or(0) + 1, 0);
        // burn-train's checkpointer would save rank 0's share only of a sharded optimizer.
        let sharded = self.reducer.shards();
        let burn_checkpointer = components.checkpointer.is_some();
        let refused = refuse_in_sharded_run(&self.group, sharded, burn_checkpointer)
            .and_then(|()| self.refuse_checkpoints_of_blocks(&learner.model(), burn_checkpointer));
        // A checkpoint of this run, if configured and present, decides where training goes on.
        let start = refused.and_then(|()| self.resume(&mut learner).map(|p| p.unwrap_or(fresh)));
        let summary_config = components.summary.clone();
        let interrupter = components.interrupter.clone();
        if self.is_main() {
            let event = LearnerEvent::Start {
                total_epochs: components.num_epochs,
                starting_epoch: start.as_ref().map_or(fresh.epoch, |p| p.epoch),
                label: components.label.clone(),
            };
            interrupter.fail_on_error(components.event_processor.process_train(event));
        }
        let (model, mut processor) = self.fit_from(components, learner, train, valid, start);
        if self.is_main() {
            let summary = summary_config.and_then(|summary| summary.init().ok());
            interrupter.fail_on_error(processor.process_train(LearnerEvent::End(summary)));
            interrupter.fail_on_error(processor.flush());
        }
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let start = Position::start_of(starting_epoch, 0);
        self.fit_from(components, learner, train, valid, Ok(start))
    }
}

impl DdpStrategy {
    /// The epoch loop from `start` (or the error that prevents training).
    pub(super) fn fit_from<M>(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        start: Result<Position>,
    ) -> (M, SupervisedTrainingEventProcessor<M>)
    where
        M: LearnerModel,
        <M as TrainStep>::Output: GlobalItem,
        <M as InferenceStep>::Output: GlobalItem,
    {
        let mut epochs = EpochLoop::new(self, components);
        // SyncBatchNorm layers take their statistics over this group.
        let _scope = crate::nn::scope(self.group.clone());
        let outcome = start.and_then(|start| {
            let train = train.to_device(&self.device);
            let valid = valid.to_device(&self.device.clone().inner());
            // Before the first step: shard the splits without a sampler, agree on the counts.
            let plan = self.plan_loaders(
                (
                    train,
                    Split::new("training", &self.samplers.train, self.uneven),
                ),
                // Validation ranks may hold different numbers of batches: metrics count every
                // item once.
                (valid, Split::new("validation", &self.samplers.valid, true)),
            )?;
            learner.fork(&self.device);
            epochs.run(&mut learner, plan, start)
        });
        if let Err(e) = outcome {
            self.fail(epochs.interrupter(), e);
        }
        self.write_trace();
        (learner.model(), epochs.into_processor())
    }
}
