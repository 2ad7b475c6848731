//! The epoch loop as an [`EpochLoop`]: for each epoch the training pass, the buffers' and
//! replicas' checks, the validation pass, rank 0's checkpoint, early stopping and the ranks'
//! vote on going on; a stop by signal ends it with a checkpoint.

use std::sync::Arc;

use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerModel, LearningCheckpointer, SupervisedTrainingEventProcessor, TrainStep,
    TrainingComponents,
};

use crate::error::Result;
use crate::status::Phase;
use crate::train::learner::checkpoint::Position;
use crate::train::learner::stop::Stop;
use crate::train::learner::strategy::DdpStrategy;
use crate::train::learner::strategy::loader_shards::Plan;
use crate::train::learner::strategy::train_epoch::TrainEpoch;
use crate::train::learner::strategy::valid_epoch::ValidEpoch;
use crate::train::report::metrics::GlobalItem;

/// The parts of burn-train's `TrainingComponents` the epoch loop uses.
pub(super) struct EpochLoop<'a, M: LearnerModel> {
    strategy: &'a DdpStrategy,
    num_epochs: usize,
    grad_accumulation: Option<usize>,
    interrupter: Interrupter,
    processor: SupervisedTrainingEventProcessor<M>,
    checkpointer: Option<LearningCheckpointer<M>>,
    early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    events: Arc<EventStoreClient>,
}

/// Whether the loop goes on after a part of an epoch.
enum Flow {
    Next,
    Break,
}

