//! The training loop of `DdpLearner`, plugged into burn-train as a custom
//! `SupervisedLearningStrategy`: every rank trains on its shard, gradients are averaged in
//! buckets (once per optimizer step, also with gradient accumulation), rank 0 alone reports
//! metrics (gathered from all ranks), writes checkpoints and decides early stopping.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::{DataLoader, Progress};
use burn::optim::GradientsAccumulator;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorError, EventProcessorTraining, InferenceStep,
    Interrupter, Learner, LearnerEvent, LearnerModel, LearningCheckpointer, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingItem, ValidLoader,
};

use super::checkpoint::{self, CheckpointConfig, Position, Snapshot};
use super::gather::{GlobalItem, PendingItem};
use super::reducer::GradientReducer;
use super::sampler::DistributedSampler;
use super::stop::{StepVote, Stop, Voters};
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
}

/// A step's output on its way to rank 0's event processor.
struct Report<T> {
    item: PendingItem<T>,
    progress: Progress,
    iteration: usize,
    lr: Option<ModuleLearningRate>,
}

/// How a split ended.
struct SplitEnd {
    /// What the ranks agreed at its end (or when they stopped it early).
    stop: Stop,
    /// The last iteration done.
    iteration: usize,
    /// This rank's progress after it.
    progress: Option<Progress>,
}

/// What one step produced: its output, the learning rate used, and whether the ranks may stop
/// after it (false inside a gradient accumulation).
type StepOutput<T> = (T, Option<ModuleLearningRate>, bool);

/// Scales a rank's progress to the whole job (all ranks process as many items).
fn global(progress: Progress, world: usize) -> Progress {
    Progress {
        items_processed: progress.items_processed * world,
        items_total: progress.items_total * world,
        unit: progress.unit,
    }
}

