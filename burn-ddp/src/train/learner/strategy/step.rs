//! One step of a split: what it works on ([`Batch`]) and what it produced ([`StepResult`]).

use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;

use crate::train::report::telemetry::StepStats;

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

/// What one step produced.
pub(super) struct StepResult<T> {
    /// Its output for the metrics (`None` without a batch).
    output: Option<T>,
    /// The learning rate it used (training only).
    lr: Option<ModuleLearningRate>,
    /// Whether the ranks may stop after it: false inside a gradient accumulation.
    boundary: bool,
    /// An optimizer step's figures.
    stats: Option<StepStats>,
}

impl<T> StepResult<T> {
    /// A training step's result.
    pub(super) fn training(
        output: Option<T>,
        lr: ModuleLearningRate,
        boundary: bool,
        stats: Option<StepStats>,
    ) -> Self {
        StepResult {
            output,
            lr: Some(lr),
            boundary,
            stats,
        }
    }

    /// A validation step's result: every step is a boundary.
    pub(super) fn validation(output: Option<T>) -> Self {
        StepResult {
            output,
            lr: None,
            boundary: true,
            stats: None,
        }
    }

    /// Whether the ranks may stop after this step.
    pub(super) fn boundary(&self) -> bool {
        self.boundary
    }

    /// The output, the learning rate and the figures, for the report to rank 0.
    pub(super) fn into_parts(self) -> (Option<T>, Option<ModuleLearningRate>, Option<StepStats>) {
        (self.output, self.lr, self.stats)
    }
}