impl<'a, M> EpochLoop<'a, M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalItem,
    <M as InferenceStep>::Output: GlobalItem,
{
    /// The loop of `strategy` with burn-train's `components`.
    pub(super) fn new(strategy: &'a DdpStrategy, components: TrainingComponents<M>) -> Self {
        EpochLoop {
            strategy,
            num_epochs: components.num_epochs,
            grad_accumulation: components.grad_accumulation,
            interrupter: components.interrupter,
            processor: components.event_processor,
            checkpointer: components.checkpointer,
            early_stopping: components.early_stopping,
            events: components.event_store,
        }
    }

    /// The interrupter the loop stops through.
    pub(super) fn interrupter(&self) -> &Interrupter {
        &self.interrupter
    }

    /// The event processor, handed back to burn-train at the end.
    pub(super) fn into_processor(self) -> SupervisedTrainingEventProcessor<M> {
        self.processor
    }

    /// Trains the epochs from `start` on the agreed loaders.
    pub(super) fn run(
        &mut self,
        learner: &mut Learner<M>,
        plan: Plan<<M as TrainStep>::Input, <M as InferenceStep>::Input>,
        start: Position,
    ) -> Result<()> {
        let status = self.strategy.group.status();
        self.strategy
            .refuse_uneven_blocks(&learner.model(), &plan)?;
        for epoch in start.epoch..=self.num_epochs {
            let from = if epoch == start.epoch {
                start
            } else {
                Position {
                    epoch,
                    ..Position::default()
                }
            };
            self.strategy.samplers.start_epoch(epoch, from.samples);
            if let Flow::Break = self.train(learner, &plan, from)? {
                break;
            }
            if let Flow::Break = self.validate(learner, &plan, epoch)? {
                break;
            }
        }
        self.strategy.count_optimizer_state(learner, &self.events);
        status.enter(Phase::Finished, None);
        Ok(())
    }

    /// The training pass of `from.epoch`, then the buffers' and replicas' checks.
    fn train(
        &mut self,
        learner: &mut Learner<M>,
        plan: &Plan<<M as TrainStep>::Input, <M as InferenceStep>::Input>,
        from: Position,
    ) -> Result<Flow> {
        let (strategy, epoch) = (self.strategy, from.epoch);
        strategy.group.status().enter(Phase::Training, Some(epoch));
        let train = plan.train.resumed(from.samples);
        let items = strategy.split_items(&train)?;
        self.on_main(|p| {
            p.process_train(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: items.total(),
            })
        });
        let pass = TrainEpoch::new(
            strategy,
            &self.events,
            from,
            plan.train_uneven,
            self.grad_accumulation,
        );
        let end = pass.run(
            learner,
            &train,
            &items,
            &mut self.processor,
            &self.interrupter,
        )?;
        self.on_main(|p| p.process_train(LearnerEvent::EndSplit(epoch)));
        match end.stop {
            Stop::Continue => {}
            Stop::Interrupted => return Ok(Flow::Break),
            Stop::Signal(signal) => {
                let world = strategy.group.world_size();
                // Mid-epoch: a checkpoint at this step; at the split's end: at the next epoch
                // (this epoch's validation is skipped).
                let at = match end.progress.filter(|p| !p.is_completed()) {
                    Some(progress) => Position {
                        epoch,
                        batches: end.iteration,
                        samples: from.samples + progress.items_processed,
                        world_size: world,
                    },
                    None => Position::start_of(epoch + 1, world),
                };
                return Err(strategy.stopped(learner, at, signal, &self.events));
            }
        }
        // Buffers agree (averaged, if so configured) before validation, and the replicas are
        // checked once per epoch.
        let model = learner.model();
        strategy.buffers.settle(&model)?;
        let when = format!("in training epoch {epoch}");
        strategy.buffers.check_replicas(&model, &when)?;
        strategy.write_trace();
        Ok(Flow::Next)
    }

    /// The validation pass of `epoch`, rank 0's epoch end (checkpointer, early stopping), the
    /// checkpoint, and the ranks' vote on going on.
    fn validate(
        &mut self,
        learner: &mut Learner<M>,
        plan: &Plan<<M as TrainStep>::Input, <M as InferenceStep>::Input>,
        epoch: usize,
    ) -> Result<Flow> {
        let strategy = self.strategy;
        let status = strategy.group.status();
        status.enter(Phase::Validation, Some(epoch));
        let valid = &plan.valid.loader;
        let items = strategy.split_items(valid)?;
        self.on_main(|p| {
            p.process_valid(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: items.total(),
            })
        });
        let pass = ValidEpoch::new(strategy, &items);
        let end = pass.run(learner, valid, &mut self.processor, &self.interrupter)?;
        status.enter(Phase::Checkpointing, Some(epoch));
        let stop = strategy.is_main() && self.end_epoch(learner, epoch);
        let next = Position::start_of(epoch + 1, strategy.group.world_size());
        strategy.checkpoint(learner, next, &self.events)?;
        // Everyone waits for rank 0's checkpoint and follows the vote.
        match end.stop.or(strategy.voters(&self.interrupter).agree(stop)?) {
            Stop::Continue => Ok(Flow::Next),
            Stop::Interrupted => Ok(Flow::Break),
            Stop::Signal(signal) => {
                let checkpoint = strategy.checkpoints.as_ref().map(|c| c.path());
                Err(strategy.stopped_error(next, signal, checkpoint))
            }
        }
    }

    /// Rank 0's end of an epoch: the events, burn-train's checkpointer and early stopping.
    /// Returns whether rank 0 votes to stop.
    fn end_epoch(&mut self, learner: &Learner<M>, epoch: usize) -> bool {
        let interrupter = &self.interrupter;
        interrupter.fail_on_error(self.processor.process_valid(LearnerEvent::EndSplit(epoch)));
        interrupter.fail_on_error(self.processor.process_train(LearnerEvent::EndEpoch(epoch)));
        if self.checkpointer.is_some() || self.early_stopping.is_some() {
            interrupter.fail_on_error(self.processor.flush());
        }
        if let Some(checkpointer) = &mut self.checkpointer {
            checkpointer.checkpoint(learner, epoch, &self.events);
        }
        let mut stop = false;
        if let Some(early) = &mut self.early_stopping {
            stop = early.should_stop(epoch, &self.events);
        }
        stop || interrupter.should_stop()
    }

    /// Hands an event to the processor on rank 0 (the only rank that reports).
    fn on_main(
        &mut self,
        event: impl FnOnce(
            &mut SupervisedTrainingEventProcessor<M>,
        ) -> std::result::Result<(), burn::train::EventProcessorError>,
    ) {
        if self.strategy.is_main() {
            self.interrupter.fail_on_error(event(&mut self.processor));
        }
    }
}
