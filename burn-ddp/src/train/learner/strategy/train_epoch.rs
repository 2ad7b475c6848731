//! The training pass of an epoch as a [`TrainEpoch`]: each step's gradients averaged across the
//! ranks (once per optimizer step with gradient accumulation), rank 0's buffers broadcast,
//! checkpoints every n optimizer steps.

use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    EventProcessorTraining, Interrupter, Learner, LearnerModel, SupervisedTrainingEventProcessor,
    TrainLoader, TrainStep,
};

use crate::error::Result;
use crate::train::learner::buffers::PendingBuffers;
use crate::train::learner::checkpoint::Position;
use crate::train::learner::strategy::DdpStrategy;
use crate::train::learner::strategy::split::{SplitEnd, SplitItems, SplitPass};
use crate::train::learner::strategy::step::{Batch, StepResult};
use crate::train::report::metrics::GlobalItem;
use crate::train::report::telemetry::StepStats;
use crate::train::report::telemetry::trace::{COMPUTE, Span};

/// One epoch's training pass on this rank, from `from` (a resumed epoch starts mid-way).
pub(super) struct TrainEpoch<'a, M: LearnerModel> {
    strategy: &'a DdpStrategy,
    events: &'a EventStoreClient,
    from: Position,
    /// Whether the ranks may hold different numbers of batches (join).
    uneven: bool,
    /// Batches per optimizer step, with gradient accumulation.
    accumulation: Option<usize>,
    accumulator: GradientsAccumulator<M>,
    /// Batches accumulated since the last optimizer step.
    micro: usize,
    /// Rank 0's buffers of the last optimizer step, on their way: applied before the next
    /// forward pass (PyTorch's timing), so their broadcast travels during the optimizer step
    /// and the loading of the next batch.
    buffers: Option<PendingBuffers>,
    /// Forward and backward time since the last optimizer step (accumulated micro-steps),
    /// less `exposed`.
    compute: f64,
    /// Of that time, the wait inside wrapped blocks ([`crate::fsdp`]) for their gathers and
    /// reductions: exposed communication.
    exposed: f64,
}

impl<'a, M> TrainEpoch<'a, M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalItem,
{
    /// The pass of `strategy` from `from`, with `accumulation` batches per optimizer step.
    pub(super) fn new(
        strategy: &'a DdpStrategy,
        events: &'a EventStoreClient,
        from: Position,
        uneven: bool,
        accumulation: Option<usize>,
    ) -> Self {
        TrainEpoch {
            strategy,
            events,
            from,
            uneven,
            accumulation,
            accumulator: GradientsAccumulator::new(),
            micro: 0,
            buffers: None,
            compute: 0.0,
            exposed: 0.0,
        }
    }

    /// Trains on `loader` (each rank's shard holds `items`) to the split's end or a stop.
    pub(super) fn run(
        mut self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        items: &SplitItems,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) -> Result<SplitEnd> {
        let strategy = self.strategy;
        let pass = SplitPass::new(
            strategy,
            &strategy.device,
            interrupter,
            (self.uneven, items.total()),
        )
        .after(self.from.batches);
        let mut process = |event| processor.process_train(event);
        let step =
            |batch, progress: &Progress, iteration| self.step(learner, batch, progress, iteration);
        let end = pass.run(loader, step, &mut process)?;
        if let Some(pending) = self.buffers.take() {
            pending.finish(learner.model())?;
        }
        Ok(end)
    }

