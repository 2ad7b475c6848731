//! One split (the training or the validation pass of an epoch) as a [`SplitPass`]: batches
//! through a step function, each step's output gathered to rank 0 while the next step
//! computes, and the ranks' pipelined vote on stopping after every step where it is possible.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::Device;
use burn::train::{EventProcessorError, Interrupter, LearnerEvent, TrainingItem};

use crate::collectives::ReduceOp;
use crate::error::{DdpError, Result};
use crate::train::learner::stop::{StepVote, Stop, Voters};
use crate::train::learner::strategy::DdpStrategy;
use crate::train::learner::strategy::loader_shards::Plan;
use crate::train::learner::strategy::step::{Batch, StepResult};
use crate::train::report::metrics::{GlobalItem, PendingItem};
use crate::wire::Writer;

/// A step's output on its way to rank 0's event processor.
struct Report<T> {
    item: PendingItem<T>,
    progress: Progress,
    iteration: usize,
    lr: Option<ModuleLearningRate>,
}

/// How a split ended.
pub(super) struct SplitEnd {
    /// What the ranks agreed at its end (or when they stopped it early).
    pub stop: Stop,
    /// The last iteration done.
    pub iteration: usize,
    /// The job's progress after it.
    pub progress: Option<Progress>,
}

/// Each rank's number of items in a split.
pub(super) struct SplitItems(Vec<usize>);

impl SplitItems {
    /// Items over all ranks.
    pub(super) fn total(&self) -> usize {
        self.0.iter().sum()
    }

    /// Whether the ranks hold different numbers of items (so, in general, of batches).
    pub(super) fn uneven(&self) -> bool {
        self.0.iter().any(|n| *n != self.0[0])
    }
}

/// Scales a rank's progress to the whole job (all ranks process as many items).
fn global(progress: Progress, world: usize) -> Progress {
    Progress {
        items_processed: progress.items_processed * world,
        items_total: progress.items_total * world,
        unit: progress.unit,
    }
}

impl DdpStrategy {
    pub(super) fn voters<'a>(&'a self, interrupter: &'a Interrupter) -> Voters<'a> {
        Voters {
            group: &self.group,
            interrupter,
            signals: &self.signals,
        }
    }

    /// Each rank's number of items in a split, in rank order (they may differ).
    pub(super) fn split_items<I>(&self, loader: &Arc<dyn DataLoader<I>>) -> Result<SplitItems> {
        let mine = Writer::default().u64(loader.num_items() as u64).buf.clone();
        let said = self.group.all_gather_object(mine)?;
        let per_rank = said.decode_each("an item count", |r| r.u64().map(|n| n as usize))?;
        Ok(SplitItems(per_rank))
    }

    /// Refuses a model with wrapped blocks ([`crate::fsdp`]) when the ranks hold different
    /// numbers of training or validation items: a rank without a batch in a step would skip
    /// the blocks' gathers the others wait in (PyTorch's `Join` has the same limit with FSDP).
    pub(super) fn refuse_uneven_blocks<M: Module, T, V>(
        &self,
        model: &M,
        plan: &Plan<T, V>,
    ) -> Result<()> {
        let Some(block) = crate::fsdp::first_block(model) else {
            return Ok(());
        };
        let splits = [
            ("training", self.split_items(&plan.train.loader)?),
            ("validation", self.split_items(&plan.valid.loader)?),
        ];
        for (split, items) in splits {
            if items.uneven() {
                return Err(DdpError::Fsdp {
                    rank: self.group.rank(),
                    block,
                    reason: format!(
                        "the ranks hold different numbers of {split} items ({:?}), so of \
                         {split} batches, and a rank without a batch would skip the gathers \
                         the others wait in: give every rank as many (a padding \
                         DistributedSampler)",
                        items.0
                    ),
                });
            }
        }
        Ok(())
    }

    /// Whether this rank has a batch in this step, told to every rank with the job's items
    /// processed so far: `None` once no rank has one (uneven inputs, PyTorch's `Join`).
    pub(super) fn join(&self, has_batch: bool, processed: usize) -> Result<Option<usize>> {
        let mine = vec![f64::from(u8::from(has_batch)), processed as f64];
        let all = self.group.all_reduce(mine, ReduceOp::Sum).wait()?;
        Ok((all[0] > 0.0).then_some(all[1] as usize))
    }
}

/// What the step function of a split sends to rank 0's event processor.
pub(super) type Process<'p, T> =
    dyn FnMut(LearnerEvent<T>) -> std::result::Result<(), EventProcessorError> + 'p;

/// One pass over a split's loader: every rank loads its batches and hands each to the step
/// function; with uneven inputs the ranks agree each step whether any still has a batch
/// (`Batch::Idle` for those that ran out, `Batch::End` once none has one).
pub(super) struct SplitPass<'a> {
    strategy: &'a DdpStrategy,
    device: &'a Device,
    interrupter: &'a Interrupter,
    /// Iterations done before this pass (a resumed epoch).
    first_iteration: usize,
    /// Whether the ranks may hold different numbers of batches (join).
    uneven: bool,
    /// The split's items over all ranks.
    total: usize,
}