impl DdpStrategy {
    fn is_main(&self) -> bool {
        self.group.rank() == 0
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

    fn voters<'a>(&'a self, interrupter: &'a Interrupter) -> Voters<'a> {
        Voters {
            group: &self.group,
            interrupter,
            signals: &self.signals,
        }
    }

    /// Runs one split: `step` turns a batch into its output (and the learning rate used); each
    /// output is gathered to rank 0 while the next step computes, then handed to `process`.
    /// After each step where stopping is possible the ranks vote (pipelined, see
    /// [`StepVote`]); the split ends early when they agree to stop.
    fn run_split<I, T: GlobalItem>(
        &self,
        loader: &Arc<dyn DataLoader<I>>,
        device: &Device,
        first_iteration: usize,
        mut step: impl FnMut(I, &Progress, usize) -> Result<StepOutput<T>>,
        mut process: impl FnMut(LearnerEvent<T>) -> std::result::Result<(), EventProcessorError>,
        interrupter: &Interrupter,
    ) -> Result<SplitEnd> {
        let world = self.group.world_size();
        let mut iterator = loader.iter();
        let mut iteration = first_iteration;
        let mut pending: Option<Report<T>> = None;
        let status = self.group.status();
        let voters = self.voters(interrupter);
        let mut vote = StepVote::default();
        let mut last_progress = None;
        let mut stop = Stop::Continue;
        loop {
            status.activity(Some("loading a batch".into()));
            let Some(item) = iterator.next() else {
                status.activity(None);
                break;
            };
            status.activity(None);
            // A rank cannot skip a batch alone: its error ends training here, and the other
            // ranks learn of it from the collectives.
            let item = item.map_err(|e| DdpError::Data {
                rank: self.group.rank(),
                reason: e.to_string(),
            })?;
            iteration += 1;
            status.step(iteration);
            let progress = iterator.progress();
            let (output, lr, boundary) = step(item, &progress, iteration)?;
            let report = Report {
                item: PendingItem::start(output, &self.group)?,
                progress: global(progress.clone(), world),
                iteration,
                lr,
            };
            last_progress = Some(progress);
            if let Some(previous) = pending.replace(report) {
                self.report(previous, device, &mut process, interrupter)?;
            }
            if boundary {
                stop = vote.boundary(&voters)?;
                if stop.stops() {
                    break;
                }
            }
        }
        if let Some(last) = pending {
            self.report(last, device, &mut process, interrupter)?;
        }
        if !stop.stops() {
            stop = vote.finish(&voters)?;
        }
        Ok(SplitEnd {
            stop,
            iteration,
            progress: last_progress,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn train_epoch<M>(
        &self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        from: Position,
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
        let world = self.group.world_size();
        let every = self.checkpoints.as_ref().and_then(|c| c.every_steps);
        let step = |item, progress: &Progress, iteration: usize| {
            let out = learner.train_step(item);
            let grads = match accumulation {
                Some(k) => {
                    accumulator.accumulate(&learner.model(), out.grads);
                    micro += 1;
                    // Every rank has as many batches, so all agree on when to synchronise.
                    (micro >= k || progress.is_completed()).then(|| {
                        micro = 0;
                        accumulator.grads()
                    })
                }
                None => Some(out.grads),
            };
            let boundary = grads.is_some();
            if let Some(grads) = grads {
                let grads =
                    self.reducer
                        .reduce_at(&learner.model(), grads, from.epoch, iteration)?;
                learner.lr_step();
                learner.optimizer_step(grads);
                // Optimizer steps of the epoch so far; the epoch's end has its own checkpoint.
                let steps = iteration / accumulation.unwrap_or(1);
                if every.is_some_and(|n| steps.is_multiple_of(n)) && !progress.is_completed() {
                    let at = Position {
                        epoch: from.epoch,
                        batches: iteration,
                        samples: from.samples + progress.items_processed * world,
                        world_size: world,
                    };
                    self.checkpoint(learner, at, events)?;
                    self.group.status().step(iteration);
                }
            }
            Ok((out.item, Some(learner.lr_current()), boundary))
        };
        let process = |event| processor.process_train(event);
        self.run_split(
            loader,
            &self.device,
            from.batches,
            step,
            process,
            interrupter,
        )
    }

    fn valid_epoch<M>(
        &self,
        learner: &Learner<M>,
        loader: &ValidLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) -> Result<SplitEnd>
    where
        M: LearnerModel,
        <M as InferenceStep>::Output: GlobalItem,
    {
        let model = learner.model().valid();
        let step = |item, _: &Progress, _| Ok((InferenceStep::step(&model, item), None, true));
        let process = |event| processor.process_valid(event);
        self.run_split(
            loader,
            &self.device.clone().inner(),
            0,
            step,
            process,
            interrupter,
        )
    }

    /// Writes a checkpoint (rank 0) at `at`; every rank learns whether it worked.
    fn checkpoint<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        at: Position,
        events: &EventStoreClient,
    ) -> Result<()> {
        let Some(config) = &self.checkpoints else {
            return Ok(());
        };
        let status = self.group.status();
        let phase = status.current().phase;
        status.enter(Phase::Checkpointing, Some(at.epoch));
        if at.batches > 0 {
            status.step(at.batches);
        }
        let timeout = self.group.options().timeout;
        let snapshot = self
            .is_main()
            .then(|| Snapshot::take(learner, at, events, timeout));
        checkpoint::save(&self.group, config, snapshot)?;
        status.enter(phase, Some(at.epoch));
        Ok(())
    }

    /// After the ranks agreed to stop for `signal`: the checkpoint at `at` (if configured), and
    /// the error that ends training (or the checkpoint's failure).
    fn stopped<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        at: Position,
        signal: i32,
        events: &EventStoreClient,
    ) -> DdpError {
        match self.checkpoint(learner, at, events) {
            Ok(()) => {
                let path = self.checkpoints.as_ref().map(|c| c.path());
                self.stopped_error(at, signal, path)
            }
            Err(e) => e,
        }
    }

    fn stopped_error(
        &self,
        at: Position,
        signal: i32,
        checkpoint: Option<std::path::PathBuf>,
    ) -> DdpError {
        self.group.status().enter(Phase::Finished, None);
        DdpError::Stopped {
            rank: self.group.rank(),
            signal,
            epoch: at.epoch,
            step: at.batches,
            checkpoint,
        }
    }

    /// Loads the checkpoint, if configured and present: where to continue from.
    fn resume<M: LearnerModel>(&self, learner: &mut Learner<M>) -> Result<Option<Position>> {
        let Some(config) = &self.checkpoints else {
            return Ok(None);
        };
        self.group.status().enter(Phase::Resuming, None);
        let Some(snapshot) = checkpoint::load(&self.group, config)? else {
            return Ok(None);
        };
        snapshot
            .restore(learner)
            .map_err(|reason| DdpError::Checkpoint {
                rank: self.group.rank(),
                reason,
            })?;
        let p = snapshot.position;
        if self.is_main() {
            log::info!(
                "resuming from {}: epoch {}, after {} batches ({} samples) written by {} ranks",
                config.path().display(),
                p.epoch,
                p.batches,
                p.samples,
                p.world_size
            );
            if p.world_size != self.group.world_size() {
                log::warn!(
                    "the checkpoint was written by {} ranks, this job has {}: epoch {} continues \
                     with the samples not seen yet, and the global batch changes",
                    p.world_size,
                    self.group.world_size(),
                    p.epoch
                );
            }
        }
        Ok(Some(p))
    }

    /// Completes a step's gather and, on rank 0, hands the global output to burn-train.
    fn report<T: GlobalItem>(
        &self,
        report: Report<T>,
        device: &Device,
        process: &mut impl FnMut(LearnerEvent<T>) -> std::result::Result<(), EventProcessorError>,
        interrupter: &Interrupter,
    ) -> Result<()> {
        if let Some(item) = report.item.finish(self.group.rank(), device)? {
            let event = TrainingItem::new(item, report.progress, Some(report.iteration), report.lr);
            interrupter.fail_on_error(process(LearnerEvent::ProcessedItem(event)));
        }
        Ok(())
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
        let (train_items, valid_items) = (train.num_items() * world, valid.num_items() * world);
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
            if self.is_main() {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: train_items,
                }));
            }
            let end = self.train_epoch(
                learner,
                &train,
                from,
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
                            samples: from.samples + progress.items_processed * world,
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
            status.enter(Phase::Validation, Some(epoch));
            if self.is_main() {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: valid_items,
                }));
            }
            let valid_end = self.valid_epoch(learner, &valid, processor, &interrupter)?;
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
        let outcome =
            start.and_then(|start| self.run(&mut loop_, &mut learner, train, valid, start));
        if let Err(e) = outcome {
            self.fail(&loop_.interrupter, e);
        }
        (learner.model(), loop_.processor)
    }
}
