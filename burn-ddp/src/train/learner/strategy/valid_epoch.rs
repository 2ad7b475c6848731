//! The validation pass of an epoch as a [`ValidEpoch`]: every rank evaluates its shard (of any
//! size: when the ranks hold different numbers of items, those that run out first take part in
//! the others' steps), and rank 0's metrics count each sample once.

use burn::data::dataloader::Progress;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerModel,
    SupervisedTrainingEventProcessor, ValidLoader,
};

use crate::error::Result;
use crate::train::learner::strategy::DdpStrategy;
use crate::train::learner::strategy::split::{SplitEnd, SplitItems, SplitPass};
use crate::train::learner::strategy::step::{Batch, StepResult};
use crate::train::report::metrics::GlobalItem;

/// One epoch's validation pass on this rank.
pub(super) struct ValidEpoch<'a> {
    strategy: &'a DdpStrategy,
    /// Each rank's number of validation items.
    items: &'a SplitItems,
}

impl<'a> ValidEpoch<'a> {
    /// The pass of `strategy` over a split whose ranks hold `items`.
    pub(super) fn new(strategy: &'a DdpStrategy, items: &'a SplitItems) -> Self {
        ValidEpoch { strategy, items }
    }

    /// Evaluates the model on `loader`, to the split's end or a stop.
    pub(super) fn run<M>(
        self,
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
        let device = self.strategy.device.clone().inner();
        let shape = (self.items.uneven(), self.items.total());
        let pass = SplitPass::new(self.strategy, &device, interrupter, shape);
        let step = |batch, _: &Progress, _| {
            Ok(StepResult::validation(match batch {
                Batch::Item(item) => Some(InferenceStep::step(&model, item)),
                Batch::Idle | Batch::End => None,
            }))
        };
        let mut process = |event| processor.process_valid(event);
        pass.run(loader, step, &mut process)
    }
}
