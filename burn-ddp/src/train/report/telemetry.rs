//! Telemetry: where a training step's time goes. Each rank measures its optimizer steps (the
//! forward and backward pass, packing the buckets, their communication and how much of it the
//! step waited for, the bytes sent); the figures travel to rank 0 with the step's metrics item
//! (no collective of their own), where they become burn-train metrics ([`DdpMetric`]: the TUI
//! and the progress lines show them), with the slowest rank and its lag behind the fastest.
//! Metric names avoid `/`: burn-train names its log files after them.
//! [`trace`] writes each rank's steps as a Chrome trace (`DdpLearner::profile`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use burn::tensor::TensorReadError;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes,
    NumericEntry, SerializedEntry,
};
use burn::train::{ClassificationOutput, RegressionOutput};

use crate::wire::{DecodeError, Reader, Writer};

pub(crate) mod trace;

/// One rank's figures for one optimizer step, in seconds and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// The forward and backward pass (the model's train step).
    pub compute: f64,
    /// Packing the gradient buckets.
    pub pack: f64,
    /// From the first bucket's all-reduce start to the last one's end.
    pub communication: f64,
    /// The part of `communication` the step waited for (not hidden behind packing).
    pub exposed: f64,
    /// Bytes sent into the gradients' reduction (all-reduces, or reduce-scatters when the
    /// gradients are sharded).
    pub bytes: f64,
    /// Sharded ([`Sharding`](crate::train::Sharding)): the updated parameters' all-gather after
    /// the optimizer step, from its first bucket's start to the last bucket's arrival (0
    /// unsharded).
    pub gather: f64,
    /// Sharded: bytes of the parameters' all-gather, every trainable value as each rank
    /// receives them (its own part included; 0 unsharded).
    pub gather_bytes: f64,
}

impl StepStats {
    pub(crate) fn encode(&self, w: &mut Writer) {
        let fields = [
            self.compute,
            self.pack,
            self.communication,
            self.exposed,
            self.bytes,
            self.gather,
            self.gather_bytes,
        ];
        for v in fields {
            w.f64(v);
        }
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<StepStats, DecodeError> {
        Ok(StepStats {
            compute: r.f64()?,
            pack: r.f64()?,
            communication: r.f64()?,
            exposed: r.f64()?,
            bytes: r.f64()?,
            gather: r.f64()?,
            gather_bytes: r.f64()?,
        })
    }
}

/// A step's figures over the job, as rank 0 sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JobStats {
    /// Rank 0's own figures.
    pub rank0: StepStats,
    /// Achieved bus bandwidth of rank 0's gradient all-reduces, bytes per second
    /// (`bytes / communication * 2(n-1)/n`, nccl-tests' definition).
    pub busbw: f64,
    /// The rank whose forward and backward pass took longest.
    pub slowest: usize,
    /// Its lag behind the fastest rank, in seconds.
    pub lag: f64,
}

impl JobStats {
    /// The job's figures from every rank's (`None`: a rank without a batch this step).
    pub(crate) fn combine(ranks: &[Option<StepStats>]) -> Option<JobStats> {
        let rank0 = ranks.first().copied().flatten()?;
        let present = || {
            ranks
                .iter()
                .enumerate()
                .filter_map(|(r, s)| Some((r, s.as_ref()?)))
        };
        let (slowest, max) = present().fold((0, f64::MIN), |(r0, m), (r, s)| {
            if s.compute > m {
                (r, s.compute)
            } else {
                (r0, m)
            }
        });
        let min = present().map(|(_, s)| s.compute).fold(f64::MAX, f64::min);
        let n = ranks.len() as f64;
        let busbw = if rank0.communication > 0.0 {
            rank0.bytes / rank0.communication * 2.0 * (n - 1.0) / n
        } else {
            0.0
        };
        Some(JobStats {
            rank0,
            busbw,
            slowest,
            lag: max - min,
        })
    }
}

