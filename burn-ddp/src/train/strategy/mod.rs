//! The training loop of `DdpLearner`, plugged into burn-train as a custom
//! `SupervisedLearningStrategy`: every rank trains on its shard, gradients are averaged in
//! buckets (once per optimizer step, also with gradient accumulation), rank 0 alone reports
//! metrics (gathered from all ranks), writes checkpoints and decides early stopping.

use std::sync::{Arc, Mutex};

use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerModel, LearningCheckpointer, LearningResult, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, ValidLoader,
};

mod epoch;
mod split;
mod state;

use super::buffers::Buffers;
use super::checkpoint::{CheckpointConfig, Position};
use super::gather::GlobalItem;
use super::reducer::GradientReducer;
use super::sampler::DistributedSampler;
use super::shard::Split;
use super::stop::Stop;
use super::telemetry::trace::Trace;
use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::signals::StopSignals;
use crate::status::Phase;

/// The custom strategy `DdpLearner` installs. Errors of collectives stop training on every
/// rank and are handed back through `failure`.
pub(crate) struct DdpStrategy {
    pub group: Arc<ProcessGroup>,
    pub device: Device,
    pub reducer: GradientReducer,
    /// The training split's samplers.
    pub samplers: Vec<DistributedSampler>,
    /// The validation split's samplers.
    pub valid_samplers: Vec<DistributedSampler>,
    /// Whether splits without a sampler are sharded by slicing (see `shard.rs`).
    pub shard_loaders: bool,
    pub checkpoints: Option<CheckpointConfig>,
    pub failure: Arc<Mutex<Option<DdpError>>>,
    pub signals: StopSignals,
    pub buffers: Buffers,
    /// Whether ranks may hold different numbers of training batches (join), as configured.
    pub uneven: bool,
    /// This rank's Chrome trace, if profiling.
    pub trace: Option<Arc<Trace>>,
}

impl DdpStrategy {
    fn is_main(&self) -> bool {
        self.group.rank() == 0
    }

    /// Writes this rank's trace so far, if profiling (a failure to write is logged: it does not
    /// stop training).
    fn write_trace(&self) {
        if let Some(trace) = &self.trace
            && let Err(e) = trace.write()
        {
            log::warn!("rank {}: writing the trace: {e}", self.group.rank());
        }
    }

    /// Records the first failure and stops the loop. A stop by signal is not a failure: it is
    /// handed back as the outcome without an error in the log.
    fn fail(&self, interrupter: &Interrupter, error: DdpError) {
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

    fn run<M>(
        &self,
        loop_: &mut EpochLoop<M>,
        learner: &mut Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        start: Position,
    ) -> Result<()>
    where
        M: LearnerModel,
        <M as TrainStep>::Output: GlobalItem,
        <M as InferenceStep>::Output: GlobalItem,
    {
        let interrupter = loop_.interrupter.clone();
        let processor = &mut loop_.processor;
        let world = self.group.world_size();
        let train = train.to_device(&self.device);
        let valid = valid.to_device(&self.device.clone().inner());
        // Before the first step: shard the splits without a sampler, agree on the counts.
        let plan = self.plan_loaders(
            (train, Split::new("training", &self.samplers, self.uneven)),
            // Validation ranks may hold different numbers of batches: metrics count every
            // item once.
            (valid, Split::new("validation", &self.valid_samplers, true)),
        )?;
        learner.fork(&self.device);
        let status = self.group.status();
        for epoch in start.epoch..=loop_.num_epochs {
            let from = if epoch == start.epoch {
                start
            } else {
                Position {
                    epoch,
                    ..Position::default()
                }
            };
            for s in &self.samplers {
                s.resume(epoch, from.samples);
            }
            for s in &self.valid_samplers {
                s.set_epoch(epoch);
            }
            status.enter(Phase::Training, Some(epoch));
            let train = plan.train.resumed(from.samples);
            let valid = &plan.valid.loader;
            let train_items = self.split_items(&train)?;
            if self.is_main() {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: train_items.total(),
                }));
            }
            let end = self.train_epoch(
                learner,
                &train,
                from,
                (&train_items, plan.train_uneven),
                loop_.grad_accumulation,
                processor,
                &loop_.event_store,
                &interrupter,
            )?;
            if self.is_main() {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
            }
            match end.stop {
                Stop::Continue => {}
                Stop::Interrupted => break,
                Stop::Signal(signal) => {
                    // Mid-epoch: a checkpoint at this step; at the split's end: at the next
                    // epoch (this epoch's validation is skipped).
                    let at = match end.progress.filter(|p| !p.is_completed()) {
                        Some(progress) => Position {
                            epoch,
                            batches: end.iteration,
                            samples: from.samples + progress.items_processed,
                            world_size: world,
                        },
                        None => Position {
                            epoch: epoch + 1,
                            world_size: world,
                            ..Position::default()
                        },
                    };
                    return Err(self.stopped(learner, at, signal, &loop_.event_store));
                }
            }
            // Buffers agree (averaged, if so configured) before validation, and the replicas
            // are checked once per epoch.
            let model = learner.model();
            self.buffers.settle(&model)?;
            self.buffers
                .check_replicas(&model, &format!("in training epoch {epoch}"))?;
            self.write_trace();
            status.enter(Phase::Validation, Some(epoch));
            let valid_items = self.split_items(valid)?;
            if self.is_main() {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: valid_items.total(),
                }));
            }
            let valid_end =
                self.valid_epoch(learner, valid, &valid_items, processor, &interrupter)?;
            status.enter(Phase::Checkpointing, Some(epoch));
            let mut stop = false;
            if self.is_main() {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
                if loop_.checkpointer.is_some() || loop_.early_stopping.is_some() {
                    interrupter.fail_on_error(processor.flush());
                }
                if let Some(checkpointer) = &mut loop_.checkpointer {
                    checkpointer.checkpoint(learner, epoch, &loop_.event_store);
                }
                if let Some(early) = &mut loop_.early_stopping {
                    stop = early.should_stop(epoch, &loop_.event_store);
                }
                stop |= interrupter.should_stop();
            }
            let next = Position {
                epoch: epoch + 1,
                world_size: world,
                ..Position::default()
            };
            self.checkpoint(learner, next, &loop_.event_store)?;
            // Everyone waits for rank 0's checkpoint and follows the vote.
            match valid_end.stop.or(self.voters(&interrupter).agree(stop)?) {
                Stop::Continue => {}
                Stop::Interrupted => break,
                Stop::Signal(signal) => {
                    let checkpoint = self.checkpoints.as_ref().map(|c| c.path());
                    return Err(self.stopped_error(next, signal, checkpoint));
                }
            }
        }
        status.enter(Phase::Finished, None);
        Ok(())
    }
}