    /// One step: forward and backward on the batch, and at an optimizer-step boundary the
    /// gradients averaged across the ranks and the optimizer step.
    fn step(
        &mut self,
        learner: &mut Learner<M>,
        batch: Batch<<M as TrainStep>::Input>,
        progress: &Progress,
        iteration: usize,
    ) -> Result<StepResult<<M as TrainStep>::Output>> {
        if let Some(pending) = self.buffers.take() {
            pending.finish(learner.model())?;
        }
        let end = matches!(batch, Batch::End);
        let (item, grads) = match batch {
            Batch::Item(item) => {
                let (started, blocks) = (Instant::now(), crate::fsdp::stats());
                let trace = self.strategy.trace.as_deref();
                let (out, waits) = match trace {
                    Some(_) => crate::fsdp::recording_waits(|| learner.train_step(item)),
                    None => (learner.train_step(item), Vec::new()),
                };
                let done = Instant::now();
                let waited = (crate::fsdp::stats() - blocks).exposed.as_secs_f64();
                self.exposed += waited;
                self.compute += ((done - started).as_secs_f64() - waited).max(0.0);
                if let Some(trace) = trace {
                    trace.span(Span::named("forward+backward"), COMPUTE, started, done);
                    // The waits inside wrapped blocks, within the pass.
                    for (what, from, to) in waits {
                        trace.span(Span::named(what.name()), COMPUTE, from, to);
                    }
                }
                (Some(out.item), Some(out.grads))
            }
            // A rank without a batch reduces zeros, and steps with the others.
            Batch::Idle | Batch::End => (None, None),
        };
        let grads = self.at_boundary(learner, grads, end, progress);
        let boundary = grads.is_some();
        let stats = match grads {
            Some(grads) => Some(self.optimizer_step(learner, grads, progress, iteration)?),
            None => None,
        };
        Ok(StepResult::training(
            item,
            learner.lr_current(),
            boundary,
            stats,
        ))
    }

    /// The gradients to reduce and step with now, if this step ends an optimizer step: every
    /// step without accumulation (but the `end` of uneven inputs), else every `k` batches and
    /// at the split's end.
    fn at_boundary(
        &mut self,
        learner: &Learner<M>,
        grads: Option<GradientsParams>,
        end: bool,
        progress: &Progress,
    ) -> Option<GradientsParams> {
        let Some(k) = self.accumulation else {
            return (!end).then(|| grads.unwrap_or_default());
        };
        if let Some(grads) = grads {
            self.accumulator.accumulate(&learner.model(), grads);
        }
        self.micro += usize::from(!end);
        // Every rank counts the same steps, so all agree on when to synchronise: with even
        // inputs each one's last batch is the split's; with uneven inputs the End step
        // flushes what is left.
        let last = if self.uneven {
            end && self.micro > 0
        } else {
            progress.is_completed()
        };
        (self.micro >= k || last).then(|| {
            self.micro = 0;
            self.accumulator.grads()
        })
    }

    /// Averages `grads` across the ranks, steps the optimizer, starts the buffers' broadcast,
    /// and writes a checkpoint when one is due.
    fn optimizer_step(
        &mut self,
        learner: &mut Learner<M>,
        grads: GradientsParams,
        progress: &Progress,
        iteration: usize,
    ) -> Result<StepStats> {
        let strategy = self.strategy;
        let trace = strategy.trace.as_deref();
        let model = learner.model();
        let at = (self.from.epoch, iteration);
        let (grads, mut stats) = strategy.reducer.reduce_traced(&model, grads, at, trace)?;
        stats.compute = std::mem::take(&mut self.compute);
        stats.exposed += std::mem::take(&mut self.exposed);
        self.buffers = strategy.buffers.start_step(&model);
        let stepping = Instant::now();
        learner.lr_step();
        learner.optimizer_step(grads);
        if let Some(trace) = trace {
            let span = Span::named("optimizer step");
            trace.span(span, COMPUTE, stepping, Instant::now());
        }
        // Sharded: the owners' updated parameters, for the parameters this rank does not own.
        if let Some(values) = strategy
            .reducer
            .share_updates(&learner.model(), trace, &mut stats)?
        {
            learner.optimizer_step(values);
        }
        // Optimizer steps of the epoch so far; the epoch's end has its own checkpoint.
        let steps = iteration / self.accumulation.unwrap_or(1);
        let every = strategy.checkpoints.as_ref().and_then(|c| c.every_steps);
        if every.is_some_and(|n| steps.is_multiple_of(n)) && !progress.is_completed() {
            let at = Position {
                epoch: self.from.epoch,
                batches: iteration,
                samples: self.from.samples + progress.items_processed,
                world_size: strategy.group.world_size(),
            };
            if let Some(pending) = self.buffers.take() {
                pending.finish(learner.model())?;
            }
            strategy.checkpoint(learner, at, self.events)?;
            strategy.group.status().step(iteration);
        }
        Ok(stats)
    }
}