/// A learner's figures of its last steps, by iteration, and the metrics that show them
/// ([`DdpMetric`]). burn-train's metrics run on its own worker thread, a few items behind, and
/// find a step's figures by the iteration their metadata carries. Each `DdpLearner` has its own
/// ([`DdpLearner::telemetry`](crate::train::DdpLearner::telemetry)), so learners that train at
/// once in one process never read each other's figures.
///
/// ```
/// # use burn::train::{LearnerModel, SupervisedTraining, TrainStep};
/// # use burn::train::metric::Adaptor;
/// use burn_ddp::train::{DdpLearner, StepInput};
/// # fn configure<M>(training: SupervisedTraining<M>, learner: &DdpLearner<M>) -> SupervisedTraining<M>
/// # where M: LearnerModel, <M as TrainStep>::Output: Adaptor<StepInput> {
/// let figures = learner.telemetry();
/// let training = training
///     .metric_train_numeric(figures.communication())
///     .metric_train_numeric(figures.exposed_communication())
///     .metric_train_numeric(figures.busbw())
///     .metric_train_numeric(figures.straggler_lag());
/// # training }
/// ```
#[derive(Clone, Default)]
pub struct Telemetry {
    recent: Arc<Mutex<VecDeque<(usize, JobStats)>>>,
    /// Whether this rank's optimizer state is to be counted at the end of training, and what it
    /// came to.
    optimizer_state: Arc<Mutex<(bool, Option<usize>)>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let steps = crate::sync::lock(&self.recent).len();
        f.debug_struct("Telemetry").field("steps", &steps).finish()
    }
}

/// Steps a [`Telemetry`] keeps (more than burn-train's worker falls behind).
const KEEP: usize = 256;

impl Telemetry {
    /// Records the figures of `iteration`'s step, before its item goes to burn-train.
    pub(crate) fn record(&self, iteration: usize, stats: JobStats) {
        let mut recent = crate::sync::lock(&self.recent);
        if recent.len() == KEEP {
            recent.pop_front();
        }
        recent.push_back((iteration, stats));
    }

    /// The job's figures of the last steps recorded (up to 256, oldest first; on rank 0 only,
    /// the rank that gathers them): for a summary after training.
    pub fn steps(&self) -> Vec<JobStats> {
        crate::sync::lock(&self.recent)
            .iter()
            .map(|(_, s)| *s)
            .collect()
    }

    /// Counts this rank's optimizer state when training ends (the bytes of its state tensors,
    /// read from the optimizer's record, which costs one checkpoint in memory), for
    /// [`Telemetry::optimizer_state_bytes`]: how much a sharded optimizer saves.
    pub fn count_optimizer_state(&self) {
        crate::sync::lock(&self.optimizer_state).0 = true;
    }

    /// This rank's optimizer-state bytes at the end of training, if counted
    /// ([`Telemetry::count_optimizer_state`]).
    pub fn optimizer_state_bytes(&self) -> Option<usize> {
        crate::sync::lock(&self.optimizer_state).1
    }

    /// Whether the optimizer state is to be counted.
    pub(crate) fn counts_optimizer_state(&self) -> bool {
        crate::sync::lock(&self.optimizer_state).0
    }

    /// Records the optimizer state counted.
    pub(crate) fn set_optimizer_state(&self, bytes: usize) {
        crate::sync::lock(&self.optimizer_state).1 = Some(bytes);
    }

    /// The figures recorded last for `iteration`.
    fn lookup(&self, iteration: Option<usize>) -> Option<JobStats> {
        let iteration = iteration?;
        let recent = crate::sync::lock(&self.recent);
        (recent.iter().rev())
            .find(|(i, _)| *i == iteration)
            .map(|(_, s)| *s)
    }

    fn metric(&self, figure: Figure, name: &str) -> DdpMetric {
        DdpMetric {
            figure,
            name: Arc::new(name.to_string()),
            state: NumericMetricState::default(),
            slowest: 0,
            telemetry: self.clone(),
        }
    }

    /// Milliseconds of rank 0's forward and backward pass.
    pub fn compute(&self) -> DdpMetric {
        self.metric(Figure::Compute, "Compute ms")
    }

    /// Milliseconds of rank 0's gradient communication (first bucket sent to last received).
    pub fn communication(&self) -> DdpMetric {
        self.metric(Figure::Communication, "Comm ms")
    }

    /// Milliseconds rank 0's step waited for communication (not hidden behind other work).
    pub fn exposed_communication(&self) -> DdpMetric {
        self.metric(Figure::Exposed, "Exposed comm ms")
    }

    /// Achieved bus bandwidth of the gradient all-reduces, GB/s.
    pub fn busbw(&self) -> DdpMetric {
        self.metric(Figure::Busbw, "Busbw GBps")
    }

    /// Milliseconds of rank 0's parameter all-gather after the optimizer step, when the
    /// optimizer is sharded (0 otherwise).
    pub fn parameter_gather(&self) -> DdpMetric {
        self.metric(Figure::Gather, "Param gather ms")
    }

    /// Milliseconds the slowest rank's forward and backward pass took beyond the fastest's
    /// (the display names the slowest rank).
    pub fn straggler_lag(&self) -> DdpMetric {
        self.metric(Figure::Lag, "Straggler lag ms")
    }
}

