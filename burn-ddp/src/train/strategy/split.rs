//! One split (the training or the validation pass of an epoch): batches through a step
//! function, each step's output gathered to rank 0 while the next step computes, and the
//! ranks' pipelined vote on stopping after every step where it is possible.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, Progress};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::Device;
use burn::train::{EventProcessorError, Interrupter, LearnerEvent, TrainingItem};

use super::DdpStrategy;
use crate::collectives::ReduceOp;
use crate::error::{DdpError, Result};
use crate::train::gather::{GlobalItem, PendingItem};
use crate::train::stop::{StepVote, Stop, Voters};
use crate::train::telemetry::{self, StepStats};
use crate::wire::{Reader, Writer};

/// A step's output on its way to rank 0's event processor.
pub(super) struct Report<T> {
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

/// What one step produced: its output (`None` without a batch), the learning rate used,
/// whether the ranks may stop after it (false inside a gradient accumulation), and its
/// telemetry (an optimizer step's).
pub(super) type StepOutput<T> = (
    Option<T>,
    Option<ModuleLearningRate>,
    bool,
    Option<StepStats>,
);

/// What a step of a split works on.
pub(super) enum Batch<I> {
    /// This rank's next batch.
    Item(I),
    /// Uneven inputs: this rank's shard is exhausted, another rank's is not. The rank takes
    /// part in the step's collectives without data (zero gradients, no metrics item).
    Idle,
    /// Uneven inputs: every rank's shard is exhausted; finish what is pending (the last, partial
    /// gradient accumulation). The split ends after it.
    End,
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
        let all = self.group.all_gather(mine).wait()?;
        let per_rank = all
            .iter()
            .enumerate()
            .map(|(rank, b)| {
                let mut r = Reader::new(b);
                let n = r.u64().and_then(|n| r.finish().map(|()| n as usize));
                n.map_err(|_| {
                    DdpError::Disagreement(format!("rank {rank} sent a malformed item count"))
                })
            })
            .collect::<Result<_>>()?;
        Ok(SplitItems(per_rank))
    }

    /// Whether this rank has a batch in this step, told to every rank with the job's items
    /// processed so far: `None` once no rank has one (uneven inputs, PyTorch's `Join`).
    fn join(&self, has_batch: bool, processed: usize) -> Result<Option<usize>> {
        let mine = vec![f64::from(u8::from(has_batch)), processed as f64];
        let all = self.group.all_reduce(mine, ReduceOp::Sum).wait()?;
        Ok((all[0] > 0.0).then_some(all[1] as usize))
    }

    /// Runs one split: `step` turns a batch into its output (and the learning rate used); each
    /// output is gathered to rank 0 while the next step computes, then handed to `process`.
    /// After each step where stopping is possible the ranks vote (pipelined, see
    /// [`StepVote`]); the split ends early when they agree to stop.
    ///
    /// With `uneven`, ranks may hold different numbers of batches: every step starts with a
    /// tiny all-reduce saying which ranks still have one; a rank that ran out takes part in the
    /// steps as [`Batch::Idle`] until none has a batch, then all take a [`Batch::End`] step
    /// and the split ends together. `total` is the split's items over all ranks.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_split<I, T: GlobalItem>(
        &self,
        loader: &Arc<dyn DataLoader<I>>,
        device: &Device,
        first_iteration: usize,
        (uneven, total): (bool, usize),
        mut step: impl FnMut(Batch<I>, &Progress, usize) -> Result<StepOutput<T>>,
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
        let mut exhausted = false;
        loop {
            let item = if exhausted {
                None
            } else {
                status.activity(Some("loading a batch".into()));
                let item = iterator.next();
                status.activity(None);
                item
            };
            // A rank cannot skip a batch alone: its error ends training here, and the other
            // ranks learn of it from the collectives.
            let item = item.transpose().map_err(|e| DdpError::Data {
                rank: self.group.rank(),
                reason: e.to_string(),
            })?;
            exhausted = item.is_none();
            let own = iterator.progress();
            let progress = if uneven {
                let Some(processed) = self.join(item.is_some(), own.items_processed)? else {
                    step(Batch::End, &global(own, world), iteration)?;
                    break;
                };
                Progress {
                    items_processed: processed,
                    items_total: total,
                    unit: own.unit,
                }
            } else {
                global(own, world)
            };
            let batch = match item {
                Some(item) => Batch::Item(item),
                None if uneven => Batch::Idle,
                None => break,
            };
            iteration += 1;
            status.step(iteration);
            let (output, lr, boundary, stats) = step(batch, &progress, iteration)?;
            let report = Report {
                item: PendingItem::start(output, stats, &self.group)?,
                progress: progress.clone(),
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

    /// Completes a step's gather and, on rank 0, hands the global output to burn-train.
    fn report<T: GlobalItem>(
        &self,
        report: Report<T>,
        device: &Device,
        process: &mut impl FnMut(LearnerEvent<T>) -> std::result::Result<(), EventProcessorError>,
        interrupter: &Interrupter,
    ) -> Result<()> {
        let (item, stats) = report.item.finish(self.group.rank(), device)?;
        if let Some(item) = item {
            // The telemetry metrics find the step's figures by its iteration.
            if let Some(stats) = stats {
                telemetry::record(report.iteration, stats);
            }
            let event = TrainingItem::new(item, report.progress, Some(report.iteration), report.lr);
            interrupter.fail_on_error(process(LearnerEvent::ProcessedItem(event)));
        }
        Ok(())
    }
}