/// The parts of burn-train's `TrainingComponents` the epoch loop uses.
struct EpochLoop<M: LearnerModel> {
    num_epochs: usize,
    grad_accumulation: Option<usize>,
    interrupter: Interrupter,
    processor: SupervisedTrainingEventProcessor<M>,
    checkpointer: Option<LearningCheckpointer<M>>,
    early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    event_store: Arc<EventStoreClient>,
}

impl<M> SupervisedLearningStrategy<M> for DdpStrategy
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalItem,
    <M as InferenceStep>::Output: GlobalItem,
{
    /// burn-train's default, with the start and end events (and so the renderer's output) on
    /// rank 0 only.
    fn train(
        &self,
        learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        mut components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        let mut learner = learner;
        let fresh = Position {
            epoch: components.checkpoint.unwrap_or(0) + 1,
            ..Position::default()
        };
        // A checkpoint of this run, if configured and present, decides where training goes on.
        let start = self.resume(&mut learner).map(|p| p.unwrap_or(fresh));
        let starting_epoch = start.as_ref().map_or(fresh.epoch, |p| p.epoch);
        let summary_config = components.summary.clone();
        let interrupter = components.interrupter.clone();
        if self.is_main() {
            interrupter.fail_on_error(components.event_processor.process_train(
                LearnerEvent::Start {
                    total_epochs: components.num_epochs,
                    starting_epoch,
                    label: components.label.clone(),
                },
            ));
        }
        let (model, mut processor) = self.fit_from(components, learner, train, valid, start);
        if self.is_main() {
            // burn-train's summary names the model through a crate-private setter.
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
        let start = Position {
            epoch: starting_epoch,
            ..Position::default()
        };
        self.fit_from(components, learner, train, valid, Ok(start))
    }
}

impl DdpStrategy {
    /// The epoch loop from `start` (or the error that prevents training).
    fn fit_from<M>(
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
        let mut loop_ = EpochLoop {
            num_epochs: components.num_epochs,
            grad_accumulation: components.grad_accumulation,
            interrupter: components.interrupter,
            processor: components.event_processor,
            checkpointer: components.checkpointer,
            early_stopping: components.early_stopping,
            event_store: components.event_store,
        };
        // SyncBatchNorm layers take their statistics over this group.
        let _scope = crate::nn::scope(self.group.clone());
        let outcome =
            start.and_then(|start| self.run(&mut loop_, &mut learner, train, valid, start));
        if let Err(e) = outcome {
            self.fail(&loop_.interrupter, e);
        }
        self.write_trace();
        (learner.model(), loop_.processor)
    }
}