/// What a [`DdpMetric`] reads: nothing from the item itself (the figures come from the training
/// loop); implemented for burn-train's outputs. Implement `Adaptor<StepInput>` for your own
/// output type (`fn adapt(&self) -> StepInput { StepInput }`) to use the metrics with it.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepInput;

impl Adaptor<StepInput> for ClassificationOutput {
    fn adapt(&self) -> StepInput {
        StepInput
    }
}

impl Adaptor<StepInput> for RegressionOutput {
    fn adapt(&self) -> StepInput {
        StepInput
    }
}

/// Which figure a [`DdpMetric`] shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Figure {
    Compute,
    Communication,
    Exposed,
    Busbw,
    Gather,
    Lag,
}

/// A data-parallel figure of each training step as a burn-train metric (rank 0 shows it), made
/// by a learner's [`Telemetry`].
#[derive(Clone)]
pub struct DdpMetric {
    figure: Figure,
    name: MetricName,
    state: NumericMetricState,
    /// The slowest rank of the last step (for the display).
    slowest: usize,
    /// Where the learner records its steps' figures.
    telemetry: Telemetry,
}

impl DdpMetric {
    fn value(&self, s: &JobStats) -> f64 {
        match self.figure {
            Figure::Compute => s.rank0.compute * 1e3,
            Figure::Communication => s.rank0.communication * 1e3,
            Figure::Exposed => s.rank0.exposed * 1e3,
            Figure::Busbw => s.busbw / 1e9,
            Figure::Gather => s.rank0.gather * 1e3,
            Figure::Lag => s.lag * 1e3,
        }
    }

    fn format(&self) -> FormatOptions {
        let name = match self.figure {
            Figure::Lag => Arc::new(format!("{} (slowest rank {})", self.name, self.slowest)),
            _ => self.name.clone(),
        };
        FormatOptions::new(name).precision(3)
    }
}

impl Metric for DdpMetric {
    type Input = StepInput;

    fn update(
        &mut self,
        _: &StepInput,
        metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        // A step inside a gradient accumulation has no figures.
        if let Some(stats) = self.telemetry.lookup(metadata.iteration) {
            self.slowest = stats.slowest;
            self.state.update(self.value(&stats), 1);
        }
        Ok(self.state.compute_update(self.format()))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.state.compute_final(self.format()))
    }

    fn clear(&mut self) {
        self.state.reset()
    }

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: self.figure == Figure::Busbw,
        }
        .into()
    }
}

impl Numeric for DdpMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }

    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }

    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_travel_and_combine_into_the_straggler() {
        let s = |compute| StepStats {
            compute,
            pack: 0.001,
            communication: 0.004,
            exposed: 0.002,
            bytes: 4e6,
            gather: 0.003,
            gather_bytes: 2e6,
        };
        let a = s(0.010);
        let mut w = Writer::default();
        a.encode(&mut w);
        assert_eq!(StepStats::decode(&mut Reader::new(&w.buf)), Ok(a));
        assert!(StepStats::decode(&mut Reader::new(&[0; 8])).is_err());
        let job = JobStats::combine(&[Some(s(0.010)), None, Some(s(0.030)), Some(s(0.012))])
            .expect("rank 0 has figures");
        assert_eq!(job.slowest, 2);
        assert!((job.lag - 0.020).abs() < 1e-12);
        // 4 MB in 4 ms on 4 ranks: 1 GB/s algorithm bandwidth, 1.5 GB/s bus bandwidth.
        assert!((job.busbw - 1.5e9).abs() < 1.0, "{}", job.busbw);
        assert_eq!(JobStats::combine(&[None, Some(a)]), None);
    }

    #[test]
    fn each_learner_reads_its_own_figures() {
        let stats = |slowest| JobStats {
            rank0: StepStats::default(),
            busbw: 0.0,
            slowest,
            lag: 0.0,
        };
        let (one, two) = (Telemetry::default(), Telemetry::default());
        one.record(7, stats(1));
        two.record(7, stats(2));
        two.record(8, stats(3));
        assert_eq!(one.lookup(Some(7)).map(|s| s.slowest), Some(1));
        assert_eq!(two.lookup(Some(7)).map(|s| s.slowest), Some(2));
        assert_eq!(one.lookup(Some(8)), None);
        // A metric reads the telemetry that made it, clones included.
        let metric = two.straggler_lag().clone();
        assert_eq!(metric.telemetry.lookup(Some(8)).map(|s| s.slowest), Some(3));
        for i in 0..KEEP {
            one.record(100 + i, stats(4));
        }
        assert_eq!(
            one.lookup(Some(7)),
            None,
            "only the last {KEEP} steps are kept"
        );
    }
}
