//! One epoch's passes: training (each step's gradients averaged across ranks, once per
//! optimizer step with gradient accumulation, buffers synchronised, checkpoints every n steps)
//! and validation (every rank on its shard, rank 0's metrics counting each sample once).

use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::optim::GradientsAccumulator;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerModel,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, ValidLoader,
};

use super::DdpStrategy;
use super::split::{Batch, SplitEnd, SplitItems};
use crate::error::Result;
use crate::train::buffers::PendingBuffers;
use crate::train::checkpoint::Position;
use crate::train::gather::GlobalItem;
use crate::train::telemetry::trace::{COMPUTE, Span};

impl DdpStrategy {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn train_epoch<M>(
        &self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        from: Position,
        (items, uneven): (&SplitItems, bool),
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
    pub(super) fn valid_epoch<M>(
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
}
