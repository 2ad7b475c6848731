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

use super::gather::{GlobalItem, PendingItem};
use super::reducer::GradientReducer;
use super::sampler::DistributedSampler;
use crate::ProcessGroup;
use crate::error::{DdpError, Result};

/// The custom strategy `DdpLearner` installs. Errors of collectives stop training on every
/// rank and are handed back through `failure`.
pub(crate) struct DdpStrategy {
    pub group: Arc<ProcessGroup>,
    pub device: Device,
    pub reducer: GradientReducer,
    pub samplers: Vec<DistributedSampler>,
    pub failure: Arc<Mutex<Option<DdpError>>>,
}

/// A step's output on its way to rank 0's event processor.
struct Report<T> {
    item: PendingItem<T>,
    progress: Progress,
    iteration: usize,
    lr: Option<ModuleLearningRate>,
}

/// Steps between checks of rank 0's stop request (an interruption or error on rank 0 takes
/// effect within this many steps on every rank; each check is a small broadcast).
const STOP_CHECK_INTERVAL: usize = 16;

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

    /// Records the first failure and stops the loop.
    fn fail(&self, interrupter: &Interrupter, error: DdpError) {
        log::error!("rank {}: {error}", self.group.rank());
        interrupter.stop(Some(&error.to_string()));
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(error);
    }

    /// Rank 0's decision, on every rank (stop flags, early stopping).
    fn agree(&self, flag: bool) -> Result<bool> {
        Ok(self.group.broadcast(vec![flag as u8], 0).wait()?[0] != 0)
    }

    /// Runs one split: `step` turns a batch into its output (and the learning rate used); each
    /// output is gathered to rank 0 while the next step computes, then handed to `process`.
    fn run_split<I, T: GlobalItem>(
        &self,
        loader: &Arc<dyn DataLoader<I>>,
        device: &Device,
        mut step: impl FnMut(I, &Progress) -> Result<(T, Option<ModuleLearningRate>)>,
        mut process: impl FnMut(LearnerEvent<T>) -> std::result::Result<(), EventProcessorError>,
        interrupter: &Interrupter,
    ) -> Result<()> {
        let world = self.group.world_size();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        let mut pending: Option<Report<T>> = None;
        while let Some(item) = iterator.next() {
            // A rank cannot skip a batch alone: its error ends training here, and the other
            // ranks learn of it from the collectives.
            let item = item.map_err(|e| DdpError::Data {
                rank: self.group.rank(),
                reason: e.to_string(),
            })?;
            iteration += 1;
            let progress = iterator.progress();
            let (output, lr) = step(item, &progress)?;
            let report = Report {
                item: PendingItem::start(output, &self.group)?,
                progress: global(progress, world),
                iteration,
                lr,
            };
            if let Some(previous) = pending.replace(report) {
                self.report(previous, device, &mut process, interrupter)?;
            }
            if iteration % STOP_CHECK_INTERVAL == 0 && self.agree(interrupter.should_stop())? {
                break;
            }
        }
        if let Some(last) = pending {
            self.report(last, device, &mut process, interrupter)?;
        }
        Ok(())
    }

    fn train_epoch<M>(
        &self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        accumulation: Option<usize>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) -> Result<()>
    where
        M: LearnerModel,
        <M as TrainStep>::Output: GlobalItem,
    {
        let mut accumulator = GradientsAccumulator::new();
        let mut micro = 0;
        let step = |item, progress: &Progress| {
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
            if let Some(grads) = grads {
                let grads = self.reducer.reduce(&learner.model(), grads)?;
                learner.lr_step();
                learner.optimizer_step(grads);
            }
            Ok((out.item, Some(learner.lr_current())))
        };
        let process = |event| processor.process_train(event);
        self.run_split(loader, &self.device, step, process, interrupter)
    }

    fn valid_epoch<M>(
        &self,
        learner: &Learner<M>,
        loader: &ValidLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) -> Result<()>
    where
        M: LearnerModel,
        <M as InferenceStep>::Output: GlobalItem,
    {
        let model = learner.model().valid();
        let step = |item, _: &Progress| Ok((InferenceStep::step(&model, item), None));
        let process = |event| processor.process_valid(event);
        self.run_split(
            loader,
            &self.device.clone().inner(),
            step,
            process,
            interrupter,
        )
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
        starting_epoch: usize,
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
        for epoch in starting_epoch..=loop_.num_epochs {
            for s in &self.samplers {
                s.set_epoch(epoch);
            }
            if self.is_main() {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: train_items,
                }));
            }
            self.train_epoch(
                learner,
                &train,
                loop_.grad_accumulation,
                processor,
                &interrupter,
            )?;
            if self.is_main() {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
            }
            if self.agree(interrupter.should_stop())? {
                break;
            }
            if self.is_main() {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: valid_items,
                }));
            }
            self.valid_epoch(learner, &valid, processor, &interrupter)?;
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
            // Everyone waits for rank 0's checkpoint and follows its decision.
            if self.agree(stop)? {
                break;
            }
        }
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
        let starting_epoch = components.checkpoint.unwrap_or(0) + 1;
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
        let (model, mut processor) = self.fit(components, learner, train, valid, starting_epoch);
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
        mut learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let mut loop_ = EpochLoop {
            num_epochs: components.num_epochs,
            grad_accumulation: components.grad_accumulation,
            interrupter: components.interrupter,
            processor: components.event_processor,
            checkpointer: components.checkpointer,
            early_stopping: components.early_stopping,
            event_store: components.event_store,
        };
        if let Err(e) = self.run(&mut loop_, &mut learner, train, valid, starting_epoch) {
            self.fail(&loop_.interrupter, e);
        }
        (learner.model(), loop_.processor)
    }
}
