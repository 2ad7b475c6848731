//! One split (the training or the validation pass of an epoch): batches through a step
//! function, each step's output gathered to rank 0 while the next step computes, and the
//! ranks' pipelined vote on stopping after every step where it is possible.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, Progress};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::Device;
use burn::train::{EventProcessorError, Interrupter, LearnerEvent, TrainingItem};

use super::DdpStrategy;
use crate::error::{DdpError, Result};
use crate::train::gather::{GlobalItem, PendingItem};
use crate::train::stop::{StepVote, Stop, Voters};

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
    /// This rank's progress after it.
    pub progress: Option<Progress>,
}

/// What one step produced: its output, the learning rate used, and whether the ranks may stop
/// after it (false inside a gradient accumulation).
pub(super) type StepOutput<T> = (T, Option<ModuleLearningRate>, bool);

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

    /// Runs one split: `step` turns a batch into its output (and the learning rate used); each
    /// output is gathered to rank 0 while the next step computes, then handed to `process`.
    /// After each step where stopping is possible the ranks vote (pipelined, see
    /// [`StepVote`]); the split ends early when they agree to stop.
    pub(super) fn run_split<I, T: GlobalItem>(
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
}
