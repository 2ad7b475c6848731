//! The training loop of `DdpLearner`, plugged into burn-train as a custom
//! `SupervisedLearningStrategy`: every rank trains on its shard, gradients are averaged in
//! buckets (once per optimizer step, also with gradient accumulation), rank 0 alone reports
//! metrics (gathered from all ranks), writes checkpoints and decides early stopping.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::optim::GradientsAccumulator;
use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerModel, LearningCheckpointer, LearningResult, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, ValidLoader,
};

mod split;
mod state;

use split::{Batch, SplitEnd, SplitItems};

use super::buffers::{Buffers, PendingBuffers};
use super::checkpoint::{CheckpointConfig, Position};
use super::gather::GlobalItem;
use super::reducer::GradientReducer;
use super::sampler::DistributedSampler;
use super::stop::Stop;
use super::telemetry::trace::{COMPUTE, Span, Trace};
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
    pub samplers: Vec<DistributedSampler>,
    pub checkpoints: Option<CheckpointConfig>,
    pub failure: Arc<Mutex<Option<DdpError>>>,
    pub signals: StopSignals,
    pub buffers: Buffers,
    /// Whether ranks may hold different numbers of training batches (join).
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
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(error);
    }

    #[allow(clippy::too_many_arguments)]
    fn train_epoch<M>(
        &self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        from: Position,
        items: &SplitItems,
        accumulation: Option<usize>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        events: &EventStoreClient,
        interrupter: &Interrupter,
    ) -> Result<SplitEnd>
    where
        M: LearnerModel,
        <M as TrainStep>::Output: GlobalItem,
    {
        let mut accumulator = GradientsAccumulator::new();
        let mut micro = 0;
        let every = self.checkpoints.as_ref().and_then(|c| c.every_steps);
        let uneven = self.uneven;
        // Rank 0's buffers of the last optimizer step, on their way: applied before the next
        // forward pass (PyTorch's timing), so their broadcast travels during the optimizer
        // step and the loading of the next batch.
        let mut buffers: Option<PendingBuffers> = None;
        // Forward and backward time since the last optimizer step (accumulated micro-steps).
        let mut compute = 0.0;
        let trace = self.trace.as_deref();
        let mut step = |batch: Batch<_>, progress: &Progress, iteration: usize| {
            if let Some(pending) = buffers.take() {
                pending.finish(learner.model())?;
            }
            let end = matches!(batch, Batch::End);
            let (item, grads) = match batch {
                Batch::Item(item) => {
                    let started = Instant::now();
                    let out = learner.train_step(item);
                    let done = Instant::now();
                    compute += (done - started).as_secs_f64();
                    if let Some(trace) = trace {
                        trace.span(Span::named("forward+backward"), COMPUTE, started, done);
                    }
                    (Some(out.item), Some(out.grads))
                }
                // A rank without a batch reduces zeros, and steps with the others.
                Batch::Idle | Batch::End => (None, None),
            };
            let grads = match accumulation {
                Some(k) => {
                    if let Some(grads) = grads {
                        accumulator.accumulate(&learner.model(), grads);
                    }
                    micro += usize::from(!end);
                    // Every rank counts the same steps, so all agree on when to synchronise:
                    // with even inputs each one's last batch is the split's; with uneven
                    // inputs the End step flushes what is left.
                    let last = if uneven {
                        end && micro > 0
                    } else {
                        progress.is_completed()
                    };
                    (micro >= k || last).then(|| {
                        micro = 0;
                        accumulator.grads()
                    })
                }
                None if end => None,
                None => Some(grads.unwrap_or_default()),
            };
            let boundary = grads.is_some();
            let mut step_stats = None;
            if let Some(grads) = grads {
                let model = learner.model();
                let (grads, mut stats) =
                    self.reducer
                        .reduce_traced(&model, grads, (from.epoch, iteration), trace)?;
                stats.compute = std::mem::take(&mut compute);
                step_stats = Some(stats);
                buffers = self.buffers.start_step(&model);
                let stepping = Instant::now();
                learner.lr_step();
                learner.optimizer_step(grads);
                if let Some(trace) = trace {
                    trace.span(
                        Span::named("optimizer step"),
                        COMPUTE,
                        stepping,
                        Instant::now(),
                    );
                }
                // Optimizer steps of the epoch so far; the epoch's end has its own checkpoint.
                let steps = iteration / accumulation.unwrap_or(1);
                if every.is_some_and(|n| steps.is_multiple_of(n)) && !progress.is_completed() {
                    let at = Position {
                        epoch: from.epoch,
                        batches: iteration,
                        samples: from.samples + progress.items_processed,
                        world_size: self.group.world_size(),
                    };
                    if let Some(pending) = buffers.take() {
                        pending.finish(learner.model())?;
                    }
                    self.checkpoint(learner, at, events)?;
                    self.group.status().step(iteration);
                }
            }
            Ok((item, Some(learner.lr_current()), boundary, step_stats))
        };
        let process = |event| processor.process_train(event);
        let end = self.run_split(
            loader,
            &self.device,
            from.batches,
            (uneven, items.total()),
            &mut step,
            process,
            interrupter,
        )?;
        if let Some(pending) = buffers {
            pending.finish(learner.model())?;
        }
        Ok(end)
    }

    /// Validation: every rank evaluates its shard (of any size: when the ranks hold different
    /// numbers of items, those that run out first take part in the others' steps), and rank
    /// 0's metrics count each sample once.
    fn valid_epoch<M>(
        &self,
        learner: &Learner<M>,
        loader: &ValidLoader<M>,
        items: &SplitItems,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) -> Result<SplitEnd>
    where
        M: LearnerModel,
        <M as InferenceStep>::Output: GlobalItem,
    {
        let model = learner.model().valid();
        let step = |batch, _: &Progress, _| {
            let output = match batch {
                Batch::Item(item) => Some(InferenceStep::step(&model, item)),
                Batch::Idle | Batch::End => None,
            };
            Ok((output, None, true, None))
        };
        let process = |event| processor.process_valid(event);
        self.run_split(
            loader,
            &self.device.clone().inner(),
            0,
            (items.uneven(), items.total()),
            step,
            process,
            interrupter,
        )
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
            status.enter(Phase::Training, Some(epoch));
            let train_items = self.split_items(&train)?;
            if train_items.uneven() && !self.uneven && self.is_main() && epoch == start.epoch {
                log::warn!(
                    "the ranks hold different numbers of training items ({}): if their numbers \
                     of batches differ, training stops with a desync error; use a \
                     DistributedSampler, or DdpLearner::uneven_inputs(true)",
                    train_items.describe()
                );
            }
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
                &train_items,
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
            let valid_items = self.split_items(&valid)?;
            if self.is_main() {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: valid_items.total(),
                }));
            }
            let valid_end =
                self.valid_epoch(learner, &valid, &valid_items, processor, &interrupter)?;
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