/// The next batch of a pass, and the job's progress with it.
struct Next<I> {
    batch: Batch<I>,
    progress: Progress,
}

impl<'a> SplitPass<'a> {
    /// A pass of `strategy` whose outputs are gathered on `device`, over a split whose ranks
    /// hold `total` items (`uneven`: possibly in different numbers of batches).
    pub(super) fn new(
        strategy: &'a DdpStrategy,
        device: &'a Device,
        interrupter: &'a Interrupter,
        (uneven, total): (bool, usize),
    ) -> Self {
        SplitPass {
            strategy,
            device,
            interrupter,
            first_iteration: 0,
            uneven,
            total,
        }
    }

    /// Numbers the steps after the `done` iterations of an interrupted epoch.
    pub(super) fn after(mut self, done: usize) -> Self {
        self.first_iteration = done;
        self
    }

    /// Runs the pass: `step` turns each batch into its [`StepResult`]; each output is gathered
    /// to rank 0 while the next step computes, then handed to `process`. After each step where
    /// stopping is possible the ranks vote (pipelined, see [`StepVote`]); the pass ends early
    /// when they agree to stop. With uneven inputs, a rank that ran out takes part in the steps
    /// as [`Batch::Idle`] until none has a batch, then all take a [`Batch::End`] step and the
    /// pass ends together.
    pub(super) fn run<I, T: GlobalItem>(
        &self,
        loader: &Arc<dyn DataLoader<I>>,
        mut step: impl FnMut(Batch<I>, &Progress, usize) -> Result<StepResult<T>>,
        process: &mut Process<'_, T>,
    ) -> Result<SplitEnd> {
        let group = &self.strategy.group;
        let mut iterator = loader.iter();
        let mut iteration = self.first_iteration;
        let mut pending: Option<Report<T>> = None;
        let voters = self.strategy.voters(self.interrupter);
        let mut vote = StepVote::default();
        let mut last_progress = None;
        let mut stop = Stop::Continue;
        let mut exhausted = false;
        while let Some(Next { batch, progress }) = self.next(&mut *iterator, &mut exhausted)? {
            if matches!(batch, Batch::End) {
                step(batch, &progress, iteration)?;
                break;
            }
            iteration += 1;
            group.status().step(iteration);
            let result = step(batch, &progress, iteration)?;
            let boundary = result.boundary();
            let (output, lr, stats) = result.into_parts();
            let report = Report {
                item: PendingItem::start(output, stats, group)?,
                progress: progress.clone(),
                iteration,
                lr,
            };
            last_progress = Some(progress);
            if let Some(previous) = pending.replace(report) {
                self.report(previous, process)?;
            }
            if boundary {
                stop = vote.boundary(&voters)?;
                if stop.stops() {
                    break;
                }
            }
        }
        if let Some(last) = pending {
            self.report(last, process)?;
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

    /// This rank's next batch, or `None` once the pass is over. With uneven inputs the ranks
    /// agree on it (`Batch::End` once no rank has a batch left).
    fn next<I>(
        &self,
        iterator: &mut dyn DataLoaderIterator<I>,
        exhausted: &mut bool,
    ) -> Result<Option<Next<I>>> {
        let group = &self.strategy.group;
        let item = if *exhausted {
            None
        } else {
            group.status().activity(Some("loading a batch".into()));
            let item = iterator.next();
            group.status().activity(None);
            item
        };
        // A rank cannot skip a batch alone: its error ends training here, and the other
        // ranks learn of it from the collectives.
        let item = item.transpose().map_err(|e| DdpError::Data {
            rank: group.rank(),
            reason: e.to_string(),
        })?;
        *exhausted = item.is_none();
        let own = iterator.progress();
        let world = group.world_size();
        if !self.uneven {
            return Ok(item.map(|item| Next {
                batch: Batch::Item(item),
                progress: global(own, world),
            }));
        }
        let Some(processed) = self.strategy.join(item.is_some(), own.items_processed)? else {
            return Ok(Some(Next {
                batch: Batch::End,
                progress: global(own, world),
            }));
        };
        let progress = Progress {
            items_processed: processed,
            items_total: self.total,
            unit: own.unit,
        };
        let batch = item.map_or(Batch::Idle, Batch::Item);
        Ok(Some(Next { batch, progress }))
    }

    /// Completes a step's gather and, on rank 0, hands the global output to burn-train.
    fn report<T: GlobalItem>(&self, report: Report<T>, process: &mut Process<'_, T>) -> Result<()> {
        let rank = self.strategy.group.rank();
        let (item, stats) = report.item.finish(rank, self.device)?;
        if let Some(item) = item {
            // The telemetry metrics find the step's figures by its iteration.
            if let Some(stats) = stats {
                self.strategy.telemetry.record(report.iteration, stats);
            }
            let event = TrainingItem::new(item, report.progress, Some(report.iteration), report.lr);
            self.interrupter
                .fail_on_error(process(LearnerEvent::ProcessedItem(event)));
        }
        Ok(())
    }
}
